"""HybridKV on the pool (kv.pool): each KV head classified static or dynamic at prefill, budgets per type.

HybridKV (Zeng et al., arXiv:2604.05887) classifies heads online from how concentrated their attention on the
prompt is (threshold 0.9), splits the layer budget between the two types and then between the heads of a type;
static heads keep a few salient tokens, dynamic heads a recent window plus chunks retrieved from host memory.
The paper is multimodal and has no public code; this is the text-only transcription that the design notes
(reference/hybrid-and-tiers.md) ask for, on the layer's pool of P = H_kv x B slots. Decisions, each a
deviation or a choice where the paper is silent:

Concentration. c_h = the share of the observation window's attention (the last w = obs_window prompt queries,
SnapKV's window, attention summed over them and group-reduced by gqa_reduce) that falls on the head's top-k
tokens before the window, k = B - w (the slots the even split leaves a head beyond the window). The window's
own keys count in the total but never in the top-k: every head keeps them anyway, and counting them would make
a local head (attention on the last few tokens, the very "dynamic" type) look concentrated. So a head whose
window queries keep returning to a few fixed earlier tokens (sinks, heavy hitters, a needle) scores near 1; a
local or diffuse head scores low. A prompt shorter than the window has nothing before it: c = 0.

Classification, per (row, layer): with static_threshold T (the paper's theta, 0.9 when the flag is given
without a value) a head is static iff c_h >= T; without it the round(static_ratio x H_kv) heads of highest c_h
are static (static_ratio 0.7, the value of the sketch that came with the request; ties go to the lower head).

Budgets (layer -> type -> head): the static heads share T_s = round(static_share x P) slots, the dynamic ones
P - T_s, each type split evenly between its heads (largest remainders to the lower heads; the paper weights
static heads by their sparsity score, the formula unpublished). The default static_share is the share of heads
that are static, n_static / H_kv: the sketch splits the budget "by ratio", i.e. every head keeps B and the
types differ in what they keep, not in how much, so hybrid is comparable head for head with the uniform
policies at equal memory; a share away from that is an explicit choice. T_s is clamped so that every head
keeps its floor (n_sinks + max(obs window of the compressor, recent_window)) and none gets more than the
prompt's S tokens; a prompt that fits the even split (S <= B) therefore keeps it. A head's budget is then
fixed for the sequence.

What each type keeps: every head keeps its sinks (n_sinks, 4 as in the sketch) and its last max(compressor
window, recent_window - 1) prompt tokens. Static heads fill the rest with the prompt compressor's top tokens
(default SnapKV) and while decoding evict their lowest accumulated attention (H2O-like; the prior of a prompt
token is its observation-window attention, decode attention is added every step, new tokens start at 0 and the
recent window (32) protects them meanwhile). Dynamic heads keep the most recent tokens and evict their oldest
unprotected one (StreamingLLM-like). The paper's chunk retrieval is the warm tier (kv.tiers, `--warm-tokens`):
every head demotes what it evicts to its warm pages and recalls Quest's top pages into its own recall slots, which
the pool keeps after the policy's slots (R per KV head, taken from the budget: P stays H_kv x B). Deviation: the
paper retrieves for dynamic heads only; here static heads recall too (their recall slots would otherwise sit
empty, and a head whose heavy hitters miss a needle gets it back the same way).

Decode (compiled, static shapes): the new token's key of KV head h replaces the lowest-scored unprotected slot
of head h itself (empty slots first), so budgets never move; one argmin over [B, H_kv, P] per step.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor

from kv.params import GQA_REDUCE, N_SINKS, RECENT_WINDOW, Param, fraction
from kv.pool import PoolCache
from kv.prompt import OBS_WINDOW, window_votes
from kv.scored import ScoredCache
from kv.slots import INF, reduce_groups
from model import KVFastError

PROTECTED = torch.finfo(torch.float32).max  # below +inf: a head's own protected slot beats another head's


def head_concentration(votes: Tensor, window: int, k: int) -> Tensor:
    """c [B, H] (float64): share of the window's attention votes [B, H, S] on each head's top-k tokens before
    the last `window` positions."""
    S = votes.shape[-1]
    votes = votes.double()
    before = votes[..., : S - window]
    k = min(k, before.shape[-1])
    top = before.topk(k, dim=-1).values.sum(-1) if k > 0 else votes.new_zeros(votes.shape[:-1])
    return top / votes.sum(-1).clamp(min=torch.finfo(torch.float64).tiny)


def classify_heads(concentration: Tensor, threshold: float | None, ratio: float) -> Tensor:
    """static [B, H] bool: c >= threshold, or (threshold None) the round(ratio x H) most concentrated."""
    if threshold is not None:
        return concentration >= threshold
    H = concentration.shape[-1]
    n_static = math.floor(ratio * H + 0.5)
    order = concentration.sort(dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(H, device=order.device).expand_as(order))
    return rank < n_static


def hybrid_budgets(static: Tensor, capacity: int, floor: int, share: float | None, ceiling: int) -> Tensor:
    """Per-head budgets [B, H] long summing to P = H x capacity: static heads share round(share x P) (None:
    n_static x capacity), clamped so every head gets between `floor` and `ceiling` slots; even within a type,
    the remainder to the lower heads. Needs floor <= capacity <= ceiling."""
    H = static.shape[-1]
    P = H * capacity
    n_static = static.long().sum(-1, keepdim=True)
    n_dynamic = H - n_static
    want = n_static * capacity if share is None else torch.full_like(n_static, math.floor(share * P + 0.5))
    lower = torch.maximum(n_static * floor, P - n_dynamic * ceiling)
    upper = torch.minimum(n_static * ceiling, P - n_dynamic * floor)
    total_static = torch.minimum(torch.maximum(want, lower), upper)
    total = torch.where(static, total_static, P - total_static)
    count = torch.where(static, n_static, n_dynamic).clamp(min=1)
    rank = torch.where(static, static.long().cumsum(-1), (~static).long().cumsum(-1)) - 1
    return total // count + (rank < total % count).long()


class HybridCache(PoolCache, ScoredCache):
    """HybridKV (Zeng et al., arXiv:2604.05887): static heads keep heavy hitters, dynamic a recent window."""

    name = "hybrid"
    needs_attention = True
    supports_tiers = True  # each head evicts one of its own slots per step
    params = (N_SINKS(4), RECENT_WINDOW(32), OBS_WINDOW, GQA_REDUCE,
              Param("static_threshold", None, "a KV head is static when the share of the observation "
                    "window's attention on its top-(B - w) tokens before the window reaches this (0.9, "
                    "HybridKV's theta, when given without a value); unset: --static-ratio", check=fraction,
                    const=0.9),
              Param("static_ratio", 0.7, "without --static-threshold, the share of each layer's KV heads "
                    "classified static, the most concentrated ones", check=fraction),
              Param("static_share", None, "the share of the layer's pool given to its static heads (unset: "
                    "their share of the heads, i.e. B slots per head)", check=fraction))
    default_prompt_compressor = "snapkv"
    statistic = "score"  # static heads' accumulated attention
    head_kinds: ClassVar[tuple[str, ...]] = ("static", "dynamic")  # what head_classes' "kind" indexes
    head_letters = "SD"  # one per kind, for the report's by-head strings

    @classmethod
    def check_params(cls, given: dict[str, Any]) -> None:
        if "static_threshold" in given and "static_ratio" in given:
            raise KVFastError("hybrid: give --static-threshold or --static-ratio, not both (the threshold "
                              "classifies each head on its own, the ratio fixes how many are static)")

    def init_state(self) -> None:
        super().init_state()
        B, H = self.batch_size, self.n_kv_heads
        self.add_state("static", (B, H), torch.bool)
        self.add_state("budget", (B, H), torch.long, fill=self.policy_capacity)
        self.add_state("concentration", (B, H), torch.float64)

    @property
    def head_floor(self) -> int:
        """Slots every head keeps whatever the split: its sinks, the prompt's protected tail and the recent
        window (capped at B, where the factory let a budget through that holds less: then no split)."""
        window = self.compressor.window if self.compressor is not None else 0
        return min(self.n_sinks + max(window, self.recent_window), self.policy_capacity)

    # ---- prefill -------------------------------------------------------------------------------------
    def votes(self, q: Tensor, k: Tensor, memo: dict) -> Tensor:
        """The observation window's attention per KV head [B, H_kv, S] (SnapKV's votes, memoized)."""
        w = min(self.obs_window, k.shape[2])
        return reduce_groups(window_votes(q, k, w, memo), self.gqa_reduce)

    def classify(self, q: Tensor, k: Tensor, memo: dict) -> None:
        """Set concentration, static and budget per (row, KV head) for this prompt."""
        S = k.shape[2]
        w = min(self.obs_window, S)
        C = self.policy_capacity
        c = head_concentration(self.votes(q, k, memo), w, max(C - w, 0))
        static = classify_heads(c, self.static_threshold, self.static_ratio)
        self.concentration.copy_(c)
        self.static.copy_(static)
        self.budget.copy_(hybrid_budgets(static, C, self.head_floor, self.static_share, max(S, C)))

    def select_pairs(self, q: Tensor, k: Tensor, v: Tensor, memo: dict) -> tuple[Tensor, Tensor]:
        B, H, S, _ = k.shape
        self.classify(q, k, memo)
        pos = torch.arange(S, device=k.device)
        protected = (pos < self.n_sinks) | (pos >= S - self.protected_prompt())
        heavy = self.compressor.cached_scores(q, k, memo, v).double().expand(B, H, S)
        # static: the compressor's top tokens; dynamic: the newest; both after the protected ones
        key = torch.where(self.static.unsqueeze(-1), heavy, pos.double()).masked_fill(protected, INF)
        order = key.sort(dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(-1, order, pos.expand_as(order))
        return rank < self.budget.unsqueeze(-1), heavy  # the prior is set from the votes in prefill_state

    def prefill_state(self, q: Tensor, k: Tensor, prior: Tensor | None, memo: dict) -> None:
        if prior is None:  # the prompt fitted: select_pairs was not called
            self.classify(q, k, memo)
        S = k.shape[2]
        votes = self.votes(q, k, memo).float()  # [B, H_kv, S]
        index = self.slot_head * S + self.slot_pos.clamp(min=0)
        seeded = votes.flatten(1).gather(1, index)
        self.score.copy_(seeded.masked_fill(self.slot_pos < 0, 0.0))

    # ---- decode --------------------------------------------------------------------------------------
    def choose_slot(self, input_pos: Tensor) -> Tensor:
        """[B, H_kv]: KV head h's lowest-scored slot among its own (empty first, protected last; never a recall
        slot of the tiers)."""
        pos = self.slot_pos
        valid = pos >= 0
        protected = valid & self.decode_protected(pos, input_pos)
        score = self.slot_scores(input_pos).masked_fill(protected, PROTECTED).masked_fill(~valid, -INF)
        own = self.slot_head.unsqueeze(1) == self.head_ids.view(1, -1, 1)  # [B, H_kv, P]
        if self.recall_slots:
            own = own & (torch.arange(self.pool_size, device=own.device) < self.policy_pool)
        return score.unsqueeze(1).masked_fill(~own, INF).argmin(-1)

    def decode_protected(self, pos: Tensor, input_pos: Tensor) -> Tensor:
        """[B, P] bool: slots a head evicts only when all its others are too (sinks, the recent window)."""
        return self.is_sink(pos) | (pos > input_pos - self.recent_window)

    def slot_scores(self, input_pos: Tensor) -> Tensor:
        """Static heads' slots: accumulated attention; dynamic heads': the position (oldest out first)."""
        return torch.where(self.static.gather(1, self.slot_head), self.score, self.slot_pos.float())

    def observe(self, probs: Tensor) -> None:
        # a slot's attention is nonzero only in its own KV head's row: the sum over heads picks it out
        self.score.add_(reduce_groups(probs[:, :, :, 0], self.gqa_reduce).sum(1))

    def synthetic_state(self, generator: torch.Generator | None) -> None:
        super().synthetic_state(generator)
        self.static.copy_(torch.rand(self.static.shape, generator=generator) < self.static_ratio)

    # ---- reporting (read once at the end) ----------------------------------------------------------------
    def head_classes(self) -> dict[str, Tensor]:
        """Per (row, KV head), on the host: kind (index into head_kinds: 0 static, 1 dynamic), static (bool),
        budget (slots), concentration (c_h)."""
        static = self.static.cpu()
        return {"kind": (~static).long(), "static": static, "budget": self.budget.cpu(),
                "concentration": self.concentration.cpu()}
