"""bench.py quantize: fp32 vs bf16 vs int8 vs int4 weights: size, compiled decode speed, quality.

Each mode quantizes the float model in memory (what quantize.py writes), then decodes compiled and is
teacher-forced over --quality-tokens of real text against the float model's distributions. int8 / int4 get a row
per kernel of their one-token products (kernels.linear_path): Inductor's reductions in fp32 and, where this CPU
chooses them, the integer dot products (Q8_0 activations), whose quality is measured with every product of the
teacher-forced forward taken through them (kernels.integer_products).
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F

import kernels
import quantize
from benchmarks.common import Bench, Flag, row, table, text_ids, time_ours
from benchmarks.kv_bits import QUALITY_TEXT, QUALITY_TOKENS
from decode import prefill_dtype
from model import KVFastError, Transformer


def bench_quantize(model: Transformer, checkpoint: Path, args: argparse.Namespace) -> dict:
    if isinstance(model.tok_embeddings, (quantize.Int8Embedding, quantize.BF16Embedding)):
        raise KVFastError("bench.py quantize compares against fp32: give the float checkpoint")
    for g in args.group_sizes:
        quantize.check_group_size(model, g)
    ids = torch.tensor([text_ids(checkpoint, args.quality_text)[: args.quality_tokens]])
    torch.manual_seed(0)
    prompt = torch.randint(100, model.args.vocab_size - 100, (1, args.prompt_len[0]))
    model.setup_caches(lambda i: None)
    with torch.inference_mode():
        ref = F.log_softmax(model(ids, all_logits=True)[0, :-1], -1)
    rows = {}
    for mode in ["fp32", "bf16", "int8", *(f"int4-g{g}" for g in args.group_sizes)]:
        m = quantize.quantized_copy(model, mode)
        dtype = {"int8": torch.int8, "int4": torch.uint8}.get(mode.split("-")[0])
        paths = ["reductions"] + ([kernels.int_path(dtype)] if dtype and kernels.int_path(dtype) != "reductions"
                                  else [])
        for path in paths:
            integer = path != "reductions"
            m.setup_caches(lambda i: None)  # a plain causal forward: no cache to fill
            with torch.inference_mode(), kernels.integer_products("everywhere" if integer else "nowhere"):
                lp = F.log_softmax(m(ids, all_logits=True)[0, :-1], -1)
            nll = -lp.gather(-1, ids[0, 1:, None]).mean()
            prefill_ppl = None  # the same forward with a prefill's products (--prefill-dtype auto's choice here)
            products = str(prefill_dtype("auto", m) or torch.float32).removeprefix("torch.")
            if not integer:
                with torch.inference_mode(), kernels.integer_products("nowhere"):
                    lp16 = F.log_softmax(m(ids, all_logits=True, prefill_dtype=prefill_dtype("auto", m))[0, :-1]
                                         .float(), -1)
                prefill_ppl = (-lp16.gather(-1, ids[0, 1:, None]).mean()).exp().item()
            with contextlib.nullcontext() if integer else kernels.integer_products("nowhere"):
                speed = time_ours(m, prompt, args.new_tokens, True, args.repeats)
            rows[f"{mode} ({path})" if dtype else mode] = {
                "weight_MB": m.weight_bytes() / 1e6, "ppl": nll.exp().item(), "ppl_prefill": prefill_ppl,
                "prefill_products": products,
                "kl": (ref.exp() * (ref - lp)).sum(-1).mean().item(),
                "top1": (lp.argmax(-1) == ref.argmax(-1)).float().mean().item(), **speed}
            torch._dynamo.reset()
    fp32 = rows["fp32"]["tok_s"]
    table(f"weights quantized in memory (quantize.quantize_model); decode: compiled, prompt {args.prompt_len[0]}, "
          f"{args.new_tokens} new tokens, median of {args.repeats}; quality: {ids.shape[1]} tokens of "
          f"{args.quality_text!r} teacher-forced, KL(fp32 || mode) and top-1 agreement per position",
          ["weights", "MB", "decode tok/s", "vs fp32", "perplexity", "KL vs fp32", "top-1 vs fp32",
           "perplexity, a prefill's products (--prefill-dtype auto)"])
    for mode, r in rows.items():
        prefill = "-" if r["ppl_prefill"] is None else f"{r['ppl_prefill']:.2f} ({r['prefill_products']})"
        row(mode, f"{r['weight_MB']:.0f}", f"{r['tok_s']:.1f}", f"{r['tok_s'] / fp32:.2f}x", f"{r['ppl']:.2f}",
            f"{r['kl']:.4f}", f"{r['top1']:.3f}", prefill)
    return rows


BENCH = Bench(__doc__, bench_quantize, {
    "group_sizes": Flag([32, 64], "int4 group sizes, a row each", {"type": int, "nargs": "+", "metavar": "G"}),
    "prompt_len": Flag([512], "prompt tokens of the timed decode (the first value)"),
    "new_tokens": Flag(128, "tokens decoded per timed run"),
    "quality_text": QUALITY_TEXT,
    "quality_tokens": QUALITY_TOKENS,
})
