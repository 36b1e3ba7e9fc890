"""bench.py batch: total decode tokens per second with B rows decoded together, against one row.

For each --weights mode (quantized in memory as quantize.py writes them) and each B of --batch-sizes (and 1): B random
prompts of --prompt-len tokens (row i is the same prompt for every B), the `full` cache, --new-tokens greedy tokens
per row, compiled at the default scope (block on CPU), the median of --repeats after a compiling round. Reported:
ms per step, total tok/s, the ratio to B = 1 and whether row 0 gives the tokens of its run at B = 1. Each step
reads the weights once for all rows (kernels.linear's per-row reductions share each weight load) but every row
its own K/V, so the ratio is bounded by (weights + K/V of one row) / (weights / B + K/V of one row) per row.
From kernels.GEMM_MIN_ROWS rows (per weight dtype, where this CPU has a GEMM for it) each --batch-kernels choice is
a row of its own: the blocked GEMM the compiled step takes there, and the reductions it replaces.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from pathlib import Path

import torch

import cache as kvcache
import kernels as mdl
import quantize
from benchmarks.common import Bench, Flag, row, table
from decode import Decoder
from kv.quant import kv_format
from model import KVFastError, Transformer

WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}  # int4: reductions only


def kernels(rows: int, weight_dtype: torch.dtype | None, choices: list[str]) -> list[str]:
    """The projection kernels a batch of `rows` one-token rows can take, of `choices` ("gemm", "reductions")."""
    return choices if rows >= mdl.gemm_rows(weight_dtype) else ["reductions"]


def time_batch(model: Transformer, prompts: torch.Tensor, new_tokens: int, repeats: int,
               kv: dict | None = None, kernel: str = "gemm") -> tuple[float, torch.Tensor]:
    """(seconds per decode step, tokens [B, new_tokens]) for the rows of prompts [B, S] decoded together; kv:
    kv.quant.kv_format's keywords; kernel "reductions" keeps the per-row reductions at any number of rows."""
    if kernel == "reductions":
        saved, mdl.GEMM_MIN_ROWS = mdl.GEMM_MIN_ROWS, {}
        try:
            return time_batch(model, prompts, new_tokens, repeats, kv)
        finally:
            mdl.GEMM_MIN_ROWS = saved
    B, S = prompts.shape
    model.setup_caches(kvcache.make_cache_factory("full", B, model.args, S, new_tokens, **(kv or {})))
    torch._dynamo.reset()
    decoder = Decoder(model, compile=True)
    decoder.warm_up(prompts)
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            for c in model.caches:
                c.reset()
            first = decoder.prefill(model, prompts, 0.0, None)
            t0 = time.perf_counter()
            rest = decoder.decode(first, S, new_tokens - 1)
            times.append((time.perf_counter() - t0) / (new_tokens - 1))
    return statistics.median(times), torch.cat([first, rest], 1)


def kv_bytes_per_token(model: Transformer, kv: dict) -> float:
    """K/V bytes one token costs in every layer's cache (codes, scales and zero points when quantized)."""
    cache = kvcache.make_cache_factory("full", 1, model.args, 1, 1, **kv)(0)
    return cache.physical_bytes() / cache.capacity * model.args.n_layers


def bench_batch(model: Transformer, checkpoint: Path, args: argparse.Namespace) -> dict:
    out = {}
    for prompt_len, kv_bits in itertools.product(args.prompt_len, args.kv_bits or [None]):
        kv_spec, kv_label = kv_format(kv_bits, args.kv_float)
        kv_row = kv_bytes_per_token(model, kv_spec)
        kv_name = f"{kv_label} K/V"
        prompts = torch.randint(100, model.args.vocab_size - 100, (max(1, *args.batch_sizes), prompt_len),
                                generator=torch.Generator().manual_seed(0))
        for mode in args.weights:
            m = quantize.quantized_copy(model, mode)
            weights, kv = m.weight_bytes(step=True), kv_row * (prompt_len + args.new_tokens // 2)
            rows, alone = {}, None
            for B in sorted({1, *args.batch_sizes}):
                for kernel in kernels(B, WEIGHT_DTYPES.get(mode), args.batch_kernels):
                    step, tokens = time_batch(m, prompts[:B], args.new_tokens, args.repeats, kv_spec, kernel)
                    alone = tokens[0] if alone is None else alone
                    rows[B, kernel] = {"step_ms": 1e3 * step, "tok_s": B / step, "bound": B * (weights + kv) / (weights + B * kv),
                                       "row0_same": bool(torch.equal(tokens[0], alone))}
            out[f"{prompt_len}/{mode}" + (f"/{kv_label}" if kv_bits else "")] = {f"{B}/{k}": r for (B, k), r in rows.items()}
            base = rows[min(rows)]["tok_s"]
            table(f"prompt {prompt_len} tokens, {mode} weights ({weights / 1e6:.0f} MB), {kv_name} "
                  f"({kv / 1e6:.1f} MB per row at mid-generation), full cache, {args.new_tokens} new tokens per row, "
                  f"greedy, compiled (default scope), median of {args.repeats}",
                  ["rows B", "projections", "step (ms)", "total tok/s", "vs B = 1", "bandwidth bound vs B = 1",
                   "row 0 = its run at B = 1"])
            for (B, kernel), r in rows.items():
                row(B, kernel, f"{r['step_ms']:.1f}", f"{r['tok_s']:.1f}", f"{r['tok_s'] / base:.2f}x",
                    f"{r['bound']:.1f}x", "yes" if r["row0_same"] else "no")
    return out


def check(args: argparse.Namespace) -> None:
    if any(b < 1 for b in args.batch_sizes):
        raise KVFastError(f"--batch-sizes {' '.join(map(str, args.batch_sizes))}: every size must be at least 1")


BENCH = Bench(__doc__, bench_batch, {
    "batch_sizes": Flag([1, 2, 4, 8], "rows decoded together, a row of the table each (B = 1 is always measured)",
                        {"type": int, "nargs": "+", "metavar": "B"}),
    "batch_kernels": Flag(["gemm", "reductions"], "the projection kernels measured from the rows where the blocked "
                                                  "GEMM takes over (kernels.gemm_rows), a row each (gemm only where "
                                                  "this CPU has one for the weights)",
                          {"nargs": "+", "choices": ["gemm", "reductions"]}),
    "prompt_len": Flag([512], "prompt lengths in tokens, a table each"),
    "new_tokens": Flag(128, "tokens decoded per row"),
    "weights": Flag(["fp32"], "weights, quantized in memory as quantize.py writes them, a table each"),
    "kv_bits": Flag([], "these K/V formats instead of the compute dtype's (16: --kv-float; 8 / 4: quantized), a "
                        "table each"),
    "kv_float": Flag("auto", "the 16-bit float of --kv-bits 16 (generate.py --kv-float; auto: float16)"),
}, check=check)
