"""bench.py compile: what compiling the decode step costs, per policy and compile scope, in fresh processes.

Each figure comes from a fresh process (the compile caches of a process would hide a cold start).

Per (policy, scope), three runs of generate.py --compile, each in its own process:
  cold      an empty Inductor cache (a new TORCHINDUCTOR_CACHE_DIR); it saves --compile-cache FILE
  warm      the same Inductor cache again (what a second run on this machine sees), WARM_REPEATS times: the
            run with the median compile time is reported (one sample of ~3 s swings by 0.5 s on a shared CPU)
  portable  an empty Inductor cache again, with --compile-cache FILE from the cold run (a fresh checkout or
            another machine of the same kind, given the saved artifacts)
Reported: compile time (generate.py's warm-up: every compiled function reached once), graphs, recompiles and
graph breaks (dynamo's counters over the whole run), first token after the model is loaded (compile +
prefill), decode tok/s of the sample, and that speed against scope `step` of the same policy, same run. One
64-token sample per process is noisy on a shared CPU, so the decode speeds are measured again in one process
(scopes_worker: both scopes compiled from the cold runs' --compile-cache files, alternating rounds of timed
steps, median and 10th percentile ms per step).

Then many prompt lengths in one process (bench_lengths): one Decoder, ten prompts of 100-3000 tokens, with
and without --capacity-buckets (padding to a few sizes) or --dynamic-capacity (a symbolic slot count), each setting in a fresh process with an empty Inductor cache: how many times
the step compiled, compile seconds in all, and decode tok/s against exact capacities.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import Bench, Flag, row, table
from cache import make_cache_factory
from compilecache import CompileCache, dynamo_count, graph_count
from decode import Decoder, configure_torch, prefill
from model import KVFastError, Transformer
from tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
SCOPES = ("step", "block")
RUNS = ("cold", "warm", "portable")
WARM_REPEATS = 3
PATTERNS = {
    "compile_s": r"compile time: ([\d.]+) s",
    "prefill_ms": r"prefill time: ([\d.]+) ms",
    "tok_s": r"decode: ([\d.]+) tok/s per row",
    "graphs": r"; (\d+) graphs, \d+ recompiles",
    "recompiles": r"(\d+) recompiles",
    "graph_breaks": r"(\d+) graph breaks",
}
PROMPT = ("The quick brown fox jumps over the lazy dog while the compiler traces every layer of the model. ")


def run_generate(checkpoint: Path, policy: str, scope: str, prompt: Path, new_tokens: int, inductor_dir: Path,
                 artifacts: Path, budget: float) -> dict:
    """One generate.py process; its figures parsed from what it prints."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir)}
    cmd = [sys.executable, str(ROOT / "generate.py"), "--checkpoint", str(checkpoint), "--prompt", f"@{prompt}",
           "--cache", policy, "--compile", "--compile-scope", scope, "--compile-cache", str(artifacts),
           "--max-new-tokens", str(new_tokens), "--temperature", "0", "--ignore-eos"]
    if policy != "full":
        cmd += ["--cache-budget", str(budget)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise KVFastError(f"generate.py failed ({' '.join(cmd)}): {proc.stderr.strip().splitlines()[-1:]}")
    out = {"wall_s": wall}
    for key, pattern in PATTERNS.items():
        m = re.search(pattern, proc.stdout)
        out[key] = float(m.group(1)) if m else float("nan")
    out["first_token_s"] = out["compile_s"] + out["prefill_ms"] / 1e3
    return out


def bench_compile(checkpoint: Path, policies: list[str], prompt_len: int, new_tokens: int, budget: float) -> dict:
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        prompt = Path(tmp) / "prompt.txt"
        words = PROMPT.split()
        prompt.write_text(" ".join(words[i % len(words)] for i in range(int(prompt_len * 0.75))))
        table(f"compile latency: generate.py --compile per policy and --compile-scope, each run a fresh process "
              f"(cold: empty Inductor cache; warm: the same cache again, median of {WARM_REPEATS} runs; portable: "
              f"empty Inductor cache + --compile-cache from the cold run); a prompt of about {prompt_len} tokens, "
              f"{new_tokens} new tokens, budget {budget:g}; first token = compile + prefill after the model is loaded",
              ["policy", "scope", "cold compile s", "warm s (range)", "portable s", "graphs", "recompiles",
               "graph breaks", "first token (cold) s", "first token (portable) s", "decode tok/s", "vs step"])
        for policy in policies:
            results[policy] = {}
            for scope in SCOPES:
                cell = Path(tmp) / f"{policy}-{scope}"
                artifacts = cell / "artifacts.bin"
                runs = {}
                for run in RUNS:
                    inductor = cell / ("inductor" if run != "portable" else "inductor-portable")
                    samples = [run_generate(checkpoint, policy, scope, prompt, new_tokens, inductor, artifacts, budget)
                               for _ in range(WARM_REPEATS if run == "warm" else 1)]
                    samples.sort(key=lambda r: r["compile_s"])
                    runs[run] = samples[len(samples) // 2] | {"compile_s_runs": [r["compile_s"] for r in samples]}
                results[policy][scope] = runs | {"artifacts": str(artifacts)}
                cold, warm, portable = (runs[r] for r in RUNS)
                step_speed = results[policy]["step"]["cold"]["tok_s"]
                row(policy, scope, f"{cold['compile_s']:.1f}",
                    f"{warm['compile_s']:.1f} ({min(warm['compile_s_runs']):.1f}-{max(warm['compile_s_runs']):.1f})",
                    f"{portable['compile_s']:.1f}", f"{cold['graphs']:.0f}", f"{cold['recompiles']:.0f}",
                    f"{cold['graph_breaks']:.0f}", f"{cold['first_token_s']:.1f}", f"{portable['first_token_s']:.1f}",
                    f"{cold['tok_s']:.1f}", f"{cold['tok_s'] / step_speed:.2f}x")
        table(f"decode, both scopes in one process: {AB_ROUNDS} alternating rounds of {new_tokens} timed steps after "
              "a prefill, ms per step (median, 10th percentile)",
              ["policy", "step ms", "block ms", "block vs step (median)", "block vs step (p10)"])
        for policy in policies:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / f"{policy}-ab")}
            ab = results[policy]["in_process"] = run_worker(
                env, "scopes", checkpoint, policy, prompt, new_tokens, budget,
                *(results[policy][scope]["artifacts"] for scope in SCOPES))
            step, block = ab["step"], ab["block"]
            row(policy, f"{step['median']:.1f}", f"{block['median']:.1f}", f"{step['median'] / block['median']:.2f}x",
                f"{step['p10'] / block['p10']:.2f}x")
    return results


