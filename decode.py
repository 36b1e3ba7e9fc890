"""The Decoder: prefill, the (optionally compiled) decode step, the policy work between steps (refresh, the
tiers' flush and recall), guard-free stepping and stopping. Its loop is the one decode schedule: generate.py,
speculation (speculate.py: rounds instead of single steps), ragged batches, the warm-up, eval and every
benchmark run it.

The process-wide torch settings that compiled decoding needs are set by configure_torch, which each entry
point calls once; building a Decoder changes nothing outside it (its model's weights may move to huge pages:
memory.weights_on_huge_pages, same values).
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import torch
from torch import Tensor, nn
from torch._inductor import config as inductor_config

from compilecache import guard_free, trust_cpu_vector_flags
from kernels import cpu, dynamic_rows, int_gemm_runs, tile_weights, time_int_paths
from kv import kvzip
from kv.budgets import DYNAMIC_CAPACITY_CONFIG, mark_capacity_dynamic
from kv.tiers import TierSpec
from memory import release_free_memory, reuse_large_allocations, weights_on_huge_pages
from model import Int4Linear, Int8Embedding, Int8Linear, KVFastError, Transformer


def configure_torch(compile: bool, dynamic_capacity: bool = False) -> None:
    """The process-wide settings compiled decoding relies on, and glibc's reuse of large blocks (long prompts);
    call once per process before building a compiled Decoder (the CLI entries do, and tests/conftest.py for the
    tests). Eager decoding needs none."""
    reuse_large_allocations()
    if compile:
        trust_cpu_vector_flags()
        # Inductor otherwise keeps a value cast down and back up in fp32 inside a fused kernel, and bfloat16 K/V's
        # one-query attention (attention.attend_one_query) would skip the roundings that make it agree with the
        # bfloat16 matmuls of eager steps and of a speculative verification
        inductor_config.emulate_precision_casts = True
        # a float a module attribute held with another value in an earlier compile (an eps, a policy's parameter)
        # would otherwise turn symbolic, and a nested region (block scope) takes no float inputs
        torch._dynamo.config.specialize_float = True
    if dynamic_capacity:  # dynamo reads these while tracing: the slot count may be a symbolic size
        for key, value in DYNAMIC_CAPACITY_CONFIG.items():
            setattr(torch._dynamo.config, key, value)


def require_configured(block_scope: bool, dynamic_capacity: bool) -> None:
    """A one-line error where configure_torch has not set what this compiled Decoder needs."""
    ready = inductor_config.emulate_precision_casts and (torch._dynamo.config.specialize_float or not block_scope)
    dynamic = all(getattr(torch._dynamo.config, k) == v for k, v in DYNAMIC_CAPACITY_CONFIG.items())
    if not ready or (dynamic_capacity and not dynamic):
        flags = "compile=True" + (", dynamic_capacity=True" if dynamic_capacity else "")
        raise KVFastError(f"compiled decoding needs torch's process-wide settings: call "
                          f"decode.configure_torch({flags}) once before building the Decoder")


# ---- sampling: no host sync (gpt-fast's exponential trick instead of torch.multinomial) ------------------
def logits_to_probs(logits: Tensor, temperature: float, top_k: int | None) -> Tensor:
    logits = logits / max(temperature, 1e-5)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[..., -1:]
        logits = torch.where(logits < kth, float("-inf"), logits)
    return torch.softmax(logits, dim=-1)


def sample(logits: Tensor, temperature: float = 0.0, top_k: int | None = None) -> Tensor:
    """logits: [B, 1, V] -> next token ids [B, 1]. Greedy when temperature is 0."""
    logits = logits[:, -1]
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    probs = logits_to_probs(logits, temperature, top_k)
    noise = torch.empty_like(probs).exponential_(1)
    return (probs / noise).argmax(dim=-1, keepdim=True)


# Prompt rows per query block of a prefill (model.TransformerBlock.prefill): a prompt up to this length runs as
# one block; a longer one keeps its activations and attention to blocks of this many rows. An FFN block of 8192
# rows holds ~0.3 GB of bfloat16 activations on Qwen2.5-0.5B; smaller blocks repeat oneDNN's per-call weight
# packing: a 16k-token prefill's GEMMs took 7.0 s in blocks of 2048 and 5.2 s in blocks of 8192.
DEFAULT_PREFILL_CHUNK = 8192


PREFILL_DTYPES = ("auto", "float32", "bfloat16", "int8")  # --prefill-dtype


def prefill_dtype(name: str | None, model: Transformer, compiled: bool = False) -> torch.dtype | None:
    """--prefill-dtype's precision of `model`'s prompt products (None: the compute dtype's); compiled: the prefill
    is (--compile-prefill). "int8": the projections' int8 / int4 codes times Q8_0 activations, as in a decode step,
    in the integer GEMM (gemm_cpu.cpp, kernels.integer_products("prompt")), and the rest of the prompt in bfloat16
    where the CPU multiplies it in hardware; eager, on a CPU with AVX-512 VNNI or AVX2. "auto": int8 for int8 / int4
    weights on such a CPU without AMX (whose bfloat16 tiles oneDNN's GEMMs use): 512 tokens of SmolLM2 int4 took 0.36
    instead of 0.48 s in bfloat16 with AVX-512, 0.60 instead of 0.92 s in float32 with AVX2, for the decode step's
    +1.4 % perplexity (docs/speed.md, "Integer prompts"). Else
    bfloat16 where the projections are stored in 16 bits or fewer (bf16, int8, int4 weights) and the CPU multiplies
    bfloat16 in hardware (AVX512-BF16 or AMX: kernels.CPU.bf16_dot): 0.48 instead of 0.93 s, +0.2 % perplexity
    ("Prefill in bfloat16"); else the compute dtype. fp32 weights keep fp32 products."""
    weight = model.layers[0].feed_forward.w13.weight
    codes, on_cpu = weight.dtype in (torch.int8, torch.uint8), weight.device.type == "cpu"
    if name in (None, "auto"):
        chip = cpu()
        if codes and on_cpu and not compiled and not chip.amx_int8 and int_gemm_runs():
            return torch.int8
        stored = codes or weight.dtype == torch.bfloat16
        return torch.bfloat16 if stored and on_cpu and chip.bf16_dot else None
    if name not in PREFILL_DTYPES:
        raise KVFastError(f"unknown prefill dtype {name!r} (choose from {', '.join(PREFILL_DTYPES)})")
    if name == "int8":
        if not codes:
            raise KVFastError(f"--prefill-dtype int8 multiplies int8 / int4 weights; this model's are {weight.dtype}")
        if compiled:
            raise KVFastError("--prefill-dtype int8 runs eagerly: leave out --compile-prefill")
        if not (on_cpu and int_gemm_runs()):
            raise KVFastError("--prefill-dtype int8 needs a CPU with AVX2 or AVX-512 VNNI and kvfast's C++ kernels "
                              "built")
    return getattr(torch, name)


def prompt_logits(model: Transformer, idx: Tensor, chunk: int | None, dtype: torch.dtype | None) -> Tensor:
    """The prompt idx [B, S] into the caches, layer by layer in query blocks of `chunk` rows (None: one block),
    the products in `dtype` (None: the model's); the logits after it. What --compile-prefill compiles."""
    if kvzip.needs_context_pass(model):  # KVzip scores need the whole model before any layer compresses
        return kvzip.prefill(model, idx, chunk, dtype)
    return model(idx, prefill_chunk=chunk, prefill_dtype=dtype)


def compiled_prompt_logits() -> Callable[..., Tensor]:
    """prompt_logits compiled once for every prompt length (dynamic shapes, one query block), its products
    ATen's GEMMs (kernels.dynamic_rows)."""
    compiled = torch.compile(prompt_logits, fullgraph=True, dynamic=True)

    def logits_of(*args: object) -> Tensor:
        with dynamic_rows():
            return compiled(*args)
    return logits_of


def prefill(model: Transformer, idx: Tensor, temperature: float, top_k: int | None,
            chunk: int | None = DEFAULT_PREFILL_CHUNK, dtype: torch.dtype | None = None,
            logits_of: Callable[..., Tensor] = prompt_logits) -> Tensor:
    """prompt_logits (or its compiled form, logits_of), the heap's freed pages returned, the token sampled after
    the prompt [B, 1]."""
    logits = logits_of(model, idx, chunk, dtype)
    release_free_memory()  # outside any graph: a foreign call dynamo cannot trace
    return sample(logits, temperature, top_k)


# ---- what gets compiled ----------------------------------------------------------------------------------
# Distinct layer shapes one compiled step may hold (a pyramid budget gives every layer its own capacity);
# dynamo raises past it: --capacity-buckets / --dynamic-capacity keep the count small.
MAX_BLOCK_SHAPES = 256


def run_layer(layer: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor, recall: bool) -> Tensor:
    return layer(x, cos, sin, input_pos, recall)


# --compile-scope block: one TransformerBlock with its cache as a nested compile region. Dynamo traces and Inductor
# compiles it once and calls it for every layer of the same shapes (the layer's parameters and buffers are its
# inputs), inside one graph per step; eager, a plain call.
run_block = torch.compiler.nested_compile_region(run_layer, max_reuse_entries=MAX_BLOCK_SHAPES)


def logits_and_sample(model: Transformer, h: Tensor, temperature: float, top_k: int | None) -> tuple[Tensor, Tensor]:
    logits = model.logits(h)
    return sample(logits, temperature, top_k), logits


def decode_step(model: Transformer, x: Tensor, input_pos: Tensor, temperature: float, top_k: int | None,
                recall: bool = False, run_block: Callable | None = None,
                head: Callable = logits_and_sample) -> tuple[Tensor, Tensor]:
    """One decode step: x [B, 1] at input_pos [1] -> (next token [B, 1], logits [B, 1, V]). recall: the layers
    first recall warm pages for their query (kv.tiers); run_block runs each layer (block scope); head makes the
    logits and samples (the layerwise step passes a separately compiled one)."""
    return head(model, model.hidden(x, input_pos, recall, run_block=run_block), temperature, top_k)


def cache_work(cache: nn.Module, work: str = "refresh") -> None:
    """One layer's cache between steps, outside the decode graph: refresh (periodic policy work, e.g.
    Scissorhands' eviction-queue refill) or flush (tiers: staged victims become warm pages)."""
    getattr(cache, work)()


def caches_work(model: Transformer, work: str = "refresh") -> None:
    """cache_work for every layer's cache in one call (one graph, step scope)."""
    for c in model.caches:
        cache_work(c, work)


def per_cache(fn: Callable[[nn.Module], None]) -> Callable[[Transformer], None]:
    """fn(cache) for every layer's cache: block scope compiles fn once for the layers of the same shapes."""
    def run(model: Transformer) -> None:
        for c in model.caches:
            fn(c)
    return run


def specialized(fn: Callable, **static) -> Callable:
    """fn with some of its defaulted parameters fixed, as a function with a code object of its own: dynamo keeps
    compiled code per code object, so each specialization compiles apart (no recompile counted when another one
    compiles, a recompile limit of its own, exactly one entry for compilecache.guard_free to find)."""
    code = fn.__code__
    names = code.co_varnames[code.co_argcount - len(fn.__defaults__) : code.co_argcount]
    if not set(static) <= set(names):
        raise TypeError(f"{fn.__name__} has no defaulted parameters {sorted(set(static) - set(names))}")
    defaults = tuple(static.get(name, default) for name, default in zip(names, fn.__defaults__))
    parts = [value if isinstance(value, str) else key for key, value in static.items()
             if value is not None and value is not False]
    name = "_".join([fn.__name__, *parts])
    function = types.FunctionType(code.replace(co_name=name, co_qualname=name), fn.__globals__, name, defaults,
                                  fn.__closure__)
    function.__doc__ = fn.__doc__
    return function


# The functions compiled, one code object per use: built once here, so that every Decoder of the process
# shares their compiled code (a Decoder per eval cell or benchmark row reuses what an earlier one compiled).
STEPS = {(recall, blocks): specialized(decode_step, recall=recall, run_block=run_block if blocks else None)
         for recall in (False, True) for blocks in (False, True)}
WORK = {(work, per_layer): specialized(cache_work if per_layer else caches_work, work=work)
        for work in ("refresh", "flush") for per_layer in (False, True)}


def compiles_refresh(model: Transformer) -> bool:
    """False where the policy says compiling its refresh does not pay (KVCache.compile_refresh)."""
    return model.caches[0].compile_refresh


def refresh_as_compiled(compiled: Callable[[Transformer], None]) -> Callable[[Transformer], None]:
    """The compiled refresh, or the eager one where compiles_refresh says no; read at each call: eval installs
    its caches after building the Decoder."""
    eager = WORK["refresh", False]

    def run(model: Transformer) -> None:
        (compiled if compiles_refresh(model) else eager)(model)
    return run


COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead")
COMPILE_SCOPES = ("step", "block")
WARMUP_STEPS = 3  # reduce-overhead: CUDA graph trees run a step eagerly, record it, then replay it


# Inductor's settings for what runs once per token on a CPU, where a small model's step is a few milliseconds and
# the Python wrapper that calls its ~270 kernels a fifth of that: no size and stride assertion per kernel output
# (~700 a SmolLM2 step), and under step scope the wrapper in C++ (dispatcher calls, no interpreter; its entry
# built apart at -O1: a cold SmolLM2 step compiles in ~47 s instead of ~40 s, and in ~125 s built with the kernels
# at -O3). Block scope keeps the Python wrapper: Inductor's C++ wrapper cannot call a nested region.
CPU_STEP_OPTIONS = {"size_asserts": False, "alignment_asserts": False}
CPU_WHOLE_STEP_OPTIONS = {**CPU_STEP_OPTIONS, "cpp_wrapper": True, "cpp_wrapper_build_separate": True}


def step_compile_options(mode: str, device: str, scope: str) -> dict:
    """torch.compile's keywords for the functions that run once per token: the mode, on a CPU as its Inductor
    options with the step's own added (torch.compile takes a mode or options, not both)."""
    if device != "cpu":
        return {"mode": mode}
    own = CPU_WHOLE_STEP_OPTIONS if scope == "step" else CPU_STEP_OPTIONS
    return {"options": {**torch._inductor.list_mode_options(mode), **own}}


def default_compile_mode(device: str) -> str:
    """CUDA graphs remove the per-kernel launch cost that dominates a small model's step on a GPU."""
    return "reduce-overhead" if device.startswith("cuda") else "default"


def default_compile_scope(device: str) -> str:
    """block on CPU: the step with one nested compile region for every layer compiles many times faster cold than
    the fully traced step and decodes as fast (docs/compile.md); step on CUDA, where its cost was measured."""
    return "step" if device.startswith("cuda") else "block"


# ---- one decode call -----------------------------------------------------------------------------------
@dataclass
class Schedule:
    """The policy work between steps, read from the installed caches when a call (or a draft) starts."""

    refresh_interval: int | None
    tiers: TierSpec | None


@dataclass
class DecodeCall:
    """One decode call: its sampling, what it schedules, its guard state, what it ran.

    fed: the inputs are teacher-forced (every step recalls, tiers). warm: the warm-up (a compiled refresh and the
    tiers' flush before every step, a recall at the first only). recall: None follows the tiers' schedule, True /
    False recalls at every step / never (a benchmark's choice). step_times: where the step calls' seconds go."""

    temperature: float
    top_k: int | None
    skip_guards: bool
    start_pos: int
    schedule: Schedule
    fed: bool = False
    warm: bool = False
    recall: bool | None = None
    step_times: list[float] | None = None
    passed: int = 0  # units run with dynamo's guards (plain steps; speculative rounds), counted by their owner
    unguarded: dict[str, Callable] = field(default_factory=dict)
    steps: int = 0
    refreshes: int = 0

    def run(self, role: str, fn: Callable, *args):
        """fn(*args); after two units have passed dynamo's guards (the caller's input, then a step's own output),
        without dynamo's cache lookup (compilecache.guard_free: ~1 ms of a 7.5 ms int8 step), one lookup per role
        and call. role: which call this is (the draft step and a plain step share one function)."""
        if not (self.skip_guards and self.passed >= 2):
            return fn(*args)
        if role not in self.unguarded:
            self.unguarded[role] = guard_free(fn, *args) or partial(without_guards, fn)
        return self.unguarded[role](*args)


class Rounds(Protocol):
    """What Decoder.decode repeats: the Decoder's own round is one step; speculate.Speculator's drafts and verifies."""

    stop_every: int  # rounds between stop checks (each reads the tokens back: a device sync)

    def round(self, x: Tensor, pos: int, input_pos: Tensor, call: DecodeCall) -> tuple[Tensor, Tensor, Tensor | None]:
        """From x [B, 1] at pos (input_pos [1]): (tokens decided [B, m], the next input [B, 1], logits or None)."""

    def reset(self) -> None: ...

    def prefill(self, model: Transformer, idx: Tensor, temperature: float, top_k: int | None) -> Tensor: ...


class Decoder:
    """Holds the (optionally compiled) functions so they compile once and are reused across samples."""

    stop_every = 8

    def __init__(self, model: Transformer, compile: bool = False, compile_prefill: bool = False,
                 mode: str | None = None, scope: str | None = None, dynamic_capacity: bool = False,
                 prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK, prefill_dtype: torch.dtype | None = None):
        self.model = model
        self.dynamic_capacity = compile and dynamic_capacity
        self.mode, self.scope, self.block_steps = None, None, None
        self.skip_guards = compile
        if prefill_chunk is not None and prefill_chunk < 1:
            raise KVFastError(f"the prefill chunk must be >= 1 token, got {prefill_chunk}")
        self.prefill_compiled, self.prefill_dtype = compile_prefill, prefill_dtype
        self.prefill = partial(prefill, chunk=prefill_chunk, dtype=prefill_dtype)
        self.steps = {recall: STEPS[recall, False] for recall in (False, True)}
        self.refresh, self.flush = WORK["refresh", False], WORK["flush", False]
        if compile:
            device = str(next(model.parameters()).device)
            self.mode = mode or default_compile_mode(device)
            scope = scope or default_compile_scope(device)
            if self.mode not in COMPILE_MODES:
                raise KVFastError(f"unknown compile mode {self.mode!r} (choose from {', '.join(COMPILE_MODES)})")
            if scope not in COMPILE_SCOPES:
                raise KVFastError(f"unknown compile scope {scope!r} (choose from {', '.join(COMPILE_SCOPES)})")
            self.scope = scope
        if compile or compile_prefill:
            require_configured(self.scope == "block", self.dynamic_capacity)
        if compile and device == "cpu":  # before tracing: the step keeps the kernels it is traced with
            quantized = [m for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear, Int8Embedding))]
            time_int_paths(quantized)
            rows = max((c.batch_size for c in getattr(model, "caches", None) or [] if hasattr(c, "batch_size")),
                       default=1)
            tile_weights(quantized, rows)
        if next(model.parameters()).device.type == "cpu":  # after tiling: the tiles are what a step streams
            weights_on_huge_pages(model)
        if compile:
            self._compile(device)
        if compile_prefill:
            if kvzip.needs_context_pass(model):
                raise KVFastError("--compile-prefill cannot compile kvzip's reconstruction pass (it runs eagerly)")
            untraceable = sorted({type(c).__name__ for c in model.caches if c is not None and not c.prompt_traceable})
            if untraceable:
                raise KVFastError(f"--compile-prefill cannot compile {', '.join(untraceable)}'s prompt compression "
                                  "(how many tokens each head keeps depends on the scores): leave it out")
            # one block: a symbolic prompt length splits into no data-dependent number of blocks
            self.prefill = partial(prefill, chunk=None, dtype=prefill_dtype,
                                   logits_of=compiled_prompt_logits())

    def _compile(self, device: str) -> None:
        compiled = partial(torch.compile, mode=self.mode, fullgraph=True)
        per_token = partial(torch.compile, fullgraph=True, **step_compile_options(self.mode, device, self.scope))
        if self.scope == "step":  # the whole step, all layers traced into one graph (gpt-fast)
            self.steps = {recall: per_token(STEPS[recall, False]) for recall in (False, True)}
            self.refresh = refresh_as_compiled(compiled(WORK["refresh", False]))
            self.flush = compiled(WORK["flush", False])
            return
        # regional: one graph per step, in which one compiled layer serves every layer of its shapes. Static
        # shapes unless --dynamic-capacity: an int seen with another value in an earlier compile (a batch size, a
        # capacity) would turn symbolic, and a nested region reuses its code only for the static shapes it was
        # traced with (a symbol specialized inside it makes dynamo fail to stamp it out for the next layer)
        nested = partial(per_token, dynamic=None if self.dynamic_capacity else False)
        # where the layers' caches differ in shape (a pyramid schedule) each layer calls one separately compiled
        # layer function instead (under --dynamic-capacity one or two graphs serve every layer), the head apart
        layer, head = per_token(run_layer), per_token(logits_and_sample)
        self.block_steps = {False: {recall: nested(STEPS[recall, True]) for recall in (False, True)},
                            True: {recall: partial(decode_step, recall=recall, run_block=layer, head=head)
                                   for recall in (False, True)}}
        self.steps = self.block_steps[False]
        self.refresh = refresh_as_compiled(per_cache(compiled(WORK["refresh", True])))
        self.flush = per_cache(compiled(WORK["flush", True]))

    def compiled(self, fn: Callable) -> Callable:
        """fn compiled as the step is (its mode, one graph; static shapes: another chunk length is another
        graph), or fn itself where decoding is eager: speculation's verification and K/V hand-over."""
        return torch.compile(fn, mode=self.mode, fullgraph=True, dynamic=False) if self.scope else fn

    # ---- read from the installed caches when decoding starts: eval and the benchmarks install theirs after
    # building the Decoder, speculation swaps the draft's in
    def choose_block_step(self) -> None:
        """Block scope: the nested-region step where every layer's cache has the same shapes, else the layerwise
        step."""
        if self.block_steps:
            shapes = {tuple(b.shape for b in c.buffers()) for c in self.model.caches}
            self.steps = self.block_steps[len(shapes) > 1]

    def refresh_interval(self) -> int | None:
        return self.model.caches[0].refresh_interval

    def tiers(self) -> TierSpec | None:
        """The caches' tiers (kv.tiers)."""
        return self.model.caches[0].tiers

    def schedule(self) -> Schedule:
        return Schedule(self.refresh_interval(), self.tiers())

    def refresh_compiles(self) -> bool:
        return self.mode is not None and compiles_refresh(self.model)

    def reset(self) -> None:
        for c in self.model.caches:
            c.reset()

    # ---- the schedule ----------------------------------------------------------------------------------------
    def step(self, x: Tensor, pos: int, input_pos: Tensor, call: DecodeCall, first: bool = False,
             role: str = "step", schedule: Schedule | None = None) -> tuple[Tensor, Tensor]:
        """One decode step of x [B, 1] at pos (input_pos [1]) with the policy work due before it: the refresh
        every refresh_interval positions; tiers: staged victims flushed to warm pages every page_size positions,
        and a recall of warm pages for the query first where the input is new: the first step of a call (first)
        and every step of a fed chunk (each token of a question read through the decode step needs the context it
        asks about, not only the last one: on query-agnostic passkey, recalling at the chunk's first and last
        tokens alone lost the needle in a quarter of the samples that recalling at each token found), and while
        generating, every recall_interval positions. The warm-up runs a compiled refresh (an eager one has nothing
        to compile) and the flush before every step instead: compiling them must not wait for their interval.
        Returns (next token [B, 1], logits), copied: a CUDA graph replay overwrites its outputs."""
        schedule = schedule or call.schedule
        interval, tiers = schedule.refresh_interval, schedule.tiers
        if interval and (self.refresh_compiles() if call.warm else pos % interval == 0):
            self.refresh(self.model)
            call.refreshes += 1
        recall = False
        if tiers:
            if call.warm or pos % tiers.page_size == 0:
                self.flush(self.model)
            if call.recall is not None:
                recall = call.recall
            else:
                recall = first or (not call.warm and (call.fed or pos % tiers.recall_interval == 0))
        args = (self.model, x, input_pos, call.temperature, call.top_k)
        if call.step_times is not None:
            synchronize(x.device)
            t0 = time.perf_counter()
        if recall:
            x_next, logits = self.steps[True](*args)
        else:
            x_next, logits = call.run(role, self.steps[False], *args)
            call.passed += role == "step"
        if call.step_times is not None:
            synchronize(x.device)
            call.step_times.append(time.perf_counter() - t0)
        call.steps += 1
        return x_next.clone(), logits

    def round(self, x: Tensor, pos: int, input_pos: Tensor, call: DecodeCall) -> tuple[Tensor, Tensor, Tensor]:
        x_next, logits = self.step(x, pos, input_pos, call, first=pos == call.start_pos)
        return x_next, x_next, logits

    def decode(self, x: Tensor, start_pos: int, n: int, temperature: float = 0.0, top_k: int | None = None,
               stop_ids: set[int] | None = None, forced: Tensor | None = None, on_logits=None, *,
               rounds: Rounds | None = None, recall: bool | None = None,
               step_times: list[float] | None = None) -> Tensor:
        """Decode up to n tokens after x ([B, 1] at start_pos). With `forced` ([B, n]) the next inputs are
        teacher-forced (used to extend a cache by a chunk and for perplexity); on_logits(step, logits) sees
        each step's logits. rounds: what each iteration runs (default: one step, self.round); recall and
        step_times: DecodeCall's. Returns the generated tokens [B, <=n]."""
        call = self._call(start_pos, temperature, top_k, forced is not None, False, recall, step_times)
        return self._run(x, start_pos, n, call, rounds or self, stop_ids, forced, on_logits)

    def feed(self, chunk: Tensor, start_pos: int, temperature: float = 0.0, top_k: int | None = None) -> Tensor:
        """Read a chunk [B, L] (a question after a restored context, kv.snapshot) through the decode step at
        start_pos.. and return the token sampled after its last [B, 1]: teacher-forced, so each of its tokens
        recalls the warm pages it needs (tiers) and nothing is compressed without having seen it."""
        forced = torch.cat([chunk[:, 1:], chunk[:, -1:]], dim=1)  # the last column is never fed
        x = chunk[:, :1].clone(memory_format=torch.contiguous_format)  # a sampled token's strides (see _run)
        tokens = self.decode(x, start_pos, chunk.shape[1], temperature, top_k, forced=forced)
        return tokens[:, -1:].clone(memory_format=torch.contiguous_format)

    def _call(self, start_pos: int, temperature: float, top_k: int | None, fed: bool, warm: bool,
              recall: bool | None, step_times: list[float] | None) -> DecodeCall:
        if self.dynamic_capacity:  # caches set up after the warm-up (eval installs its own)
            mark_capacity_dynamic(self.model.caches)
        self.choose_block_step()
        return DecodeCall(temperature, top_k, self.skip_guards, start_pos, self.schedule(), fed=fed, warm=warm,
                          recall=recall, step_times=step_times)

    def _run(self, x: Tensor, start_pos: int, n: int, call: DecodeCall, rounds: Rounds,
             stop_ids: set[int] | None = None, forced: Tensor | None = None, on_logits=None) -> Tensor:
        out, done, calls = [], 0, 0
        if forced is not None:  # a chunk's first column, as its later ones below: the strides of a sampled token
            x = x.clone(memory_format=torch.contiguous_format)
        input_pos = torch.tensor([start_pos], dtype=torch.long, device=x.device)
        while done < n:
            tokens, x, logits = rounds.round(x, start_pos + done, input_pos, call)
            if on_logits is not None:
                on_logits(done, logits.clone())
            out.append(tokens)
            done += tokens.shape[1]
            calls += 1
            if forced is not None:  # the strides of a sampled token: dynamo guards on them (a chunk's column
                # has its length as row stride, so each chunk length would compile a graph of its own)
                x = forced[:, done - 1 : done].clone(memory_format=torch.contiguous_format)
            input_pos = input_pos + tokens.shape[1]
            if stop_ids and forced is None and calls % rounds.stop_every == 0 and all_stopped(torch.cat(out, 1),
                                                                                               stop_ids):
                break
        if not out:  # n == 0: --max-new-tokens 1 is the prefill's token alone
            return x.new_empty(x.shape[0], 0)
        tokens = torch.cat(out, dim=1)
        return tokens if tokens.shape[1] <= n else tokens[:, :n]

    def warm_up(self, idx: Tensor, temperature: float = 0.0, top_k: int | None = None, steps: int = WARMUP_STEPS,
                rounds: Rounds | None = None) -> tuple[int, int]:
        """Run the decode loop for `steps` tokens on throwaway cache state, with the shapes, dtypes and Python
        arguments of a real sample from prompt idx [B, S], so that the sample then compiles nothing (DecodeCall's
        warm: the compiled refresh and the tiers' flush at every step, a recall at the first); the caches are
        reset afterwards. The global RNG is restored, so a seeded sample does not depend on the warm-up.
        Returns (decode steps, refreshes) run: a constant, whatever the sample's length."""
        rounds, S = rounds or self, idx.shape[1]
        devices = [idx.device] if idx.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.inference_mode():
            call = self._call(S, temperature, top_k, False, True, None, None)
            rounds.reset()
            if self.prefill_compiled:  # same prompt, same shapes as the sample's prefill
                x = rounds.prefill(self.model, idx, temperature, top_k)
            else:  # decoding into empty caches is enough to compile the step; no prefill cost (kvzip's)
                # the strides of the token sample() returns: dynamo guards on strides, even of size-1 dims
                x = idx[:, -1:].clone(memory_format=torch.contiguous_format)
            self._run(x, S, steps, call, rounds)
            rounds.reset()
        return call.steps, call.refreshes


def without_guards(fn: Callable, *args):
    """fn(*args) evaluating only the guards that tell its compiled entries apart (where guard_free finds none)."""
    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
        return fn(*args)


def all_stopped(tokens: Tensor, stop_ids: set[int]) -> bool:
    stops = torch.tensor(sorted(stop_ids), device=tokens.device)
    return bool(torch.isin(tokens, stops).any(dim=1).all())


def truncate_at_stop(tokens: list[int], stop_ids: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[:i]
    return tokens


def synchronize(device: str | torch.device) -> None:
    """Wait for the device (CUDA kernels are asynchronous) before reading a clock."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
