"""bench.py --section compile: what compiling the decode step costs, per policy and compile scope, each figure
from a fresh process (the compile caches of a process would hide a cold start).

Per (policy, scope), three runs of generate.py --compile, each in its own process:
  cold      an empty Inductor cache (a new TORCHINDUCTOR_CACHE_DIR); it saves --compile-cache FILE
  warm      the same Inductor cache again (what a second run on this machine sees)
  portable  an empty Inductor cache again, with --compile-cache FILE from the cold run (a fresh checkout or
            another machine of the same kind, given the saved artifacts)
Reported: compile time (generate.py's warm-up: every compiled function reached once), graphs, recompiles and
graph breaks (dynamo's counters over the whole run), first token after the model is loaded (compile +
prefill), decode tok/s of the sample, and that speed against scope `step` of the same policy, same run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
SCOPES = ("step", "block")
RUNS = ("cold", "warm", "portable")
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
        raise RuntimeError(f"generate.py failed ({' '.join(cmd)}): {proc.stderr.strip().splitlines()[-1:]}")
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
        print(f"\ncompile latency: generate.py --compile per policy and --compile-scope, each run a fresh process "
              f"(cold: empty Inductor cache; warm: the same cache again; portable: empty Inductor cache + "
              f"--compile-cache from the cold run); a prompt of about {prompt_len} tokens, {new_tokens} new "
              f"tokens, budget {budget:g}; first token = compile + prefill after the model is loaded\n")
        print("| policy | scope | cold compile s | warm s | portable s | graphs | recompiles | graph breaks | "
              "first token (cold) s | first token (portable) s | decode tok/s | vs step |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for policy in policies:
            results[policy] = {}
            for scope in SCOPES:
                cell = Path(tmp) / f"{policy}-{scope}"
                artifacts = cell / "artifacts.bin"
                runs = {}
                for run in RUNS:
                    inductor = cell / ("inductor" if run != "portable" else "inductor-portable")
                    runs[run] = run_generate(checkpoint, policy, scope, prompt, new_tokens, inductor, artifacts,
                                             budget)
                results[policy][scope] = runs
                cold, warm, portable = (runs[r] for r in RUNS)
                step_speed = results[policy]["step"]["cold"]["tok_s"]
                print(f"| {policy} | {scope} | {cold['compile_s']:.1f} | {warm['compile_s']:.1f} | "
                      f"{portable['compile_s']:.1f} | {cold['graphs']:.0f} | {cold['recompiles']:.0f} | "
                      f"{cold['graph_breaks']:.0f} | {cold['first_token_s']:.1f} | {portable['first_token_s']:.1f} | "
                      f"{cold['tok_s']:.1f} | {cold['tok_s'] / step_speed:.2f}x |", flush=True)
    return results