def run_worker(env: dict[str, str], *argv: object) -> dict:
    """A worker of this module in a fresh process (its compile caches its own), its JSON answer."""
    cmd = [sys.executable, "-m", "benchmarks.compile", *map(str, argv)]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise KVFastError(f"{argv[0]} worker failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


AB_ROUNDS = 15


def scopes_worker(checkpoint: str, policy: str, prompt: str, new_tokens: int, budget: float,
                  artifacts: list[str]) -> dict:
    """In this process: the model, a Decoder per scope (compiled from the cold runs' artifacts), then
    AB_ROUNDS rounds that each prefill and decode new_tokens timed steps under every scope in turn."""
    configure_torch(compile=True)
    for path in artifacts:
        CompileCache(Path(path), "cpu").load()
    model = Transformer.from_checkpoint(Path(checkpoint))
    tokenizer = load_tokenizer(Path(checkpoint))
    ids = tokenizer.encode(Path(prompt).read_text(), bos=tokenizer.add_bos)
    idx = torch.tensor([ids])
    model.setup_caches(make_cache_factory(policy, 1, model.args, idx.shape[1], new_tokens,
                                          budget=None if policy == "full" else budget))
    decoders = {scope: Decoder(model, compile=True, scope=scope) for scope in SCOPES}
    for decoder in decoders.values():
        decoder.warm_up(idx)
    times: dict[str, list[float]] = {scope: [] for scope in SCOPES}
    with torch.inference_mode():
        for _ in range(AB_ROUNDS):
            for scope, decoder in decoders.items():
                for c in model.caches:
                    c.reset()
                first = prefill(model, idx, 0.0, None)
                t0 = time.perf_counter()
                decoder.decode(first, idx.shape[1], new_tokens)
                times[scope].append((time.perf_counter() - t0) * 1e3 / new_tokens)
    return {scope: {"median": statistics.median(t), "p10": statistics.quantiles(t, n=10)[0]}
            for scope, t in times.items()}


LENGTHS = [100 + round(i * 2900 / 9) for i in range(10)]  # 100 .. 3000 tokens


def lengths_worker(checkpoint: str, policy: str, scope: str, buckets: str, new_tokens: int) -> dict:
    """In this process: one Decoder; per prompt length new caches, the warm-up (compiles when the capacity is
    new), a prefill and new_tokens timed decode steps. The recompile limit is raised so that exact capacities
    (one graph per length) can be counted past dynamo's default of 8."""
    configure_torch(compile=True, dynamic_capacity=buckets == "dynamic")
    torch._dynamo.config.recompile_limit = 4 * len(LENGTHS)
    model = Transformer.from_checkpoint(Path(checkpoint))
    decoder = Decoder(model, compile=True, scope=scope, dynamic_capacity=buckets == "dynamic")
    budget = None if policy == "full" else 0.5
    rows, generator = [], torch.Generator().manual_seed(0)
    for n in LENGTHS:
        model.setup_caches(make_cache_factory(policy, 1, model.args, n, new_tokens, budget=budget,
                                              capacity_buckets=None if buckets in ("off", "dynamic") else buckets))
        idx = torch.randint(0, model.args.vocab_size, (1, n), generator=generator)
        graphs, t0 = graph_count(), time.perf_counter()
        decoder.warm_up(idx)
        compile_s = time.perf_counter() - t0
        with torch.inference_mode():
            first = prefill(model, idx, 0.0, None)
            t0 = time.perf_counter()
            decoder.decode(first, n, new_tokens)
            tok_s = new_tokens / (time.perf_counter() - t0)
        rows.append({"prompt": n, "capacity": model.caches[0].capacity, "compile_s": compile_s,
                     "compiled": graph_count() > graphs, "tok_s": tok_s})
    return {"rows": rows, "compiles": sum(r["compiled"] for r in rows),
            "recompiles": dynamo_count("recompiles"), "compile_s": sum(r["compile_s"] for r in rows)}


def bench_lengths(checkpoint: Path, policies: list[str], scope: str, settings: list[str],
                  new_tokens: int = 32) -> dict:
    table(f"many prompt lengths in one process: one Decoder (--compile-scope {scope}), prompts of "
          f"{', '.join(map(str, LENGTHS))} tokens, {new_tokens} new tokens each; a fresh process with an empty "
          "Inductor cache per row; compile s = the warm-ups of all ten prompts; tok/s = mean over the prompts",
          ["policy", "capacities (--capacity-buckets, or --dynamic-capacity)", "distinct", "step compiled",
           "compile s", "decode tok/s", "vs off"])
    results: dict = {}
    for policy in policies:
        results[policy] = {}
        for setting in settings:
            with tempfile.TemporaryDirectory() as tmp:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor")}
                r = results[policy][setting] = run_worker(env, "lengths", checkpoint, policy, scope, setting,
                                                          new_tokens)
            speed = sum(x["tok_s"] for x in r["rows"]) / len(r["rows"])
            base = results[policy].get(settings[0], r)
            base_speed = sum(x["tok_s"] for x in base["rows"]) / len(base["rows"])
            caps = len({x["capacity"] for x in r["rows"]})
            row(policy, setting, caps, f"{r['compiles']} times", f"{r['compile_s']:.1f}", f"{speed:.1f}",
                f"{speed / base_speed:.2f}x")
    return results


def run(model: Transformer | None, checkpoint: Path, args: argparse.Namespace) -> dict:
    """The cold / warm / portable table (unless --lengths-only), then the many-lengths one (unless
    --length-policies is empty)."""
    out = {}
    if not args.lengths_only:
        out["scopes"] = bench_compile(checkpoint, args.policies, args.prompt_len[0], args.new_tokens, 0.5)
    if args.length_policies:
        out["lengths"] = bench_lengths(checkpoint, args.length_policies, "block", ["off", *args.buckets])
    return out


BENCH = Bench(__doc__, run, {
    "policies": Flag(["full", "h2o", "scissorhands", "snapkv"], "policies of the cold / warm / portable rows, "
                                                                "evicting ones at a budget of 0.5"),
    "prompt_len": Flag([512], "prompt tokens of those runs (the first value)"),
    "new_tokens": Flag(128, "tokens decoded per run"),
    "buckets": Flag(["x4", "dynamic"], "--capacity-buckets settings (and dynamic: --dynamic-capacity) to compare "
                                       "with off over ten prompt lengths", {"nargs": "+", "metavar": "SETTING"}),
    "length_policies": Flag(["full", "h2o"], "policies of the ten-prompt-lengths rows, evicting ones at a budget of "
                                             "0.5 (none given: skip those rows)",
                            {"nargs": "*", "metavar": "POLICY"}),
    "lengths_only": Flag(False, "only the ten-prompt-lengths rows (no cold / warm / portable runs)",
                         {"action": "store_true"}),
}, needs_model=False)


if __name__ == "__main__":  # the workers of bench_compile and bench_lengths, each in a fresh process
    if sys.argv[1] == "scopes":
        print(json.dumps(scopes_worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), float(sys.argv[6]),
                                       sys.argv[7:])))
    else:
        print(json.dumps(lengths_worker(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6]))))
