"""What a finished run's caches report, read once from their buffers at the end: tokens seen / kept /
evicted, the bytes they hold against a full cache's, and hybrid's / fastgen's head classification.

The byte accounting (one for generate.py's report, eval.py's `bytes %` column and its byte budgets): a cache holds
what its buffers hold, every one of them: hot K/V as stored (16-bit floats, or 8 / 4-bit codes with their scales
and zero points), slot positions and head maps, the policy's statistics, and with tiers the warm pages, their
scales, positions and key bounds, the staging page and the counters. The reference is the full cache in the
compute dtype: K and V only, 2 x rows x KV heads x tokens x head dim x itemsize per layer, so a compressed
cache pays for its metadata and the full cache itself reads a little over 100 % (its slot positions).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kv.slots import KVCache
from model import KVFastError, ModelArgs

# the parts of cache_bytes, by buffer name; a buffer named by none of them is a policy statistic
POSITION_BUFFERS = ("slot_pos", "slot_head", "head_ids", "row_start", "seen", "slot_rank")
WARM_PREFIXES = ("warm_", "page_", "stage_", "recall_page", "traffic")


def byte_parts(cache: nn.Module) -> dict[str, int]:
    """One layer cache's bytes by part: hot K/V ("kv": codes, scales and zero points included), "positions",
    "warm" (the tiers' store, staging and counters) and "statistics" (the rest); they sum to every buffer's
    nbytes."""
    kv_names = set(cache.kv_buffers()) if isinstance(cache, KVCache) else {"k", "v"}
    parts = dict.fromkeys(("kv", "positions", "warm", "statistics"), 0)
    for name, b in cache.named_buffers():
        part = ("kv" if name in kv_names else "positions" if name in POSITION_BUFFERS
                else "warm" if name.startswith(WARM_PREFIXES) else "statistics")
        parts[part] += b.nbytes
    return parts


def cache_bytes(caches: list[nn.Module]) -> int:
    """Every byte the caches hold (byte_parts summed over the layers)."""
    return sum(sum(byte_parts(c).values()) for c in caches)


def full_kv_bytes(args: ModelArgs, batch: int, tokens: int, dtype: torch.dtype, layers: int | None = None) -> int:
    """The full cache's K/V for `tokens` tokens in `dtype`: the reference every `bytes %` is a share of."""
    per_layer = 2 * batch * args.n_kv_heads * tokens * args.head_dim * dtype.itemsize
    return per_layer * (args.n_layers if layers is None else layers)


def bytes_of(factory: Any) -> dict[str, int]:
    """The byte parts of the caches a cache.CacheFactory builds, all layers, built on the meta device (no memory
    is allocated: only shapes and dtypes count)."""
    device = factory.device
    factory.device = torch.device("meta")
    try:
        total = dict.fromkeys(("kv", "positions", "warm", "statistics"), 0)
        for layer in range(factory.model_args.n_layers):
            for part, n in byte_parts(factory(layer)).items():
                total[part] += n
        return total
    finally:
        factory.device = device


def largest(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest x in [lo, hi] with fits(x), for a fits that holds up to some x and fails after (lo - 1 if
    none does): a binary search."""
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid + 1
        else:
            hi = mid - 1
    return hi


def slots_for_bytes(make: Callable[[int, int | None], Any], fraction: float, full: int, tokens: int,
                    warm_share: float = 0.0, page: int = 1, what: str = "the cache") -> tuple[int, int | None]:
    """Slots per layer (and warm tokens, with a warm_share > 0) whose caches hold at most `fraction` of `full`
    bytes: make(slots, warm_tokens) -> a cache.CacheFactory (warm_tokens None: no tiers). With tiers the warm
    store (whole pages of `page` tokens) gets warm_share of the bytes, the hot slots the rest."""
    target = int(fraction * full)
    warm = None
    if warm_share > 0:  # warm bytes grow by one page's bytes per page: measured between two stores
        hot = max(1, tokens // 4)
        pages = -(-tokens // page)
        b1, b2 = (bytes_of(make(hot, n * page))["warm"] for n in (pages, pages // 2))
        per_page = (b1 - b2) / (pages - pages // 2)
        n = min(pages, int((warm_share * target - (b1 - per_page * pages)) // per_page))
        if n < 1:
            raise KVFastError(f"{what}: {warm_share:g} of {fraction:g} of the full cache's bytes holds no warm page")
        warm = n * page

    def feasible(slots: int) -> bool:
        try:
            make(slots, warm)
            return True
        except KVFastError:
            return False

    # the policy needs some slots (sinks, windows, a tier's recall pages): the fewest it takes, by doubling then
    # halving; past some count a tier's recall slots (a share of the hot ones) outgrow the warm store
    low = 2
    while low <= tokens and not feasible(low):
        low *= 2
    if low > tokens and not feasible(tokens):
        make(tokens, warm)  # raises the policy's own one-line reason
    low = min(low, tokens)
    low = largest(lambda n: not feasible(n), low // 2 + 1, low) + 1

    def fits(slots: int) -> bool:
        return feasible(slots) and sum(bytes_of(make(slots, warm)).values()) <= target

    slots = largest(fits, low, tokens)
    if slots < low:
        raise KVFastError(f"{what} does not fit in {fraction:g} of the full cache's bytes: its fewest slots "
                          f"({low}) hold {sum(bytes_of(make(low, warm)).values()) / full:.1%}")
    return slots, warm


def cache_report(caches: list[KVCache]) -> dict[str, Any]:
    """Figures for a finished run, read once from the buffers (one host sync per layer, at the end)."""
    seen = max(c.tokens_seen() for c in caches)
    kept = sum(c.kept().float().mean().item() for c in caches) / len(caches)
    kv_bytes = sum(c.physical_bytes() for c in caches)
    c = caches[0]  # what a full cache would hold for the same tokens (full_kv_bytes)
    full_bytes = 2 * c.batch_size * c.n_kv_heads * seen * c.head_dim * c.dtype.itemsize * len(caches)
    held = cache_bytes(caches)
    return {"policy": caches[0].name, "capacities": [c.capacity for c in caches], "seen": seen, "kept": kept,
            "evicted": seen - kept, "kv_bytes": kv_bytes, "full_kv_bytes": full_bytes,
            "overhead_bytes": sum(c.overhead_bytes() for c in caches),
            "compression_ratio": full_bytes / max(kv_bytes, 1), "cache_bytes": held,
            "bytes_frac": held / max(full_bytes, 1)}


def format_cache_report(r: dict[str, Any]) -> list[str]:
    caps = sorted(set(r["capacities"]))
    cap = str(caps[0]) if len(caps) == 1 else f"{caps[0]}..{caps[-1]}"
    seen = (f"cache: {r['policy']}, capacity per layer {cap} slots; tokens seen {r['seen']}, "
            f"kept {r['kept']:.1f} (mean over layers, rows, KV heads), evicted {r['evicted']:.1f}")
    size = (f"KV cache physical bytes: {r['kv_bytes'] / 1e6:.2f} MB (full cache for {r['seen']} tokens: "
            f"{r['full_kv_bytes'] / 1e6:.2f} MB; compression ratio {r['compression_ratio']:.2f}x); "
            f"positions + policy statistics {r['overhead_bytes'] / 1e6:.2f} MB")
    held = (f"everything the cache holds (K/V, positions, statistics, warm tier): {r['cache_bytes'] / 1e6:.2f} MB, "
            f"{100 * r['bytes_frac']:.1f} % of the full cache's K/V")
    return [seen, size, held]


def head_class_report(caches: list[KVCache]) -> list[dict[str, Any]] | None:
    """The per-head classification of hybrid (static / dynamic) or fastgen (its profiles) per layer and row
    (None for other policies): per kind, how many KV heads and the slots they hold, and the heads' kinds as a
    string of the policy's head_letters ("SDD": static, dynamic, dynamic), read once at the end."""
    if not caches or not all(isinstance(c, KVCache) and c.head_kinds for c in caches):  # eval's wrappers: None
        return None
    out = []
    for c in caches:
        r = c.head_classes()
        kind, budget = r["kind"], r["budget"]
        layer: dict[str, Any] = {"kinds": list(c.head_kinds)}
        for i, name in enumerate(c.head_kinds):
            layer[name] = (kind == i).sum(-1).tolist()
            layer[f"{name}_slots"] = (budget * (kind == i)).sum(-1).tolist()
        layer["heads"] = ["".join(c.head_letters[k] for k in row) for row in kind.tolist()]
        out.append(layer)
    return out


def format_head_class_report(report: list[dict[str, Any]] | None, policy: str = "hybrid") -> list[str]:
    """One line per layer: KV heads of each kind and slots per head of that kind (means over rows; kinds no
    head took are left out unless all are), and each row's kinds by head."""
    if report is None:
        return []
    lines = []
    for i, layer in enumerate(report):
        parts = []
        for kind in layer["kinds"]:
            heads, slots = sum(layer[kind]), sum(layer[f"{kind}_slots"])
            if heads or len(layer["kinds"]) <= 2:
                each = f"{slots / heads:.1f} slots each" if heads else "no slots"
                parts.append(f"{heads / len(layer[kind]):g} {kind} ({each})")
        rows = " ".join(layer["heads"])
        lines.append(f"{policy} layer {i}: KV heads {', '.join(parts)}; by row and head: {rows}")
    return lines
