"""eval.py's text tasks: perplexity and attention loss over windows of real text, teacher-forced through the
decode path after a prefix is prefilled (past the model's length only POLICY+shift combos read a window)."""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch

import cache as kvcache
from evals.caches import Combo, Evaluator, ShadowCaches, tier_fields
from evals.store import NO_MODE, Store, head_fields, record_key


def prefix_len(args: argparse.Namespace, combo: Combo, T: int, recall_slots: int = 0) -> int:
    """Tokens of a ppl window that are prefilled before decoding: the budget's uniform capacity (nothing is
    evicted before a uniform cache is full, so those predictions are the batched pass's; a layer with a smaller
    capacity, e.g. a pyramid's top layers, compresses that prefix with its prompt compressor), less a tiered
    combo's recall slots (the policy holds the rest), or 1 with --ppl-decode-all. It depends on the budget (and
    tier settings) only, so a policy gets the same result in any group."""
    if args.ppl_decode_all:
        return 1
    return T if combo.is_full else min(T, kvcache.resolve_capacity(combo.budget, T) - recall_slots)


def positions(args: argparse.Namespace) -> list[int]:
    ps = list(range(args.ppl_every, args.ppl_length + 1, args.ppl_every))
    return ps if ps and ps[-1] == args.ppl_length else ps + [args.ppl_length]


