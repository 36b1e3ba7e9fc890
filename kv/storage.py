"""Slot storage: a layer's K/V buffers, their formats, and the one write every step makes.

Buffers (docs/design.md, "The cache contract"): k, v [*slots, D] and slot_pos [*slots], the original position of
the token in each slot (-1 = empty), where slots is [B, H_kv, C] in the uniform layout and [B, P] in the pool
(kv.pool). Shapes never change, so the compiled decode step never recompiles.

Formats. Plain: k and v in kv_dtype (the compute dtype, or float16 / bfloat16 with --kv-bits 16), read in the
compute dtype. With kv_bits (8 or 4), k and v hold uint8 codes ([*slots, D], or packed [*slots, D/2]) beside
fp32 k_scale / k_zero / v_scale / v_zero [*slots, D/group]: write_slots quantizes only the tokens it writes,
stored_kv dequantizes for attention (kv.quant), and a compiled CPU decode step reads the codes in place
(channel_blocks: attention.Codes). Policies see full-precision K at insert and prefill.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from attention import Codes
from kv.contract import AttentionCache
from kv.quant import dequantize_halves, dequantize_tokens, halves_share_groups, quantize_tokens, storage_width
from memory import zeros_on_huge_pages

INF = float("inf")


def put_rows(buffer: Tensor, slot: Tensor, value: Tensor) -> None:
    """buffer[..., slot[..., i], :] = value[..., i, :] for a buffer [*lead, C, *row] (slot [*lead, n], value
    [*lead, n, *row]), in place. Inductor writes just those rows; a scatter_ along the slot dimension became an
    out-of-place scatter plus a copy of the whole buffer back (every slot of K and V read and written, per layer
    and step: 15-20 % of an h2o step at 4096 tokens)."""
    lead = slot.shape[:-1]
    if buffer.is_contiguous():  # index_copy_ into the flattened rows
        C = buffer.shape[len(lead)]
        base = torch.arange(lead.numel(), device=slot.device).view(*lead, 1) * C
        buffer.view(lead.numel() * C, -1).index_copy_(0, (base + slot).flatten(), value.reshape(slot.numel(), -1))
    else:  # a strided view (eval's MultiCache members slice one buffer): advanced indexing, in place too
        index = [torch.arange(n, device=slot.device).view(*(n if i == d else 1 for i in range(len(lead))), 1)
                 for d, n in enumerate(lead)]
        buffer[(*index, slot)] = value


class SlotStorage(AttentionCache):
    """The buffers and their formats (see the module doc). KVCache (kv.slots) sets the shape attributes
    (batch_size, n_kv_heads, head_dim, capacity, device, dtype, kv_dtype, kv_bits, kv_group_size) and calls
    allocate()."""

    n_slots: int
    """The slot dimension's size: the capacity C (uniform), or the pool's P (kv.pool)."""

    def allocate(self, slots: tuple[int, ...]) -> None:
        """Register k, v (codes, scales and zero points when quantized) of shape [*slots, D], slot_pos [*slots]
        and row_start [B, 1, ...]."""
        device, D = self.device, self.head_dim
        self.n_slots = slots[-1]

        def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:  # a step streams them: 2 MB pages on CPU
            on_cpu = torch.device(device).type == "cpu"
            return zeros_on_huge_pages(shape, dtype) if on_cpu else torch.zeros(shape, dtype=dtype, device=device)

        if self.kv_bits:
            codes = (*slots, storage_width(D, self.kv_bits))
            groups = (*slots, D // self.kv_group_size)
            for name in ("k", "v"):
                self.register_buffer(name, zeros(codes, torch.uint8), persistent=False)
                for part in ("scale", "zero"):
                    self.register_buffer(f"{name}_{part}", zeros(groups, torch.float32), persistent=False)
        else:
            for name in ("k", "v"):
                self.register_buffer(name, zeros((*slots, D), self.kv_dtype), persistent=False)
        self.register_buffer("slot_pos", torch.full(slots, -1, dtype=torch.long, device=device),
                             persistent=False)
        # per row, the position of its first token: 0, except in a ragged batch (kv.rows), whose shorter prompts
        # start later on the batch's one clock; sinks count from there
        row_start = torch.zeros((slots[0],) + (1,) * (len(slots) - 1), dtype=torch.long, device=device)
        self.register_buffer("row_start", row_start, persistent=False)

    def kv_buffers(self) -> list[str]:
        """Names of the buffers that hold K/V (codes, scales and zero points when quantized)."""
        return ["k", "v"] if not self.kv_bits else ["k", "k_scale", "k_zero", "v", "v_scale", "v_zero"]

    def encode(self, k: Tensor, v: Tensor) -> list[Tensor]:
        """K/V [..., D] in the stored format, kv_buffers() order: quantized once if kv_bits."""
        if self.kv_bits:
            return [*quantize_tokens(k, self.kv_bits, self.kv_group_size),
                    *quantize_tokens(v, self.kv_bits, self.kv_group_size)]
        return [k.to(self.kv_dtype), v.to(self.kv_dtype)]

    def write_slots(self, slot: Tensor | None, k: Tensor, v: Tensor) -> None:
        """Store K/V [*lead, n, D] in slots `slot` [*lead, n] (None: the first n slots), lead being the slots'
        leading dims ([B, H_kv], a pool's [B])."""
        dim = self.slot_pos.dim() - 1
        for name, value in zip(self.kv_buffers(), self.encode(k, v)):
            buffer = getattr(self, name)
            if slot is None:
                buffer.narrow(dim, 0, value.shape[dim]).copy_(value)
            else:
                put_rows(buffer, slot, value)

    # ---- reading --------------------------------------------------------------------------------------------
    @property
    def fuse_one_query(self) -> bool:
        """May a compiled CPU decode step attend through attention.attend_one_query? Its fused reductions dequantize
        8-bit codes in place, and 4-bit ones as two halves of channels (channel_blocks); where those cannot be
        had, unpacking 4-bit codes into one tensor there costs 1.4x SDPA over the unpacked K/V (docs/speed.md)."""
        return self.kv_bits != 4 or self.channel_blocks is not None

    @property
    def channel_blocks(self) -> Callable[[], tuple[tuple, tuple]] | None:
        """What attention.attend_one_query reads instead of keys_values() (None: keys_values): quantized K/V whose
        blocks of channels each have one scale group per token as attention.Codes (8-bit: the whole head; 4-bit: the
        low and the high nibbles), read without dequantizing; other 4-bit groups that do not straddle the middle
        channel as the two halves, dequantized apart."""
        if not self.kv_bits:
            return None
        blocks = 1 if self.kv_bits == 8 else 2
        if self.kv_group_size in (self.head_dim, self.head_dim // blocks):
            return self.key_value_codes
        if self.kv_bits == 4 and halves_share_groups(self.head_dim, self.kv_group_size):
            return self.key_value_halves
        return None

    def key_value_codes(self) -> tuple[tuple[Codes, ...], tuple[Codes, ...]]:
        def blocks(codes: Tensor, scale: Tensor, zero: Tensor) -> tuple[Codes, ...]:
            if self.kv_bits == 8:
                return (Codes(codes, scale, zero),)
            if scale.shape[-1] == 1:  # one group for both halves: both nibbles in one pass
                return (Codes(codes, scale, zero, packed=True),)
            return (Codes(codes & 15, scale[..., :1], zero[..., :1]),
                    Codes(codes >> 4, scale[..., 1:], zero[..., 1:]))

        return (blocks(self.k, self.k_scale, self.k_zero), blocks(self.v, self.v_scale, self.v_zero))

    def key_value_halves(self) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        return (dequantize_halves(self.k, self.k_scale, self.k_zero, self.dtype),
                dequantize_halves(self.v, self.v_scale, self.v_zero, self.dtype))

    def stored_kv(self, attention: bool = False) -> tuple[Tensor, Tensor]:
        """Every slot's K and V [*slots, D] as stored, in the compute dtype (dequantized if kv_bits). attention:
        16-bit float K/V stay as stored, for attention.attend: bfloat16 to attend in bfloat16, float16 to be read in
        place (a compiled step's one-query kernel; elsewhere attend converts them, exactly)."""
        if not self.kv_bits:
            keep = attention and self.kv_dtype in (torch.bfloat16, torch.float16)
            return (self.k, self.v) if keep else (self.k.to(self.dtype), self.v.to(self.dtype))
        return (dequantize_tokens(self.k, self.k_scale, self.k_zero, self.kv_bits, self.dtype),
                dequantize_tokens(self.v, self.v_scale, self.v_zero, self.kv_bits, self.dtype))

    def keys_values(self, attention: bool = False) -> tuple[Tensor, Tensor]:
        """The K/V attention reads: stored_kv (kv.posshift rotates the keys to their ranks)."""
        return self.stored_kv(attention)

    def physical_bytes(self) -> int:
        """Bytes of the K/V buffers (what a full cache would hold for every token), scales and zero points of
        quantized K/V included."""
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in self.kv_buffers())
