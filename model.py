"""A compact Llama-style transformer whose attention runs through one call site shared with the KV cache.

RMSNorm, RoPE (llama3 scaling too), grouped-query attention (K/V stored per KV head, never repeated),
SwiGLU, tied or separate embeddings; qwen2 checkpoints add biases to the q / k / v projections
(ModelArgs.attention_bias). Weights are stored as our own state_dict (see scripts/convert_*.py); q/k rows
use the Hugging Face "rotate half" RoPE layout.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attention import attend, prompt_attention
from kernels import KVFastError, cpu, dequantize_int4, int4_linear, integer_products, linear
from kernels_cpu import int4_rows, tiled_int8_rows, untile_int8
from kv.contract import AttentionCache


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
    attention_bias: bool = False  # qwen2: biases on the q / k / v rows of wqkv

    # fields a config.json may omit: checkpoints written before they existed load with the defaults
    OPTIONAL = ("rope_scaling", "attention_bias")

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
        missing = sorted(known - set(raw) - set(cls.OPTIONAL))
        if missing:
            raise KVFastError(f"config.json lacks fields {missing} ({path})")
        return cls(**raw)

    @property
    def n_groups(self) -> int:
        return self.n_heads // self.n_kv_heads


def add_bias(y: Tensor, bias: Tensor | None) -> Tensor:
    """y + bias after any of kernels.linear's paths (a float bias, also beside quantized weights)."""
    return y if bias is None else y + bias


class PromptWeight:
    """A linear layer whose weight a long prompt's query blocks read as one dense copy in their dtype
    (TransformerBlock.prefill sets prompt_weight for the layer's blocks): converting or dequantizing it once per
    layer, not once per block, took 8 of 45 s off a 16k-token prefill of Qwen2.5-0.5B with int4 weights."""

    prompt_weight: Tensor | None = None

    def dense_weight(self, dtype: torch.dtype) -> Tensor:
        """The weight as a [out, in] float tensor in dtype (a plain tensor: a Parameter would be registered)."""
        return self.weight.detach().to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        if self.prompt_weight is not None:
            return add_bias(F.linear(x, self.prompt_weight), self.bias)
        return self.product(x)

    def product(self, x: Tensor) -> Tensor:
        """x @ weight.T + bias through the layer's own kernel (kernels.linear / int4_linear)."""
        raise NotImplementedError


class Linear(PromptWeight, nn.Linear):
    """nn.Linear whose forward goes through `linear` (same state_dict layout); bias only where asked."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)

    def product(self, x: Tensor) -> Tensor:
        return add_bias(linear(x, self.weight), self.bias)


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
    """x: [B, heads, S, D]; cos/sin: [S, D]. The rotate-half form x cos + [-x2, x1] sin in fp32, rounded once to
    x's dtype. Inductor fuses the concatenated form into the decode step's kernels; eager torch (a prompt's
    query blocks) makes a pass per op over a large q, so there it is two in-place multiply-adds on the halves
    (8k-token q: 100 -> 16 ms; in a compiled step that form cost a quarter of the 4k-token decode speed)."""
    half = x.shape[-1] // 2
    if torch.compiler.is_compiling():
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x.float() * cos + rotated.float() * sin).type_as(x)
    x32 = x.float()
    out = x32 * cos
    out[..., :half].addcmul_(x32[..., half:], sin[..., :half], value=-1)
    out[..., half:].addcmul_(x32[..., :half], sin[..., half:])
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        qkv_rows = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = Linear(args.dim, qkv_rows, bias=args.attention_bias)
        self.wo = Linear(args.n_heads * args.head_dim, args.dim)
        self.kv_cache: AttentionCache | None = None  # set by Transformer.setup_caches

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
        """The one attention call site of a decode step (a prompt goes through TransformerBlock.prefill); the cache
        is read only through kv.contract.AttentionCache. cos None: the cache applies RoPE at its own positions
        (pos_shift: ranks among the cached tokens)."""
        q, k, v = self.project(x, cos, sin)
        cache = self.kv_cache
        if recall:  # tiers: bring back the evicted pages this query needs (kv.tiers), then attend as always
            cache.recall(q)
        k_all, v_all, mask = cache.update(input_pos, k, v)
        if cos is None:
            q = cache.rotate_query(q)
        out, probs = attend(q, k_all, v_all, mask, want_probs=cache.needs_attention,
                            fuse_one_query=cache.fuse_one_query, channel_blocks=cache.channel_blocks,
                            layout=cache.layout)
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
        return self.w2(F.silu(gate).mul_(up))


def prompt_work_dtype(dtype: torch.dtype | None, x_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a prompt's activations and float products for --prefill-dtype's `dtype` (None: x's). int8
    multiplies the int8 / int4 codes in integers (kernels.integer_products("prompt")) and the rest in bfloat16
    where this CPU multiplies it in hardware (its attention, float weights' products), else in x's dtype."""
    if dtype == torch.int8:
        return torch.bfloat16 if cpu().bf16_dot else x_dtype
    return dtype or x_dtype


