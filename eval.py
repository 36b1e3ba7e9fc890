"""Quality of every KV-cache policy at every budget, offline: retrieval, perplexity, fidelity, attention loss.

    python eval.py --tasks passkey niah ppl fidelity --policies full window h2o scissorhands snapkv \\
        --budgets 0.5 0.25 0.125 --lengths 1024 2048 4096 --samples 20

Tasks (evals/tasks.py builds them, seeded, at exact token lengths):
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
share one batch. Decoding is decode.Decoder's (optionally compiled) step. Results go to --out: results.json,
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
import os
import sys
import time
from functools import partial
from pathlib import Path

# OpenMP threads that spin while waiting lose their core to any other busy process on a small shared machine and
# then stall every parallel region (decode steps measured 5-30x slower here); passive waiting avoids that.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # after OMP_WAIT_POLICY, which is read when torch loads OpenMP

import cache as kvcache
import evals.ray
from cli import DEFAULT_CHECKPOINT, ArgumentParser, load, resolve_checkpoint, run_cli
from decode import DEFAULT_PREFILL_CHUNK, configure_torch
from evals import report, tasks
from evals.caches import (
    SHIFT,
    Evaluator,
    add_tier_flags,
    combo_kv_bits,
    given_tier_flags,
    policy_params,
    split_combo_policy,
    tier_settings,
)
from evals.evaluator import combos_of, evaluate
from evals.store import Store
from model import KVFastError

ROOT = Path(__file__).resolve().parent
TASK_NAMES = ("passkey", "niah", *tasks.NIAH_NEEDLES, tasks.SHARED, "fidelity", "ppl", "attention-loss")
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
                        "POLICY+shift: with --pos-shift, e.g. window+shift; a last +kv16, +kv8 or +kv4: with "
                        "--kv-bits, e.g. kvzip+kv4 or h2o+warm+kv8")
    p.add_argument("--pos-shift", action="store_true",
                   help="every policy but full as POLICY+shift (StreamingLLM's positions): a ppl window may then "
                        "exceed the model's length (full is left out of such windows)")
    p.add_argument("--budgets", nargs="+", type=float, default=[0.5, 0.25, 0.125],
                   help="cache budgets: fractions of prompt + new tokens (or slots per layer if > 1); with "
                        "--budget-unit bytes, fractions of the full cache's bytes")
    p.add_argument("--budget-unit", choices=["slots", "bytes"], default="slots",
                   help="slots: a budget is a share of the slots (each combo's bytes follow from its format); "
                        "bytes: a share of the full cache's K/V bytes that every combo holds at most, everything "
                        "counted (K/V at its bits, scales, positions, statistics, warm tier): each combo gets "
                        "the slots (and warm tokens) that fit (kv.report.slots_for_bytes)")
    p.add_argument("--warm-share", type=float, default=0.5,
                   help="--budget-unit bytes: the share of a +warm combo's bytes its warm store gets (the hot "
                        "slots get the rest)")
    p.add_argument("--shared-questions", type=int, default=tasks.SHARED_QUESTIONS,
                   help=f"{tasks.SHARED}: needles in each context, each asked in turn of one compressed cache")
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
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                   help="prompt rows per prefill block, layer by layer (0: one block); memory then grows with the "
                        "block, not the prompt")
    p.add_argument("--prefill-dtype", default=None, choices=["float32", "bfloat16"],
                   help="precision of the prefill's products (default: the compute dtype); bfloat16 runs them on "
                        "AMX / AVX512-BF16; q, k, v and the caches stay in the compute dtype")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (once per cache shape)")
    p.add_argument("--compile-scope", choices=["step", "block"], default=None,
                   help="with --compile: one block reused for every layer (the default on CPU) or the whole step "
                        "in one graph (the default on CUDA)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (default float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run the cells as Ray tasks (evals/ray.py): alone, on a local cluster started here; with an "
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
    if args.prefill_chunk < 0:
        raise KVFastError(f"--prefill-chunk must be >= 0 (0: one block), got {args.prefill_chunk}")
    tiered = False
    if args.pos_shift:
        args.policies = [p if p == "full" or p.endswith(SHIFT) else p + SHIFT for p in args.policies]
    for name in args.policies:
        policy, warm, shift = split_combo_policy(name)
        bits = combo_kv_bits(name)[1]
        if policy not in kvcache.POLICIES:
            raise KVFastError(f"unknown cache policy {name!r} (choose from {', '.join(kvcache.POLICIES)}, each "
                              "optionally +warm or +shift, then +kv16, +kv8 or +kv4)")
        if policy == "full" and bits:
            raise KVFastError(f"--policies {name}: full is the reference, in the compute dtype")
        if warm or shift or bits:  # full, adakv and kvzip have no tiers: cache.py's one-line reason
            try:
                kvcache.CacheSpec(policy, tiers={"warm_tokens": 1.0} if warm else {}, pos_shift=shift,
                                  kv_bits=bits).resolve()
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
        if b > 1 and args.budget_unit == "bytes":
            raise KVFastError(f"--budgets: {b:g} with --budget-unit bytes: give a fraction of the full cache's bytes")
    if not 0 < args.warm_share < 1:
        raise KVFastError(f"--warm-share must lie in (0, 1), got {args.warm_share:g}")
    if args.shared_questions < 1:
        raise KVFastError(f"--shared-questions must be >= 1, got {args.shared_questions}")
    if tasks.SHARED in args.tasks and "agnostic" not in args.mode:
        raise KVFastError(f"{tasks.SHARED} compresses the context before any question: it needs --mode agnostic")
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
    args.params = {k: kvcache.PARAMS[k].validate(getattr(args, k)) for k in kvcache.PARAMS if getattr(args, k) is not None}
    for key in args.params:
        if not any(key in policy_params(split_combo_policy(p)[0]) for p in args.policies):
            raise KVFastError(f"--{key.replace('_', '-')} is used by none of the policies {args.policies}")
    if args.ray_workers is not None and (args.ray is None or args.ray_workers <= 0):
        raise KVFastError("--ray-workers needs --ray and must be > 0")
    if args.ppl_every > args.ppl_length:
        raise KVFastError("--ppl-every exceeds --ppl-length")


# ---- main -------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    configure_torch(args.compile)
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
    # settings that change what a record means, only where not the default (earlier results folders stay valid)
    if args.budget_unit != "slots":
        config |= {"budget_unit": args.budget_unit, "warm_share": args.warm_share}
    if tasks.SHARED in args.tasks and args.shared_questions != tasks.SHARED_QUESTIONS:
        config["shared_questions"] = args.shared_questions
    store = Store(out, config, args.overwrite)
    t0 = time.perf_counter()
    # the cells as Ray tasks; the checkpoint and dtype say how a worker loads the model
    remote = None if args.ray is None else partial(
        evals.ray.run_cells, address=args.ray, args=args, checkpoint=checkpoint, dtype=config["dtype"],
        workers=args.ray_workers)
    evaluate(Evaluator(model, tokenizer, args), store, remote)
    wall = time.perf_counter() - t0
    store.save()
    (out / "summary.md").write_text(report.summary(list(store.records.values()), config, wall))
    if not args.no_plots:
        report.plots(list(store.records.values()), out)
    print(f"wrote {out / 'results.json'}, {out / 'summary.md'} ({wall:.0f} s)")
    return out


def cli(argv: list[str] | None = None) -> int:
    return run_cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
