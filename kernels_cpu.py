"""The integer dot-product linear kernels of kernels_cpu.cpp (one-token rows) and gemm_cpu.cpp (a prompt's rows)
and the attention kernels of attention_cpu.cpp: built together at first use for one instruction set, loaded, and
registered as torch ops (with Meta shapes) that a compiled decode step calls as extern kernels.

The instruction set is the best one the chosen CPU kind has (kernels.cpu(), so KVFAST_CPU=avx2 builds the AVX2
variant) that this CPU also runs. Each variant is its own op namespace (kvfast_avx512_vnni, kvfast_avx2,
kvfast_scalar), and its build directory under ~/.cache/kvfast/cpp is named by the compile flags, the sources' hash
and torch's version: a build is never loaded for another CPU kind or another torch. Without a working compiler the
kernels are unavailable (one warning) and kernels.py keeps its Inductor reductions.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

SOURCES = tuple(Path(__file__).with_name(f) for f in ("kernels_cpu.cpp", "gemm_cpu.cpp", "attention_cpu.cpp"))  # one extension
HEADERS = (Path(__file__).with_suffix(".h"),)
ISA_FLAGS = {
    "avx512-vnni": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                    "-mavx512vnni"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "scalar": [],
}
ISAS = tuple(ISA_FLAGS)


def isa_of(chip: Any, native: Any) -> str:
    """The instruction set of the kernels for CPU kind `chip` (kernels.CPU), within what `native` runs."""
    if chip.avx512_vnni and native.avx512_vnni:
        return "avx512-vnni"
    return "avx2" if chip.avx2 and native.avx2 else "scalar"


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvfast"


def build_name(isa: str) -> tuple[str, list[str]]:
    """(namespace_key, compile flags): the name of the variant's build, keyed by flags, source and torch."""
    ns = "kvfast_" + isa.replace("-", "_")
    flags = ["-O3", "-fopenmp", f"-DKVFAST_NS={ns}", *ISA_FLAGS[isa]]
    source = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    digest = hashlib.sha256(source + " ".join(flags).encode() + torch.__version__.encode())
    return f"{ns}_{digest.hexdigest()[:16]}", flags


_loaded: dict[str, Any] = {}  # isa -> its op namespace (torch.ops.kvfast_<isa>), or None: the build failed
_meta: list[torch.library.Library] = []


def ops(isa: str) -> Any:
    """torch.ops.kvfast_<isa> with int8_linear, int4_linear, int4_dequantize and quantize_activations (and, in the
    AVX-512 and AVX2 builds, int8_linear_tiled, int4_linear_tiled, one_query_attention and the prompt's int8_gemm /
    int4_gemm; in the AVX-512 build, prompt_attention), built on first use; None (after one warning) where it
    cannot be built."""
    if isa not in _loaded:
        _loaded[isa] = _build(isa)
    return _loaded[isa]


