"""Bench filling: a cache made to look as if a long sequence had been processed, without a prefill.

Mixed into kv.slots.KVCache (the pool, kv.pool, fills its even split instead), so that a decode step at any
context can be timed (cache.setup_decode_benchmark, bench.py): random K/V, the sinks and the most recent positions
kept, and statistics a policy makes plausible in synthetic_state (kv.scored: random values).
"""

from __future__ import annotations

import torch


class SyntheticFill:
    def fill_synthetic(self, seq_len: int, generator: torch.Generator | None = None) -> None:
        """As if seq_len tokens had been processed: random K/V, the sinks and the latest positions kept."""
        n = min(seq_len, self.prompt_capacity)
        sinks = min(self.n_sinks, n)
        positions = torch.cat([torch.arange(sinks), torch.arange(seq_len - (n - sinks), seq_len)])
        self.reset()
        shape = (self.batch_size, self.n_kv_heads, n, self.head_dim)
        k, v = (torch.randn(shape, generator=generator).to(self.device, self.dtype) for _ in "kv")
        self.write_slots(None, k, v)
        self.slot_pos[:, :, :n] = positions.to(self.slot_pos)
        self.seen.fill_(seq_len)
        self.synthetic_state(generator)

    def synthetic_state(self, generator: torch.Generator | None) -> None:
        """Plausible statistics for fill_synthetic (zeros by default)."""
