"""bench.py engine: HF transformers vs our eager vs our compiled decode (and llama.cpp with --peers).

Per prompt length, on the same random prompt ids in one run: prefill seconds, decode tok/s, the share of the
bandwidth floor (weights + K/V per step at the host's measured bandwidth) and the greedy tokens equal to kvfast
fp32's. Each compiled row names the kernel its one-token projections took (kernels.linear_path); llama.cpp runs
at each --llamacpp-formats weight format (Q8_0 beside int8, Q4_0 / Q4_1 beside int4).
"""

from __future__ import annotations

import argparse
import copy
from functools import partial
from pathlib import Path

import torch

import kernels
from attention import attention_path
from benchmarks.common import Bench, Flag, copy_bandwidth, interleaved, median_time, ours_run, row, table
from decode import PREFILL_DTYPES, prefill_dtype
from kv.quant import kv_format
from model import KVFastError, Transformer

ROOT = Path(__file__).resolve().parent.parent
HF = "HF transformers generate (fp32, eager)"
WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8, "int4": torch.uint8}


def load_hf_gguf(gguf: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' model for the GGUF's architecture (llama, qwen2), dequantized by its own GGUF reader."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.device("meta"):  # skips the random init; every weight is assigned below
        model = AutoModelForCausalLM.from_config(cfg)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg)
    return model.to(dtype).eval()


def time_hf(gguf: Path, prompt: torch.Tensor, new_tokens: int, repeats: int) -> dict:
    hf = load_hf_gguf(gguf)
    kwargs = {"do_sample": False, "pad_token_id": 2, "eos_token_id": None}

    def gen(n: int) -> None:
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
    from scripts.prepare import source_gguf

    if any(m != "fp32" for m in args.weights) and not isinstance(model.tok_embeddings, torch.nn.Embedding):
        raise KVFastError("--weights bf16/int8/int4 quantize the float model in memory: give the float checkpoint")
    bandwidth = copy_bandwidth()
    threads = torch.get_num_threads()
    gguf = source_gguf(checkpoint, ROOT) if args.peers or not args.skip_hf else None
    out = {"copy_bandwidth_GBs": bandwidth / 1e9, "new_tokens": args.new_tokens, "threads": threads, "lengths": {}}
    models = {mode: quantize.quantized_copy(model, mode) for mode in args.weights}
    for prompt_len in args.prompt_len:
        torch.manual_seed(0)
        prompt = torch.randint(100, model.args.vocab_size - 100, (1, prompt_len))
        rows = {}
        if not args.skip_hf:
            rows[HF] = time_hf(gguf, prompt, args.new_tokens, args.repeats)
        # each row its own model (quantized_copy's fp32 is the model itself): its own caches and compiled graph
        runs = {"kvfast eager (fp32)": ours_run(copy.deepcopy(model), prompt, args.new_tokens, False)}
        torch._dynamo.config.recompile_limit = max(8, 2 * len(args.weights) * (1 + len(args.kv_bits)))
        for mode in args.weights:
            for bits in (None, *args.kv_bits):
                m = models[mode] if bits is None else copy.deepcopy(models[mode])
                kv, name = kv_format(bits, args.kv_float)
                run = ours_run(m, prompt, args.new_tokens, True, kv,  # its Decoder times the integer kernels
                               prefill_dtype(args.prefill_dtype, m))
                path = kernels.linear_path(WEIGHT_DTYPES[mode.split("-")[0]], 1)  # the kernel each projection took
                runs[f"kvfast compiled ({mode} {path}" + (f", {name} K/V)" if bits else ")")] = run
        if "llama.cpp" in args.peers:
            from scripts.peer_llamacpp import time_llamacpp
            from scripts.peer_llamacpp_formats import requantized

            tokens = prompt[0].tolist()
            for fmt in args.llamacpp_formats:  # Q8_0: int8's peer; Q4_0 / Q4_1: int4's
                runs[f"llama.cpp ({fmt}, prebuilt CPU build)"] = partial(
                    time_llamacpp, requantized(gguf, fmt), tokens, args.new_tokens, threads, 1)  # a process per run
        rows.update(interleaved(runs, args.repeats, bandwidth=True))
        torch._dynamo.reset()
        out["lengths"][prompt_len] = rows
        print_engine_table(rows, prompt_len, bandwidth, args)
    return out


