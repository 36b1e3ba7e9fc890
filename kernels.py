"""The kernels of a forward pass on CPU or CUDA, and the one place that chooses them for this CPU.

Linear layers: `linear` (fp32 / bfloat16 / int8 weights) and `int4_linear` take, inside a compiled CPU step,
per-row multiply-and-sum reductions, integer dot products (int8 / int4 codes times Q8_0 activations,
kernels_cpu.cpp, where the CPU has AVX2 or AVX-512 VNNI), a blocked GEMM or F.linear; `linear_path` names the
choice for a weight dtype and a number of rows. attention.py chooses its attention kernels from the same probe.

`cpu()` probes the CPU once; every CPU-dependent choice (the GEMM thresholds here, kv.quant's --kv-float auto)
reads it. KVFAST_CPU=avx2 | avx512-bf16 | amx (or `force_cpu` in tests) makes those choices as on that kind of
CPU, to run or measure another CPU's paths on this one; native (the default) follows this CPU.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

import kernels_cpu


class KVFastError(Exception):
    """A user-facing error: bad checkpoint, bad flag, bad config. Printed as one line by the CLIs. Defined in
    the lowest module that raises one (model imports this one), known to the rest as model.KVFastError."""


# ---- the CPU --------------------------------------------------------------------------------------------------
CPU_KINDS = ("native", "avx2", "avx512-bf16", "amx")
FLAGS = ("avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class CPU:
    """What the kernels may assume of the CPU: what it has, or under a forced kind what that kind has."""

    model: str
    aten: str  # the vector ISA of ATen's own kernels (fixed at startup; a forced kind leaves it)
    onednn: bool
    avx2: bool
    avx512: bool
    avx512_vnni: bool
    avx512_bf16: bool
    amx_bf16: bool
    amx_int8: bool
    forced: str | None = None

    @property
    def bf16_dot(self) -> bool:
        """bfloat16 dot products in hardware (AVX512-BF16 or AMX tiles): bfloat16 products run ~2.5x fp32's
        speed there (docs/speed.md); elsewhere they are emulated, slower than fp32."""
        return self.avx512_bf16 or self.amx_bf16

    def flags(self) -> list[str]:
        return [f for f in FLAGS if getattr(self, f)]


def probe() -> CPU:
    """This CPU, from torch's cpuinfo queries."""
    caps = torch.cpu.get_capabilities()
    return CPU(model=caps.get("cpu_name") or caps.get("architecture", "unknown"),
               aten=torch.backends.cpu.get_cpu_capability(), onednn=torch.backends.mkldnn.is_available(),
               avx2=caps.get("avx2", False), avx512=caps.get("avx512_f", False),
               avx512_vnni=caps.get("avx512_vnni", False), avx512_bf16=caps.get("avx512_bf16", False),
               amx_bf16=caps.get("amx_bf16", False), amx_int8=caps.get("amx_int8", False))


def as_kind(native: CPU, kind: str) -> CPU:
    """`native` as the kernels see it under KVFAST_CPU=kind: native itself, or with kind's vector features in
    place of its own (avx2: no bfloat16 dot products; avx512-bf16: AVX-512 with them, no AMX; amx: both)."""
    if kind not in CPU_KINDS:
        raise KVFastError(f"unknown CPU kind {kind!r} (KVFAST_CPU): choose one of {', '.join(CPU_KINDS)}")
    if kind == "native":
        return native
    avx512, amx = kind != "avx2", kind == "amx"
    return replace(native, avx2=True, avx512=avx512, avx512_vnni=avx512, avx512_bf16=avx512, amx_bf16=amx,
                   amx_int8=amx, forced=kind)


_native: CPU | None = None
_cpu: CPU | None = None
_forced: str | None = None  # force_cpu's kind; None: KVFAST_CPU's


def native_cpu() -> CPU:
    global _native
    if _native is None:
        _native = probe()
    return _native


