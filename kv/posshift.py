"""Streaming positions (--pos-shift, StreamingLLM's): RoPE at each token's rank among the cached tokens.

Composed onto a policy by shifted(cls), as tiers are (kv.tiers.tiered): keys are stored before RoPE, slot_rank
[B, H_kv, C] holds each token's rank among the cached tokens (kept incrementally: an eviction lowers the rank of
every later token by one), and keys_values / rotate_query apply RoPE at those ranks, so the positions attention
sees never exceed the capacity and decoding can run past the model's max_seq_len. The model sees only the
contract's pos_shift (it leaves q and k unrotated) and rotate_query. Uniform layout only: a pool's heads hold
different counts, so a query would need a rank per KV head (kv.pool says no).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kv.slots import KVCache
from model import KVFastError, ModelArgs, apply_rope, rope_at

_RANK_TABLES: dict[tuple, tuple[Tensor, Tensor]] = {}


def rank_tables(capacity: int, args: ModelArgs, device: torch.device) -> tuple[Tensor, Tensor]:
    """RoPE cos / sin [capacity, D] for ranks 0..capacity-1, one copy shared by every layer of that capacity."""
    key = (capacity, args.head_dim, args.rope_base, repr(args.rope_scaling), str(device))
    if key not in _RANK_TABLES:
        _RANK_TABLES[key] = rope_at(torch.arange(capacity, device=device), args)
    return _RANK_TABLES[key]


class PosShift:
    """Mixed into a uniform-layout policy by shifted(cls): keys before RoPE, rotated at their ranks."""

    pos_shift = True
    channel_blocks = None  # RoPE at the ranks needs the values: no reading of codes in place

    def allocate(self, slots: tuple[int, ...]) -> None:
        super().allocate(slots)
        self.register_buffer("slot_rank", torch.full(slots, -1, dtype=torch.long, device=self.device),
                             persistent=False)
        # plain attributes, not buffers: one table serves every layer of this capacity
        self.rank_cos, self.rank_sin = rank_tables(self.capacity, self.model_args or ModelArgs(), self.device)

    def reset(self) -> None:
        super().reset()
        self.slot_rank.fill_(-1)

    def keys_values(self, attention: bool = False) -> tuple[Tensor, Tensor]:
        """stored_kv with the keys rotated to their ranks."""
        k, v = self.stored_kv(attention)
        k = k if k.dtype == torch.bfloat16 else k.to(self.dtype)  # float16 keys rotate in fp32, as stored_kv's
        rank = self.slot_rank.clamp(min=0)  # empty slots (-1) are masked anyway
        return apply_rope(k, self.rank_cos[rank], self.rank_sin[rank]), v

    def rotate_query(self, q: Tensor) -> Tensor:
        """RoPE for the new query q [B, H, 1, D] (stored unrotated) at its rank, the number of cached tokens
        before it, per KV head (every head of the uniform layout holds as many)."""
        rank = self.kept() - 1  # the new token is in the cache already: update() ran
        cos, sin = (t[rank].repeat_interleave(self.n_groups, dim=1).unsqueeze(2)
                    for t in (self.rank_cos, self.rank_sin))
        return apply_rope(q, cos, sin)

    def store_prompt(self, pos: Tensor, k: Tensor, v: Tensor) -> None:
        """The kept prompt tokens' keys unrotated (RoPE undone at their original positions), ranked by position."""
        cos, sin = rope_at(pos, self.model_args or ModelArgs())
        self.slot_rank.fill_(-1)
        self.slot_rank[:, :, : pos.shape[-1]] = pos.argsort(dim=-1).argsort(dim=-1)
        super().store_prompt(pos, apply_rope(k, cos, -sin), v)

    def insert(self, slot: Tensor, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, H = slot.shape
        self.shift_ranks(slot.view(B, H, 1))
        return super().insert(slot, input_pos, k, v)

    def shift_ranks(self, slot: Tensor) -> None:
        """Before the new token overwrites `slot` [B, H_kv, 1]: the tokens after its evicted token move down one
        rank, and the new token (the newest) takes the last rank."""
        pos = self.slot_pos
        victim = pos.gather(2, slot)  # -1: an empty slot, nothing evicted
        self.slot_rank.sub_(((pos > victim) & (victim >= 0)).long())
        self.slot_rank.scatter_(2, slot, (pos >= 0).sum(-1, keepdim=True) - (victim >= 0).long())

    def position_keys(self, k: Tensor, offset: int) -> Tensor:
        """kv.rows: keys stored before RoPE do not move with the row's offset."""
        return k

    def fill_synthetic(self, seq_len: int, generator: torch.Generator | None = None) -> None:
        super().fill_synthetic(seq_len, generator)
        slots = torch.arange(self.slot_pos.shape[-1], device=self.device)
        self.slot_rank.copy_(torch.where(self.slot_pos >= 0, slots, -1))  # filled in position order


_SHIFTED: dict[type, type] = {}


def shifted(cls: type[KVCache]) -> type[KVCache]:
    """The policy class with streaming positions (one class per policy, made once): Shifted<Policy>."""
    if not cls.supports_pos_shift:
        raise KVFastError(f"--pos-shift does not apply to --cache {cls.name}")
    if cls not in _SHIFTED:
        _SHIFTED[cls] = type(f"Shifted{cls.__name__}", (PosShift, cls),
                             {"__doc__": f"{cls.__doc__}\n\nWith streaming positions (--pos-shift)."})
    return _SHIFTED[cls]
