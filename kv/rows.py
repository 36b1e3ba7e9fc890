"""Ragged batches (ragged.py): a prompt prefilled alone into a one-row cache, then loaded into its batch row.

Mixed into kv.slots.KVCache. Every row runs on the batch's one clock, so a shorter prompt's row starts later:
its positions move by the offset, its row_start (where its sinks count from) is the offset, and its keys are
rotated by it (RoPE composes: R(offset) R(p) = R(offset + p), so attention within the row is unchanged).
"""

from __future__ import annotations

import torch
from torch import Tensor

from model import ModelArgs, apply_rope, rope_at


class RaggedRows:
    def load_row(self, row: int, single: RaggedRows, offset: int) -> None:
        """Copy a one-row cache of the same policy and capacity, holding K/V in full precision (a prompt prefilled
        alone), into `row`, its positions `offset` later; K/V are quantized here, once, if kv_bits. Every other
        per-row buffer (statistics, ranks, a pool's owners) is copied as it is."""
        k, v = single.stored_kv()
        parts = self.encode(self.position_keys(k[0], offset), v[0])
        for name, value in zip(self.kv_buffers(), parts):
            getattr(self, name)[row] = value
        pos = single.slot_pos[0]
        self.slot_pos[row] = torch.where(pos >= 0, pos + offset, pos)
        self.row_start[row] = offset
        skip = {*self.kv_buffers(), "slot_pos", "row_start", "seen"}
        theirs = dict(single.named_buffers())
        for name, buffer in self.named_buffers():
            if name in skip:
                continue
            source = theirs[name]
            if buffer.dim() and buffer.shape[0] == self.batch_size and source.shape == (1, *buffer.shape[1:]):
                buffer[row] = source[0]
            else:  # not per row (a schedule, constants): the same in every one-row cache
                buffer.copy_(source)

    def position_keys(self, k: Tensor, offset: int) -> Tensor:
        """Keys stored after RoPE at their positions, moved `offset` positions later (kv.posshift: unchanged)."""
        cos, sin = rope_at(torch.tensor(offset, device=k.device), self.model_args or ModelArgs())
        return apply_rope(k, cos, sin)

    def after_load(self) -> None:
        """Once every row is loaded and `seen` is the batch's clock (policies whose statistics depend on it)."""
