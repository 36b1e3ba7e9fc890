"""Quality of every KV-cache policy at every budget, offline: retrieval, perplexity, fidelity, attention loss.

    python eval.py --tasks passkey niah ppl fidelity --policies full window h2o scissorhands snapkv \\
        --budgets 0.5 0.25 0.125 --lengths 1024 2048 4096 --samples 20

Tasks (evaltasks.py builds them, seeded, at exact token lengths):
  passkey            a 5-digit key in filler text at a grid of depths; exact match
  niah               RULER-style needles in real prose: niah_single, niah_multikey, niah_multivalue (each can
                     also be named alone); string match as RULER scores it
  fidelity           on the niah_single prompts: N tokens decoded greedily with the full cache are teacher-forced
                     through each compressed cache: mean KL(full || policy) of the next-token distributions,
                     top-1 agreement, and the length of the greedy prefix that matches full
  ppl                perplexity of windows of real text (--ppl-text), teacher-forced through the decode path,
                     reported every --ppl-every tokens
  attention-loss     the model decodes the same windows with a full cache while each policy's cache follows in
                     its shadow; the loss is the attention mass on the tokens the policy has evicted (cold-compress)

Modes: query-agnostic (default) compresses the context before the question is seen, then feeds the question as a
second chunk through the decode step; query-aware prefills context + question together, so prompt compressors
(SnapKV, PyramidKV) see the question. Every number records its mode.

Speed: each batch of samples is prefilled once; every layer's (q, k, v) is recorded and replayed into each
policy's caches with `cache.prefill(q, k, v, memo)` (prefill attention never reads the cache; `memo` keeps the
budget-independent prompt statistics), so a policy/budget pair costs only its decode steps. Samples of a cell
share one batch. Decoding is generate.Decoder's (optionally compiled) step. Results go to --out: results.json,
summary.md and plots; reruns skip finished cells.

Tiers: POLICY+warm in --policies (e.g. `--policies h2o h2o+warm --budgets 0.25`) is the same policy and budget with
kv.tiers on (evicted tokens demoted to a quantized warm store, recalled into reserved hot slots), set by
--warm-tokens (default 1.0 here), --warm-bits, --page-size, --recall-slots, --recall-interval. Its cells are
labelled h2o@0.25+warm (results record the policy as h2o+warm, plus h2o+warm[warm-bits=8] etc. for settings other
than the defaults, so the grid shows plain and tiered side by side) and record the settings ("tiers") and the tier
counters per sample ("tier_counters": kv.tiers.tier_report of the batch divided by its rows). Tiered combos decode
in groups of their own; the attention-loss probe flushes and recalls its tiered followers (a recalled token is
held).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# OpenMP threads that spin while waiting lose their core to any other busy process on a small shared machine and
# then stall every parallel region (decode steps measured 5-30x slower here); passive waiting avoids that.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # after OMP_WAIT_POLICY, which is read when torch loads OpenMP

import cache as kvcache
import evaltasks as tasks
from evalcaches import (
    SHIFT,
    Combo,
    Evaluator,
    MultiCache,
    add_tier_flags,
    given_tier_flags,
    policy_params,
    split_combo_policy,
    tier_fields,
    tier_settings,
)
from evalstore import NO_MODE, Store, add_record, head_fields, record_key
from evaltext import run_windows
from generate import (
    DEFAULT_CHECKPOINT,
    ArgumentParser,
    load,
    resolve_checkpoint,
    run_cli,
    truncate_at_stop,
)
from model import KVFastError, Transformer

ROOT = Path(__file__).resolve().parent
TASK_NAMES = ("passkey", "niah", *tasks.NIAH_NEEDLES, "fidelity", "ppl", "attention-loss")
MODES = ("agnostic", "aware")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT,
                   help="checkpoint folder (the default model is prepared on first use)")
    p.add_argument("--tasks", nargs="+", default=["passkey", "niah", "fidelity", "ppl"],
                   help=f"tasks to run: {', '.join(TASK_NAMES)} (niah = its three variants)")
    p.add_argument("--policies", nargs="+", default=["full", "window", "h2o", "scissorhands", "snapkv"],
                   help=f"cache policies: {', '.join(kvcache.POLICIES)}; full is always the reference; POLICY+warm: "
                        "the same policy with tiers (kv.tiers) on, e.g. h2o+warm or hybrid+warm (not full, adakv or kvzip); "
                        "POLICY+shift: with --pos-shift, e.g. window+shift")
    p.add_argument("--pos-shift", action="store_true",
                   help="every policy but full as POLICY+shift (StreamingLLM's positions): a ppl window may then "
                        "exceed the model's length (full is left out of such windows)")
    p.add_argument("--budgets", nargs="+", type=float, default=[0.5, 0.25, 0.125],
                   help="cache budgets: fractions of prompt + new tokens (or slots per layer if > 1)")
    p.add_argument("--lengths", nargs="+", type=int, default=[2048, 4096],
                   help="prompt lengths in tokens for the retrieval and fidelity tasks")
    p.add_argument("--samples", type=int, default=20, help="samples per retrieval / fidelity cell")
    p.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.3, 0.5, 0.7, 0.9],
                   help="needle depths (fraction of the haystack before it), cycled over the samples")
    p.add_argument("--mode", nargs="+", default=["agnostic"], choices=MODES,
                   help="query-agnostic: compress the context, then read the question; query-aware: the "
                        "question is part of the compressed prompt")
    p.add_argument("--haystack", default="jargon",
                   help=f"niah haystack: {', '.join(tasks.TEXT_SOURCES)} (fetched with apt into data/), a file, or "
                        f"{tasks.NOISE} (RULER's repeated filler sentences)")
    p.add_argument("--ppl-text", default="jargon",
                   help=f"ppl / attention-loss text: {', '.join(tasks.TEXT_SOURCES)} or a text file")
    p.add_argument("--ppl-length", type=int, default=None, help="tokens per ppl window (default: max --lengths)")
    p.add_argument("--ppl-samples", type=int, default=4, help="ppl / attention-loss windows")
    p.add_argument("--ppl-every", type=int, default=512, help="report ppl / attention loss every N tokens")
    p.add_argument("--ppl-decode-all", action="store_true",
                   help="decode every token from the first (StreamingLLM's loop) instead of prefilling the tokens "
                        "that fit the smallest layer's cache (identical until the cache is full, much slower)")
    p.add_argument("--fidelity-tokens", type=int, default=32, help="tokens decoded by full for fidelity")
    p.add_argument("--fidelity-lengths", nargs="+", type=int, default=None,
                   help="prompt lengths for fidelity (default: --lengths)")
    p.add_argument("--answer-room", type=int, default=64,
                   help="new tokens the caches are sized for after each prompt (budget = fraction of length + this)")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the model's chat template")
    p.add_argument("--limit", type=int, default=None, help="at most N samples / windows per cell (smoke runs)")
    p.add_argument("--batch-size", type=int, default=8, help="samples decoded together (one prefill per batch)")
    p.add_argument("--record-gb", type=float, default=4.0,
                   help="memory for the recorded prefill q/k/v; batches shrink to fit")
    p.add_argument("--group-gb", type=float, default=2.0,
                   help="memory for the K/V of policies decoded together in one batch (all budgets' policies "
                        "share each step's weight reads)")
    p.add_argument("--seed", type=int, default=0, help="seed of the task generators")
    p.add_argument("--out", type=Path, default=None, help="output folder (default results/<checkpoint name>)")
    p.add_argument("--overwrite", action="store_true", help="recompute the requested cells even if finished")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (once per cache shape)")
    p.add_argument("--compile-scope", choices=["step", "block"], default=None,
                   help="with --compile: one block reused for every layer (the default on CPU) or the whole step "
                        "in one graph (the default on CUDA)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (default float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run the cells as Ray tasks (evalray.py): alone, on a local cluster started here; with an "
                        "ADDRESS (or auto), on that cluster. Needs `pip install ray`")
    p.add_argument("--ray-workers", type=int, default=None,
                   help="--ray without an ADDRESS: the local cluster's workers (default: one per core)")
    kvcache.add_param_flags(p.add_argument_group("policy hyper-parameters (each applies to the listed policies "
                                                 "that use it)"))
    add_tier_flags(p, "the POLICY+warm combos of --policies")
    args = p.parse_args(argv)
    check_args(args)
    return args


def expand_tasks(names: list[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        for t in (tasks.NIAH_NEEDLES if name == "niah" else [name]):
            if t not in out:
                out.append(t)
    return out


def check_args(args: argparse.Namespace) -> None:
    for t in args.tasks:
        if t not in TASK_NAMES:
            raise KVFastError(f"unknown task {t!r} (choose from {', '.join(TASK_NAMES)})")
    args.tasks = expand_tasks(args.tasks)
    tiered = False
    if args.pos_shift:
        args.policies = [p if p == "full" or p.endswith(SHIFT) else p + SHIFT for p in args.policies]
    for name in args.policies:
        policy, warm, shift = split_combo_policy(name)
        if policy not in kvcache.POLICIES:
            raise KVFastError(f"unknown cache policy {name!r} (choose from {', '.join(kvcache.POLICIES)}, each "
                              "optionally +warm or +shift)")
        if warm or shift:  # full, adakv and kvzip have no tiers: cache.py's one-line reason
            try:
                kvcache.CacheSpec(policy, tiers={"warm_tokens": 1.0} if warm else {}, pos_shift=shift).resolve()
            except KVFastError as e:
                raise KVFastError(f"--policies {name}: {e}") from None
            tiered = tiered or warm
    args.policies = ["full"] + [p for p in dict.fromkeys(args.policies) if p != "full"]
    given = given_tier_flags(args)
    if given and not tiered:
        raise KVFastError(f"{given[0]} is used by none of the policies {args.policies} (tiers are on for POLICY+warm, "
                          "e.g. h2o+warm)")
    args.tiers = tier_settings(args) if tiered else None
    for b in args.budgets:
        if b <= 0 or (b > 1 and b != int(b)):
            raise KVFastError(f"--budgets: {b:g} is neither a fraction in (0, 1] nor a whole number of slots")
    for name in ("samples", "ppl_samples", "ppl_every", "fidelity_tokens", "answer_room", "batch_size"):
        if getattr(args, name) <= 0:
            raise KVFastError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if min(args.lengths) < 128:
        raise KVFastError(f"--lengths must be at least 128 tokens, got {min(args.lengths)}")
    if any(not 0 <= d <= 1 for d in args.depths):
        raise KVFastError("--depths must lie in [0, 1]")
    if args.limit is not None and args.limit <= 0:
        raise KVFastError(f"--limit must be > 0, got {args.limit}")
    if "fidelity" in args.tasks and args.fidelity_tokens > args.answer_room:
        raise KVFastError("--fidelity-tokens cannot exceed --answer-room")
    args.ppl_length = args.ppl_length or max(args.lengths)
    args.fidelity_lengths = args.fidelity_lengths or args.lengths
    if min(args.fidelity_lengths) < 128:
        raise KVFastError(f"--fidelity-lengths must be at least 128 tokens, got {min(args.fidelity_lengths)}")
    args.params = {k: kvcache.PARAMS[k][0](k, getattr(args, k)) for k in kvcache.PARAMS if getattr(args, k) is not None}
    for key in args.params:
        if not any(key in policy_params(split_combo_policy(p)[0]) for p in args.policies):
            raise KVFastError(f"--{key.replace('_', '-')} is used by none of the policies {args.policies}")
    if args.ray_workers is not None and (args.ray is None or args.ray_workers <= 0):
        raise KVFastError("--ray-workers needs --ray and must be > 0")
    if args.ppl_every > args.ppl_length:
        raise KVFastError("--ppl-every exceeds --ppl-length")


# ---- combos and records ----------------------------------------------------------------------------------
def combos_of(args: argparse.Namespace) -> list[Combo]:
    combos = [Combo("full", None)]
    for name in args.policies:
        policy, warm, shift = split_combo_policy(name)
        tiers = tuple(args.tiers.items()) if warm else None
        combos += [Combo(policy, b, tiers, shift) for b in args.budgets if policy != "full"]
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
                        "time_s": round(elapsed, 4), "prefill_s": round(prefill_s, 4)}
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
                                                             a.depths, self.memo.get("sentences"))
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
    return [record_key(t, cell.length, i, c, mode) for mode in args.mode for c in combos for t in cell.wanted
            for i in cell.indices]


def run_cell(ev: Evaluator, inputs: Inputs, cell: Cell, combos: list[Combo], store: Store, bar: Any) -> None:
    if cell.source == TEXT:
        windows = inputs.windows()
        run_windows(ev, [windows[i] for i in cell.indices], list(cell.indices), list(cell.wanted), combos, store, bar)
    else:
        prompts = inputs.prompts(cell.source, cell.length)
        run_prompts(ev, [prompts[i] for i in cell.indices], list(cell.wanted), combos, store, bar)


def evaluate(ev: Evaluator, store: Store, ray_address: str | None = None, worker_args: tuple = ()) -> None:
    """Run every cell not done yet: here, one after another, or as Ray tasks (evalray.py) when ray_address is
    given (worker_args: how a worker loads the model, evalray.run_cells)."""
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
        if ray_address is not None:
            import evalray

            todo = [c for c in cells if not all(map(store.done, keys[c]))]
            if todo:
                evalray.run_cells(ray_address, todo, keys, store, bar, args, *worker_args)
            return
        for cell in cells:
            run_cell(ev, inputs, cell, combos, store, bar)


# ---- main -------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if args.device == "cpu" else torch.bfloat16)
    checkpoint = resolve_checkpoint(args.checkpoint)
    model, tokenizer = load(checkpoint, args.device, dtype)
    longest = max(args.lengths + args.fidelity_lengths) + args.answer_room
    if longest > model.args.max_seq_len:
        raise KVFastError(f"length + --answer-room ({longest}) exceeds the model's maximum of {model.args.max_seq_len}")
    unshifted = [p for p in args.policies[1:] if not split_combo_policy(p)[2]]
    if args.ppl_length > model.args.max_seq_len and (unshifted or "attention-loss" in args.tasks):
        why = f"policies {unshifted} keep" if unshifted else "attention-loss needs full's attention over"
        raise KVFastError(f"--ppl-length {args.ppl_length} exceeds the model's maximum of {model.args.max_seq_len}: "
                          f"{why} original positions (only POLICY+shift combos, --pos-shift, read past it)")
    if args.compile:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(combos_of(args)) + 8)
    name = checkpoint.name if checkpoint.is_dir() else checkpoint.parent.name
    out = args.out or ROOT / "results" / name
    config = {"checkpoint": name, "seed": args.seed, "chat": args.chat, "dtype": str(dtype).replace("torch.", ""),
              "haystack": args.haystack, "ppl_text": args.ppl_text, "depths": args.depths,
              "fidelity_tokens": args.fidelity_tokens, "answer_room": args.answer_room, "ppl_length": args.ppl_length,
              "ppl_every": args.ppl_every, "ppl_decode_all": args.ppl_decode_all, "params": args.params}
    store = Store(out, config, args.overwrite)
    t0 = time.perf_counter()
    worker = (checkpoint, str(dtype).replace("torch.", ""), args.ray_workers)  # how a Ray worker loads the model
    evaluate(Evaluator(model, tokenizer, args), store, args.ray, worker)
    wall = time.perf_counter() - t0
    store.save()
    import evalreport

    (out / "summary.md").write_text(evalreport.summary(list(store.records.values()), config, wall))
    if not args.no_plots:
        evalreport.plots(list(store.records.values()), out)
    print(f"wrote {out / 'results.json'}, {out / 'summary.md'} ({wall:.0f} s)")
    return out


def cli(argv: list[str] | None = None) -> int:
    return run_cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
