"""Per-head budgets in one pool per layer (DESIGN.md, "Per-head budgets (pool layout)"), and Ada-KV on it.

Layout: a layer's K/V live in one pool k, v [B, P, D] (uint8 codes + fp32 scales / zero points with --kv-bits)
beside slot_pos [B, P] (original position, -1 = empty) and slot_head [B, P] (the KV head that owns the slot).
Every slot always has exactly one owner, so a head's budget is the number of slots it owns and the memory is P
slots whatever the split. `capacity` is the average budget per KV head B (what --cache-budget sets), P =
H_kv x B. After reset() head h owns slots h B .. (h + 1) B - 1 (the even split); a prompt that fits is written
there.

Decode (compiled, static shapes): the new token brings H_kv keys, one per KV head; they take the H_kv slots of
the layer with the lowest `slot_scores` across heads (empty slots first; sinks and the recent window, per
head, never), chosen greedily one at a time so that no head falls below its floor `head_floor`: head h may
give up at most (slots it owns) + 1 - floor slots in a step. Ownership moves with the slot, so budgets adapt
while decoding and nothing is reallocated. Attention (attention.attend_pool) reads the pool once under the mask
slot_head == h. Prefill: when the prompt exceeds B tokens per head the policy's `select_pairs` picks exactly P
(KV head, token) pairs across heads; they are written head by head in position order.

A policy on the pool is also a kv.scored.ScoredCache: it defines select_pairs, slot_scores ([B, P], comparable
across heads) and its statistic (one per slot, [B, P]: ScoredCache clears a new token's), observe (probs
[B, H_kv, g, 1, P], 0 outside each head's own slots) and prefill_state(q, k, prior, memo), prior [B, P] being
select_pairs' scores of the kept pairs (None when the prompt fitted).

Tiers (kv.tiers) on the pool: the last H_kv x R slots are the recall slots, R per KV head in head order and owned
by it for good; the policy manages the first H_kv x (B - R) (`policy_pool`). Tiers stage one victim per KV head
and step, so only a policy whose heads evict their own slots has them (hybrid: `supports_tiers`); Ada-KV's
victims move between heads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kv.params import GQA_REDUCE, N_SINKS, RECENT_WINDOW, Param, boolean, fraction
from kv.scored import ScoredCache
from kv.slots import KVCache, reduce_groups
from kv.storage import INF, put_rows

TIER = float(2**24)  # choose_slot's gap between eviction tiers


class PoolCache(KVCache):
    """The pool mechanics shared by per-head-budget policies (a layout, no paper: see the module doc)."""

    layout = "pool"
    shared_pool = True
    supports_pos_shift = False  # heads hold different counts, so a query would need a rank per KV head: not built
    supports_tiers = False  # a step's H_kv victims may belong to any heads; tiers stage one per head (hybrid does)
    channel_blocks = None  # attend_pool_one_query reads the pool whole
    prompt_traceable = False  # how many of a prompt's tokens each head keeps is decided by their scores

    def allocate(self, slots: tuple[int, ...]) -> None:
        B, H, C = slots
        self.pool_size = H * C
        super().allocate((B, self.pool_size))
        self.register_buffer("head_ids", torch.arange(H, device=self.device), persistent=False)
        self.register_buffer("slot_head", self.home_heads().expand(B, -1).clone(), persistent=False)

    @property
    def policy_capacity(self) -> int:
        """The policy's slots per KV head on average: the budget less the tiers' recall slots."""
        return self.capacity - self.recall_slots

    @property
    def policy_pool(self) -> int:
        """Pool slots the policy manages (the first ones); each KV head's R recall slots follow, head by head."""
        return self.n_kv_heads * self.policy_capacity

    def home_heads(self) -> Tensor:
        """[P] owner of each slot after reset(): the even split of the policy's slots, then the recall slots."""
        C, R = self.policy_capacity, self.recall_slots
        policy = torch.arange(self.policy_pool, device=self.device) // C
        return torch.cat([policy, torch.arange(self.n_kv_heads * R, device=self.device) // max(R, 1)])

    @property
    def head_floor(self) -> int:
        """Slots no head ever drops below by eviction (0: no floor)."""
        return 0

    def protected_prompt(self) -> int:
        """Last prompt tokens each head keeps at prefill: the compressor's window and the recent window."""
        return max(self.compressor.window if self.compressor is not None else 0, self.recent_window - 1)

    def home_slots(self, n: int) -> Tensor:
        """[H_kv * n] slots of the first n tokens of each head in the even split (head-major)."""
        H, C = self.n_kv_heads, self.policy_capacity
        return ((self.head_ids * C).view(H, 1) + torch.arange(n, device=self.device)).flatten()

    def reset(self) -> None:
        super().reset()
        self.slot_head.copy_(self.home_heads().expand_as(self.slot_head))

    def owned(self) -> Tensor:
        """[B, H_kv, P] bool: slot p holds a token of KV head h."""
        mine = self.slot_head.unsqueeze(1) == self.head_ids.view(1, -1, 1)
        return mine & (self.slot_pos >= 0).unsqueeze(1)

    # ---- prefill -------------------------------------------------------------------------------------
    def prefill(self, q: Tensor, k: Tensor, v: Tensor, memo: dict | None = None) -> None:
        """Fill an empty pool with a prompt's K/V [B, H_kv, S, D]: all of it in the even split if it fits
        (S <= capacity), else the P pairs `select_pairs` keeps, with the prior scores it gives them."""
        B, H, S, D = k.shape
        memo = {} if memo is None else memo
        self.reset()
        if S <= self.prompt_capacity:
            slots = self.home_slots(S).expand(B, -1)
            self.write_slots(slots, k.reshape(B, H * S, D), v.reshape(B, H * S, D))
            self.slot_pos.scatter_(1, slots, torch.arange(S, device=k.device).repeat(H).expand(B, -1))
            prior = None
        else:
            keep, scores = self.select_pairs(q, k, v, memo)  # [B, H_kv, S] bool, exactly P per row
            flat = torch.arange(H * S, device=k.device)
            # the kept pairs in (head, position) order: dropped ones sort behind every kept one
            index = torch.where(keep.reshape(B, H * S), flat, flat + H * S).sort(dim=-1).values
            n = self.policy_pool
            index = index[:, :n]
            if int(index.max()) >= H * S:
                raise AssertionError(f"{self.name}: select_pairs kept fewer than {n} pairs")
            rows = index.unsqueeze(-1).expand(B, n, D)
            pairs = [x.reshape(B, H * S, D).gather(1, rows) for x in (k, v)]
            self.write_slots(None, *pairs)
            self.slot_pos[:, :n] = index % S
            self.slot_head[:, :n] = index // S
            prior = torch.zeros(B, self.pool_size, dtype=scores.dtype, device=k.device)
            prior[:, :n] = scores.reshape(B, H * S).gather(1, index)
        self.seen.fill_(S)
        self.prefill_state(q, k, prior, memo)

    def select_pairs(self, q: Tensor, k: Tensor, v: Tensor, memo: dict) -> tuple[Tensor, Tensor]:
        """(keep [B, H_kv, S] bool with exactly policy_pool True per row, scores [B, H_kv, S] the policy's prior for the
        kept pairs). Called only when the prompt exceeds `prompt_capacity` tokens per head."""
        raise NotImplementedError

    def prefill_state(self, q: Tensor, k: Tensor, prior: Tensor | None, memo: dict) -> None:
        """Seed the statistics of the prompt's slots: prior [B, P] from select_pairs, None if all fit."""

    # ---- decode --------------------------------------------------------------------------------------
    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Write one token's H_kv keys ([B, H_kv, 1, D]) into the victims; return the pool and the mask
        [B, H_kv, 1, P] of each KV head's slots."""
        return self.insert(self.choose_slot(input_pos), input_pos, k, v)

    def insert(self, slot: Tensor, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """update() after the choice: KV head h's new key into slot[:, h] (kv.tiers demotes its old token first)."""
        B, H = slot.shape
        self.write_slots(slot, k[:, :, 0], v[:, :, 0])
        put_rows(self.slot_pos, slot, input_pos.view(1, 1).expand(B, H))  # a scatter_ would copy every slot
        put_rows(self.slot_head, slot, self.head_ids.view(1, H).expand(B, H))
        self.seen.copy_(input_pos + 1)
        self.on_insert(slot, k, input_pos)
        return *self.keys_values(), self.owned().unsqueeze(2)

    def choose_slot(self, input_pos: Tensor) -> Tensor:
        """H_kv victims per row, the lowest-scored first, each head giving up at most (owned + 1 - floor).

        The greedy choice (pick the lowest, count it against its head, repeat) in one pass: every slot gets a
        key ordering (tier, score), tier 0 = empty or evictable, 2 = protected, each tier TIER above the last
        (scores clamped to +-TIER / 4; empty slots at -TIER / 2, below every score). Each head's H_kv lowest
        keys are its candidates; those past the head's allowance among its valid unprotected ones move up a
        tier (1: its head is at its floor), and the H_kv lowest candidates of the row are the victims, lowest
        first. Tier 0's order is the scores' exactly; tiers 1-2, which a budget the factory accepts never
        reaches (every head keeps its protected tokens + 1 slot), order scores to float32's step at TIER."""
        H = self.n_kv_heads
        pos, head = self.slot_pos, self.slot_head
        valid = pos >= 0
        protected = valid & (self.is_sink(pos) | (pos > input_pos - self.recent_window))
        score = self.slot_scores(input_pos).float().clamp(-TIER / 4, TIER / 4).masked_fill(~valid, -TIER / 2)
        key = score + protected.float() * (2 * TIER)
        own = head.unsqueeze(1) == self.head_ids.view(1, -1, 1)  # [B, H_kv, P]
        cand_key, cand = key.unsqueeze(1).masked_fill(~own, INF).topk(H, dim=-1, largest=False)  # [B, H_kv, H_kv]
        evictable = (valid & ~protected).gather(1, cand.flatten(1)).view_as(cand)
        allowance = self.owned().sum(-1, keepdim=True) + 1 - self.head_floor  # [B, H_kv, 1]
        at_floor = evictable & (evictable.long().cumsum(-1) > allowance)
        order = (cand_key + at_floor.float() * TIER).flatten(1).topk(H, dim=-1, largest=False).indices
        return cand.flatten(1).gather(1, order)

    # ---- where kv.tiers finds things in the pool (see KVCache's versions) ---------------------------------
    def holds(self, S: int) -> Tensor:
        B, H = self.batch_size, self.n_kv_heads
        flat = torch.where(self.slot_pos >= 0, self.slot_head * S + self.slot_pos, H * S)
        held = torch.zeros(B, H * S + 1, dtype=torch.bool, device=flat.device).scatter_(1, flat, True)
        return held[:, : H * S].view(B, H, S)

    def take_slots(self, buffer: Tensor, slot: Tensor) -> Tensor:
        """Rows of a pool-shaped buffer ([B, P, *row]) at slot [B, H_kv]: [B, H_kv, 1, *row]."""
        B, H = slot.shape
        index = slot.view(B, H, *(1,) * (buffer.dim() - 2))
        return buffer.gather(1, index.expand(B, H, *buffer.shape[2:])).unsqueeze(2)

    def recall_positions(self) -> Tensor:
        return self.slot_pos[:, self.policy_pool :].view(self.batch_size, self.n_kv_heads, self.recall_slots)

    def put_recall(self, buffer: Tensor, index: Tensor, value: Tensor) -> None:
        first = self.policy_pool + self.head_ids.view(1, -1, 1) * self.recall_slots  # KV head h's recall slots
        put_rows(buffer, (first + index).flatten(1), value.flatten(1, 2))

    # ---- eval's attention-loss probe -------------------------------------------------------------------
    def restrict(self, probs: Tensor) -> Tensor:
        """A full cache's attention probs [B, H_kv, g, T] (slot j = position j) over this pool's slots:
        [B, H_kv, g, P], each query head's attention on the tokens its KV head still holds, 0 elsewhere."""
        B, H, g, T = probs.shape
        index = self.slot_head * T + self.slot_pos.clamp(min=0)  # [B, P] into the flattened (head, position)
        flat = probs.permute(0, 1, 3, 2).reshape(B, H * T, g)
        held = flat.gather(1, index.unsqueeze(-1).expand(-1, -1, g)).transpose(1, 2)  # [B, g, P]
        return held.unsqueeze(1) * self.owned().unsqueeze(2)

    # ---- benchmarking and reporting --------------------------------------------------------------------
    def fill_synthetic(self, seq_len: int, generator: torch.Generator | None = None) -> None:
        """As if seq_len tokens had been seen: the even split, each head holding its sinks and its most
        recent tokens (random K/V)."""
        n = min(seq_len, self.prompt_capacity)
        sinks = min(self.n_sinks, n)
        positions = torch.cat([torch.arange(sinks), torch.arange(seq_len - (n - sinks), seq_len)])
        self.reset()
        B, H, D = self.batch_size, self.n_kv_heads, self.head_dim
        slots = self.home_slots(n).expand(B, -1)
        kv = [torch.randn((B, H * n, D), generator=generator).to(self.device, self.dtype) for _ in "kv"]
        self.write_slots(slots, *kv)
        self.slot_pos.scatter_(1, slots, positions.to(self.device).repeat(H).expand(B, -1))
        self.seen.fill_(seq_len)
        self.synthetic_state(generator)

    def kept(self) -> Tensor:
        """Valid slots per (row, KV head): the heads' current budgets in use."""
        return self.owned().sum(-1)


def adakv_budgets(scores: Tensor, base: int, alpha: float, normalize: bool) -> tuple[Tensor, Tensor]:
    """Ada-KV's per-head budgets (FFY0/AdaKV `AdaptiveSnapKVCluster.update_kv_gqa`): for candidate scores
    [B, H, n] and an average of `base` selected tokens per head, returns (budgets [B, H] long summing to
    H x base, the per-head factor [B, H, 1] applied by `normalize`).

    Each head's scores sorted; with normalize each head's multiplied by (sum of its top-base / its total)
    (non-negative scores; a head with nothing positive keeps factor 1); c_h = head h's share of the layer's
    top-(H x base); budget = c_h (1 - alpha) + alpha x base. Deviation: the reference rounds each head's
    budget on its own (round(c_h (1 - alpha) + int(alpha x base))), which can leave the layer a few slots
    short or over; here the fractions are apportioned by largest remainder (ties: lower head first), so the
    budgets sum to exactly H x base and each is within one slot of the reference's. Ties between scores go to
    the lower head and then the earlier rank (stable sorts), identically in every row."""
    B, H, n = scores.shape
    ranked = scores.sort(dim=-1, descending=True, stable=True).values
    factor = torch.ones(B, H, 1, dtype=ranked.dtype, device=ranked.device)
    if normalize:
        positive = ranked.clamp(min=0)
        total = positive.sum(-1, keepdim=True)
        factor = torch.where(total > 0, positive[..., :base].sum(-1, keepdim=True) / total, factor)
    adjusted = (ranked * factor).reshape(B, H * n)
    top = adjusted.sort(dim=-1, descending=True, stable=True).indices[:, : H * base]
    counts = torch.zeros(B, H, dtype=ranked.dtype, device=ranked.device)
    counts.scatter_add_(1, top // n, torch.ones_like(top, dtype=ranked.dtype))
    target = counts * (1 - alpha) + alpha * base
    whole = (target - 1e-9).floor()  # never above the exact floor, so at most H slots are left to hand out
    short = H * base - whole.sum(-1, keepdim=True)
    order = (target - whole).sort(dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(H, device=order.device).expand(B, H))
    return (whole + (rank < short)).long(), factor


class AdaKVCache(PoolCache, ScoredCache):
    """Ada-KV (Feng et al., arXiv:2407.11550): per layer the top H_kv x B pairs across KV heads, a floor each.

    Prompt: the sinks and the last max(window, recent_window - 1) tokens of every head are kept; the other
    H_kv x B' pairs (B' = B - those) are chosen by `adakv_budgets` (adakv_floor = Ada-KV's floor_alpha, 0.2;
    adakv_normalize = its `normalize`) from the scores of any prompt compressor (default SnapKV: w = 32,
    kernel 7, max pooling, Ada-KV's settings; with kvzip and adakv_floor 0 the pairs are KVzip's joint top-k
    across heads, as kvpress's KVzipPress ranks them), each head keeping its top-b_h. Every head keeps at
    least its protected tokens + floor(alpha B') slots, at prefill and during decoding.

    Decode (Ada-KV itself appends and never evicts): one score per slot, comparable across heads, score =
    prior + attention paid by decode queries (group-reduced by gqa_reduce, accumulated), where the prior is
    the pair's (normalized) prompt score, the protected prompt tokens taking their head's highest, and decoded
    tokens start at 0 (recent_window 32 = Ada-KV's window protects them meanwhile). Every query head spends
    one unit of attention per step over its own KV head's slots, so accumulated attention is on one scale
    across heads: evicting the lowest loses the least attention mass, the quantity Ada-KV's bound (L1 output
    loss <= attention mass evicted, summed over heads) is about; with an attention compressor (snapkv, h2o,
    kvzip) the prior is that mass as the prompt's queries paid it. A prompt that fits is not scored: its
    tokens start at 0 like decoded ones. Cost: one scan of P scores per KV head per step."""

    name = "adakv"
    needs_attention = True
    params = (N_SINKS, RECENT_WINDOW(32),
              Param("adakv_floor", 0.2, "Ada-KV's floor_alpha, the share of the average per-head budget "
                    "every KV head keeps (0 = pure top-k across heads)", check=fraction),
              Param("adakv_normalize", True, "scale each head's prompt scores by the share of its top-B' in "
                    "its total (Ada-KV's normalize) before ranking across heads", check=boolean),
              GQA_REDUCE)
    default_prompt_compressor = "snapkv"
    statistic = "score"  # prior + attention paid since

    @property
    def base_capacity(self) -> int:
        """Ada-KV's B': the selected (not protected) slots per head on average."""
        return self.policy_capacity - self.n_sinks - self.protected_prompt()

    @property
    def head_floor(self) -> int:
        protected = self.n_sinks + self.protected_prompt()
        # a budget that holds less than the prompt's protected tokens (a prompt that fits) caps it at B
        return min(protected + int(self.adakv_floor * max(self.base_capacity, 0)), self.policy_capacity)

    def select_pairs(self, q: Tensor, k: Tensor, v: Tensor, memo: dict) -> tuple[Tensor, Tensor]:
        B, H, S, _ = k.shape
        scores = self.compressor.cached_scores(q, k, memo, v).double().expand(B, H, S)
        pos = torch.arange(S, device=k.device)
        protected = (pos < self.n_sinks) | (pos >= S - self.protected_prompt())
        candidates = scores[..., ~protected]  # [B, H, n]
        base = self.policy_capacity - int(protected.sum())
        budgets, factor = adakv_budgets(candidates, base, self.adakv_floor, self.adakv_normalize)
        order = candidates.sort(dim=-1, descending=True, stable=True).indices
        n = candidates.shape[-1]
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=k.device).expand_as(order))
        keep = protected.expand(B, H, S).clone()
        keep[..., ~protected] = rank < budgets.unsqueeze(-1)
        prior = candidates * factor
        top = prior.amax(-1, keepdim=True) if n else torch.zeros(B, H, 1, dtype=prior.dtype, device=k.device)
        full = top.expand(B, H, S).clone()
        full[..., ~protected] = prior
        return keep, full

    def slot_scores(self, input_pos: Tensor) -> Tensor:
        return self.score

    def observe(self, probs: Tensor) -> None:
        # a slot's attention is nonzero only in its own KV head's row: the sum over heads picks it out
        self.score.add_(reduce_groups(probs[:, :, :, 0], self.gqa_reduce).sum(1))

    def prefill_state(self, q: Tensor, k: Tensor, prior: Tensor | None, memo: dict) -> None:
        if prior is not None:
            self.score.copy_(prior.float())


POOL_POLICIES: dict[str, type[KVCache]] = {AdaKVCache.name: AdaKVCache}
