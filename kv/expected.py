"""Expected Attention (Devoto, Jeblick, Jégou, arXiv:2510.00636; kvpress's ExpectedAttentionPress).

The next queries are modelled as Gaussian: per query head, the mean mu and covariance Sigma of the prompt's
pre-RoPE queries (the first N_SINK left out, as outliers). Their RoPE rotation is averaged over the next
positions, R = mean of R(p) for p in [t, t + n_future_positions), so mu' = R mu and Sigma' = R Sigma R^T, and
the expected (unnormalised) attention of a post-RoPE key k is E[exp(q.k / sqrt(d))] = exp(z) with

    z = mu'.k / sqrt(d) + 0.5 k^T Sigma' k / d.

A token's score is (softmax over the non-sink tokens of z, mean over the g query heads of its KV head
+ epsilon) * ||v||. In the rotate-half layout R(p) x = x * cos(p) + rotate_half(x) * sin(p), so an average
of rotations is the same map with averaged cos and sin, and the queries the model rotated are rotated back
with R(p)^T = R(-p); no D x D matrix and no max_seq_len table is ever built.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kv.params import N_SINKS, RECENT_WINDOW, Param, nonnegative, whole
from kv.prompt import PromptCompressor, memoized
from kv.scored import ScoredCache
from kv.slots import INF
from kv.storage import put_rows
from model import KVFastError, ModelArgs, rope_frequencies

N_SINK = 4  # kvpress's n_sink: the first queries are outliers for the statistics, the first keys always kept


def inverse_frequencies(model_args: ModelArgs | None, who: str) -> Tensor:
    """RoPE's inverse frequencies [D/2] (float64, llama3 scaling included) of the model, or a clear error."""
    if model_args is None:
        raise KVFastError(f"{who} needs the model's ModelArgs to undo and average RoPE: build it with "
                          "cache.make_cache_factory(..., model_args) or pass model_args=")
    return rope_frequencies(model_args)


