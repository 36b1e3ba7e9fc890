"""Where kv.tiers finds things in the uniform layout (the pool, kv.pool, has its own versions).

Mixed into kv.slots.KVCache. With tiers the last recall_slots slots of each KV head hold recalled warm pages:
the policy never prefills, fills or evicts them (shield_recall), and attention reads them as any slot.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from kv.storage import INF, put_rows


class TierSlots:
    # False where the policy's victims are not one slot of each KV head per step (tiers stage one per head)
    supports_tiers: ClassVar[bool] = True
    # the last recall_slots slots belong to the tiers (kv.tiers): never evicted by the policy, never prefilled
    recall_slots: int = 0

    def shield_recall(self, scores: Tensor) -> Tensor:
        """Eviction scores [..., C] with the recall slots at +inf: full or empty, never the policy's to evict."""
        if not self.recall_slots:
            return scores
        return torch.cat([scores[..., : -self.recall_slots],
                          scores.new_full((*scores.shape[:-1], self.recall_slots), INF)], dim=-1)

    def holds(self, S: int) -> Tensor:
        """[B, H_kv, S] bool: prompt position p of KV head h is in one of its slots."""
        pos = self.slot_pos
        held = torch.zeros(*pos.shape[:2], S + 1, dtype=torch.bool, device=pos.device)
        return held.scatter_(2, torch.where(pos >= 0, pos, S), True)[..., :S]

    def take_slots(self, buffer: Tensor, slot: Tensor) -> Tensor:
        """Rows of a slot-shaped buffer [B, H_kv, C, *row] at slot [B, H_kv], one per KV head: [B, H_kv, 1, *row]."""
        B, H = slot.shape
        index = slot.view(B, H, 1, *(1,) * (buffer.dim() - 3))
        return buffer.gather(2, index.expand(B, H, 1, *buffer.shape[3:]))

    def recall_positions(self) -> Tensor:
        """slot_pos of the tiers' recall slots, [B, H_kv, R] (a view: the last R slots of each KV head)."""
        return self.slot_pos[..., self.slot_pos.shape[-1] - self.recall_slots :]

    def put_recall(self, buffer: Tensor, index: Tensor, value: Tensor) -> None:
        """Write value [B, H_kv, n, *row] into recall slots `index` [B, H_kv, n] (0 .. R - 1) of a slot buffer."""
        put_rows(buffer, self.capacity - self.recall_slots + index, value)
