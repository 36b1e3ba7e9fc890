"""llama.cpp beside kvfast (`bench.py --peers llama.cpp`): the prebuilt CPU llama.cpp of the llama-cpp-cffi
wheel, installed on first use into .peers/llamacpp (never into the project's .venv), run on the same GGUF the
default checkpoint was converted from, with the same prompt ids, new tokens and thread count
(pinned at 0.4.20: later versions need a newer libstdc++ than Debian 12 ships)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from model import KVFastError
from scripts.peer_env import ensure_peer_env, one_line, worker_env

ROOT = Path(__file__).resolve().parent.parent
LLAMACPP_REQUIREMENTS = ("llama-cpp-cffi==0.4.20", "cffi")
DEFAULT_ENV = ROOT / ".peers" / "llamacpp"
WORKER = Path(__file__).resolve().parent / "peer_llamacpp_worker.py"
# the wheel's package __init__ imports transformers (not installed: --no-deps); the worker needs the .so alone
CHECK = ("import glob, sys; assert glob.glob(sys.prefix + '/lib/python3*/site-packages/llama/_llama_cpp_cpu*.so'), "
         "'no CPU build in the wheel'")


def time_llamacpp(gguf: Path, prompt: list[int], new_tokens: int, threads: int, repeats: int,
                  env: Path = DEFAULT_ENV) -> dict:
    """Median prefill seconds and decode tokens/s of llama.cpp, greedy, after one warm-up run; also its
    system_info line (the SIMD it was built for and uses) and the greedy tokens."""
    if not gguf.exists():
        raise KVFastError(f"llama.cpp needs the GGUF {gguf} (run scripts/prepare.py)")
    python = ensure_peer_env(env, LLAMACPP_REQUIREMENTS, CHECK, pip_flags=("--no-deps",))
    job = {"gguf": str(gguf), "prompt": prompt, "new_tokens": new_tokens, "threads": threads,
           "repeats": repeats}
    done = subprocess.run([str(python), str(WORKER)], input=json.dumps(job), capture_output=True, text=True,
                          check=False, env=worker_env(threads))
    if done.returncode != 0:
        raise KVFastError(f"llama.cpp worker failed (exit {done.returncode}): "
                          f"{one_line(done.stderr or done.stdout, 300)}")
    return json.loads(done.stdout.strip().splitlines()[-1])
