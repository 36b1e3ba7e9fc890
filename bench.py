"""Speed and memory, side by side in one run: every figure is read against a baseline measured in the same run.

    python bench.py                       # engine: HF transformers vs our eager vs our compiled decode
    python bench.py --section policies    # decode step time per cache policy at 512 / 2048 / 4096 tokens
    python bench.py --section quantize    # fp32 vs int8 vs int4 weights: size, decode speed, quality
    python bench.py --section kv-bits     # K/V stored in fp32 vs 16 vs 8 vs 4 bits: decode step time and KV bytes
    python bench.py --section prefill     # what each prompt compressor adds to a plain prefill (kvzip, ...)
    python bench.py --section compile     # cold / warm / portable compile per policy, whole step vs one block
    python bench.py --section tiers       # tiered (kv.tiers) vs plain decode step at the same hot budget, 4096 tokens
    python bench.py --section speculate   # self-speculative decoding (speculate.py) vs plain, on real text
    python bench.py --section batch       # total decode tok/s with B rows together vs one row (B = 1 2 4 8)
    python bench.py --section ragged      # 8 different prompts decoded together (ragged.py) vs one run each
    python bench.py --section tp          # generate.py on 1 process vs torchrun on 2 ranks (tp.py)

Markdown tables go to stdout, everything measured to --json.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

import cache as kvcache
from benchbatch import bench_batch
from benchragged import bench_ragged
from benchspeculate import bench_speculate
from benchtiers import TIER_SPAN, bench_tiers, timed_steps
from benchtp import bench_tp
from evalcaches import add_tier_flags, given_tier_flags, tier_settings
from generate import DEFAULT_CHECKPOINT, ArgumentParser, Decoder, resolve_checkpoint, run_cli
from kv.quant import KV_FLOATS, kv_format
from model import KVFastError, Transformer


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(n_bytes: int = 1 << 30, repeats: int = 7) -> float:
    """Bytes moved per second (read + write) copying a buffer far larger than the caches."""
    src = torch.ones(n_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * n_bytes / median_time(lambda: dst.copy_(src), repeats)


def read_bandwidth(n_bytes: int = 1 << 30, repeats: int = 3) -> float:
    """Bytes read per second summing a buffer far larger than the caches: a decode step only reads."""
    src = torch.ones(n_bytes // 4)
    src.sum()
    return n_bytes / median_time(src.sum, repeats)


def cpu_summary() -> str:
    """What this CPU can do, read from the machine (every table records it: machines differ between runs)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                 "unknown CPU")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    simd = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags]
    return f"{model}; {', '.join(simd) or 'no AVX2'}; torch {torch.__version__}, {torch.get_num_threads()} threads"


# ---- engine: HF vs ours -------------------------------------------------------------------------------------
def ours_run(model: Transformer, prompt: torch.Tensor, new_tokens: int, compile: bool,
             kv: dict | None = None) -> Callable[[], dict]:
    """One timed greedy run of our engine with a full cache (the first call compiles): its prefill seconds,
    decode tok/s and tokens. kv: kv_format's keywords."""
    model.setup_caches(kvcache.make_cache_factory("full", 1, model.args, prompt.shape[1], new_tokens, **(kv or {})))
    decoder = Decoder(model, compile=compile, scope="step")  # the tables' compiled rows: whole-step graphs

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
    weights = {"step_bytes": model.weight_bytes() + sum(c.physical_bytes() for c in model.caches)} if compile else {}
    return run


