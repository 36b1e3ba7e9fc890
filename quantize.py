"""Weight-only int8 / int4 quantization of a checkpoint (gpt-fast's schemes), and its CLI.

    python quantize.py --mode int8                  # -> checkpoints/SmolLM2-135M-Instruct/model_int8.pth
    python quantize.py --mode int4                  # -> checkpoints/SmolLM2-135M-Instruct/model_int4-g32.pth
    python generate.py --checkpoint checkpoints/SmolLM2-135M-Instruct/model_int8.pth --compile ...

int8: symmetric, one scale per output row, for every linear layer and the embedding table (which is also the
tied LM head). int4: the transformer blocks' linear layers, asymmetric min-max per group of --group-size input
columns (scale and offset per group), two codes per byte; the embedding / LM head stays int8, as the most
sensitive layer. Activations, norms and the KV cache stay in the compute dtype. The default group of 32 is
also GGUF Q4_0/Q4_1's block: weights converted from such a file (the default model) are already on an int4
grid of 32 columns, so int4 with --group-size 32 loses almost nothing on them (bench.py --section quantize).

Decoding reads every weight once per token, so it is memory-bound: int8 reads a quarter of fp32's bytes and
int4 about a fifth. Inside the compiled decode step a CPU with AVX2 or AVX-512 VNNI multiplies the codes as
integers (kernels_cpu.cpp, llama.cpp's scheme: each activation row quantized per block of 32 to int8, int32 dot
products, the block scales applied in fp32), reading quantize.py's layout in place; elsewhere Inductor fuses the
dequantization into kernels.linear's multiply-and-sum. No fp32 copy of a weight is ever materialized; prefill
and eager decoding dequantize a layer's weight on the fly (docs/speed.md, "Integer dot products").

The layers that hold quantized weights are model.py's (from_checkpoint loads a quantized checkpoint without
this module), their kernels kernels.py's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import Tensor

from cli import DEFAULT_CHECKPOINT, ArgumentParser, resolve_checkpoint, run_cli
from kernels import dequantize_int4  # noqa: F401 -- the inverse of quantize_int4, as quantize.dequantize_int4
from model import (
    BF16Embedding,
    BF16Linear,
    Int4Linear,  # noqa: F401 -- quantize.py's layers, under quantize too
    Int8Embedding,
    Int8Linear,
    KVFastError,
    Transformer,
    empty_quantized,
    linears,
)

MODES = ("int8", "int4", "bf16")
GROUP_SIZES = (32, 64, 128, 256)


# ---- quantizers ---------------------------------------------------------------------------------------------
def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """[out, in] float -> int8 codes [out, in] and scales [out]: weight ~ codes * scales[:, None]."""
    w = weight.float()
    scales = w.abs().amax(-1).clamp(min=1e-12) / 127
    codes = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return codes, scales


def float16_bound(x: Tensor, up: bool) -> Tensor:
    """x (fp32) rounded to a float16 value at or above it (up) or at or below it, returned as fp32; values beyond
    float16's range stay as they are."""
    h = x.half()
    past = h.float() < x if up else h.float() > x
    h = torch.where(past, torch.nextafter(h, torch.full_like(h, float("inf") if up else float("-inf"))), h)
    return torch.where(h.isinf(), x, h.float())


