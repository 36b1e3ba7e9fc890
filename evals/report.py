"""summary.md and plots for eval.py: rows policy x budget (x mode), columns task x length.

Retrieval cells are mean score +- standard error over samples; fidelity cells the mean KL (nats per token),
top-1 agreement and greedy prefix (tokens) over samples; ppl cells exp(mean NLL) over windows; attention-loss
cells the mean evicted attention mass per token, over layers and windows. A tiered combo (kv.tiers) is a row of
its own, named as eval.py records it (h2o+warm), right below its policy's row.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

TASK_ORDER = ("passkey", "niah_single", "niah_multikey", "niah_multivalue", "shared_context", "fidelity", "ppl",
              "attention-loss")
FIDELITY = (("kl", "KL"), ("top1", "top-1"), ("prefix", "prefix"))


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, float("nan")
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, math.sqrt(var / len(xs))


def row_key(r: dict) -> tuple[str, float | None]:
    return r["policy"], r["budget"]


def order_rows(records: list[dict]) -> list[tuple[str, float | None]]:
    policies: list[str] = []
    for r in records:
        if r["policy"] not in policies:
            policies.append(r["policy"])
    # full first; a tiered combo (h2o+warm, kv.tiers) right after its policy, so plain and tiered sit side by side
    bases: list[str] = []
    for p in policies:
        if p.split("+")[0] not in bases:
            bases.append(p.split("+")[0])
    policies.sort(key=lambda p: (p != "full", bases.index(p.split("+")[0]), p != p.split("+")[0]))
    budgets = sorted({r["budget"] for r in records if r["budget"] is not None}, reverse=True)
    rows = []
    for p in policies:
        for b in ([None] if p == "full" else budgets):
            if any(row_key(r) == (p, b) for r in records):
                rows.append((p, b))
    return rows


def thin(positions: list[int], k: int = 4) -> list[int]:
    """At most k positions, evenly spread, the last one kept."""
    if len(positions) <= k:
        return positions
    step = len(positions) / k
    return [positions[min(len(positions) - 1, round((i + 1) * step) - 1)] for i in range(k)]


def columns(records: list[dict], full_ppl: bool = False) -> list[tuple[str, int, str, str]]:
    """(task, length, metric, header) in display order."""
    cols = []
    for task in TASK_ORDER:
        rs = [r for r in records if r["task"] == task]
        for L in sorted({r["length"] for r in rs}):
            if task == "fidelity":
                cols += [(task, L, m, f"{name}@{L}") for m, name in FIDELITY]
            elif task in ("ppl", "attention-loss"):
                metric = "ppl" if task == "ppl" else "loss"
                ps = sorted({int(k.split("@")[1]) for r in rs if r["length"] == L for k in r["metrics"]
                             if k.startswith(metric + "@")})
                name = "ppl" if task == "ppl" else "attn-loss"
                cols += [(task, L, f"{metric}@{p}", f"{name}@{p}") for p in (ps if full_ppl else thin(ps))]
            else:
                cols.append((task, L, "score", f"{task}@{L}"))
    return cols


def cell(rs: list[dict], task: str, metric: str) -> str:
    if not rs:
        return ""
    if task == "ppl":
        nll = [r["metrics"]["nll@" + metric.split("@")[1]] for r in rs]
        return f"{math.exp(sum(nll) / len(nll)):.2f}"
    if task == "attention-loss":
        return f"{mean_se([r['metrics'][metric] for r in rs])[0]:.4f}"
    if task == "fidelity":
        m, _ = mean_se([r["metrics"][metric] for r in rs])
        return f"{m:.3f}" if metric == "kl" else f"{m:.2f}" if metric == "top1" else f"{m:.1f}"
    m, se = mean_se([r["score"] for r in rs])
    return f"{m:.2f}" + ("" if math.isnan(se) else f" ±{se:.2f}")


def budget_text(b: float | None) -> str:
    if b is None:
        return "100%"
    return f"{b * 100:g}%" if b <= 1 else f"{b:g} slots"


def bytes_text(rs: list[dict]) -> str:
    """What a row's caches hold as a share of the full cache's K/V (kv.report's accounting; the mean over its
    records' sizes: the lengths differ a little in how the answer room weighs)."""
    fracs = [r["bytes_frac"] for r in rs if "bytes_frac" in r]
    return f"{100 * sum(fracs) / len(fracs):.1f}" if fracs else ""


def table(records: list[dict], cols: list[tuple[str, int, str, str]]) -> list[str]:
    modes = sorted({r["mode"] for r in records if r["mode"] != "-"}) or ["-"]
    by: dict[tuple, list[dict]] = defaultdict(list)
    rows: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        by[(r["task"], r["length"], r["policy"], r["budget"], r["mode"])].append(r)
        rows[row_key(r)].append(r)
    head = ["policy", "budget"] + (["mode"] if modes != ["-"] else []) + ["bytes %"] + [c[3] for c in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for policy, budget in order_rows(records):
        for mode in modes:
            cells = [policy, budget_text(budget)] + ([mode] if modes != ["-"] else []) + [
                bytes_text(rows[(policy, budget)])]
            for task, L, metric, _ in cols:
                m = "-" if task in ("ppl", "attention-loss") else mode
                cells.append(cell(by.get((task, L, policy, budget, m), []), task, metric))
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def counts(records: list[dict]) -> str:
    n: dict[tuple[str, int], set] = defaultdict(set)
    for r in records:
        n[(r["task"], r["length"])].add(r["index"])
    return ", ".join(f"{t}@{L}: {len(v)}" for (t, L), v in sorted(n.items(), key=lambda x: (TASK_ORDER.index(x[0][0]),
                                                                                             x[0][1])))


def summary(records: list[dict], config: dict[str, Any], wall_s: float | None = None) -> str:
    lines = [f"# Quality of KV-cache policies on {config.get('checkpoint')}", ""]
    modes = sorted({r["mode"] for r in records if r["mode"] != "-"})
    lines.append(f"Mode: {', '.join('query-' + m for m in modes) or 'n/a'} (ppl and attention loss have no "
                 f"question). Samples per cell: {counts(records)}. Seed {config.get('seed')}, "
                 f"chat template {'on' if config.get('chat') else 'off'}, {config.get('dtype')}, haystack "
                 f"{config.get('haystack')}, ppl text {config.get('ppl_text')}.")
    if config.get("params"):
        lines.append(f"Policy parameters: {config['params']}.")
    if wall_s is not None:
        lines.append(f"Wall time of this run: {wall_s / 60:.1f} min.")
    legend = (f"Budget = cache slots per layer as a fraction of prompt + {config.get('answer_room')} new tokens "
              "(ppl: of the window). Retrieval: mean score ± standard error. Fidelity against full: KL in nats/token, "
              f"top-1 agreement, greedy prefix matching full (tokens, of {config.get('fidelity_tokens')}). ppl@p: "
              "perplexity of the first p tokens of each window.")
    if config.get("budget_unit") == "bytes":
        legend = legend.replace("Budget = cache slots per layer as a fraction of prompt + ", "Budget = the most "
                                "bytes a combo's caches may hold, as a fraction of the full cache's K/V for prompt + ")
    legend += (" bytes %: everything the caches hold (K/V as stored, scales, positions, statistics, warm tier) as a "
               "share of the full cache's K/V in the compute dtype.")
    lines += ["", legend, ""]
    lines += table(records, columns(records))
    lines += shared_table([r for r in records if r["task"] == "shared_context"])
    text = [r for r in records if r["task"] in ("ppl", "attention-loss")]
    if text and len(columns(text, True)) > len(columns(text)):
        lines += ["", "## Perplexity and attention loss at every position", ""]
        lines += table(text, columns(text, True))
    note = ("Replaying the prefill into the caches, then decoding the question and answer (or a ppl window), per "
            "sample; policies decoded together in one batch share their time, and the first group of a batch also "
            "computes the prompt statistics that the later ones reuse.")
    lines += ["", "## Time per sample (seconds)", "", note, ""]
    by: dict[tuple, list[float]] = defaultdict(list)
    prefill: dict[str, list[float]] = defaultdict(list)
    for r in records:
        by[(r["policy"], r["budget"], r["task"], r["length"])].append(r["time_s"])
        prefill[f"{r['task']}@{r['length']}"].append(r.get("prefill_s", 0.0))
    cols = sorted({(t, L) for (_, _, t, L) in by}, key=lambda x: (TASK_ORDER.index(x[0]), x[1]))
    lines.append("| policy | budget | " + " | ".join(f"{t}@{L}" for t, L in cols) + " |")
    lines.append("|" + "---|" * (len(cols) + 2))
    for policy, budget in order_rows(records):
        cells = [f"{sum(v) / len(v):.2f}" if (v := by.get((policy, budget, t, L))) else "" for t, L in cols]
        lines.append(f"| {policy} | {budget_text(budget)} | " + " | ".join(cells) + " |")
    lines += ["", "Prefill (once per sample, shared by every policy and budget): " + ", ".join(
        f"{k} {sum(v) / len(v):.2f} s" for k, v in prefill.items()) + "."]
    return "\n".join(lines) + "\n"


def shared_table(rs: list[dict]) -> list[str]:
    """shared_context: each turn's score (the questions asked in turn of one compressed context) and the time
    per sample with reuse (one prefill + compression, a restore per question) against a fresh prefill +
    compression per question."""
    if not rs:
        return []
    n = max(len(r["turns"]) for r in rs)
    by: dict[tuple, list[dict]] = defaultdict(list)
    for r in rs:
        by[(r["length"],) + row_key(r)].append(r)
    lines = ["", "## Shared context: one compressed context, questions in turn", "",
             ("Each question restores the caches as compressed (kv.snapshot). Time per sample: reuse = prefill + "
             "compression + every restore and answer; fresh = a prefill + compression per question + every answer."),
             "", "| policy | budget | length | " + " | ".join(f"q{i + 1}" for i in range(n))
             + " | reuse s | fresh s | fresh / reuse |", "|" + "---|" * (n + 6)]
    for L in sorted({r["length"] for r in rs}):
        for policy, budget in order_rows([r for r in rs if r["length"] == L]):
            group = by[(L, policy, budget)]
            turns = [f"{mean_se([r['turns'][i] for r in group])[0]:.2f}" for i in range(n)]
            reuse = sum(r["reuse_s"] for r in group) / len(group)
            fresh = sum(r["fresh_s"] for r in group) / len(group)
            lines.append(f"| {policy} | {budget_text(budget)} | {L} | " + " | ".join(turns)
                         + f" | {reuse:.2f} | {fresh:.2f} | {fresh / reuse:.1f}x |")
    return lines


# ---- plots -----------------------------------------------------------------------------------------------------
def series(records: list[dict], task: str, L: int, metric: str, mode: str) -> dict[str, list[tuple[float, float, float]]]:
    """policy -> [(budget, mean, se)], full under budget None -> the reference."""
    groups: dict[tuple[str, float | None], list[dict]] = defaultdict(list)
    for r in records:
        if r["task"] == task and r["length"] == L and r["mode"] == mode:
            groups[row_key(r)].append(r)
    out: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for (policy, budget), rs in sorted(groups.items(), key=lambda x: (x[0][0], x[0][1] or 0)):
        if task == "ppl":
            nll = [r["metrics"]["nll@" + metric.split("@")[1]] for r in rs]
            m, se = math.exp(sum(nll) / len(nll)), float("nan")
        elif metric == "score":
            m, se = mean_se([r["score"] for r in rs])
        else:
            m, se = mean_se([r["metrics"][metric] for r in rs])
        out[policy].append((1.0 if budget is None else budget, m, se))
    return out


def draw(ax: Any, records: list[dict], task: str, L: int, metric: str, title: str) -> None:
    modes = sorted({r["mode"] for r in records if r["task"] == task}) or ["-"]
    for mode, style in zip(modes, ("-", "--", ":")):
        data = series(records, task, L, metric, mode)
        for policy, pts in sorted(data.items()):
            if policy == "full":
                _, m, _ = pts[0]
                ax.axhline(m, color="black", linestyle=":" if style != "-" else "--", linewidth=1,
                           label=f"full{'' if len(modes) == 1 else ' ' + mode}")
                continue
            xs, ys, es = zip(*pts)
            es = [0 if math.isnan(e) else e for e in es]
            ax.errorbar(xs, ys, yerr=es, marker="o", markersize=3, capsize=2, linestyle=style,
                        label=policy + ("" if len(modes) == 1 else f" {mode}"))
    ax.set_xscale("log", base=2)
    if task == "ppl":
        ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("budget", fontsize=8)
    ax.tick_params(labelsize=7)


def plots(records: list[dict], out: Path) -> list[Path]:
    """overview.png (every column of the summary table) and one PNG per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    compressed = [r for r in records if r["budget"] is not None]
    if not compressed:
        return []
    cols = columns(records)
    files = []
    groups = {"overview": cols}
    for task in TASK_ORDER:
        task_cols = [c for c in cols if c[0] == task] if task not in ("ppl", "attention-loss") else [
            c for c in columns(records, True) if c[0] == task]
        if task_cols:
            groups[task.replace("-", "_")] = task_cols
    for name, group in groups.items():
        n = len(group)
        ncols = min(4, n)
        nrows = math.ceil(n / ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols, 2.6 * nrows + 0.6), squeeze=False)
        for ax, (task, L, metric, header) in zip(axes.flat, group):
            draw(ax, records, task, L, metric, header)
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=7, frameon=False)
        fig.tight_layout(rect=(0, 0.08 if nrows == 1 else 0.05, 1, 1))
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    by_position = ppl_by_position(records, out)
    return files + ([by_position] if by_position else [])


def ppl_by_position(records: list[dict], out: Path) -> Path | None:
    """ppl_by_position.png: per ppl length, the perplexity of the tokens since the previous report (nll_seg@p,
    averaged over windows) against the position, one line per policy and budget: StreamingLLM's figure, where a
    cache that goes wrong past some length shows as a rise the cumulative ppl@p smooths away."""
    rs = [r for r in records if r["task"] == "ppl" and any(k.startswith("nll_seg@") for k in r["metrics"])]
    lengths = sorted({r["length"] for r in rs})
    if not rs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths), 3.6), squeeze=False)
    for ax, L in zip(axes.flat, lengths):
        by: dict[tuple, list[dict]] = defaultdict(list)
        for r in rs:
            if r["length"] == L:
                by[row_key(r)].append(r)
        for policy, budget in order_rows([r for r in rs if r["length"] == L]):
            group = by[(policy, budget)]
            ps = sorted({int(k.split("@")[1]) for r in group for k in r["metrics"] if k.startswith("nll_seg@")})
            ys = [math.exp(sum(r["metrics"][f"nll_seg@{p}"] for r in group) / len(group)) for p in ps]
            ax.plot(ps, ys, marker="o", markersize=3, label=f"{policy} {budget_text(budget)}")
        ax.set_title(f"ppl of each segment, windows of {L} tokens", fontsize=9)
        ax.set_xlabel("position (end of segment)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    path = out / "ppl_by_position.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
