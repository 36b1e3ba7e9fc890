"""bench.py longctx: long prompts end to end: prefill time, compiled decode tok/s and peak memory per context length,
with the full cache and with compressed ones, and llama.cpp with its full cache on the same GGUF.

Per length (the first N tokens of --text) and per cache (a budget: 1 is the full cache; each --kv-bits): the
prompt's prefill in query blocks of --prefill-chunk rows (products in --prefill-dtype), then --new-tokens greedy
tokens through the compiled step (block scope, compiled before the prefill and not timed), and the process's
resident-set high-water mark over that prefill and decode (VmHWM, reset before each row: the weights, the caches,
the prefill's activations). Budgets compress the prompt with --policy's own compressor; POLICY+warm (e.g.
window+warm) adds kv.tiers' warm store at its default settings. llama.cpp (the
llama-cpp-cffi wheel's CPU build, installed on first use into .peers/) runs only at --peer-lengths: its prefill of
16k tokens takes minutes on two cores.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import cache as kvcache
import quantize
from benchmarks.common import Bench, Flag, row, table, text_ids, tokenizer_of
from decode import DEFAULT_PREFILL_CHUNK, Decoder
from evals.caches import TIER_DEFAULTS, split_combo_policy
from kv import kvzip
from kv.quant import kv_format
from memory import release_free_memory
from model import KVFastError, Transformer

GGUF_DIR = Path(__file__).resolve().parent.parent / "checkpoints" / ".downloads"


def rss_peak_gib() -> float:
    """The process's resident-set high-water mark since the last reset_rss_peak (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    raise KVFastError("no VmHWM in /proc/self/status: peak memory needs Linux")


