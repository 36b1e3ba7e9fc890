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
int4 about a fifth, though on a CPU unpacking int4 costs more compute than it saves in bytes (int8 decodes
fastest here; see the README). Inside the compiled decode step the dequantization is part of model.linear's
multiply-and-sum (Inductor fuses it into the reduction), so no fp32 copy of a weight is ever materialized;
prefill and eager decoding dequantize a layer's weight on the fly.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model import KVFastError, Linear, Transformer, as_reduction, linear, per_row

MODES = ("int8", "int4", "bf16")
GROUP_SIZES = (32, 64, 128, 256)


# ---- quantizers ---------------------------------------------------------------------------------------------
def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """[out, in] float -> int8 codes [out, in] and scales [out]: weight ~ codes * scales[:, None]."""
    w = weight.float()
    scales = w.abs().amax(-1).clamp(min=1e-12) / 127
    codes = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return codes, scales


def quantize_int4(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """[out, in] float -> packed codes uint8 [out, in / 2] (column j in the low nibble, j + in / 2 in the high),
    scales and offsets [out, in / group_size]: weight ~ codes * scale + offset within each group of columns."""
    out, n_in = weight.shape
    w = weight.float().view(out, n_in // group_size, group_size)
    low, high = w.amin(-1), w.amax(-1)
    scales = ((high - low) / 15).clamp(min=1e-12)
    codes = ((w - low[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.uint8).view(out, n_in)
    return codes[:, : n_in // 2] | (codes[:, n_in // 2 :] << 4), scales, low


def dequantize_int4(packed: Tensor, scales: Tensor, offsets: Tensor) -> Tensor:
    out, n_groups = scales.shape
    codes = torch.cat([packed & 15, packed >> 4], 1).view(out, n_groups, -1)
    return (codes.to(scales.dtype) * scales[..., None] + offsets[..., None]).view(out, -1)


# ---- modules that replace the float ones (same names, so state_dict keys stay readable) -----------------------
class Int8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(out_features))

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.scales)


class Int8Embedding(nn.Module):
    """Embedding rows as int8 with a scale per row; the tied LM head reads them through model.linear."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(num_embeddings, embedding_dim, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(num_embeddings))

    def forward(self, idx: Tensor) -> Tensor:
        return F.embedding(idx, self.weight).to(self.scales.dtype) * self.scales[idx].unsqueeze(-1)


class BF16Storage(nn.Module):
    """A bfloat16 weight buffer that model.to(dtype) leaves in bfloat16 (the compute dtype stays the caller's)."""

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self.weight = self.weight.to(torch.bfloat16)  # exact: the values were bfloat16
        return self


class BF16Linear(BF16Storage):
    """Weights stored in bfloat16, computed in the activations' dtype (model.linear converts inside its fused
    reduction): half of fp32's bytes, for CPUs where reading int8 weights costs more than it saves (bench.py
    --section quantize records which)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.bfloat16))

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight)


class BF16Embedding(BF16Storage):
    """Embedding rows in bfloat16; the tied LM head reads them through model.linear."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(num_embeddings, embedding_dim, dtype=torch.bfloat16))

    def forward(self, idx: Tensor) -> Tensor:
        return F.embedding(idx, self.weight)


class Int4Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, group_size: int):
        super().__init__()
        n_groups = in_features // group_size
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.ones(out_features, n_groups))
        self.register_buffer("offsets", torch.zeros(out_features, n_groups))

    def forward(self, x: Tensor) -> Tensor:
        if not as_reduction(x):
            return F.linear(x, dequantize_int4(self.weight, self.scales, self.offsets).to(x.dtype))
        # sum_j x_j (q_j s + o) = sum_j x_j q_j s + o * (x's group sum). The nibbles are split with float
        # arithmetic and each half of the row meets a contiguous half of x: both keep Inductor's reduction
        # vectorized (uint8 bit operations and interleaved columns did not: 3-20x slower here). It is fastest
        # when a group never straddles the two halves (in / 2 a multiple of the group size).
        out, n_groups = self.scales.shape
        half = self.weight.shape[1]
        codes = self.weight.to(x.dtype)
        high = torch.floor(codes * (1 / 16))
        low = codes - 16 * high
        scales = self.scales.view(out, n_groups, 1).expand(out, n_groups, 2 * half // n_groups).reshape(out, -1)

        def row_product(row: Tensor) -> Tensor:
            y = (row[:half] * low * scales[:, :half] + row[half:] * high * scales[:, half:]).sum(-1)
            return y + (self.offsets * row.view(n_groups, -1).sum(-1)).sum(-1)

        return per_row(x, row_product)


# ---- whole model ------------------------------------------------------------------------------------------------
def linears(model: Transformer) -> list[tuple[nn.Module, str, Linear]]:
    """(parent, attribute, layer) for every linear layer of the transformer blocks."""
    out = []
    for block in model.layers:
        for parent, name in ((block.attention, "wqkv"), (block.attention, "wo"),
                             (block.feed_forward, "w13"), (block.feed_forward, "w2")):
            out.append((parent, name, getattr(parent, name)))
    return out


def empty_quantized(lin: Linear, mode: str, group_size: int) -> nn.Module:
    if mode == "int8":
        return Int8Linear(lin.in_features, lin.out_features)
    if mode == "bf16":
        return BF16Linear(lin.in_features, lin.out_features)
    return Int4Linear(lin.in_features, lin.out_features, group_size)


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


def prepare_quantized(model: Transformer, state: dict[str, Tensor], source: Path) -> None:
    """Swap the (meta) float modules of `model` for the quantized ones a quantize.py state dict holds."""
    wqkv = state.get("layers.0.attention.wqkv.scales")
    bf16 = state["tok_embeddings.weight"].dtype == torch.bfloat16
    if not bf16 and (wqkv is None or wqkv.dim() not in (1, 2)):
        raise KVFastError(f"{source}: not a checkpoint written by quantize.py (quantized embeddings only)")
    mode = "bf16" if bf16 else "int8" if wqkv.dim() == 1 else "int4"
    group_size = model.args.dim // wqkv.shape[1] if mode == "int4" else 0
    for parent, name, lin in linears(model):
        setattr(parent, name, empty_quantized(lin, mode, group_size))
    embedding, head = (BF16Embedding, BF16Linear) if bf16 else (Int8Embedding, Int8Linear)
    model.tok_embeddings = embedding(model.args.vocab_size, model.args.dim)
    if model.output is not None:
        model.output = head(model.args.dim, model.args.vocab_size)


def output_name(mode: str, group_size: int) -> str:
    return f"model_{mode}.pth" if mode != "int4" else f"model_int4-g{group_size}.pth"


def main(argv: list[str] | None = None) -> Path:
    from generate import DEFAULT_CHECKPOINT, ArgumentParser, resolve_checkpoint

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
    from generate import run_cli

    sys.exit(run_cli(main))
