"""bench.py tp: generate.py on 1 process against torchrun on N ranks (tp.py), same prompt, same cores.

Each row is a fresh `generate.py --compile --temperature 0 --ignore-eos` run (through torchrun for N > 1) on a
prompt of about --prompt-len tokens of --quality-text, --new-tokens, --repeats samples after the warm-up, the
machine's cores shared among the ranks (OMP_NUM_THREADS = cores / N). Reported: compile time, the median decode
tok/s of the samples, and whether the text equals the one-process run's. On one 2-core machine the row is not
expected to be faster (the ranks share the same memory bandwidth and add an all-reduce per layer twice); it exists
to be rerun where each rank has its own cores or GPU.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import Bench, Flag, row, table, tokenizer_of
from benchmarks.kv_bits import QUALITY_TEXT
from evals import tasks
from model import KVFastError, Transformer

ROOT = Path(__file__).resolve().parent.parent


def weights_file(checkpoint: Path, weights: str) -> Path:
    """The checkpoint's float weights or its quantize.py file, written on first use."""
    if weights == "fp32":
        return checkpoint
    import quantize

    mode, _, group = weights.partition("-g")
    name = quantize.output_name(mode, int(group or 32))
    if not (checkpoint / name).exists():
        quantize.main(["--checkpoint", str(checkpoint), "--mode", mode, *(["--group-size", group] if group else [])])
    return checkpoint / name


def run_generate(ranks: int, flags: list[str]) -> dict:
    cores = os.cpu_count() or 1
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, cores // ranks))}
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] if ranks > 1
                else [sys.executable])
    proc = subprocess.run([*launcher, str(ROOT / "generate.py"), *flags], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=False)
    if proc.returncode:
        raise KVFastError(f"tp bench: generate.py on {ranks} ranks failed: {proc.stderr.strip().splitlines()[-1:]}")
    out = proc.stdout
    return {"tok_s": statistics.median(float(x) for x in re.findall(r"decode ([\d.]+) tok/s x", out)),
            "compile_s": float(re.search(r"compile time: ([\d.]+) s", out).group(1)),
            "prompt_tokens": int(re.search(r"prefill [\d.]+ ms \((\d+) tokens", out).group(1)),
            "text": [line for line in out.split("-" * 40)[0].splitlines() if not line.startswith("compile ")],
            "threads": env["OMP_NUM_THREADS"]}


def bench_tp(model: Transformer | None, checkpoint: Path, args: argparse.Namespace) -> dict:
    tokenizer = tokenizer_of(checkpoint)
    prompt = tokenizer.decode(tokenizer.encode(tasks.load_text(args.quality_text))[: args.prompt_len[0]])
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file = Path(tmp) / "prompt.txt"
        prompt_file.write_text(prompt)
        for weights in args.weights:
            flags = ["--checkpoint", str(weights_file(checkpoint, weights)), "--prompt", f"@{prompt_file}",
                     "--max-new-tokens", str(args.new_tokens), "--temperature", "0", "--ignore-eos", "--compile",
                     "--num-samples", str(args.repeats)]
            for ranks in args.tp_ranks:
                rows[f"{weights}/{ranks}"] = {"weights": weights, "ranks": ranks, **run_generate(ranks, flags)}
    table(f"generate.py --compile, full cache, greedy, {args.new_tokens} new tokens, median of {args.repeats} "
          f"samples; {os.cpu_count()} cores shared by the ranks",
          ["weights", "ranks", "threads per rank", "prompt tokens", "compile (s)", "decode tok/s", "vs 1 rank",
           "text = 1 rank's"])
    for r in rows.values():
        base = rows.get(f"{r['weights']}/1", r)
        row(r["weights"], r["ranks"], r["threads"], r["prompt_tokens"], f"{r['compile_s']:.1f}", f"{r['tok_s']:.1f}",
            f"{r['tok_s'] / base['tok_s']:.2f}x", "yes" if r["text"] == base["text"] else "NO")
    for r in rows.values():
        del r["text"]
    return rows


BENCH = Bench(__doc__, bench_tp, {
    "tp_ranks": Flag([1, 2], "process counts, a row each (torchrun for more than 1; tp.py)",
                     {"type": int, "nargs": "+", "metavar": "N"}),
    "weights": Flag(["fp32"], "weights (the checkpoint's, or quantize.py's file, written on first use), a group of "
                              "rows each"),
    "prompt_len": Flag([512], "prompt tokens, cut from --quality-text (the first value)"),
    "new_tokens": Flag(128, "tokens decoded per sample"),
    "quality_text": QUALITY_TEXT,
}, needs_model=False)