def reset_rss_peak() -> None:
    """Start the high-water mark afresh from the current resident set (writing 5 to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def run_cache(model: Transformer, ids: list[int], label: str, policy: str, budget: float | None, bits: int,
              args: argparse.Namespace) -> dict:
    """One row: compile, prefill, decode, peak memory; the caches are dropped afterwards."""
    kv, _ = kv_format(bits, args.kv_float)
    policy, warm, _ = split_combo_policy(policy)
    model.setup_caches(kvcache.make_cache_factory(policy, 1, model.args, len(ids), args.new_tokens, budget=budget,
                                                  tokenizer=args.tokenizer, tiers=dict(TIER_DEFAULTS) if warm else None,
                                                  **kv))
    torch._dynamo.reset()  # new cache shapes: a clean compile cache (dynamo's recompile limit)
    dtype = getattr(torch, args.prefill_dtype) if args.prefill_dtype else None
    compile_prefill = args.compile_prefill and not kvzip.needs_context_pass(model) and \
        all(c.prompt_traceable for c in model.caches)
    decoder = Decoder(model, compile=True, compile_prefill=compile_prefill, prefill_chunk=args.prefill_chunk or None,
                      prefill_dtype=dtype)
    idx = torch.tensor([ids])
    decoder.warm_up(idx)
    counters = torch._dynamo.utils.counters
    graphs = counters["stats"]["unique_graphs"]
    release_free_memory()  # the free pages earlier rows and peers left in the heap are no part of this row
    reset_rss_peak()
    with torch.inference_mode():
        t0 = time.perf_counter()
        first = decoder.prefill(model, idx, 0.0, None)
        t1 = time.perf_counter()
        decoder.decode(first, len(ids), args.new_tokens - 1)
        t2 = time.perf_counter()
    out = {"cache": label + (", compiled prefill" if compile_prefill else ""), "prefill_s": t1 - t0, "tok_s": (args.new_tokens - 1) / (t2 - t1),
           "peak_gib": rss_peak_gib(), "slots": model.caches[0].capacity,
           "kv_mib": sum(c.physical_bytes() for c in model.caches) / 2**20,
           "new_graphs": counters["stats"]["unique_graphs"] - graphs}
    model.setup_caches(lambda i: None)
    return out


def gguf_of(args: argparse.Namespace) -> Path:
    folder = args.checkpoint if args.checkpoint.is_dir() else args.checkpoint.parent
    return args.gguf or GGUF_DIR / f"{folder.name}.gguf"


def run_llamacpp(ids: list[int], args: argparse.Namespace) -> dict:
    from scripts.peer_llamacpp import time_llamacpp

    t = time_llamacpp(gguf_of(args), ids, args.new_tokens, torch.get_num_threads(), 1)
    return {"cache": "llama.cpp, full (f16 K/V)", "prefill_s": t["prefill_s"], "tok_s": t["tok_s"]}


def run_transformers(ids: list[int], args: argparse.Namespace) -> dict:
    """transformers' prefill of the same ids in bfloat16 (its SDPA attention), the last position's logits only."""
    from benchmarks.engine import load_hf_gguf

    hf = load_hf_gguf(gguf_of(args), torch.bfloat16)
    with torch.inference_mode():
        hf(torch.tensor([ids[:256]]), logits_to_keep=1)  # warm-up
        t0 = time.perf_counter()
        hf(torch.tensor([ids]), logits_to_keep=1)
        return {"cache": "transformers, bfloat16 prefill", "prefill_s": time.perf_counter() - t0}


def bench_longctx(model: Transformer, checkpoint: Path, args: argparse.Namespace) -> dict:
    args.tokenizer = tokenizer_of(checkpoint)  # KVzip's repeat prompt is text
    text = text_ids(checkpoint, args.text)
    if len(text) < max(args.lengths):
        raise KVFastError(f"--text has {len(text)} tokens, fewer than the longest length {max(args.lengths)}")
    longest = max(args.lengths) + args.new_tokens
    if longest > model.args.max_seq_len:
        raise KVFastError(f"the longest length + --new-tokens ({longest}) exceed the model's maximum length of "
                          f"{model.args.max_seq_len} tokens")
    chunk = f"in blocks of {args.prefill_chunk} rows" if args.prefill_chunk else "as one block"
    if args.compile_prefill:
        chunk = f"compiled (one block; kvzip and the per-head pools: {chunk})"
    table(f"long context: {', '.join(args.policy)} budgets vs the full cache, prefill {chunk} "
          f"({args.prefill_dtype or 'fp32'} products), {args.new_tokens} greedy tokens compiled (block scope); "
          "peak = resident-set high-water mark over the row's prefill + decode; graphs = compiled graphs added after "
          "the warm-up (0: no recompiles)",
          ["tokens", "weights", "cache", "slots / layer", "K/V (MiB)", "prefill (s)", "decode tok/s", "vs full",
           "vs llama.cpp", "peak RSS (GiB)", "graphs"])
    results: dict[int, list[dict]] = {}
    models = {w: quantize.quantized_copy(model, w) for w in args.weights}
    for n in args.lengths:
        ids, rows = text[:n], []
        peer = run_llamacpp(ids, args) if n in args.peer_lengths else None
        hf = run_transformers(ids, args) if n in args.hf_lengths else None
        for weights, m in models.items():
            caches = [(b, "full") for b in args.budgets if b >= 1] + \
                [(b, p) for p in args.policy for b in args.budgets if b < 1]
            for budget, policy in caches:
                for bits in args.kv_bits:
                    name = kv_format(bits, args.kv_float)[1]
                    label = f"full ({name})" if policy == "full" else f"{policy} {100 * budget:g} % ({name})"
                    r = run_cache(m, ids, label, policy, None if budget >= 1 else budget, bits, args)
                    rows.append({"weights": weights, "kv_bits": bits, **r})
        full = {(r["weights"], r["kv_bits"]): r["tok_s"] for r in rows if r["cache"].startswith("full")}
        for r in rows:
            f = full.get((r["weights"], r["kv_bits"]))
            row(n, r["weights"], r["cache"], r["slots"], f"{r['kv_mib']:.0f}", f"{r['prefill_s']:.1f}", f"{r['tok_s']:.1f}",
                f"{r['tok_s'] / f:.2f}x" if f else "-", f"{r['tok_s'] / peer['tok_s']:.2f}x" if peer else "-",
                f"{r['peak_gib']:.2f}", r["new_graphs"])
        if peer:
            row(n, "GGUF as is", peer["cache"], n + args.new_tokens, "-", f"{peer['prefill_s']:.1f}",
                f"{peer['tok_s']:.1f}", "-", "1.00x", "-", "-")
            rows.append(peer)
        if hf:
            row(n, "GGUF, bfloat16", hf["cache"], "-", "-", f"{hf['prefill_s']:.1f}", "-", "-", "-", "-", "-")
            rows.append(hf)
        results[n] = rows
    return results


def check(args: argparse.Namespace) -> None:
    for p in args.policy:
        name, _, shift = split_combo_policy(p)
        if name not in kvcache.POLICIES or name == "full" or shift or p.rpartition("+kv")[1]:
            raise KVFastError(f"--policy must name compressing policies (POLICY or POLICY+warm), got {p!r}")
    if any(b <= 0 for b in args.budgets):
        raise KVFastError("--budgets must be > 0 (1: the full cache)")
    if not set(args.peer_lengths) <= set(args.lengths) or not set(args.hf_lengths) <= set(args.lengths):
        raise KVFastError("--peer-lengths and --hf-lengths must be among --lengths")


BENCH = Bench(__doc__, bench_longctx, {
    "lengths": Flag([4096, 16384, 32768], "context lengths in tokens, rows each"),
    "weights": Flag(["int8"], "weight formats, rows each (quantize.py's modes)"),
    "budgets": Flag([1.0, 0.25, 0.125], "cache budgets, a fraction of context + new tokens (1: the full cache)",
                    {"type": float, "nargs": "+", "metavar": "B"}),
    "kv_bits": Flag([16, 8], "K/V formats, a row each (16: --kv-float)"),
    "kv_float": Flag("float16", "16-bit K/V's float"),
    "policy": Flag(["snapkv"], "the compressing policies of the budgets, rows each (POLICY+warm: with kv.tiers)",
                   {"nargs": "+", "metavar": "POLICY"}),
    "new_tokens": Flag(64, "greedy tokens decoded after each prefill"),
    "prefill_chunk": Flag(DEFAULT_PREFILL_CHUNK, "prompt rows per prefill block (0: one block)", {"type": int}),
    "compile_prefill": Flag(False, "compile each row's prefill (decode.Decoder's compile_prefill: dynamic shapes, one "
                            "block) where its cache can be traced", {"action": "store_true"}),
    "prefill_dtype": Flag("bfloat16", "precision of the prefill's products",
                          {"choices": ["float32", "bfloat16"]}),
    "peer_lengths": Flag([], "lengths at which llama.cpp also runs (its 16k prefill takes minutes)",
                         {"type": int, "nargs": "*", "metavar": "N"}),
    "hf_lengths": Flag([], "lengths at which transformers' bfloat16 prefill of the same prompt is also timed",
                       {"type": int, "nargs": "*", "metavar": "N"}),
    "gguf": Flag(None, "llama.cpp's GGUF (default: checkpoints/.downloads/<checkpoint name>.gguf)",
                 {"type": Path}),
    "text": Flag("jargon", "the text whose first tokens are the prompts (evals.tasks.load_text)",
                 {"metavar": "TEXT"}),
})