def run_windows(ev: Evaluator, windows: list[list[int]], indices: list[int], wanted: list[str], combos: list[Combo],
                store: Store, bar: Any) -> None:
    """ppl and attention loss on one batch of text windows (one prefill)."""
    args = ev.args
    T = len(windows[0])
    longer = T > ev.model.args.max_seq_len  # only POLICY+shift combos read past the model's length (main checked)
    todo = {(t, c) for t in wanted for c in combos
            if not (t == "attention-loss" and c.is_full) and not (longer and c.is_full)
            and any(not store.done(record_key(t, T, i, c, NO_MODE)) for i in indices)}
    if not todo:
        return
    ids = torch.tensor(windows, device=ev.device)
    B = ids.shape[0]
    # the batched pass covers what any combo prefills: the whole window, or (past the model's length) the longest
    # prefix, each combo decoding the rest
    head = max(prefix_len(args, c, T) for _, c in todo) if longer else T
    bar.set_postfix_str(f"text@{T}: prefill {B} x {head}")
    t0 = time.perf_counter()
    kv, hidden = ev.record(ids[:, :head])
    full_nll = ev.nll_from_hidden(hidden, ids[:, : head + 1])
    del hidden
    prefill_s = (time.perf_counter() - t0) / B
    memos: dict[int, list[dict]] = {}
    ps = positions(args)

    def add(task: str, combo: Combo, metrics: list[dict], elapsed: float, cap: Any, extra: list[dict]) -> None:
        for row, i in enumerate(indices):
            key = record_key(task, T, i, combo, NO_MODE)
            if store.done(key):
                continue
            metric = "ppl" if task == "ppl" else "loss"
            store.add({"key": key, "task": task, "length": T, "index": i, "policy": combo.name,
                       "budget": combo.budget, "mode": NO_MODE, "capacity": cap, "metrics": metrics[row],
                       "score": metrics[row][f"{metric}@{T}"], "time_s": round(elapsed, 4),
                       "prefill_s": round(prefill_s, 4), **({"tiers": dict(combo.tiers)} if combo.tiers else {}),
                       **ev.bytes_fields(combo, B, T, 0), **extra[row]})
            bar.update(1)
        store.save()

    if "ppl" in wanted:
        for group in ev.groups([c for c in combos if ("ppl", c) in todo], B, T, 0):
            G = len(group)
            bar.set_postfix_str(f"ppl@{T}: {', '.join(c.label() for c in group)}")
            t0 = time.perf_counter()
            members = [ev.caches(c, B, T, 0) for c in group]
            P = prefix_len(args, group[0], T, getattr(members[0][0], "recall_slots", 0))
            classes, tiers = None, {}
            if P >= T or (group[0].is_full and not args.ppl_decode_all):
                nll, P = full_nll.repeat(G, 1), T  # no eviction can happen: the decode path would give the same
            else:
                caches = ev.group_caches(group, B, T, 0)
                memo = memos.setdefault(P, [{} for _ in range(ev.n_layers)])
                ev.install(caches)
                ev.fill(caches, kv, P, memo, ids)
                nll = torch.cat([full_nll[:, :P].repeat(G, 1), ev.decode_nll(ids.repeat(G, 1), P)], 1)
                classes = kvcache.head_class_report(caches)
                tiers = tier_fields(caches, B)  # a tiered combo is alone in its group
            elapsed = (time.perf_counter() - t0) / (B * G)
            for j, combo in enumerate(group):
                rows = range(j * B, (j + 1) * B)
                # cumulative (ppl@p, nll@p) and of the tokens since the previous report (nll_seg@p: StreamingLLM's
                # curve, which shows a cache going wrong at some length where the cumulative mean hides it)
                metrics = [{f"ppl@{p}": math.exp(float(nll[r, : p - 1].mean())) for p in ps}
                           | {f"nll@{p}": float(nll[r, : p - 1].mean()) for p in ps}
                           | {f"nll_seg@{p}": float(nll[r, q - 1 if q else 0 : p - 1].mean())
                              for q, p in zip([0, *ps], ps)} for r in rows]
                cap = sorted({c.capacity for c in members[j]})
                extra = [{"prefilled": P, **head_fields(classes, j * B + r), **tiers} for r in range(B)]
                add("ppl", combo, metrics, elapsed, cap[0] if len(cap) == 1 else cap, extra)

    if "attention-loss" in wanted:
        followers = [c for c in combos if ("attention-loss", c) in todo]
        groups: dict[Any, list[Combo]] = {}
        for c in followers:  # one shadow pass per refresh interval (the decode loop calls refresh for all) and
            # tier settings (it flushes and recalls the tiered followers on their schedule)
            every = getattr(ev.factory(c, B, T, 0)(0), "refresh_interval", None)
            groups.setdefault((every, c.tiers), []).append(c)
        for group in groups.values():
            bar.set_postfix_str(f"attention-loss@{T}: {', '.join(c.label() for c in group)}")
            t0 = time.perf_counter()
            full = ev.caches(Combo("full", None), B, T, 0)
            inner = [ev.caches(c, B, T, 0) for c in group]
            shadows = [ShadowCaches(full[i], [caches[i] for caches in inner], T) for i in range(ev.n_layers)]
            P = min(min(prefix_len(args, c, T) for c in group),  # a tiered follower: the slots its policy holds
                    min(c.capacity - getattr(c, "recall_slots", 0) for m in inner for c in m), T - 1)
            memo = memos.setdefault(P, [{} for _ in range(ev.n_layers)])
            ev.install(shadows)
            ev.fill(shadows, kv, P, memo, ids)
            ev.decode_nll(ids, P)
            loss = torch.stack([s.loss for s in shadows])  # [layers, followers, B, T]
            elapsed = (time.perf_counter() - t0) / B / len(group)
            bins = max(1, T // 64)
            for j, combo in enumerate(group):
                classes = kvcache.head_class_report(inner[j])
                lj = loss[:, j]  # [layers, B, T]; positions < P never evict (0), T - 1 is never a query
                mean = lj.mean(0)
                metrics = [{f"loss@{p}": float(mean[r, 1 : min(p, T - 1)].mean()) for p in ps} for r in range(B)]
                tiers = tier_fields(inner[j], B)
                extra = [{"per_layer": [round(float(x), 5) for x in lj[:, r, 1 : T - 1].mean(-1)],
                          "curve": [round(float(x), 5) for x in mean[r, : T // bins * bins].view(-1, bins).mean(-1)],
                          "prefilled": P, **head_fields(classes, r), **tiers} for r in range(B)]
                cap = sorted({c.capacity for c in inner[j]})
                add("attention-loss", combo, metrics, elapsed, cap[0] if len(cap) == 1 else cap, extra)