def cpu() -> CPU:
    """The CPU every kernel choice reads: this one, or the kind KVFAST_CPU / force_cpu names (KVFastError for an
    unknown kind). Probed once; Transformer.from_checkpoint reads it first, so a bad KVFAST_CPU fails there in
    one line and not inside a compile."""
    global _cpu
    if _cpu is None:
        _cpu = as_kind(native_cpu(), _forced or os.environ.get("KVFAST_CPU") or "native")
    return _cpu


def native_runs(kind: str) -> bool:
    """Does this CPU have every feature of `kind`, so that kind's fast paths run here natively?"""
    native = native_cpu()
    return all(getattr(native, f) for f in as_kind(native, kind).flags())


class _Restore:
    def __init__(self, previous: str | None):
        self.previous = previous

    def __enter__(self) -> CPU:
        return cpu()

    def __exit__(self, *exc: object) -> None:
        _choose(self.previous)


def force_cpu(kind: str | None) -> _Restore:
    """Choose kernels as on a CPU of `kind` from now on (None: as KVFAST_CPU says); as a context manager, until
    its end. What was chosen before is dropped: the GEMM table and dynamo's graphs, which hold it as a constant."""
    if kind is not None:
        as_kind(native_cpu(), kind)  # an unknown kind changes nothing
    previous = _forced
    _choose(kind)
    return _Restore(previous)


def _choose(kind: str | None) -> None:
    global _cpu, _forced, GEMM_MIN_ROWS, _INT_PATHS
    _cpu, _forced, GEMM_MIN_ROWS, _INT_PATHS = None, kind, None, None
    torch._dynamo.reset()


def cpu_report() -> str:
    """One line for bench and log headers: the CPU, the features that choose kernels, the forced kind if any."""
    native, chosen = native_cpu(), cpu()
    line = (f"{native.model}: {' '.join(native.flags()) or 'no AVX2'}, ATen {native.aten}, "
            f"{'oneDNN' if native.onednn else 'no oneDNN'}")
    if chosen.forced:
        line += f"; kernels chosen as for {chosen.forced} ({' '.join(chosen.flags())})"
    return line


# ---- linear layers --------------------------------------------------------------------------------------------
# Rows up to which a compiled CPU matmul is written as multiply-and-sum reductions (a batch of one-token rows,
# speculate.py's verification). Measured on an AVX-512 CPU (docs/scaling.md, "Batched decode"): with int8 / bfloat16
# weights the fused reductions beat F.linear (which converts the whole weight per call) 3-8x at 1-16 rows; with
# fp32 weights they win up to ~8 rows and break even at 16. A batch of one-token rows takes batched_linear's
# blocked GEMM before that where this CPU has one (gemm_min_rows).
MAX_REDUCTION_ROWS = 16


def gemm_min_rows(chip: CPU | None = None) -> dict[torch.dtype, int]:
    """Per weight dtype, the sequences from which a compiled CPU decode step (one token per row) leaves the per-row
    reductions for a blocked GEMM (batched_linear), where `chip` (default: cpu()) has a fast one: oneDNN's packed
    fp32 GEMM wherever oneDNN is built in; the bfloat16 and int8 ones multiply bfloat16 activations, which only
    CPUs with bfloat16 dot products run natively. The rows: crossovers measured on an AVX-512 CPU with
    SmolLM2-135M (docs/scaling.md, "Batched decode"): the reductions are bound by their fp32 multiply-adds from ~4 rows,
    the GEMM costs about the same at 5 to 8 rows. A verification's tokens of one sequence keep the reductions:
    each must equal its one-token step bit for bit."""
    chip = chip or cpu()
    if not chip.onednn:
        return {}
    if chip.bf16_dot:
        return {torch.float32: 5, torch.bfloat16: 8, torch.int8: 8}
    return {torch.float32: 5}


GEMM_MIN_ROWS: dict[torch.dtype, int] | None = None  # gemm_min_rows(), filled at first use; {}: reductions only


@torch._dynamo.assume_constant_result  # run, not traced, at compile time: a constant of the graph
def gemm_rows(dtype: torch.dtype) -> int:
    global GEMM_MIN_ROWS
    if GEMM_MIN_ROWS is None:
        GEMM_MIN_ROWS = gemm_min_rows()
    return GEMM_MIN_ROWS.get(dtype, 1 << 30)


