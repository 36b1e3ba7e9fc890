"""bench.py policies: the compiled decode step of every cache policy at long context against the full cache.

Per policy and length: the step, and the share of it that is the policy's bookkeeping (against a full cache with
as many slots); then the policies' steps interleaved in one process, where the host's drift between rows timed
minutes apart cannot move the ratios.

The cached K/V are random (cache.setup_decode_benchmark): the model's own 4k prefill would cost minutes on 2 cores
and does not change what a decode step costs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from pathlib import Path

import torch

import cache as kvcache
from benchmarks.common import Bench, Flag, row, table
from benchmarks.tiers import timed_steps
from decode import Decoder
from model import Transformer


def step_time(model: Transformer, policy: str, context_len: int, budget: float | None, steps: int,
              repeats: int, scope: str = "step", **cache_kwargs) -> tuple[float, int]:
    """Median seconds per compiled decode step with the caches filled as after `context_len` tokens. Returns
    (seconds, capacity of layer 0)."""
    new = steps * (repeats + 1) + 1
    kwargs = cache_kwargs if budget is None else {"budget": budget, **cache_kwargs}
    kvcache.setup_decode_benchmark(model, policy, context_len, max_new_tokens=new, **kwargs)
    torch._dynamo.reset()  # new cache buffers: start from a clean compile cache (dynamo's recompile limit)
    decoder = Decoder(model, compile=True, scope=scope)
    pos, times = context_len, []
    with torch.inference_mode():
        x = torch.tensor([[42]])  # an inference tensor like every later input: one graph
        for r in range(repeats + 1):  # the first round compiles
            t0 = time.perf_counter()
            decoder.decode(x, pos, steps)
            if r:
                times.append((time.perf_counter() - t0) / steps)
            pos += steps
    return statistics.median(times), model.caches[0].capacity


def interleaved_caches(model: Transformer, setups: dict[str, dict], context_len: int, args: argparse.Namespace,
                       rounds: int = 15) -> dict:
    """Compiled steps over several caches (label -> setup_decode_benchmark's policy and keywords: a budget,
    kv_bits) in one process and one Decoder, alternating rounds of args.steps steps (caches filled as after
    context_len tokens): per label the median and 10th percentile ms per step, and the ratio of medians to the
    first label. Rows timed minutes apart drift by more than the 10 % that per-head budgets are allowed to cost on
    a shared host; alternating in one process they do not."""
    caches = {}
    for label, setup in setups.items():
        kvcache.setup_decode_benchmark(model, context_len=context_len,
                                       max_new_tokens=rounds * args.steps + args.steps + 1, **setup)
        caches[label] = list(model.caches)
    torch._dynamo.reset()
    decoder = Decoder(model, compile=True, scope=args.compile_scope)
    times: dict[str, list[float]] = {label: [] for label in setups}
    with torch.inference_mode():
        for r in range(rounds + 1):  # the first round compiles
            for label, layers in caches.items():
                model.setup_caches(lambda i, layers=layers: layers[i])
                decoder.choose_block_step()
                ms = 1e3 * timed_steps(model, decoder, context_len + r * args.steps, args.steps)
                if r:
                    times[label].append(ms)
    first = next(iter(setups))
    base = statistics.median(times[first])
    table(f"the same steps interleaved in one process at {context_len} tokens ({rounds} alternating rounds of "
          f"{args.steps} steps, one Decoder): ms per step, median (10th percentile), vs {first}",
          ["cache", "step ms", f"vs {first}"])
    out = {}
    for label, t in times.items():
        med, p10 = statistics.median(t), statistics.quantiles(t, n=10)[0]
        out[label] = {"median_ms": med, "p10_ms": p10, "ratio": med / base, "rounds_ms": t}
        row(label, f"{med:.2f} ({p10:.2f})", f"{med / base:.3f}x")
    return out


def bench_policies(model: Transformer, checkpoint: Path, args: argparse.Namespace) -> dict:
    # full is every table's first row (and has no budget): listed again, it is not repeated
    policies = [p for p in args.policies or kvcache.POLICIES if p != "full"]
    results = {}
    table(f"decode step time (ms), compiled (--compile-scope {args.compile_scope}), budget {args.budget:g} of context "
          "+ new tokens; bookkeeping = (step - step of a full cache with as many slots) / step",
          ["policy", *(f"{n} tokens: step (speed-up vs full), bookkeeping" for n in args.lengths)])
    timed = partial(step_time, steps=args.steps, repeats=args.repeats, scope=args.compile_scope)
    full = {n: timed(model, "full", n, None)[0] for n in args.lengths}
    row("full", *(f"{1e3 * full[n]:.1f}" for n in args.lengths))
    results["full"] = {n: {"step_s": full[n]} for n in args.lengths}
    same_slots: dict[int, float] = {}  # capacity -> step time of a full cache with that many slots
    for policy in policies:
        cells, results[policy] = [], {}
        for n in args.lengths:
            t, capacity = timed(model, policy, n, args.budget)
            if capacity not in same_slots:
                new = args.steps * (args.repeats + 1) + 1
                same_slots[capacity] = timed(model, "full", capacity - new, None)[0]
            t_slots = same_slots[capacity]
            share = max(t - t_slots, 0.0) / t
            results[policy][n] = {"step_s": t, "capacity": capacity, "same_slots_full_step_s": t_slots,
                                  "bookkeeping_share": share}
            cells.append(f"{1e3 * t:.1f} ({full[n] / t:.2f}x), {100 * share:.0f} %")
        row(policy, *cells)
    if len(policies) > 1:
        setups = {p: {"policy": p, "budget": args.budget} for p in policies}
        results["interleaved"] = interleaved_caches(model, setups, args.lengths[-1], args)
    return results


LENGTHS = Flag([512, 2048, 4096], "context lengths in tokens, a column each")
COMPILE_SCOPE = Flag("step", "compile the whole step (as the speed tables were taken) or one nested "
                             "block region per step (generate.py's default on CPU)")
STEPS = Flag(16, "decode steps per timed repeat")

BENCH = Bench(__doc__, bench_policies, {
    "policies": Flag(None, "policies against full (default: every policy but full)"),
    "lengths": LENGTHS,
    "budget": Flag(0.25, "cache budget: a fraction of context + new tokens, or slots per layer if > 1"),
    "steps": STEPS,
    "compile_scope": COMPILE_SCOPE,
})
