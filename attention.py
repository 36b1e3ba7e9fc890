"""Attention: `attend`, the model's one attention call site, the prompt's flash attention, and the one-query
kernels of a compiled CPU decode step (attention_path chooses between the C++ kernel and Inductor's
fused reductions)."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import reduce
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

import kernels_cpu
from kernels import cpu, int_ops, native_cpu, realized


@torch._dynamo.assume_constant_result  # run, not traced (it may build the kernels): a constant of the graph
def attention_path() -> str:
    """The kernel of a compiled CPU decode step's one-query attention over float K/V: "one-query-avx512" or
    "one-query-avx2" (attention_cpu.cpp in that build: the g query heads of a KV head share each load of K and V,
    2-5x Inductor's reductions from 640 to 16k slots, docs/speed.md) or "reductions" (attend_one_query's, fused by
    Inductor). Derived from kernels.cpu() on each call (a forced CPU kind changes it)."""
    isa = kernels_cpu.isa_of(cpu(), native_cpu())
    ops = kernels_cpu.ops(isa) if isa != "scalar" else None
    return f"one-query-{isa.split('-')[0]}" if hasattr(ops, "one_query_attention") else "reductions"


def prompt_attention_path() -> str:
    """The kernel of a prompt's causal attention in bfloat16 on CPU: "causal-avx512-bf16" (attention_cpu.cpp:
    both products on vdpbf16ps, 2-3x ATen's flash attention at 512-2048 tokens on an AMD EPYC, docs/speed.md)
    where the CPU has AVX512-BF16 but no AMX, whose tiles ATen's flash attention uses; else "flash" (ATen's)."""
    chip, native = cpu(), native_cpu()
    if not (chip.avx512_bf16 and native.avx512_bf16 and not chip.amx_bf16):
        return "flash"
    ops = kernels_cpu.ops("avx512-vnni") if kernels_cpu.isa_of(chip, native) == "avx512-vnni" else None
    return "causal-avx512-bf16" if hasattr(ops, "prompt_attention") else "flash"


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, want_probs: bool,
           fuse_one_query: bool = True, channel_blocks: Callable | None = None,
           layout: str = "uniform") -> tuple[Tensor, Tensor | None]:
    """The one attention call site. q: [B, H, S, D]; k, v: [B, H_kv, T, D] (never repeated to H heads).

    mask None means causal attention of S queries over the same S keys (prefill on fresh K/V); otherwise
    mask is [B, H_kv, S, T] bool (True = may attend), or a one-token step's slot positions [B, H_kv, 1, T] int64
    (attend where >= 0: a compiled step's one-query kernel reads them as they are, where Inductor would build a
    bool mask slowly, docs/speed.md). When want_probs, the probabilities are computed
    explicitly and returned as [B, H_kv, g, S, T] so a cache policy can score its slots per KV head.

    The last three come from the cache (kv.contract.AttentionCache). layout "pool": k, v [B, P, D] are a layer's
    pool shared by its KV heads (kv.pool): see attend_pool. A compiled CPU decode step (one query) takes
    attend_one_query (attend_pool_one_query) instead of SDPA or matmuls, unless fuse_one_query is False (4-bit
    K/V whose codes cannot be read in place); it then reads channel_blocks() instead of k, v where given
    (quantized codes in place, or 4-bit K/V as two halves of channels).
    """
    B, H, S, D = q.shape
    pool = layout == "pool"
    if (fuse_one_query and mask is not None and S == 1 and q.device.type == "cpu"
            and torch.compiler.is_compiling()):
        if pool:
            return attend_pool_one_query(q, k, v, live(mask), want_probs)
        if channel_blocks is not None:
            k, v = channel_blocks()
        return attend_one_query(q, k, v, mask, want_probs)
    mask = live(mask)
    if pool:
        return attend_pool(q, k, v, mask, want_probs)
    k, v = (x.to(q.dtype) if x.dtype == torch.float16 else x for x in (k, v))  # float16 K/V: read exactly in fp32
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
    # over 4096 slots where the CPU has bfloat16 dot products (docs/speed.md); attend_one_query rounds alike
    qg = q.to(k.dtype).reshape(B, n_kv, g * S, D)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float().view(B, n_kv, g, S, -1) * (1.0 / math.sqrt(D))
    if mask is None:
        mask = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    else:
        mask = mask.unsqueeze(2)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    out = torch.matmul(probs.to(v.dtype).view(B, n_kv, g * S, -1), v).to(q.dtype)
    return out.view(B, H, S, D), probs


def live(mask: Tensor | None) -> Tensor | None:
    """attend's mask as bool: slot positions live where >= 0."""
    return mask if mask is None or mask.dtype == torch.bool else mask >= 0