@contextmanager
def dense_for_prompt(layers: tuple[nn.Module, ...], dtype: torch.dtype) -> Iterator[None]:
    """While a prompt's query blocks run, each of these linear layers reads one dense copy of its weight in dtype
    (PromptWeight), made here once."""
    for layer in layers:
        layer.prompt_weight = layer.dense_weight(dtype)
    try:
        yield
    finally:
        for layer in layers:  # back to the class's None: a compiled step's guards saw that attribute
            del layer.prompt_weight


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

    def prefill(self, x: Tensor, cos: Tensor, sin: Tensor, chunk: int | None = None,
                dtype: torch.dtype | None = None) -> Tensor:
        """The block over a whole prompt x [B, S, dim] at positions 0..S-1 (cos, sin [S, D]), in query blocks of
        `chunk` rows (None: one block, as forward()). The layer's q, k, v are projected block by block; each block
        attends causally to the keys up to its own (attention.prompt_attention) and runs the output projection and
        the FFN; then the cache gets the whole prompt at once, so its prompt compression and statistics see all
        of it (kv.prompt computes them in query blocks). Memory: x and the layer's q, k, v
        grow with S; the blocks' activations ([chunk, intermediate]) and attention do not, and nothing is
        S x S. dtype: the products' precision (bfloat16: AMX / AVX512-BF16 GEMMs and attention; int8: the integer
        GEMM, prompt_work_dtype), q, k and v are rounded to the activations' dtype; the residual stream and the
        cache stay in x's dtype. x is overwritten in place."""
        attn, ffn, S = self.attention, self.feed_forward, x.shape[1]
        work = prompt_work_dtype(dtype, x.dtype)
        blocks = [(0, S)] if chunk is None or chunk >= S else [(a, min(S, a + chunk)) for a in range(0, S, chunk)]
        integer = dtype == torch.int8  # the integer GEMM reads the codes as stored in every block
        dense = partial(dense_for_prompt, dtype=work) if len(blocks) > 1 and not integer else lambda layers: nullcontext()
        with integer_products("prompt") if integer else nullcontext():
            with dense((attn.wqkv,)):
                parts = [[t.to(work) for t in attn.project(self.attention_norm(x[:, a:b]).to(work), cos[a:b], sin[a:b])]
                         for a, b in blocks]  # q, k, v biases are fp32: the sums come back in fp32
            q, k, v = (torch.cat(p, dim=2) if len(blocks) > 1 else p[0] for p in zip(*parts))
            with dense((attn.wo, ffn.w13, ffn.w2)):
                for a, b in blocks:
                    out = prompt_attention(q[:, :, a:b], k[:, :, :b], v[:, :, :b], a)
                    h = x[:, a:b]  # the residual stream stays in x's dtype: each sum is added into it in place
                    h.add_(attn.output(out))
                    h.add_(ffn(self.ffn_norm(h).to(work)))
        if attn.kv_cache is not None:  # after the attention on the fresh K/V, as kv.contract says
            attn.kv_cache.prefill(*(t.to(x.dtype) for t in (q, k, v)))  # its statistics as in an fp32 prefill
        return x


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
    def caches(self) -> list[AttentionCache | None]:
        return [layer.attention.kv_cache for layer in self.layers]

    def setup_caches(self, make_cache: Callable[[int], AttentionCache | None]) -> None:
        """make_cache(layer_index) -> the layer's cache (kv.contract.AttentionCache; None: a plain causal forward,
        no decoding); each layer gets its own buffers."""
        for i, layer in enumerate(self.layers):
            cache = make_cache(i)
            if cache is not None and not isinstance(cache, AttentionCache):
                raise TypeError(f"layer {i}'s cache {type(cache).__name__} is not a kv.contract.AttentionCache")
            layer.attention.kv_cache = cache

    def forward(self, idx: Tensor, input_pos: Tensor | None = None, all_logits: bool = False,
                recall: bool = False, run_block: Callable | None = None, prefill_chunk: int | None = None,
                prefill_dtype: torch.dtype | None = None) -> Tensor:
        """idx: [B, S]. input_pos None = prefill of a fresh sequence at positions 0..S-1 (returns the last
        position's logits, [B, 1, V], unless all_logits), layer by layer in query blocks of prefill_chunk rows
        (TransformerBlock.prefill; None: one block), its products in prefill_dtype (None: the model's); else one
        decode token at input_pos ([1]), which first recalls evicted tokens into the caches if `recall` (a tiered
        cache, kv.tiers), or a chunk of tokens at consecutive positions input_pos [S] (the full cache only:
        speculate.py's verification)."""
        h = self.hidden(idx, input_pos, recall, run_block, prefill_chunk, prefill_dtype)
        return self.logits(h if all_logits else h[:, -1:])

    def hidden(self, idx: Tensor, input_pos: Tensor | None = None, recall: bool = False,
               run_block: Callable | None = None, prefill_chunk: int | None = None,
               prefill_dtype: torch.dtype | None = None) -> Tensor:
        """The final hidden states; run_block(layer, x, cos, sin, input_pos, recall) runs each decode layer instead
        of calling it (generate.py's --compile-scope block: one nested compile region for every layer)."""
        if input_pos is None:
            cos, sin = self.rope_cos[: idx.shape[1]], self.rope_sin[: idx.shape[1]]
        elif self.layers[0].attention.kv_cache.pos_shift:
            cos = sin = None  # StreamingLLM's positions: the caches rotate q and k at ranks (kv.posshift)
        else:
            cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]
        x = self.tok_embeddings(idx).to(self.norm.weight.dtype)  # bfloat16 rows (quantize.py) to the compute dtype
        for cache in self.caches:  # fastgen keeps tokens by their class (kv.fastgen): it sees the ids fed
            if cache is not None:
                cache.see_tokens(idx)
        for layer in self.layers:
            if input_pos is None:
                x = layer.prefill(x, cos, sin, prefill_chunk, prefill_dtype)
            else:
                x = run_block(layer, x, cos, sin, input_pos, recall) if run_block else layer(x, cos, sin, input_pos, recall)
        return self.norm(x)

    def logits(self, h: Tensor) -> Tensor:
        head = self.tok_embeddings if self.output is None else self.output
        return linear(h, head.weight, getattr(head, "scales", None), getattr(head, "tiled", False)).float()

    def weight_bytes(self, step: bool = False) -> int:
        """Bytes of the weights (quantized weights are buffers; rope tables are not). step: the bytes one decode
        step reads, where an untied token embedding table is one row (the head reads a tied one whole)."""
        tensors = [*self.parameters(), *(b for n, b in self.named_buffers() if not n.startswith("rope_")
                                         and ".kv_cache." not in n)]
        total = sum(t.numel() * t.element_size() for t in tensors)
        if step and self.output is not None:
            table = sum(t.numel() * t.element_size() for t in (*self.tok_embeddings.parameters(),
                                                                 *self.tok_embeddings.buffers()))
            total -= table - table // self.args.vocab_size
        return total

    @classmethod
    def from_checkpoint(cls, path: Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Transformer:
        """Load `<dir>/config.json` plus `model.safetensors` or `model.pth`; path may be the folder or the file."""
        cpu()  # the kernels' CPU, probed before anything compiles: a bad KVFAST_CPU is one line here
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


# ---- quantized layers (quantize.py writes them; same names, so state_dict keys stay readable) ---------------
class TiledCodes:
    """int8 / int4 codes that kernels.tile_weights may rearrange, in place of the rows, into the AVX-512 integer
    products' tiles (`tiled`); state_dict, dense_weight and embedding lookups still see quantize.py's rows."""

    tiled = False

    def rows(self) -> dict[str, Tensor]:
        """The buffers that tiling rearranges, in quantize.py's row layout (int8: the codes)."""
        return {"weight": untile_int8(self.weight) if self.tiled else self.weight}

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.tiled:
            destination.update({prefix + name: t for name, t in self.rows().items()})

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args)
        if prefix + "weight" in state_dict:  # rows were copied over the tiles
            self.tiled = False


