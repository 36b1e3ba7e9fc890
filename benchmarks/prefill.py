"""bench.py prefill: what each prompt compressor (kvzip's reconstruction, ...) adds to a plain prefill.

Per length: a plain prefill (every
layer's q, k, v recorded), then each compressor's work on top of it (statistics, scores, selection into a cache of
a quarter of the prompt; kvzip: its reconstruction pass, once per --kvzip-dtypes value). Random token ids: the
cost does not depend on the text.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

import cache as kvcache
from benchmarks.common import Bench, Flag, median_time, row, table, tokenizer_of
from benchmarks.policies import LENGTHS
from kv import kvzip
from model import KVFastError, Transformer


def compress_prompt(model: Transformer, idx: Tensor, kv: list, caches: list) -> None:
    """Fill caches from a recorded prefill (kv) of idx, with fresh memos: all the compressors' work."""
    memos = [{} for _ in caches]
    kvzip.score_into(model, idx, kv, caches, memos)
    for c, (q, k, v), memo in zip(caches, kv, memos):
        c.prefill(q, k, v, memo=memo)


def bench_prefill(model: Transformer, checkpoint: Path, args: argparse.Namespace) -> dict:
    tok = tokenizer_of(checkpoint)
    # one column per compressor; kvzip once per --kvzip-dtypes value (its reconstruction's precision)
    columns = [(n, {"kvzip_dtype": d}) if n == "kvzip" else (n, {}) for n in args.compressors
               for d in (args.kvzip_dtypes if n == "kvzip" else [None])]
    names = [n if not extra else f"{n} ({extra['kvzip_dtype']})" for n, extra in columns]
    table(f"prefill vs prompt compression (s, median of {args.repeats}); ratio = (prefill + compression) / "
          "prefill; fp32", ["tokens", "prefill", *(f"{n}: s (ratio)" for n in names)])
    results = {}
    for n in args.lengths:
        idx = torch.randint(100, model.args.vocab_size - 100, (1, n), generator=torch.Generator().manual_seed(n))
        with torch.inference_mode():
            t_prefill = median_time(partial(kvzip.record_prefill, model, idx), args.repeats)
            kv, _ = kvzip.record_prefill(model, idx)
            result = {"prefill_s": t_prefill}
            for name, (compressor, extra) in zip(names, columns):
                factory = kvcache.make_cache_factory("snapkv", 1, model.args, n, 1, prompt_compression=compressor,
                                                     budget=n // 4 + 1, tokenizer=tok, **extra)
                caches = [factory(i) for i in range(model.args.n_layers)]
                result[name] = median_time(partial(compress_prompt, model, idx, kv, caches), args.repeats)
        results[n] = result
        row(n, f"{t_prefill:.2f}", *(f"{result[name]:.2f} ({(t_prefill + result[name]) / t_prefill:.2f}x)"
                                     for name in names))
    return results


def check(args: argparse.Namespace) -> None:
    unknown = [c for c in args.compressors if c not in kvcache.PROMPT_COMPRESSORS]
    if unknown:
        raise KVFastError(f"unknown prompt compressor {unknown[0]!r} (choose from "
                          f"{', '.join(kvcache.PROMPT_COMPRESSORS)})")


BENCH = Bench(__doc__, bench_prefill, {
    "compressors": Flag(["snapkv", "h2o", "expected_attention", "kvzip"], "prompt compressors, a column each",
                        {"nargs": "+", "metavar": "COMPRESSOR"}),
    "kvzip_dtypes": Flag(["float32", "bfloat16"], "precisions of kvzip's reconstruction pass, a column each",
                         {"nargs": "+", "choices": ["float32", "bfloat16", "auto"]}),
    "lengths": Flag(LENGTHS.default, "prompt lengths in tokens, a row each"),
}, check=check)