# ---- integer dot products (kernels_cpu.cpp) ---------------------------------------------------------------------
INT_DTYPES = (torch.int8, torch.uint8)  # int8 weights; uint8: int4 codes


def int_paths(chip: CPU | None = None, timed: bool = True) -> dict[torch.dtype, str]:
    """Per quantized weight dtype, the kernel of its one-token products on `chip` (default: cpu()) where the
    integer dot products win: "int-dot-<isa>" (kernels_cpu.cpp: Q8_0 activations times the codes in int32), else
    absent (Inductor's fused reductions). First by what the CPU has: with AVX-512 VNNI or AVX2 (docs/speed.md,
    "Integer dot products"); without AVX2 the plain C++ loops lose. Then, on the native CPU kind, by what
    time_int_paths measured on this machine (int8 codes multiply faster as integers on an Intel Xeon, slower on
    an AMD EPYC); timed=False: by the instruction set alone."""
    chip = chip or cpu()
    isa = kernels_cpu.isa_of(chip, native_cpu())
    if isa == "scalar" or kernels_cpu.ops(isa) is None:
        return {}
    measured = _TIMED if timed and chip.forced is None else {}
    return {dtype: f"int-dot-{isa}" for dtype in INT_DTYPES if measured.get(dtype, True)}


_TIMED: dict[torch.dtype, bool] = {}  # time_int_paths(): per dtype, do the integer products win on this machine
WEIGHT_NAMES = {torch.int8: "int8", torch.uint8: "int4"}  # the weight formats of the codes' dtypes
MIN_TIMED_COLUMNS = 256  # narrower products (the tests' tiny models) say nothing of a real model's: not timed


def time_int_paths(layers: list[torch.nn.Module]) -> dict[torch.dtype, bool]:
    """Time one token through `layers` (every int8 / int4 projection of a model and its int8 head, which weighs a
    fifth of SmolLM2's int8 projections and alone decides int8 for an int4 model; so that the weights stream from
    memory as in a step: one block's stay in the cache, where on an AMD EPYC the int8 integer products won 85 to
    150 us and lost 6.3 to 4.3 ms over the whole model) both ways, compiled: the integer kernels (over tiles where
    they read tiles) and Inductor's reductions. Once per machine and model: the result is remembered in
    ~/.cache/kvfast/choices.json under this CPU's name and flags, the thread count, torch's version, the kernels'
    source and the shapes, and int_paths() follows it. Not under a forced CPU kind (KVFAST_CPU), and not for
    products narrower than MIN_TIMED_COLUMNS. Call it before compiling a step (decode.Decoder does): a compiled
    graph keeps the kernels it was traced with. The dtypes of layers an earlier Decoder tiled keep the integer
    kernels without timing: a new timing that flipped to the reductions would leave their tiles to be untiled
    inside every step (13 instead of 98 tok/s)."""
    global _INT_PATHS
    chip, base = cpu(), int_paths(timed=False)
    kept = {m.weight.dtype for m in layers if m.tiled}
    if any(not _TIMED.get(d, False) for d in kept):
        _TIMED.update({d: True for d in kept})
        _INT_PATHS = None
    layers = [m for m in layers if m.weight.dtype in base and m.weight.dtype not in kept
              and columns(m) >= MIN_TIMED_COLUMNS]
    if chip.forced is not None:
        return {}
    if not layers:
        return dict(_TIMED)
    by_dtype = {WEIGHT_NAMES[d]: [m for m in layers if m.weight.dtype == d]
                for d in INT_DTYPES if any(m.weight.dtype == d for m in layers)}
    shapes = Counter(f"{n}{tuple(m.weight.shape)}" for n, ms in by_dtype.items() for m in ms)
    key = "|".join([chip.model, ",".join(chip.flags()), f"{torch.get_num_threads()} threads", torch.__version__,
                    kernels_cpu.build_name(kernels_cpu.isa_of(chip, native_cpu()))[0],
                    ";".join(f"{shape} x{n}" for shape, n in sorted(shapes.items()))])

    def faster(name: str) -> tuple[bool, float, float]:
        mods = by_dtype[name]
        xs = [torch.randn(1, 1, columns(m)) for m in mods]

        def products(*xs: Tensor) -> list[Tensor]:  # the head's too (an Int8Embedding's forward is its lookup)
            return [int4_linear(x, m.weight, m.scales, m.offsets, m.tiled) if m.weight.dtype == torch.uint8
                    else linear(x, m.weight, m.scales, m.tiled) for m, x in zip(mods, xs)]

        def compiled_seconds(paths: dict[torch.dtype, str]) -> float:
            """Both sides compiled, as a step calls them (timed eagerly, the integer kernels paid ~10 us of Python
            per call), each over the layout it reads. The graph is dropped after: the next trace must not find it,
            nor count as a recompile."""
            global _INT_PATHS
            _INT_PATHS = paths
            try:
                for m in mods:
                    kernels_cpu.retile(m, False)
                tile_weights(mods)  # where `paths` reads tiles
                step = torch.compile(products, fullgraph=True, dynamic=False)
                step(*xs)
                return kernels_cpu.time_calls(lambda: step(*xs))
            finally:
                _INT_PATHS = None
                torch._dynamo.eval_frame.remove_from_cache(products)

        with torch.no_grad():
            try:
                t_int, t_red = compiled_seconds(base), compiled_seconds({})
            finally:
                for m in mods:  # handed back in rows: the Decoder tiles after choosing
                    kernels_cpu.retile(m, False)
        return t_int <= t_red, t_int, t_red

    wins = kernels_cpu.remembered_choice(key, list(by_dtype), faster)
    _TIMED.update({d: wins[name] for d, name in WEIGHT_NAMES.items() if name in wins})
    _INT_PATHS = None
    return dict(_TIMED)


