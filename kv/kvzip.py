"""KVzip (Kim et al., NeurIPS 2025, arXiv:2505.23416): query-agnostic prompt compression by context reconstruction.

After the context's prefill the model is teacher-forced to repeat the context ("Repeat the previous context
exactly." in the model's chat format, then the context itself) in chunks of `kvzip_chunk` tokens, each chunk
attending to the whole cached context. A cached (KV head, token) pair is worth the largest attention any
reconstruction query of its GQA group pays it; each KV head keeps its top-scored pairs (and the sinks).

Details follow kvpress's KVzipPress (NVIDIA/kvpress `presses/kvzip_press.py`, the method's port by its authors):
- chunk i > 0 is introduced by "Repeat the part of the previous context exactly, starting with" and the last 8
  tokens of chunk i - 1; every chunk sits right after the context (positions S, S + 1, ...) and is discarded
  after scoring, so chunks never see each other;
- a chunk's scores are a softmax over the sinks, the chunk's own span of the context and the repeat tokens
  (causal), maxed over the chunk's queries and the GQA group; with `kvzip_plus` (KVzip+) each probability is
  divided by the norm of its query row's normed hidden state and multiplied by ||W_o v|| of its key.
kvpress ranks all (layer, head, token) triples jointly (layer and head budgets then differ, realised by masking,
so no memory is saved); the `kvzip` policy ranks the pairs of each layer jointly across its KV heads in a pool
of fixed size (kv.pool: real memory, static shapes), every layer keeping the same number of slots.

Unlike every other compressor the scores need the whole model (layer l's queries come from layers < l run on the
repeat tokens), so they cannot come from one layer's prefill: `prefill(model, idx)` records each layer's (q, k,
v) in one ordinary pass, runs the reconstruction over the recorded K/V (the context is never prefilled twice),
puts each layer's scores in its memo and only then fills the caches. eval.py does the same with its recording.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import reduce
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from attention import attention_lse
from kernels import cpu
from kv.contract import AttentionCache
from kv.params import Param, boolean, choice, whole
from kv.pool import AdaKVCache
from kv.prompt import PREFILL_BLOCK_ELEMENTS, PromptCompressor
from kv.slots import KVCache
from model import KVFastError, Transformer, prompt_work_dtype

FIRST_INSTRUCTION = "\n\nRepeat the previous context exactly."
LATER_INSTRUCTION = "\n\nRepeat the part of the previous context exactly, starting with"


@dataclass
class RepeatPrompt:
    """Token ids around each reconstruction chunk: instruction (+ the previous chunk's last `carry` tokens for
    chunks after the first), then `suffix` (the end of the user turn and the assistant header), then the chunk."""

    first: list[int]
    later: list[int]
    suffix: list[int]
    carry: int = 8

    @classmethod
    def from_tokenizer(cls, tok: Any) -> RepeatPrompt:
        mark = "\x00KVZIP\x00"
        chat = getattr(tok, "chat_format", "none") != "none"
        suffix = tok.chat_prompt(mark).split(mark, 1)[1] if chat else "\n"  # kvpress: "\n" without a template
        return cls(tok.encode(FIRST_INSTRUCTION), tok.encode(LATER_INSTRUCTION), tok.encode(suffix))

    def chunk_ids(self, idx: Tensor, start: int, stop: int) -> Tensor:
        """[B, r + stop - start]: the reconstruction input for context tokens start..stop-1."""
        B = idx.shape[0]

        def ids(x: list[int]) -> Tensor:
            return torch.tensor(x, dtype=idx.dtype, device=idx.device).expand(B, len(x))

        head = [ids(self.first)] if start == 0 else [ids(self.later), idx[:, max(0, start - self.carry) : start]]
        return torch.cat([*head, ids(self.suffix), idx[:, start:stop]], dim=1)

    def longest(self, S: int, chunk: int) -> int:
        """The length of the longest chunk_ids row for a context of S tokens in chunks of `chunk` (the first chunk,
        or a full later one with its instruction and carried tokens)."""
        first = len(self.first) + len(self.suffix) + min(S, chunk)
        later = len(self.later) + min(self.carry, chunk) + len(self.suffix) + min(S - chunk, chunk) if S > chunk else 0
        return max(first, later)


def check_room(model: Transformer, S: int) -> None:
    """Refuse, before the prefill, a context of S tokens whose reconstruction chunks would run past the model's
    last position (a 32,704-token context leaves Qwen2.5 64 positions)."""
    users = [m.compressor for m in kvzip_caches(model.caches) if m.prompt_capacity < S]
    for comp in users:
        n = (comp.repeat_prompt or RepeatPrompt([], [], [])).longest(S, comp.kvzip_chunk)
        if S + n > model.rope_cos.shape[0]:
            raise no_room(S, n, model.rope_cos.shape[0])


def no_room(S: int, n: int, limit: int) -> KVFastError:
    return KVFastError(f"kvzip: context ({S}) + a reconstruction chunk ({n}) exceed the model's maximum length of "
                       f"{limit}; use a smaller --kvzip-chunk or a shorter context")


class KVzipPrompt(PromptCompressor):
    """KVzip (Kim et al., NeurIPS 2025, arXiv:2505.23416): max attention received while the model repeats the
    context. The scores come from a reconstruction pass of the whole model (kv.kvzip.prefill)."""

    name = "kvzip"
    params = (Param("kvzip_chunk", 2048, "context tokens the model repeats per reconstruction chunk",
                    check=whole(1)),
              Param("kvzip_plus", False, "KVzip+ normalization (attention / ||hidden|| x ||W_o v||, as "
                    "kvpress)", check=boolean),
              Param("kvzip_dtype", "prefill", "precision of the reconstruction pass's products: prefill (the "
                    "prefill's, --prefill-dtype), float32, bfloat16, or auto (bf16 on a GPU or a CPU with AMX, "
                    "else the model's)", check=choice("prefill", "float32", "bfloat16", "auto")))
    needs_model_pass: ClassVar[bool] = True
    repeat_prompt: RepeatPrompt | None = None  # set by bind(); without a tokenizer chunks repeat bare

    def bind(self, tokenizer: Any) -> None:
        self.repeat_prompt = RepeatPrompt.from_tokenizer(tokenizer)

    def memo_key(self) -> tuple:
        return ("kvzip", self.kvzip_chunk, self.kvzip_plus, self.kvzip_dtype)

    def compute_dtype(self, device: torch.device, prefill_dtype: torch.dtype | None = None) -> torch.dtype | None:
        """The reconstruction's precision: kvzip_dtype, where prefill = the prefill's products' (prefill_dtype;
        None: the model's), auto = bf16 on a GPU or a CPU with AMX tiles (there a bf16 product runs several times
        faster than fp32; the scores only rank tokens), else the model's. The CPU is the kernels' (kernels.cpu():
        KVFAST_CPU / force_cpu choose as on another kind)."""
        if self.kvzip_dtype == "prefill":  # int8's integer products: their activations' dtype
            return None if prefill_dtype is None else prompt_work_dtype(prefill_dtype, None)
        if self.kvzip_dtype == "auto":
            fast = device.type == "cuda" or (device.type == "cpu" and cpu().amx_bf16)
            return torch.bfloat16 if fast else None
        return getattr(torch, self.kvzip_dtype)

    def scores(self, q: Tensor, k: Tensor, memo: dict | None = None) -> Tensor:
        if memo is None or self.memo_key() not in memo:
            raise KVFastError("kvzip scores the prompt with a reconstruction pass of the whole model: prefill "
                              "through kv.kvzip.prefill (decode.prefill does), not layer by layer")
        return memo[self.memo_key()]


class KVzipCache(AdaKVCache):
    """KVzip (Kim et al., NeurIPS 2025, arXiv:2505.23416): the prompt's (KV head, token) pairs ranked jointly
    across the heads of a layer by reconstruction scores, in a pool of H_kv x budget slots (kv.pool), no floor,
    4 sinks: kvpress's KVzipPress, which also ranks across layers (a static per-layer pool cannot). Decoding
    as adakv (reconstruction score + attention paid since, the last 32 tokens protected). KVzip with an equal
    budget per head: --cache snapkv --prompt-compression kvzip (append-only, uniform layout)."""

    name = "kvzip"
    params = AdaKVCache.params.with_defaults(n_sinks=4, adakv_floor=0.0, adakv_normalize=False)
    default_prompt_compressor = "kvzip"


# ---- the reconstruction pass ------------------------------------------------------------------------------
class Recorder(AttentionCache):
    """Stands in for a layer's cache during a prefill: keeps the post-RoPE q, k, v."""

    def prefill(self, q: Tensor, k: Tensor, v: Tensor, memo: dict | None = None) -> None:
        self.q, self.k, self.v = q, k, v


