"""A compact Llama-style transformer whose attention runs through one call site shared with the KV cache.

RMSNorm, RoPE (llama3 scaling too), grouped-query attention (K/V stored per KV head, never repeated),
SwiGLU, tied embeddings. Weights are stored as our own state_dict (see scripts/convert_*.py); q/k rows
use the Hugging Face "rotate half" RoPE layout.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import reduce
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.weak import WeakTensorKeyDictionary


class KVFastError(Exception):
    """A user-facing error: bad checkpoint, bad flag, bad config. Printed as one line by the CLIs."""


@dataclass
class ModelArgs:
    dim: int = 576
    n_layers: int = 30
    n_heads: int = 9
    n_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    vocab_size: int = 49152
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_scaling: dict | None = None
    max_seq_len: int = 8192
    tie_embeddings: bool = True

    @classmethod
    def from_json(cls, path: Path) -> ModelArgs:
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise KVFastError(f"checkpoint has no config.json: {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise KVFastError(f"config.json is not valid JSON ({path}): {e}") from None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise KVFastError(f"config.json has unknown fields {unknown} ({path})")
        missing = sorted(known - set(raw) - {"rope_scaling"})
        if missing:
            raise KVFastError(f"config.json lacks fields {missing} ({path})")
        return cls(**raw)

    @property
    def n_groups(self) -> int:
        return self.n_heads // self.n_kv_heads


# Rows up to which a compiled CPU matmul is written as multiply-and-sum reductions (a batch of one-token rows,
# speculate.py's verification). Measured on an AVX-512 CPU (README, "Batched decode"): with int8 / bfloat16
# weights the fused reductions beat F.linear (which converts the whole weight per call) 3-8x at 1-16 rows; with
# fp32 weights they win up to ~8 rows and break even at 16. A batch of one-token rows takes batched_linear's
# blocked GEMM before that where this CPU has one (GEMM_MIN_ROWS).
MAX_REDUCTION_ROWS = 16


def as_reduction(x: Tensor) -> bool:
    """True for a few tokens on CPU inside a compiled graph, where a matrix-vector product is best written as a
    multiply-and-sum: torch's fp32 GEMV streams weights at a fraction of the memory bandwidth there, while
    Inductor turns the multiply-and-sum into one vectorized, parallel reduction that reads each weight once
    (decode is bandwidth-bound) and fuses any dequantization of int8 / int4 weights into it (quantize.py)."""
    rows = x.shape[:-1].numel()  # a SymInt under a dynamic-shape compile (--compile-prefill): F.linear
    return torch.compiler.is_compiling() and x.device.type == "cpu" and isinstance(rows, int) and rows <= MAX_REDUCTION_ROWS


def realized(x: Tensor) -> Tensor:
    """x written to memory once in a compiled graph. Inductor otherwise inlines x's cheap producers (the
    residual add and RMSNorm before a projection) into each reduction that reads it, recomputing them for every
    output row: 8 % of an int8 decode step at one token, half of the step at eight."""
    from torch._inductor import inductor_prims  # noqa: F401  (registers the op; imported when compiling only)

    return torch.ops.prims.inductor_force_stride_order(x, x.stride())


def per_row(x: Tensor, row_product: Callable[[Tensor], Tensor]) -> Tensor:
    """row_product(one row [in]) -> [out], applied to each row of x [..., in]. The rows are unrolled into
    separate reductions over the same weight: Inductor fuses them into one loop that loads (and dequantizes)
    each weight once for all rows, where one broadcast [rows, out, in] reduction redoes that per row."""
    rows = realized(x).reshape(-1, x.shape[-1]).unbind(0)
    y = row_product(rows[0]).unsqueeze(0) if len(rows) == 1 else torch.stack([row_product(r) for r in rows])
    return y.view(*x.shape[:-1], -1)


def gemm_min_rows() -> dict[torch.dtype, int]:
    """Per weight dtype, the sequences from which a compiled CPU decode step (one token per row) leaves the per-row
    reductions for a blocked GEMM (batched_linear), where this CPU has a fast one: oneDNN's packed fp32 GEMM
    wherever oneDNN is built in; the bfloat16 and int8 ones multiply bfloat16 activations, which only CPUs with
    bfloat16 dot products (AVX512-BF16, AMX) run natively. The rows: crossovers measured on an AVX-512 CPU with
    SmolLM2-135M (README, "Batched decode"): the reductions are bound by their fp32 multiply-adds from ~4 rows,
    the GEMM costs about the same at 5 to 8 rows. A verification's tokens of one sequence keep the reductions:
    each must equal its one-token step bit for bit."""
    if not torch.backends.mkldnn.is_available():
        return {}
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        return {torch.float32: 5, torch.bfloat16: 8, torch.int8: 8}
    return {torch.float32: 5}


GEMM_MIN_ROWS = gemm_min_rows()  # read at import: dynamo refuses to trace the CPU queries; set it, then reset dynamo


@torch._dynamo.assume_constant_result  # a constant of the trace (block scope's subgraph reuse can't guard it)
def gemm_rows(dtype: torch.dtype) -> int:
    return GEMM_MIN_ROWS.get(dtype, 1 << 30)


def batch_gemm(x: Tensor, weight: Tensor) -> bool:
    """True for a compiled CPU decode step of at least GEMM_MIN_ROWS[weight dtype] sequences."""
    return (torch.compiler.is_compiling() and x.device.type == "cpu" and x.dim() == 3 and x.shape[1] == 1
            and isinstance(x.shape[0], int) and x.shape[0] >= gemm_rows(weight.dtype))


_packed = WeakTensorKeyDictionary()  # weight -> (its version, its oneDNN-packed copy)


def _batched_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x [..., in] @ weight.T as one blocked GEMM (fp32 / bfloat16 weights): oneDNN on a copy of the weight packed
    into its blocked layout at first use and kept while the weight lives (a second copy of the weights; packed
    again after an in-place change, e.g. load_state_dict). With bfloat16 weights the activations and the output
    are rounded to bfloat16, as in a bfloat16 model."""
    version = None if weight.is_inference() else weight._version  # inference tensors keep no version counter
    entry = _packed.get(weight)
    if entry is None or entry[0] != version:
        entry = _packed[weight] = (version, torch.ops.mkldnn._reorder_linear_weight(weight, x.shape[:-1].numel()))
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]).to(weight.dtype), entry[1], None, "none", [], "")
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