def columns(layer: torch.nn.Module) -> int:
    """The input width of an int8 / int4 projection (int4 codes hold two columns a byte)."""
    return layer.weight.shape[1] * (2 if layer.weight.dtype == torch.uint8 else 1)


_INT_PATHS: dict[torch.dtype, str] | None = None  # int_paths(), filled at first use


@torch._dynamo.assume_constant_result  # run, not traced (it may build the kernels): a constant of the graph
def int_path(dtype: torch.dtype) -> str:
    """int_paths()'s kernel for `dtype` weights, "reductions" where it has none."""
    global _INT_PATHS
    if _INT_PATHS is None:
        _INT_PATHS = int_paths()
    return _INT_PATHS.get(dtype, "reductions")


def int_ops() -> object:
    """The op namespace of the chosen integer kernels (torch.ops.kvfast_<isa>)."""
    return kernels_cpu.ops(kernels_cpu.isa_of(cpu(), native_cpu()))


def gemm_path(dtype: torch.dtype) -> str:
    """The GEMM of `dtype` weights (fp32, bfloat16, int8), as linear_path names it. No table: a compiled graph
    under block scope can't guard a read of a module's dict."""
    if dtype == torch.int8:
        return "int8pack-mm"
    return "gemm-onednn-bf16" if dtype == torch.bfloat16 else "gemm-onednn-fp32"


def linear_path(dtype: torch.dtype, rows: int, one_token: bool = True, compiled: bool = True) -> str:
    """The kernel of a linear layer with `dtype` weights (uint8: int4) over `rows` rows on this CPU, one token
    per row (a batched decode step) or not (a verification's tokens): "f-linear" (eager: ATen's GEMM;
    "int8-gemv" for up to two eager rows of int8 weights), up to MAX_REDUCTION_ROWS rows "reductions"
    (per_row) or for int8 / int4 weights int_path(dtype) (integer dot products, each row on its own), or from
    gemm_rows(dtype) one-token rows gemm_path(dtype). Reductions: torch's fp32 GEMV streams weights at a fraction of the memory
    bandwidth, while Inductor turns a multiply-and-sum into one vectorized, parallel reduction that reads each
    weight once (decode is bandwidth-bound) and fuses any dequantization of int8 / int4 weights into it."""
    if not compiled:
        # eager: a prompt's last rows through an int8 head read its codes in ATen's int8 GEMV, where F.linear
        # would first write the whole weight in fp32 (Qwen2.5's 151,936-row head: 0.3 s per prompt)
        return "int8-gemv" if dtype == torch.int8 and rows <= 2 else "f-linear"
    if one_token and rows >= gemm_rows(dtype):
        return gemm_path(dtype)
    if rows > MAX_REDUCTION_ROWS:
        return "f-linear"
    return int_path(dtype) if dtype in INT_DTYPES else "reductions"