def record_prefill(model: Transformer, idx: Tensor, chunk: int | None = None,
                   dtype: torch.dtype | None = None) -> tuple[list[tuple[Tensor, Tensor, Tensor]], Tensor]:
    """One ordinary prefill of idx [B, S] (in query blocks of `chunk` rows, products in `dtype`: Transformer's
    prefill_chunk / prefill_dtype) with recorders as caches: per-layer (q, k, v) and the final hidden states
    [B, S, dim]. The model's caches are put back afterwards."""
    caches = [layer.attention.kv_cache for layer in model.layers]
    recorders = [Recorder() for _ in model.layers]
    model.setup_caches(lambda i: recorders[i])
    try:
        hidden = model.hidden(idx, prefill_chunk=chunk, prefill_dtype=dtype)
    finally:
        model.setup_caches(lambda i: caches[i])
    return [(r.q, r.k, r.v) for r in recorders], hidden


def reconstruction_attention(q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k: Tensor, v: Tensor, start: int, stop: int,
                             n_sinks: int, row_scale: Tensor | None = None,
                             key_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One layer of one reconstruction chunk: the repeat queries q [B, H, n, D] attend to the whole context
    (k_ctx, v_ctx [B, H_kv, S, D]) and causally to their own keys (k, v [B, H_kv, n, D]).

    Returns the attention output [B, H, n, D] and KVzip's scores of the chunk's span start..stop-1 [B, H_kv, c]:
    the max over the n queries and the GQA group of the softmax over [sinks, span, own keys] (kvpress's
    normalisation), times row_scale [B, n] and key_scale [B, H_kv, g, span] for KVzip+. The attention runs as
    two fused passes, over those keys and over the rest of the context, merged by their log-sum-exp, so the
    scores cost one extra [n x span] product, not a second attention over everything."""
    B, H, n, D = q.shape
    n_kv, S = k_ctx.shape[1], k_ctx.shape[2]
    g, s, c = H // n_kv, min(n_sinks, start), stop - start
    qg = q.reshape(B, n_kv, g * n, D)
    # the softmax KVzip normalises by covers [sinks, span] (all visible to the chunk) and the chunk's own keys
    # (causally): two fused passes merged by their log-sum-exps, then the rest of the context likewise. No mask:
    # a [g n, s + c + n] bias per layer cost more than the attention itself
    span_out, span_lse = attention_lse(qg, torch.cat([k_ctx[:, :, :s], k_ctx[:, :, start:stop]], dim=2),
                                       torch.cat([v_ctx[:, :, :s], v_ctx[:, :, start:stop]], dim=2))
    own_out, own_lse = attention_lse(q, k, v, causal=True)  # GQA native: head h reads KV head h // g, as qg
    parts = [(span_out, span_lse), (own_out.reshape(B, n_kv, g * n, D), own_lse.reshape(B, n_kv, g * n))]
    lse = torch.logaddexp(span_lse, parts[1][1])
    total = lse
    rest = [(k_ctx[:, :, a:b], v_ctx[:, :, a:b]) for a, b in ((s, start), (stop, S)) if b > a]
    if rest:
        rest_out, rest_lse = attention_lse(qg, torch.cat([r[0] for r in rest], 2),
                                           torch.cat([r[1] for r in rest], 2), None)
        parts.append((rest_out, rest_lse))
        total = torch.logaddexp(lse, rest_lse)
    out = reduce(torch.add, [o.float() * (w - total).exp().unsqueeze(-1) for o, w in parts])
    # max over rows of exp(q.k / sqrt(D) - lse + log row_scale): the offset rides as an extra channel of the
    # queries against a channel of ones in the keys, so one product per block of rows gives the exponent; zero
    # channels pad it to a multiple of 32, which the bfloat16 tiles multiply several times faster than D + 1
    offset = -lse
    if row_scale is not None:
        offset = offset + row_scale.float().log().repeat(1, g)[:, None, :]
    pad = -(D + 1) % 32
    q_aug = torch.cat([qg * (1.0 / math.sqrt(D)), offset.unsqueeze(-1).to(qg.dtype),
                       qg.new_zeros(B, n_kv, g * n, pad)], dim=-1)
    span = k_ctx[:, :, start:stop].to(qg.dtype)
    span_aug = torch.cat([span, span.new_ones(B, n_kv, c, 1), span.new_zeros(B, n_kv, c, pad)],
                         dim=-1).transpose(-1, -2)
    best = q.new_full((B, n_kv, g, c), -math.inf, dtype=torch.float32)
    rows = max(1, PREFILL_BLOCK_ELEMENTS // (B * n_kv * c))
    for member in range(g):  # KVzip+ scales keys per query head, so each group member keeps its own max
        for r0 in range(member * n, (member + 1) * n, rows):
            r1 = min((member + 1) * n, r0 + rows)
            exponent = torch.matmul(q_aug[:, :, r0:r1], span_aug).amax(dim=2).float()
            best[:, :, member] = torch.maximum(best[:, :, member], exponent)
    probs = best.exp()
    if key_scale is not None:
        probs = probs * key_scale[..., s : s + c]
    return out.reshape(B, H, n, D).to(q.dtype), probs.amax(dim=2)


def context_scores(model: Transformer, idx: Tensor, kv: list[tuple[Tensor, Tensor, Tensor]],
                   repeat: RepeatPrompt | None = None, chunk: int = 2048, plus: bool = False,
                   n_sinks: int = 4, dtype: torch.dtype | None = None) -> list[Tensor]:
    """KVzip's scores [B, H_kv, S] per layer for the context idx [B, S] whose per-layer post-RoPE (q, k, v) are kv
    (a recorded prefill). Runs the reconstruction chunks through the model over the recorded K/V; n_sinks first
    tokens join every chunk's softmax (kvpress's n_sink). dtype: the products' precision (None: the model's);
    the residual stream, log-sum-exps and scores stay fp32."""
    repeat = repeat or RepeatPrompt([], [], [])
    B, S = idx.shape
    a = model.args
    g = a.n_heads // a.n_kv_heads
    scores = [k.new_zeros(B, a.n_kv_heads, S, dtype=torch.float32) for _, k, _ in kv]
    last = len(model.layers) - 1
    for start in range(0, S, chunk):
        stop = min(S, start + chunk)
        ids = repeat.chunk_ids(idx, start, stop)
        n = ids.shape[1]
        pos = torch.arange(S, S + n, device=idx.device)
        if S + n > model.rope_cos.shape[0]:
            raise no_room(S, n, model.rope_cos.shape[0])
        cos, sin = model.rope_cos[pos], model.rope_sin[pos]
        x = model.tok_embeddings(ids).float()
        for i, (layer, (_, k_ctx, v_ctx)) in enumerate(zip(model.layers, kv)):
            h = layer.attention_norm(x).to(dtype or k_ctx.dtype)  # kernels.linear casts the weights to h's dtype
            # RoPE's fp32 tables would promote q and k to fp32: the products run in dtype (AMX's bfloat16)
            q, k, v = (t.to(h.dtype) for t in layer.attention.project(h, cos, sin))
            k_ctx, v_ctx = k_ctx.to(h.dtype), v_ctx.to(h.dtype)
            row_scale = key_scale = None
            if plus:
                s = min(n_sinks, start)
                values = torch.cat([v_ctx[:, :, :s], v_ctx[:, :, start:stop], v], dim=2).float()
                wo = layer.attention.wo.dense_weight(torch.float32).view(a.dim, a.n_kv_heads, g, a.head_dim)
                gram = torch.einsum("okgd,okge->kgde", wo, wo)  # ||W_o,h v||^2 = v^T (W_o,h^T W_o,h) v
                key_scale = torch.einsum("bkmd,kgde,bkme->bkgm", values, gram, values).clamp(min=0).sqrt()
                row_scale = 1.0 / h.float().norm(dim=-1)
            out, scores[i][..., start:stop] = reconstruction_attention(q, k_ctx, v_ctx, k, v, start, stop, n_sinks,
                                                                       row_scale, key_scale)
            if i == last:
                break  # the last layer's output feeds no score
            x = x + layer.attention.output(out).float()
            x = x + layer.feed_forward(layer.ffn_norm(x).to(h.dtype)).float()
    return scores


def kvzip_caches(caches: list[nn.Module]) -> list[nn.Module]:
    """The caches compressing with KVzip among caches and their submodules (eval's wrappers hold several)."""
    return [m for c in caches if c is not None for m in c.modules()
            if isinstance(m, KVCache) and isinstance(m.compressor, KVzipPrompt)]


def score_into(model: Transformer, idx: Tensor, kv: list[tuple[Tensor, Tensor, Tensor]], caches: list[nn.Module],
               memos: list[dict], prefill_dtype: torch.dtype | None = None) -> float:
    """Put KVzip's scores into each layer's memo if any layer's KVzip cache will compress a prompt of
    idx.shape[1] tokens (and they are not there yet); prefill_dtype: the prefill's products' (KVzipPrompt's
    compute_dtype). Returns the seconds spent (0 if nothing to do)."""
    S = idx.shape[1]
    users = [m for m in kvzip_caches(caches) if m.prompt_capacity < S]
    if not users:
        return 0.0
    t0 = time.perf_counter()
    for comp in {m.compressor.memo_key(): m.compressor for m in users}.values():  # a pass per distinct setting
        if comp.memo_key() in memos[0]:
            continue
        layer_scores = context_scores(model, idx, [(q[:, :, :S], k[:, :, :S], v[:, :, :S]) for q, k, v in kv],
                                      comp.repeat_prompt, comp.kvzip_chunk, comp.kvzip_plus,
                                      dtype=comp.compute_dtype(idx.device, prefill_dtype))
        for memo, s in zip(memos, layer_scores):
            memo[comp.memo_key()] = s
    return time.perf_counter() - t0


def needs_context_pass(model: Transformer) -> bool:
    return bool(kvzip_caches(model.caches))


def prefill(model: Transformer, idx: Tensor, chunk: int | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """Prefill idx [B, S] into the model's caches when some layer compresses with KVzip: record (in query blocks
    of `chunk` rows, products in `dtype`), score by reconstruction, fill. Returns the last position's logits
    [B, 1, V], like model(idx). The seconds spent on scoring are left in `model.kvzip_scoring_s` (read once by
    generate.py)."""
    check_room(model, idx.shape[1])
    kv, hidden = record_prefill(model, idx, chunk, dtype)
    caches = model.caches
    memos = [{} for _ in caches]
    model.kvzip_scoring_s = score_into(model, idx, kv, caches, memos, dtype)
    for cache, (q, k, v), memo in zip(caches, kv, memos):
        cache.prefill(q, k, v, memo=memo)
    return model.logits(hidden[:, -1:])