def interleaved(runs: dict[str, Callable[[], dict]], repeats: int, bandwidth: bool = False) -> dict[str, dict]:
    """Each engine's repeats alternate with the others' (a shared host drifts between separately timed rows),
    after one untimed round (compiles, warms up); per engine the median prefill and tok/s, and the last run's
    other fields. bandwidth: the copy and read bandwidths are measured at the start of every round too, and a
    run that reports its step_bytes gets floor_pct / read_floor_pct, the medians over rounds of its share of that
    round's floors (the host's bandwidth moves between minutes as much as the engines do)."""
    for run in runs.values():
        run()
    rounds: dict[str, list[dict]] = {name: [] for name in runs}
    for _ in range(repeats):
        bw = {"copy_bw": copy_bandwidth(repeats=3), "read_bw": read_bandwidth()} if bandwidth else {}
        for name, run in runs.items():
            rounds[name].append({**run(), **bw})
    out = {name: {**rs[-1], "prefill_s": statistics.median(r["prefill_s"] for r in rs),
                  "tok_s": statistics.median(r["tok_s"] for r in rs)} for name, rs in rounds.items()}
    for name, rs in rounds.items():
        if bandwidth and "step_bytes" in rs[-1]:
            for floor, bw in (("floor_pct", "copy_bw"), ("read_floor_pct", "read_bw")):
                out[name][floor] = statistics.median(100 * r["tok_s"] * r["step_bytes"] / r[bw] for r in rs)
                out[name][f"{bw}_GBs"] = [r[bw] / 1e9 for r in rs]
    return out


def time_ours(model: Transformer, prompt: torch.Tensor, new_tokens: int, compile: bool, repeats: int) -> dict:
    return interleaved({"ours": ours_run(model, prompt, new_tokens, compile)}, repeats)["ours"]


def load_hf_gguf(gguf: Path):
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg)
    return model.float().eval()


def time_hf(gguf: Path, prompt: torch.Tensor, new_tokens: int, repeats: int) -> dict:
    hf = load_hf_gguf(gguf)
    kwargs = {"do_sample": False, "pad_token_id": 2, "eos_token_id": None}

    def gen(n: int):
        with torch.inference_mode():
            hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kwargs)

    gen(2)
    t_prefill = median_time(lambda: gen(1), repeats)
    t_all = median_time(lambda: gen(new_tokens), repeats)
    return {"prefill_s": t_prefill, "tok_s": (new_tokens - 1) / (t_all - t_prefill)}


