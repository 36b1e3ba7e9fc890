"""What every bench shares: its description for bench.py (Bench, Flag), timing (medians, engine runs alternating
round by round), the host's bandwidth and CPU, the text the quality columns read, tables and the JSON file."""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import cache as kvcache
import kernels
from decode import Decoder
from evals import tasks
from kv.quant import KV_FLOATS
from memory import huge_page_memory
from model import KVFastError, Transformer
from tokenizer import load_tokenizer

WEIGHTS = ("fp32", "bf16", "int8", "int4", "int4-g32", "int4-g64")  # quantize.quantized_copy's modes (int4: g32)

# argparse keywords of the flags several benches take; each bench's Flag gives its own default and help
SHARED_FLAGS: dict[str, dict[str, Any]] = {
    "prompt_len": {"type": int, "nargs": "+", "metavar": "N"},
    "new_tokens": {"type": int, "metavar": "N"},
    "weights": {"nargs": "+", "choices": WEIGHTS},
    "kv_bits": {"type": int, "nargs": "*", "choices": [16, 8, 4]},
    "kv_float": {"choices": KV_FLOATS},
    "policies": {"nargs": "+", "metavar": "POLICY"},
    "lengths": {"type": int, "nargs": "+", "metavar": "N"},
    "compile_scope": {"choices": ["step", "block"]},
    "budget": {"type": float},
    "steps": {"type": int, "metavar": "N"},
    "quality_text": {"metavar": "TEXT"},
    "quality_tokens": {"type": int, "metavar": "N"},
}


@dataclass(frozen=True)
class Flag:
    """A flag as one bench reads it: the default there and what it means there. kwargs: argparse keywords; None
    takes SHARED_FLAGS' for the same name."""

    default: Any
    help: str
    kwargs: dict[str, Any] | None = None

    def keywords(self, name: str) -> dict[str, Any]:
        return SHARED_FLAGS[name] if self.kwargs is None else self.kwargs


@dataclass(frozen=True)
class Bench:
    """One bench as bench.py runs it. run(model, checkpoint, args) prints its tables and returns what goes into
    --json under the bench's name; model is None where needs_model is False (benches that start processes of
    their own). check(args): one-line errors (model.KVFastError) before the model loads. extra_flags(parser):
    flags that come as a group from elsewhere (the tier flags)."""

    doc: str
    run: Callable[[Transformer | None, Path, argparse.Namespace], dict]
    flags: dict[str, Flag]
    check: Callable[[argparse.Namespace], None] | None = None
    extra_flags: Callable[[argparse.ArgumentParser], None] | None = None
    needs_model: bool = True


# ---- the machine ------------------------------------------------------------------------------------------------
@functools.cache
def cpu_summary() -> str:
    """The CPU (kernels.cpu_report: model, the features that choose kernels, a forced kind), its L2 and L3 sizes,
    torch's version and threads. Every table's header carries it: runs on other machines differ."""
    caches = cache_sizes()
    return (f"{kernels.cpu_report()}" + (f", {caches}" if caches else "")
            + f"; torch {torch.__version__}, {torch.get_num_threads()} threads")


