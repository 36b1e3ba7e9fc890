"""Tiers (DESIGN.md, "Tiers"): an evicting policy demotes what it evicts to a quantized warm store, and the
pages the current query needs come back, instead of every evicted token being gone for good.

HOT   the policy's slots. The last R of them (--recall-slots, whole pages) are reserved for recalled pages
      (KVCache.recall_slots; on hybrid's pool, R per KV head after the policy's slots, kv.pool): the policy
      never prefills, fills or evicts them; attention reads them as any slot. R comes out of the budget: the hot
      bytes are the budget's, as without tiers.
WARM  per (row, KV head), a ring of pages of P tokens (--page-size), quantized once with kv.quant
      (--warm-bits): keys per channel over the page (KIVI's layout: a page's keys share one scale and zero
      point per channel, so an outlier channel does not flatten the others), values per token. With --kv-bits
      the hot codes are copied as they are, never re-quantized. Per page, the positions and Quest's
      per-channel key min / max, which recall scores (the per-channel zero point and top code: not stored twice).
COLD  a page the ring overwrites (the oldest) is dropped and counted.

Per decode step, inside the compiled step, the policy's victim is copied in the hot format to a staging page
(column = position mod P; an empty victim leaves its column empty). Every P steps the loop calls flush(), compiled
separately: each (row, head)'s staged tokens become one warm page. On recall steps (decode.Decoder: the
first step of every decode call, every token of a fed chunk such as a question, and every --recall-interval
positions while generating) each layer scores its warm pages against the current query before it
attends: Quest's bound sum over channels of max(q kmin, q kmax), max over the GQA group; the top R / P pages
per (row, KV head) are chosen. A chosen page already in a recall slot is a hit and stays there; the best misses,
at most --recall-installs of them per recall, are dequantized into slots whose page was not chosen (the rest
wait for the next recall, which comes at the next fed or generated token by default; a miss is counted when it
is installed). Prefill with prompt compression demotes the prompt tokens it drops straight to warm pages, in
position order, so a compressed prompt is recallable too.

Counters (device tensors, read once at the end; COUNTERS): tokens demoted, pages flushed by decoding and
written by prefill, pages and tokens dropped cold, recall calls, page hits and misses. Bytes moved hot -> warm
= pages written x page bytes; warm -> hot = misses x page bytes (a page in its warm format).

Deviation from a CUDA design with the warm store in pinned host memory and asynchronous copies: here it
lives on the compute device everywhere: recall runs inside the compiled step, which cannot read host memory.
On CPU (this project's machines) that is the same memory anyway; the byte accounting is the one a host store
would have. A recall step writes a fixed number of pages (static shapes): the installed misses, and where
there are fewer, slots rewritten with the page they hold; only misses are counted as moved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kv.quant import dequantize_channels, dequantize_tokens, quantize_channels, quantize_tokens, storage_width
from kv.slots import KVCache
from kv.storage import INF, put_rows
from model import KVFastError

TIER_FLAGS = ("warm_tokens", "warm_bits", "page_size", "recall_slots", "recall_interval", "recall_installs")
COUNTERS = ("demoted_tokens", "flushed_pages", "prompt_pages", "cold_pages", "cold_tokens", "recalls",
            "recall_hits", "recall_misses")
RECALL_COUNTERS = [COUNTERS.index(n) for n in ("recalls", "recall_hits", "recall_misses")]  # a list: one index op
WARM_PARTS = ("k", "k_scale", "k_zero", "v", "v_scale", "v_zero")
WARM_BITS = (8, 4)
# scales and zero points of warm pages: fp16 halves what they cost (at pages of 4 tokens the keys' per-channel pair
# would be 4x their 4-bit codes in fp32). Codes are computed with the fp32 ones and only the stored pair is
# rounded, so compiled and eager store the same codes (kv.quant's note) and a page's bounds stay exact bounds of
# the keys recall installs (code x scale + zero with codes in [0, top])
WARM_SCALE_DTYPE = torch.float16
# what a tier flag left out means (--warm-tokens turns tiers on; eval's +warm combos default it to 1.0). Measured on
# query-agnostic passkey and niah_multikey (2048 tokens, h2o and window at 25 %; docs/tiers.md): pages of 4
# tokens (16 caught half a needle and missed the digits that follow), three quarters of the hot budget for
# recall, and a recall at every step (a 7-digit value crosses pages while it is being copied; every 4 steps lost it).
# A recall installs at most a quarter of the recall pages (the best misses; hits stay): on 16 of those samples every
# answer was token-identical to installing all of them, and the recall step does a quarter of the copies
DEFAULTS = {"warm_bits": 4, "page_size": 4, "recall_slots": 0.75, "recall_interval": 1, "recall_installs": 0.25}


@dataclass(frozen=True)
class TierSpec:
    """What the tier flags resolve to, per (row, KV head): pages in the warm ring, recall pages, etc."""

    page_size: int
    warm_pages: int
    warm_bits: int
    recall_slots: int
    recall_interval: int
    recall_installs: int  # pages a recall may bring in per (row, KV head), at most

    @property
    def recall_pages(self) -> int:
        return self.recall_slots // self.page_size


def resolve_tiers(flags: dict[str, float | None], *, total: int, hot_budget: int, kv_bits: int | None) -> TierSpec:
    """Check the tier flags (TIER_FLAGS; None or missing = DEFAULTS) against the sequence length (prompt + new
    tokens) and the smallest layer budget."""
    warm_tokens, warm_bits, page_size, recall_slots, recall_interval, recall_installs = (
        flags.get(name) for name in TIER_FLAGS)
    page = DEFAULTS["page_size"] if page_size is None else page_size
    if page != int(page) or page < 1:
        raise KVFastError(f"--page-size must be a whole number >= 1, got {page:g}")
    page = int(page)
    if warm_tokens <= 0:
        raise KVFastError(f"--warm-tokens must be > 0, got {warm_tokens:g}")
    tokens = math.ceil(warm_tokens * total) if warm_tokens <= 1 else warm_tokens
    if tokens != int(tokens):
        raise KVFastError(f"--warm-tokens above 1 is a number of tokens and must be whole, got {warm_tokens:g}")
    if tokens < page:
        raise KVFastError(f"--warm-tokens gives a warm store of {int(tokens)} tokens per KV head, smaller than one "
                          f"page ({page} tokens, --page-size)")
    bits = warm_bits if warm_bits is not None else (kv_bits or DEFAULTS["warm_bits"])
    if bits not in WARM_BITS:
        raise KVFastError(f"--warm-bits must be {' or '.join(map(str, WARM_BITS))}, got {bits}")
    if kv_bits and bits != kv_bits:
        raise KVFastError(f"--warm-bits {bits} with --kv-bits {kv_bits}: a token is quantized once, so the warm "
                          "tier keeps the hot codes; give the same bits (or leave --warm-bits out)")
    slots = DEFAULTS["recall_slots"] if recall_slots is None else recall_slots
    if slots < 0:
        raise KVFastError(f"--recall-slots must be >= 0, got {slots:g}")
    if 0 < slots < 1:  # a fraction of the hot budget, in whole pages, at least one
        slots = max(page, int(slots * hot_budget) // page * page)
    elif slots != int(slots) or slots % page:
        raise KVFastError(f"--recall-slots {slots:g} must be a whole number of pages ({page} tokens, --page-size)")
    slots = int(slots)
    if slots >= hot_budget:
        raise KVFastError(f"--recall-slots {slots} does not fit the hot budget of {hot_budget} slots per KV head "
                          "(the policy needs the rest)")
    pages = math.ceil(int(tokens) / page)
    if slots > pages * page:
        raise KVFastError(f"--recall-slots {slots} exceed the warm store ({pages} pages of {page} tokens): nothing "
                          "could fill them")
    interval = DEFAULTS["recall_interval"] if recall_interval is None else recall_interval
    if interval != int(interval) or interval < 1:
        raise KVFastError(f"--recall-interval must be a whole number >= 1, got {interval:g}")
    installs = DEFAULTS["recall_installs"] if recall_installs is None else recall_installs
    recall_pages = slots // page
    if 0 < installs <= 1:  # a fraction of the recall pages, at least one
        installs = max(1, math.ceil(installs * recall_pages)) if recall_pages else 0
    elif installs != int(installs) or installs < 1:
        raise KVFastError(f"--recall-installs must be a fraction in (0, 1] or a whole number of pages above 1, "
                          f"got {installs:g}")
    return TierSpec(page, pages, bits, slots, int(interval), min(int(installs), recall_pages))


class Tiers:
    """Mixed into an evicting policy by tiered(cls): the policy still chooses what leaves its slots; this keeps it
    (demote), brings it back (recall) and counts every byte that moves. Shapes never change."""

    supports_pos_shift = False  # recalled pages would need ranks among the hot tokens: not built

    def __init__(self, *args, tiers: TierSpec, **kwargs):
        self.recall_slots = tiers.recall_slots  # before the layout is allocated: the pool places them (kv.pool)
        super().__init__(*args, **kwargs)
        self.tiers = tiers
        self.page_size, self.warm_bits = tiers.page_size, tiers.warm_bits
        self.recall_pages = tiers.recall_pages
        self.warm_group = self.kv_group_size or self.head_dim
        self.key_channels = not self.kv_bits  # keys quantized per channel over a page (else the hot codes)
        B, H, P, NP, D = self.batch_size, self.n_kv_heads, tiers.page_size, tiers.warm_pages, self.head_dim
        dev = self.device
        for name in self.kv_buffers():  # staging, in the hot format: column = position mod P
            hot = getattr(self, name)
            self.register_buffer(f"stage_{name}", hot.new_zeros(B, H, P, hot.shape[-1]), persistent=False)
        self.register_buffer("stage_pos", torch.full((B, H, P), -1, dtype=torch.long, device=dev),
                             persistent=False)
        width, groups = storage_width(D, self.warm_bits), D // self.warm_group
        for name in WARM_PARTS:  # every part page-shaped [B, H, pages, tokens, ...]
            scale_dtype = torch.float32 if self.kv_bits else WARM_SCALE_DTYPE  # --kv-bits: the hot codes' own
            shape, dtype = ((P, width), torch.uint8) if name in ("k", "v") else ((P, groups), scale_dtype)
            if self.key_channels and name in ("k_scale", "k_zero"):
                shape = (1, D)
            self.register_buffer(f"warm_{name}", torch.zeros(B, H, NP, *shape, dtype=dtype, device=dev),
                                 persistent=False)
        self.register_buffer("page_pos", torch.full((B, H, NP, P), -1, dtype=torch.long, device=dev),
                             persistent=False)
        if not self.key_channels:  # Quest's summaries of the hot codes; per-channel pages carry them (quest_bound)
            for name in ("page_kmin", "page_kmax"):
                self.register_buffer(name, torch.zeros(B, H, NP, D, device=dev), persistent=False)
        self.register_buffer("page_ptr", torch.zeros(B, H, dtype=torch.long, device=dev), persistent=False)
        self.register_buffer("recall_page", torch.full((B, H, tiers.recall_pages), -1, dtype=torch.long,
                                                       device=dev), persistent=False)
        self.register_buffer("traffic", torch.zeros(len(COUNTERS), dtype=torch.long, device=dev),
                             persistent=False)

    # ---- formats ------------------------------------------------------------------------------------------
    def page_bytes(self) -> int:
        """Bytes of one warm page of one (row, KV head): K and V codes, scales and zero points."""
        return sum(getattr(self, f"warm_{n}")[0, 0, 0].nbytes for n in WARM_PARTS)

    def quantize_pages(self, k: Tensor, v: Tensor, pos: Tensor) -> list[Tensor]:
        """Pages of K/V [B, H, pages, P, D] (positions pos [B, H, pages, P], -1 = empty) -> the warm parts."""
        if self.key_channels:
            keys = quantize_channels(k, self.warm_bits, pos >= 0)
        else:
            keys = quantize_tokens(k, self.warm_bits, self.warm_group)
        parts = [*keys, *quantize_tokens(v, self.warm_bits, self.warm_group)]
        return [p.to(getattr(self, f"warm_{n}").dtype) for n, p in zip(WARM_PARTS, parts)]

    def warm_parts(self, hot: list[Tensor], pos: Tensor) -> list[Tensor]:
        """Hot-format K/V pages (self.kv_buffers() order) -> the warm parts: quantized once, or the hot codes."""
        return hot if self.kv_bits else self.quantize_pages(hot[0], hot[1], pos)

    def dequantize_keys(self, parts: list[Tensor], dtype: torch.dtype) -> Tensor:
        dequantize = dequantize_channels if self.key_channels else dequantize_tokens
        return dequantize(*parts, self.warm_bits, dtype)

    def hot_parts(self, warm: list[Tensor]) -> list[Tensor]:
        if self.kv_bits:
            return warm
        return [self.dequantize_keys(warm[:3], self.kv_dtype),
                dequantize_tokens(*warm[3:], self.warm_bits, self.kv_dtype)]

    def count(self, name: str, value: Tensor | int) -> None:
        self.traffic[COUNTERS.index(name)] += value

    # ---- reset and prefill ---------------------------------------------------------------------------------
    def reset(self) -> None:
        super().reset()
        self.reset_tiers()

    def reset_tiers(self) -> None:
        self.stage_pos.fill_(-1)
        self.page_pos.fill_(-1)
        self.page_ptr.zero_()
        self.recall_page.fill_(-1)
        self.traffic.zero_()

    def prefill(self, q: Tensor, k: Tensor, v: Tensor, memo: dict | None = None) -> None:
        """The policy's prefill, then the prompt tokens its compressor dropped go to warm pages, in position
        order (a fresh sequence: the warm store starts empty)."""
        super().prefill(q, k, v, memo)
        self.reset_tiers()
        B, H, S, D = k.shape
        dropped = ~self.holds(S)  # heads of a pool may drop different numbers of tokens
        most = int(dropped.sum(-1).max())
        if most == 0:
            return
        order = torch.arange(S, device=k.device).expand(B, H, S)
        last = torch.where(dropped, order + S, order).sort(dim=-1).values[..., S - most :]  # dropped ones last
        P, NP = self.page_size, self.tiers.warm_pages
        pages = math.ceil(most / P)
        # each head's dropped tokens in position order, ending at the last page (empty entries before them)
        pos = torch.cat([last.new_zeros(B, H, pages * P - most), last], dim=-1)  # 0 < S: empty
        pos = torch.where(pos >= S, pos - S, -1)
        cold = max(pages - NP, 0)  # the oldest pages do not fit the ring: straight to cold
        kept = pages - cold
        lost, pos = pos[:, :, : cold * P].unflatten(2, (cold, P)), pos[:, :, cold * P :]
        index = pos.clamp(min=0).unsqueeze(-1).expand(B, H, kept * P, D)
        pos = pos.unflatten(2, (kept, P))
        parts = self.quantize_pages(k.gather(2, index).unflatten(2, (kept, P)),
                                    v.gather(2, index).unflatten(2, (kept, P)), pos)
        self.count("demoted_tokens", dropped.sum())
        if cold:
            self.count("cold_pages", (lost >= 0).any(-1).sum())
            self.count("cold_tokens", (lost >= 0).sum())
        for name, value in zip(WARM_PARTS, parts):
            getattr(self, f"warm_{name}")[:, :, :kept] = value
        self.page_pos[:, :, :kept] = pos
        if not self.key_channels:
            self.page_kmin[:, :, :kept], self.page_kmax[:, :, :kept] = self.key_bounds(parts[:3], pos)
        self.page_ptr.fill_(kept % NP)
        self.count("prompt_pages", (pos >= 0).any(-1).sum())

    def key_bounds(self, key_parts: list[Tensor], pos: Tensor) -> tuple[Tensor, Tensor]:
        """Per page, the min and max over its tokens of each channel of the keys as recall will install them
        (dequantized): key_parts page-shaped [B, H, pages, P or 1, ...], pos [B, H, pages, P] (-1 = no token).
        Stored only for hot codes kept as they are (--kv-bits: per-token scales)."""
        keys = self.dequantize_keys(key_parts, torch.float32)
        empty = (pos < 0).unsqueeze(-1)
        return keys.masked_fill(empty, INF).amin(3), keys.masked_fill(empty, -INF).amax(3)

    # ---- decode: demote ------------------------------------------------------------------------------------
    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        slot = self.choose_slot(input_pos)
        self.stage(slot, input_pos)
        return self.insert(slot, input_pos, k, v)

    def stage(self, slot: Tensor, input_pos: Tensor) -> None:
        """Copy the token in slot [B, H_kv] (about to be overwritten) to its head's staging page, in column
        position mod P (an empty victim leaves its column empty: position -1). The column comes from the
        position, not from a count of victims, so staging is three copies and no bookkeeping; flush() runs every
        P positions (decode.Decoder does), before a column comes round again."""
        B, H = slot.shape
        victim = self.take_slots(self.slot_pos, slot)  # [B, H, 1]
        column = (input_pos.view(1, 1, 1) % self.page_size).expand(B, H, 1)
        for name in self.kv_buffers():
            hot, stage = getattr(self, name), getattr(self, f"stage_{name}")
            stage.scatter_(2, column.unsqueeze(-1).expand(B, H, 1, hot.shape[-1]), self.take_slots(hot, slot))
        self.stage_pos.scatter_(2, column, victim)

    def staged(self) -> Tensor:
        """Victims since the last flush, per (row, KV head) [B, H]."""
        return (self.stage_pos >= 0).sum(-1)

    def flush(self) -> None:
        """Each (row, KV head)'s staged tokens become one warm page (called every page_size positions)."""
        staged = self.staged()
        has = staged > 0
        pos = self.stage_pos.unsqueeze(2)
        parts = self.warm_parts([getattr(self, f"stage_{n}").unsqueeze(2) for n in self.kv_buffers()], pos)
        self.write_page(parts, pos, has)
        self.count("demoted_tokens", staged.sum())
        self.count("flushed_pages", has.sum())
        self.stage_pos.fill_(-1)

    def write_page(self, parts: list[Tensor], pos: Tensor, has: Tensor) -> None:
        """Write one page (page-shaped warm parts [B, H, 1, ...], positions [B, H, 1, P]) where has [B, H], at
        the ring's pointer; the page it replaces goes cold, and so does a recalled copy of it."""
        B, H, _, P = pos.shape
        ptr = self.page_ptr
        old = self.page_pos.gather(2, ptr.view(B, H, 1, 1).expand(B, H, 1, P)).squeeze(2)
        old_tokens = (old >= 0).sum(-1) * has
        self.count("cold_pages", (old_tokens > 0).sum())
        self.count("cold_tokens", old_tokens.sum())
        pairs = [*((getattr(self, f"warm_{n}"), p) for n, p in zip(WARM_PARTS, parts)), (self.page_pos, pos)]
        if not self.key_channels:
            pairs += zip((self.page_kmin, self.page_kmax), self.key_bounds(parts[:3], pos))
        for buffer, value in pairs:
            ones = (1,) * (value.dim() - 2)
            index = ptr.view(B, H, *ones).expand(value.shape)
            put_rows(buffer, ptr.view(B, H, 1), torch.where(has.view(B, H, *ones), value, buffer.gather(2, index)))
        if self.recall_pages:
            stale = (self.recall_page == ptr.unsqueeze(-1)) & has.unsqueeze(-1)
            self.recall_page.masked_fill_(stale, -1)
            self.recall_positions().unflatten(2, (self.recall_pages, P)).masked_fill_(stale.unsqueeze(-1), -1)
        self.page_ptr.copy_(torch.where(has, (ptr + 1) % self.tiers.warm_pages, ptr))

    # ---- decode: recall ------------------------------------------------------------------------------------
    def recall(self, q: Tensor) -> None:
        """Choose the warm pages with the highest Quest bound for q [B, H, 1, D] and bring the chosen ones that are
        not resident into the recall slots, best first, at most `recall_installs` per (row, KV head), each into a
        slot whose page was not chosen again; a chosen page already resident is a hit and stays where it is. Only
        the installed pages are dequantized and written (static shapes: always recall_installs of them; a slot
        with no miss for it is rewritten with the page it holds). Few ops on purpose: at one recall per step, each
        kernel per layer counts."""
        if not self.recall_pages:
            return
        B, n_heads, _, D = q.shape
        H, K, M = self.n_kv_heads, self.recall_pages, self.tiers.recall_installs
        qg = q.view(B, H, n_heads // H, 1, D).float()
        top = self.quest_bound(qg).masked_fill((self.page_pos < 0).all(-1), -INF).topk(K, dim=-1)
        chosen = torch.where(top.values > -INF, top.indices, -1)  # [B, H, K], best first
        resident = self.recall_page
        again = (resident.unsqueeze(-1) == chosen.unsqueeze(-2)) & (chosen >= 0).unsqueeze(-2)  # [B, H, slot, k]
        kept = again.any(-1)  # the slot's page was chosen again
        miss = (chosen >= 0) & ~again.any(-2)  # a chosen page not resident
        # the best M misses, into the free slots in slot order (argsort of a 0/1 key: stable, so orders are kept)
        order = (~miss).to(torch.uint8).argsort(dim=-1, stable=True)[..., :M]
        slot = kept.to(torch.uint8).argsort(dim=-1, stable=True)[..., :M]  # distinct slots, free ones first
        moves = miss.gather(-1, order)
        page = torch.where(moves, chosen.gather(-1, order), resident.gather(-1, slot))
        self.install(slot, page)
        hits, misses = (chosen >= 0).sum() - miss.sum(), moves.sum()
        self.traffic[RECALL_COUNTERS] += torch.stack([hits.new_ones(()), hits, misses])

    def quest_bound(self, qg: Tensor) -> Tensor:
        """Quest's upper bound of q.k over each warm page, sum_d max(q_d kmin_d, q_d kmax_d), max over the GQA group
        (qg [B, H, g, 1, D]) -> [B, H, pages]. With keys per channel over a page, kmin is the zero point and kmax
        zero + top x scale (scale >= 0), so the bound is q.zero + top relu(q).scale: two products, no max."""
        if not self.key_channels:
            kmin, kmax = self.page_kmin.unsqueeze(2), self.page_kmax.unsqueeze(2)
            return torch.maximum(qg * kmin, qg * kmax).sum(-1).amax(2)
        zero, scale = self.warm_k_zero.squeeze(3).unsqueeze(2), self.warm_k_scale.squeeze(3).unsqueeze(2)
        top = 2**self.warm_bits - 1
        return (qg * zero.float() + (top * qg.clamp(min=0)) * scale.float()).sum(-1).amax(2)

    def install(self, slot: Tensor, pages: Tensor) -> None:
        """Write warm pages [B, H, M] (-1 = none: the slot empties) into recall page slots [B, H, M] (distinct
        per row and head), in the hot format."""
        B, H, M = pages.shape
        P = self.page_size
        at = pages.clamp(min=0)
        warm = []
        for name in WARM_PARTS:
            buffer = getattr(self, f"warm_{name}")
            warm.append(buffer.gather(2, at.view(B, H, M, 1, 1).expand(B, H, M, *buffer.shape[3:])))
        slots = (slot.unsqueeze(-1) * P + torch.arange(P, device=slot.device)).flatten(2)  # [B, H, M P] of 0 .. R - 1
        for name, value in zip(self.kv_buffers(), self.hot_parts(warm)):
            self.put_recall(getattr(self, name), slots, value.flatten(2, 3))
        pos = self.page_pos.gather(2, at.unsqueeze(-1).expand(B, H, M, P)).masked_fill((pages < 0).unsqueeze(-1), -1)
        self.put_recall(self.slot_pos.unsqueeze(-1), slots, pos.flatten(2).unsqueeze(-1))
        put_rows(self.recall_page.unsqueeze(-1), slot, pages.unsqueeze(-1))

    def synthetic_state(self, generator: torch.Generator | None) -> None:
        """fill_synthetic: the policy's statistics, and a full warm store of random pages (positions below the
        hot tokens'), so that timed recalls score, pick and install real pages."""
        super().synthetic_state(generator)
        self.reset_tiers()
        B, H, NP, P = self.page_pos.shape
        shape = (B, H, NP, P, self.head_dim)
        k, v = (torch.randn(shape, generator=generator).to(self.device) for _ in "kv")
        pos = (self.n_sinks + torch.arange(NP * P, device=self.device)).view(1, 1, NP, P).expand(B, H, NP, P)
        parts = self.quantize_pages(k, v, pos)
        for name, value in zip(WARM_PARTS, parts):
            getattr(self, f"warm_{name}").copy_(value)
        self.page_pos.copy_(pos)
        if not self.key_channels:
            kmin, kmax = self.key_bounds(parts[:3], pos)
            self.page_kmin.copy_(kmin)
            self.page_kmax.copy_(kmax)

    # ---- reporting (read once at the end) ------------------------------------------------------------------
    def kept(self) -> Tensor:
        """Tokens the policy holds (valid slots outside the recall slots: those are copies of warm pages)."""
        return super().kept() - (self.recall_positions() >= 0).sum(-1)

    def warm_bytes(self) -> int:
        """Bytes of the warm store (codes, scales, zero points): its pages x page bytes."""
        return sum(getattr(self, f"warm_{n}").nbytes for n in WARM_PARTS)

    def overhead_bytes(self) -> int:
        return super().overhead_bytes() - self.warm_bytes()

    def tier_counts(self) -> dict[str, int]:
        """This layer's tokens per tier and traffic counters, summed over rows and KV heads."""
        counts = dict(zip(COUNTERS, self.traffic.tolist()))
        staged = self.staged()  # not flushed yet: demoted all the same
        counts["demoted_tokens"] += int(staged.sum())
        counts["hot_tokens"] = int(self.kept().sum())
        counts["recalled_tokens"] = int((self.recall_positions() >= 0).sum())
        counts["warm_tokens"] = int((self.page_pos >= 0).sum() + staged.sum())
        page = self.page_bytes()
        counts["hot_to_warm_bytes"] = (counts["flushed_pages"] + counts["prompt_pages"]) * page
        counts["warm_to_hot_bytes"] = counts["recall_misses"] * page
        counts["warm_bytes"] = self.warm_bytes()
        return counts


_TIERED: dict[type, type] = {}


def tiered(cls: type[KVCache]) -> type[KVCache]:
    """The policy class with tiers (one class per policy, made once): class Tiered<Policy>(Tiers, policy)."""
    if cls not in _TIERED:
        _TIERED[cls] = type(f"Tiered{cls.__name__}", (Tiers, cls), {"__doc__": f"{cls.__doc__}\n\nWith tiers."})
    return _TIERED[cls]


def flush_caches(caches: list) -> None:
    for c in caches:
        c.flush()


def tier_report(caches: list) -> dict[str, int] | None:
    """The tier counters summed over layers (None without tiers), read once at the end."""
    if not caches or not all(isinstance(c, Tiers) for c in caches):
        return None
    total: dict[str, int] = {}
    for c in caches:
        for key, value in c.tier_counts().items():
            total[key] = total.get(key, 0) + value
    c = caches[0]
    total.update(page_size=c.page_size, warm_bits=c.warm_bits, recall_slots=c.recall_slots, layers=len(caches),
                 rows_heads_layers=c.batch_size * c.n_kv_heads * len(caches))
    return total


def format_tier_report(r: dict[str, int] | None) -> list[str]:
    if r is None:
        return []
    per = r["rows_heads_layers"]
    recalls = r["recall_hits"] + r["recall_misses"]
    rate = f"{r['recall_hits'] / recalls:.0%} hits" if recalls else "none recalled"
    hot = (f"tiers: tokens per (row, KV head, layer): hot {r['hot_tokens'] / per:.1f}, warm "
           f"{r['warm_tokens'] / per:.1f} ({r['warm_bits']}-bit pages of {r['page_size']}), cold "
           f"{r['cold_tokens'] / per:.1f}; plus {r['recalled_tokens'] / per:.1f} copies of warm tokens in the "
           f"{r['recall_slots']} recall slots")
    moved = (f"tiers: warm store {r['warm_bytes'] / 1e6:.2f} MB; moved hot->warm "
             f"{r['hot_to_warm_bytes'] / 1e6:.3f} MB ({r['prompt_pages']} prompt pages + {r['flushed_pages']} "
             f"flushed), warm->hot {r['warm_to_hot_bytes'] / 1e6:.3f} MB; {r['demoted_tokens']} tokens demoted, "
             f"{r['cold_pages']} pages dropped cold")
    recalled = (f"tiers: {r['recalls'] // r['layers']} recall steps; pages recalled: {r['recall_hits']} hits, "
                f"{r['recall_misses']} misses ({rate})")
    return [hot, moved, recalled]




def add_tier_args(parser, title: str = "KV tiers (demote evicted tokens to a quantized warm store, recall them)",
                  warm_tokens_help: str = "turn tiers on: ") -> None:
    """The tier flags (argparse), all defaulting to None: generate.py turns tiers on by --warm-tokens; eval.py
    and bench.py by a +warm combo, and tell given flags from DEFAULTS."""
    g = parser.add_argument_group(title)
    g.add_argument("--warm-tokens", type=float, default=None,
                   help=f"{warm_tokens_help}evicted tokens go to a warm store of this many tokens per row and KV "
                        "head (a fraction in (0, 1] of prompt + new tokens, or a number); when full, its oldest "
                        "page is dropped (cold)")
    g.add_argument("--warm-bits", type=int, default=None,
                   help="warm store precision, 8 or 4 bits per value, quantized once (default: --kv-bits if "
                        f"given, else {DEFAULTS['warm_bits']})")
    g.add_argument("--page-size", type=int, default=None,
                   help=f"tokens per warm page, the unit of demotion, scoring and recall ({DEFAULTS['page_size']})")
    g.add_argument("--recall-slots", type=float, default=None,
                   help="hot slots per KV head reserved for recalled pages, taken from the budget: a number of "
                        f"tokens (whole pages), or a fraction of the budget ({DEFAULTS['recall_slots']}, at least "
                        "one page); 0 = demote but never recall")
    g.add_argument("--recall-interval", type=int, default=None,
                   help="recall every that many generated positions (fed tokens, e.g. a question, and the first step "
                        "of a call always recall) "
                        f"({DEFAULTS['recall_interval']})")
    g.add_argument("--recall-installs", type=float, default=None,
                   help="pages one recall may bring in per row and KV head, the best-scored first (the rest wait for "
                        "the next recall): a fraction in (0, 1] of the recall pages, or a number above 1 "
                        f"({DEFAULTS['recall_installs']:g}; 1: every chosen page)")


def check_tiers_for(policy: type[KVCache]) -> None:
    """Tiers keep what a policy evicts, one victim per KV head and step (the uniform layout, hybrid's pool)."""
    if not policy.compresses:
        raise KVFastError(f"tier flags (--warm-tokens, ...) are not used by --cache {policy.name}: it never evicts")
    if not policy.supports_tiers:
        raise KVFastError(f"tier flags (--warm-tokens, ...) do not apply to --cache {policy.name}: its pool moves "
                          "slots between KV heads as it evicts, and tiers keep one victim per head and step "
                          "(hybrid's heads keep their own budgets: --cache hybrid has tiers)")