def quantize_int4(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """[out, in] float -> packed codes uint8 [out, in / 2] (column j in the low nibble, j + in / 2 in the high),
    scales and offsets [out, in / group_size]: weight ~ codes * scale + offset within each group of columns.
    Scales and offsets are fp32 values that float16 holds exactly (as Q4_1's): the AVX-512 kernels' tiles keep
    them in 16 bits (kernels_cpu.retile), a sixth of an int4 step's bytes. Offsets round down and scales up, so
    offset + 15 * scale still spans each group."""
    out, n_in = weight.shape
    w = weight.float().view(out, n_in // group_size, group_size)
    low = float16_bound(w.amin(-1), up=False)
    scales = float16_bound(((w.amax(-1) - low) / 15).clamp(min=2 ** -24), up=True)  # 2^-24: float16's least
    codes = ((w - low[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.uint8).view(out, n_in)
    return codes[:, : n_in // 2] | (codes[:, n_in // 2 :] << 4), scales, low


# ---- whole model ------------------------------------------------------------------------------------------------
def check_group_size(model: Transformer, group_size: int) -> None:
    bad = sorted({lin.in_features for _, _, lin in linears(model) if lin.in_features % group_size})
    if bad:
        raise KVFastError(f"--group-size {group_size} does not divide the input width {bad[0]} of the model's "
                          f"linear layers; choose one of {[g for g in GROUP_SIZES if not bad[0] % g]}")


@torch.no_grad()
def quantize_model(model: Transformer, mode: str, group_size: int = 32) -> Transformer:
    """Replace the model's float weights by quantized ones, in place (weights must be loaded, not meta)."""
    if mode not in MODES:
        raise KVFastError(f"unknown quantization mode {mode!r} (choose from {', '.join(MODES)})")
    if mode == "int4":
        check_group_size(model, group_size)
    dtype = model.norm.weight.dtype
    for parent, name, lin in linears(model):
        new = empty_quantized(lin, mode, group_size)
        if mode == "int8":
            new.weight, new.scales = quantize_int8(lin.weight)
        elif mode == "bf16":
            new.weight = lin.weight.to(torch.bfloat16)
        else:
            new.weight, new.scales, new.offsets = quantize_int4(lin.weight, group_size)
        if lin.bias is not None:  # qwen2's q / k / v biases stay in the compute dtype
            new.bias = lin.bias.detach().clone()
        setattr(parent, name, new.to(lin.weight.device, dtype))
    heads = [("tok_embeddings", model.tok_embeddings)] + ([("output", model.output)] if model.output else [])
    for name, head in heads:
        rows, cols = head.weight.shape
        if mode == "bf16":
            new = BF16Embedding(rows, cols) if name == "tok_embeddings" else BF16Linear(cols, rows)
            new.weight = head.weight.to(torch.bfloat16)
            setattr(model, name, new.to(head.weight.device))
            continue
        new = Int8Embedding(rows, cols) if name == "tok_embeddings" else Int8Linear(cols, rows)
        new.weight, new.scales = quantize_int8(head.weight)
        setattr(model, name, new.to(head.weight.device, dtype))
    return model


def quantized_copy(model: Transformer, weights: str) -> Transformer:
    """A copy of the float model with weights "fp32" (the model itself), "int8" or "int4-gN" (bench.py)."""
    if weights == "fp32":
        return model
    import copy

    mode, _, group = weights.partition("-g")
    return quantize_model(copy.deepcopy(model), mode, int(group or 32))


def output_name(mode: str, group_size: int) -> str:
    return f"model_{mode}.pth" if mode != "int4" else f"model_int4-g{group_size}.pth"


def main(argv: list[str] | None = None) -> Path:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT,
                   help="float checkpoint folder (or its weights file) to quantize")
    p.add_argument("--mode", choices=MODES, default="int8",
                   help="int8: per-row scales; int4: per-group; bf16: bfloat16 storage, compute in fp32 (the "
                        "fastest on CPUs whose int8 conversion is slow: see bench.py --section quantize)")
    p.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=32,
                   help="int4: input columns that share a scale and offset")
    p.add_argument("--out", type=Path, help="output file (default: <checkpoint folder>/model_int8.pth or "
                                            "model_int4-g<group size>.pth)")
    args = p.parse_args(argv)
    checkpoint = resolve_checkpoint(args.checkpoint)
    model = Transformer.from_checkpoint(checkpoint)
    if isinstance(model.tok_embeddings, (Int8Embedding, BF16Embedding)):
        raise KVFastError(f"{checkpoint} is already quantized; quantize the float checkpoint")
    before = model.weight_bytes()
    quantize_model(model, args.mode, args.group_size)
    folder = checkpoint if checkpoint.is_dir() else checkpoint.parent
    out = args.out or folder / output_name(args.mode, args.group_size)
    if out.parent.resolve() != folder.resolve():
        raise KVFastError(f"--out must lie in the checkpoint folder {folder} (it holds config.json and the tokenizer)")
    if out.name in ("model.safetensors", "model.pth") or out.suffix != ".pth":
        raise KVFastError(f"--out {out.name}: give a new .pth name (model.safetensors / model.pth are the float "
                          "weights a folder loads by default)")
    try:
        torch.save(model.state_dict(), out)
    except (OSError, RuntimeError) as e:
        raise KVFastError(f"cannot write {out}: {str(e).splitlines()[0]}") from None
    print(f"wrote {out}: {args.mode}{f' (groups of {args.group_size})' if args.mode == 'int4' else ''}, "
          f"weights {before / 1e6:.1f} MB -> {model.weight_bytes() / 1e6:.1f} MB")
    return out


if __name__ == "__main__":
    sys.exit(run_cli(main))