def rope_cos_sin(inv_freq: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin [n, D] (fp32, rotate-half layout) at `positions` [n], computed like model.rope_tables rows."""
    angles = positions.double().unsqueeze(-1) * inv_freq.to(positions.device)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """R x along the last dim for R = diag(cos) + diag(sin) P, P the rotate-half map [-x2, x1]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def average_rotation(inv_freq: Tensor, start: Tensor | int, n: int) -> tuple[Tensor, Tensor]:
    """cos, sin [D] of the mean rotation over positions start .. start + n - 1 (start: an int or a [1] tensor,
    so the compiled refresh() keeps one graph for every position)."""
    positions = torch.arange(n, dtype=torch.float64, device=inv_freq.device) + start
    cos, sin = rope_cos_sin(inv_freq, positions)
    return cos.mean(0), sin.mean(0)


def sink_count(seq_len: int) -> int:
    """Tokens left out as sinks: N_SINK, but never all (a prompt of <= N_SINK tokens scores its last one)."""
    return min(N_SINK, seq_len - 1)


def prerope_queries(q: Tensor, inv_freq: Tensor, start: int = 0) -> Tensor:
    """The queries of positions start..S-1 before RoPE, [B, H, S - start, D] fp32: RoPE is orthogonal, so the
    query at position p is R(p)^T q = q * cos(p) - rotate_half(q) * sin(p)."""
    cos, sin = rope_cos_sin(inv_freq, torch.arange(start, q.shape[2], device=q.device))
    return rotate(q[:, :, start:].float(), cos, -sin)


def query_moments(q: Tensor, n_kv_heads: int, inv_freq: Tensor,
                  memo: dict | None = None) -> tuple[Tensor, Tensor]:
    """Mean [B, H_kv, g, D] and covariance [B, H_kv, g, D, D] of the non-sink pre-RoPE prompt queries, divided
    by their count (kvpress); memoized, as they depend on neither the budget nor the hyper-parameters."""
    def compute() -> tuple[Tensor, Tensor]:
        B, H, S, D = q.shape
        pre = prerope_queries(q, inv_freq, sink_count(S))
        mean = pre.mean(dim=2, keepdim=True)
        centered = pre - mean
        cov = centered.transpose(-1, -2) @ centered / pre.shape[2]
        g = H // n_kv_heads
        return mean.view(B, n_kv_heads, g, D), cov.view(B, n_kv_heads, g, D, D)
    return memoized(memo, ("expected_attention_moments", N_SINK), compute)


def rotate_moments(mean: Tensor, cov: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """(R mu, R Sigma R^T): rotating Sigma's rows gives Sigma R^T, then its transpose's rows R Sigma^T R^T."""
    return rotate(mean, cos, sin), rotate(rotate(cov, cos, sin).transpose(-1, -2), cos, sin).transpose(-1, -2)


def log_expected_attention(k: Tensor, mean: Tensor, cov: Tensor) -> Tensor:
    """z = mu'.k / sqrt(d) + 0.5 k^T Sigma' k / d, [B, H_kv, g, n] for keys k [B, H_kv, n, D] (fp32)."""
    d = k.shape[-1]
    kf = k.float().unsqueeze(2)  # [B, H_kv, 1, n, D]: every query head of the group, no copy
    linear = torch.matmul(kf, mean.unsqueeze(-1)).squeeze(-1)
    quadratic = (torch.matmul(kf, cov) * kf).sum(-1)
    return linear / math.sqrt(d) + quadratic / (2 * d)


def prompt_log_attention(q: Tensor, k: Tensor, inv_freq: Tensor, n_future: int,
                         memo: dict | None = None) -> Tensor:
    """z of every prompt key [B, H_kv, g, S] for the statistics rotated to the S .. S + n_future - 1 queries;
    memoized for the compressor and the decode policy alike."""
    def compute() -> Tensor:
        mean, cov = query_moments(q, k.shape[1], inv_freq, memo)
        rotation = average_rotation(inv_freq, k.shape[2], n_future)
        return log_expected_attention(k, *rotate_moments(mean, cov, *rotation))
    return memoized(memo, ("expected_attention_logits", N_SINK, n_future), compute)


class ExpectedAttentionPrompt(PromptCompressor):
    """Expected Attention (Devoto, Jeblick, Jégou, arXiv:2510.00636): kvpress's ExpectedAttentionPress, its
    defaults (n_sink 4, 512 future positions, covariance and ||v|| rescaling on, epsilon 0).

    The first N_SINK tokens score the row's maximum + 1 (kvpress: the whole tensor's maximum + 1; the ranking
    within a row is the same, and a row's scores do not depend on the other rows of the batch)."""

    name = "expected_attention"
    params = (Param("n_future_positions", 512, "the next query positions over which the RoPE "
                    "rotation of the query statistics is averaged", check=whole(1)),
              Param("epsilon", 0.0, "added to the expected attention before the ||v|| "
                    "rescaling", check=nonnegative))
    uses_values = True

    def scores(self, q: Tensor, k: Tensor, memo: dict | None = None, v: Tensor | None = None) -> Tensor:
        if v is None:
            raise KVFastError("expected_attention scores rescale by ||v||: call scores(q, k, memo, v)")
        inv_freq = inverse_frequencies(self.model_args, "expected_attention prompt compression").to(k.device)
        start = sink_count(k.shape[2])
        z = prompt_log_attention(q, k, inv_freq, self.n_future_positions, memo)[..., start:]
        probs = torch.softmax(z, dim=-1).mean(dim=2)
        scores = (probs + self.epsilon) * v[:, :, start:].float().norm(dim=-1)
        sinks = (scores.amax(dim=-1, keepdim=True) + 1).expand(*scores.shape[:2], start)
        return torch.cat([sinks, scores], dim=-1)


class ExpectedAttentionCache(ScoredCache):
    """Expected Attention (Devoto, Jeblick, Jégou, arXiv:2510.00636) while decoding: evict the slot with the
    lowest (softmax over the non-sink slots of z, mean over the group, + epsilon) * ||v||.

    Deviations from kvpress's DecodingPress(ExpectedAttentionPress), which re-scores the whole cache every 512
    steps: one token in, one out per step; the query statistics are frozen from the prompt (the cache never
    sees decode queries, where DecodingPress re-estimates them from a buffer of recent hidden states); the
    rotation is averaged over the true next positions [t, t + n_future_positions) (DecodingPress passes the
    buffer's length as the position), re-rotated and every slot re-scored by refresh() every refresh_interval
    steps; between refreshes a new token is scored with the same rotation as the slots it competes with.
    Sinks: the policy's n_sinks (4, kvpress's n_sink) are protected and left out of the softmax. A recent
    window of 8 (kvpress has none; 8 slots are noise against budgets of hundreds) keeps the last tokens, whose
    strong local attention lives in the high-frequency RoPE components that averaging over 512 positions
    cancels: z cannot see it. refresh_interval 64: the averaging window moves by 1/8 of its 512 positions
    between refreshes, where the components that survive the averaging (periods of 512 and more) turn by less
    than 1/8 of a period, while re-scoring (a D x D form per slot and query head) is amortized over 64 steps.
    ||v|| is taken from the V written to each slot, at full precision even with --kv-bits. Overhead: two
    D x D matrices per query head beside the per-slot z and ||v||."""

    name = "expected_attention"
    params = (N_SINKS(4), RECENT_WINDOW(8), *ExpectedAttentionPrompt.params.values(),
              Param("refresh_interval", 64, "every that many decode steps, rotate the "
                    "statistics to the current position and re-score every slot", check=whole(1)))
    default_prompt_compressor = "expected_attention"
    supports_pos_shift = False  # its scores rotate the query statistics to absolute positions
    statistic, per_query_head = "log_attn", True  # z of each slot's key, per query head

    def init_state(self) -> None:
        super().init_state()
        B, H, g, C, D = self.batch_size, self.n_kv_heads, self.n_groups, self.capacity, self.head_dim
        inv_freq = inverse_frequencies(self.model_args, "the expected_attention cache")
        self.register_buffer("inv_freq", inv_freq.to(self.device), persistent=False)
        # pre-RoPE moments, kept to re-rotate them as the future positions move; rotated ones for scoring
        for name in ("query_mean", "mean_rotated"):
            self.add_state(name, (B, H, g, D))
        for name in ("query_cov", "cov_rotated"):
            self.add_state(name, (B, H, g, D, D))
        # written with V itself (write_slots), so reset() need not clear it: empty slots are never scored
        self.register_buffer("v_norm", torch.zeros(B, H, C, device=self.device), persistent=False)

    def write_slots(self, slot: Tensor | None, k: Tensor, v: Tensor) -> None:
        # every write of V (prefill, decode, fill_synthetic) records its norm, before any quantization
        super().write_slots(slot, k, v)
        norm = v.float().norm(dim=-1)
        if slot is None:
            self.v_norm[:, :, : norm.shape[2]] = norm
        else:
            put_rows(self.v_norm, slot, norm)

    def rotate_statistics(self, t: Tensor | int) -> None:
        """Rotate the query moments for the queries of positions t .. t + n_future_positions - 1."""
        cos, sin = average_rotation(self.inv_freq, t, self.n_future_positions)
        mean, cov = rotate_moments(self.query_mean, self.query_cov, cos, sin)
        self.mean_rotated.copy_(mean)
        self.cov_rotated.copy_(cov)

    def slot_scores(self, input_pos: Tensor) -> Tensor:
        scored = (self.slot_pos >= 0) & ~self.is_sink(self.slot_pos)  # sinks: protected, outside the softmax (kvpress)
        z = self.log_attn.masked_fill(~scored.unsqueeze(2), -INF)
        probs = torch.softmax(z, dim=-1).mean(dim=2)  # NaN on a row with nothing scored: replaced below
        return torch.where(scored, (probs + self.epsilon) * self.v_norm, 0.0)

    def after_load(self) -> None:
        self.rotate_statistics(self.seen)  # to the batch's clock, which the rows' keys were moved to

    def token_statistic(self, k: Tensor) -> Tensor:
        return log_expected_attention(k, self.mean_rotated, self.cov_rotated)  # [B, H_kv, g, 1]

    def refresh(self) -> None:
        self.rotate_statistics(self.seen)
        keys = self.keys_values()[0]  # dequantized with --kv-bits: the keys attention reads
        self.log_attn.copy_(log_expected_attention(keys, self.mean_rotated, self.cov_rotated))

    def prefill_state(self, q: Tensor, k: Tensor, keep: Tensor | None, memo: dict) -> None:
        mean, cov = query_moments(q, self.n_kv_heads, self.inv_freq, memo)
        self.query_mean.copy_(mean)
        self.query_cov.copy_(cov)
        self.rotate_statistics(k.shape[2])
        super().prefill_state(q, k, keep, memo)

    def prompt_statistic(self, q: Tensor, k: Tensor, memo: dict) -> Tensor:
        return prompt_log_attention(q, k, self.inv_freq, self.n_future_positions, memo)

    def synthetic_state(self, generator: torch.Generator | None) -> None:
        D = self.head_dim
        self.query_mean.copy_(torch.randn(self.query_mean.shape, generator=generator))
        a = torch.randn(self.query_cov.shape, generator=generator) / math.sqrt(D)
        self.query_cov.copy_(a @ a.transpose(-1, -2))
        self.refresh()
