"""Ragged batches (generate.py --prompts FILE): prompts of different lengths decoded together.

Each prompt is prefilled alone into one-row caches, so its prompt compression and every policy statistic are
those of a run of its own; its row of the batch's caches then receives that state with the positions moved
later by (longest prompt - its length) (kv.slots.KVCache.load_row). All rows thus share one clock: the compiled
decode step, its input position and every policy stay exactly as for one prompt, and nothing recompiles for
another mix of lengths. RoPE depends on position differences only, so a row attends as it would alone (its
keys are rotated by the offset once, at the copy; sinks count from the row's first token). Rows stop on their
own; the batch stops when all have, and each row's output is cut at its first stop token.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import Tensor

from model import KVFastError, Transformer


def read_prompts(path: Path, key: str = "prompt", flag: str = "--prompts") -> list[str]:
    """One prompt per line, or JSONL (each line an object with a `key` string); blank lines are skipped. flag:
    the option that named the file, for the errors (generate.py's --questions reads its file here too)."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise KVFastError(f"{flag} file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise KVFastError(f"cannot read {flag} file {path}: {e}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                prompt = json.loads(line)[key]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise KVFastError(f"{path}:{number}: a JSON line must be an object with a \"{key}\" string") from None
            if not isinstance(prompt, str):
                raise KVFastError(f"{path}:{number}: \"{key}\" must be a string")
            line = prompt
        prompts.append(line.replace("\\n", "\n"))
    if not prompts:
        raise KVFastError(f"{flag} file {path} holds no {key}")
    return prompts


def check_args(args: argparse.Namespace) -> None:
    """Flags that do not combine with --prompts: one line each."""
    clashes = [("--prompt", args.prompt is not None), ("--batch-size", args.batch_size != 1),
               ("--speculate", args.speculate is not None),
               ("--warm-tokens (tiers)", getattr(args, "warm_tokens", None) is not None)]
    for flag, given in clashes:
        if given:
            why = {"--prompt": "the prompts come from the file", "--batch-size": "the batch is the file's prompts"}
            raise KVFastError(f"--prompts does not combine with {flag}"
                              + (f": {why[flag]}" if flag in why else ": not built for ragged batches"))


def single_row_args(args: argparse.Namespace) -> argparse.Namespace:
    """The cache flags for the one-row caches a prompt is prefilled into: the batch's, K/V in full precision
    (the batch's caches quantize them once, when the row is loaded)."""
    return argparse.Namespace(**{**vars(args), "kv_bits": None, "kv_group_size": None})


def padded(rows: list[list[int]], device: str | torch.device) -> Tensor:
    """[B, longest] ids, shorter rows left-padded with their first token (what the compiled warm-up needs: shapes)."""
    longest = max(map(len, rows))
    return torch.tensor([[r[0]] * (longest - len(r)) + r for r in rows], dtype=torch.long, device=device)


def prefill_rows(model: Transformer, rows: list[list[int]], batch_caches: list, single_caches: list, prefill,
                 temperature: float, top_k: int | None) -> Tensor:
    """Prefill each prompt alone into single_caches (one row), load it into its row of batch_caches, install
    them; returns each row's first token [B, 1]. prefill(model, idx [1, S], temperature, top_k) -> [1, 1]."""
    longest = max(map(len, rows))
    model.setup_caches(lambda i: single_caches[i])
    for c in batch_caches:
        c.reset()
    firsts = []
    for r, ids in enumerate(rows):
        for c in single_caches:
            c.reset()
        firsts.append(prefill(model, torch.tensor([ids], device=batch_caches[0].device), temperature, top_k))
        for batch, single in zip(batch_caches, single_caches):
            batch.load_row(r, single, longest - len(ids))
    model.setup_caches(lambda i: batch_caches[i])
    for c in batch_caches:
        c.seen.fill_(longest)
        c.after_load()
    return torch.cat(firsts, 0)


def row_report(model: Transformer, rows: list[list[int]], tokens: Tensor, stop_ids: set[int] | None) -> list[str]:
    """Per row: prompt tokens, new tokens up to its stop, and the slots it holds (mean over layers and KV heads)."""
    kept = torch.stack([c.kept().float().reshape(len(rows), -1).mean(-1) for c in model.caches]).mean(0)
    lines = []
    for r, ids in enumerate(rows):
        out = tokens[r].tolist()
        n = next((i for i, t in enumerate(out) if stop_ids and t in stop_ids), len(out))
        lines.append(f"row {r}: prompt {len(ids)} tokens, {n} new tokens, {kept[r]:.1f} slots held per layer "
                     "and KV head")
    return lines
