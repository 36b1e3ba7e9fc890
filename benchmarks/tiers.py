"""bench.py tiers: a tiered cache (kv.tiers) against the plain policy at the same hot budget.

Compiled decode steps from caches filled as after --lengths tokens (random K/V; with tiers, a full warm store of
random pages): the step alone, a step that recalls first, and the mean step over 256 steps as generation runs
them (flushes, recalls, refreshes), at --recall-interval and at a recall every 32 steps; bytes moved per step.
Then the plain and the tiered step once more, interleaved in one process (interleaved_steps): the ratio the
step-time target is about, which two rows timed minutes apart on a shared host cannot settle.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

import cache as kvcache
from benchmarks.common import Bench, Flag, row, table
from decode import Decoder, synchronize
from evals.caches import add_tier_flags, tier_settings
from kv.tiers import tier_report
from model import KVFastError, Transformer

SPARSE_RECALL = 32  # the schedule the tiers' step-time target is stated for: a recall every 32 steps
INTERLEAVED_ROUNDS = 15
SPAN_ROUNDS = 5
TIER_SPAN = 256  # steps of the average: recall every --recall-interval, flush every --page-size positions


def timed_steps(model: Transformer, decoder: Decoder, start: int, steps: int, recall: bool = False) -> float:
    """Seconds per decode step over `steps` steps from position `start` as Decoder.decode runs them (tiers: a
    recall first at every step if `recall`, else at none), the step call alone timed: refreshes and tier flushes
    run untimed on their schedules."""
    device, times = next(model.parameters()).device, []
    decoder.decode(torch.tensor([[42]], device=device), start, steps, recall=recall, step_times=times)
    return sum(times) / steps


def tier_step_times(model: Transformer, policy: str, context_len: int, budget: float, tiers: dict | None,
                    steps: int, repeats: int, span: int = TIER_SPAN, scope: str = "step") -> dict:
    """Compiled decode steps with caches filled as after context_len tokens (setup_decode_benchmark: random hot
    K/V; with tiers, a full warm store of random pages), refilled before every measurement so each starts from
    the same state at position context_len. Sized for context_len + span + 1 tokens either way, so the plain and
    the tiered caches have the same hot budget (slots per layer; the tiered one's recall slots inside it).

    step_s: a plain decode step (the step call alone: no refresh, flush or recall timed), the mean over `steps`
    steps; recall_s (tiers): a step that recalls first, likewise; span_s: the mean step of Decoder.decode over
    `span` steps, everything it schedules included (refreshes; tiers: a flush every page_size positions, a
    recall at the first step and every recall_interval positions). Each: the median over `repeats`. tiers: the
    tier counters of the last span (kv.tiers.tier_report)."""
    kwargs = {"budget": budget, **({"tiers": tiers} if tiers else {})}
    factory = kvcache.setup_decode_benchmark(model, policy, context_len, max_new_tokens=span + 1, **kwargs)
    torch._dynamo.reset()  # new cache buffers: start from a clean compile cache (dynamo's recompile limit)
    decoder = Decoder(model, compile=True, scope=scope)
    spec = factory.tiers
    generator = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device

    def refill() -> None:
        for c in model.caches:
            c.fill_synthetic(context_len, generator)

    def single(recall: bool) -> float:
        refill()
        return timed_steps(model, decoder, context_len, steps, recall)

    def whole(interval: int | None = None) -> float:
        """The span as Decoder.decode runs it; with tiers, recalling every `interval` positions if given."""
        if spec:
            for c in model.caches:
                c.tiers = dataclasses.replace(spec, recall_interval=interval or spec.recall_interval)
        refill()
        synchronize(str(device))
        t0 = time.perf_counter()
        decoder.decode(torch.tensor([[42]], device=device), context_len, span)
        synchronize(str(device))
        return (time.perf_counter() - t0) / span

    out: dict = {"capacity": model.caches[0].capacity,
                 "hot_MB": sum(c.physical_bytes() for c in model.caches) / 1e6}
    with torch.inference_mode():
        # compile every function first (the step; tiers: the recall step and the flush), then one untimed round
        decoder.warm_up(torch.full((1, context_len), 42, dtype=torch.long, device=device))
        single(False)
        if spec:
            single(True)
        whole()
        runs = [(single(False), single(True) if spec else 0.0, whole(), whole(SPARSE_RECALL) if spec else 0.0)
                for _ in range(repeats)]
        whole()  # the counters below: the configured schedule's
        out.update(step_s=statistics.median(r[0] for r in runs), span_s=statistics.median(r[2] for r in runs))
        if spec:
            out["recall_s"] = statistics.median(r[1] for r in runs)
            out["sparse_span_s"] = statistics.median(r[3] for r in runs)
            report = tier_report(model.caches)  # the last span's
            out.update(recall_slots=spec.recall_slots, tiers=report, recall_steps=report["recalls"] // report["layers"],
                       moved_per_step=(report["hot_to_warm_bytes"] + report["warm_to_hot_bytes"]) / span,
                       warm_MB=report["warm_bytes"] / 1e6)
    return out


def interleaved_steps(model: Transformer, policy: str, context_len: int, budget: float, tiers: dict, steps: int,
                      rounds: int, scope: str, span_rounds: int = 0) -> dict[str, dict[str, list[float]]]:
    """The plain and the tiered cache at the same hot budget in one process and one Decoder, alternating, for
    ratios that the host's drift between two separately timed rows does not move. "step": rounds of `steps`
    steps without recall (flushes untimed, on their schedule), ms per step of each round; "span": span_rounds
    runs of Decoder.decode over TIER_SPAN steps from refilled caches, the tiered one recalling every
    SPARSE_RECALL positions, ms per step of each run."""
    setups = {}
    for name, kw in (("plain", {}), ("tiered", {"tiers": tiers})):
        factory = kvcache.setup_decode_benchmark(model, policy, context_len, max_new_tokens=TIER_SPAN + 1,
                                                 budget=budget, **kw)
        spec = factory.tiers and dataclasses.replace(factory.tiers, recall_interval=SPARSE_RECALL)
        setups[name] = (list(model.caches), spec)
    torch._dynamo.reset()
    decoder = Decoder(model, compile=True, scope=scope)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    times: dict[str, dict[str, list[float]]] = {"step": {n: [] for n in setups}, "span": {n: [] for n in setups}}

    def install(caches: list, spec) -> None:
        for layer, cache in zip(model.layers, caches):
            layer.attention.kv_cache = cache
            if spec:
                cache.tiers = spec
        decoder.choose_block_step()

    with torch.inference_mode():
        for r in range(rounds + 1):  # the first round compiles
            for name, (caches, spec) in setups.items():
                install(caches, spec)
                ms = 1e3 * timed_steps(model, decoder, context_len + (r * steps) % TIER_SPAN, steps)
                if r:
                    times["step"][name].append(ms)
        for _ in range(span_rounds):
            for name, (caches, spec) in setups.items():
                install(caches, spec)
                for cache in caches:
                    cache.fill_synthetic(context_len, generator)
                synchronize(str(device))
                t0 = time.perf_counter()
                decoder.decode(torch.tensor([[42]], device=device), context_len, TIER_SPAN)
                synchronize(str(device))
                times["span"][name].append(1e3 * (time.perf_counter() - t0) / TIER_SPAN)
    return times


def bench_tiers(model: Transformer, checkpoint: Path, args: argparse.Namespace) -> dict:
    """Per policy and length: the plain policy and the same policy with tiers at the same hot budget."""
    policies, lengths = args.policies, args.lengths
    tiers = tier_settings(args)
    table(f"tiers: decode step time (ms), compiled (--compile-scope {args.compile_scope}), median of {args.repeats}; "
          f"budget {args.budget:g} of context + "
          f"{TIER_SPAN + 1} new tokens, the same hot slots for both (the tiered cache's recall slots among them); "
          f"warm store {tiers['warm_tokens']:g} of the tokens at {tiers['warm_bits']:g} bits, pages of "
          f"{tiers['page_size']:g}, a recall installing at most {tiers['recall_installs']:g} of the recall pages "
          f"(hits stay). step: the step alone, mean of {args.steps}; recall: a step that recalls first; "
          f"avg: the mean over {TIER_SPAN} steps as generation runs them (flushes, recalls, refreshes), recalling "
          f"every {tiers['recall_interval']:g} positions (the setting), and every {SPARSE_RECALL} (the targets' "
          f"schedule). Ratios vs the plain policy (targets: step <= 1.05x, {TIER_SPAN}-step avg with a "
          f"recall every {SPARSE_RECALL} <= 1.25x). Moved: hot->warm + warm->hot bytes per step over those "
          f"{TIER_SPAN} steps at the setting (random warm pages); warm: the warm store; hot: the K/V buffers",
          ["policy", "tokens", "slots (recall)", "plain step", "plain avg", "tiered step", "recall step",
           f"tiered avg (every {tiers['recall_interval']:g})", f"tiered avg (every {SPARSE_RECALL})", "moved KB/step",
           "warm MB", "hot MB"])
    results: dict = {}
    notes = []
    for policy in policies:
        results[policy] = {}
        for n in lengths:
            base = tier_step_times(model, policy, n, args.budget, None, args.steps, args.repeats,
                                   scope=args.compile_scope)
            warm = tier_step_times(model, policy, n, args.budget, tiers, args.steps, args.repeats,
                                   scope=args.compile_scope)
            ratios = {"step": warm["step_s"] / base["step_s"], "recall": warm["recall_s"] / base["step_s"],
                      "avg": warm["span_s"] / base["span_s"], "sparse_avg": warm["sparse_span_s"] / base["span_s"]}
            results[policy][n] = {"plain": base, "tiered": warm, "ratios": ratios, "tier_settings": tiers}
            row(policy, n, f"{warm['capacity']} ({warm['recall_slots']})", f"{1e3 * base['step_s']:.2f}",
                f"{1e3 * base['span_s']:.2f}", f"{1e3 * warm['step_s']:.2f} ({ratios['step']:.2f}x)",
                f"{1e3 * warm['recall_s']:.2f} ({ratios['recall']:.2f}x)",
                f"{1e3 * warm['span_s']:.2f} ({ratios['avg']:.2f}x)",
                f"{1e3 * warm['sparse_span_s']:.2f} ({ratios['sparse_avg']:.2f}x)",
                f"{warm['moved_per_step'] / 1e3:.1f}", f"{warm['warm_MB']:.1f}", f"{warm['hot_MB']:.1f}")
            r = warm["tiers"]
            notes.append(f"{policy} at {n} tokens, over {TIER_SPAN} steps: {r['flushed_pages']} pages flushed, "
                         f"{warm['recall_steps']} recall steps, {r['recall_hits']} page hits, {r['recall_misses']} "
                         f"misses, {r['cold_pages']} pages dropped cold (summed over layers and KV heads)")
    print("\n" + "\n".join(notes))
    table(f"plain and tiered in one process, alternating: the non-recall step ({INTERLEAVED_ROUNDS} rounds of "
          f"{args.steps} steps; target <= 1.05x) and the average over {TIER_SPAN} steps with a recall every "
          f"{SPARSE_RECALL} ({SPAN_ROUNDS} runs; target <= 1.25x); ms per step, median (10th percentile)",
          ["policy", "tokens", "plain step", "tiered step", "step: tiered vs plain", "plain avg",
           f"tiered avg (every {SPARSE_RECALL})", "avg: tiered vs plain"])
    for policy in policies:
        for n in lengths:
            t = interleaved_steps(model, policy, n, args.budget, tiers, args.steps, INTERLEAVED_ROUNDS,
                                  args.compile_scope, SPAN_ROUNDS)
            results[policy][n]["interleaved_ms"] = t
            cells = []
            for kind in ("step", "span"):
                med = {k: statistics.median(v) for k, v in t[kind].items()}
                low = {k: min(v) if len(v) < 4 else statistics.quantiles(v, n=10)[0] for k, v in t[kind].items()}
                cells += [f"{med['plain']:.2f}", f"{med['tiered']:.2f}",
                          f"{med['tiered'] / med['plain']:.3f}x ({low['tiered'] / low['plain']:.3f}x)"]
            row(policy, n, *cells)
    return results


def check(args: argparse.Namespace) -> None:
    tier_settings(args)  # bad tier flags fail before the model loads
    if args.steps > TIER_SPAN:
        raise KVFastError(f"--steps {args.steps}: the tiers table's caches hold {TIER_SPAN} steps")


BENCH = Bench(__doc__, bench_tiers, {
    "policies": Flag(["h2o"], "evicting policies, each run plain and tiered"),
    "lengths": Flag([4096], "context lengths in tokens, a row each"),
    "budget": Flag(0.25, "hot budget of both caches: a fraction of context + new tokens, or slots per layer"),
    "steps": Flag(16, f"steps per timed single-step mean (at most {TIER_SPAN}, the steps of the average)"),
    "compile_scope": Flag("step", "compile the whole step (as the speed tables were taken) or one nested block "
                                  "region per step (generate.py's default on CPU)"),
}, check=check, extra_flags=lambda p: add_tier_flags(p, "the tiered policy's settings"))
