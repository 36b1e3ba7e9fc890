"""The slot cache: a policy's mechanics over the slot storage, with the features every policy shares.

Storage (kv.storage): k, v [B, H_kv, C, D] and slot_pos [B, H_kv, C] (the original position of the token in each
slot, -1 = empty), plain or quantized. Keys are stored after RoPE at their original position, so eviction leaves
gaps and nothing is ever re-rotated. A new token overwrites one slot per KV head, chosen by

    argmin over slots of  score(slot)   with  empty slots -> -inf,
                                               sinks (pos < n_sinks) and the recent window
                                               (pos > t - recent_window) -> +inf

so empty slots fill first, protected tokens never leave, and a policy only defines `slot_scores` (low =
evicted first) and the statistics behind it. Every row of the batch and every KV head chooses on its own.

Features layered on it, each a mixin of its own module: speculation's rollback (kv.rollback), bench filling
(kv.synthetic), ragged rows (kv.rows), where the tiers find the recall slots (kv.tierslots). Optional
capabilities are composed onto a policy class by the factory: streaming positions (kv.posshift.shifted) and
tiers (kv.tiers.tiered). The model sees only the contract (kv.contract.AttentionCache).

Hooks a policy may override (kv.scored.ScoredCache implements the statistics ones for score-based policies):
    init_state()                 register its statistics with add_state()
    slot_scores(input_pos)       [B, H_kv, C] float, low = evicted first
    on_insert(slot, k, pos)      reset/seed the statistics of the slots just overwritten
    observe(probs)               attention of the new query [B, H_kv, g, 1, C] (when needs_attention)
    prefill_state(q, k, keep, memo)  seed the statistics of the kept prompt tokens
    refresh()                    periodic work outside the decode graph, every refresh_interval steps
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from kv.params import Configurable
from kv.rollback import Rollback
from kv.rows import RaggedRows
from kv.storage import INF, SlotStorage, put_rows
from kv.synthetic import SyntheticFill
from kv.tierslots import TierSlots
from model import KVFastError, ModelArgs


def reduce_groups(x: Tensor, how: str, dim: int = 2) -> Tensor:
    """Reduce the g query heads of a GQA group to their KV head (DESIGN.md: mean by default, or max)."""
    return x.mean(dim) if how == "mean" else x.amax(dim)


def counter_hash(pos: Tensor, t: Tensor | int, salt: Tensor) -> Tensor:
    """Pseudo-random int64 scores in [0, 2^31 - 1) from (position, step, salt), counter-based.

    Random eviction draws its choice from this hash instead of torch.rand so that eager and compiled decoding
    evict the same token (a compiled RNG stream differs from eager's). Integer arithmetic stays below 2^63.
    Two rounds of the MINSTD multiplier mix the inputs."""
    modulus = 2147483647
    x = (pos * 1000003 + t * 7919 + salt) % modulus + 1
    x = (x * 48271) % modulus
    return (x * 48271) % modulus


def row_head_salt(batch_size: int, n_heads: int, layer: int, device: str | torch.device = "cpu") -> Tensor:
    """[B, H, 1] salts for counter_hash that depend only on (layer, row, head), not on the batch size."""
    rows = torch.arange(batch_size).view(-1, 1, 1)
    heads = torch.arange(n_heads).view(1, -1, 1)
    return counter_hash(rows * 4099 + heads, layer, torch.tensor(12345)).to(device)


def gather_tokens(x: Tensor, keep: Tensor | None, n: int) -> Tensor:
    """Per-token statistics x [..., S] -> [..., n] at the kept positions keep [B, H_kv, n] (None: first n).

    x has the [B, H_kv] leading dims of keep, possibly with extra dims in between (e.g. g)."""
    if keep is None:
        return x[..., :n]
    index = keep.view(keep.shape[:2] + (1,) * (x.dim() - 3) + keep.shape[2:])
    return x.gather(-1, index.expand(x.shape[:-1] + (n,)))


class KVCache(Configurable, Rollback, SyntheticFill, RaggedRows, TierSlots, SlotStorage):
    """Shared slot mechanics. Subclasses set `name`, `params` (kv.params) and `slot_scores`, and the hooks
    they need."""

    # the contract's members (kv.contract) keep their defaults unless a policy or capability overrides them
    # False: append-only (full, snapkv, pyramidkv): the prompt is compressed to leave a slot per new token
    evicts: ClassVar[bool] = True
    # False: keeps every token (full): no budget, prompt compressor, layer schedule or tiers apply
    compresses: ClassVar[bool] = True
    # True: the capacity is n_sinks + recent_window, the window being all that is not a sink (window)
    window_fills_capacity: ClassVar[bool] = False
    # True: one pool of slots per layer shared by the KV heads, H_kv x the budget (kv.pool; the contract's
    # layout "pool"): what the factory's budget checks read
    shared_pool: ClassVar[bool] = False
    # True when the kept positions never depend on the content (full, window)
    position_only: ClassVar[bool] = False
    default_prompt_compressor: ClassVar[str | None] = None
    default_layer_budget: ClassVar[str] = "uniform"
    # the kinds of KV head a policy that classifies its heads reports (hybrid, fastgen: head_classes())
    head_kinds: ClassVar[tuple[str, ...]] = ()
    # protection, overridden by params where a policy exposes them
    n_sinks: int = 0
    recent_window: int = 1  # counts the new token: the r - 1 newest cached tokens are protected
    # False where --pos-shift cannot apply: the cache never evicts, or its statistics rotate keys by position
    supports_pos_shift: ClassVar[bool] = True

    def __init__(self, batch_size: int, n_kv_heads: int, head_dim: int, capacity: int, *, n_groups: int = 1,
                 prompt_capacity: int | None = None, compressor=None, layer: int = 0,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 kv_bits: int | None = None, kv_group_size: int | None = None, kv_dtype: torch.dtype | None = None,
                 model_args: ModelArgs | None = None, **params: Any):
        super().__init__()
        self.set_params(params)
        self.batch_size, self.n_kv_heads, self.head_dim = batch_size, n_kv_heads, head_dim
        self.n_groups = n_groups
        self.capacity = capacity
        self.prompt_capacity = capacity if prompt_capacity is None else prompt_capacity
        self.compressor = compressor
        self.layer = layer
        self.model_args = model_args  # RoPE and shapes, for policies that need them (None in unit tests)
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype  # unquantized K/V's storage (float16: --kv-bits 16); attention reads dtype
        self.kv_bits, self.kv_group_size = kv_bits, (kv_group_size or head_dim) if kv_bits else None
        self.allocate((batch_size, n_kv_heads, capacity))
        # tokens seen so far = the next position; read once at the end for the report (no per-step sync)
        self.register_buffer("seen", torch.zeros(1, dtype=torch.long, device=device), persistent=False)
        self._state_fill: dict[str, float | int] = {}
        self.init_state()

    @classmethod
    def check_params(cls, given: dict[str, Any]) -> None:
        """Reject a combination of given parameters that cannot go together (each is checked on its own)."""

    def bind(self, tokenizer: Any) -> None:
        """Called by the cache factory with the model's tokenizer (for policies that read token classes)."""

    # ---- statistics buffers --------------------------------------------------------------------------
    def add_state(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
                  fill: float = 0) -> None:
        """Register a per-policy statistics buffer, refilled with `fill` by reset()."""
        self.register_buffer(name, torch.full(shape, fill, dtype=dtype, device=self.device), persistent=False)
        self._state_fill[name] = fill

    def init_state(self) -> None:
        """Register statistics buffers (policies with statistics override)."""

    def reset_state(self) -> None:
        for name, fill in self._state_fill.items():
            getattr(self, name).fill_(fill)

    def reset(self) -> None:
        """Empty the cache for a new sequence, reusing the buffers (compiled code holds on to them)."""
        self.slot_pos.fill_(-1)
        self.row_start.zero_()
        self.seen.zero_()
        self.reset_state()

    # ---- prefill -------------------------------------------------------------------------------------
    def prefill(self, q: Tensor, k: Tensor, v: Tensor, memo: dict | None = None) -> None:
        """Fill an empty cache with a prompt's K/V [B, H_kv, S, D] (q: [B, H, S, D], post-RoPE).

        If the prompt is longer than `prompt_capacity`, the prompt compressor picks which tokens each KV head
        keeps (the policy's sinks and recent window always among them). `memo` (a dict, one per sample and
        layer) lets a caller that prefills once and tries many policies/budgets reuse the budget-independent
        prompt statistics (compressor scores, H2O column sums, ...)."""
        B, H, S, D = k.shape
        n = min(S, self.prompt_capacity)
        if S <= self.prompt_capacity:
            keep, kept_k, kept_v = None, k, v
            pos = torch.arange(S, device=k.device).expand(B, H, S)
        else:
            if self.compressor is None:
                raise KVFastError(f"prompt of {S} tokens does not fit the {self.name!r} cache of "
                                  f"{self.prompt_capacity} slots and no prompt compressor is set")
            keep = pos = self.compressor.select(q, k, n, self.n_sinks, self.recent_window, memo, v)  # [B, H, n]
            index = keep.unsqueeze(-1).expand(B, H, n, D)
            kept_k, kept_v = k.gather(2, index), v.gather(2, index)
        self.store_prompt(pos, kept_k, kept_v)
        self.seen.fill_(S)
        self.reset_state()
        self.prefill_state(q, k, keep, memo if memo is not None else {})

    def store_prompt(self, pos: Tensor, k: Tensor, v: Tensor) -> None:
        """The kept prompt tokens (K/V [B, H_kv, n, D] at positions pos [B, H_kv, n]) into slots 0..n-1, the rest
        empty."""
        n = pos.shape[-1]
        self.write_slots(None, k, v)
        self.slot_pos[:, :, :n] = pos
        self.slot_pos[:, :, n:] = -1

    def prefill_state(self, q: Tensor, k: Tensor, keep: Tensor | None, memo: dict) -> None:
        """Seed the statistics of the kept prompt tokens (keep: [B, H_kv, n] positions, None = all)."""

    # ---- decode --------------------------------------------------------------------------------------
    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Write one token's K/V ([B, H_kv, 1, D]) at position input_pos ([1]); return all slots + mask."""
        return self.insert(self.choose_slot(input_pos), input_pos, k, v)

    def insert(self, slot: Tensor, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """update() after the choice: the new token into slot [B, H_kv] (kv.tiers demotes its old token first).
        The mask is the slots' positions (attention.attend: live where >= 0), valid until the next update."""
        B, H = slot.shape
        self.write_slots(slot.view(B, H, 1), k, v)
        put_rows(self.slot_pos, slot.view(B, H, 1), input_pos.view(1, 1, 1).expand(B, H, 1))
        self.seen.copy_(input_pos + 1)
        self.on_insert(slot, k, input_pos)
        return *self.keys_values(attention=True), self.slot_pos.unsqueeze(2)

    def choose_slot(self, input_pos: Tensor) -> Tensor:
        """Per KV head, the slot the new token goes to: an empty one, else the lowest-scored evictable one."""
        return self.protect(self.slot_scores(input_pos), input_pos).argmin(dim=-1)

    def protect(self, scores: Tensor, t: Tensor) -> Tensor:
        """Scores with sinks and the recent window (before the incoming position t) at +inf, empty at -inf."""
        pos = self.slot_pos
        kept = self.is_sink(pos) | (pos > t - self.recent_window)
        return self.shield_recall(scores.masked_fill(kept, INF).masked_fill(pos < 0, -INF))

    def is_sink(self, pos: Tensor) -> Tensor:
        """Positions pos (slot_pos-shaped) among their row's first n_sinks tokens."""
        return pos - self.row_start < self.n_sinks

    def slot_scores(self, input_pos: Tensor) -> Tensor:
        raise NotImplementedError

    def on_insert(self, slot: Tensor, k: Tensor, input_pos: Tensor) -> None:
        """Reset per-slot statistics of the slots just overwritten (slot [B, H_kv]; k [B, H_kv, 1, D])."""

    # ---- reporting (read once at the end) -----------------------------------------------------------------
    def kept(self) -> Tensor:
        """Valid slots per (row, KV head)."""
        return (self.slot_pos >= 0).sum(-1)

    def tokens_seen(self) -> int:
        return int(self.seen.item())

    def overhead_bytes(self) -> int:
        """Bytes of bookkeeping beside K/V: slot positions and the policy's statistics."""
        return sum(b.numel() * b.element_size() for b in self.buffers()) - self.physical_bytes()