_integer_everywhere = False  # integer_products("everywhere")
_dynamic_rows = False  # dynamic_rows()


@contextmanager
def dynamic_rows() -> Iterator[None]:
    """Around a call of a dynamic-shape compiled prompt (--compile-prefill): every product over the prompt's rows
    takes "f-linear". Their count is symbolic, and dynamo answers isinstance(rows, int) for it, so linear_path
    would compare it with its thresholds and guard the graph to one side of each (a 300-token prompt compiled to
    per-row reductions and recompiled for a longer one). Compiled graphs guard on this flag's value."""
    global _dynamic_rows
    _dynamic_rows = True
    try:
        yield
    finally:
        _dynamic_rows = False


_integer_prompt = False  # integer_products("prompt")
_integer_nowhere = False  # integer_products("nowhere")


class integer_products:
    """Where the integer dot products run. "prompt" (--prefill-dtype int8): eager CPU products of int8 / int4
    weights over several rows take the integer GEMM (int_gemm_ops). "everywhere" (bench.py quantize): every eager
    CPU product of int8 / int4 weights takes int_path(dtype), so a teacher-forced forward measures a decode step's
    products (each row quantized and multiplied on its own). "nowhere": none (Inductor's fp32 reductions, their
    baseline); compiled graphs are dropped on entry and exit."""

    def __init__(self, where: str) -> None:
        if where not in ("prompt", "everywhere", "nowhere"):
            raise KVFastError(f"integer_products: 'prompt', 'everywhere' or 'nowhere', not {where!r}")
        self.where = where

    def __enter__(self) -> None:
        self._set(True)

    def __exit__(self, *exc: object) -> None:
        self._set(False)

    def _set(self, on: bool) -> None:
        global _integer_everywhere, _integer_prompt, _integer_nowhere, _INT_PATHS
        if self.where == "everywhere":
            _integer_everywhere = on
        elif self.where == "prompt":
            _integer_prompt = on
        else:
            _INT_PATHS, _integer_nowhere = {} if on else None, on
            torch._dynamo.reset()


def int_gemm_ops(x: Tensor, tiled: bool) -> object | None:
    """The build with the integer GEMM (int8_gemm / int4_gemm) for an eager CPU product of x [..., in] of tileable
    codes, where its rows take it: under integer_products("prompt") or "everywhere" (each row is then the tiled
    decode kernel's product, bit for bit), or up to MAX_REDUCTION_ROWS rows through tiles (a short prompt: the
    codes read once for all rows, not a dense copy of the weight). None: another kernel."""
    ops = None if x.device.type != "cpu" or torch.compiler.is_compiling() else gemm_ops()
    if ops is None:
        return None
    rows = x.shape[:-1].numel()
    if (_integer_prompt and rows > 1) or _integer_everywhere:
        return ops
    return ops if tiled and rows <= MAX_REDUCTION_ROWS else None


def int_gemm_runs() -> bool:
    """Does the chosen CPU kind run the integer GEMM (the AVX-512 VNNI or AVX2 build of the kernels)?"""
    return gemm_ops() is not None