def attention_lse(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None,
                  causal: bool = False) -> tuple[Tensor, Tensor]:
    """softmax(q k^T / sqrt(D) + bias) v [B, H, r, D] in q's dtype and each row's log-sum-exp [B, H, r] (fp32).
    q [B, H, r, D]; k, v [B, H_kv, m, D] with H a multiple of H_kv (GQA: query head h reads KV head h // g);
    bias [r, m] or None; causal: row i sees keys 0..i (top-left aligned, r = m). On CPU one fused
    flash-attention kernel returns both (GQA native, nothing is repeated, no r x m matrix); elsewhere they are
    computed directly."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    if q.device.type == "cpu":  # fp32 or bf16 inputs; the log-sum-exp comes back in fp32 either way
        bias = bias if bias is None else bias.to(q.dtype)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k.to(q.dtype), v.to(q.dtype), 0.0,
                                                                          causal, attn_mask=bias, scale=scale)
    g = q.shape[1] // k.shape[1]
    k, v = (x.float().repeat_interleave(g, dim=1) if g > 1 else x.float() for x in (k, v))
    logits = torch.matmul(q.float(), k.transpose(-1, -2)) * scale
    logits = logits if bias is None else logits + bias
    if causal:
        logits = logits.masked_fill(torch.ones(logits.shape[-2:], dtype=torch.bool, device=q.device).triu(1),
                                    float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    return torch.matmul(torch.exp(logits - lse.unsqueeze(-1)), v).to(q.dtype), lse


def prompt_attention(q: Tensor, k: Tensor, v: Tensor, start: int = 0) -> Tensor:
    """Causal attention of a block of prompt queries, q [B, H, L, D] at positions start..start + L - 1, over the
    prompt's keys up to the block's last, k, v [B, H_kv, start + L, D]: what a prefill in query blocks computes
    block by block (model.TransformerBlock.prefill). The first block is plain causal SDPA; a later one attends
    in two fused passes, over the earlier keys (all visible) and causally over its own, merged by their
    log-sum-exps: no mask, no L x (start + L) matrix per head."""
    if start == 0:
        if (q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.device.type == "cpu" and q.shape[-1] in (64, 128)
                and not torch.compiler.is_compiling() and prompt_attention_path() == "causal-avx512-bf16"):
            return int_ops().prompt_attention(q, k, v, 1.0 / math.sqrt(q.shape[-1]))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    own, own_lse = attention_lse(q, k[:, :, start:], v[:, :, start:], causal=True)
    past, past_lse = attention_lse(q, k[:, :, :start], v[:, :, :start])
    total = torch.logaddexp(own_lse, past_lse).unsqueeze(-1)
    out = own.float() * (own_lse.unsqueeze(-1) - total).exp() + past.float() * (past_lse.unsqueeze(-1) - total).exp()
    return out.to(q.dtype)


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


ONE_QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # K/V the one-query kernel reads in place


def attend_one_query(q: Tensor, k: Tensor | tuple, v: Tensor | tuple, mask: Tensor,
                     want_probs: bool = False) -> tuple[Tensor, Tensor | None]:
    """A decode step's attention (one query per row) as multiply-and-sum reductions, inside a compiled CPU graph.
    SDPA's CPU kernel (and a matmul's, when a policy wants the probabilities) has a fixed cost per call that
    dwarfs one query's work (3 KV heads x 512 keys: ~90 us for ~1 MB of K/V) and splits the step's graph at
    every layer; as reductions Inductor fuses the attention into the layer's kernels (int8 decode step at 512
    tokens, whole-step graph: 11.4 -> 9.1 ms; docs/speed.md). probs as attend returns them.

    k and v may come as tuples of channel blocks (concatenated along the last dim they are k and v: 4-bit K/V's
    halves, kv.storage's channel_blocks), each block reduced apart, so no reduction reads a concatenation. A block
    given as Codes is read as its codes, its scale and zero point applied per token outside the reductions:
    q . (c s + z) = s (q . c) + z sum(q), and sum_t p (c s + z) = sum_t (p s) c + sum_t p z, so each code is
    converted and multiplied once per query head instead of dequantized once per query head.

    Float K/V given whole take attention_cpu.cpp's one-query kernel where attention_path() has it: the same
    roundings, each key and value read once for the g query heads of its KV head, and masked slots not read
    (bfloat16 K/V on AVX512-BF16: both products on vdpbf16ps)."""
    B, H, _, D = q.shape
    n_kv = mask.shape[1]
    if (isinstance(k, Tensor) and isinstance(v, Tensor) and q.dtype == torch.float32 and k.dtype in ONE_QUERY_DTYPES and v.dtype == k.dtype
            and D in (64, 128) and H // n_kv <= 8 and attention_path() != "reductions"):
        out, probs = int_ops().one_query_attention(q.reshape(B, n_kv, H // n_kv, D), k, v,
                                                   mask.reshape(B, n_kv, k.shape[2]), 1.0 / math.sqrt(D))
        return out.view(B, H, 1, D), probs.unsqueeze(3) if want_probs else None
    mask = live(mask)
    k_blocks, v_blocks = (x if isinstance(x, tuple) and not isinstance(x, Codes) else (x,) for x in (k, v))
    widths = [b.width if isinstance(b, Codes) else b.shape[-1] for b in k_blocks]
    # bfloat16 K/V under float queries: round where attend's bfloat16 matmuls do (the query, the scores, the
    # probabilities, the output), so a (K + 1)-query verification agrees with the one-query steps it replaces
    bf16_kv = not isinstance(k_blocks[0], Codes) and k_blocks[0].dtype == torch.bfloat16 and q.dtype != torch.bfloat16
    low = torch.bfloat16 if bf16_kv else None
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
