"""The peer check's tables (scripts/peer_kvpress.py): per (task, length), each method and ratio on both sides,
mean ± standard error over samples, agreement and paired differences, and seconds per sample."""

from __future__ import annotations

import math
from collections.abc import Sequence

SIDES = ("kvfast", "kvpress")


def mean_se(values: list[float]) -> tuple[float, float | None]:
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, None
    var = sum((v - m) ** 2 for v in values) / (len(values) - 1)
    return m, math.sqrt(var / len(values))


def fmt(values: list[float], digits: int = 3) -> str:
    if not values:
        return "—"
    m, se = mean_se(values)
    return f"{m:.{digits}f}" if se is None else f"{m:.{digits}f} ± {se:.{digits}f}"


def row_cells(ours: dict[int, dict], theirs: dict[int, dict]) -> dict[str, str]:
    """Table cells of one (method, ratio) from records by sample index on each side."""
    both = sorted(set(ours) & set(theirs))
    a = [ours[i]["score"] for i in both]
    b = [theirs[i]["score"] for i in both]
    kept = [f"{sum(r['kept'] for r in side.values()) / len(side):.1f}" if side else "—"
            for side in (ours, theirs)]
    time_s = [f"{sum(r['time_s'] for r in side.values()) / len(side):.2f}" if side else "—"
              for side in (ours, theirs)]
    same = sum(ours[i]["tokens"] == theirs[i]["tokens"] for i in both)
    return {
        "kept": f"{kept[0]} / {kept[1]}",
        "kvfast": fmt([r["score"] for r in ours.values()]),
        "kvpress": fmt([r["score"] for r in theirs.values()]),
        "n": f"{len(ours)} / {len(theirs)}",
        "agree": f"{sum(x == y for x, y in zip(a, b)) / len(both):.2f}" if both else "—",
        "same": f"{same / len(both):.2f}" if both else "—",
        "diff": fmt([x - y for x, y in zip(a, b)]),
        "time": f"{time_s[0]} / {time_s[1]}",
    }


HEADER = ("| method | ratio | kept / head (kvfast / kvpress) | kvfast | kvpress | n | agreement "
          "| same tokens | paired diff (kvfast − kvpress) | s / sample (kvfast / kvpress) |")


def format_tables(records: list[dict], skipped: dict[str, str] | None = None,
                  methods: Sequence[str] = ()) -> list[str]:
    """One table per (task, length): rows full, then each method (in `methods` order) by ratio; cells: mean ±
    s.e. over samples."""
    cells: dict[tuple, dict[str, dict[int, dict]]] = {}
    for r in records:
        key = (r["task"], r["length"], r["method"], r["ratio"])
        cells.setdefault(key, {s: {} for s in SIDES})[r["side"]][r["index"]] = r
    order = {"full": -1, **{m: i for i, m in enumerate(methods)}}
    lines: list[str] = []
    for task, length in sorted({k[:2] for k in cells}):
        keys = sorted((k for k in cells if k[:2] == (task, length)),
                      key=lambda k: (order.get(k[2], 99), k[3] if k[3] is not None else -1))
        lines += [f"### {task}, {length} tokens", "", HEADER, "|" + "---|" * 10]
        for k in keys:
            c = row_cells(cells[k]["kvfast"], cells[k]["kvpress"])
            ratio = "—" if k[3] is None else f"{k[3]:g}"
            lines.append(f"| {k[2]} | {ratio} | {c['kept']} | {c['kvfast']} | {c['kvpress']} | {c['n']} | "
                         f"{c['agree']} | {c['same']} | {c['diff']} | {c['time']} |")
        lines.append("")
        lines += timing_lines([r for r in records if (r["task"], r["length"]) == (task, length)])
        lines.append("")
    for name, why in sorted((skipped or {}).items()):
        lines.append(f"- {name}: kvfast side skipped: {why}")
    return lines


def timing_lines(records: list[dict]) -> list[str]:
    """Seconds per sample on each side: kvfast = its one recorded prefill + every method's decode (time_s);
    kvpress = every method's time_s (the shared prefill is split over the methods it served)."""
    out = []
    for side in SIDES:
        rows = [r for r in records if r["side"] == side]
        if not rows:
            continue
        samples = {r["index"] for r in rows}
        total = sum(r["time_s"] for r in rows)
        if side == "kvfast":
            total += sum({r["index"]: r["prefill_s"] for r in rows}.values())
        out.append(f"- {side}: {total / len(samples):.1f} s per sample over {len(samples)} samples "
                   f"({len({(r['method'], r['ratio']) for r in rows})} method/ratio rows)")
    return out
