"""Prompt compression: which `n` prompt tokens each KV head keeps when the prompt is longer than the capacity.

A compressor defines only `scores(q, k, memo)` ([B, H_kv, S], higher = kept). The scores never depend on the
budget, so a caller trying many budgets computes them once (they are memoized in `memo`). The shared
`select` then keeps the top-n per KV head with the protected positions forced in: the policy's sinks, its
recent window, and the compressor's own window (SnapKV's observation window).

Statistics that need the prompt's attention are computed here from (q, k) in query blocks, never as one
S x S matrix (PREFILL_BLOCK_ELEMENTS probabilities at a time); SnapKV and TOVA need only their last rows
(a w x S product). All of them are fp32 and causal; GQA queries are viewed as [B, H_kv, g, S, D].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from attention import attention_lse
from kv.params import GQA_REDUCE, Configurable, Param, boolean, choice, odd, whole
from kv.slots import INF, counter_hash, reduce_groups, row_head_salt
from model import ModelArgs

PREFILL_BLOCK_ELEMENTS = 1 << 22  # attention probabilities held at once by the blockwise statistics


# ---- prompt statistics --------------------------------------------------------------------------------
def memoized(memo: dict | None, key: tuple, compute: Callable[[], Tensor]) -> Tensor:
    if memo is None:
        return compute()
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def attention_rows(q: Tensor, k: Tensor, start: int, stop: int, key_pos: Tensor | None = None) -> Tensor:
    """Causal attention probabilities [B, H_kv, g, stop - start, n] (fp32) of query rows start..stop-1 over
    the n keys k [B, H_kv, n, D] at positions key_pos [B, H_kv, n] (None: the prompt's first n, 0..n-1)."""
    B, H, _, D = q.shape
    n_kv = k.shape[1]
    qg = q[:, :, start:stop].float().reshape(B, n_kv, H // n_kv, stop - start, D) * (1.0 / math.sqrt(D))
    scores = torch.matmul(qg, k.float().unsqueeze(2).transpose(-1, -2))
    rows = torch.arange(start, stop, device=q.device).view(-1, 1)
    if key_pos is None:  # keys before `start` are seen by every row: mask the causal corner only, in place
        scores[..., start:].masked_fill_(torch.arange(start, k.shape[2], device=q.device) > rows, -INF)
        return torch.softmax(scores, dim=-1)
    return torch.softmax(scores.masked_fill(key_pos[:, :, None, None, :] > rows, -INF), dim=-1)


def attention_row_blocks(q: Tensor, k: Tensor, start: int = 0,
                         block_rows: int | None = None) -> Iterator[tuple[int, Tensor]]:
    """(first row, probabilities) for query rows start..S-1, a block of rows at a time."""
    B, H, S, _ = q.shape
    rows = block_rows or max(1, PREFILL_BLOCK_ELEMENTS // (B * H * S))
    for r0 in range(start, S, rows):
        yield r0, attention_rows(q, k, r0, min(S, r0 + rows))


def column_sums_fused(q: Tensor, k: Tensor) -> Tensor:
    """column_sums without a single probability in memory, by two CPU flash-attention passes in fp32. Key j's
    column sum is sum_{i >= j} exp(s_ij - lse_i) (lse_i: row i's log-sum-exp, the first pass); that is the
    softmax denominator of key j attending, as a query, to the prompt's queries i >= j with a bias -lse_i per
    "key": one more column on both sides ([k_j / sqrt(D), 1] . [q_i, -lse_i]), both sequences reversed to make
    i >= j causal, and the second pass's log-sum-exp is log of the column sum. 8k tokens, 14 heads: 3-4x the
    blockwise softmax's speed, whose S x S exponentials are memory-bound."""
    B, H, S, D = q.shape
    g = H // k.shape[1]
    q32, k32 = q.float(), k.float()
    lse = attention_lse(q32, k32, k32, causal=True)[1]  # [B, H, S]
    keys = torch.cat([q32, -lse.unsqueeze(-1)], dim=-1).flip(2)
    queries = torch.cat([k32 * (1.0 / math.sqrt(D)), torch.ones_like(k32[..., :1])], dim=-1)
    queries = queries.repeat_interleave(g, dim=1).flip(2)
    log_sums = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        queries, keys, torch.zeros_like(keys), 0.0, True, scale=1.0)[1]
    return log_sums.flip(2).exp().view(B, k.shape[1], g, S)


def column_sums(q: Tensor, k: Tensor, memo: dict | None = None, block_rows: int | None = None) -> Tensor:
    """H2O's accumulated attention of every prompt query, per query head: [B, H_kv, g, S]. On CPU (unless
    block_rows asks for the blockwise form) column_sums_fused; elsewhere softmax rows in blocks."""
    def compute() -> Tensor:
        if q.device.type == "cpu" and block_rows is None:
            return column_sums_fused(q, k)
        B, H, S, _ = q.shape
        rows = block_rows or max(1, PREFILL_BLOCK_ELEMENTS // (B * H * S))
        total = q.new_zeros(B, k.shape[1], H // k.shape[1], S, dtype=torch.float32)
        for r0 in range(0, S, rows):
            r1 = min(S, r0 + rows)
            # causal: query rows before r1 give no attention to keys from r1 on, so skip them (half the work)
            total[..., :r1] += attention_rows(q, k[:, :, :r1], r0, r1).sum(dim=3)
        return total
    return memoized(memo, ("column_sums",), compute)


def window_votes(q: Tensor, k: Tensor, window: int, memo: dict | None = None) -> Tensor:
    """SnapKV's vote: attention of the last `window` queries summed, per query head: [B, H_kv, g, S]."""
    S = q.shape[2]
    return memoized(memo, ("window_votes", window),
                    lambda: attention_rows(q, k, S - window, S).sum(dim=3))


def last_query_attention(q: Tensor, k: Tensor, memo: dict | None = None) -> Tensor:
    """Attention of the last prompt query, per query head: [B, H_kv, g, S]."""
    S = q.shape[2]
    return memoized(memo, ("last_query",), lambda: attention_rows(q, k, S - 1, S)[:, :, :, 0])


def low_attention(q: Tensor, k: Tensor, window: int, gqa_reduce: str, keep: Tensor | None = None,
                  memo: dict | None = None, block_rows: int | None = None) -> Tensor:
    """Scissorhands' record for the last min(window, S) prompt queries: [B, H_kv, w, n] bool over the n kept
    prompt tokens (keep: [B, H_kv, n] positions, ascending; None = all S). Query j judges the kept tokens it
    can see, V_j = {i in keep: i <= j}, as a decode step judges its slots: True where its attention
    renormalised over V_j (per query head, then group-reduced) is below uniform, 1 / |V_j|. Judging against
    the whole prompt (1 / (j + 1)) would set a lower bar for prompt tokens than for decoded ones.

    The kept set depends on the budget, so only the uncompressed record (keep None, the same for every
    budget that fits the prompt) is memoized; a compressed one costs a w x n product over the kept keys, less
    than the w x S rows of the whole prompt."""
    B, H, S, D = q.shape
    w = min(window, S)
    key_pos = torch.arange(S, device=k.device).expand(k.shape[:3]) if keep is None else keep
    kept_k = k if keep is None else k.gather(2, keep.unsqueeze(-1).expand(*keep.shape, D))
    n = key_pos.shape[-1]

    def compute() -> Tensor:
        blocks = []
        rows = block_rows or max(1, PREFILL_BLOCK_ELEMENTS // (B * H * n))
        for r0 in range(S - w, S, rows):
            r1 = min(S, r0 + rows)
            # a row that sees no kept token is all -inf (NaN probabilities): `seen` leaves it all False
            p = reduce_groups(attention_rows(q, kept_k, r0, r1, key_pos), gqa_reduce)  # [B, H_kv, rows, n]
            seen = key_pos.unsqueeze(2) <= torch.arange(r0, r1, device=q.device).view(-1, 1)
            blocks.append((p < 1.0 / seen.sum(-1, keepdim=True).float()) & seen)
        return torch.cat(blocks, dim=2)
    if keep is not None:
        return compute()
    return memoized(memo, ("low_attention", window, gqa_reduce), compute)


def key_norm_rank(norm: Tensor, pos: Tensor) -> Tensor:
    """KNorm's ranking, higher = kept: lower L2 norm first, compared at fp16 precision, then the newer token.

    A repeated token has the same key norm at every position (RoPE preserves norms), so exact comparisons
    would hinge on rounding noise that differs between eager and compiled kernels; fp16 buckets plus an
    explicit tie-break make it reproducible (fp16 bits of a non-negative float sort like the float)."""
    bits = norm.half().view(torch.int16).long()
    return (pos - (bits << 32)).double()


# ---- compressors ----------------------------------------------------------------------------------------
class PromptCompressor(Configurable):
    """Picks the prompt tokens each KV head keeps. Subclasses define `scores` (higher = kept) and `params`."""

    kind = "prompt compressor"
    window_param: ClassVar[str | None] = None  # the parameter naming a window of last tokens always kept
    uses_values: ClassVar[bool] = False  # True: scores(q, k, memo, v) also gets the values (only then)
    default_layer_budget: ClassVar[str] = "uniform"  # the layer schedule it implies (pyramidkv: pyramid)

    def __init__(self, layer: int = 0, model_args: ModelArgs | None = None, **params: Any):
        self.set_params(params)
        self.layer = layer
        self.model_args = model_args  # RoPE and shapes, for compressors that need them (None in unit tests)

    def bind(self, tokenizer: Any) -> None:
        """Called by the cache factory with the model's tokenizer (for compressors that write text)."""

    @property
    def window(self) -> int:
        return getattr(self, self.window_param) if self.window_param else 0

    def scores(self, q: Tensor, k: Tensor, memo: dict | None = None) -> Tensor:
        """[B, H_kv, S] per-token scores, higher = kept; independent of the budget. With uses_values the
        signature is scores(q, k, memo, v), v [B, H_kv, S, D]."""
        raise NotImplementedError

    def cached_scores(self, q: Tensor, k: Tensor, memo: dict | None = None,
                      v: Tensor | None = None) -> Tensor:
        key = ("scores", self.name, tuple(sorted((p, getattr(self, p)) for p in self.params)))
        # v stays out of the key: a memo belongs to one sample and layer, hence to one v
        values = (v,) if self.uses_values else ()
        return memoized(memo, key, lambda: self.scores(q, k, memo, *values))

    def select(self, q: Tensor, k: Tensor, n: int, n_sinks: int = 0, recent_window: int = 1,
               memo: dict | None = None, v: Tensor | None = None) -> Tensor:
        """Positions [B, H_kv, n] (ascending) each KV head keeps: the protected ones, then the top-scored."""
        S = k.shape[2]
        scores = self.cached_scores(q, k, memo, v).double().expand(k.shape[:3])
        pos = torch.arange(S, device=k.device)
        # at the first decode step (t = S) the policy protects pos > S - recent_window: the last r - 1 tokens
        keep_last = max(self.window, recent_window - 1)
        protected = (pos < n_sinks) | (pos >= S - keep_last)
        return scores.masked_fill(protected, INF).topk(n, dim=-1).indices.sort(dim=-1).values


class WindowPrompt(PromptCompressor):
    """StreamingLLM-style: the sinks and the most recent tokens."""

    name = "window"

    def scores(self, q: Tensor, k: Tensor, memo: dict | None = None) -> Tensor:
        return torch.arange(k.shape[2], device=k.device).float().expand(k.shape[:3])


class RandomPrompt(PromptCompressor):
    """Random baseline: a uniformly random subset per KV head (counter-based, reproducible)."""

    name = "random"

    def scores(self, q: Tensor, k: Tensor, memo: dict | None = None) -> Tensor:
        B, H, S, _ = k.shape
        salt = row_head_salt(B, H, self.layer, k.device)
        return counter_hash(torch.arange(S, device=k.device), S, salt).double()


OBS_WINDOW = Param("obs_window", 32, "SnapKV's observation window: the last prompt queries that vote, "
                   "always kept", check=whole(1))
POOL_KERNEL = Param("pool_kernel", 7, "1-D pooling kernel over SnapKV's votes", check=odd)
POOL = Param("pool", "max", "pooling of SnapKV's votes: max or avg", check=choice("max", "avg"))
H2O_NORMALIZE = Param("h2o_normalize", False, "divide accumulated attention by the number of queries that "
                      "saw the token", check=boolean)


class H2OPrompt(PromptCompressor):
    """H2O at prefill (KVCache-Factory's H2OKVCluster): accumulated attention of all prompt queries, computed
    in query blocks; with h2o_normalize divided by the number of queries that saw each token (S - i)."""

    name = "h2o"
    params = (H2O_NORMALIZE, GQA_REDUCE)

    def scores(self, q: Tensor, k: Tensor, memo: dict | None = None) -> Tensor:
        sums = reduce_groups(column_sums(q, k, memo), self.gqa_reduce)
        if self.h2o_normalize:
            S = k.shape[2]
            sums = sums / (S - torch.arange(S, device=k.device)).float()
        return sums


class SnapKVPrompt(PromptCompressor):
    """SnapKV (Li et al., NeurIPS 2024, arXiv:2404.14469): the last obs_window queries vote (attention
    summed), the votes are 1-D pooled (stride 1, padding k // 2), top-k per KV head, the window itself always
    kept. GQA: pooled per query head, then reduced over the group (kvpress's order); the official code instead
    keeps one cache per query head. Defaults: the paper's LongBench configs (w = 32, kernel 7, max pooling).
    """

    name = "snapkv"
    params = (OBS_WINDOW, POOL_KERNEL, POOL, GQA_REDUCE)
    window_param = "obs_window"

    def scores(self, q: Tensor, k: Tensor, memo: dict | None = None) -> Tensor:
        S = k.shape[2]
        prefix = S - min(self.obs_window, S)
        votes = window_votes(q, k, min(self.obs_window, S), memo)[..., :prefix]  # [B, H_kv, g, prefix]
        pool = F.max_pool1d if self.pool == "max" else F.avg_pool1d
        flat = votes.reshape(-1, 1, prefix)
        pooled = pool(flat, self.pool_kernel, stride=1, padding=self.pool_kernel // 2) if prefix else flat
        scores = reduce_groups(pooled.view(votes.shape), self.gqa_reduce)
        return F.pad(scores, (0, S - prefix))  # the window is protected by select()


class PyramidKVPrompt(SnapKVPrompt):
    """PyramidKV (Cai et al., arXiv:2406.02069): SnapKV's scores under pyramid layer budgets (--layer-budget
    pyramid, beta 20). Defaults from its reference run_longbench.py: w = 8, kernel 7, max pooling."""

    name = "pyramidkv"
    params = SnapKVPrompt.params.with_defaults(obs_window=8)
    default_layer_budget = "pyramid"


class KNormPrompt(PromptCompressor):
    """KNorm (Devoto et al., EMNLP 2024, arXiv:2406.11430): keep the keys with the lowest L2 norm."""

    name = "knorm"

    def scores(self, q: Tensor, k: Tensor, memo: dict | None = None) -> Tensor:
        return key_norm_rank(k.float().norm(dim=-1), torch.arange(k.shape[2], device=k.device))


class TOVAPrompt(PromptCompressor):
    """TOVA (Oren et al., EMNLP 2024, arXiv:2401.06104): the last prompt query's attention averaged over all
    heads of the layer; one kept set shared by the layer's KV heads."""

    name = "tova"

    def scores(self, q: Tensor, k: Tensor, memo: dict | None = None) -> Tensor:
        layer_mean = last_query_attention(q, k, memo).mean(dim=(1, 2), keepdim=True)[:, :, 0]  # [B, 1, S]
        return layer_mean.expand(k.shape[:3])


PROMPT_COMPRESSORS: dict[str, type[PromptCompressor]] = {
    cls.name: cls
    for cls in (WindowPrompt, RandomPrompt, H2OPrompt, SnapKVPrompt, PyramidKVPrompt, KNormPrompt, TOVAPrompt)
}
