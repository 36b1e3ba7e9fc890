"""KV-cache policies: fixed slot buffers per layer, decode-time eviction, prompt compression.

Every layer owns one policy instance with buffers k, v: [B, H_kv, C, D] and slot_pos: [B, H_kv, C]
(the original position of the token in each slot, -1 = empty). Shapes never change, so the compiled
decode step never recompiles: eviction overwrites the lowest-scored slot in place.

A policy is a short subclass: it defines `slot_scores` (low = evicted first), optionally `observe`
(attention probabilities of the new query, when `needs_attention`), and its CLI parameters.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn as nn
from torch import Tensor

from model import KVFastError


class KVCache(nn.Module):
    """Shared slot mechanics. Subclasses set `name`, `slot_scores`, and optionally `observe`/`refresh`."""

    name: ClassVar[str] = ""
    needs_attention: ClassVar[bool] = False
    # CLI parameters this policy uses, with their defaults (the papers' values)
    params: ClassVar[dict[str, float | int | str]] = {}

    def __init__(self, batch_size: int, n_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", **params):
        super().__init__()
        unknown = set(params) - set(self.params)
        if unknown:
            raise KVFastError(f"cache policy {self.name!r} does not use {sorted(unknown)}")
        for key, default in self.params.items():
            setattr(self, key, params.get(key, default))
        self.capacity = capacity
        shape = (batch_size, n_kv_heads, capacity, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("slot_pos", torch.full(shape[:3], -1, dtype=torch.long, device=device),
                             persistent=False)

    def reset(self) -> None:
        """Empty the cache for a new sequence, reusing the buffers."""
        self.slot_pos.fill_(-1)

    # ---- prefill -------------------------------------------------------------------------------------
    def prefill(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        """Fill an empty cache with a prompt's K/V [B, H_kv, S, D] (q: [B, H, S, D], post-RoPE)."""
        S = k.shape[2]
        if S > self.capacity:
            raise KVFastError(f"prompt of {S} tokens does not fit the {self.name!r} cache of {self.capacity} slots")
        self.k[:, :, :S] = k
        self.v[:, :, :S] = v
        self.slot_pos[:, :, :S] = torch.arange(S, device=k.device)
        self.slot_pos[:, :, S:] = -1

    # ---- decode --------------------------------------------------------------------------------------
    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Write one token's K/V ([B, H_kv, 1, D]) at position input_pos ([1]); return all slots + mask."""
        slot = self.choose_slot(input_pos)  # [B, H_kv]
        B, H, _, D = k.shape
        index = slot.view(B, H, 1, 1).expand(B, H, 1, D)
        self.k.scatter_(2, index, k)
        self.v.scatter_(2, index, v)
        self.slot_pos.scatter_(2, slot.view(B, H, 1), input_pos.view(1, 1, 1).expand(B, H, 1))
        self.on_insert(slot)
        return self.k, self.v, (self.slot_pos >= 0).unsqueeze(2)

    def choose_slot(self, input_pos: Tensor) -> Tensor:
        """Per KV head, the slot the new token goes to: an empty one, else the lowest-scored evictable one."""
        return self.slot_scores(input_pos).argmin(dim=-1)

    def slot_scores(self, input_pos: Tensor) -> Tensor:
        raise NotImplementedError

    def on_insert(self, slot: Tensor) -> None:
        """Reset per-slot statistics of the slots just overwritten (policies with statistics override)."""

    def observe(self, probs: Tensor) -> None:
        """probs: [B, H_kv, g, 1, C] attention of the new query over all slots (only if needs_attention)."""

    def refresh(self) -> None:
        """Work done every `refresh_interval` steps by a separately compiled function (none by default)."""

    # ---- reporting -----------------------------------------------------------------------------------
    def physical_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def kept(self) -> Tensor:
        """Valid slots per (row, KV head)."""
        return (self.slot_pos >= 0).sum(-1)


class FullCache(KVCache):
    """No compression: capacity = prompt + new tokens; token t lives in slot t (gpt-fast's static cache)."""

    name = "full"

    def choose_slot(self, input_pos: Tensor) -> Tensor:
        B, H, _ = self.slot_pos.shape
        return input_pos.view(1, 1).expand(B, H)


POLICIES: dict[str, type[KVCache]] = {cls.name: cls for cls in (FullCache,)}


def resolve_capacity(budget: float | None, total_len: int) -> int:
    """--cache-budget: a fraction in (0, 1] of prompt + new tokens, or an absolute number of slots (> 1)."""
    if budget is None:
        return total_len
    if budget <= 0:
        raise KVFastError(f"--cache-budget must be > 0, got {budget}")
    if budget <= 1:
        return max(1, math.ceil(budget * total_len))
    if budget != int(budget):
        raise KVFastError(f"--cache-budget above 1 is a number of slots and must be whole, got {budget}")
    return min(int(budget), total_len)


def make_cache_factory(policy: str, batch_size: int, n_kv_heads: int, head_dim: int, total_len: int,
                       budget: float | None = None, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu", **params):
    """Return make_cache(layer_index) for Transformer.setup_caches, validating the policy and its flags."""
    if policy not in POLICIES:
        raise KVFastError(f"unknown cache policy {policy!r} (choose from {', '.join(POLICIES)})")
    cls = POLICIES[policy]
    capacity = total_len if cls is FullCache else resolve_capacity(budget, total_len)

    def make_cache(layer: int) -> KVCache:
        return cls(batch_size, n_kv_heads, head_dim, capacity, dtype=dtype, device=device, **params)

    return make_cache
