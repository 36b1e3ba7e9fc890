"""eval.py's cache side: prefill a batch once and replay it into every policy's caches (Evaluator), and the
wrappers that make that possible: record a prefill, follow a full cache in its shadow, batch many policies.

The wrappers hold real policy caches from cache.py (no second cache implementation) behind the same interface
the model's attention calls: prefill / update / observe / refresh / reset.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import cache as kvcache
from decode import Decoder
from kv import kvzip
from kv.contract import AttentionCache
from kv.report import bytes_of, full_kv_bytes, slots_for_bytes
from kv.tiers import DEFAULTS as TIER_FLAG_DEFAULTS
from kv.tiers import TIER_FLAGS, add_tier_args, resolve_tiers, tier_report
from model import KVFastError, Transformer

# ---- tier combos (POLICY+warm): the policy and budget with kv.tiers on -------------------------------------------
WARM = "+warm"
SHIFT = "+shift"  # POLICY+shift: the policy with --pos-shift (StreamingLLM's positions)
KV = "+kv"  # POLICY+kv16 / +kv8 / +kv4, last: the policy with --kv-bits (16-bit floats, 8 / 4-bit codes)
# what a +warm combo gets for a tier flag left out (kv.tiers' own defaults, --warm-tokens included: eval and bench
# turn tiers on by the combo, not by the flag); a combo's name lists the settings that differ from these
TIER_DEFAULTS: dict[str, float] = {"warm_tokens": 1.0, **TIER_FLAG_DEFAULTS}
# tier_report keys that do not add up over a batch's rows, kept as they are when counters are taken per sample:
# settings, and recalls (one per layer and recall step, whatever the rows)
TIER_SETTINGS_KEYS = ("page_size", "warm_bits", "recall_slots", "layers", "recalls")


def add_tier_flags(parser: argparse.ArgumentParser, where: str) -> None:
    """kv.tiers' flags (same names as generate.py's), default None so that given flags can be told apart;
    tier_settings() fills in TIER_DEFAULTS."""
    add_tier_args(parser, f"KV tiers ({where})", warm_tokens_help="with a +warm combo (default 1.0): ")


def given_tier_flags(args: argparse.Namespace) -> list[str]:
    return [f"--{k.replace('_', '-')}" for k in TIER_FLAGS if getattr(args, k, None) is not None]


def tier_settings(args: argparse.Namespace) -> dict[str, float]:
    """The tier settings of a +warm combo: the flags given, TIER_DEFAULTS for the rest (TIER_FLAGS order),
    checked (kv.tiers.resolve_tiers) as far as they can be without a length: bits, page size, signs, whole
    numbers, an absolute warm store of at least one page. Length-dependent checks come with the caches."""
    settings = {k: TIER_DEFAULTS[k] if getattr(args, k, None) is None else getattr(args, k) for k in TIER_FLAGS}
    huge = 1 << 40  # no length-dependent limit can bite
    resolve_tiers(settings, total=huge, hot_budget=huge, kv_bits=None)
    return settings


def combo_kv_bits(name: str) -> tuple[str, int | None]:
    """'h2o+warm+kv4' -> ('h2o+warm', 4); 'h2o' -> ('h2o', None). Bits other than 16, 8 or 4 are an error."""
    head, sep, bits = name.rpartition(KV)
    if not sep:
        return name, None
    if bits not in ("16", "8", "4"):
        raise KVFastError(f"--policies {name}: {KV}{bits} is not a K/V format (+kv16, +kv8 or +kv4)")
    return head, int(bits)


def split_combo_policy(name: str) -> tuple[str, bool, bool]:
    """'h2o+warm' -> ('h2o', True, False); 'window+shift' -> ('window', False, True); 'h2o' -> ('h2o', False,
    False); a +kvN suffix is left out (combo_kv_bits)."""
    name = combo_kv_bits(name)[0]
    shift = name.endswith(SHIFT)
    name = name[: -len(SHIFT)] if shift else name
    if name.endswith(WARM):
        return name[: -len(WARM)], True, shift
    return name, False, shift


def tier_fields(caches: list[nn.Module], rows: int) -> dict[str, Any]:
    """A tiered group's counters (kv.tiers.tier_report, read once), per sample: every amount that sums over the
    batch's rows divided by them (so rows_heads_layers becomes KV heads x layers), settings and recalls (layers
    x recall steps) kept; no fields without tiers."""
    r = tier_report(caches)
    if r is None:
        return {}
    return {"tier_counters": {k: v if k in TIER_SETTINGS_KEYS else v / rows for k, v in r.items()}}


class ShadowCaches(AttentionCache):
    """Attention-loss probe for one layer: the model attends to a full cache; policy caches follow every step.

    Each follower receives the same tokens and the full attention restricted to its own slots (unnormalised, as
    in cold-compress's KVCacheAnalysis); its loss at step t is the attention mass on the tokens it evicted,
    1 - sum of the full attention over the tokens it still holds, averaged over heads.

    Tiered followers (kv.tiers) are flushed and recall as they would alone: `tiers` is theirs, so
    decode.Decoder calls flush() every page_size positions and recalls on its schedule; recall(q) runs their
    recall with the model's query before the step's update. A token in a follower's recall slots is held, so
    its loss is the attention mass on what is neither hot nor recalled. All tiered followers of one shadow
    share one schedule (page size and recall interval); untiered ones are never flushed nor recall."""

    needs_attention = True

    def __init__(self, full: nn.Module, followers: list[nn.Module], total_len: int):
        super().__init__()
        self.full, self.followers = full, nn.ModuleList(followers)
        self.refresh_interval = followers[0].refresh_interval
        self.compile_refresh = all(f.compile_refresh for f in followers)
        self.tiered_followers = [f for f in followers if f.tiers is not None]
        schedules = {(f.tiers.page_size, f.tiers.recall_interval) for f in self.tiered_followers}
        if len(schedules) > 1:
            raise ValueError(f"tiered followers flush and recall on different schedules {schedules}")
        self.tiers = self.tiered_followers[0].tiers if self.tiered_followers else None
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
            if f.layout == "pool":  # slots of every head in one pool: gathered by (owner, position)
                kept = f.restrict(p)
            else:
                index = f.slot_pos.clamp(min=0).unsqueeze(2).expand(B, H, g, -1)
                kept = p.gather(-1, index) * (f.slot_pos >= 0).unsqueeze(2)
            losses.append(1 - kept.sum(-1).mean(dim=(1, 2)))
            if f.needs_attention:
                f.observe(kept.unsqueeze(3))
        self.loss.index_copy_(2, self.pos, torch.stack(losses).unsqueeze(-1))

    def refresh(self) -> None:
        for f in self.followers:
            f.refresh()

    def flush(self) -> None:
        for f in self.tiered_followers:
            f.flush()

    def recall(self, q: Tensor) -> None:
        for f in self.tiered_followers:
            f.recall(q)

    def see_tokens(self, idx: Tensor) -> None:
        for f in self.followers:  # fastgen classes tokens by them (kv.fastgen)
            f.see_tokens(idx)


class MultiCache(AttentionCache):
    """Several policies' caches for one layer, decoded as one batch: rows [i B, (i + 1) B) belong to member i.

    The members' k, v and slot_pos become views into shared buffers padded to the largest capacity (padding slots
    stay empty, hence masked), so one decode step reads the weights once for every policy and budget of the group,
    while each member updates, observes and refreshes only its own rows and slots, exactly as it would alone."""

    def __init__(self, members: list[nn.Module]):
        super().__init__()
        self.members = nn.ModuleList(members)
        self.needs_attention = any(m.needs_attention for m in members)
        intervals = {m.refresh_interval for m in members} - {None}
        if len(intervals) > 1:
            raise ValueError(f"members refresh at different intervals {intervals}")
        self.refresh_interval = next(iter(intervals), None)
        self.compile_refresh = all(m.compile_refresh for m in members)
        if any(m.kv_bits for m in members):
            raise ValueError("MultiCache shares full-precision K/V buffers; quantized K/V is not batched")
        if any(m.layout == "pool" for m in members):
            raise ValueError("MultiCache views [B, H_kv, C, D] buffers; a pool cache decodes in a group "
                             "of its own")
        if any(m.pos_shift for m in members):
            raise ValueError("MultiCache returns unrotated shared keys; a --pos-shift cache decodes in a group of its own")
        if any(m.tiers is not None for m in members):
            raise ValueError("MultiCache neither flushes nor recalls; a tiered cache decodes in a group of its own")
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


def policy_params(policy: str) -> set[str]:
    """Hyper-parameters a policy and its prompt compressor use (window's recent window is what the budget sets)."""
    cls = kvcache.POLICIES[policy]
    comp = kvcache.PROMPT_COMPRESSORS.get(cls.default_prompt_compressor or "")
    return (set(cls.params) | set(comp.params if comp else ())) - ({"recent_window"} if cls.window_fills_capacity
                                                                   else set())


@dataclass(frozen=True)
class Combo:
    policy: str
    budget: float | None  # None: full, no compression
    tiers: tuple[tuple[str, float], ...] | None = None  # POLICY+warm: kv.tiers settings (TIER_FLAGS order)
    pos_shift: bool = False  # POLICY+shift
    kv_bits: int | None = None  # POLICY+kvN: --kv-bits N

    @property
    def is_full(self) -> bool:
        return self.budget is None

    @property
    def name(self) -> str:
        """The policy as results record it: h2o, h2o+warm, or h2o+warm[warm-bits=8] when tier settings differ
        from TIER_DEFAULTS (so that cells of other settings are other cells)."""
        shift = SHIFT if self.pos_shift else ""
        bits = f"{KV}{self.kv_bits}" if self.kv_bits else ""
        if self.tiers is None:
            return self.policy + shift + bits
        changed = [f"{k.replace('_', '-')}={v:g}" for k, v in self.tiers if v != TIER_DEFAULTS[k]]
        return self.policy + WARM + (f"[{','.join(changed)}]" if changed else "") + shift + bits

    def label(self) -> str:
        if self.is_full:
            return "full"
        return f"{self.policy}@{self.budget:g}{self.name[len(self.policy):]}"


# ---- prefill once, replay into every policy's caches -----------------------------------------------------
class Evaluator:
    def __init__(self, model: Transformer, tokenizer: Any, args: argparse.Namespace):
        self.model, self.tok, self.args = model, tokenizer, args
        self.decoder = Decoder(model, compile=args.compile, scope=args.compile_scope)
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.bank: dict[tuple, list[nn.Module]] = {}
        self.byte_budgets: dict[tuple, Any] = {}
        self.stop_ids = getattr(tokenizer, "stop_ids", None) or None
        self.n_layers = model.args.n_layers

    # -- caches
    def factory(self, combo: Combo, B: int, prompt_len: int, max_new: int) -> kvcache.CacheFactory:
        """The combo's caches: its budget in slots, or (--budget-unit bytes) the slots and warm tokens that hold
        that fraction of the full cache's bytes (byte_budget)."""
        budget, tiers = combo.budget, dict(combo.tiers) if combo.tiers else None
        if budget is not None and getattr(self.args, "budget_unit", "slots") == "bytes":
            budget, warm = self.byte_budget(combo, prompt_len, max_new)
            tiers = tiers and {**tiers, "warm_tokens": warm}
        return self.make_factory(combo, B, prompt_len, max_new, budget, tiers)

    def make_factory(self, combo: Combo, B: int, prompt_len: int, max_new: int, budget: float | None,
                     tiers: dict | None) -> kvcache.CacheFactory:
        params = {k: v for k, v in self.args.params.items() if k in policy_params(combo.policy)}
        return kvcache.make_cache_factory(combo.policy, B, self.model.args, prompt_len, max_new, budget=budget,
                                          dtype=self.dtype, device=self.device, tokenizer=self.tok, tiers=tiers,
                                          pos_shift=combo.pos_shift, kv_bits=combo.kv_bits, **params)

    def byte_budget(self, combo: Combo, prompt_len: int, max_new: int) -> tuple[int, int | None]:
        """Slots per layer (and, for a +warm combo, warm tokens: --warm-share of the bytes) whose caches hold at
        most combo.budget of the full cache's bytes for prompt_len + max_new tokens (kv.report's accounting)."""
        key = (combo, prompt_len, max_new)
        if key not in self.byte_budgets:
            total = prompt_len + max_new
            tiers = dict(combo.tiers) if combo.tiers else None

            def make(slots: int, warm: int | None) -> kvcache.CacheFactory:
                return self.make_factory(combo, 1, prompt_len, max_new, slots, tiers and {**tiers, "warm_tokens": warm})

            share = self.args.warm_share if tiers else 0.0
            page = int(tiers["page_size"]) if tiers else 1
            full = full_kv_bytes(self.model.args, 1, total, self.dtype)
            self.byte_budgets[key] = slots_for_bytes(make, combo.budget, full, total, share, page,
                                                     f"{combo.label()} at {prompt_len} + {max_new} tokens")
        return self.byte_budgets[key]

    def bytes_fields(self, combo: Combo, B: int, prompt_len: int, max_new: int) -> dict[str, Any]:
        """What the combo's caches hold (kv.report.cache_bytes: K/V as stored, positions, statistics, warm tier)
        as a share of the full cache's K/V for prompt_len + max_new tokens; in bytes mode the slots (and warm
        tokens) that budget gave. Computed from the shapes (meta device), once per size."""
        key = (combo, B, prompt_len, max_new, "fields")
        if key not in self.byte_budgets:
            full = full_kv_bytes(self.model.args, B, prompt_len + max_new, self.dtype)
            parts = bytes_of(self.factory(combo, B, prompt_len, max_new))
            fields: dict[str, Any] = {"bytes_frac": round(sum(parts.values()) / full, 5),
                                      "bytes": {k: round(v / full, 5) for k, v in parts.items()}}
            if combo.budget is not None and getattr(self.args, "budget_unit", "slots") == "bytes":
                slots, warm = self.byte_budget(combo, prompt_len, max_new)
                fields |= {"slots": slots, **({"warm_tokens": warm} if warm else {})}
            self.byte_budgets[key] = fields
        return self.byte_budgets[key]

    def check_tiered(self, combos: list[Combo], sizes: set[tuple[int, int]]) -> None:
        """Tier settings that do not fit a (prompt length, new tokens) size (a warm store smaller than a page,
        recall slots that take the whole hot budget) fail here, in one line, before any work."""
        for combo in combos:
            if combo.tiers is not None:
                for length, room in sorted(sizes):
                    try:
                        self.factory(combo, 1, length, room)
                    except KVFastError as e:
                        raise KVFastError(f"{combo.label()} at {length} tokens: {e}") from None

    def caches(self, combo: Combo, B: int, prompt_len: int, max_new: int) -> list[nn.Module]:
        """One cache per layer for (combo, batch, lengths). Compiled: built once per shape and kept (the same
        modules keep the compiled step valid); eager: built afresh, so only the caches in use hold memory."""
        key = (combo, B, prompt_len, max_new)
        if key in self.bank:
            return self.bank[key]
        factory = self.factory(combo, B, prompt_len, max_new)
        caches = [factory(i) for i in range(self.n_layers)]
        if self.args.compile:
            self.bank[key] = caches
        return caches

    def groups(self, combos: list[Combo], B: int, prompt_len: int, max_new: int) -> list[list[Combo]]:
        """Combos decoded together: full alone; pool policies (kv.pool: one [B, P, D] pool per layer, which
        MultiCache cannot view) alone; the others by budget, within --group-gb of K/V buffers and with at most
        one refresh interval (the decode loop refreshes every member at that interval); tiered combos (+warm)
        last, each alone (the decode loop flushes and recalls the caches it runs; MultiCache does neither), as are
        POLICY+shift combos (MultiCache's shared K/V would need every member's ranks) and POLICY+kvN combos
        (MultiCache shares one buffer in the compute dtype)."""
        tiered = [c for c in combos if c.tiers is not None or c.pos_shift or c.kv_bits]
        pool = [c for c in combos if not c.is_full and kvcache.POLICIES[c.policy].layout == "pool"
                and c not in tiered]
        out = [[c] for c in combos if c.is_full] + [[c] for c in pool]
        combos = [c for c in combos if c not in pool and c not in tiered]
        a = self.model.args
        slot_bytes = B * a.n_layers * 2 * a.n_kv_heads * a.head_dim * torch.finfo(self.dtype).bits // 8
        by_budget: dict[float, list[Combo]] = {}
        for c in combos:
            if not c.is_full:
                by_budget.setdefault(c.budget, []).append(c)
        for group in by_budget.values():
            current: list[Combo] = []
            widest, interval = 0, None
            for c in group:
                f = self.factory(c, B, prompt_len, max_new)
                width = max(f.capacities)
                every = f(0).refresh_interval if f.cls.refresh is not kvcache.KVCache.refresh else None
                rows = len(current) + 1
                too_big = rows * max(widest, width) * slot_bytes > self.args.group_gb * 1e9
                if current and (too_big or (every and interval and every != interval)):
                    out.append(current)
                    current, widest, interval = [], 0, None
                current.append(c)
                widest, interval = max(widest, width), interval or every
            out.append(current)
        return out + [[c] for c in tiered]

    def group_caches(self, group: list[Combo], B: int, prompt_len: int, max_new: int) -> list[nn.Module]:
        members = [self.caches(c, B, prompt_len, max_new) for c in group]
        if len(group) == 1:
            return members[0]
        key = (tuple(group), B, prompt_len, max_new, "multi")
        if key not in self.bank:
            caches = [MultiCache([m[i] for m in members]) for i in range(self.n_layers)]
            if not self.args.compile:
                return caches
            self.bank[key] = caches
        return self.bank[key]

    def install(self, caches: list[nn.Module]) -> None:
        self.model.setup_caches(lambda i: caches[i])

    def prefill_dtype(self) -> torch.dtype | None:
        name = getattr(self.args, "prefill_dtype", None)
        return getattr(torch, name) if name else None

    def record(self, ids: Tensor) -> tuple[list[tuple[Tensor, Tensor, Tensor]], Tensor]:
        """The one real prefill of a batch: per-layer (q, k, v) and the final hidden states [B, S, dim]."""
        chunk = getattr(self.args, "prefill_chunk", None) or None
        return kvzip.record_prefill(self.model, ids, chunk, self.prefill_dtype())

    def fill(self, caches: list[nn.Module], kv: list[tuple[Tensor, Tensor, Tensor]], n: int, memos: list[dict],
             ids: Tensor) -> None:
        """Prefill the first n recorded tokens (ids [B, >= n]) into caches; KVzip's reconstruction scores, if a
        cache needs them, are computed once into the memos."""
        self.kvzip_s = kvzip.score_into(self.model, ids[:, :n], kv, caches, memos, self.prefill_dtype())
        for c, (q, k, v), memo in zip(caches, kv, memos):
            c.reset()
            c.see_tokens(ids[:, :n])  # fastgen classes the prompt's tokens (kv.fastgen)
            c.prefill(q[:, :, :n], k[:, :, :n], v[:, :, :n], memo=memo)

    @staticmethod
    def state(cache: nn.Module) -> list[Tensor]:
        return cache.state() if isinstance(cache, MultiCache) else list(cache.buffers())

    def snapshot(self, caches: list[nn.Module]) -> list[list[Tensor]]:
        return [[b.clone() for b in self.state(c)] for c in caches]

    def restore(self, caches: list[nn.Module], state: list[list[Tensor]]) -> None:
        for c, saved in zip(caches, state):
            for b, s in zip(self.state(c), saved):
                b.copy_(s)

    # -- decoding (all through decode.Decoder)
    def feed(self, chunk: Tensor, start_pos: int) -> Tensor:
        """Extend the caches by a chunk (teacher-forced steps); the logits after its last token [B, 1, V]."""
        last: list[Tensor] = []
        n = chunk.shape[1]
        self.decoder.decode(chunk[:, :1], start_pos, n, forced=chunk[:, 1:],
                            on_logits=lambda i, logits: last.append(logits) if i == n - 1 else None)
        return last[0]

    def greedy(self, first: Tensor, pos: int, n: int, stop: bool, keep: bool) -> tuple[Tensor, Tensor | None]:
        """n greedy tokens from the logits `first` [B, 1, V] (the next input at `pos`); optionally their log-probs."""
        logprobs = [F.log_softmax(first[:, 0].float(), -1)] if keep else []
        token = first[:, -1].argmax(-1, keepdim=True)
        out = [token]
        if n > 1:
            hook = (lambda i, logits: logprobs.append(F.log_softmax(logits[:, 0].float(), -1))) if keep else None
            out.append(self.decoder.decode(token, pos, n - 1, temperature=0.0, stop_ids=self.stop_ids if stop else None,
                                           on_logits=hook))
        return torch.cat(out, 1), (torch.stack(logprobs, 1) if keep else None)

    def follow(self, first: Tensor, pos: int, ref_tokens: Tensor, ref_lp: Tensor) -> dict[str, Tensor]:
        """Teacher-force full's greedy tokens ([B, N], log-probs [B, N, V]) through caches holding G x B rows;
        per row: mean KL(full || this), top-1 agreement, length of the greedy prefix that matches full."""
        N = ref_tokens.shape[1]
        G = first.shape[0] // ref_tokens.shape[0]
        kl, agree = [], []

        def compare(i: int, logits: Tensor) -> None:
            lp = F.log_softmax(logits[:, 0].float(), -1).view(G, -1, logits.shape[-1])  # [G, B, V]
            ref = ref_lp[:, i]  # [B, V]
            kl.append((ref.exp() * (ref - lp)).sum(-1).clamp(min=0).flatten())
            agree.append((lp.argmax(-1) == ref_tokens[:, i]).flatten())

        compare(0, first)
        if N > 1:
            tokens = ref_tokens.repeat(G, 1)
            self.decoder.decode(tokens[:, :1], pos, N - 1, forced=tokens[:, 1:],
                                on_logits=lambda i, logits: compare(i + 1, logits))
        a = torch.stack(agree, 1)
        return {"kl": torch.stack(kl, 1).mean(1), "top1": a.float().mean(1), "prefix": a.long().cumprod(1).sum(1).float()}

    def nll_from_hidden(self, hidden: Tensor, ids: Tensor, chunk: int = 256) -> Tensor:
        """Negative log-likelihood of ids[:, 1:] from the batched pass: [B, S - 1] (logits in chunks)."""
        out = []
        for s in range(0, ids.shape[1] - 1, chunk):
            e = min(s + chunk, ids.shape[1] - 1)
            lp = F.log_softmax(self.model.logits(hidden[:, s:e]), -1)
            out.append(-lp.gather(-1, ids[:, s + 1 : e + 1, None])[..., 0])
        return torch.cat(out, 1)

    def decode_nll(self, ids: Tensor, start: int) -> Tensor:
        """NLL of ids[:, start+1:] teacher-forced through the decode step from position `start` (caches hold
        positions < start): [B, S - 1 - start]."""
        steps: list[Tensor] = []
        n = ids.shape[1] - 1 - start

        def on_logits(i: int, logits: Tensor) -> None:
            lp = F.log_softmax(logits[:, 0].float(), -1)
            steps.append(-lp.gather(-1, ids[:, start + 1 + i, None])[:, 0])

        if n > 0:
            self.decoder.decode(ids[:, start : start + 1], start, n, forced=ids[:, start + 1 :], on_logits=on_logits)
        return torch.stack(steps, 1) if steps else ids.new_zeros(ids.shape[0], 0, dtype=torch.float)