class Int8Linear(TiledCodes, PromptWeight, nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(out_features))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)  # float, as the activations

    def dense_weight(self, dtype: torch.dtype) -> Tensor:
        return (self.rows()["weight"].to(self.scales.dtype) * self.scales.unsqueeze(-1)).to(dtype)

    def product(self, x: Tensor) -> Tensor:
        return add_bias(linear(x, self.weight, self.scales, self.tiled), self.bias)


class Int8Embedding(TiledCodes, nn.Module):
    """Embedding rows as int8 with a scale per row; the tied LM head reads them through kernels.linear."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(num_embeddings, embedding_dim, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(num_embeddings))

    def forward(self, idx: Tensor) -> Tensor:
        codes = tiled_int8_rows(self.weight, idx) if self.tiled else F.embedding(idx, self.weight)
        return codes.to(self.scales.dtype) * self.scales[idx].unsqueeze(-1)


class BF16Storage(nn.Module):
    """A bfloat16 weight buffer that model.to(dtype) leaves in bfloat16 (the compute dtype stays the caller's)."""

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self.weight = self.weight.to(torch.bfloat16)  # exact: the values were bfloat16
        return self


class BF16Linear(PromptWeight, BF16Storage):
    """Weights stored in bfloat16, computed in the activations' dtype (kernels.linear converts inside its fused
    reduction): half of fp32's bytes, for CPUs where reading int8 weights costs more than it saves (bench.py
    quantize records which)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.bfloat16))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)  # the compute dtype, not bf16

    def product(self, x: Tensor) -> Tensor:
        return add_bias(linear(x, self.weight), self.bias)


class BF16Embedding(BF16Storage):
    """Embedding rows in bfloat16; the tied LM head reads them through kernels.linear."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(num_embeddings, embedding_dim, dtype=torch.bfloat16))

    def forward(self, idx: Tensor) -> Tensor:
        return F.embedding(idx, self.weight)


class Int4Linear(TiledCodes, PromptWeight, nn.Module):
    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool = False):
        super().__init__()
        n_groups = in_features // group_size
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.ones(out_features, n_groups))
        self.register_buffer("offsets", torch.zeros(out_features, n_groups))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    def rows(self) -> dict[str, Tensor]:
        codes = (self.weight, self.scales, self.offsets)
        return dict(zip(("weight", "scales", "offsets"), int4_rows(*codes) if self.tiled else codes))

    def dense_weight(self, dtype: torch.dtype) -> Tensor:
        return dequantize_int4(self.weight, self.scales, self.offsets, dtype, self.tiled)

    def product(self, x: Tensor) -> Tensor:
        return add_bias(int4_linear(x, self.weight, self.scales, self.offsets, self.tiled), self.bias)


def linears(model: Transformer) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, layer) for every linear layer of the transformer blocks."""
    out = []
    for block in model.layers:
        for parent, name in ((block.attention, "wqkv"), (block.attention, "wo"),
                             (block.feed_forward, "w13"), (block.feed_forward, "w2")):
            out.append((parent, name, getattr(parent, name)))
    return out


def empty_quantized(lin: Linear, mode: str, group_size: int) -> nn.Module:
    """The quantized layer of `mode` shaped like `lin`, with a (float) bias where `lin` has one."""
    bias = lin.bias is not None
    if mode == "int8":
        return Int8Linear(lin.in_features, lin.out_features, bias)
    if mode == "bf16":
        return BF16Linear(lin.in_features, lin.out_features, bias)
    return Int4Linear(lin.in_features, lin.out_features, group_size, bias)


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