def _path(x: Tensor, dtype: torch.dtype, tiled: bool = False, tileable: bool = False) -> str:
    """linear_path for x [..., in] where it runs: compiled on CPU, one token per row if [B, 1, in]. A compiled
    product of tileable int8 / int4 codes follows the layout its Decoder gave them (tile_weights, after
    time_int_paths): tiles take the tiled kernel, rows the reductions, whatever a later timing of another model's
    weights of that dtype chose (a benched int8 model left in rows once took the row-major kernel: 81 tok/s)."""
    if _integer_everywhere and dtype in INT_DTYPES and x.device.type == "cpu":
        return int_path(dtype)
    if x.device.type != "cpu":
        return "f-linear"
    compiled = torch.compiler.is_compiling()
    one_token = compiled and x.dim() == 3 and x.shape[1] == 1
    if _dynamic_rows and not one_token:  # a prompt's rows; its last row's logits keep the one-token kernels
        return "f-linear"
    path = linear_path(dtype, x.shape[:-1].numel(), one_token, compiled)
    if compiled and tileable and path in TILED_PATHS and not tiled:
        return "reductions"
    if compiled and tiled and path == "reductions" and not _integer_nowhere:
        return tiled_path() or path
    return path


@torch._dynamo.assume_constant_result
def tiled_path() -> str:
    """The chosen CPU kind's path that multiplies tiles (one of TILED_PATHS), "" where it has none."""
    path = int_paths(timed=False).get(torch.int8, "")
    return path if path in TILED_PATHS else ""


def realized(x: Tensor) -> Tensor:
    """x written to memory once in a compiled graph. Inductor otherwise inlines x's cheap producers (the
    residual add and RMSNorm before a projection) into each reduction that reads it, recomputing them for every
    output row: 8 % of an int8 decode step at one token, half of the step at eight."""
    from torch._inductor import inductor_prims  # noqa: F401  (registers the op; imported when compiling only)

    return torch.ops.prims.inductor_force_stride_order(x, x.stride())


def per_row(x: Tensor, row_product: Callable[[Tensor], Tensor]) -> Tensor:
    """row_product(one row [in]) -> [out], applied to each row of x [..., in]. The rows are unrolled into
    separate reductions over the same weight: Inductor fuses them into one loop that loads (and dequantizes)
    each weight once for all rows, where one broadcast [rows, out, in] reduction redoes that per row."""
    rows = realized(x).reshape(-1, x.shape[-1]).unbind(0)
    y = row_product(rows[0]).unsqueeze(0) if len(rows) == 1 else torch.stack([row_product(r) for r in rows])
    return y.view(*x.shape[:-1], -1)


_packed = WeakTensorKeyDictionary()  # weight -> (its version, its oneDNN-packed copy)


