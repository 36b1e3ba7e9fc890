"""shared_context: one context, several questions, one compressed cache (SCBench's multi-turn shared-context
setting, offline). The context holds N needles (RULER's multi-key template, evals.tasks.niah_prompt with asked=N)
and is compressed before any question exists (query-agnostic). Its caches are snapshot once (kv.snapshot); each
question then restores them, is read through the decode step and answered, so every question finds the context
exactly as compressed, whatever the earlier ones did to the caches.

Per sample the record keeps each turn's score and answer, and the time with reuse against without it (a fresh
prefill + compression per question), built from the parts measured here: the prefill (recorded once per batch),
the compression (the caches' fill, KVzip's reconstruction scoring included for kvzip), each restore and each
answer. benchmarks/contexts.py measures the same two schedules end to end.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor, nn

from decode import truncate_at_stop
from evals import tasks
from evals.caches import Combo, Evaluator, MultiCache, tier_fields
from evals.store import Store, add_record, record_key
from kv import snapshot

MODE = "agnostic"  # the context is compressed before any question: the only mode this task has


def answer_turns(ev: Evaluator, caches: list[nn.Module], kv: list, ctx: Tensor, questions: list[Tensor],
                 memos: list[dict], steps: int, reuse: bool = True) -> tuple[list[Tensor], dict[str, Any]]:
    """Compress the context ctx [B, S] into the installed caches (G x B rows) and answer every question [B, Q]
    in turn: with reuse, compress once, snapshot, and restore before each; without, compress afresh before each
    (the reference reuse must equal). Returns each turn's greedy tokens [G B, <= steps] and the seconds of each
    part: compress_s (of the one compression, or the first), restore_s and answer_s (per turn)."""
    S, G = ctx.shape[1], len(caches[0].members) if isinstance(caches[0], MultiCache) else 1
    answers, times = [], {"compress_s": 0.0, "restore_s": [], "answer_s": []}
    snap = None
    for turn, q in enumerate(questions):
        t0 = time.perf_counter()
        if turn == 0 or not reuse:
            ev.fill(caches, kv, S, memos, ctx)
            if turn == 0:
                times["compress_s"] = time.perf_counter() - t0
                times["kvzip_s"] = ev.kvzip_s
            if reuse:
                snap = snapshot.snapshot(ev.model)
        else:
            snapshot.restore(ev.model, snap)
            times["restore_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        first = ev.feed(q.repeat(G, 1), S)
        tokens, _ = ev.greedy(first, S + q.shape[1], steps, stop=True, keep=False)
        times["answer_s"].append(time.perf_counter() - t0)
        answers.append(tokens)
    return answers, times


def run_shared(ev: Evaluator, prompts: list[tasks.Prompt], combos: list[Combo], store: Store, bar: Any) -> None:
    """One batch of shared_context prompts: one prefill of the contexts, then per group of combos one
    compression and every question in turn (answer_turns)."""
    args, src = ev.args, tasks.SHARED
    L, B = prompts[0].length, len(prompts)
    todo = [c for c in combos if any(not store.done(record_key(src, L, p.index, c, MODE)) for p in prompts)]
    if not todo:
        return
    ctx = torch.tensor([p.context for p in prompts], device=ev.device)
    turns = [torch.tensor([p.turns[t][0] for p in prompts], device=ev.device) for t in range(len(prompts[0].turns))]
    S, Q = ctx.shape[1], turns[0].shape[1]
    room = L + args.answer_room - S  # every question and its answer after the context (as niah's one question)
    bar.set_postfix_str(f"{src}@{L}: prefill {B} x {S}")
    t0 = time.perf_counter()
    kv, hidden = ev.record(ctx)
    del hidden
    prefill_s = (time.perf_counter() - t0) / B
    memos = [{} for _ in range(ev.n_layers)]
    steps = tasks.ANSWER_TOKENS[src]
    kvzip_s = 0.0  # the batch's reconstruction scoring (memoized: counted for every kvzip combo)
    for group in ev.groups(todo, B, S, room):
        G = len(group)
        bar.set_postfix_str(f"{src}@{L}: {', '.join(c.label() for c in group)}")
        caches = ev.group_caches(group, B, S, room)
        ev.install(caches)
        answers, times = answer_turns(ev, caches, kv, ctx, turns, memos, steps)
        kvzip_s = kvzip_s or times["kvzip_s"] / B
        tiers = tier_fields(caches, B)  # a tiered combo is alone in its group
        per = B * G  # the rows that shared each measured part
        compress = (times["compress_s"] - times["kvzip_s"]) / per
        restore = sum(times["restore_s"]) / per
        answer = [t / per for t in times["answer_s"]]
        for j, combo in enumerate(group):
            c_s = compress + (kvzip_s if combo.policy == "kvzip" else 0.0)
            timing = {"prefill_s": round(prefill_s, 4), "compress_s": round(c_s, 4),
                      "restore_s": round(restore / max(len(turns) - 1, 1), 5),
                      "answer_s": [round(a, 4) for a in answer],
                      "reuse_s": round(prefill_s + c_s + restore + sum(answer), 4),
                      "fresh_s": round(len(turns) * (prefill_s + c_s) + sum(answer), 4)}
            cap = sorted({c.members[j].capacity if isinstance(c, MultiCache) else c.capacity for c in caches})
            base = {"task": src, "length": L, "policy": combo.name, "budget": combo.budget, "mode": MODE,
                    "prompt_tokens": S + Q, "context_tokens": S, "capacity": cap[0] if len(cap) == 1 else cap,
                    "time_s": round(timing["reuse_s"] - prefill_s, 4), **timing,
                    **ev.bytes_fields(combo, B, S, room), **tiers}
            if combo.tiers:
                base["tiers"] = dict(combo.tiers)
            for row, p in enumerate(prompts):
                r = j * B + row
                preds, scores = [], []
                for (_, refs), tokens in zip(p.turns, answers):
                    ids = tokens[r].tolist()
                    preds.append(ev.tok.decode(truncate_at_stop(ids, ev.stop_ids) if ev.stop_ids else ids))
                    scores.append(tasks.score(src, preds[-1], refs))
                add_record(store, bar, {**base, "index": p.index, "prediction": preds, "turns": scores,
                                        "answers": [refs for _, refs in p.turns], "score": sum(scores) / len(scores),
                                        "meta": p.meta}, combo)
        store.save()
