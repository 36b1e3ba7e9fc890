"""The slot cache: fixed buffers per layer and the mechanics every policy shares.

Buffers (DESIGN.md, "The cache contract"): k, v [B, H_kv, C, D] and slot_pos [B, H_kv, C] (the original
position of the token in each slot, -1 = empty). Keys are stored after RoPE at their original position, so
eviction leaves gaps and nothing is ever re-rotated. Shapes never change, so the compiled decode step never
recompiles: a new token overwrites one slot per KV head, chosen by

    argmin over slots of  score(slot)   with  empty slots -> -inf,
                                               sinks (pos < n_sinks) and the recent window
                                               (pos > t - recent_window) -> +inf

so empty slots fill first, protected tokens never leave, and a policy only defines `slot_scores` (low =
evicted first) and the statistics behind it. Every row of the batch and every KV head chooses on its own.

With kv_bits (8 or 4), k and v hold uint8 codes ([B, H_kv, C, D] or packed [B, H_kv, C, D/2]) beside fp32
k_scale / k_zero / v_scale / v_zero [B, H_kv, C, D/group]: write_slots quantizes only the tokens it writes,
keys_values dequantizes for attention (kv.quant), and a compiled decode step reads the codes in place
(channel_blocks: model.Codes). With kv_dtype float16 (--kv-bits 16) k and v hold float16 values, read in the
compute dtype. Policies see full-precision K at insert and prefill.

With pos_shift (StreamingLLM's positions, --pos-shift) keys are stored before RoPE instead, slot_rank [B, H_kv, C]
holds each token's rank among the cached tokens (kept incrementally: an eviction lowers the rank of every later
token by one), and keys_values / rotate_query apply RoPE at those ranks, so the positions attention sees never
exceed the capacity and decoding can run past the model's max_seq_len.

Hooks a policy may override (kv.scored.ScoredCache implements the statistics ones for score-based policies):
    init_state()                 register its statistics with add_state()
    slot_scores(input_pos)       [B, H_kv, C] float, low = evicted first
    on_insert(slot, k, pos)      reset/seed the statistics of the slots just overwritten
    observe(probs)               attention of the new query [B, H_kv, g, 1, C] (when needs_attention)
    prefill_state(q, k, keep, memo)  seed the statistics of the kept prompt tokens
    refresh()                    periodic work outside the decode graph, every refresh_interval steps
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from kernels import Codes
from kv.params import Configurable
from kv.quant import dequantize_halves, dequantize_tokens, halves_share_groups, quantize_tokens, storage_width
from model import KVFastError, ModelArgs, apply_rope, rope_at

INF = float("inf")


_RANK_TABLES: dict[tuple, tuple[Tensor, Tensor]] = {}


def rank_tables(capacity: int, args: ModelArgs, device: torch.device) -> tuple[Tensor, Tensor]:
    """RoPE cos / sin [capacity, D] for ranks 0..capacity-1, one copy shared by every layer of that capacity."""
    key = (capacity, args.head_dim, args.rope_base, repr(args.rope_scaling), str(device))
    if key not in _RANK_TABLES:
        _RANK_TABLES[key] = rope_at(torch.arange(capacity, device=device), args)
    return _RANK_TABLES[key]


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



def put_rows(buffer: Tensor, slot: Tensor, value: Tensor) -> None:
    """buffer[..., slot[..., i], :] = value[..., i, :] for a buffer [*lead, C, *row] (slot [*lead, n], value
    [*lead, n, *row]), in place. Inductor writes just those rows; a scatter_ along the slot dimension became an
    out-of-place scatter plus a copy of the whole buffer back (every slot of K and V read and written, per layer
    and step: 15-20 % of an h2o step at 4096 tokens)."""
    lead = slot.shape[:-1]
    if buffer.is_contiguous():  # index_copy_ into the flattened rows
        C = buffer.shape[len(lead)]
        base = torch.arange(lead.numel(), device=slot.device).view(*lead, 1) * C
        buffer.view(lead.numel() * C, -1).index_copy_(0, (base + slot).flatten(), value.reshape(slot.numel(), -1))
    else:  # a strided view (eval's MultiCache members slice one buffer): advanced indexing, in place too
        index = [torch.arange(n, device=slot.device).view(*(n if i == d else 1 for i in range(len(lead))), 1)
                 for d, n in enumerate(lead)]
        buffer[(*index, slot)] = value



class KVCache(Configurable, nn.Module):
    """Shared slot mechanics. Subclasses set `name`, `params` (kv.params) and `slot_scores`, and the hooks
    they need."""

    # explicit attention probabilities are computed (and observe() called) only when True
    needs_attention: ClassVar[bool] = False
    # False: append-only (full, snapkv, pyramidkv): the prompt is compressed to leave a slot per new token
    evicts: ClassVar[bool] = True
    # False: keeps every token (full): no budget, prompt compressor or layer schedule applies
    compresses: ClassVar[bool] = True
    # True: the capacity is n_sinks + recent_window, the window being all that is not a sink (window)
    window_fills_capacity: ClassVar[bool] = False
    # True: one pool of slots per layer shared by the KV heads, H_kv x the budget (kv.pool)
    shared_pool: ClassVar[bool] = False
    # True when the kept positions never depend on the content (full, window)
    position_only: ClassVar[bool] = False
    default_prompt_compressor: ClassVar[str | None] = None
    default_layer_budget: ClassVar[str] = "uniform"
    # protection, overridden by params where a policy exposes them
    n_sinks: int = 0
    recent_window: int = 1  # counts the new token: the r - 1 newest cached tokens are protected
    refresh_interval: int | None = None  # read by generate.Decoder: call refresh() every that many steps
    compile_refresh = True  # generate.Decoder compiles refresh() (a policy whose eager refresh is faster says no)
    # the last recall_slots slots belong to the tiers (kv.tiers): never evicted by the policy, never prefilled
    recall_slots: int = 0
    # False where --pos-shift cannot apply: the cache never evicts, or its statistics rotate keys by position
    supports_pos_shift: ClassVar[bool] = True

    def __init__(self, batch_size: int, n_kv_heads: int, head_dim: int, capacity: int, *, n_groups: int = 1,
                 prompt_capacity: int | None = None, compressor=None, layer: int = 0,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 kv_bits: int | None = None, kv_group_size: int | None = None, kv_dtype: torch.dtype | None = None,
                 model_args: ModelArgs | None = None, pos_shift: bool = False, **params: Any):
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
        self.pos_shift = pos_shift
        if pos_shift:
            if not self.supports_pos_shift:
                raise KVFastError(f"--pos-shift does not apply to --cache {self.name}")
            # plain attributes, not buffers: one table serves every layer of this capacity
            self.rank_cos, self.rank_sin = rank_tables(capacity, model_args or ModelArgs(), self.device)
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

    # ---- K/V storage ---------------------------------------------------------------------------------
    def allocate(self, slots: tuple[int, ...]) -> None:
        """Register k, v (codes, scales and zero points when quantized) of shape [*slots, D] and slot_pos
        [*slots]; the pool layout (kv.pool) passes [B, P] instead of [B, H_kv, C]."""
        device, D = self.device, self.head_dim
        if self.kv_bits:
            codes = (*slots, storage_width(D, self.kv_bits))
            groups = (*slots, D // self.kv_group_size)
            for name in ("k", "v"):
                self.register_buffer(name, torch.zeros(codes, dtype=torch.uint8, device=device),
                                     persistent=False)
                for part in ("scale", "zero"):
                    zeros = torch.zeros(groups, dtype=torch.float32, device=device)
                    self.register_buffer(f"{name}_{part}", zeros, persistent=False)
        else:
            for name in ("k", "v"):
                self.register_buffer(name, torch.zeros((*slots, D), dtype=self.kv_dtype, device=device),
                                     persistent=False)
        self.register_buffer("slot_pos", torch.full(slots, -1, dtype=torch.long, device=device),
                             persistent=False)
        if self.pos_shift:
            self.register_buffer("slot_rank", torch.full(slots, -1, dtype=torch.long, device=device),
                                 persistent=False)
        # per row, the position of its first token: 0, except in a ragged batch (ragged.py), whose shorter prompts
        # start later on the batch's one clock; sinks count from there
        row_start = torch.zeros((slots[0],) + (1,) * (len(slots) - 1), dtype=torch.long, device=device)
        self.register_buffer("row_start", row_start, persistent=False)

    def kv_buffers(self) -> list[str]:
        """Names of the buffers that hold K/V (codes, scales and zero points when quantized)."""
        return ["k", "v"] if not self.kv_bits else ["k", "k_scale", "k_zero", "v", "v_scale", "v_zero"]

    def write_slots(self, slot: Tensor | None, k: Tensor, v: Tensor) -> None:
        """Store K/V [B, H_kv, n, D] in slots `slot` [B, H_kv, n] (None: slots 0..n-1), quantizing each token
        once if kv_bits."""
        if self.kv_bits:
            parts = [*quantize_tokens(k, self.kv_bits, self.kv_group_size),
                     *quantize_tokens(v, self.kv_bits, self.kv_group_size)]
        else:
            parts = [k.to(self.kv_dtype), v.to(self.kv_dtype)]
        for name, value in zip(self.kv_buffers(), parts):
            buffer = getattr(self, name)
            if slot is None:
                buffer[:, :, : value.shape[2]] = value
            else:
                put_rows(buffer, slot, value)

    @property
    def fuse_one_query(self) -> bool:
        """May a compiled CPU decode step attend through model.attend_one_query? Its fused reductions dequantize
        8-bit codes in place, and 4-bit ones as two halves of channels (channel_blocks); where those cannot be
        had, unpacking 4-bit codes into one tensor there costs 1.4x SDPA over the unpacked K/V (README)."""
        return self.kv_bits != 4 or self.channel_blocks is not None

    @property
    def channel_blocks(self) -> Callable[[], tuple[tuple, tuple]] | None:
        """What model.attend_one_query reads instead of keys_values() (None: keys_values): quantized K/V whose
        blocks of channels each have one scale group per token as Codes (8-bit: the whole head; 4-bit: the low and
        the high nibbles), read without dequantizing; other 4-bit groups that do not straddle the middle channel
        as the two halves, dequantized apart. Not with pos_shift (RoPE at the ranks needs the values)."""
        if not self.kv_bits or self.pos_shift:
            return None
        blocks = 1 if self.kv_bits == 8 else 2
        if self.kv_group_size in (self.head_dim, self.head_dim // blocks):
            return self.key_value_codes
        if self.kv_bits == 4 and halves_share_groups(self.head_dim, self.kv_group_size):
            return self.key_value_halves
        return None

    def key_value_codes(self) -> tuple[tuple[Codes, ...], tuple[Codes, ...]]:
        def blocks(codes: Tensor, scale: Tensor, zero: Tensor) -> tuple[Codes, ...]:
            if self.kv_bits == 8:
                return (Codes(codes, scale, zero),)
            if scale.shape[-1] == 1:  # one group for both halves: both nibbles in one pass
                return (Codes(codes, scale, zero, packed=True),)
            return (Codes(codes & 15, scale[..., :1], zero[..., :1]), Codes(codes >> 4, scale[..., 1:], zero[..., 1:]))

        return (blocks(self.k, self.k_scale, self.k_zero), blocks(self.v, self.v_scale, self.v_zero))

    def key_value_halves(self) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        return (dequantize_halves(self.k, self.k_scale, self.k_zero, self.dtype),
                dequantize_halves(self.v, self.v_scale, self.v_zero, self.dtype))

    def keys_values(self, attention: bool = False) -> tuple[Tensor, Tensor]:
        """Every slot's K and V [B, H_kv, C, D] in the compute dtype (dequantized if kv_bits; keys rotated to
        their ranks if pos_shift). attention: bfloat16 K/V stay bfloat16, for model.attend to attend in bfloat16."""
        if not self.kv_bits:
            keep = attention and self.kv_dtype == torch.bfloat16
            k, v = (self.k, self.v) if keep else (self.k.to(self.dtype), self.v.to(self.dtype))
        else:
            k = dequantize_tokens(self.k, self.k_scale, self.k_zero, self.kv_bits, self.dtype)
            v = dequantize_tokens(self.v, self.v_scale, self.v_zero, self.kv_bits, self.dtype)
        if self.pos_shift:
            rank = self.slot_rank.clamp(min=0)  # empty slots (-1) are masked anyway
            k = apply_rope(k, self.rank_cos[rank], self.rank_sin[rank])
        return k, v

    def token_kv(self, input_pos: Tensor) -> tuple[Tensor, Tensor]:
        """K and V [B, H_kv, 1, D] of the cached token at position input_pos ([1]; every row and KV head must hold
        it), in the compute dtype (speculate.py hands the full cache's to the draft)."""
        slot = (self.slot_pos == input_pos).int().argmax(-1, keepdim=True).unsqueeze(-1)  # [B, H_kv, 1, 1]
        k, *rest = (b.gather(2, slot.expand(*slot.shape[:3], b.shape[-1]))
                    for b in (getattr(self, name) for name in self.kv_buffers()))
        if not self.kv_bits:
            return k.to(self.dtype), rest[0].to(self.dtype)
        k_scale, k_zero, v, v_scale, v_zero = rest
        return (dequantize_tokens(k, k_scale, k_zero, self.kv_bits, self.dtype),
                dequantize_tokens(v, v_scale, v_zero, self.kv_bits, self.dtype))

    def rotate_query(self, q: Tensor) -> Tensor:
        """pos_shift: RoPE for the new query q [B, H, 1, D] (stored unrotated) at its rank, the number of cached
        tokens before it, per KV head (every head of the uniform layout holds as many)."""
        rank = self.kept() - 1  # the new token is in the cache already: update() ran
        cos, sin = (t[rank].repeat_interleave(self.n_groups, dim=1).unsqueeze(2) for t in (self.rank_cos, self.rank_sin))
        return apply_rope(q, cos, sin)

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
        if self.pos_shift:
            self.slot_rank.fill_(-1)
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
        if self.pos_shift:  # store the keys before RoPE (undo the rotation at their original positions)
            cos, sin = rope_at(pos, self.model_args or ModelArgs())
            kept_k = apply_rope(kept_k, cos, -sin)
            self.slot_rank.fill_(-1)
            self.slot_rank[:, :, :n] = pos.argsort(dim=-1).argsort(dim=-1)
        self.write_slots(None, kept_k, kept_v)
        self.slot_pos[:, :, :n] = pos
        self.slot_pos[:, :, n:] = -1
        self.seen.fill_(S)
        self.reset_state()
        self.prefill_state(q, k, keep, memo if memo is not None else {})

    def prefill_state(self, q: Tensor, k: Tensor, keep: Tensor | None, memo: dict) -> None:
        """Seed the statistics of the kept prompt tokens (keep: [B, H_kv, n] positions, None = all)."""

    # ---- decode --------------------------------------------------------------------------------------
    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Write one token's K/V ([B, H_kv, 1, D]) at position input_pos ([1]); return all slots + mask."""
        return self.insert(self.choose_slot(input_pos), input_pos, k, v)

    def insert(self, slot: Tensor, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """update() after the choice: the new token into slot [B, H_kv] (kv.tiers demotes its old token first)."""
        B, H = slot.shape
        if self.pos_shift:
            self.shift_ranks(slot.view(B, H, 1))
        self.write_slots(slot.view(B, H, 1), k, v)
        self.slot_pos.scatter_(2, slot.view(B, H, 1), input_pos.view(1, 1, 1).expand(B, H, 1))
        self.seen.copy_(input_pos + 1)
        self.on_insert(slot, k, input_pos)
        return *self.keys_values(attention=True), (self.slot_pos >= 0).unsqueeze(2)

    def shift_ranks(self, slot: Tensor) -> None:
        """pos_shift, before the new token overwrites `slot` [B, H_kv, 1]: the tokens after its evicted token
        move down one rank, and the new token (the newest) takes the last rank."""
        pos = self.slot_pos
        victim = pos.gather(2, slot)  # -1: an empty slot, nothing evicted
        self.slot_rank.sub_(((pos > victim) & (victim >= 0)).long())
        self.slot_rank.scatter_(2, slot, (pos >= 0).sum(-1, keepdim=True) - (victim >= 0).long())

    def truncate(self, length: int) -> None:
        """Forget every token at position >= length (speculate.py's rejected drafts): their slots become empty
        and fill first. What the policy evicted to make room for them stays evicted."""
        self.slot_pos.masked_fill_(self.slot_pos >= length, -1)
        self.seen.fill_(length)

    def choose_slot(self, input_pos: Tensor) -> Tensor:
        """Per KV head, the slot the new token goes to: an empty one, else the lowest-scored evictable one."""
        return self.protect(self.slot_scores(input_pos), input_pos).argmin(dim=-1)

    def protect(self, scores: Tensor, t: Tensor) -> Tensor:
        """Scores with sinks and the recent window (before the incoming position t) at +inf, empty at -inf."""
        pos = self.slot_pos
        kept = self.is_sink(pos) | (pos > t - self.recent_window)
        scores = scores.masked_fill(kept, INF).masked_fill(pos < 0, -INF)
        if self.recall_slots:  # the tiers' recall slots: full or empty, never the policy's to fill or evict
            scores = torch.cat([scores[..., : -self.recall_slots],
                                scores.new_full((*scores.shape[:-1], self.recall_slots), INF)], dim=-1)
        return scores

    def is_sink(self, pos: Tensor) -> Tensor:
        """Positions pos (slot_pos-shaped) among their row's first n_sinks tokens."""
        return pos - self.row_start < self.n_sinks

    def slot_scores(self, input_pos: Tensor) -> Tensor:
        raise NotImplementedError

    def on_insert(self, slot: Tensor, k: Tensor, input_pos: Tensor) -> None:
        """Reset per-slot statistics of the slots just overwritten (slot [B, H_kv]; k [B, H_kv, 1, D])."""

    def observe(self, probs: Tensor) -> None:
        """probs: [B, H_kv, g, 1, C] attention of the new query over all slots (only if needs_attention)."""

    def refresh(self) -> None:
        """Work done every `refresh_interval` steps, outside the decode graph (none by default); a separately
        compiled function unless compile_refresh is False."""

    def recall(self, q: Tensor) -> None:
        """Bring back evicted tokens for the current query q [B, H, 1, D] before update() (kv.tiers; none here)."""

    # ---- where kv.tiers finds things in this layout (the pool, kv.pool, has its own) ---------------------------
    # False where the policy's victims are not one slot of each KV head per step (tiers stage one per head)
    supports_tiers: ClassVar[bool] = True

    def holds(self, S: int) -> Tensor:
        """[B, H_kv, S] bool: prompt position p of KV head h is in one of its slots."""
        pos = self.slot_pos
        held = torch.zeros(*pos.shape[:2], S + 1, dtype=torch.bool, device=pos.device)
        return held.scatter_(2, torch.where(pos >= 0, pos, S), True)[..., :S]

    def take_slots(self, buffer: Tensor, slot: Tensor) -> Tensor:
        """Rows of a slot-shaped buffer ([B, H_kv, C, *row]) at slot [B, H_kv], one per KV head: [B, H_kv, 1, *row]."""
        B, H = slot.shape
        index = slot.view(B, H, 1, *(1,) * (buffer.dim() - 3))
        return buffer.gather(2, index.expand(B, H, 1, *buffer.shape[3:]))

    def recall_positions(self) -> Tensor:
        """slot_pos of the tiers' recall slots, [B, H_kv, R] (a view: the last R slots of each KV head)."""
        return self.slot_pos[..., self.slot_pos.shape[-1] - self.recall_slots :]

    def put_recall(self, buffer: Tensor, index: Tensor, value: Tensor) -> None:
        """Write value [B, H_kv, n, *row] into recall slots `index` [B, H_kv, n] (0 .. R - 1) of a slot-shaped buffer."""
        put_rows(buffer, self.capacity - self.recall_slots + index, value)

    # ---- ragged batches (ragged.py) ----------------------------------------------------------------------
    def load_row(self, row: int, single: KVCache, offset: int) -> None:
        """Copy a one-row cache of the same policy and capacity, holding K/V in full precision (a prompt prefilled
        alone), into `row`, its positions `offset` later: ragged.py puts every row on the batch's one clock. Keys
        are rotated by the offset (RoPE composes: R(offset) R(p) = R(offset + p), so attention within the row is
        unchanged) unless stored before RoPE (pos_shift), and quantized here, once, if kv_bits. Every other
        per-row buffer (statistics, ranks, a pool's owners) is copied as it is."""
        k, v = single.keys_values() if not single.pos_shift else (single.k, single.v)
        k, v = k[0], v[0]
        if not self.pos_shift:
            cos, sin = rope_at(torch.tensor(offset, device=k.device), self.model_args or ModelArgs())
            k = apply_rope(k, cos, sin)
        parts = ([*quantize_tokens(k, self.kv_bits, self.kv_group_size), *quantize_tokens(v, self.kv_bits,
                  self.kv_group_size)] if self.kv_bits else [k, v])
        for name, value in zip(self.kv_buffers(), parts):
            getattr(self, name)[row] = value
        pos = single.slot_pos[0]
        self.slot_pos[row] = torch.where(pos >= 0, pos + offset, pos)
        self.row_start[row] = offset
        skip = {*self.kv_buffers(), "slot_pos", "row_start", "seen"}
        theirs = dict(single.named_buffers())
        for name, buffer in self.named_buffers():
            if name in skip:
                continue
            source = theirs[name]
            if buffer.dim() and buffer.shape[0] == self.batch_size and source.shape == (1, *buffer.shape[1:]):
                buffer[row] = source[0]
            else:  # not per row (a schedule, constants): the same in every one-row cache
                buffer.copy_(source)

    def after_load(self) -> None:
        """Once every row is loaded and `seen` is the batch's clock (policies whose statistics depend on it)."""

    # ---- benchmarking ----------------------------------------------------------------------------------
    def fill_synthetic(self, seq_len: int, generator: torch.Generator | None = None) -> None:
        """Make the cache look as if a seq_len-token sequence had been processed (random K/V, the sinks and
        the most recent positions kept), so a decode step at that context can be timed without a prefill."""
        n = min(seq_len, self.prompt_capacity)
        sinks = min(self.n_sinks, n)
        positions = torch.cat([torch.arange(sinks), torch.arange(seq_len - (n - sinks), seq_len)])
        self.reset()
        shape = (self.batch_size, self.n_kv_heads, n, self.head_dim)
        self.write_slots(None, *(torch.randn(shape, generator=generator).to(self.device, self.dtype) for _ in "kv"))
        self.slot_pos[:, :, :n] = positions.to(self.slot_pos)
        if self.pos_shift:
            self.slot_rank[:, :, :n] = torch.arange(n, device=self.device)
        self.seen.fill_(seq_len)
        self.synthetic_state(generator)

    def synthetic_state(self, generator: torch.Generator | None) -> None:
        """Plausible statistics for fill_synthetic (zeros by default)."""

    # ---- reporting (read once at the end) -----------------------------------------------------------------
    def kept(self) -> Tensor:
        """Valid slots per (row, KV head)."""
        return (self.slot_pos >= 0).sum(-1)

    def tokens_seen(self) -> int:
        return int(self.seen.item())

    def physical_bytes(self) -> int:
        """Bytes of the K/V buffers (what a full cache would hold for every token), scales and zero points of
        quantized K/V included."""
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in self.kv_buffers())

    def overhead_bytes(self) -> int:
        """Bytes of bookkeeping beside K/V: slot positions and the policy's statistics."""
        return sum(b.numel() * b.element_size() for b in self.buffers()) - self.physical_bytes()
