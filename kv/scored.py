"""Score-based eviction: the base of every policy that ranks its slots and keeps the best within its budget.

kv.slots evicts, per KV head, the lowest-scored slot that is neither a sink nor in the recent window (empty
slots first). A subclass says only how it scores:

    slot_scores(input_pos)   the rule, [B, H_kv, C] (a pool's [B, P]), low = evicted first
    observe(probs)           what it learns from the new query's attention (with needs_attention = True)
    params                   its hyper-parameters (kv.params), each with the paper's default

and, when the rule reads a statistic per slot, describes it; this class keeps it:

    statistic = "acc"        the buffer's name: [B, H_kv, C] like slot_pos ([B, H_kv, g, C] with
                             per_query_head), refilled with `fill` by reset()
    token_statistic(k)       its value for a token written into a slot (default: fill)
    prompt_statistic(q, k, memo)  its value for every prompt token [B, H_kv(, g), S]; the kept ones are
                             gathered into the prompt's slots (None: fill)

Random values stand in for the statistic when a benchmark fills the cache without a prefill.

A query-agnostic policy defines `key_scores(k, held)` instead: scores [B, H_kv, N] of keys [B, H_kv, N, D]
(held [B, H_kv, N] marks the slots in use; None: every key, a prompt). Its slots are scored from the keys they
hold, and the same rule picks a long prompt's tokens: the class is also the prompt compressor of its name
(`prompt_compressor`, registered by cache.py), and its own default compressor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from kv.prompt import PromptCompressor
from kv.slots import KVCache, gather_tokens


class KeyScoredPrompt(PromptCompressor):
    """A query-agnostic policy's rule applied to the prompt's keys (one per such policy, made by
    ScoredCache)."""

    policy: ClassVar[type[ScoredCache]]

    def scores(self, q: Tensor, k: Tensor, memo: dict | None = None) -> Tensor:
        return self.policy.key_scores(k, None)


class ScoredCache(KVCache):
    """Keeps, per KV head, the highest-scored tokens: the shared statistic mechanics (see the module doc)."""

    statistic: ClassVar[str | None] = None
    per_query_head: ClassVar[bool] = False
    fill: ClassVar[float] = 0.0
    key_scores: ClassVar[Callable[[Tensor, Tensor | None], Tensor] | None] = None
    prompt_compressor: ClassVar[type[PromptCompressor] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "key_scores" in cls.__dict__:
            cls.prompt_compressor = type(f"{cls.__name__}Prompt", (KeyScoredPrompt,),
                                         {"name": cls.name, "policy": cls, "__doc__": cls.__doc__})
            if "default_prompt_compressor" not in cls.__dict__:
                cls.default_prompt_compressor = cls.name

    def init_state(self) -> None:
        if self.statistic is not None:
            *lead, C = self.slot_pos.shape
            shape = (*lead, self.n_groups, C) if self.per_query_head else (*lead, C)
            self.add_state(self.statistic, shape, fill=self.fill)

    @property
    def stat(self) -> Tensor:
        return getattr(self, self.statistic)

    def slot_scores(self, input_pos: Tensor) -> Tensor:
        if self.key_scores is None:
            raise NotImplementedError(f"{type(self).__name__} defines neither slot_scores nor key_scores")
        return self.key_scores(self.keys_values()[0], self.slot_pos >= 0)

    def token_statistic(self, k: Tensor) -> Tensor | float:
        """The statistic of a token written now, k [B, H_kv, 1, D]: [B, H_kv(, g), 1] or a number."""
        return self.fill

    def prompt_statistic(self, q: Tensor, k: Tensor, memo: dict) -> Tensor | None:
        """The statistic of every prompt token, [B, H_kv(, g), S] (None: they start at fill)."""
        return None

    def on_insert(self, slot: Tensor, k: Tensor, input_pos: Tensor) -> None:
        if self.statistic is None:
            return
        stat = self.stat
        # slot [B, H_kv]: the new token's slot, one per KV head (uniform) or H_kv of a row's pool (kv.pool)
        index = slot.reshape(*self.slot_pos.shape[:-1], -1)
        index = index.view(*index.shape[:-1], *(1,) * (stat.dim() - index.dim()), index.shape[-1])
        stat.scatter_(-1, index.expand(*stat.shape[:-1], index.shape[-1]), self.token_statistic(k))

    def prefill_state(self, q: Tensor, k: Tensor, keep: Tensor | None, memo: dict) -> None:
        prompt = self.prompt_statistic(q, k, memo) if self.statistic is not None else None
        if prompt is not None:
            n = min(k.shape[2], self.prompt_capacity)
            self.stat[..., :n] = gather_tokens(prompt, keep, n)

    def synthetic_state(self, generator: torch.Generator | None) -> None:
        if self.statistic is not None:
            self.stat.copy_(torch.rand(self.stat.shape, generator=generator))