# A plain library registration: torch.library.custom_op's wrapper costs ~20 us more per call inside a compiled
# graph, 2.5 ms of an 8-row step's 121 calls. Meta gives compiling its shapes.
_ops = torch.library.Library("kvfast", "DEF")
_ops.define("batched_linear(Tensor x, Tensor weight) -> Tensor")
_ops.impl("batched_linear", _batched_linear, "CPU")
_ops.impl("batched_linear", lambda x, weight: x.new_empty(*x.shape[:-1], weight.shape[0]), "Meta")


def int8_gemm(x: Tensor, codes: Tensor) -> Tensor:
    """x [..., in] @ codes.T for int8 codes in ATen's int8 x bfloat16 kernel inside a compiled graph (unit scales:
    linear applies the per-row ones in fp32); activations and output rounded to bfloat16."""
    rows = realized(x.reshape(-1, x.shape[-1]).bfloat16())  # its lowering wants stored inputs
    y = torch._weight_int8pack_mm(rows, codes, realized(torch.ones(codes.shape[0], dtype=torch.bfloat16)))
    return y.to(x.dtype).view(*x.shape[:-1], -1)


def linear(x: Tensor, weight: Tensor, scales: Tensor | None = None) -> Tensor:
    """x @ weight.T; for int8 weights (quantize.py) times the per-row `scales`."""
    if batch_gemm(x, weight):
        y = int8_gemm(x, weight) if weight.dtype == torch.int8 else torch.ops.kvfast.batched_linear(x, weight)
    else:
        weight = weight.to(x.dtype)  # no-op for weights in the compute dtype
        y = per_row(x, lambda row: (row * weight).sum(-1)) if as_reduction(x) else F.linear(x, weight)
    return y if scales is None else y * scales


