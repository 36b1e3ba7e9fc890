"""The cache contract: everything model.py, attention.attend and the decode loop may ask of a layer's cache.

Every cache derives from AttentionCache (kv.slots.KVCache and the pool, kv.pool; eval's wrappers; the
stand-ins that record a prefill), so the model reads these members directly and never probes a cache.
A member's default is what a cache that does not care about it behaves like; a capability (tiers, FastGen's
token classes, streaming positions) overrides the members it needs and nothing else changes in the model.

The attention call, per layer and step (model.Attention.forward):

    prefill:  cache.prefill(q, k, v)                       the prompt's K/V, after causal attention on them
    decode:   cache.recall(q)                              only on the decoder's recall steps (kv.tiers)
              k_all, v_all, mask = cache.update(input_pos, k, v)
              q = cache.rotate_query(q)                    only with pos_shift: the model left q unrotated
              attend(q, k_all, v_all, mask, needs_attention, fuse_one_query, channel_blocks, layout)
              cache.observe(probs)                         only with needs_attention

and once per forward, before the layers, cache.see_tokens(idx) (the ids fed). The decode loop (decode.Decoder)
adds refresh_interval / compile_refresh / refresh() and, where `tiers` is set, the tiers' flush and recall.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal, get_args

from torch import Tensor, nn

Layout = Literal["uniform", "pool"]
LAYOUTS: tuple[Layout, ...] = get_args(Layout)


class AttentionCache(nn.Module):
    """A layer's KV cache as the model sees it (see the module doc). Subclasses override what applies."""

    # ---- what the attention call reads ---------------------------------------------------------------------
    layout: ClassVar[Layout] = "uniform"
    """update()'s K/V: "uniform" [B, H_kv, C, D]; "pool" [B, P, D], shared by the KV heads (kv.pool)."""
    needs_attention: bool = False
    """True: attention computes explicit probabilities and observe() receives them (else fused kernels)."""
    fuse_one_query: bool = True
    """May a compiled CPU decode step attend through attention.attend_one_query (4-bit K/V may say no)?"""
    channel_blocks: Callable[[], tuple[tuple, tuple]] | None = None
    """What attend_one_query reads instead of update()'s K/V (quantized codes in place); None: those."""
    pos_shift: bool = False
    """True: keys stored before RoPE; the model leaves q, k unrotated and calls rotate_query (kv.posshift)."""

    # ---- what the decode loop reads ------------------------------------------------------------------------
    refresh_interval: int | None = None
    """Call refresh() every that many decode steps (None: never)."""
    compile_refresh: bool = True
    """Compile refresh() (False where its eager version is faster)."""
    tiers: Any = None
    """kv.tiers.TierSpec where evicted tokens go to a warm store: the decoder's flush() and recall() apply."""
    prompt_traceable: bool = True
    """May --compile-prefill trace prefill() into its dynamic-shape graph (False: sizes that depend on data)?"""

    def prefill(self, q: Tensor, k: Tensor, v: Tensor, memo: dict | None = None) -> None:
        """Take a fresh prompt's K/V [B, H_kv, S, D] (q [B, H, S, D], post-RoPE); memo: reusable statistics."""
        raise NotImplementedError(f"{type(self).__name__} takes no prompt")

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Write the new token(s) at input_pos; return every slot's K, V (in `layout`) and attend()'s mask."""
        raise NotImplementedError(f"{type(self).__name__} does not decode")

    def observe(self, probs: Tensor) -> None:
        """The new query's attention [B, H_kv, g, 1, C] over the slots (called only when needs_attention)."""

    def rotate_query(self, q: Tensor) -> Tensor:
        """q [B, H, 1, D] rotated where this cache places it (pos_shift); unchanged otherwise."""
        return q

    def see_tokens(self, idx: Tensor) -> None:
        """The token ids [B, S] about to be fed (FastGen classes tokens by them); nothing by default."""

    def recall(self, q: Tensor) -> None:
        """Bring back evicted tokens the query q [B, H, 1, D] needs, before update() (kv.tiers); no-op."""

    def refresh(self) -> None:
        """Periodic work outside the decode graph, every refresh_interval steps; nothing by default."""

    def reset(self) -> None:
        """Empty the cache for a new sequence, keeping its buffers; nothing by default."""