def agreement(a: list[int], b: list[int]) -> int:
    """Greedy tokens two engines produce alike before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def bench_engine(model: Transformer, checkpoint: Path, args: argparse.Namespace) -> dict:
    """Per prompt length: HF transformers, our eager and compiled decode for each --weights mode, and the
    --peers (llama.cpp on the GGUF the checkpoint came from), all on the same prompt ids in this run."""
    import quantize
    from scripts.prepare import default_gguf

    if any(m != "fp32" for m in args.weights) and not isinstance(model.tok_embeddings, torch.nn.Embedding):
        raise KVFastError("--weights bf16/int8/int4 quantize the float model in memory: give the float checkpoint")
    bandwidth = copy_bandwidth()
    threads = torch.get_num_threads()
    gguf = default_gguf(Path(__file__).parent) if args.peers or not args.skip_hf else None
    out = {"copy_bandwidth_GBs": bandwidth / 1e9, "new_tokens": args.new_tokens, "threads": threads, "lengths": {}}
    models = {mode: quantize.quantized_copy(model, mode) for mode in args.weights}
    for prompt_len in args.prompt_len:
        torch.manual_seed(0)
        prompt = torch.randint(100, model.args.vocab_size - 100, (1, prompt_len))
        rows = {}
        if not args.skip_hf:
            rows["HF transformers generate (fp32, eager)"] = time_hf(gguf, prompt, args.new_tokens, args.repeats)
        # each row its own model (quantized_copy's fp32 is the model itself): its own caches and compiled graph
        runs = {"kvfast eager (fp32)": ours_run(copy.deepcopy(model), prompt, args.new_tokens, False)}
        torch._dynamo.config.recompile_limit = max(8, 2 * len(args.weights) * (1 + len(args.kv_bits)))
        for mode in args.weights:
            for bits in (None, *args.kv_bits):
                m = models[mode] if bits is None else copy.deepcopy(models[mode])
                kv, name = kv_format(bits, args.kv_float)
                runs[f"kvfast compiled ({mode}" + (f", {name} K/V)" if bits else ")")] = ours_run(
                    m, prompt, args.new_tokens, True, kv)
        if "llama.cpp" in args.peers:
            from scripts.peer_llamacpp import time_llamacpp

            tokens = prompt[0].tolist()
            runs[f"llama.cpp ({gguf.name.split('.')[-2]}, prebuilt CPU build)"] = partial(
                time_llamacpp, gguf, tokens, args.new_tokens, threads, 1)  # a process per run, its own warm-up
        rows.update(interleaved(runs, args.repeats, bandwidth=True))
        torch._dynamo.reset()
        out["lengths"][prompt_len] = rows
        print_engine_table(rows, prompt_len, bandwidth, args)
    return out


def bandwidths(rows: dict, key: str) -> str:
    measured = next((r[key] for r in rows.values() if key in r), [])
    return " / ".join(f"{b:.1f}" for b in measured) or "-"


def print_engine_table(rows: dict, prompt_len: int, bandwidth: float, args: argparse.Namespace) -> None:
    hf = rows.get("HF transformers generate (fp32, eager)")
    peer = next((r for name, r in rows.items() if name.startswith("llama.cpp")), None)
    ref = rows.get("kvfast compiled (fp32)", {}).get("tokens")
    print(f"\nprompt {prompt_len} tokens (the same random ids for every engine), {args.new_tokens} new tokens, "
          f"greedy, median of {args.repeats} (the engines' runs alternating); compiled = one graph per step (--compile-scope step); copy bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s before the table, {bandwidths(rows, 'copy_bw_GBs')} GB/s at the start of each "
          f"round; read bandwidth {bandwidths(rows, 'read_bw_GBs')} GB/s")
    if peer:
        print(f"llama.cpp system_info: {peer['system_info']}")
    print("\n| engine | prefill (s) | decode tok/s | vs HF | vs llama.cpp | % of bandwidth floor: copy / read (weights "
          "+ K/V per step at each round's bandwidth, median) | greedy tokens equal to kvfast fp32 |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        vs_hf = f"{r['tok_s'] / hf['tok_s']:.2f}x" if hf else "-"
        vs_peer = f"{r['tok_s'] / peer['tok_s']:.2f}x" if peer else "-"
        floor = f"{r['floor_pct']:.0f} % / {r['read_floor_pct']:.0f} %" if "floor_pct" in r else "-"
        same = f"{agreement(r['tokens'], ref)} of {len(ref)}" if ref and "tokens" in r else "-"
        print(f"| {name} | {r['prefill_s']:.2f} | {r['tok_s']:.1f} | {vs_hf} | {vs_peer} | {floor} | {same} |")


# ---- policies: decode step time at long context --------------------------------------------------------------
def step_time(model: Transformer, policy: str, context_len: int, budget: float | None, steps: int,
              repeats: int, scope: str = "step", **cache_kwargs) -> tuple[float, int]:
    """Median seconds per compiled decode step with the caches filled as after `context_len` tokens.

    The cached K/V are random (kvcache.setup_decode_benchmark): the model's own 4k prefill would cost minutes
    on 2 cores and does not change what a decode step costs. Returns (seconds, capacity of layer 0)."""
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


def bench_policies(model: Transformer, args: argparse.Namespace) -> dict:
    # full is every table's first row (and has no budget): listed again, it is not repeated
    policies = [p for p in args.policies or kvcache.POLICIES if p != "full"]
    results = {}
    print(f"\ndecode step time (ms), compiled (--compile-scope {args.compile_scope}), budget {args.budget:g} of context + new tokens; bookkeeping ="
          f" (step - step of a full cache with as many slots) / step\n")
    print("| policy | " + " | ".join(f"{n} tokens: step (speed-up vs full), bookkeeping" for n in args.lengths) + " |")
    print("|---|" + "---|" * len(args.lengths))
    timed = partial(step_time, steps=args.steps, repeats=args.repeats, scope=args.compile_scope)
    full = {n: timed(model, "full", n, None)[0] for n in args.lengths}
    print("| full | " + " | ".join(f"{1e3 * full[n]:.1f}" for n in args.lengths) + " |", flush=True)
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
        print(f"| {policy} | " + " | ".join(cells) + " |", flush=True)
    if len(policies) > 1:
        setups = {p: {"policy": p, "budget": args.budget} for p in policies}
        results["interleaved"] = interleaved_caches(model, setups, args.lengths[-1], args)
    return results


def interleaved_caches(model: Transformer, setups: dict[str, dict], context_len: int, args: argparse.Namespace,
                       rounds: int = 15) -> dict:
    """Compiled steps over several caches (label -> setup_decode_benchmark's policy and keywords: a budget,
    kv_bits) in one process and one Decoder, alternating rounds of args.steps steps (caches filled as after
    context_len tokens): per label the median and 10th percentile ms per step, and the ratio of medians to the
    first label. Rows timed minutes apart drift by more than the 10 % the per-head issue allows on a shared
    host; alternating in one process they do not."""
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
                ms = 1e3 * timed_steps(model, decoder, None, context_len + r * args.steps, args.steps)
                if r:
                    times[label].append(ms)
    first = next(iter(setups))
    base = statistics.median(times[first])
    print(f"\nthe same steps interleaved in one process at {context_len} tokens ({rounds} alternating rounds of "
          f"{args.steps} steps, one Decoder): ms per step, median (10th percentile), vs {first}\n")
    print(f"| cache | step ms | vs {first} |")
    print("|---|---|---|")
    out = {}
    for label, t in times.items():
        med, p10 = statistics.median(t), statistics.quantiles(t, n=10)[0]
        out[label] = {"median_ms": med, "p10_ms": p10, "ratio": med / base, "rounds_ms": t}
        print(f"| {label} | {med:.2f} ({p10:.2f}) | {med / base:.3f}x |", flush=True)
    return out


# ---- prompt compression: what scoring the prompt adds to a prefill -----------------------------------------------
def compress_prompt(model: Transformer, idx: Tensor, kv: list, caches: list) -> None:
    """Fill caches from a recorded prefill (kv) of idx, with fresh memos: all the compressors' work."""
    from kv import kvzip

    memos = [{} for _ in caches]
    kvzip.score_into(model, idx, kv, caches, memos)
    for c, (q, k, v), memo in zip(caches, kv, memos):
        c.prefill(q, k, v, memo=memo)


