"""eval.py's cache wrappers: record a prefill once, follow a full cache in its shadow, batch many policies.

Each wraps real policy caches from cache.py (no second cache implementation) behind the same interface the
model's attention calls: prefill / update / observe / refresh / reset.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class Recorder(nn.Module):
    """Stands in for a layer's cache during the one real prefill: keeps the post-RoPE q, k, v."""

    needs_attention = False

    def prefill(self, q: Tensor, k: Tensor, v: Tensor, memo: dict | None = None) -> None:
        self.q, self.k, self.v = q, k, v


class ShadowCaches(nn.Module):
    """Attention-loss probe for one layer: the model attends to a full cache; policy caches follow every step.

    Each follower receives the same tokens and the full attention restricted to its own slots (unnormalised, as
    in cold-compress's KVCacheAnalysis); its loss at step t is the attention mass on the tokens it evicted,
    1 - sum of the full attention over the tokens it still holds, averaged over heads."""

    needs_attention = True

    def __init__(self, full: nn.Module, followers: list[nn.Module], total_len: int):
        super().__init__()
        self.full, self.followers = full, nn.ModuleList(followers)
        self.refresh_interval = getattr(followers[0], "refresh_interval", None)
        B = full.k.shape[0]
        self.register_buffer("loss", torch.zeros(len(followers), B, total_len), persistent=False)
        self.register_buffer("pos", torch.zeros(1, dtype=torch.long), persistent=False)

    def reset(self) -> None:
        self.full.reset()
        for f in self.followers:
            f.reset()
        self.loss.zero_()

    def prefill(self, q: Tensor, k: Tensor, v: Tensor, memo: dict | None = None) -> None:
        self.full.prefill(q, k, v, memo=memo)
        for f in self.followers:
            f.prefill(q, k, v, memo=memo)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        self.pos.copy_(input_pos)
        for f in self.followers:
            f.update(input_pos, k, v)
        return self.full.update(input_pos, k, v)

    def observe(self, probs: Tensor) -> None:
        p = probs[:, :, :, 0]  # [B, H_kv, g, T]: slot j of the full cache holds position j
        B, H, g, _ = p.shape
        losses = []
        for f in self.followers:
            index = f.slot_pos.clamp(min=0).unsqueeze(2).expand(B, H, g, -1)
            kept = p.gather(-1, index) * (f.slot_pos >= 0).unsqueeze(2)
            losses.append(1 - kept.sum(-1).mean(dim=(1, 2)))
            if f.needs_attention:
                f.observe(kept.unsqueeze(3))
        self.loss.index_copy_(2, self.pos, torch.stack(losses).unsqueeze(-1))

    def refresh(self) -> None:
        for f in self.followers:
            f.refresh()


class MultiCache(nn.Module):
    """Several policies' caches for one layer, decoded as one batch: rows [i B, (i + 1) B) belong to member i.

    The members' k, v and slot_pos become views into shared buffers padded to the largest capacity (padding slots
    stay empty, hence masked), so one decode step reads the weights once for every policy and budget of the group,
    while each member updates, observes and refreshes only its own rows and slots, exactly as it would alone."""

    def __init__(self, members: list[nn.Module]):
        super().__init__()
        self.members = nn.ModuleList(members)
        self.needs_attention = any(m.needs_attention for m in members)
        intervals = {getattr(m, "refresh_interval", None) for m in members} - {None}
        if len(intervals) > 1:
            raise ValueError(f"members refresh at different intervals {intervals}")
        self.refresh_interval = next(iter(intervals), None)
        B, H, _, D = members[0].k.shape
        self.rows = B
        C = max(m.capacity for m in members)
        k0 = members[0].k
        self.register_buffer("k", k0.new_zeros(len(members) * B, H, C, D), persistent=False)
        self.register_buffer("v", k0.new_zeros(len(members) * B, H, C, D), persistent=False)
        self.register_buffer("slot_pos", torch.full((len(members) * B, H, C), -1, dtype=torch.long,
                                                    device=k0.device), persistent=False)
        for i, m in enumerate(members):
            rows = slice(i * B, (i + 1) * B)
            m.k, m.v = self.k[rows, :, : m.capacity], self.v[rows, :, : m.capacity]
            m.slot_pos = self.slot_pos[rows, :, : m.capacity]

    def state(self) -> list[Tensor]:
        """Every tensor of the decoding state, each once (the members' k, v, slot_pos are views of ours)."""
        shared = {id(self.k), id(self.v), id(self.slot_pos)}
        views = {id(t) for m in self.members for t in (m.k, m.v, m.slot_pos)}
        return [self.k, self.v, self.slot_pos] + [b for b in self.buffers() if id(b) not in shared | views]

    def reset(self) -> None:
        self.slot_pos.fill_(-1)
        for m in self.members:
            m.reset()

    def prefill(self, q: Tensor, k: Tensor, v: Tensor, memo: dict | None = None) -> None:
        for m in self.members:  # every member gets the same B samples
            m.prefill(q, k, v, memo=memo)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B = self.rows
        for i, m in enumerate(self.members):
            m.update(input_pos, k[i * B : (i + 1) * B], v[i * B : (i + 1) * B])
        return self.k, self.v, (self.slot_pos >= 0).unsqueeze(2)

    def observe(self, probs: Tensor) -> None:
        B = self.rows
        for i, m in enumerate(self.members):
            if m.needs_attention:
                m.observe(probs[i * B : (i + 1) * B, ..., : m.capacity])

    def refresh(self) -> None:
        for m in self.members:
            m.refresh()
