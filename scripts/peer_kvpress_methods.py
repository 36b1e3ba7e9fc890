"""The methods the peer check compares (scripts/peer_kvpress.py): each one's kvpress press and parameters, kvfast's
compressor and parameters, and the differences between the two implementations that the report lists."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Method:
    """One method on both sides: kvpress's press class and parameters, kvfast's compressor and parameters."""

    press: str
    press_params: dict[str, Any]
    compressor: str
    ours: dict[str, Any]
    differences: tuple[str, ...] = field(default=())


def prose(text: str) -> str:
    """A paragraph written over several source lines, as one line."""
    return " ".join(text.split())


COMMON_DIFFERENCES = (
    prose("""kvpress keeps the pruned cache in top-k order, kvfast in position order; attention does not
          depend on the order, only the floating-point summation order changes."""),
    prose("""kvpress attends with transformers' SDPA over a DynamicCache and reads the question as one causal
          chunk; kvfast feeds the question token by token through its decode step (same mathematics, another
          summation order). The `full` row measures what this costs."""),
    prose("""Ties between equal scores are broken by each side's top-k (kvfast: torch.topk on float64 scores
          with the protected positions at +inf; kvpress: torch.topk on the press's scores)."""),
)

METHODS: dict[str, Method] = {
    "snapkv": Method(
        "SnapKVPress", {"window_size": 64, "kernel_size": 5}, "snapkv",
        {"obs_window": 64, "pool_kernel": 5, "pool": "avg", "gqa_reduce": "mean", "n_sinks": 0},
        (prose("""kvfast's SnapKV defaults (window 32, kernel 7, max pooling: the paper's LongBench settings)
               are set to kvpress's (window 64, kernel 5, average pooling); both pool each query head's votes,
               then average the GQA group, and always keep the window."""),
         prose("""kvpress averages the window's attention rows, kvfast sums them: a constant factor, the same
               ranking."""))),
    "streaming": Method(
        "StreamingLLMPress", {"n_sink": 4}, "window", {"n_sinks": 4},
        (prose("""Both keep the 4 sinks and the most recent int(S (1 - r)) - 4 context tokens; neither
               re-rotates the kept keys (kvpress would need KeyRerotationPress, kvfast keeps original
               positions by design)."""),)),
    "tova": Method(
        "TOVAPress", {}, "tova", {"n_sinks": 0},
        (prose("""kvpress forces the last context token into the kept set (score = max + 1); kvfast ranks it
               by its attention like every other token (usually high: it is the query's own key). The
               append-only policy has no recent-window parameter to force it."""),
         prose("""Both average the last query's attention over all query heads of the layer, so every KV head
               of a layer keeps the same tokens."""))),
    "knorm": Method(
        "KnormPress", {}, "knorm", {"n_sinks": 0},
        (prose("""kvfast ranks keys by their L2 norm rounded to fp16, newer token first among equal fp16 norms
               (so that eager and compiled runs agree); kvpress ranks fp32 norms. Only keys whose norms agree
               to fp16 precision at the edge of the kept set can differ."""),)),
    "kvzip": Method(
        "KVzipPress",
        {"layerwise": False, "n_sink": 4, "kvzip_plus_normalization": False, "chunk_size": 2048},
        "kvzip", {"kvzip_chunk": 2048, "kvzip_plus": False, "n_sinks": 4},
        (prose("""kvpress ranks all (layer, KV head, token) scores jointly (layerwise=False, its default):
               layers and heads keep different numbers of tokens, the same total (up to rounding); it masks
               the pruned keys (a fake key with zero attention) instead of removing them. kvfast keeps
               int(S (1 - r)) tokens in every layer and KV head (a static cache). A real difference in what is
               kept; kvpress's layerwise=True would still share a budget across the heads of a layer."""),
         prose("""Repeat prompt: kvpress builds it from the tokenizer's chat template and treats the
               template's prefix (SmolLM2's default system prompt, ~20 tokens) as not part of the context.
               With raw prompts that would leave the first ~20 context tokens unscored, so the kvpress side
               gets a copy of the tokenizer whose template has no prefix and the model's end-of-turn +
               assistant header as suffix (--kvzip-suffix chat, kvfast's choice for a tokenizer with a chat
               format) or no template (raw: suffix \\n)."""),
         prose("""Scores come from a second pass over the context on both sides: kvpress really prefills the
               context, then repeats it through the model; kvfast reuses the recorded prefill's K/V."""))),
    "expected_attention": Method(
        "ExpectedAttentionPress",
        {"n_future_positions": 512, "n_sink": 4, "use_covariance": True, "use_vnorm": True, "epsilon": 0.0},
        "expected_attention", {"n_future_positions": 512, "epsilon": 0.0, "n_sinks": 4},
        (prose("""kvpress gives the 4 sinks the whole batch's maximum + 1, kvfast its row's maximum + 1 (the
               same ranking at batch size 1); kvfast derives the pre-RoPE queries by un-rotating the recorded
               post-RoPE ones, kvpress projects them again (fp32 rounding only)."""),)),
}
