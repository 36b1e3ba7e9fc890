"""eval.py --ray: the grid's cells as Ray tasks, results streamed back into the same results.json store.

    python eval.py --ray --ray-workers 2 ...        # a local Ray cluster of 2 workers on this machine
    python eval.py --ray auto ...                   # an existing cluster (`ray start --head` here, or ADDRESS)

Each cell (a batch of samples of one task and length, evals.evaluator.Cell) is one task: it prefills once and
runs every policy and budget on it, as a single process would. A worker loads the model once and keeps it for the cells it
runs next. The driver adds each finished cell's records to the store and saves it, so a run stopped at any point
resumes where it was (finished cells are skipped, a partly done cell computes only what is missing); a worker
killed mid-cell loses only that cell, which Ray runs again (`max_retries`), and since records are keyed, nothing
is counted twice. Every node must see this checkout and the checkpoint at the same paths (a shared file system,
or the same image); workers import the project from its folder.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch

from cli import load
from decode import configure_torch
from evals.caches import Evaluator
from evals.evaluator import Cell, Inputs, combos_of, run_cell
from evals.store import Store
from model import KVFastError

ROOT = Path(__file__).resolve().parent.parent  # the repository: a worker's PYTHONPATH
RETRIES = 3  # a cell whose worker dies is run again, up to this many times


class CellStore:
    """What evals.evaluator.run_cell needs of a Store, inside a worker: the cell's finished keys in, its new records out."""

    def __init__(self, done: set[str]):
        self.finished, self.records = done, {}

    def done(self, key: str) -> bool:
        return key in self.finished or key in self.records

    def add(self, record: dict) -> None:
        self.records[record["key"]] = record

    def save(self) -> None:
        """Nothing here: the driver saves what the task returns."""


class NoBar:
    def update(self, n: int = 1) -> None: ...

    def set_postfix_str(self, text: str) -> None: ...


_WORKER: dict[tuple, Any] = {}  # per worker process: (evaluator, its inputs) of the last checkpoint it loaded


def run_cell_task(args: argparse.Namespace, checkpoint: str, dtype: str, cell: Cell, done: list[str]) -> list[dict]:
    """A Ray task: the records of one cell (those not in done)."""
    key = (checkpoint, args.device, dtype)
    if key not in _WORKER:
        configure_torch(args.compile)
        model, tokenizer = load(Path(checkpoint), args.device, getattr(torch, dtype))
        evaluator = Evaluator(model, tokenizer, args)
        _WORKER.clear()
        _WORKER[key] = (evaluator, Inputs(evaluator))
    evaluator, inputs = _WORKER[key]
    store = CellStore(set(done))
    with torch.inference_mode():
        run_cell(evaluator, inputs, cell, combos_of(args), store, NoBar())
    return list(store.records.values())


def connect(address: str, workers: int | None) -> Any:
    """ray.init for a local cluster of `workers` CPUs (address "local") or an existing one."""
    try:
        import ray
    except ImportError:
        raise KVFastError("--ray needs Ray, which is not installed: pip install 'ray==2.60.0' (make setup puts it "
                          "in .venv)") from None
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                        "OMP_WAIT_POLICY": "PASSIVE"}}
    if address == "local":
        ray.init(num_cpus=workers or os.cpu_count(), include_dashboard=False, runtime_env=env,
                 log_to_driver=False, configure_logging=False)
    else:
        if workers:
            raise KVFastError("--ray-workers sizes a local cluster; an existing one has its own workers")
        ray.init(address=address, runtime_env=env, log_to_driver=False, configure_logging=False)
    return ray


def run_cells(cells: list[Cell], keys: dict[Cell, list[str]], store: Store, bar: Any, *, address: str,
              args: argparse.Namespace, checkpoint: Path, dtype: str, workers: int | None = None) -> None:
    """Submit every cell, then take results as they come: add, save, count. The keywords say where (a cluster
    address, or "local") and how a worker loads the model; bound, this is evals.evaluator's RemoteRunner."""
    ray = connect(address, workers)
    try:
        task = ray.remote(num_cpus=1, max_retries=RETRIES)(run_cell_task)
        pending = {task.remote(args, str(checkpoint), dtype, cell, [k for k in keys[cell] if store.done(k)]): cell
                   for cell in cells}
        bar.set_postfix_str(f"{len(pending)} cells on Ray ({int(ray.cluster_resources().get('CPU', 0))} CPUs)")
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            cell = pending.pop(ready[0])
            try:
                records = ray.get(ready[0])
            except ray.exceptions.RayError as e:  # the task raised, or its worker died more than RETRIES times
                cause = getattr(e, "cause", None)
                reason = f"{type(cause).__name__}: {cause}" if cause else str(e).splitlines()[0]
                raise KVFastError(f"Ray: the cell {cell.source}@{cell.length} samples {list(cell.indices)} failed: "
                                  f"{reason}") from None
            for record in records:
                if not store.done(record["key"]):
                    store.add(record)
                    bar.update(1)
            store.save()
    finally:
        ray.shutdown()
