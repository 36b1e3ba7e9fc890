"""bench.py kv-bits: K/V stored in the compute dtype vs 16 vs 8 vs 4 bits: step time, K/V bytes, quality.

Per policy: the compiled decode step at each length, the megabytes the caches hold, and what the format costs in
quality (--quality-tokens of real text, the first half prefilled, the second teacher-forced through the decode
step: KL and top-1 agreement against the compute-dtype K/V); then the formats' steps interleaved in one process.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import Tensor

import cache as kvcache
from benchmarks.common import Bench, Flag, row, table, text_ids
from benchmarks.policies import COMPILE_SCOPE, LENGTHS, STEPS, interleaved_caches, step_time
from decode import Decoder
from kv.quant import kv_format
from model import Transformer

BITS = (None, 16, 8, 4)  # None: the compute dtype


def forced_logprobs(model: Transformer, policy: str, ids: Tensor, budget: float | None, **cache_kwargs) -> Tensor:
    """Prefill the first half of ids [1, T], teacher-force the rest through the (eager) decode step: the
    next-token log-probs [T/2 - 1, V] of the second half."""
    P, T = ids.shape[1] // 2, ids.shape[1]
    kwargs = {} if budget is None else {"budget": budget}
    model.setup_caches(kvcache.make_cache_factory(policy, 1, model.args, P, T - P, **kwargs, **cache_kwargs))
    steps: list[Tensor] = []
    with torch.inference_mode():
        model(ids[:, :P])
        Decoder(model).decode(ids[:, P : P + 1], P, T - P - 1, forced=ids[:, P + 1 :],
                              on_logits=lambda i, logits: steps.append(torch.log_softmax(logits[0, 0].float(), -1)))
    return torch.stack(steps)


def bench_kv_bits(model: Transformer, checkpoint: Path, args: argparse.Namespace) -> dict:
    ids = torch.tensor([text_ids(checkpoint, args.quality_text)[: args.quality_tokens]])
    results: dict[str, dict] = {}
    table(f"decode step time (ms), compiled, K/V stored in the compute dtype vs --kv-bits 16 "
          f"({kv_format(16, args.kv_float)[1]}) / 8 / 4 (one group per token and head); budget {args.budget:g} for "
          f"policies other than full; KV = MB the caches hold. Quality: {ids.shape[1]} tokens of "
          f"{args.quality_text!r}, the first half prefilled, the second teacher-forced through the decode step; "
          "KL(fp32 K/V || quantized) and top-1 agreement per token",
          ["policy", "K/V", *(f"{n} tokens: step (vs fp32), KV MB" for n in args.lengths), "KL vs fp32",
           "top-1 vs fp32"])
    for policy in args.policies:
        budget = None if policy == "full" else args.budget
        base: dict[int, float] = {}
        reference = forced_logprobs(model, policy, ids, budget)
        for bits in BITS:
            cells, result = [], {}
            kv, label = kv_format(bits, args.kv_float)
            for n in args.lengths:
                t, _ = step_time(model, policy, n, budget, args.steps, args.repeats, args.compile_scope, **kv)
                kv_mb = sum(c.physical_bytes() for c in model.caches) / 1e6
                base.setdefault(n, t)
                result[n] = {"step_s": t, "kv_MB": kv_mb}
                cells.append(f"{1e3 * t:.1f} ({base[n] / t:.2f}x), {kv_mb:.1f}")
            lp = reference if bits is None else forced_logprobs(model, policy, ids, budget, **kv)
            result["kl"] = (reference.exp() * (reference - lp)).sum(-1).mean().item()
            result["top1"] = (lp.argmax(-1) == reference.argmax(-1)).float().mean().item()
            results[f"{policy}/{label}"] = result
            row(policy, label, *cells, f"{result['kl']:.4f}", f"{result['top1']:.3f}")
        formats = [kv_format(bits, args.kv_float) for bits in BITS]
        setups = {label: {"policy": policy, "budget": budget, **kv} for kv, label in formats}
        results[f"{policy}/interleaved"] = interleaved_caches(model, setups, args.lengths[-1], args)
    return results


QUALITY_TEXT = Flag("jargon", "text of the quality columns: a named text (see eval.py --ppl-text; `make data` "
                              "fetches it) or a file")
QUALITY_TOKENS = Flag(1024, "tokens of --quality-text")

BENCH = Bench(__doc__, bench_kv_bits, {
    "policies": Flag(["full", "h2o"], "cache policies, a group of rows each"),
    "lengths": LENGTHS,
    "budget": Flag(0.25, "cache budget of the policies other than full"),
    "steps": STEPS,
    "compile_scope": COMPILE_SCOPE,
    "kv_float": Flag("auto", "the 16-bit float of the 16-bit rows (generate.py --kv-float; auto: float16)"),
    "quality_text": QUALITY_TEXT,
    "quality_tokens": QUALITY_TOKENS,
})
