"""Speculation's hooks on a cache (speculate.py): forget rejected drafts, hand a cached token's K/V over.

Mixed into kv.slots.KVCache. Decoding a draft writes tokens that verification may reject; truncate() empties
their slots (they fill first). What the policy evicted to make room for them stays evicted: that only changes
later drafts, never the verified output (the full cache decides every token).
"""

from __future__ import annotations

from torch import Tensor

from kv.quant import dequantize_tokens


class Rollback:
    """truncate and token_kv over the slot storage (uniform layout: speculate.py verifies with the full cache)."""

    def truncate(self, length: int) -> None:
        """Forget every token at position >= length: their slots become empty and fill first."""
        self.slot_pos.masked_fill_(self.slot_pos >= length, -1)
        self.seen.fill_(length)

    def token_kv(self, input_pos: Tensor) -> tuple[Tensor, Tensor]:
        """K and V [B, H_kv, 1, D] of the cached token at position input_pos ([1]; every row and KV head must hold
        it), in the compute dtype (speculate.py hands the full cache's to the draft)."""
        slot = (self.slot_pos == input_pos).int().argmax(-1, keepdim=True).unsqueeze(-1)  # [B, H_kv, 1, 1]
        k, *rest = (b.gather(2, slot.expand(*slot.shape[:3], b.shape[-1]))
                    for b in (getattr(self, name) for name in self.kv_buffers()))
        if not self.kv_bits:
            return k.to(self.dtype), rest[0].to(self.dtype)
        k_scale, k_zero, v, v_scale, v_zero = rest
        return (dequantize_tokens(k, k_scale, k_zero, self.kv_bits, self.dtype),
                dequantize_tokens(v, v_scale, v_zero, self.kv_bits, self.dtype))
