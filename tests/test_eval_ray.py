"""eval.py --ray (evals/ray.py): a local 2-worker Ray cluster runs a tiny grid, one worker is killed mid-run, and
the merged results equal a single-process run's; reruns skip finished cells; Ray missing is one line."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cache_testing import single_thread_fixture

import eval as ev_mod
from evals import ray as eval_ray
from model import KVFastError

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)

REPO = Path(__file__).resolve().parent.parent
TIMING = ("time_s", "prefill_s")


def grid_flags(checkpoint: Path) -> list[str]:
    return ["--checkpoint", str(checkpoint), "--tasks", "passkey", "ppl", "--policies", "full", "h2o", "--budgets",
            "0.5", "--lengths", "384", "--samples", "6", "--batch-size", "2", "--ppl-length", "256", "--ppl-samples",
            "2", "--ppl-every", "128", "--answer-room", "16", "--no-plots"]


def records(out: Path) -> dict[str, dict]:
    saved = json.loads((out / "results.json").read_text())["records"]
    return {r["key"]: {k: v for k, v in r.items() if k not in TIMING} for r in saved}


def running_cell_tasks() -> list[int]:
    """Pids of Ray workers executing a cell now (a worker's process title names its task)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                title = (entry / "cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if title.startswith(b"ray::run_cell_task"):
                pids.append(int(entry.name))
    return pids


def test_killed_worker_loses_nothing(tiny_checkpoint, tmp_path):
    flags = grid_flags(tiny_checkpoint)
    alone = ev_mod.main([*flags, "--out", str(tmp_path / "alone")])
    cmd = [sys.executable, "eval.py", *flags, "--out", str(tmp_path / "ray"), "--ray", "--ray-workers", "2"]
    log = tmp_path / "ray.log"
    with log.open("w") as sink:  # a file, not a pipe nobody reads while the run lasts
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    killed = None
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        busy = running_cell_tasks()
        if busy and killed is None:
            killed = busy[0]
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.02)
    proc.wait(timeout=60)
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert "will be retried" in log.read_text()  # Ray saw the task's worker die and ran the cell again
    assert killed is not None, "no cell was seen running: nothing was killed"
    expected, merged = records(alone), records(tmp_path / "ray")
    assert len(expected) == 6 * 2 + 2 * 2  # passkey: 6 samples x 2 combos; ppl: 2 windows x 2 combos
    assert merged.keys() == expected.keys()
    for key, r in expected.items():
        got = merged[key]
        if r["task"] == "ppl":
            for name, value in r["metrics"].items():
                assert got["metrics"][name] == pytest.approx(value, rel=1e-5), (key, name)
            got, r = {**got, "metrics": None}, {**r, "metrics": None}
        assert got == r, key

    # a rerun finds every cell finished: no Ray cluster is started, nothing is recomputed
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    assert again.returncode == 0, again.stderr[-2000:]
    assert records(tmp_path / "ray") == merged
    assert "cells on Ray" not in again.stderr


def test_ray_flags_and_missing_ray_are_one_line_errors(monkeypatch, tmp_path):
    with pytest.raises(KVFastError, match="--ray-workers needs --ray"):
        ev_mod.parse_args(["--ray-workers", "2"])
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now fails as if not installed
    with pytest.raises(KVFastError, match="--ray needs Ray, which is not installed: pip install 'ray==2.60.0'"):
        eval_ray.connect("local", 2)