def _build(isa: str) -> Any:
    from torch.utils import cpp_extension

    name, flags = build_name(isa)
    ns = name.rsplit("_", 1)[0]
    folder = cache_root() / "cpp" / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name=name, sources=[str(path) for path in SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                           build_directory=str(folder), is_python_module=False, verbose=False)
    except Exception as e:  # noqa: BLE001 -- no compiler, no ninja, a read-only cache: all mean the same here
        lines = str(e).strip().splitlines() or [type(e).__name__]
        reason = next((line for line in lines if "error" in line.lower()), lines[-1]).strip()
        warnings.warn(f"kvfast: the integer CPU kernels ({isa}) could not be built, so int8 / int4 weights use "
                      f"the slower fused reductions ({reason[:200]})", stacklevel=3)
        return None
    meta = torch.library.Library(ns, "IMPL")
    meta.impl("int8_linear", lambda x, codes, scales: x.new_empty(*x.shape[:-1], codes.shape[0]), "Meta")
    meta.impl("int4_linear", lambda x, packed, scales, offsets: x.new_empty(*x.shape[:-1], packed.shape[0]), "Meta")
    meta.impl("quantize_activations", lambda x: (x.new_empty(x.shape, dtype=torch.int8),
                                                 x.new_empty(*x.shape[:-1], x.shape[-1] // 32)), "Meta")
    meta.impl("int4_dequantize", lambda packed, scales, offsets, dtype, tiled=False: packed.new_empty(
        packed.shape[0], 2 * packed.shape[1], dtype=dtype), "Meta")
    if hasattr(getattr(torch.ops, ns), "one_query_attention"):  # AVX-512 and AVX2 builds
        meta.impl("one_query_attention", lambda q, k, v, mask, scale: (
            q.new_empty(q.shape), q.new_empty(*q.shape[:3], k.shape[2])), "Meta")
    if hasattr(getattr(torch.ops, ns), "int8_linear_tiled"):  # AVX-512 and AVX2 builds
        meta.impl("int8_linear_tiled", lambda x, codes, scales: x.new_empty(*x.shape[:-1], codes.shape[0]), "Meta")
        meta.impl("int4_linear_tiled", lambda x, packed, scales, offsets: x.new_empty(*x.shape[:-1], packed.shape[0]),
                  "Meta")
    if hasattr(getattr(torch.ops, ns), "int8_gemm"):  # AVX-512 and AVX2 builds
        meta.impl("int8_gemm", lambda x, codes, scales, tiled: x.new_empty(*x.shape[:-1], codes.shape[0]), "Meta")
        meta.impl("int4_gemm", lambda x, packed, scales, offsets, tiled: x.new_empty(*x.shape[:-1], packed.shape[0]),
                  "Meta")
    _meta.append(meta)
    return getattr(torch.ops, ns)


# ---- which products take the integer kernels on this machine: timed once, remembered ---------------------------
def time_calls(fn: Callable[[], object], calls: int = 10, rounds: int = 7) -> float:
    """Seconds per call of fn, the median over `rounds` of `calls` calls each, after two untimed ones."""
    fn(), fn()
    per_round = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_round.append((time.perf_counter() - t0) / calls)
    return statistics.median(per_round)


def remembered_choice(key: str, names: list[str], faster: Callable[[str], tuple[bool, float, float]]) -> dict[str, bool]:
    """For each name, whether the integer kernels win, from ~/.cache/kvfast/choices.json under `key`, else timed
    now by faster(name) -> (integer wins, integer seconds, other seconds) and written there for the next process."""
    path = cache_root() / "choices.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: time again
        saved = {}
    entry = saved.get(key, {})
    if not all(name in entry for name in names):
        print(f"kvfast: timing the integer kernels against the reductions for {', '.join(names)} weights on this "
              f"machine (once; remembered in {path})", file=sys.stderr, flush=True)
        for name in names:
            wins, t_int, t_other = faster(name)
            entry[name] = {"integer": wins, "integer_us": round(t_int * 1e6, 1), "other_us": round(t_other * 1e6, 1)}
        saved[key] = entry
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(saved, indent=1))
            tmp.replace(path)
        except OSError:  # a read-only cache: the choice holds for this process only
            pass
    return {name: bool(entry[name]["integer"]) for name in names}


# ---- the tiled layouts of the integer products (kernels_cpu.cpp int8_linear_tiled / int4_linear_tiled) --------------
# Same shapes and bytes as quantize.py's row-major weights, rearranged in tiles of TILE_ROWS output rows so that
# each vector lane is one output row. Plain tensor ops: they run once per layer when a model is tiled, and in a
# compiled graph where a tiled layer meets a kernel that reads rows (its views fuse into the reduction).
TILE_ROWS = 16


def tileable(out_features: int, in_features: int, n_groups: int = 1) -> bool:
    """Can this int8 / int4 projection be tiled, or multiplied by the integer GEMM (whole tiles; int4 groups of a
    multiple of 32 columns)."""
    group = in_features // n_groups
    return out_features % TILE_ROWS == 0 and in_features % 32 == 0 and group % 32 == 0 and group * n_groups == in_features


def tile_int8(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [out, in] -> [out / 16][in / 4][16][4] of code + 128, as int8 bits of the same shape."""
    out, n = codes.shape
    tiles = codes.view(out // TILE_ROWS, TILE_ROWS, n // 4, 4).transpose(1, 2).contiguous()
    return (tiles.view(torch.uint8) ^ 0x80).view(torch.int8).view(out, n)


def untile_int8(tiled: torch.Tensor) -> torch.Tensor:
    out, n = tiled.shape
    tiles = (tiled.view(torch.uint8) ^ 0x80).view(torch.int8).view(out // TILE_ROWS, n // 4, TILE_ROWS, 4)
    return tiles.transpose(1, 2).reshape(out, n)


def tiled_int8_rows(tiled: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows `idx` of tiled int8 codes, as rows ([*idx.shape, in]): an embedding lookup in a tiled head."""
    out, n = tiled.shape
    tiles = tiled.view(torch.uint8).view(out // TILE_ROWS, n // 4, TILE_ROWS, 4)
    return (tiles[idx // TILE_ROWS, :, idx % TILE_ROWS] ^ 0x80).view(torch.int8).view(*idx.shape, n)


def tile_groups(per_group: torch.Tensor) -> torch.Tensor:
    """int4 scales or offsets [out, n_groups] -> [out / 16][n_groups][16], same shape."""
    out, n_groups = per_group.shape
    return per_group.view(out // TILE_ROWS, TILE_ROWS, n_groups).transpose(1, 2).contiguous().view(out, n_groups)


def untile_groups(tiled: torch.Tensor) -> torch.Tensor:
    out, n_groups = tiled.shape
    return tiled.view(out // TILE_ROWS, n_groups, TILE_ROWS).transpose(1, 2).reshape(out, n_groups)


def tile_int4(packed: torch.Tensor) -> torch.Tensor:
    """int4 codes [out, in / 2] (column j low, j + in / 2 high) -> [out / 16][in / 8][16][4] bytes, byte i of a
    row holding column 8c + i low and 8c + 4 + i high."""
    out, half = packed.shape
    codes = torch.cat([packed & 15, packed >> 4], 1).view(out // TILE_ROWS, TILE_ROWS, half // 4, 2, 4)
    tiles = codes[:, :, :, 0] | (codes[:, :, :, 1] << 4)
    return tiles.transpose(1, 2).contiguous().view(out, half)


def untile_int4(tiled: torch.Tensor) -> torch.Tensor:
    out, half = tiled.shape
    tiles = tiled.view(out // TILE_ROWS, half // 4, TILE_ROWS, 4).transpose(1, 2)  # [T, 16, in / 8, 4]
    codes = torch.stack([tiles & 15, tiles >> 4], 3).reshape(out, 2 * half)  # columns in order
    return codes[:, :half] | (codes[:, half:] << 4)


def int4_rows(packed: Tensor, scales: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Tiled int4 codes, scales and offsets back in quantize.py's rows (untile_int4 is the codes' half)."""
    return (untile_int4(packed), untile_groups(scales).float(),
            untile_groups(offsets).float())


def retile(layer: torch.nn.Module, tiled: bool) -> None:
    """An Int8Linear / Int4Linear / Int8Embedding's codes (and int4 scales and offsets) into tiles, or back into
    rows. Tiled int4 scales and offsets are kept in float16 where that is exact (quantize_int4 makes them so;
    older checkpoints keep fp32): 66 instead of 80 MB a step for SmolLM2's projections."""
    if layer.tiled == tiled:
        return
    if not tiled:
        for name, t in layer.rows().items():
            setattr(layer, name, t)
    elif layer.weight.dtype == torch.uint8:
        layer.weight = tile_int4(layer.weight)
        scales, offsets = tile_groups(layer.scales), tile_groups(layer.offsets)
        if all(torch.equal(t.half().float(), t) for t in (scales, offsets)):  # quantize_int4's: float16 is exact
            scales, offsets = scales.half(), offsets.half()
        layer.scales, layer.offsets = scales, offsets
    else:
        layer.weight = tile_int8(layer.weight)
    layer.tiled = tiled
