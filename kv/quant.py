"""Quantized K/V storage (--kv-bits 8|4): per token, per group of channels, asymmetric min-max.

The plain per-token baseline (8b; FlexGen-style, what H2O and Scissorhands report as compatible): each
group of `group_size` channels of one token's key (or value) vector
gets its own scale and zero point, and codes in [0, 2^bits - 1]. Scale and zero point are fp32, not the
reference's fp16: with fp16 ones compiled decoding stored other codes than eager (most likely because
Inductor keeps fp32 where eager code rounds to fp16); fp32 costs 4 more bytes per group.
A token is quantized once, when it is written; reads dequantize. Nothing is ever re-quantized
(no dequantize-concatenate-requantize flush as in HF's QuantizedCache), so a stored token never drifts.

4-bit codes are packed two per byte: channel j in the low nibble, channel j + D/2 in the high one.

quantize_channels is KIVI's key layout (Liu et al., ICML 2024): one scale and zero point per channel over a
group of tokens, because keys have outlier channels that a per-token range spreads over every other channel.
The warm tier (kv.tiers) uses it for keys, a page being the group.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import cpu

KV_BITS = (8, 4)
KV_FLOATS = ("auto", "float16", "bfloat16")  # --kv-bits 16: which 16-bit float


def kv_float_dtype(choice: str, device: str | torch.device, verifies: bool = False) -> torch.dtype:
    """--kv-float: auto is float16 (llama.cpp's cache; a one-query step reads it within about 10 % of bfloat16's
    speed without rounding its attention, docs/speed.md), except for a speculative verification (verifies: K + 1 queries a step) on a CPU with
    bfloat16 dot products (kernels.cpu(): AVX512-BF16 or AMX tiles), where attention's bfloat16 products run 2.5x
    fp32's over a 4096-token cache (docs/speed.md) and bfloat16 is chosen."""
    if choice == "auto":
        fast = verifies and torch.device(device).type == "cpu" and cpu().bf16_dot
        return torch.bfloat16 if fast else torch.float16
    return getattr(torch, choice)


def kv_format(bits: int | None, kv_float: str = "auto", verifies: bool = False) -> tuple[dict, str]:
    """make_cache_factory's K/V keywords for --kv-bits `bits` (None: the compute dtype; 16: the --kv-float, auto
    resolved for this CPU and use) and the tables' name for it."""
    if bits is None:
        return {}, "fp32"
    if bits != 16:
        return {"kv_bits": bits}, f"{bits}-bit"
    name = str(kv_float_dtype(kv_float, "cpu", verifies)).removeprefix("torch.")
    return {"kv_bits": 16, "kv_float": name}, name


def storage_width(head_dim: int, bits: int) -> int:
    """Bytes per token and head in the code buffer."""
    return head_dim if bits == 8 else head_dim // 2


def quantize_tokens(x: Tensor, bits: int, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """x [..., D] -> codes uint8 [..., storage_width], scale and zero fp32 [..., D / group_size]."""
    *lead, D = x.shape
    groups = x.float().reshape(*lead, D // group_size, group_size)
    top = 2**bits - 1
    zero = groups.amin(-1)
    scale = ((groups.amax(-1) - zero) / top).clamp(min=1e-6)
    codes = ((groups - zero[..., None]) / scale[..., None]).round().clamp(0, top)
    return pack(codes.reshape(*lead, D), bits), scale, zero


def pack(codes: Tensor, bits: int) -> Tensor:
    """Float codes in [0, 2^bits - 1], [..., D] -> uint8 [..., storage_width]."""
    codes = codes.to(torch.uint8)
    if bits == 4:
        D = codes.shape[-1]
        codes = codes[..., : D // 2] | (codes[..., D // 2 :] << 4)
    return codes


def unpack(codes: Tensor, bits: int) -> Tensor:
    return torch.cat([codes & 15, codes >> 4], -1) if bits == 4 else codes


def halves_share_groups(head_dim: int, group_size: int) -> bool:
    """Can 4-bit codes be dequantized as their two halves of channels apart (dequantize_halves)? Yes when no
    scale group straddles the middle channel."""
    return group_size == head_dim or (head_dim // 2) % group_size == 0


def dequantize_halves(codes: Tensor, scale: Tensor, zero: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """4-bit token codes (quantize_tokens) -> channels [0, D/2) and [D/2, D), each [..., D/2] in `dtype`: the
    low and the high nibbles, so neither needs the other's bytes. dequantize_tokens concatenates them, which
    inside a fused reduction costs a select per element (a 4096-token attention 18x slower)."""
    n_groups = scale.shape[-1]
    halves = []
    for half, nibbles in enumerate((codes & 15, codes >> 4)):
        *lead, width = nibbles.shape
        if n_groups == 1:
            s, z = scale, zero
        else:
            s, z = (t[..., half * n_groups // 2 : (half + 1) * n_groups // 2] for t in (scale, zero))
        groups = nibbles.float().reshape(*lead, s.shape[-1], width // s.shape[-1])
        halves.append((groups * s[..., None] + z[..., None]).reshape(*lead, width).to(dtype))
    return halves[0], halves[1]


def quantize_channels(x: Tensor, bits: int, valid: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """x [..., T, D] -> codes uint8 [..., T, storage_width], scale and zero fp32 [..., 1, D]: per channel over
    the T tokens (those where valid [..., T] is True; the others get codes but do not widen the range)."""
    x = x.float()
    top = 2**bits - 1
    low, high = x, x
    if valid is not None:
        low = x.masked_fill(~valid.unsqueeze(-1), torch.inf)
        high = x.masked_fill(~valid.unsqueeze(-1), -torch.inf)
    zero = low.amin(-2, keepdim=True)
    zero = torch.where(zero.isfinite(), zero, 0.0)  # no valid token: any range will do
    scale = ((high.amax(-2, keepdim=True) - zero) / top).clamp(min=1e-6)
    codes = ((x - zero) / scale).round().clamp(0, top)
    return pack(codes, bits), scale, zero


def dequantize_channels(codes: Tensor, scale: Tensor, zero: Tensor, bits: int, dtype: torch.dtype) -> Tensor:
    """The inverse of quantize_channels: [..., T, D] in `dtype`."""
    return (unpack(codes, bits).float() * scale + zero).to(dtype)


def dequantize_tokens(codes: Tensor, scale: Tensor, zero: Tensor, bits: int, dtype: torch.dtype) -> Tensor:
    """The inverse of quantize_tokens: [..., D] in `dtype`."""
    codes = unpack(codes, bits)
    *lead, D = codes.shape
    n_groups = scale.shape[-1]
    groups = codes.float().reshape(*lead, n_groups, D // n_groups)  # fp32 math, one rounding to `dtype`
    return (groups * scale[..., None] + zero[..., None]).reshape(*lead, D).to(dtype)
