"""Peers (kvpress, llama.cpp) run in environments of their own under .peers/, created on first use, so the
project's .venv never receives their dependencies."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from model import KVFastError


def one_line(text: str, limit: int = 400) -> str:
    """The last lines of a tool's output, joined into one line for an error message."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    tail = " | ".join(lines[-4:])
    return tail[-limit:] if tail else "(no output)"


def ensure_peer_env(env: Path, requirements: Sequence[str], check: str, pip_flags: Sequence[str] = ()) -> Path:
    """The python of environment `env`, created with `requirements` installed on first use (a stamp file
    records them, so a changed pin reinstalls); `check` is Python code that must run there afterwards."""
    python = env / "bin" / "python"
    stamp = env / ".kvfast-installed"
    if stamp.exists() and stamp.read_text().split() == list(requirements) and python.exists():
        return python
    what = " ".join(requirements)
    print(f"installing {what} into {env} (first use, a few minutes)...", flush=True)
    steps = ([] if python.exists() else [[sys.executable, "-m", "venv", str(env)]])
    # torch==2.13.0 resolves like requirements.txt does (the CPU wheel on local disk, via pip's config)
    steps.append([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *pip_flags,
                  *requirements])
    steps.append([str(python), "-c", check])
    for cmd in steps:
        try:
            done = subprocess.run(cmd, check=False, capture_output=True, text=True)
        except OSError as e:
            raise KVFastError(f"cannot install {requirements[0]} into {env}: {e}") from None
        if done.returncode != 0:
            raise KVFastError(f"cannot install {requirements[0]} into {env}: {one_line(done.stderr or done.stdout)}")
    stamp.write_text("\n".join(requirements) + "\n")
    return python


def worker_env(threads: int | None) -> dict[str, str]:
    """The environment of a peer's worker process: quiet, offline, and `threads` threads if given."""
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env