def bandwidths(rows: dict, key: str) -> str:
    measured = next((r[key] for r in rows.values() if key in r), [])
    return " / ".join(f"{b:.1f}" for b in measured) or "-"


def print_engine_table(rows: dict, prompt_len: int, bandwidth: float, args: argparse.Namespace) -> None:
    hf = rows.get(HF)
    peers = {name: r for name, r in rows.items() if name.startswith("llama.cpp")}
    peer = next(iter(peers.values()), None)
    ref = next((r.get("tokens") for name, r in rows.items() if name.startswith("kvfast compiled (fp32 ")
                and "K/V" not in name), None)
    caption = (f"prompt {prompt_len} tokens (the same random ids for every engine), {args.new_tokens} new tokens, "
               f"greedy, median of {args.repeats} (the engines' runs alternating); compiled = one graph per step "
               f"(--compile-scope step), its attention over float K/V: {attention_path()}, its prefill's "
               f"products: --prefill-dtype {args.prefill_dtype} (in the prefill column); copy bandwidth "
               f"{bandwidth / 1e9:.1f} GB/s before the table, "
               f"{bandwidths(rows, 'copy_bw_GBs')} GB/s at the start of each round; read bandwidth "
               f"{bandwidths(rows, 'read_bw_GBs')} GB/s (1 GiB buffers)")
    if peer:
        caption += f"\nllama.cpp system_info: {peer['system_info']}"
    table(caption, ["engine", "prefill (s)", "decode tok/s", "vs HF",
                    "vs llama.cpp " + " / ".join(n.split(" ")[1].strip("(,") for n in peers) if peers else "vs llama.cpp",
                    ("% of bandwidth floor: copy / read / read of the step's bytes (weights + K/V per step at "
                     "each round's bandwidth, median)"),
                    "greedy tokens equal to kvfast fp32"])
    for name, r in rows.items():
        vs_hf = f"{r['tok_s'] / hf['tok_s']:.2f}x" if hf else "-"
        vs_peer = " / ".join(f"{r['tok_s'] / p['tok_s']:.2f}x" for p in peers.values()) or "-"
        floor = " / ".join(f"{r[k]:.0f} %" for k in ("floor_pct", "read_floor_pct", "step_read_floor_pct")) \
            if "floor_pct" in r else "-"
        same = f"{agreement(r['tokens'], ref)} of {len(ref)}" if ref and "tokens" in r else "-"
        products = f" ({r['prefill_products']})" if "prefill_products" in r else ""
        row(name, f"{r['prefill_s']:.2f}{products}", f"{r['tok_s']:.1f}", vs_hf, vs_peer, floor, same)


BENCH = Bench(__doc__, bench_engine, {
    "prompt_len": Flag([512], "prompt lengths in tokens, a table each"),
    "new_tokens": Flag(128, "tokens decoded per run"),
    "weights": Flag(["fp32"], "weights of the compiled kvfast rows, quantized in memory as quantize.py writes them"),
    "kv_bits": Flag([], "also run each compiled --weights row with the full cache's K/V stored in these bits "
                        "(16: 16-bit floats, --kv-float; 8 / 4: quantized)"),
    "kv_float": Flag("auto", "the 16-bit float of every --kv-bits 16 row (generate.py --kv-float; auto: float16), "
                             "named in the row"),
    "peers": Flag([], "other engines timed in the same run on the same prompts (llama.cpp: its prebuilt CPU build "
                      "on the checkpoint's GGUF, installed on first use into .peers/)",
                  {"nargs": "*", "choices": ["llama.cpp"]}),
    "llamacpp_formats": Flag(["Q8_0", "Q4_0", "Q4_1"], "llama.cpp's weight formats, a row each: the "
                             "checkpoint's GGUF with its blocks' weights re-quantized once with the gguf package "
                             "(scripts/peer_llamacpp_formats.py)",
                             {"nargs": "+", "choices": ["Q8_0", "Q4_0", "Q4_1"]}),
    "prefill_dtype": Flag("auto", "precision of the compiled rows' prefill products (generate.py "
                          "--prefill-dtype; the eager row keeps fp32)", {"choices": list(PREFILL_DTYPES)}),
    "skip_hf": Flag(False, "leave out the HF transformers row", {"action": "store_true"}),
})
