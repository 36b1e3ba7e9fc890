"""bench.py ragged: several different prompts decoded together (ragged.py) against one run per prompt.

Eight prompts (--ragged-lengths, default 20 to 2000 tokens) cut from --quality-text at different places, greedy,
--new-tokens each, compiled (block scope), per policy of --policies (default full and h2o at --budget): the
caches of both ways are sized by the longest prompt, so a prompt's run alone keeps exactly what its row keeps and
one compiled graph serves every run. Reported: prefill (all prompts), decode tok/s of all rows together against
the separate runs one after another (the median of --repeats after a compiling round), and how many rows give
the tokens of their run alone.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import cache as kvcache
import ragged
from benchmarks.common import Bench, Flag, row, table, text_ids
from benchmarks.kv_bits import QUALITY_TEXT
from decode import Decoder, prefill
from model import KVFastError, Transformer


def prompts_from_text(text_ids: list[int], lengths: list[int]) -> list[list[int]]:
    """Each prompt from its own stretch of the text, so the rows differ."""
    need = sum(lengths)
    if len(text_ids) < need:
        raise KVFastError(f"--quality-text has {len(text_ids)} tokens, fewer than the prompts' {need}")
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [text_ids[s : s + n] for s, n in zip(starts, lengths)]


def run_ragged(model: Transformer, decoder: Decoder, rows: list[list[int]], batch: list, single: list,
               new_tokens: int) -> tuple[float, float, torch.Tensor]:
    """(prefill s, decode s, tokens [B, new_tokens]) of all rows together."""
    with torch.inference_mode():
        t0 = time.perf_counter()
        first = ragged.prefill_rows(model, rows, batch, single, prefill, 0.0, None)
        t1 = time.perf_counter()
        rest = decoder.decode(first, max(map(len, rows)), new_tokens - 1)
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1, torch.cat([first, rest], 1)


def run_alone(model: Transformer, decoder: Decoder, ids: list[int], caches: list,
              new_tokens: int) -> tuple[float, float, torch.Tensor]:
    model.setup_caches(lambda i: caches[i])
    for c in caches:
        c.reset()
    with torch.inference_mode():
        t0 = time.perf_counter()
        first = prefill(model, torch.tensor([ids]), 0.0, None)
        t1 = time.perf_counter()
        rest = decoder.decode(first, len(ids), new_tokens - 1)
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1, torch.cat([first, rest], 1)


def bench_ragged(model: Transformer, checkpoint: Path, args: argparse.Namespace) -> dict:
    rows = prompts_from_text(text_ids(checkpoint, args.quality_text), args.ragged_lengths)
    longest, n = max(map(len, rows)), model.args.n_layers
    out = {}
    for policy in args.policies:
        budget = None if policy == "full" else args.budget
        batch, single = ([kvcache.make_cache_factory(policy, b, model.args, longest, args.new_tokens, budget=budget)(i)
                          for i in range(n)] for b in (len(rows), 1))  # single: each prompt's prefill, each run alone
        decoder = Decoder(model, compile=True, scope="block")
        together, alone = [], []
        for _ in range(args.repeats + 1):  # the first round compiles
            together.append(run_ragged(model, decoder, rows, batch, single, args.new_tokens))
            alone.append([run_alone(model, decoder, ids, single, args.new_tokens) for ids in rows])
        together, alone = together[1:], alone[1:]
        decode_together = statistics.median(t[1] for t in together)
        decode_alone = statistics.median(sum(r[1] for r in runs) for runs in alone)
        same = sum(torch.equal(together[0][2][i], alone[0][i][2][0]) for i in range(len(rows)))
        tokens = len(rows) * (args.new_tokens - 1)
        out[policy] = {"capacity": batch[0].capacity, "prefill_s": statistics.median(t[0] for t in together),
                       "tok_s_together": tokens / decode_together, "tok_s_alone": tokens / decode_alone,
                       "same_rows": same, "rows": len(rows)}
        torch._dynamo.reset()
    table(f"{len(rows)} prompts of {', '.join(str(len(r)) for r in rows)} tokens ({args.quality_text}), "
          f"{args.new_tokens} new tokens each, greedy, compiled (block), median of {args.repeats}",
          ["policy", "slots per layer", "prefill, all prompts (s)", "decode tok/s, one run per prompt",
           "decode tok/s, together", "speed-up", "rows = their run alone"])
    for policy, r in out.items():
        name = policy if policy == "full" else f"{policy} @ {args.budget:g}"
        row(name, r["capacity"], f"{r['prefill_s']:.2f}", f"{r['tok_s_alone']:.1f}", f"{r['tok_s_together']:.1f}",
            f"{r['tok_s_together'] / r['tok_s_alone']:.2f}x", f"{r['same_rows']} of {r['rows']}")
    return out


BENCH = Bench(__doc__, bench_ragged, {
    "ragged_lengths": Flag([20, 45, 100, 200, 400, 700, 1200, 2000], "the prompts' lengths in tokens, a row of the "
                                                                      "batch each",
                           {"type": int, "nargs": "+", "metavar": "N"}),
    "policies": Flag(["full", "h2o"], "cache policies, a row each"),
    "budget": Flag(0.25, "cache budget of the policies other than full"),
    "new_tokens": Flag(128, "tokens decoded per prompt"),
    "quality_text": QUALITY_TEXT,
})
