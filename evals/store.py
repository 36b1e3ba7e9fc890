"""eval.py's results: the results.json store (resumable: finished records are skipped) and the record keys."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from evals.caches import Combo
from model import KVFastError

NO_MODE = "-"  # ppl and attention loss have no question


def record_key(task: str, length: int, index: int, combo: Combo, mode: str) -> str:
    """The combo's name (h2o, h2o+warm, ...) keys its records: tiered and plain cells are cached apart."""
    return f"{task}|{length}|{index}|{combo.name}|{combo.budget}|{mode}"


CONFIG_KEYS = ("checkpoint", "seed", "chat", "dtype", "haystack", "ppl_text", "depths", "fidelity_tokens",
               "answer_room", "ppl_length", "ppl_every", "ppl_decode_all", "params", "budget_unit", "warm_share",
               "shared_questions")


class Store:
    """results.json: the run's configuration and one record per (task, length, sample, policy, budget, mode)."""

    def __init__(self, out: Path, config: dict[str, Any], overwrite: bool):
        self.path = out / "results.json"
        self.config = config
        self.records: dict[str, dict] = {}
        self.overwrite = overwrite
        if self.path.exists():
            try:
                saved = json.loads(self.path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise KVFastError(f"cannot read {self.path}: {e}") from None
            if saved.get("config") == config:
                self.records = {r["key"]: r for r in saved.get("records", [])}
            elif not overwrite:
                differ = [k for k in CONFIG_KEYS if saved.get("config", {}).get(k) != config.get(k)]
                raise KVFastError(f"{self.path} holds results of another configuration (differs in {differ}); "
                                  "use --overwrite or another --out")
        self.fresh: set[str] = set()

    def done(self, key: str) -> bool:
        return key in self.records and (not self.overwrite or key in self.fresh)

    def add(self, record: dict) -> None:
        self.records[record["key"]] = record
        self.fresh.add(record["key"])

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"config": self.config, "records": list(self.records.values())}, indent=1))
        os.replace(tmp, self.path)


def head_fields(report: list[dict[str, Any]] | None, row: int) -> dict[str, Any]:
    """hybrid's / fastgen's head classes of one batch row (cache.head_class_report), per layer: "head_classes"
    (one letter per KV head: "S" static, "D" dynamic for hybrid) and the slots of each kind; no fields for
    other policies."""
    if report is None:
        return {}
    fields = {"head_classes": [layer["heads"][row] for layer in report]}
    for kind in report[0]["kinds"]:
        fields[f"{kind}_slots"] = [layer[f"{kind}_slots"][row] for layer in report]
    return fields


def add_record(store: Store, bar: Any, record: dict, combo: Combo) -> None:
    record["key"] = record_key(record["task"], record["length"], record["index"], combo, record["mode"])
    if not store.done(record["key"]):
        store.add(record)
        bar.update(1)
