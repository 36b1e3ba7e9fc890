"""The evaluation grid: which cells (a batch of samples of one source and length) there are, what each records,
and running them, here one after another or through a remote runner (evals.ray for eval.py --ray).

Each batch of samples is prefilled once; every layer's (q, k, v) is recorded and replayed into each policy's caches
(evals.caches.Evaluator), so a policy/budget pair costs only its decode steps. Records go to an evals.store.Store;
a cell whose records are all there is skipped.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import cache as kvcache
from decode import truncate_at_stop
from evals import shared, tasks
from evals.caches import Combo, Evaluator, MultiCache, combo_kv_bits, split_combo_policy, tier_fields
from evals.store import NO_MODE, Store, add_record, head_fields, record_key
from evals.text import run_windows
from model import Transformer


# ---- combos and records ----------------------------------------------------------------------------------
def combos_of(args: argparse.Namespace) -> list[Combo]:
    combos = [Combo("full", None)]
    for name in args.policies:
        policy, warm, shift = split_combo_policy(name)
        bits = combo_kv_bits(name)[1]
        # a token is quantized once: with 8 / 4-bit codes the warm tier keeps the hot codes, at their bits
        tiers = tuple({**args.tiers, **({"warm_bits": bits} if bits in (8, 4) else {})}.items()) if warm else None
        combos += [Combo(policy, b, tiers, shift, bits) for b in args.budgets if policy != "full"]
    return combos


# ---- retrieval and fidelity -------------------------------------------------------------------------------
def run_prompts(ev: Evaluator, prompts: list[tasks.Prompt], wanted: list[str], combos: list[Combo], store: Store,
                bar: Any) -> None:
    """One batch of prompts of the same (task, length): one prefill, then every group of combos, mode and task."""
    args = ev.args
    L, B = prompts[0].length, len(prompts)
    src = prompts[0].task
    todo: dict[tuple[Combo, str], set[str]] = {}
    for mode in args.mode:
        for combo in combos:
            need = {t for t in wanted if any(not store.done(record_key(t, L, p.index, combo, mode)) for p in prompts)}
            if need:
                todo[(combo, mode)] = need
    if not todo:
        return
    ctx = torch.tensor([p.context for p in prompts], device=ev.device)
    qst = torch.tensor([p.question for p in prompts], device=ev.device)
    S, Q = ctx.shape[1], qst.shape[1]
    total = L + args.answer_room
    bar.set_postfix_str(f"{src}@{L}: prefill {B} x {S + Q}")
    t0 = time.perf_counter()
    prompt_ids = torch.cat([ctx, qst], 1)
    kv, hidden = ev.record(prompt_ids)
    last = ev.model.logits(hidden[:, -1:])
    del hidden
    prefill_s = (time.perf_counter() - t0) / B
    answer_n = tasks.ANSWER_TOKENS.get(src, 16)
    N = args.fidelity_tokens
    for mode in args.mode:
        n = S if mode == "agnostic" else S + Q
        memos = [{} for _ in range(ev.n_layers)]
        ref, kvzip_s = None, 0.0
        need_ref = any("fidelity" in todo.get((c, mode), ()) for c in combos if not c.is_full)
        active = [c for c in combos if (c, mode) in todo or (c.is_full and need_ref)]
        for group in ev.groups(active, B, n, total - n):
            G = len(group)
            need = set().union(*(todo.get((c, mode), set()) for c in group))
            bar.set_postfix_str(f"{src}@{L} {mode}: {', '.join(c.label() for c in group)}")
            t0 = time.perf_counter()
            caches = ev.group_caches(group, B, n, total - n)
            ev.install(caches)
            ev.fill(caches, kv, n, memos, prompt_ids)
            kvzip_s = kvzip_s or ev.kvzip_s / B  # reconstruction scoring: once per batch and mode, memoized
            first = ev.feed(qst.repeat(G, 1), S) if mode == "agnostic" else last.repeat(G, 1, 1)
            pos = S + Q
            retrieval = src in need
            tiers_answer: dict = {}
            tiers_fid: dict = {}
            if group[0].is_full:
                keep = need_ref or "fidelity" in need
                steps = max(answer_n if retrieval else 1, N if keep else 1)
                tokens, lp = ev.greedy(first, pos, steps, stop=False, keep=keep)
                if lp is not None:
                    ref = (tokens[:, :N], lp[:, :N])
                answer = tokens[:, :answer_n]
                fid = {"kl": torch.zeros(B), "top1": torch.ones(B), "prefix": torch.full((B,), float(N))}
            else:
                state = ev.snapshot(caches) if retrieval and "fidelity" in need else None
                if retrieval:
                    answer, _ = ev.greedy(first, pos, answer_n, stop=True, keep=False)
                    tiers_answer = tier_fields(caches, B)  # a tiered combo is alone in its group: G = 1
                if "fidelity" in need:
                    if state is not None:
                        ev.restore(caches, state)
                    fid = ev.follow(first, pos, *ref)
                    tiers_fid = tier_fields(caches, B)
            elapsed = (time.perf_counter() - t0) / (B * G)
            classes = kvcache.head_class_report(caches)
            for j, combo in enumerate(group):
                cap = sorted({c.members[j].capacity if isinstance(c, MultiCache) else c.capacity for c in caches})
                base = {"length": L, "policy": combo.name, "budget": combo.budget, "mode": mode,
                        "prompt_tokens": S + Q, "context_tokens": S, "capacity": cap[0] if len(cap) == 1 else cap,
                        "time_s": round(elapsed, 4), "prefill_s": round(prefill_s, 4),
                        **ev.bytes_fields(combo, B, n, total - n)}
                if kvzip_s and combo.policy == "kvzip":
                    base["kvzip_s"] = round(kvzip_s, 4)
                if combo.tiers:
                    base["tiers"] = dict(combo.tiers)
                for row, p in enumerate(prompts):
                    r = j * B + row
                    if retrieval and src in todo.get((combo, mode), ()):
                        ids = answer[r].tolist()
                        pred = ev.tok.decode(truncate_at_stop(ids, ev.stop_ids) if ev.stop_ids else ids)
                        add_record(store, bar, {**base, "task": src, "index": p.index, "prediction": pred,
                                                "answers": p.answers, "score": tasks.score(src, pred, p.answers),
                                                "meta": p.meta, **head_fields(classes, r), **tiers_answer}, combo)
                    if "fidelity" in todo.get((combo, mode), ()):
                        m = {k: float(v[r]) for k, v in fid.items()}
                        add_record(store, bar, {**base, "task": "fidelity", "index": p.index, "score": m["top1"],
                                                "metrics": m, "meta": p.meta, **head_fields(classes, r), **tiers_fid},
                                   combo)
            store.save()


# ---- batching -------------------------------------------------------------------------------------------------
def batches(n: int, max_batch: int, tokens: int, per_token_bytes: int, limit_gb: float) -> list[range]:
    """Split n samples into near-equal batches that fit the recording memory."""
    fit = max(1, int(limit_gb * 1e9 // max(1, tokens * per_token_bytes)))
    size = max(1, min(max_batch, fit, n))
    k = math.ceil(n / size)
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(k)]


def recorded_bytes_per_token(model: Transformer) -> int:
    a = model.args
    return a.n_layers * (a.n_heads + 2 * a.n_kv_heads) * a.head_dim * next(model.parameters()).element_size()


TEXT = "text"  # a Cell of ppl / attention-loss windows


@dataclass(frozen=True)
class Cell:
    """One unit of work: a batch of samples of one source at one length, prefilled once, every combo run on it.
    source: a retrieval task's prompts (fidelity rides on niah_single's) or TEXT (the ppl text's windows)."""

    source: str
    length: int
    wanted: tuple[str, ...]
    indices: tuple[int, ...]


class Inputs:
    """The run's prompts and text windows, built on first use and kept (a Ray worker builds only its cells')."""

    def __init__(self, ev: Evaluator):
        self.ev, self.memo = ev, {}
        self.framing = tasks.Framing.make(ev.tok, ev.args.chat)

    def prompts(self, source: str, length: int) -> list[tasks.Prompt]:
        a = self.ev.args
        if "sentences" not in self.memo and source != "passkey":
            self.memo["sentences"] = tasks.haystack_units(self.ev.tok, a.haystack)
        if (source, length) not in self.memo:
            n = min(a.samples, a.limit or a.samples)
            self.memo[(source, length)] = tasks.make_prompts(source, self.ev.tok, self.framing, length, n, a.seed,
                                                             a.depths, self.memo.get("sentences"),
                                                             getattr(a, "shared_questions", tasks.SHARED_QUESTIONS))
        return self.memo[(source, length)]

    def windows(self) -> list[list[int]]:
        if TEXT not in self.memo:
            a, tok = self.ev.args, self.ev.tok
            w = min(a.ppl_samples, a.limit or a.ppl_samples)
            bos = tok.bos_id if getattr(tok, "add_bos", False) else None
            self.memo[TEXT] = tasks.text_windows(tok.encode(tasks.load_text(a.ppl_text)), a.ppl_length, w, a.seed, bos)
        return self.memo[TEXT]


def plan_cells(args: argparse.Namespace, model: Transformer) -> list[Cell]:
    """Every cell of the grid, in the order a single process runs them."""
    per_token = recorded_bytes_per_token(model)
    n = min(args.samples, args.limit or args.samples)
    sources = [t for t in tasks.RETRIEVAL_TASKS if t in args.tasks]
    if "fidelity" in args.tasks and "niah_single" not in sources:  # one prefill serves both
        sources.append("niah_single")
    cells = []
    for src in sources:
        for L in sorted(set(args.lengths) | (set(args.fidelity_lengths) if src == "niah_single" else set())):
            wanted = [t for t in (src,) if t in args.tasks and L in args.lengths]
            if src == "niah_single" and "fidelity" in args.tasks and L in args.fidelity_lengths:
                wanted.append("fidelity")
            if wanted:
                cells += [Cell(src, L, tuple(wanted), tuple(part))
                          for part in batches(n, args.batch_size, L, per_token, args.record_gb)]
    text_tasks = tuple(t for t in ("ppl", "attention-loss") if t in args.tasks)
    if text_tasks:
        w = min(args.ppl_samples, args.limit or args.ppl_samples)
        recorded = min(args.ppl_length, model.args.max_seq_len)  # past it, only a prefix is recorded
        cells += [Cell(TEXT, args.ppl_length, text_tasks, tuple(part))
                  for part in batches(w, args.batch_size, recorded, per_token, args.record_gb)]
    return cells


def cell_keys(cell: Cell, combos: list[Combo], args: argparse.Namespace, max_seq_len: int) -> list[str]:
    """The records a cell produces (when none is done yet)."""
    if cell.source == TEXT:  # attention loss follows full; full cannot read a window past the model's length
        return [record_key(t, cell.length, i, c, NO_MODE) for t in cell.wanted for c in combos for i in cell.indices
                if not (c.is_full and (t == "attention-loss" or cell.length > max_seq_len))]
    modes = [shared.MODE] if cell.source == tasks.SHARED else args.mode
    return [record_key(t, cell.length, i, c, mode) for mode in modes for c in combos for t in cell.wanted
            for i in cell.indices]


def run_cell(ev: Evaluator, inputs: Inputs, cell: Cell, combos: list[Combo], store: Store, bar: Any) -> None:
    if cell.source == TEXT:
        windows = inputs.windows()
        run_windows(ev, [windows[i] for i in cell.indices], list(cell.indices), list(cell.wanted), combos, store, bar)
    else:
        prompts = inputs.prompts(cell.source, cell.length)
        batch = [prompts[i] for i in cell.indices]
        if cell.source == tasks.SHARED:
            shared.run_shared(ev, batch, combos, store, bar)
        else:
            run_prompts(ev, batch, list(cell.wanted), combos, store, bar)


# a runner of cells elsewhere (evals.ray.run_cells with its cluster bound): (cells to do, each cell's record keys,
# the store it adds the records to, the progress bar)
RemoteRunner = Callable[[list[Cell], dict[Cell, list[str]], Store, Any], None]


def evaluate(ev: Evaluator, store: Store, remote: RemoteRunner | None = None) -> None:
    """Run every cell not done yet: here, one after another, or through `remote` when given. The runner is
    passed in rather than imported so that evals.ray, which runs cells with this module, is not imported back."""
    from tqdm import tqdm

    args = ev.args
    combos = combos_of(args)
    sizes = {(L, args.answer_room) for L in args.lengths} if set(args.tasks) & set(tasks.RETRIEVAL_TASKS) else set()
    if "fidelity" in args.tasks:
        sizes |= {(L, args.answer_room) for L in args.fidelity_lengths}
    if {"ppl", "attention-loss"} & set(args.tasks):
        sizes.add((args.ppl_length, 0))
    ev.check_tiered(combos, sizes)
    cells = plan_cells(args, ev.model)
    inputs = Inputs(ev)
    for cell in cells:  # every prompt is built first (cheap), so a length that cannot hold a task fails before any work
        inputs.windows() if cell.source == TEXT else inputs.prompts(cell.source, cell.length)
    keys = {cell: cell_keys(cell, combos, args, ev.model.args.max_seq_len) for cell in cells}
    with torch.inference_mode(), tqdm(total=sum(map(len, keys.values())), unit="rec", dynamic_ncols=True) as bar:
        bar.update(sum(store.done(k) for ks in keys.values() for k in ks))
        if remote is not None:
            todo = [c for c in cells if not all(map(store.done, keys[c]))]
            if todo:
                remote(todo, keys, store, bar)
            return
        for cell in cells:
            run_cell(ev, inputs, cell, combos, store, bar)