def bench_prefill(model: Transformer, checkpoint: Path, args: argparse.Namespace) -> dict:
    """Per length: a plain prefill (every layer's q, k, v recorded), then each compressor's work on top of it
    (statistics, scores, selection into a cache of a quarter of the prompt; kvzip: its reconstruction pass).
    Random token ids: the cost does not depend on the text."""
    from kv import kvzip
    from tokenizer import load_tokenizer

    tok = load_tokenizer(checkpoint if checkpoint.is_dir() else checkpoint.parent)
    # one column per compressor; kvzip once per --kvzip-dtypes value (its reconstruction's precision)
    columns = [(n, {"kvzip_dtype": d}) if n == "kvzip" else (n, {}) for n in args.compressors
               for d in (args.kvzip_dtypes if n == "kvzip" else [None])]
    names = [n if not extra else f"{n} ({extra['kvzip_dtype']})" for n, extra in columns]
    print(f"\nprefill vs prompt compression (s, median of {args.repeats}); ratio = (prefill + compression) / "
          "prefill; fp32\n")
    print("| tokens | prefill | " + " | ".join(f"{n}: s (ratio)" for n in names) + " |")
    print("|---|---|" + "---|" * len(names))
    results = {}
    for n in args.lengths:
        idx = torch.randint(100, model.args.vocab_size - 100, (1, n), generator=torch.Generator().manual_seed(n))
        with torch.inference_mode():
            t_prefill = median_time(partial(kvzip.record_prefill, model, idx), args.repeats)
            kv, _ = kvzip.record_prefill(model, idx)
            row = {"prefill_s": t_prefill}
            for name, (compressor, extra) in zip(names, columns):
                factory = kvcache.make_cache_factory("snapkv", 1, model.args, n, 1, prompt_compression=compressor,
                                                     budget=n // 4 + 1, tokenizer=tok, **extra)
                caches = [factory(i) for i in range(model.args.n_layers)]
                row[name] = median_time(partial(compress_prompt, model, idx, kv, caches), args.repeats)
        results[n] = row
        cells = [f"{row[name]:.2f} ({(t_prefill + row[name]) / t_prefill:.2f}x)" for name in names]
        print(f"| {n} | {t_prefill:.2f} | " + " | ".join(cells) + " |", flush=True)
    return results


# ---- quantized K/V: what a step costs and what the cache holds ---------------------------------------------------
def forced_logprobs(model: Transformer, policy: str, ids: Tensor, budget: float | None, **cache_kwargs) -> Tensor:
    """Prefill the first half of ids [1, T], teacher-force the rest through the (eager) decode step: the
    next-token log-probs [T/2 - 1, V] of the second half."""
    P, T = ids.shape[1] // 2, ids.shape[1]
    kwargs = {} if budget is None else {"budget": budget}
    model.setup_caches(kvcache.make_cache_factory(policy, 1, model.args, P, T - P, **kwargs, **cache_kwargs))
    steps: list[Tensor] = []
    with torch.inference_mode():
        model(ids[:, :P])
        Decoder(model).decode(ids[:, P : P + 1], P, T - P - 1, forced=ids[:, P + 1 :],
                              on_logits=lambda i, logits: steps.append(torch.log_softmax(logits[0, 0].float(), -1)))
    return torch.stack(steps)


def bench_kv_bits(model: Transformer, checkpoint: Path, args: argparse.Namespace) -> dict:
    import evaltasks
    from generate import load

    _, tokenizer = load(checkpoint, "cpu", torch.float32)
    ids = torch.tensor([tokenizer.encode(evaltasks.load_text(args.quality_text))[: args.quality_tokens]])
    policies = args.policies or ["full", "h2o"]
    results: dict[str, dict] = {}
    print(f"\ndecode step time (ms), compiled, K/V stored in the compute dtype vs --kv-bits 16 ({kv_format(16, args.kv_float)[1]}) / 8 / 4 (one group per "
          f"token and head); budget {args.budget:g} for policies other than full; KV = MB the caches hold. "
          f"Quality: {ids.shape[1]} tokens of {args.quality_text!r}, the first half prefilled, the second "
          "teacher-forced through the decode step; KL(fp32 K/V || quantized) and top-1 agreement per token\n")
    print("| policy | K/V | " + " | ".join(f"{n} tokens: step (vs fp32), KV MB" for n in args.lengths)
          + " | KL vs fp32 | top-1 vs fp32 |")
    print("|---|---|" + "---|" * (len(args.lengths) + 2))
    for policy in policies:
        budget = None if policy == "full" else args.budget
        base: dict[int, float] = {}
        reference = forced_logprobs(model, policy, ids, budget)
        for bits in (None, 16, 8, 4):
            cells, row = [], {}
            kv, label = kv_format(bits, args.kv_float)
            for n in args.lengths:
                t, _ = step_time(model, policy, n, budget, args.steps, args.repeats, args.compile_scope, **kv)
                kv_mb = sum(c.physical_bytes() for c in model.caches) / 1e6
                base.setdefault(n, t)
                row[n] = {"step_s": t, "kv_MB": kv_mb}
                cells.append(f"{1e3 * t:.1f} ({base[n] / t:.2f}x), {kv_mb:.1f}")
            lp = reference if bits is None else forced_logprobs(model, policy, ids, budget, **kv)
            row["kl"] = (reference.exp() * (reference - lp)).sum(-1).mean().item()
            row["top1"] = (lp.argmax(-1) == reference.argmax(-1)).float().mean().item()
            results[f"{policy}/{label}"] = row
            print(f"| {policy} | {label} | " + " | ".join(cells) + f" | {row['kl']:.4f} | {row['top1']:.3f} |",
                  flush=True)
        formats = [kv_format(bits, args.kv_float) for bits in (None, 16, 8, 4)]
        setups = {label: {"policy": policy, "budget": budget, **kv} for kv, label in formats}
        results[f"{policy}/interleaved"] = interleaved_caches(model, setups, args.lengths[-1], args)
    return results


# ---- quantization: size, speed and what it costs -------------------------------------------------------------
def bench_quantize(model: Transformer, checkpoint: Path, args: argparse.Namespace) -> dict:
    """Each mode quantizes the float model in memory (what quantize.py writes), then decodes compiled and is
    teacher-forced over --quality-tokens of real text against the float model's distributions."""

    import torch.nn.functional as F

    import evaltasks
    import quantize
    from generate import load

    if isinstance(model.tok_embeddings, (quantize.Int8Embedding, quantize.BF16Embedding)):
        raise KVFastError("--section quantize compares against fp32: give the float checkpoint")
    for g in args.group_sizes:
        quantize.check_group_size(model, g)
    _, tokenizer = load(checkpoint, "cpu", torch.float32)
    ids = torch.tensor([tokenizer.encode(evaltasks.load_text(args.quality_text))[: args.quality_tokens]])
    torch.manual_seed(0)
    prompt = torch.randint(100, model.args.vocab_size - 100, (1, args.prompt_len[0]))
    model.setup_caches(lambda i: None)
    with torch.inference_mode():
        ref = F.log_softmax(model(ids, all_logits=True)[0, :-1], -1)
    rows = {}
    for mode in ["fp32", "bf16", "int8", *(f"int4-g{g}" for g in args.group_sizes)]:
        m = quantize.quantized_copy(model, mode)
        m.setup_caches(lambda i: None)  # a plain causal forward: no cache to fill
        with torch.inference_mode():
            lp = F.log_softmax(m(ids, all_logits=True)[0, :-1], -1)
        nll = -lp.gather(-1, ids[0, 1:, None]).mean()
        rows[mode] = {"weight_MB": m.weight_bytes() / 1e6, "ppl": nll.exp().item(),
                      "kl": (ref.exp() * (ref - lp)).sum(-1).mean().item(),
                      "top1": (lp.argmax(-1) == ref.argmax(-1)).float().mean().item(),
                      **time_ours(m, prompt, args.new_tokens, True, args.repeats)}
        torch._dynamo.reset()
    fp32 = rows["fp32"]["tok_s"]
    print(f"\nweights quantized in memory (quantize.quantize_model); decode: compiled, prompt {args.prompt_len[0]}, "
          f"{args.new_tokens} new tokens, median of {args.repeats}; quality: {ids.shape[1]} tokens of "
          f"{args.quality_text!r} teacher-forced, KL(fp32 || mode) and top-1 agreement per position\n")
    print("| weights | MB | decode tok/s | vs fp32 | perplexity | KL vs fp32 | top-1 vs fp32 |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in rows.items():
        print(f"| {mode} | {r['weight_MB']:.0f} | {r['tok_s']:.1f} | {r['tok_s'] / fp32:.2f}x | {r['ppl']:.2f} | "
              f"{r['kl']:.4f} | {r['top1']:.3f} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT, help="checkpoint folder")
    p.add_argument("--section", choices=["engine", "policies", "kv-bits", "quantize", "prefill", "tiers", "compile",
                                                "speculate", "batch", "ragged", "tp", "all"],
                   default="engine", help="which tables")
    p.add_argument("--compressors", nargs="+", default=["snapkv", "h2o", "expected_attention", "kvzip"],
                   help="prefill table: prompt compressors")
    p.add_argument("--kvzip-dtypes", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "bfloat16", "auto"],
                   help="prefill table: precisions of kvzip's reconstruction pass, a column each")
    p.add_argument("--prompt-len", type=int, nargs="+", default=[512],
                   help="engine and batch tables: prompt lengths, a table each; compile table: prompt tokens (the first)")
    p.add_argument("--weights", nargs="+", default=["fp32"], choices=["fp32", "bf16", "int8", "int4-g32", "int4-g64"],
                   help="engine, speculate and batch tables: weights of the compiled kvfast rows, quantized in memory as "
                        "quantize.py writes them")
    p.add_argument("--kv-bits", type=int, nargs="*", default=[], choices=[16, 8, 4],
                   help="engine table: also run each compiled --weights row with the full cache's K/V stored in "
                        "these bits (16: 16-bit floats, --kv-float; 8 / 4: quantized); batch table: these K/V formats "
                        "instead of fp32; speculate table: also with the full cache in these formats")
    p.add_argument("--kv-float", default="auto", choices=KV_FLOATS,
                   help="the 16-bit float of every --kv-bits 16 row (generate.py --kv-float; auto: float16, and for the "
                        "speculate table bfloat16 on a CPU with bfloat16 dot products), named in the row")
    p.add_argument("--peers", nargs="*", default=[], choices=["llama.cpp"],
                   help="engine table: other engines timed in the same run on the same prompts (llama.cpp: its "
                        "prebuilt CPU build on the checkpoint's GGUF, installed on first use into .peers/)")
    p.add_argument("--new-tokens", type=int, default=128, help="engine, compile and batch tables: tokens decoded (per row)")
    p.add_argument("--repeats", type=int, default=5, help="repeats per measurement (the median is reported)")
    p.add_argument("--skip-hf", action="store_true", help="engine table without the HF transformers row")
    p.add_argument("--policies", nargs="*",
                   help="policies table: policies (default: all but full); kv-bits table: (default: full h2o); "
                        "tiers table: evicting policies to run plain and tiered (default: h2o); compile table: "
                        "(default: full h2o scissorhands snapkv, at a budget of 0.5)")
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="policies, kv-bits and prefill tables: prompts (default: 512 2048 4096); tiers and speculate "
                        "tables: (default: 4096)")
    p.add_argument("--compile-scope", choices=["step", "block"], default="step",
                   help="policies, kv-bits and tiers tables: compile the whole step (as their README tables were taken) or "
                        "one nested block region per step (generate.py's default on CPU)")
    p.add_argument("--budget", type=float, default=0.25, help="policies, kv-bits and tiers tables: cache budget")
    p.add_argument("--steps", type=int, default=16,
                   help="policies and kv-bits tables: decode steps per timed repeat; tiers table: steps per timed "
                        "single-step mean (the average runs 256)")
    p.add_argument("--group-sizes", type=int, nargs="+", default=[32, 64], help="quantize table: int4 groups")
    p.add_argument("--quality-text", default="jargon",
                   help="quantize and kv-bits tables: text source (see eval.py --ppl-text; `make data` fetches "
                        "it) or a file")
    p.add_argument("--quality-tokens", type=int, default=1024,
                   help="quantize and kv-bits tables: tokens of that text")
    p.add_argument("--buckets", nargs="+", default=["x4", "dynamic"],
                   help="compile table: --capacity-buckets settings (and dynamic: --dynamic-capacity) to compare "
                        "with off over ten prompt lengths")
    p.add_argument("--length-policies", nargs="*", default=["full", "h2o"],
                   help="compile table: policies of the ten-prompt-lengths rows, evicting ones at a budget of 0.5 (none: "
                        "skip those rows)")
    p.add_argument("--lengths-only", action="store_true",
                   help="compile table: only the ten-prompt-lengths rows (no cold / warm / portable runs)")
    p.add_argument("--drafts", nargs="+", default=["window@0.05", "window@0.1"],
                   help="speculate table: draft caches as POLICY@BUDGET (an evicting policy; a fraction of prompt + "
                        "new tokens or a slot count)")
    p.add_argument("--draft-k", type=int, nargs="+", default=[2, 3, 4],
                   help="speculate table: drafts per round (--speculate K), a row each")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="batch table: rows decoded together, a row of the table each (B = 1 is always measured)")
    p.add_argument("--batch-kernels", nargs="+", choices=["gemm", "reductions"], default=["gemm", "reductions"],
                   help="batch table: the projection kernels measured from model.GEMM_MIN_ROWS rows, a row each "
                        "(gemm only where this CPU has one for the weights)")
    p.add_argument("--ragged-lengths", type=int, nargs="+", default=[20, 45, 100, 200, 400, 700, 1200, 2000],
                   help="ragged table: the prompts' lengths in tokens, a row of the batch each")
    p.add_argument("--tp-ranks", type=int, nargs="+", default=[1, 2],
                   help="tp table: process counts, a row each (torchrun for more than 1; tp.py)")
    p.add_argument("--json", type=Path, default=Path("bench_results.json"), help="where to write all figures")
    add_tier_flags(p, "tiers table: the tiered policy's settings")
    args = p.parse_args(argv)
    given = given_tier_flags(args)
    if given and args.section not in ("tiers", "all"):
        p.error(f"{given[0]} is used by --section tiers only")
    if any(b < 1 for b in args.batch_sizes):
        p.error(f"--batch-sizes {' '.join(map(str, args.batch_sizes))}: every size must be at least 1")
    tier_settings(args)  # bad tier flags fail before the model loads
    if args.section == "tiers" and args.steps > TIER_SPAN:
        p.error(f"--steps {args.steps}: the tiers table's caches hold {TIER_SPAN} steps")
    torch.manual_seed(0)
    checkpoint = resolve_checkpoint(args.checkpoint)
    model = Transformer.from_checkpoint(checkpoint)
    out = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu_summary()}
    print(f"machine: {out['cpu']}")
    tier_lengths, args.lengths = args.lengths, args.lengths or [512, 2048, 4096]
    if args.section in ("engine", "all"):
        out["engine"] = bench_engine(model, checkpoint, args)
    if args.section in ("policies", "all"):
        out["policies"] = bench_policies(model, args)
    if args.section in ("kv-bits", "all"):
        out["kv_bits"] = bench_kv_bits(model, checkpoint, args)
    if args.section in ("quantize", "all"):
        out["quantize"] = bench_quantize(model, checkpoint, args)
    if args.section in ("prefill", "all"):
        unknown = [c for c in args.compressors if c not in kvcache.PROMPT_COMPRESSORS]
        if unknown:
            raise KVFastError(f"unknown prompt compressor {unknown[0]!r} (choose from "
                              f"{', '.join(kvcache.PROMPT_COMPRESSORS)})")
        out["prefill"] = bench_prefill(model, checkpoint, args)
    if args.section in ("tiers", "all"):
        args.lengths = tier_lengths
        out["tiers"] = bench_tiers(model, args)
    if args.section in ("speculate", "all"):
        args.lengths = tier_lengths or [4096]
        out["speculate"] = bench_speculate(model, checkpoint, args)
    if args.section in ("batch", "all"):
        out["batch"] = bench_batch(model, args)
    if args.section in ("ragged", "all"):
        out["ragged"] = bench_ragged(model, checkpoint, args)
    if args.section in ("tp", "all"):
        out["tp"] = bench_tp(checkpoint, args)
    if args.section in ("compile", "all"):
        from benchcompile import bench_compile, bench_lengths

        if not args.lengths_only:
            out["compile"] = bench_compile(checkpoint, args.policies or ["full", "h2o", "scissorhands", "snapkv"],
                                           args.prompt_len[0], args.new_tokens, 0.5)
        if args.length_policies:
            out["compile_lengths"] = bench_lengths(checkpoint, args.length_policies, "block", ["off", *args.buckets])
    args.json.write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    sys.exit(run_cli(main))
