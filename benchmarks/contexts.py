"""bench.py contexts: compress once, ask many. N questions about one long context, end to end, two ways:

- reuse: one prefill + compression of the context, a snapshot of the caches (kv.snapshot), then per question a
  restore, the question read through the decode step and the answer decoded;
- fresh: N separate runs, each a prefill + compression of the same context, the question and the answer.

The context is shared_context's (evals.tasks): N RULER-style needles in RULER's noise haystack, each asked in
turn, so the table also scores the answers, and checks that reuse answers token for token as the fresh runs do.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import cache as kvcache
import quantize
from benchmarks.common import Bench, Flag, row, table, tokenizer_of
from decode import Decoder, synchronize, truncate_at_stop
from evals import tasks
from kv import snapshot
from model import KVFastError, Transformer


def context_and_questions(tok: object, length: int, n: int) -> tasks.Prompt:
    """shared_context's first sample at `length` tokens with n needles, each asked in turn."""
    framing = tasks.Framing.make(tok, chat=False)
    units = tasks.haystack_units(tok, tasks.NOISE)
    return tasks.make_prompts(tasks.SHARED, tok, framing, length, 1, 0, [0.5], units, n)[0]


def timed(fn: object, device: torch.device) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - t0


def run_policy(model: Transformer, tok: object, prompt: tasks.Prompt, policy: str, kv_bits: int | None,
               args: argparse.Namespace) -> dict:
    """Both schedules for one policy: seconds of each, per-question seconds of reuse, answers and scores."""
    device = next(model.parameters()).device
    ctx = torch.tensor([prompt.context], device=device)
    S, turns = ctx.shape[1], prompt.turns
    Q = len(turns[0][0])
    budget = None if policy == "full" else args.budget
    factory = kvcache.make_cache_factory(policy, 1, model.args, S, Q + args.new_tokens, budget=budget,
                                         kv_bits=kv_bits, tokenizer=tok)
    model.setup_caches(factory)
    decoder = Decoder(model, compile=not args.eager, scope=args.compile_scope)
    if not args.eager:
        decoder.warm_up(ctx)

    def answer(question: list[int]) -> list[int]:
        x = decoder.feed(torch.tensor([question], device=device), S)
        rest = decoder.decode(x, S + Q, args.new_tokens - 1)
        ids = torch.cat([x, rest], 1)[0].tolist()
        return truncate_at_stop(ids, tok.stop_ids) if getattr(tok, "stop_ids", None) else ids

    def fresh() -> list[list[int]]:
        out = []
        for question, _ in turns:
            decoder.reset()
            decoder.prefill(model, ctx, 0.0, None)
            out.append(answer(question))
        return out

    def reuse() -> tuple[list[list[int]], list[float]]:
        decoder.reset()
        t0 = time.perf_counter()
        decoder.prefill(model, ctx, 0.0, None)
        snap = snapshot.snapshot(model)
        out, marks = [], [time.perf_counter() - t0]
        for question, _ in turns:
            t0 = time.perf_counter()
            snapshot.restore(model, snap)
            out.append(answer(question))
            marks.append(time.perf_counter() - t0)
        return out, marks

    with torch.inference_mode():
        reuse_s, fresh_s, marks = [], [], []
        for _ in range(args.repeats):  # alternating: a shared host drifts between separately timed runs
            (reused, m), t = timed(reuse, device)
            reuse_s.append(t)
            marks.append(m)
            fresh_answers, t = timed(fresh, device)
            fresh_s.append(t)
    mid = sorted(range(len(reuse_s)), key=reuse_s.__getitem__)[len(reuse_s) // 2]
    texts = [tok.decode(ids) for ids in reused]
    scores = [tasks.score(tasks.SHARED, text, refs) for text, (_, refs) in zip(texts, turns)]
    return {"context_tokens": S, "question_tokens": Q, "reuse_s": reuse_s[mid],
            "fresh_s": sorted(fresh_s)[len(fresh_s) // 2],
            "compress_s": marks[mid][0], "per_question_s": marks[mid][1:], "same_answers": reused == fresh_answers,
            "answers": texts, "scores": scores, "capacity": factory.capacities[0]}


def bench_contexts(model: Transformer, checkpoint: Path, args: argparse.Namespace) -> dict:
    tok = tokenizer_of(checkpoint)
    prompt = context_and_questions(tok, args.context_len, args.questions)
    table(f"{args.questions} questions about one {args.context_len}-token context, end to end (s; median of "
          f"{args.repeats}): reuse = one prefill + compression, then a restore per question; fresh = a prefill + "
          f"compression per question; budget {args.budget:g}, {args.new_tokens} answer tokens, "
          f"{'eager' if args.eager else 'compiled'} decode",
          ["weights", "policy", "K/V", "slots", "prefill + compression", "restore + question + answer (mean)", "reuse",
           f"{args.questions} fresh runs", "fresh / reuse", "same answers", "score"])
    results = {}
    for weights in args.weights:
        m = quantize.quantized_copy(model, weights)
        for policy in args.policies:
            for bits in args.kv_bits or [None]:
                r = run_policy(m, tok, prompt, policy, bits, args)
                results[f"{weights}/{policy}" + (f"+kv{bits}" if bits else "")] = r
                per = sum(r["per_question_s"]) / len(r["per_question_s"])
                row(weights, policy, f"{bits}-bit" if bits else "fp", r["capacity"], f"{r['compress_s']:.2f}", f"{per:.2f}",
                    f"{r['reuse_s']:.2f}", f"{r['fresh_s']:.2f}",
                    f"{r['fresh_s'] / r['reuse_s']:.1f}x", "yes" if r["same_answers"] else "NO",
                    f"{sum(r['scores']) / len(r['scores']):.2f}")
    return results


def check(args: argparse.Namespace) -> None:
    unknown = [p for p in args.policies if p not in kvcache.POLICIES]
    if unknown:
        raise KVFastError(f"unknown cache policy {unknown[0]!r} (choose from {', '.join(kvcache.POLICIES)})")
    if args.questions < 1 or args.context_len < 256 or args.new_tokens < 1 or args.repeats < 1:
        raise KVFastError("--questions, --new-tokens and --repeats must be >= 1 and --context-len >= 256")
    if not 0 < args.budget:
        raise KVFastError(f"--budget must be > 0, got {args.budget:g}")


BENCH = Bench(__doc__, bench_contexts, {
    "policies": Flag(["snapkv", "kvzip"], "cache policies, a row each (full: no compression)"),
    "weights": Flag(["fp32"], "weight formats, rows each (quantize.py's modes)"),
    "budget": Flag(0.25, "cache budget: a fraction of context + question + answer, or slots per layer if > 1"),
    "kv_bits": Flag([], "K/V storage, a row each: 16-bit floats or 8 / 4-bit codes (none: the compute dtype)"),
    "context_len": Flag(4096, "context + one question, in tokens", {"type": int, "metavar": "N"}),
    "questions": Flag(8, "questions asked about the context (one needle each)", {"type": int, "metavar": "N"}),
    "new_tokens": Flag(16, "answer tokens per question"),
    "compile_scope": Flag("block", "compiled decode step's scope"),
    "eager": Flag(False, "decode eagerly (no compile)", {"action": "store_true"}),
}, check=check)