def cache_sizes(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> str:
    """'L2 2 MB, L3 480 MB' as Linux reports the first core's caches ('' where it does not): an L3 that holds a
    share of a step's bytes lets a decode step read faster than a stream from memory (interleaved's step floor)."""
    sizes = {}
    for index in sorted(root.glob("index*")):
        try:
            level, kind, size = ((index / f).read_text().strip() for f in ("level", "type", "size"))
        except OSError:
            continue
        if level in ("2", "3") and kind == "Unified" and size[:-1].isdigit() and size[-1] in "KM":
            sizes[f"L{level}"] = int(size[:-1]) * (1 if size[-1] == "K" else 1024)
    return ", ".join(f"{name} {kb // 1024} MB" if kb >= 1024 else f"{name} {kb} KB" for name, kb in sizes.items())


def median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def huge_page_floats(n_bytes: int) -> torch.Tensor:
    """n_bytes of fp32 ones on 2 MB pages where the kernel has them, as a Decoder places a model's weights
    (memory.weights_on_huge_pages): the floors are what the memory gives the best-placed stream."""
    mapping, start = huge_page_memory(n_bytes)
    return torch.frombuffer(mapping, dtype=torch.float32, count=n_bytes // 4, offset=start).fill_(1.0)


def copy_bandwidth(n_bytes: int = 1 << 30, repeats: int = 7) -> float:
    """Bytes moved per second (read + write) copying a buffer far larger than the caches."""
    src, dst = huge_page_floats(n_bytes), huge_page_floats(n_bytes)
    return 2 * n_bytes / median_time(lambda: dst.copy_(src), repeats)


def read_bandwidth(n_bytes: int = 1 << 30, repeats: int = 3) -> float:
    """Bytes read per second summing a buffer of n_bytes again and again: a decode step only reads, and reads
    the same bytes every step (the default, far larger than the caches: a stream from memory)."""
    src = huge_page_floats(n_bytes)
    return n_bytes / median_time(src.sum, repeats)


# ---- our engine's runs, alternating with other engines' ---------------------------------------------------------
def ours_run(model: Transformer, prompt: torch.Tensor, new_tokens: int, compile: bool,
             kv: dict | None = None, prefill_dtype: torch.dtype | None = None) -> Callable[[], dict]:
    """One timed greedy run of our engine with a full cache (the first call compiles): its prefill seconds,
    decode tok/s and tokens. kv: kv_format's keywords; prefill_dtype: the prefill's products (None: the model's)."""
    model.setup_caches(kvcache.make_cache_factory("full", 1, model.args, prompt.shape[1], new_tokens, **(kv or {})))
    # the tables' compiled rows: whole-step graphs
    decoder = Decoder(model, compile=compile, scope="step", prefill_dtype=prefill_dtype)

    def run() -> dict:
        for c in model.caches:
            c.reset()
        with torch.inference_mode():
            t0 = time.perf_counter()
            first = decoder.prefill(model, prompt, 0.0, None)
            t1 = time.perf_counter()
            rest = decoder.decode(first, prompt.shape[1], new_tokens - 1)
            t2 = time.perf_counter()
        return {"prefill_s": t1 - t0, "tok_s": (new_tokens - 1) / (t2 - t1),
                "tokens": torch.cat([first, rest], 1)[0].tolist(), **weights}

    # the bandwidth-floor column: a step reads every weight and the whole static K/V buffer (masked past the fill)
    weights = {"step_bytes": model.weight_bytes(step=True) + sum(c.physical_bytes() for c in model.caches)} if compile else {}
    weights["prefill_products"] = str(prefill_dtype or model.norm.weight.dtype).removeprefix("torch.")
    return run


def interleaved(runs: dict[str, Callable[[], dict]], repeats: int, bandwidth: bool = False) -> dict[str, dict]:
    """Each engine's repeats alternate with the others' (a shared host drifts between separately timed rows),
    after one untimed round (compiles, warms up); per engine the median prefill and tok/s, and the last run's
    other fields. bandwidth: the copy and read bandwidths are measured at the start of every round too, and a
    run that reports its step_bytes gets floor_pct / read_floor_pct, the medians over rounds of its share of that
    round's floors (the host's bandwidth moves between minutes as much as the engines do), and step_read_floor_pct:
    the same against reading a buffer of its own step's bytes again and again, measured with the others at the
    round's start (where the L3 holds a share of those bytes, faster than the stream from memory; right before
    its run, the probe's freshly written lines slowed Qwen2.5-0.5B's int8 step by about 2 %)."""
    steps = {name: run().get("step_bytes") for name, run in runs.items()}
    rounds: dict[str, list[dict]] = {name: [] for name in runs}
    for _ in range(repeats):
        bw = {"copy_bw": copy_bandwidth(repeats=3), "read_bw": read_bandwidth()} if bandwidth else {}
        # a step of 1 GiB or more gets the stream's rate: no L3 holds a share worth a probe of its size in memory
        own = {name: {"step_read_bw": read_bandwidth(n) if n < 1 << 30 else bw["read_bw"]}
               for name, n in steps.items() if bandwidth and n}
        for name, run in runs.items():
            rounds[name].append({**bw, **own.get(name, {}), **run()})
    out = {name: {**rs[-1], "prefill_s": statistics.median(r["prefill_s"] for r in rs),
                  "tok_s": statistics.median(r["tok_s"] for r in rs)} for name, rs in rounds.items()}
    for name, rs in rounds.items():
        if bandwidth and steps[name]:
            for floor, bw in (("floor_pct", "copy_bw"), ("read_floor_pct", "read_bw"), ("step_read_floor_pct", "step_read_bw")):
                out[name][floor] = statistics.median(100 * r["tok_s"] * r["step_bytes"] / r[bw] for r in rs)
                out[name][f"{bw}_GBs"] = [r[bw] / 1e9 for r in rs]
    return out


def time_ours(model: Transformer, prompt: torch.Tensor, new_tokens: int, compile: bool, repeats: int) -> dict:
    return interleaved({"ours": ours_run(model, prompt, new_tokens, compile)}, repeats)["ours"]


# ---- inputs -----------------------------------------------------------------------------------------------------
def tokenizer_of(checkpoint: Path) -> Any:
    """The tokenizer beside a checkpoint folder or file."""
    folder = checkpoint if checkpoint.is_dir() else checkpoint.parent
    try:
        return load_tokenizer(folder)
    except (OSError, ValueError) as e:  # missing files, bad JSON, bad tokenizer model
        raise KVFastError(f"cannot load the tokenizer of {folder}: {e}") from None


def text_ids(checkpoint: Path, source: str) -> list[int]:
    """The token ids of a --quality-text source (evals.tasks.load_text: a named text, fetched on first use, or a
    file)."""
    return tokenizer_of(checkpoint).encode(tasks.load_text(source))


# ---- output -----------------------------------------------------------------------------------------------------
def table(caption: str, columns: list[str]) -> None:
    """A markdown table's caption, the CPU it ran on, and its header row."""
    print(f"\n{caption}\nCPU: {cpu_summary()}\n")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))


def row(*cells: object) -> None:
    """One row of the table printed last, at once (a long bench shows its rows as they come)."""
    print("| " + " | ".join(map(str, cells)) + " |", flush=True)


def write_json(path: Path, out: dict) -> None:
    path.write_text(json.dumps(out, indent=1))
    print(f"\nwrote {path}")
