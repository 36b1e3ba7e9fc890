"""Quantized K/V storage (--kv-bits 8|4): per token, per group of channels, asymmetric min-max.

The plain per-token baseline of ../shared/reference/algorithms.md (8b; FlexGen-style, what H2O and
Scissorhands report as compatible): each group of `group_size` channels of one token's key (or value) vector
gets its own scale and zero point, and codes in [0, 2^bits - 1]. Scale and zero point are fp32, not the
reference's fp16: with fp16 ones compiled decoding stored other codes than eager (most likely because
Inductor keeps fp32 where eager code rounds to fp16); fp32 costs 4 more bytes per group.
A token is quantized once, when it is written; reads dequantize. Nothing is ever re-quantized
(no dequantize-concatenate-requantize flush as in HF's QuantizedCache), so a stored token never drifts.

4-bit codes are packed two per byte: channel j in the low nibble, channel j + D/2 in the high one.
"""

from __future__ import annotations

import torch
from torch import Tensor

KV_BITS = (8, 4)


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
    codes = codes.to(torch.uint8).reshape(*lead, D)
    if bits == 4:
        codes = codes[..., : D // 2] | (codes[..., D // 2 :] << 4)
    return codes, scale, zero


def dequantize_tokens(codes: Tensor, scale: Tensor, zero: Tensor, bits: int, dtype: torch.dtype) -> Tensor:
    """The inverse of quantize_tokens: [..., D] in `dtype`."""
    if bits == 4:
        codes = torch.cat([codes & 15, codes >> 4], -1)
    *lead, D = codes.shape
    n_groups = scale.shape[-1]
    groups = codes.float().reshape(*lead, n_groups, D // n_groups)  # fp32 math, one rounding to `dtype`
    return (groups * scale[..., None] + zero[..., None]).reshape(*lead, D).to(dtype)