def _batched_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x [..., in] @ weight.T as one blocked GEMM (fp32 / bfloat16 weights): oneDNN on a copy of the weight packed
    into its blocked layout at first use and kept while the weight lives (a second copy of the weights; packed
    again after an in-place change, e.g. load_state_dict). With bfloat16 weights the activations and the output
    are rounded to bfloat16, as in a bfloat16 model."""
    version = None if weight.is_inference() else weight._version  # inference tensors keep no version counter
    entry = _packed.get(weight)
    if entry is None or entry[0] != version:
        entry = _packed[weight] = (version, torch.ops.mkldnn._reorder_linear_weight(weight, x.shape[:-1].numel()))
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]).to(weight.dtype), entry[1], None, "none", [], "")
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


# A plain library registration: torch.library.custom_op's wrapper costs ~20 us more per call inside a compiled
# graph, 2.5 ms of an 8-row step's 121 calls. Meta gives compiling its shapes.
_ops = torch.library.Library("kvfast", "DEF")
_ops.define("batched_linear(Tensor x, Tensor weight) -> Tensor")
_ops.impl("batched_linear", _batched_linear, "CPU")
_ops.impl("batched_linear", lambda x, weight: x.new_empty(*x.shape[:-1], weight.shape[0]), "Meta")


def int8_gemm(x: Tensor, codes: Tensor) -> Tensor:
    """x [..., in] @ codes.T for int8 codes in ATen's int8 x bfloat16 kernel inside a compiled graph (unit scales:
    linear applies the per-row ones in fp32); activations and output rounded to bfloat16."""
    rows = realized(x.reshape(-1, x.shape[-1]).bfloat16())  # its lowering wants stored inputs
    y = torch._weight_int8pack_mm(rows, codes, realized(torch.ones(codes.shape[0], dtype=torch.bfloat16)))
    return y.to(x.dtype).view(*x.shape[:-1], -1)


def linear(x: Tensor, weight: Tensor, scales: Tensor | None = None, tiled: bool = False) -> Tensor:
    """x @ weight.T; for int8 weights (quantize.py) times the per-row `scales`, the codes in rows or, where
    `tiled`, in kernels_cpu.tile_int8's tiles."""
    tileable = weight.dtype == torch.int8 and kernels_cpu.tileable(*weight.shape)
    path = _path(x, weight.dtype, tiled, tileable)
    gemm = int_gemm_ops(x, tiled) if scales is not None and tileable else None
    if gemm is not None:
        return gemm.int8_gemm(x if x.dtype == torch.bfloat16 else x.float(), weight, scales, tiled).to(x.dtype)
    if tiled:
        if path in TILED_PATHS:
            return int_ops().int8_linear_tiled(x.float(), weight, scales).to(x.dtype)
        eager = None if torch.compiler.is_compiling() or x.device.type != "cpu" else int_ops()
        if path == "f-linear" and eager is not None and x.dtype in (torch.float32, torch.bfloat16):
            y = F.linear(x, eager.int8_dequantize(weight, x.dtype, True))  # one pass: the codes, exact
            return y if scales is None else (y * scales).to(x.dtype)
        weight = kernels_cpu.untile_int8(weight)
    if path.startswith("int-dot") and scales is not None:
        return int_ops().int8_linear(x.float(), weight, scales).to(x.dtype)
    if path == "int8-gemv" and scales is not None:
        y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), weight, scales.to(x.dtype))
        return y.view(*x.shape[:-1], -1)
    if path == "int8pack-mm":
        y = int8_gemm(x, weight)
    elif path.startswith("gemm-onednn"):
        y = torch.ops.kvfast.batched_linear(x, weight)
    else:
        weight = weight.to(x.dtype)  # no-op for weights in the compute dtype
        y = per_row(x, lambda row: (row * weight).sum(-1)) if path == "reductions" else F.linear(x, weight)
    return y if scales is None else (y * scales).to(x.dtype)  # fp32 scales: bfloat16 rows stay bfloat16


def gemm_ops() -> object | None:
    """The chosen CPU kind's build of the kernels if it has the integer GEMM (AVX-512 VNNI and AVX2 builds)."""
    ops = int_ops()
    return ops if hasattr(ops, "int8_gemm") else None


def dequantize_int4(packed: Tensor, scales: Tensor, offsets: Tensor, dtype: torch.dtype | None = None,
                    tiled: bool = False) -> Tensor:
    """quantize.py's int4 weights -> [out, in] in dtype (default: the scales'): codes uint8 [out, in / 2]
    (column j in the low nibble, j + in / 2 in the high one), scales and offsets [out, in / group_size], or all
    three in kernels_cpu's tiles where `tiled`; eager on CPU by kernels_cpu's one-pass kernel where it is built
    and the groups tile each half of a row."""
    dtype = dtype or scales.dtype
    out, n_groups = scales.shape
    half_row, group = packed.shape[1], 2 * packed.shape[1] // n_groups
    ops = None if torch.compiler.is_compiling() or packed.device.type != "cpu" else int_ops()
    if ops is not None and dtype in (torch.float32, torch.bfloat16) and (tiled or half_row % group == 0):
        return ops.int4_dequantize(packed, scales, offsets, dtype, tiled)
    if tiled:
        packed, scales, offsets = kernels_cpu.int4_rows(packed, scales, offsets)
    codes = torch.cat([packed & 15, packed >> 4], 1).view(out, n_groups, -1)
    return torch.addcmul(offsets[..., None], codes.to(scales.dtype), scales[..., None]).view(out, -1).to(dtype)


