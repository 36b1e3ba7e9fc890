"""What a finished run's caches report, read once from their buffers at the end: tokens seen / kept /
evicted, physical and full-cache bytes, and hybrid's / fastgen's head classification."""

from __future__ import annotations

from typing import Any

from kv.slots import KVCache


def cache_report(caches: list[KVCache]) -> dict[str, Any]:
    """Figures for a finished run, read once from the buffers (one host sync per layer, at the end)."""
    seen = max(c.tokens_seen() for c in caches)
    kept = sum(c.kept().float().mean().item() for c in caches) / len(caches)
    kv_bytes = sum(c.physical_bytes() for c in caches)
    # what a full cache would hold for the same tokens: 2 (K and V) x B x H_kv x seen x D per layer
    full_bytes = sum(2 * c.batch_size * c.n_kv_heads * seen * c.head_dim * c.dtype.itemsize for c in caches)
    return {"policy": caches[0].name, "capacities": [c.capacity for c in caches], "seen": seen, "kept": kept,
            "evicted": seen - kept, "kv_bytes": kv_bytes, "full_kv_bytes": full_bytes,
            "overhead_bytes": sum(c.overhead_bytes() for c in caches),
            "compression_ratio": full_bytes / max(kv_bytes, 1)}


def format_cache_report(r: dict[str, Any]) -> list[str]:
    caps = sorted(set(r["capacities"]))
    cap = str(caps[0]) if len(caps) == 1 else f"{caps[0]}..{caps[-1]}"
    seen = (f"cache: {r['policy']}, capacity per layer {cap} slots; tokens seen {r['seen']}, "
            f"kept {r['kept']:.1f} (mean over layers, rows, KV heads), evicted {r['evicted']:.1f}")
    size = (f"KV cache physical bytes: {r['kv_bytes'] / 1e6:.2f} MB (full cache for {r['seen']} tokens: "
            f"{r['full_kv_bytes'] / 1e6:.2f} MB; compression ratio {r['compression_ratio']:.2f}x); "
            f"positions + policy statistics {r['overhead_bytes'] / 1e6:.2f} MB")
    return [seen, size]


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
