"""A portable torch.compile cache in one file (`generate.py --compile-cache FILE`).

torch.compiler.save_cache_artifacts() serializes what Inductor / AOTAutograd compiled (or found in their
local caches) in this process; load_cache_artifacts() writes such artifacts back into the local caches, so
a fresh checkout, a wiped /tmp or another machine of the same kind finds its graphs there instead of
compiling them. Artifacts are only valid for the torch build, Python version and device kind that made
them, so the file starts with a header saying which (plus a checksum of the payload):

    KVFAST-COMPILE-CACHE 1\\n
    {"torch": ..., "python": ..., "device": ..., "sha256": ..., "size": ..., "artifacts": n,
     "kernels": [[relative path, size], ...]}\\n
    <n bytes from save_cache_artifacts()> <each kernel library's bytes>

On CPU the artifacts hold the generated C++ source but not the compiled libraries: a fresh cache would
run the C++ compiler again, which is most of a CPU compile. So the file also carries the kernel libraries
this process loaded (CppCodeCache), installed back under the same names: the name hashes the source and
the compiler command line (paths included), so a library is only found where it is valid. On CUDA torch
already bundles the Triton kernels into the artifacts.

A file that is unreadable, corrupt or made for something else is never fatal: one warning line on stderr,
a normal compile, and the file is rewritten after it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import platform
import sys
import tempfile
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

MAGIC = b"KVFAST-COMPILE-CACHE 1\n"


def device_kind(device: str) -> str:
    """What compiled code depends on besides torch: the GPU model and its compute capability, or the CPU
    model and the vector ISA torch dispatches to (Inductor's C++ kernels are built for it)."""
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda {torch.version.cuda}: {torch.cuda.get_device_name(index)} (sm_{major}{minor})"
    return f"cpu {platform.machine()}: {_cpu_model()} ({torch.backends.cpu.get_cpu_capability()})"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment(device: str) -> dict[str, str]:
    return {"torch": torch.__version__, "python": platform.python_version(), "device": device_kind(device)}


@dataclass
class CompileCache:
    """Load before the first compiled call, save after the warm-up; `report()` says what happened."""

    path: Path
    device: str
    loaded: bytes | None = None  # the payload loaded, to skip rewriting an unchanged file
    n_loaded: int = 0
    n_saved: int = 0
    kernels_loaded: set[str] = field(default_factory=set)
    kernels_installed: int = 0
    hits_before: int = 0  # Inductor graphs found in the local cache since load(): compiles the file saved
    written: bool = False

    def load(self) -> None:
        """Populate torch's local compile caches from the file; a missing file is a cold start (silent), any
        other problem one warning line."""
        self.hits_before = _fx_graph_hits()
        if not self.path.exists():
            return
        try:
            payload, kernels = self._read_valid()
        except ValueError as e:
            _warn(f"compile cache {self.path} {e}; compiling from scratch (the file will be rewritten)")
            return
        # torch logs a traceback when it cannot unpickle the artifacts: keep the error to our one line
        with _quiet("torch.compiler._cache"):
            try:
                info = torch.compiler.load_cache_artifacts(payload)
            except Exception as e:  # noqa: BLE001 - any failure here only costs a normal compile
                info, error = None, f"{type(e).__name__}: {e}"
            else:
                error = "artifacts cannot be read"
        if info is None:
            _warn(f"compile cache {self.path}: {error}; compiling from scratch (the file will be rewritten)")
            return
        self.loaded = payload
        self.n_loaded = _count(info)
        self.kernels_loaded = {rel for rel, _ in kernels}
        self.kernels_installed = install_kernels(kernels)

    def _read_valid(self) -> tuple[bytes, list[tuple[str, bytes]]]:
        """(torch's artifacts, [(kernel path relative to Inductor's cache, bytes)]) or ValueError(why)."""
        try:
            data = self.path.read_bytes()
        except OSError as e:
            raise ValueError(f"cannot be read ({e.strerror})") from None
        if not data.startswith(MAGIC):
            raise ValueError("is not a kvfast compile cache")
        header_end = data.find(b"\n", len(MAGIC))
        try:
            header = json.loads(data[len(MAGIC) : header_end])
            expected_sha, expected_size = header["sha256"], header["size"]
        except (ValueError, KeyError, TypeError):
            raise ValueError("is corrupt (bad header)") from None
        payload = data[header_end + 1 :] if header_end >= 0 else b""
        if len(payload) != expected_size or hashlib.sha256(payload).hexdigest() != expected_sha:
            raise ValueError("is corrupt (checksum mismatch)")
        here = environment(self.device)
        for key, value in here.items():
            if header.get(key) != value:
                raise ValueError(f"was made for {key} {header.get(key)!r}, this is {value!r}")
        try:
            start, kernels = int(header.get("artifacts", len(payload))), []
            for rel, size in header.get("kernels", []):
                kernels.append((str(rel), payload[start : start + size]))
                start += size
        except (ValueError, TypeError):
            raise ValueError("is corrupt (bad kernel list)") from None
        return payload[: int(header.get("artifacts", len(payload)))], kernels

    def save(self) -> None:
        """Write what this process compiled or loaded, atomically (a crash or a concurrent run never leaves a
        half-written file); a failure to write is one warning line."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return
        artifacts, info = saved
        self.n_saved = _count(info)
        kernels = kernel_files()
        if artifacts == self.loaded and kernels <= self.kernels_loaded:
            return  # nothing new: keep the file as it is
        root = Path(inductor_cache_dir())
        blobs = [(rel, (root / rel).read_bytes()) for rel in sorted(kernels)]
        payload = artifacts + b"".join(blob for _, blob in blobs)
        header = {**environment(self.device), "sha256": hashlib.sha256(payload).hexdigest(),
                  "size": len(payload), "artifacts": len(artifacts),
                  "kernels": [[rel, len(blob)] for rel, blob in blobs]}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.path, MAGIC + json.dumps(header).encode() + b"\n" + payload)
        except OSError as e:
            _warn(f"cannot write the compile cache {self.path}: {e.strerror or e}")
            return
        self.written = True

    def report(self) -> str:
        hits = _fx_graph_hits() - self.hits_before
        loaded = (f"{self.n_loaded} artifacts and {len(self.kernels_loaded)} C++ kernels loaded "
                  f"({self.kernels_installed} installed), {hits} Inductor graphs found" if self.n_loaded
                  else "cold (nothing loaded)")
        saved = f", {self.n_saved} artifacts saved" if self.written else ", unchanged"
        return f"compile cache: {self.path}: {loaded}{saved}"


def inductor_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def kernel_files() -> set[str]:
    """The C++ kernel libraries this process compiled or loaded and Inductor's ISA probes, relative to its
    cache directory
    (`<cache>/<key[1:3]>/<key>*.so`, the layout of torch._inductor.codecache.write). Private torch API: if it
    changes, nothing is bundled and a fresh machine runs the C++ compiler, which is slower, not wrong."""
    try:
        from torch._inductor import codecache

        keys = set()
        for cls in (codecache.CppCodeCache, codecache.CppPythonBindingsCodeCache, codecache.CppWrapperCodeCache):
            keys |= set(cls.cache)
        root = Path(inductor_cache_dir())
        kernels = {f for key in keys for f in (root / key[1:3]).glob(f"{key}*.so")}
        return {str(f.relative_to(root)) for f in kernels | isa_probes(root)}
    except Exception:  # noqa: BLE001
        return set()


def isa_probes(root: Path) -> set[Path]:
    """The little libraries with which Inductor checks once per cache which vector ISAs the CPU builds and
    runs (torch._inductor.cpu_vec_isa.VecISA.check_build, `<key>.so` beside a `<key>.cpp` that defines a
    `*_chk_kernel`): about 10 compiler runs, a second each, before the first kernel. Valid on the same CPU
    model, which the header checks. Only built where trust_cpu_vector_flags() leaves the probe on."""
    probes = set()
    for lib in root.glob("??/*.so"):
        if lib.name.endswith(".main.so") or lib.stat().st_size > 1 << 16:
            continue
        source = lib.with_suffix(".cpp")
        if source.exists() and source.stat().st_size < 1 << 14 and "_chk_kernel()" in source.read_text():
            probes.add(lib)
    return probes


def trust_cpu_vector_flags() -> None:
    """Let Inductor take its vector ISA from the CPU's flags instead of compiling and dlopen-ing a probe library
    per ISA in every process (3.3 s cold, 0.5 s warm per ISA on a 2-core AVX2 EPYC; h2o's cold block-scope
    compile 17.5 -> 9.0 s: docs/compile.md). Only where ATen itself runs AVX2 / AVX-512 kernels on this machine (so CPU
    and OS support them); KVFAST_PROBE_VEC_ISA=1 keeps Inductor's probe."""
    from torch._inductor import config

    if os.environ.get("KVFAST_PROBE_VEC_ISA") == "1" or config.cpp.vec_isa_ok is not None:
        return
    if platform.machine() in ("x86_64", "AMD64") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        config.cpp.vec_isa_ok = True


def guard_free(compiled: Callable, *args: Any) -> Callable | None:
    """The code dynamo compiled for `compiled` whose guards pass for args, as a plain function that calls it
    without dynamo's cache lookup, or None (not a torch.compile'd function, or not exactly one compiled entry
    passes). For calls that keep passing those guards (a decode call's later steps: same caches, shapes and
    strides): the lookup evaluates guards on every weight and cache buffer of every layer, ~1 ms of a 7.5 ms int8
    step at 512 tokens, where torch.compiler.set_stance(skip_guard_eval_unsafe=True) still checks every tensor
    (docs/speed.md). Nothing notices if a later call would fail those guards: the caller must know it cannot."""
    fn = getattr(compiled, "_torchdynamo_orig_callable", None)
    if not isinstance(fn, types.FunctionType):
        return None
    bound = inspect.signature(fn).bind(*args)
    bound.apply_defaults()
    frame_locals = dict(bound.arguments)
    try:  # dynamo's own debugging accessor (torch is pinned; another version may lack it: then guards stay)
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        passing = [e for e in _debug_get_cache_entry_list(fn.__code__) if e.guard_manager.check(frame_locals)]
    except (ImportError, AttributeError):
        return None
    if len(passing) != 1:
        return None
    return types.FunctionType(passing[0].code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def install_kernels(kernels: list[tuple[str, bytes]]) -> int:
    """Write the libraries the local cache lacks; returns how many. Names are checked to stay inside the
    cache directory."""
    root, installed = Path(inductor_cache_dir()), 0
    for rel, blob in kernels:
        parts = Path(rel).parts
        if len(parts) != 2 or not rel.endswith(".so") or any(part in ("", ".", "..") for part in parts):
            continue
        target = root / rel
        if target.exists():
            continue
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(target, blob)
            target.chmod(0o755)
            installed += 1
        except OSError:
            pass  # the kernel is compiled as usual
    return installed


def write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fx_graph_hits() -> int:
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"]


def _count(info) -> int:
    return sum(len(v) for v in info.artifacts.values())


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


class _quiet:
    """Silence one logger for a block."""

    def __init__(self, name: str):
        self.logger = logging.getLogger(name)

    def __enter__(self) -> None:
        self.disabled = self.logger.disabled
        self.logger.disabled = True

    def __exit__(self, *exc) -> None:
        self.logger.disabled = self.disabled


def graph_count() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def dynamo_count(kind: str) -> int:
    """Recompiles or graph breaks so far, all reasons together (dynamo's counters)."""
    from torch._dynamo.utils import counters

    return sum(counters[kind].values())