def int4_dot_fits(in_features: int, n_groups: int) -> bool:
    """Can kernels_cpu's int4 product read this layout: half a row in blocks of 32, groups of 2^k >= 32 columns."""
    group = in_features // n_groups
    return in_features % 64 == 0 and group * n_groups == in_features and group >= 32 and not group & (group - 1)


def int4_linear(x: Tensor, packed: Tensor, scales: Tensor, offsets: Tensor, tiled: bool = False) -> Tensor:
    """x @ W.T for int4 weights (dequantize_int4's layouts): integer dot products, reductions or F.linear on the
    dequantized weight."""
    tileable = kernels_cpu.tileable(packed.shape[0], x.shape[-1], scales.shape[1])
    path = _path(x, packed.dtype, tiled, tileable)
    gemm = int_gemm_ops(x, tiled) if tileable else None
    if gemm is not None:  # a short prompt through tiles: 5 tokens of SmolLM2 took 66 ms on a dense copy, now 20
        rows = x if x.dtype == torch.bfloat16 else x.float()
        return gemm.int4_gemm(rows, packed, scales, offsets, tiled).to(x.dtype)
    if tiled and path in TILED_PATHS:
        return int_ops().int4_linear_tiled(x.float(), packed, scales, offsets).to(x.dtype)
    if path == "f-linear":
        return F.linear(x, dequantize_int4(packed, scales, offsets, x.dtype, tiled))
    if tiled:
        packed, scales, offsets = kernels_cpu.int4_rows(packed, scales, offsets)
    if path.startswith("int-dot") and int4_dot_fits(x.shape[-1], scales.shape[1]):
        return int_ops().int4_linear(x.float(), packed, scales, offsets).to(x.dtype)
    # sum_j x_j (q_j s + o) = sum_j x_j q_j s + o * (x's group sum). The nibbles are split with float
    # arithmetic and each half of the row meets a contiguous half of x: both keep Inductor's reduction
    # vectorized (uint8 bit operations and interleaved columns did not: 3-20x slower here). It is fastest
    # when a group never straddles the two halves (in / 2 a multiple of the group size).
    out, n_groups = scales.shape
    half = packed.shape[1]
    codes = packed.to(x.dtype)
    high = torch.floor(codes * (1 / 16))
    low = codes - 16 * high
    wide = scales.view(out, n_groups, 1).expand(out, n_groups, 2 * half // n_groups).reshape(out, -1)

    def row_product(row: Tensor) -> Tensor:
        y = (row[:half] * low * wide[:, :half] + row[half:] * high * wide[:, half:]).sum(-1)
        return y + (offsets * row.view(n_groups, -1).sum(-1)).sum(-1)

    return per_row(x, row_product)


# ---- tiled weights: the integer products' layout (kernels_cpu.tile_int8 / tile_int4) -----------------------------
TILED_PATHS = ("int-dot-avx512-vnni", "int-dot-avx2")  # the paths whose builds read tiles (int8_linear_tiled, ...)


def tile_weights(layers: list[torch.nn.Module], rows: int = 1) -> int:
    """Rearrange in place, into kernels_cpu's tiles of 16 output rows, the int8 / int4 weights of `layers`
    (model.Int8Linear / Int4Linear / Int8Embedding) whose products over a step's `rows` (its batch) take one of
    TILED_PATHS on this machine (linear_path, after time_int_paths): the row-major kernel reduces each row across
    its vector lanes, and for a 135M model's rows that costs more than the loads (its int8 projections: 5.8 ms a
    token in rows, 3.7-4.0 ms in tiles, an AMD EPYC). Same bytes and shapes; the layers read their weight through
    their `tiled` flag (another kernel untiles them on the fly: a batch that reaches a GEMM later pays for it).
    Returns how many."""
    n = 0
    for layer in layers:
        groups = layer.offsets.shape[1] if layer.weight.dtype == torch.uint8 else 1
        if (layer.tiled or linear_path(layer.weight.dtype, rows) not in TILED_PATHS or layer.weight.device.type != "cpu"
                or not kernels_cpu.tileable(layer.weight.shape[0], columns(layer), groups)):
            continue
        kernels_cpu.retile(layer, True)
        n += 1
    return n
