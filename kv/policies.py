"""Decode-time policies: what leaves the cache when a new token arrives and the cache is full.

One short class each: its paper in one line, its parameters with the paper's defaults (kv.params), its
score and the statistic behind it. Mechanics live in kv.slots.KVCache (buffers, protection, the scatter,
prefill) and kv.scored.ScoredCache (the statistic: its buffer, reset on insert, prompt and benchmark values).
Common deviation: eviction happens when the new token is written, before it attends, so a policy with
capacity C behaves like the paper's method with budget C - 1 plus the newest token, which is never evicted
on arrival.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kv.params import GQA_REDUCE, N_SINKS, RECENT_WINDOW, Param, count, fraction, whole
from kv.prompt import (
    H2O_NORMALIZE,
    attention_row_blocks,
    column_sums,
    key_norm_rank,
    last_query_attention,
    low_attention,
    memoized,
)
from kv.scored import ScoredCache
from kv.slots import KVCache, counter_hash, reduce_groups, row_head_salt


class FullCache(KVCache):
    """No compression (gpt-fast's static cache): capacity = prompt + new tokens; token t lives in slot t."""

    name = "full"
    evicts = False
    compresses = False
    position_only = True
    supports_pos_shift = False  # never evicts: every rank is the token's position

    def choose_slot(self, input_pos: Tensor) -> Tensor:
        B, H, _ = self.slot_pos.shape
        return input_pos.view(1, 1).expand(B, H)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Also several new tokens at once (speculate.py's verification of K drafts): token t into slot t, each
        query attending to the slots up to its own position."""
        n = input_pos.numel()
        if n == 1:
            return super().update(input_pos, k, v)
        B, H, _ = self.slot_pos.shape
        self.write_slots(input_pos.view(1, 1, n).expand(B, H, n), k, v)
        self.slot_pos[:, :, input_pos] = input_pos
        self.seen.copy_(input_pos[-1:] + 1)
        pos = self.slot_pos.unsqueeze(2)
        return *self.keys_values(attention=True), (pos >= 0) & (pos <= input_pos.view(1, 1, n, 1))


class WindowCache(ScoredCache):
    """StreamingLLM (Xiao et al., ICLR 2024, arXiv:2309.17453): the first n_sinks tokens + a recent window.

    Capacity = n_sinks + recent_window (or --cache-budget, the window then being the rest). Deviation: keys
    keep their original RoPE positions (gaps after eviction) instead of the paper's pos-shift, which
    re-rotates the cache to positions 0..C-1 at every step. Defaults: 4 + 2000 (run_streaming_llama.py).
    """

    name = "window"
    position_only = True
    window_fills_capacity = True
    params = (N_SINKS(4), RECENT_WINDOW(2000))
    default_prompt_compressor = "window"

    def slot_scores(self, input_pos: Tensor) -> Tensor:
        return self.slot_pos.float()  # the oldest non-sink token leaves


class RandomCache(ScoredCache):
    """Random eviction baseline (cold-compress `random`, kvpress RandomPress): a uniform choice among the
    evictable slots at every step, drawn from a counter-based hash so compiled and eager runs agree."""

    name = "random"
    params = (N_SINKS, RECENT_WINDOW)
    default_prompt_compressor = "random"

    def init_state(self) -> None:
        salt = row_head_salt(self.batch_size, self.n_kv_heads, self.layer, self.device)
        self.register_buffer("salt", salt, persistent=False)  # fixed, survives reset()

    def slot_scores(self, input_pos: Tensor) -> Tensor:
        # positions counted from the row's first token: a ragged batch's row draws what it would alone
        start = self.row_start
        return counter_hash(self.slot_pos - start, input_pos - start, self.salt).double()


class H2OCache(ScoredCache):
    """H2O (Zhang et al., NeurIPS 2023, arXiv:2306.14048): evict the lowest accumulated attention, the recent
    window kept. Scores sum every query that saw the token, prompt queries included (computed in query blocks
    at prefill); h2o_normalize divides by their number (kvpress ObservedAttention, against the early-token
    bias). Defaults: heavy hitters and recent window halve the budget (the paper's 0.1 + 0.1); no sinks."""

    name = "h2o"
    needs_attention = True
    params = (N_SINKS, RECENT_WINDOW(0.5), H2O_NORMALIZE, GQA_REDUCE)
    default_prompt_compressor = "h2o"
    statistic = "acc"
    per_query_head = True  # so --gqa-reduce max reduces accumulated scores (not per-step ones)

    def slot_scores(self, input_pos: Tensor) -> Tensor:
        scores = reduce_groups(self.acc, self.gqa_reduce)
        if self.h2o_normalize:  # queries that attended each token: its own and every later one up to t - 1
            scores = scores / (input_pos - self.slot_pos).clamp(min=1).float()
        return scores

    def observe(self, probs: Tensor) -> None:
        self.acc.add_(probs[:, :, :, 0])

    def prompt_statistic(self, q: Tensor, k: Tensor, memo: dict) -> Tensor:
        return column_sums(q, k, memo)


class ScissorhandsCache(ScoredCache):
    """Scissorhands (Liu et al., NeurIPS 2023, arXiv:2305.17118): evict the tokens whose attention was most
    often below uniform over the last history_window steps; recent window kept.

    Each step records one bit per slot, low = the group-reduced attention (--gqa-reduce) is below 1 / (number
    of valid slots). Deviation: the paper's bar is 1 / t, uniform over every token seen; shares of a
    compressed cache sum to 1 over its slots, so against 1 / t almost none would be low. The prompt's last
    history_window queries seed the record by the same rule (kv.prompt.low_attention): query j's attention
    renormalised over the kept prompt tokens it can see, below 1 / their number, so that prompt and decoded
    tokens are judged against the same bar. The bits live in a ring of history_window (bit-packed, slots last
    so that ScoredCache clears a new token's); every drop_interval steps refresh() re-ranks the evictable
    slots by their fraction of low-attention steps (ties: older first) into an eviction queue that the next
    steps pop, one token in and one out. Deviation: the paper drops m = 0.5 B tokens at once when the cache
    overflows; here the same m worst tokens are chosen at once but leave one per step, so memory never exceeds
    the budget and no slot is ever empty. No sinks."""

    name = "scissorhands"
    needs_attention = True
    # two sorts per layer every drop_interval steps: eager they run faster than compiled (30 layers at 50 % of
    # 512 / 2048 tokens: 25 vs 43 ms, 94 vs 146 ms on a 2-core AVX2 EPYC) and cost no compile (docs/speed.md)
    compile_refresh = False
    params = (N_SINKS, RECENT_WINDOW(10),
              Param("history_window", 400, "steps of attention history counted per token", check=whole(1)),
              Param("drop_interval", 0.5, "re-rank the eviction queue every m steps; < 1 = fraction of the "
                    "smallest layer capacity, at most what is evictable (0.5: the paper's m = 0.5 B)",
                    check=count),
              GQA_REDUCE)
    default_prompt_compressor = "snapkv"
    statistic = "low_bits"

    def init_state(self) -> None:
        B, H, C = self.batch_size, self.n_kv_heads, self.capacity
        self.refresh_interval = self.drop_interval
        self.add_state("low_bits", (B, H, (self.history_window + 7) // 8, C), torch.uint8)
        self.add_state("queue", (B, H, self.drop_interval), torch.long)
        self.add_state("queue_next", (1,), torch.long)

    def reset_state(self) -> None:
        super().reset_state()
        self.refresh()  # a valid queue (the empty slots in order) even before any prefill

    def low_counts(self) -> Tensor:
        """Low-attention steps in the window, per slot: popcount of the ring."""
        shifts = torch.arange(8, dtype=torch.uint8, device=self.low_bits.device).view(8, 1)
        return ((self.low_bits.unsqueeze(-2) >> shifts) & 1).sum(dim=(-2, -3))

    def eviction_ranking(self, t: Tensor) -> Tensor:
        """Scores at time t (the next position): minus the fraction of low-attention steps, protected."""
        observed = (t - self.slot_pos).clamp(min=1, max=self.history_window)  # steps seen within the window
        return self.protect(-(self.low_counts().float() / observed.float()), t)

    def refresh(self) -> None:
        scores = self.eviction_ranking(self.seen)
        by_age = torch.sort(self.slot_pos, dim=-1, stable=True).indices  # ties leave oldest first
        order = torch.sort(scores.gather(-1, by_age), dim=-1, stable=True).indices
        self.queue.copy_(by_age.gather(-1, order)[..., : self.drop_interval])
        self.queue_next.zero_()

    def choose_slot(self, input_pos: Tensor) -> Tensor:
        m = self.drop_interval
        slot = self.queue.index_select(2, self.queue_next.clamp(max=m - 1)).squeeze(2)
        # only reached if refresh() is not called every m steps: fall back to the oldest evictable token
        fallback = self.protect(self.slot_pos.float(), input_pos).argmin(dim=-1)
        self.queue_next.add_(1)
        return torch.where(self.queue_next <= m, slot, fallback)

    def observe(self, probs: Tensor) -> None:
        p = reduce_groups(probs[:, :, :, 0], self.gqa_reduce)  # [B, H_kv, C]
        valid = self.slot_pos >= 0
        low = (p < 1.0 / valid.sum(-1, keepdim=True).float()) & valid
        column = (self.seen - 1) % self.history_window  # this step's place in the ring
        byte, bit = column // 8, column % 8
        old = self.low_bits.index_select(2, byte).long()
        new = (old & ~torch.bitwise_left_shift(torch.ones_like(bit), bit)) | (low.long().unsqueeze(-2) << bit)
        self.low_bits.index_copy_(2, byte, new.to(torch.uint8))

    def prefill_state(self, q: Tensor, k: Tensor, keep: Tensor | None, memo: dict) -> None:
        S = k.shape[2]
        n = min(S, self.prompt_capacity)
        low = low_attention(q, k, self.history_window, self.gqa_reduce, keep, memo)  # [B, H_kv, w, n]
        ring_shape = (*low.shape[:2], n, self.low_bits.shape[2] * 8)
        ring = torch.zeros(ring_shape, dtype=torch.bool, device=k.device)
        columns = torch.arange(S - low.shape[2], S, device=k.device) % self.history_window
        ring[..., columns] = low.transpose(2, 3)
        weights = 2 ** torch.arange(8, device=k.device)
        packed = (ring.unflatten(-1, (-1, 8)).long() * weights).sum(-1)  # [B, H_kv, n, bytes]
        self.low_bits[..., :n] = packed.transpose(2, 3).to(torch.uint8)
        self.refresh()

    def synthetic_state(self, generator: torch.Generator | None) -> None:
        bits = torch.randint(0, 256, self.low_bits.shape, generator=generator, dtype=torch.uint8)
        self.low_bits.copy_(bits)
        self.refresh()


class TOVACache(ScoredCache):
    """TOVA (Oren et al., EMNLP 2024, arXiv:2401.06104): evict the token the newest query attended least,
    attention averaged over all heads of the layer (one kept set per layer, as long as the KV heads' slots
    hold the same tokens; if a per-head prompt compressor misaligned them: the mean over each KV group).
    """

    name = "tova"
    needs_attention = True
    params = (N_SINKS, RECENT_WINDOW)
    default_prompt_compressor = "tova"
    statistic = "last_attn"  # the newest query's attention, averaged over each KV group

    def slot_scores(self, input_pos: Tensor) -> Tensor:
        # the policy's own slots only: recall slots (kv.tiers) hold each KV head's own pages; sliced by the
        # buffer's size, not the int capacity, which would specialize a --dynamic-capacity graph to one capacity
        own = self.slot_pos[..., : self.slot_pos.shape[-1] - self.recall_slots]
        aligned = (own == own[:, :1]).flatten(1).all(dim=1).view(-1, 1, 1)
        per_group = self.last_attn
        return torch.where(aligned, per_group.mean(dim=1, keepdim=True).expand_as(per_group), per_group)

    def observe(self, probs: Tensor) -> None:
        self.last_attn.copy_(probs[:, :, :, 0].mean(dim=2))

    def prompt_statistic(self, q: Tensor, k: Tensor, memo: dict) -> Tensor:
        return last_query_attention(q, k, memo).mean(dim=2)


class EMACache(ScoredCache):
    """Adaptive KV (Q-TensorFormer design, reference/hybrid-and-tiers.md): attention utility as an exponential
    moving average, u <- ema_beta u + (1 - ema_beta) a, a = the new query's attention on the slot; new tokens
    start at 1.0; the lowest utility leaves; 4 sinks and 128 recent tokens protected. Deviations: one utility
    per row and KV head (a reduced over the group's query heads by gqa_reduce), not the sketch's mean over
    batch and heads; kept prompt tokens start from the utility the same rule gives them over the prompt's own
    queries (the sketch has no prefill rule)."""

    name = "ema"
    needs_attention = True
    params = (N_SINKS(4), RECENT_WINDOW(128), GQA_REDUCE,
              Param("ema_beta", 0.9, "utility u <- beta u + (1 - beta) x attention of the new query",
                    check=fraction))
    default_prompt_compressor = "snapkv"
    statistic, fill = "utility", 1.0  # new tokens start at 1.0

    def slot_scores(self, input_pos: Tensor) -> Tensor:
        return self.utility

    def observe(self, probs: Tensor) -> None:
        a = reduce_groups(probs[:, :, :, 0].float(), self.gqa_reduce)
        self.utility.mul_(self.ema_beta).add_(a, alpha=1 - self.ema_beta)

    def prompt_utility(self, q: Tensor, k: Tensor) -> Tensor:
        """[B, H_kv, S]: u_j after prompt queries j..S-1 as decoding runs them (token j enters at 1.0, then
        its own query and every later one observe): beta^(S-j) + (1 - beta) sum_{i>=j} beta^(S-1-i) a_ij.
        Only the last w queries are computed, in blocks: the rest weigh sum_{m>=w} (1 - beta) beta^m
        = beta^w <= 2^-24 in all (w = 256 suffices for beta <= 0.937; larger betas look further back)."""
        S, beta = k.shape[2], self.ema_beta
        w = min(S, 256)
        while beta ** w > 2 ** -24 and w < S:
            w = min(S, 2 * w)
        u = (beta ** torch.arange(S, 0, -1, device=k.device, dtype=torch.float64)).float().expand(k.shape[:3])
        for r0, probs in attention_row_blocks(q, k, S - w):
            rows = torch.arange(r0, r0 + probs.shape[3], device=k.device, dtype=torch.float64)
            weight = ((1 - beta) * beta ** (S - 1 - rows)).float().view(-1, 1)
            u = u + (reduce_groups(probs, self.gqa_reduce) * weight).sum(dim=2)
        return u

    def prompt_statistic(self, q: Tensor, k: Tensor, memo: dict) -> Tensor:
        key = ("ema_utility", self.ema_beta, self.gqa_reduce)
        return memoized(memo, key, lambda: self.prompt_utility(q, k))


class KNormCache(ScoredCache):
    """KNorm (Devoto et al., EMNLP 2024, arXiv:2406.11430): evict the key with the highest L2 norm.
    Deviations: no layer is skipped (the official README example leaves layers 0 and 1 uncompressed); norms
    are compared at fp16 precision, ties evicting the older token (see kv.prompt.key_norm_rank)."""

    name = "knorm"
    params = (N_SINKS, RECENT_WINDOW)
    default_prompt_compressor = "knorm"
    statistic = "key_norm"  # of the full-precision key, before any --kv-bits quantization

    def slot_scores(self, input_pos: Tensor) -> Tensor:
        return key_norm_rank(self.key_norm, self.slot_pos)

    def token_statistic(self, k: Tensor) -> Tensor:
        return k.float().norm(dim=-1)

    def prompt_statistic(self, q: Tensor, k: Tensor, memo: dict) -> Tensor:
        return self.token_statistic(k)

    def synthetic_state(self, generator: torch.Generator | None) -> None:
        self.key_norm.copy_(self.token_statistic(self.keys_values()[0]))


class SnapKVCache(ScoredCache):
    """SnapKV (Li et al., NeurIPS 2024, arXiv:2404.14469): the prompt is compressed once at prefill
    (observation window votes); decoded tokens are appended and never evicted, so --cache-budget is the
    prompt's budget plus max new tokens. Outside the paper: if a sequence ever outgrows the capacity, the
    oldest token leaves."""

    name = "snapkv"
    evicts = False
    params = (N_SINKS,)  # kept by any prompt compressor (SnapKV itself: none)
    default_prompt_compressor = "snapkv"

    def slot_scores(self, input_pos: Tensor) -> Tensor:
        return self.slot_pos.float()


class PyramidKVCache(SnapKVCache):
    """PyramidKV (Cai et al., arXiv:2406.02069): SnapKV under pyramid layer budgets (lower layers: more)."""

    name = "pyramidkv"
    default_prompt_compressor = "pyramidkv"
    default_layer_budget = "pyramid"



class KeyDiffCache(ScoredCache):
    """KeyDiff (Park et al., 2025, arXiv:2504.15364): evict the key most similar to its KV head's mean key.

    Score = minus the key's cosine similarity to the anchor, the mean of the normalized keys the head holds,
    so the most distinct keys stay. Query-agnostic, so it also compresses the prompt. Deviation: the paper
    evicts a block at a time; here one token in, one out, the anchor over the keys held when it arrives."""

    name = "keydiff"
    params = (N_SINKS, RECENT_WINDOW)

    @staticmethod
    def key_scores(k: Tensor, held: Tensor | None) -> Tensor:
        unit = F.normalize(k.float(), dim=-1)
        if held is not None:  # empty slots point nowhere; the mean's length does not change a cosine
            unit = unit * held.unsqueeze(-1)
        return -F.cosine_similarity(unit, unit.mean(dim=2, keepdim=True), dim=-1)
