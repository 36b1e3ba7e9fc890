"""bench.py speculate: self-speculative decoding (speculate.py) against plain full-cache decoding, on real text.

Per weights mode, full cache K/V format (fp32 and each --kv-bits) and prompt length: the first N tokens of
--quality-text as the prompt (random ids would make the draft's acceptance meaningless), greedy, --new-tokens
tokens, compiled (block scope: each graph compiles in seconds). Plain: the full cache, one token per step.
Speculative: each --drafts cache (POLICY@BUDGET) with each --draft-k K. The runs alternate (plain, then each
speculative row, --repeats rounds). Reported: decode tok/s (median, prefill excluded), the speedup over plain,
the share of drafts accepted, tokens per verification, and whether the tokens equal plain decoding's.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from pathlib import Path

import torch
from torch import Tensor

import cache as kvcache
import quantize
from benchmarks.common import Bench, Flag, row, table, text_ids
from benchmarks.kv_bits import QUALITY_TEXT
from decode import Decoder
from kv.quant import kv_format
from model import KVFastError, Transformer
from speculate import Speculator


def parse_draft(text: str) -> tuple[str, float]:
    policy, _, budget = text.partition("@")
    try:
        value = float(budget)
    except ValueError:
        raise KVFastError(f"--drafts {text!r}: expected POLICY@BUDGET, e.g. window@0.05") from None
    if policy not in kvcache.POLICIES or not kvcache.POLICIES[policy].evicts:
        raise KVFastError(f"--drafts {text!r}: {policy!r} is not an evicting policy")
    return policy, value


def run_once(runner, model: Transformer, ids: Tensor, new_tokens: int) -> tuple[float, list[int]]:
    """One greedy run from a fresh prefill: (decode tok/s, prefill excluded; the tokens)."""
    for c in model.caches:
        c.reset()
    if isinstance(runner, Speculator):
        runner.reset()
    with torch.inference_mode():
        first = runner.prefill(model, ids, 0.0, None)
        t0 = time.perf_counter()
        rest = runner.decode(first, ids.shape[1], new_tokens - 1)
        elapsed = time.perf_counter() - t0
    return (new_tokens - 1) / elapsed, torch.cat([first, rest], 1)[0].tolist()


def interleaved_runs(runners: dict, model: Transformer, ids: Tensor, new_tokens: int, repeats: int) -> dict:
    """Per runner the median tok/s over `repeats` rounds in which every runner decodes once in turn (after an
    untimed round that compiles), and its tokens: rows timed minutes apart drift on a shared host."""
    rates: dict[str, list[float]] = {name: [] for name in runners}
    tokens = {}
    for r in range(repeats + 1):
        for name, runner in runners.items():
            rate, tokens[name] = run_once(runner, model, ids, new_tokens)
            if r:
                rates[name].append(rate)
    return {name: (statistics.median(rates[name]), tokens[name]) for name in runners}


def bench_speculate(model: Transformer, checkpoint: Path, args: argparse.Namespace) -> dict:
    drafts = [parse_draft(d) for d in args.drafts]
    text = text_ids(checkpoint, args.quality_text)
    out = {}
    for mode, bits in itertools.product(args.weights, (None, *args.kv_bits)):
        m = quantize.quantized_copy(model, mode)
        kv, kv_name = kv_format(bits, args.kv_float, verifies=True)
        for length in args.lengths:
            if len(text) < length:
                raise KVFastError(f"--quality-text has {len(text)} tokens, fewer than --lengths {length}")
            ids = torch.tensor([text[:length]])
            room = args.new_tokens + max(args.draft_k)
            m.setup_caches(kvcache.make_cache_factory("full", 1, m.args, length, room, **kv))
            decoder = Decoder(m, compile=True, scope="block")
            runners = {"plain": decoder}
            for policy, budget in drafts:
                factory = kvcache.make_cache_factory(policy, 1, m.args, length, room, budget=budget)
                draft = [factory(i) for i in range(m.args.n_layers)]
                for k in args.draft_k:
                    runners[f"{policy}@{budget} K={k}"] = Speculator(m, decoder, draft, k)
            timed = interleaved_runs(runners, m, ids, args.new_tokens, args.repeats)
            plain, plain_tokens = timed["plain"]
            rows = {"plain": {"tok_s": plain}}
            for name, (tok_s, tokens) in timed.items():
                if name != "plain":
                    spec = runners[name]  # its counters: the last run's
                    rows[name] = {"tok_s": tok_s, "speedup": tok_s / plain, "slots": spec.draft[0].capacity,
                                  "accepted": spec.accepted / spec.drafted,
                                  "per_round": (spec.accepted + spec.rounds) / spec.rounds,
                                  "same_tokens": tokens == plain_tokens}
            torch._dynamo.reset()
            out[f"{mode} {kv_name} {length}"] = rows
            table(f"{mode} weights, {kv_name} K/V in the full cache (the draft's: fp32), {length}-token prompt "
                  f"({args.quality_text}), {args.new_tokens} new tokens, greedy, compiled (block), runs interleaved, "
                  f"median of {args.repeats}",
                  ["decoding", "draft slots per layer", "decode tok/s", "vs plain", "drafts accepted",
                   "tokens per verification", "tokens = plain"])
            for name, r in rows.items():
                if name == "plain":
                    row("plain (full cache)", "-", f"{r['tok_s']:.1f}", "1.00x", "-", "1.00", "-")
                    continue
                row(name, r["slots"], f"{r['tok_s']:.1f}", f"{r['speedup']:.2f}x", f"{100 * r['accepted']:.0f} %",
                    f"{r['per_round']:.2f}", "yes" if r["same_tokens"] else "NO")
    return out


def check(args: argparse.Namespace) -> None:
    for text in args.drafts:
        parse_draft(text)


BENCH = Bench(__doc__, bench_speculate, {
    "drafts": Flag(["window@0.05", "window@0.1"], "draft caches as POLICY@BUDGET (an evicting policy; a fraction "
                                                  "of prompt + new tokens or a slot count)",
                   {"nargs": "+", "metavar": "POLICY@BUDGET"}),
    "draft_k": Flag([2, 3, 4], "drafts per round (generate.py --speculate K), a row each",
                    {"type": int, "nargs": "+", "metavar": "K"}),
    "weights": Flag(["fp32"], "weights, quantized in memory as quantize.py writes them, a table each"),
    "kv_bits": Flag([], "also with the full cache's K/V in these formats (16: --kv-float; 8 / 4: quantized), a "
                        "table each"),
    "kv_float": Flag("auto", "the 16-bit float of --kv-bits 16 (auto: bfloat16 on a CPU with bfloat16 dot "
                             "products, else float16)"),
    "lengths": Flag([4096], "prompt lengths in tokens (the first tokens of --quality-text), a table each"),
    "new_tokens": Flag(128, "tokens decoded per run"),
    "quality_text": QUALITY_TEXT,
}, check=check)