class Linear(nn.Linear):
    """nn.Linear without bias whose forward goes through `linear` (same state_dict layout)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_frequencies(args: ModelArgs) -> Tensor:
    """Inverse frequencies of RoPE, with llama3's piecewise rescaling when the config asks for it."""
    inv_freq = 1.0 / (args.rope_base ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind != "llama3":
        raise KVFastError(f"unsupported rope_scaling type {kind!r} (supported: llama3)")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_at(positions: Tensor, args: ModelArgs) -> tuple[Tensor, Tensor]:
    """cos and sin [*positions.shape, head_dim] at any positions (float64 angles, rounded once; the rotate-half
    layout repeats each frequency)."""
    angles = positions.double().unsqueeze(-1) * rope_frequencies(args).to(positions.device)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def rope_tables(args: ModelArgs) -> tuple[Tensor, Tensor]:
    """cos and sin of shape [max_seq_len, head_dim]."""
    return rope_at(torch.arange(args.max_seq_len), args)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [B, heads, S, D]; cos/sin: [S, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).type_as(x)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, want_probs: bool,
           fuse_one_query: bool = True, channel_blocks: Callable | None = None) -> tuple[Tensor, Tensor | None]:
    """The one attention call site. q: [B, H, S, D]; k, v: [B, H_kv, T, D] (never repeated to H heads).

    mask None means causal attention of S queries over the same S keys (prefill on fresh K/V); otherwise
    mask is [B, H_kv, S, T] bool (True = may attend). When want_probs, the probabilities are computed
    explicitly and returned as [B, H_kv, g, S, T] so a cache policy can score its slots per KV head.

    k, v of shape [B, P, D] are a layer's pool shared by its KV heads (kv.pool): see attend_pool. A compiled
    CPU decode step (one query) takes attend_one_query (attend_pool_one_query) instead of SDPA or matmuls,
    unless the cache says otherwise (4-bit K/V: KVCache.fuse_one_query); it then reads channel_blocks() instead
    of k, v where given (KVCache.channel_blocks: 4-bit K/V as two halves of channels).
    """
    B, H, S, D = q.shape
    if (fuse_one_query and mask is not None and S == 1 and q.device.type == "cpu"
            and torch.compiler.is_compiling()):
        if k.dim() == 3:
            return attend_pool_one_query(q, k, v, mask, want_probs)
        if channel_blocks is not None:
            k, v = channel_blocks()
        return attend_one_query(q, k, v, mask, want_probs)
    if k.dim() == 3:
        return attend_pool(q, k, v, mask, want_probs)
    n_kv = k.shape[1]
    if not want_probs and k.dtype == q.dtype:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), None
        # one mask row per query head: the g heads of a group share their KV head's mask
        mask = mask.repeat_interleave(H // n_kv, dim=1) if H != n_kv else mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), None
    g = H // n_kv
    # the g query heads of a KV head as g * S rows of one matmul: broadcasting k, v over g would copy them. K/V
    # in bfloat16 under float queries (--kv-float bfloat16): both products in bfloat16, as a bfloat16 model's
    # attention (fp32 accumulation, bfloat16 scores and output; softmax in fp32), 2.5x an fp32 matmul's speed
    # over 4096 slots where the CPU has bfloat16 dot products (README); attend_one_query rounds alike
    qg = q.to(k.dtype).reshape(B, n_kv, g * S, D)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float().view(B, n_kv, g, S, -1) * (1.0 / math.sqrt(D))
    if mask is None:
        mask = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    else:
        mask = mask.unsqueeze(2)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    out = torch.matmul(probs.to(v.dtype).view(B, n_kv, g * S, -1), v).to(q.dtype)
    return out.view(B, H, S, D), probs


class Codes(NamedTuple):
    """Channels of quantized K or V that attend_one_query reads without dequantizing them first: the values are
    codes * scale + zero, one scale and zero point per token ([B, H_kv, T, 1]) for these channels. packed: two
    4-bit codes per byte, channel j in the low nibble and j + w in the high one (kv.quant.pack), read in one
    pass over the bytes."""

    codes: Tensor  # uint8 [B, H_kv, T, w]
    scale: Tensor
    zero: Tensor
    packed: bool = False

    @property
    def width(self) -> int:
        return self.codes.shape[-1] * (2 if self.packed else 1)

    def channels(self, dtype: torch.dtype) -> tuple[Tensor, ...]:
        """The codes as numbers, [B, H_kv, 1, T, w] each: one tensor, or the low and the high nibbles."""
        c = self.codes.unsqueeze(2)
        return ((c & 15).to(dtype), (c >> 4).to(dtype)) if self.packed else (c.to(dtype),)


def attend_one_query(q: Tensor, k: Tensor | tuple, v: Tensor | tuple, mask: Tensor,
                     want_probs: bool = False) -> tuple[Tensor, Tensor | None]:
    """A decode step's attention (one query per row) as multiply-and-sum reductions, inside a compiled CPU graph.
    SDPA's CPU kernel (and a matmul's, when a policy wants the probabilities) has a fixed cost per call that
    dwarfs one query's work (3 KV heads x 512 keys: ~90 us for ~1 MB of K/V) and splits the step's graph at
    every layer; as reductions Inductor fuses the attention into the layer's kernels (int8 decode step at 512
    tokens, whole-step graph: 11.4 -> 9.1 ms; README). probs as attend returns them.

    k and v may come as tuples of channel blocks (concatenated along the last dim they are k and v: 4-bit K/V's
    halves, KVCache.channel_blocks), each block reduced apart, so no reduction reads a concatenation. A block
    given as Codes is read as its codes, its scale and zero point applied per token outside the reductions:
    q . (c s + z) = s (q . c) + z sum(q), and sum_t p (c s + z) = sum_t (p s) c + sum_t p z, so each code is
    converted and multiplied once per query head instead of dequantized once per query head."""
    B, H, _, D = q.shape
    k_blocks, v_blocks = (x if isinstance(x, tuple) and not isinstance(x, Codes) else (x,) for x in (k, v))
    widths = [b.width if isinstance(b, Codes) else b.shape[-1] for b in k_blocks]
    n_kv = mask.shape[1]
    # bfloat16 K/V under float queries: round where attend's bfloat16 matmuls do (the query, the scores, the
    # probabilities, the output), so a (K + 1)-query verification agrees with the one-query steps it replaces
    low = k_blocks[0].dtype if not isinstance(k_blocks[0], Codes) and k_blocks[0].dtype != q.dtype else None
    rounded = (lambda x: x.to(low).to(x.dtype)) if low else (lambda x: x)
    q_blocks = rounded(q).view(B, n_kv, H // n_kv, 1, D).split(widths, dim=-1)
    scores = reduce(torch.add, [block_scores(qb, kb) for qb, kb in zip(q_blocks, k_blocks)])
    scores = rounded(scores).float() * (1.0 / math.sqrt(D))
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # [B, n_kv, g, T]
    outs = [block_values(rounded(probs), vb, q.dtype) for vb in v_blocks]
    out = rounded(outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)).view(B, H, 1, D)
    return out, probs.unsqueeze(3) if want_probs else None


def block_scores(q: Tensor, k: Tensor | Codes) -> Tensor:
    """q [B, n_kv, g, 1, w] . every key's channels [B, n_kv, T, w] -> [B, n_kv, g, T]."""
    if not isinstance(k, Codes):
        return (q * k.unsqueeze(2).to(q.dtype)).sum(-1)
    # packed: one reduction over the bytes for both nibbles (as two reductions, 30 layers at 4096 tokens took
    # 5.89 instead of 5.01 ms)
    channels = k.channels(q.dtype)
    dot = reduce(torch.add, [qc * c for qc, c in zip(q.chunk(len(channels), -1), channels)]).sum(-1)
    return dot * k.scale.squeeze(-1).unsqueeze(2) + k.zero.squeeze(-1).unsqueeze(2) * q.sum(-1)


def block_values(probs: Tensor, v: Tensor | Codes, dtype: torch.dtype) -> Tensor:
    """probs [B, n_kv, g, T] times every value's channels [B, n_kv, T, w] -> [B, n_kv, g, w]."""
    if not isinstance(v, Codes):
        return (probs.to(dtype).unsqueeze(-1) * v.unsqueeze(2).to(dtype)).sum(-2)
    scaled = (probs * v.scale.squeeze(-1).unsqueeze(2)).unsqueeze(-1)
    out = torch.cat([(scaled * c).sum(-2) for c in v.channels(torch.float32)], dim=-1)
    return (out + (probs * v.zero.squeeze(-1).unsqueeze(2)).sum(-1, keepdim=True)).to(dtype)


def attend_pool_one_query(q: Tensor, k: Tensor, v: Tensor, mask: Tensor,
                          want_probs: bool = False) -> tuple[Tensor, Tensor | None]:
    """attend_pool for one query per row inside a compiled CPU graph: each slot is scored only by the g query
    heads of the KV head that owns it (their queries gathered by the slot's owner, a third of the products of
    every query head scoring every slot with H_kv = 3), fused with the masked softmax, the scores laid out
    [g, P] so the softmax vectorizes along the slots. The probabilities times V stay a matmul (halves_product):
    as a reduction Inductor would stream the whole pool once per 8 output channels of every query head."""
    B, H, _, D = q.shape
    n_kv, P = mask.shape[1], k.shape[1]
    g = H // n_kv
    mine = mask[:, :, 0]  # [B, n_kv, P]
    owner = realized((mine * torch.arange(n_kv, device=q.device).view(1, n_kv, 1)).sum(1))  # [B, P]; 0 if empty
    rows = torch.arange(B, device=q.device).view(B, 1, 1)
    heads = torch.arange(g, device=q.device).view(1, g, 1)
    q_slot = q.view(B, n_kv, g, D).transpose(1, 2)[rows, heads, owner.unsqueeze(1)]  # [B, g, P, D]
    scores = (q_slot * k.unsqueeze(1)).sum(-1) * (1.0 / math.sqrt(D))  # [B, g, P]
    probs = torch.softmax(scores.float().unsqueeze(1).masked_fill(~mine.unsqueeze(2), float("-inf")), dim=-1)
    out = halves_product(probs.type_as(v).view(B, H, P), v)
    return out.view(B, H, 1, D), probs.unsqueeze(3) if want_probs else None


def halves_product(probs: Tensor, v: Tensor) -> Tensor:
    """probs [B, H, P] @ v [B, P, D]. One row as one bmm over the two halves of v's channels: torch runs a
    single small matmul on one thread, a batch of two on two (30 layers' pool attention at 3267 slots: 59 -> 44 us
    per layer); several rows are already a batch."""
    B, P, D = v.shape
    if B > 1:
        return torch.bmm(probs, v)
    halves = v.view(P, 2, D // 2).transpose(0, 1)  # [2, P, D/2], no copy
    return torch.bmm(probs.expand(2, *probs.shape[1:]), halves).transpose(0, 1).reshape(1, -1, D)


def attend_pool(q: Tensor, k: Tensor, v: Tensor, mask: Tensor,
                want_probs: bool) -> tuple[Tensor, Tensor | None]:
    """Attention over a per-layer pool (DESIGN.md, "Per-head budgets"): k, v [B, P, D] hold the slots of
    every KV head; mask [B, H_kv, S, P] says which slots KV head h owns (and holds a token), for each of its g
    query heads.

    All H query heads score every slot in one product, so the pool is read once whatever the split between
    heads (the extra H_kv-fold flops are cheap next to the bytes on a bandwidth-bound step); the mask keeps
    each query head to its own KV head's slots. probs [B, H_kv, g, S, P] are exactly 0 outside them."""
    B, H, S, D = q.shape
    n_kv, P = mask.shape[1], k.shape[1]
    g = H // n_kv
    scores = torch.matmul(q.reshape(B, H * S, D), k.transpose(1, 2)).view(B, n_kv, g, S, P)
    scores = scores * (1.0 / math.sqrt(D))
    probs = torch.softmax(scores.float().masked_fill(~mask.unsqueeze(2), float("-inf")), dim=-1)
    out = torch.matmul(probs.type_as(v).view(B, H * S, P), v)
    return out.view(B, H, S, D), probs if want_probs else None


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        qkv_rows = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = Linear(args.dim, qkv_rows)
        self.wo = Linear(args.n_heads * args.head_dim, args.dim)
        self.kv_cache = None  # set by Transformer.setup_caches

    def project(self, x: Tensor, cos: Tensor | None, sin: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v [B, heads, S, D], q and k rotated at cos / sin (left unrotated when cos is None)."""
        B, S, _ = x.shape
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(B, S, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if cos is None:
            return q, k, v
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def output(self, out: Tensor) -> Tensor:
        B, _, S, _ = out.shape
        return self.wo(out.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim))

    def forward(self, x: Tensor, cos: Tensor | None, sin: Tensor | None, input_pos: Tensor | None,
                recall: bool = False) -> Tensor:
        """cos None: the cache applies RoPE at its own positions (--pos-shift: ranks among the cached tokens)."""
        q, k, v = self.project(x, cos, sin)
        cache = self.kv_cache
        if input_pos is None:  # prefill: causal attention on the fresh K/V, then the cache keeps what it can
            out, _ = attend(q, k, v, None, want_probs=False)
            if cache is not None:
                cache.prefill(q, k, v)
            return self.output(out)
        if recall:  # tiers: bring back the evicted pages this query needs (kv.tiers), then attend as always
            cache.recall(q)
        k_all, v_all, mask = cache.update(input_pos, k, v)
        if cos is None:
            q = cache.rotate_query(q)
        out, probs = attend(q, k_all, v_all, mask, want_probs=cache.needs_attention,  # wrappers: fused
                            fuse_one_query=getattr(cache, "fuse_one_query", True),
                            channel_blocks=getattr(cache, "channel_blocks", None))
        if probs is not None:
            cache.observe(probs)
        return self.output(out)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w13 = Linear(args.dim, 2 * args.intermediate_size)
        self.w2 = Linear(args.intermediate_size, args.dim)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: Tensor, cos: Tensor | None, sin: Tensor | None, input_pos: Tensor | None,
                recall: bool = False) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, input_pos, recall)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = None if args.tie_embeddings else Linear(args.dim, args.vocab_size)
        cos, sin = rope_tables(args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def caches(self) -> list:
        return [layer.attention.kv_cache for layer in self.layers]

    def setup_caches(self, make_cache) -> None:
        """make_cache(layer_index) -> a cache policy module; each layer gets its own buffers."""
        for i, layer in enumerate(self.layers):
            layer.attention.kv_cache = make_cache(i)

    def forward(self, idx: Tensor, input_pos: Tensor | None = None, all_logits: bool = False,
                recall: bool = False, run_block: Callable | None = None) -> Tensor:
        """idx: [B, S]. input_pos None = prefill of a fresh sequence at positions 0..S-1 (returns the last
        position's logits, [B, 1, V], unless all_logits); else one decode token at input_pos ([1]), which
        first recalls evicted tokens into the caches if `recall` (a tiered cache, kv.tiers), or a chunk of
        tokens at consecutive positions input_pos [S] (the full cache only: speculate.py's verification)."""
        h = self.hidden(idx, input_pos, recall, run_block)
        return self.logits(h if all_logits else h[:, -1:])

    def hidden(self, idx: Tensor, input_pos: Tensor | None = None, recall: bool = False,
               run_block: Callable | None = None) -> Tensor:
        """The final hidden states; run_block(layer, x, cos, sin, input_pos, recall) runs each layer instead of
        calling it (generate.py's --compile-scope block: one nested compile region for every layer)."""
        if input_pos is None:
            cos, sin = self.rope_cos[: idx.shape[1]], self.rope_sin[: idx.shape[1]]
        elif getattr(self.layers[0].attention.kv_cache, "pos_shift", False):
            cos = sin = None  # StreamingLLM's positions: the caches rotate q and k at ranks (kv.slots)
        else:
            cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]
        x = self.tok_embeddings(idx).to(self.norm.weight.dtype)  # bfloat16 rows (quantize.py) to the compute dtype
        for cache in self.caches:  # fastgen keeps tokens by their class (kv.fastgen): it sees the ids fed
            if hasattr(cache, "see_tokens"):
                cache.see_tokens(idx)
        for layer in self.layers:
            x = run_block(layer, x, cos, sin, input_pos, recall) if run_block else layer(x, cos, sin, input_pos, recall)
        return self.norm(x)

    def logits(self, h: Tensor) -> Tensor:
        head = self.tok_embeddings if self.output is None else self.output
        return linear(h, head.weight, getattr(head, "scales", None)).float()

    def weight_bytes(self) -> int:
        """Bytes of the weights one decode step reads (quantized weights are buffers; rope tables are not)."""
        tensors = [*self.parameters(), *(b for n, b in self.named_buffers() if not n.startswith("rope_")
                                         and ".kv_cache." not in n)]
        return sum(t.numel() * t.element_size() for t in tensors)

    @classmethod
    def from_checkpoint(cls, path: Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Transformer:
        """Load `<dir>/config.json` plus `model.safetensors` or `model.pth`; path may be the folder or the file."""
        path = Path(path)
        if not path.exists():
            raise KVFastError(f"checkpoint not found: {path}")
        folder, weights = (path, None) if path.is_dir() else (path.parent, path)
        if weights is None:
            candidates = [folder / n for n in ("model.safetensors", "model.pth") if (folder / n).exists()]
            if not candidates:
                raise KVFastError(f"no model.safetensors or model.pth in {folder}")
            weights = candidates[0]
        args = ModelArgs.from_json(folder / "config.json")
        state = load_weights(weights)
        with torch.device("meta"):
            model = cls(args)
        embedding = state.get("tok_embeddings.weight")
        if "tok_embeddings.scales" in state or getattr(embedding, "dtype", None) == torch.bfloat16:  # quantize.py
            from quantize import prepare_quantized

            prepare_quantized(model, state, weights)
        check_state_dict(model, state, weights)
        model.load_state_dict(state, assign=True, strict=False)
        cos, sin = rope_tables(args)
        model.rope_cos, model.rope_sin = cos, sin
        return model.to(device=device, dtype=dtype).eval()


def load_weights(path: Path) -> dict[str, Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        return torch.load(str(path), mmap=True, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 -- safetensors, pickle and zip errors mean the same to the user
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise KVFastError(f"cannot read weights {path}: corrupt or truncated file ({reason})") from None


def check_state_dict(model: nn.Module, state: dict[str, Any], source: Path) -> None:
    """One clear line instead of torch's multi-line load_state_dict report."""
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        parts = ([f"missing {missing[:3]}"] if missing else []) + ([f"unexpected {unexpected[:3]}"] if unexpected else [])
        raise KVFastError(f"config.json does not match the weights in {source}: " + ", ".join(parts))
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise KVFastError(
                f"config.json does not match the weights in {source}: {name} has shape "
                f"{tuple(state[name].shape)}, config expects {shape}"
            )
