"""Generate text with a compressible KV cache: prefill, compiled decode loop, sampling, figures at the end.

    python generate.py --prompt "Hello, my name is" --max-new-tokens 64 --compile
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import Tensor, nn
from torch._inductor import config as inductor_config

import cache as kvcache
import ragged
import tp
from compilecache import dynamo_count, graph_count, guard_free, trust_cpu_vector_flags
from kv import kvzip
from kv.budgets import DYNAMIC_CAPACITY_CONFIG, mark_capacity_dynamic
from kv.quant import kv_format
from kv.tiers import TierSpec, flush_caches, format_tier_report, tier_report
from model import KVFastError, Transformer

ROOT = Path(__file__).resolve().parent
DEFAULT_CHECKPOINT = ROOT / "checkpoints" / "SmolLM2-135M-Instruct"


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


# ---- the three phases -------------------------------------------------------------------------------
def prefill(model: Transformer, idx: Tensor, temperature: float, top_k: int | None) -> Tensor:
    if kvzip.needs_context_pass(model):  # KVzip scores need the whole model before any layer compresses
        return sample(kvzip.prefill(model, idx), temperature, top_k)
    return sample(model(idx), temperature, top_k)


# Distinct layer shapes one compiled step may hold (a pyramid budget gives every layer its own capacity);
# dynamo raises past it: --capacity-buckets / --dynamic-capacity keep the count small.
MAX_BLOCK_SHAPES = 256


def decode_one_token(model: Transformer, x: Tensor, input_pos: Tensor, temperature: float,
                     top_k: int | None, recall: bool = False, run_block: Callable | None = None) -> tuple[Tensor, Tensor]:
    """One decode step: x [B, 1] at input_pos [1] -> (next token [B, 1], logits [B, 1, V])."""
    logits = model(x, input_pos, recall=recall, run_block=run_block)
    return sample(logits, temperature, top_k), logits


def recall_and_decode_one_token(model: Transformer, x: Tensor, input_pos: Tensor, temperature: float,
                                top_k: int | None) -> tuple[Tensor, Tensor]:
    """A decode step whose layers first recall warm pages for their query (kv.tiers); compiled on its own."""
    return decode_one_token(model, x, input_pos, temperature, top_k, recall=True)


def run_layer(layer: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor, recall: bool) -> Tensor:
    return layer(x, cos, sin, input_pos, recall)


# --compile-scope block: one TransformerBlock with its cache as a nested compile region. Dynamo traces and Inductor
# compiles it once and calls it for every layer of the same shapes (the layer's parameters and buffers are its
# inputs), inside one graph per step; eager, a plain call.
run_block = torch.compiler.nested_compile_region(run_layer, max_reuse_entries=MAX_BLOCK_SHAPES)


def logits_and_sample(model: Transformer, h: Tensor, temperature: float,
                      top_k: int | None) -> tuple[Tensor, Tensor]:
    logits = model.logits(h)
    return sample(logits, temperature, top_k), logits


class LayerwiseStep:
    """--compile-scope block where the layers' caches differ in shape (a pyramid schedule): a nested region is
    reused only for the static shapes it was traced with, so each layer calls one separately compiled layer
    function instead (under --dynamic-capacity one or two graphs serve every layer), the head compiled apart."""

    def __init__(self, layer: Callable, head: Callable, recall: bool = False):
        self.layer, self.head, self.recall = layer, head, recall

    def __call__(self, model: Transformer, x: Tensor, input_pos: Tensor, temperature: float,
                 top_k: int | None) -> tuple[Tensor, Tensor]:
        h = model.hidden(x, input_pos, self.recall, run_block=self.layer)
        return self.head(model, h, temperature, top_k)


def decode_by_blocks(model: Transformer, x: Tensor, input_pos: Tensor, temperature: float,
                     top_k: int | None) -> tuple[Tensor, Tensor]:
    """--compile-scope block's decode step: decode_one_token with every layer through run_block."""
    return decode_one_token(model, x, input_pos, temperature, top_k, run_block=run_block)


def recall_and_decode_by_blocks(model: Transformer, x: Tensor, input_pos: Tensor, temperature: float,
                                top_k: int | None) -> tuple[Tensor, Tensor]:
    return decode_one_token(model, x, input_pos, temperature, top_k, recall=True, run_block=run_block)


def per_cache(fn: Callable[[nn.Module], None]) -> Callable[[Transformer], None]:
    """fn(cache) for every layer's cache: the refresh and the flush under --compile-scope block."""
    def run(model: Transformer) -> None:
        for c in model.caches:
            fn(c)
    return run


def refresh_cache(cache: nn.Module) -> None:
    cache.refresh()


def flush_cache(cache: nn.Module) -> None:
    cache.flush()


def refresh_caches(model: Transformer) -> None:
    """Periodic policy work (e.g. Scissorhands' eviction-queue refill), outside the decode graph."""
    for c in model.caches:
        c.refresh()


def compiles_refresh(model: Transformer) -> bool:
    """False where the policy says compiling its refresh does not pay (KVCache.compile_refresh)."""
    return getattr(model.caches[0], "compile_refresh", True)


def refresh_as_compiled(compiled: Callable[[Transformer], None]) -> Callable[[Transformer], None]:
    """The compiled refresh, or the eager one where compiles_refresh says no; read at each call: eval installs
    its caches after building the Decoder."""
    def run(model: Transformer) -> None:
        (compiled if compiles_refresh(model) else refresh_caches)(model)
    return run


def flush_tiers(model: Transformer) -> None:
    """Tiers: staged victims become warm pages (every page_size positions), compiled separately."""
    flush_caches(model.caches)


COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead")
COMPILE_SCOPES = ("step", "block")
WARMUP_STEPS = 3  # reduce-overhead: CUDA graph trees run a step eagerly, record it, then replay it


def default_compile_mode(device: str) -> str:
    """CUDA graphs remove the per-kernel launch cost that dominates a small model's step on a GPU."""
    return "reduce-overhead" if device.startswith("cuda") else "default"


def default_compile_scope(device: str) -> str:
    """block on CPU: the step with one nested compile region for every layer compiles many times faster cold than
    the fully traced step and decodes as fast (README, "Compile latency"); step on CUDA, where its cost was measured."""
    return "step" if device.startswith("cuda") else "block"


class Decoder:
    """Holds the (optionally compiled) step functions so they compile once and are reused across samples."""

    def __init__(self, model: Transformer, compile: bool = False, compile_prefill: bool = False,
                 mode: str | None = None, scope: str | None = None, dynamic_capacity: bool = False):
        self.model = model
        self.dynamic_capacity = compile and dynamic_capacity
        if self.dynamic_capacity:  # process-wide: dynamo reads it while tracing
            for key, value in DYNAMIC_CAPACITY_CONFIG.items():
                setattr(torch._dynamo.config, key, value)
        self.step = decode_one_token
        self.step_recall = recall_and_decode_one_token
        self.refresh = refresh_caches
        self.flush = flush_tiers
        self.prefill = prefill
        self.mode, self.scope, self.block_steps = None, None, None
        # after a call's first two plain steps have passed dynamo's guards (the caller's input, then a step's own
        # output), its later plain steps (same caches, same shapes: the tests count 0 recompiles) call the
        # compiled code without dynamo's cache lookup (compilecache.guard_free): ~1 ms of a 7.5 ms int8 step
        self.skip_guards = compile
        if (compile or compile_prefill) and next(model.parameters()).device.type == "cpu":
            trust_cpu_vector_flags()
        if compile or compile_prefill:
            # process-wide: Inductor otherwise keeps a value cast down and back up in fp32 inside a fused kernel,
            # and bfloat16 K/V's one-query attention (model.attend_one_query) would skip the roundings that make
            # it agree with the bfloat16 matmuls of eager steps and of a speculative verification
            inductor_config.emulate_precision_casts = True
        if compile:
            device = str(next(model.parameters()).device)
            self.mode = mode or default_compile_mode(device)
            scope = scope or default_compile_scope(device)
            if self.mode not in COMPILE_MODES:
                choices = ", ".join(COMPILE_MODES)
                raise KVFastError(f"unknown compile mode {self.mode!r} (choose from {choices})")
            if scope not in COMPILE_SCOPES:
                raise KVFastError(f"unknown compile scope {scope!r} (choose from {', '.join(COMPILE_SCOPES)})")
            self.scope = scope
            compiled = partial(torch.compile, mode=self.mode, fullgraph=True)
            if scope == "step":  # the whole step, all layers traced into one graph (gpt-fast)
                self.step = compiled(decode_one_token)
                self.step_recall = compiled(recall_and_decode_one_token)
                self.refresh = refresh_as_compiled(compiled(refresh_caches))
                self.flush = compiled(flush_tiers)
            else:  # regional: one graph per step, in which one compiled layer serves every layer of its shapes
                # process-wide: a float a module attribute held with another value in an earlier compile (an eps,
                # a policy's parameter) would otherwise turn symbolic, and a nested region takes no float inputs
                torch._dynamo.config.specialize_float = True
                # static shapes unless --dynamic-capacity: an int seen with another value in an earlier compile
                # (a batch size, a capacity) would turn symbolic, and a nested region reuses its code only for
                # the static shapes it was traced with (a symbol specialized inside it makes dynamo fail to
                # stamp it out for the next layer)
                nested = partial(compiled, dynamic=None if self.dynamic_capacity else False)
                layer, head = compiled(run_layer), compiled(logits_and_sample)
                self.block_steps = {False: (nested(decode_by_blocks), nested(recall_and_decode_by_blocks)),
                                    True: (LayerwiseStep(layer, head), LayerwiseStep(layer, head, recall=True))}
                self.step, self.step_recall = self.block_steps[False]
                self.refresh = refresh_as_compiled(per_cache(compiled(refresh_cache)))
                self.flush = per_cache(compiled(flush_cache))
        if compile_prefill:
            if kvzip.needs_context_pass(model):
                raise KVFastError("--compile-prefill cannot compile kvzip's reconstruction pass (it runs eagerly)")
            self.prefill = torch.compile(prefill, fullgraph=True, dynamic=True)

    def choose_block_step(self) -> None:
        """Block scope: the nested-region step where every layer's cache has the same shapes, else the layerwise
        step; read when decoding starts, as the caches may have been installed after us (eval)."""
        if self.block_steps:
            shapes = {tuple(b.shape for b in c.buffers()) for c in self.model.caches}
            self.step, self.step_recall = self.block_steps[len(shapes) > 1]

    def refresh_interval(self) -> int | None:
        return getattr(self.model.caches[0], "refresh_interval", None)

    def tiers(self) -> TierSpec | None:
        """The caches' tiers (kv.tiers), read when decoding starts: eval installs caches after building us."""
        return getattr(self.model.caches[0], "tiers", None)

    def warm_up(self, idx: Tensor, temperature: float = 0.0, top_k: int | None = None,
                steps: int = WARMUP_STEPS) -> tuple[int, int]:
        """Call every compiled function `steps` times on throwaway cache state, with the shapes, dtypes and
        Python arguments of a real sample from prompt idx [B, S], so that the sample then compiles nothing;
        the caches are reset afterwards. A compiled refresh (and the tiers' flush) runs before each step instead of
        on its schedule: compiling it must not wait for the interval; an eager one is not run (nothing to compile);
        the first step recalls (tiers). The global RNG is restored, so
        a seeded sample does not depend on the warm-up. Returns (decode steps, refreshes) run: a constant,
        whatever the sample's length."""
        model, S = self.model, idx.shape[1]
        if self.dynamic_capacity:
            mark_capacity_dynamic(model.caches)
        self.choose_block_step()
        compiled_refresh = self.refresh is not refresh_caches and compiles_refresh(model)
        refreshes = steps if self.refresh_interval() and compiled_refresh else 0
        tiers = self.tiers()
        devices = [idx.device] if idx.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.inference_mode():
            for c in model.caches:
                c.reset()
            if self.prefill is not prefill:  # compiled: same prompt, same shapes as the sample's prefill
                x = self.prefill(model, idx, temperature, top_k)
            else:  # decoding into empty caches is enough to compile the step; no prefill cost (kvzip's)
                # the strides of the token sample() returns: dynamo guards on strides, even of size-1 dims
                x = idx[:, -1:].clone(memory_format=torch.contiguous_format)
            input_pos = torch.tensor([S], dtype=torch.long, device=idx.device)
            for i in range(steps):
                if refreshes:
                    self.refresh(model)
                if tiers:
                    self.flush(model)
                step = self.step_recall if tiers and i == 0 else self.step
                x, _ = step(model, x, input_pos, temperature, top_k)
                x = x.clone()  # as in decode(): a CUDA graph replay overwrites its outputs
                input_pos = input_pos + 1
            for c in model.caches:
                c.reset()
        return steps, refreshes

    def decode(self, x: Tensor, start_pos: int, n: int, temperature: float = 0.0, top_k: int | None = None,
               stop_ids: set[int] | None = None, forced: Tensor | None = None,
               on_logits=None) -> Tensor:
        """Decode up to n tokens after x ([B, 1] at start_pos). With `forced` ([B, n]) the next inputs are
        teacher-forced (used to extend a cache by a chunk and for perplexity); on_logits(step, logits) sees
        each step's logits. Returns the generated tokens [B, <=n].

        Tiers (kv.tiers): staged victims are flushed to warm pages every page_size positions; a step recalls
        warm pages for its query first when its input is new: the first step of a call and every step of a fed
        chunk (each token of a question read through the decode step needs the context it asks about, not only
        the last one: on query-agnostic passkey, recalling at the chunk's first and last tokens alone lost the
        needle in a quarter of the samples that recalling at each token found), and while generating, every
        recall_interval positions."""
        out = []
        if self.dynamic_capacity:  # caches set up after the warm-up (eval installs its own)
            mark_capacity_dynamic(self.model.caches)
        self.choose_block_step()
        input_pos = torch.tensor([start_pos], dtype=torch.long, device=x.device)
        interval, tiers = self.refresh_interval(), self.tiers()
        guarded, unguarded = 0, None  # plain steps of this call run with guards; then the guard-free step
        for i in range(n):
            pos = start_pos + i
            if interval and pos % interval == 0:
                self.refresh(self.model)
            step = self.step
            if tiers:
                if pos % tiers.page_size == 0:
                    self.flush(self.model)
                if i == 0 or forced is not None or pos % tiers.recall_interval == 0:
                    step = self.step_recall
            if step is self.step and self.skip_guards and guarded >= 2:
                args = (self.model, x, input_pos, temperature, top_k)
                unguarded = unguarded or guard_free(step, *args) or partial(without_guards, step)
                x_next, logits = unguarded(*args)
            else:
                x_next, logits = step(self.model, x, input_pos, temperature, top_k)
                guarded += step is self.step
            # with CUDA graphs the step's outputs live in memory the next replay overwrites: copy them out
            x_next = x_next.clone()
            if on_logits is not None:
                on_logits(i, logits.clone())
            out.append(x_next)
            x = forced[:, i : i + 1] if forced is not None else x_next
            input_pos = input_pos + 1
            if stop_ids and forced is None and (i + 1) % 8 == 0 and _all_stopped(torch.cat(out, 1), stop_ids):
                break
        return torch.cat(out, dim=1)


def without_guards(fn: Callable, *args):
    """fn(*args) evaluating only the guards that tell its compiled entries apart (where guard_free finds none)."""
    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
        return fn(*args)


def _all_stopped(tokens: Tensor, stop_ids: set[int]) -> bool:
    stops = torch.tensor(sorted(stop_ids), device=tokens.device)
    return bool(torch.isin(tokens, stops).any(dim=1).all())


def truncate_at_stop(tokens: list[int], stop_ids: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[:i]
    return tokens


# ---- CLI -----------------------------------------------------------------------------------------------
class ArgumentParser(argparse.ArgumentParser):
    """Bad flags end in one line ('error: ...') and exit code 2, like every other user error."""

    def error(self, message: str):
        raise KVFastError(message)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT,
                   help="checkpoint folder (config.json + model.safetensors|model.pth + tokenizer) or its "
                        "weights file; the default model is prepared on first use")
    p.add_argument("--prompt", default=None, help=f"prompt text, or @FILE to read it from a file ({DEFAULT_PROMPT!r})")
    p.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                   help="a ragged batch: one prompt per line (\\n for a newline), or JSONL lines {\"prompt\": ...}, "
                        "decoded together, each row stopping on its own (ragged.py)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per sample")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=200, help="sample among the k most likely tokens")
    p.add_argument("--num-samples", type=int, default=1, help="number of samples to generate")
    p.add_argument("--batch-size", type=int, default=1, help="rows per sample (the prompt is replicated)")
    p.add_argument("--seed", type=int, default=1234, help="random seed")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (fullgraph)")
    p.add_argument("--compile-prefill", action="store_true", help="torch.compile prefill (dynamic shapes)")
    p.add_argument("--compile-mode", choices=COMPILE_MODES, default=None,
                   help="torch.compile mode of the decode step and the refresh (default: reduce-overhead, "
                        "i.e. CUDA graphs, on CUDA; default on CPU, where reduce-overhead is an error)")
    p.add_argument("--compile-scope", choices=COMPILE_SCOPES, default=None,
                   help="what --compile traces into one graph: one transformer block reused for every layer "
                        "(block, the default on CPU: regional compilation, ~4x faster cold compile, steps as fast) "
                        "or the whole decode step (step, the default on CUDA: one CUDA graph per step)")
    p.add_argument("--dynamic-capacity", action="store_true",
                   help="--compile: the cache's slot count is a symbolic size, so one compiled step serves "
                        "every prompt length and budget (no padding, unlike --capacity-buckets)")
    p.add_argument("--compile-cache", type=Path, default=None, metavar="FILE",
                   help="load compiled code from FILE before compiling, save it there after the warm-up: a "
                        "fresh checkout starts warm; a file from another torch version or device kind, or a "
                        "corrupt one, is a warning and a normal compile")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (default float32 on CPU, which has no fast bf16 here; bfloat16 on GPU)")
    kvcache.add_cache_args(p)
    g = p.add_argument_group("self-speculative decoding (speculate.py)")
    g.add_argument("--speculate", type=int, default=None, metavar="K",
                   help="draft K tokens per round with a compressed cache and verify them with the full cache in "
                        "one step (one row; greedy output equals plain decoding)")
    g.add_argument("--draft-cache", default=None,
                   help="--speculate: the draft cache's policy (any evicting one, at its defaults; default window)")
    g.add_argument("--draft-budget", type=float, default=None,
                   help="--speculate: the draft cache's slots per layer, a fraction in (0, 1] of prompt + new "
                        "tokens or a number (> 1) (default 0.1)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    args = p.parse_args(argv)
    if args.max_new_tokens <= 0:
        p.error(f"--max-new-tokens must be > 0, got {args.max_new_tokens}")
    if args.num_samples <= 0 or args.batch_size <= 0:
        p.error("--num-samples and --batch-size must be > 0")
    if args.top_k is not None and args.top_k <= 0:
        p.error("--top-k must be > 0")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    if args.compile_scope and not args.compile:
        p.error("--compile-scope needs --compile")
    if args.dynamic_capacity and not args.compile:
        p.error("--dynamic-capacity needs --compile")
    if args.compile_mode and not args.compile:
        p.error("--compile-mode needs --compile")
    if args.compile_mode == "reduce-overhead" and not args.device.startswith("cuda"):
        p.error("--compile-mode reduce-overhead needs CUDA (it is CUDA graphs); on CPU use default or "
                "max-autotune-no-cudagraphs")
    if args.compile_cache and not (args.compile or args.compile_prefill):
        p.error("--compile-cache needs --compile or --compile-prefill")
    if args.speculate is None and (args.draft_cache or args.draft_budget):
        p.error(f"--draft-{'cache' if args.draft_cache else 'budget'} needs --speculate")
    if args.speculate is not None:
        args.draft_cache, args.draft_budget = args.draft_cache or "window", args.draft_budget or 0.1
        if args.speculate < 1:
            p.error(f"--speculate must be >= 1, got {args.speculate}")
        if args.batch_size != 1 or (args.cache or "full") != "full":
            p.error("--speculate decodes one row with --cache full verifying (rows would accept different "
                    "numbers of drafts): drop --batch-size / --cache")
        if args.draft_cache not in kvcache.POLICIES or not kvcache.POLICIES[args.draft_cache].evicts:
            evicting = ", ".join(n for n, c in kvcache.POLICIES.items() if c.evicts)
            p.error(f"--draft-cache must be an evicting policy ({evicting}), got {args.draft_cache!r}")
    return args


DEFAULT_PROMPT = "Hello, my name is"


def read_prompt(prompt: str) -> str:
    if not prompt.startswith("@"):
        return prompt
    path = Path(prompt[1:])
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise KVFastError(f"cannot read prompt file {path}: {e.strerror if isinstance(e, OSError) else e}")


def resolve_checkpoint(path: Path) -> Path:
    if path == DEFAULT_CHECKPOINT and not (path / "config.json").exists():
        from scripts.prepare import prepare_default

        print("preparing the default model (first use)...", file=sys.stderr)
        return prepare_default(ROOT)
    return path


def load(checkpoint: Path, device: str, dtype: torch.dtype):
    from tokenizer import load_tokenizer

    model = Transformer.from_checkpoint(checkpoint, device=device, dtype=dtype)
    folder = checkpoint if checkpoint.is_dir() else checkpoint.parent
    try:
        tokenizer = load_tokenizer(folder)
    except (OSError, ValueError) as e:  # missing files, bad JSON, bad tokenizer model
        raise KVFastError(f"cannot load the tokenizer of {folder}: {e}") from None
    return model, tokenizer


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.device = tp.init(args.device)  # under torchrun: join the ranks (tp.py); alone, nothing
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if args.device == "cpu" else torch.bfloat16)
    torch.manual_seed(args.seed)
    if args.prompts:
        ragged.check_args(args)
    texts = ragged.read_prompts(args.prompts) if args.prompts else [read_prompt(args.prompt or DEFAULT_PROMPT)]
    kvcache.check_cache_args(args)  # bad policy, preset or flag: fail before loading the model
    checkpoint = resolve_checkpoint(args.checkpoint)
    model, tokenizer = load(checkpoint, args.device, dtype)
    tp.shard(model)  # this rank's heads and FFN columns, before the caches are sized for its heads
    if args.chat:
        texts = [tokenizer.chat_prompt(t) for t in texts]
    rows = [tokenizer.encode(t, bos=tokenizer.add_bos) for t in texts]
    for number, row in enumerate(rows, 1):
        if not row:
            raise KVFastError("the prompt is empty" if not args.prompts else f"prompt {number} of {args.prompts} is empty")
    ids = max(rows, key=len)  # a ragged batch is sized by its longest prompt
    prompt = "the prompt" if not args.prompts else f"the longest prompt (line {rows.index(ids) + 1})"
    total = len(ids) + args.max_new_tokens + (args.speculate or 0)
    if args.pos_shift and len(ids) > model.args.max_seq_len:  # the prompt is prefilled at its own positions
        raise KVFastError(f"{prompt} ({len(ids)} tokens) exceeds the model's maximum length of "
                          f"{model.args.max_seq_len} tokens (--pos-shift lets decoding, not the prompt, go past it)")
    if total > model.args.max_seq_len and not args.pos_shift:
        drafts = f" + --speculate ({args.speculate})" if args.speculate else ""
        raise KVFastError(f"{prompt} ({len(ids)} tokens) + --max-new-tokens ({args.max_new_tokens}){drafts} exceeds "
                          f"the model's maximum length of {model.args.max_seq_len} tokens")
    idx = (ragged.padded(rows, args.device) if args.prompts else
           torch.tensor([ids] * args.batch_size, dtype=torch.long, device=args.device))
    B = idx.shape[0]
    room = args.max_new_tokens + (args.speculate or 0)  # a verification writes up to K positions past the end
    if args.speculate and args.kv_bits == 16 and args.kv_float in (None, "auto"):  # the verification's K/V float
        args.kv_float = kv_format(16, "auto", verifies=args.device == "cpu")[0]["kv_float"]
    make_cache = kvcache.cache_factory_from_args(args, B, model.args, len(ids), room, dtype, args.device, tokenizer)
    single_rows = None  # --prompts: the one-row caches each prompt is prefilled into (ragged.py)
    if args.prompts:
        if make_cache.tiers:  # e.g. from a --cache-config preset
            raise KVFastError("--prompts does not combine with tiers (--warm-tokens): not built for ragged batches")
        single = kvcache.cache_factory_from_args(ragged.single_row_args(args), 1, model.args, len(ids), room, dtype,
                                                 args.device, tokenizer)
        single_rows = [single(i) for i in range(model.args.n_layers)]
    if make_cache.prompt_compression == "kvzip" and len(ids) <= min(make_cache.prompt_capacities):
        print(f"kvzip: the prompt ({len(ids)} tokens) fits the cache ({min(make_cache.prompt_capacities)} prompt "
              "slots per layer): nothing to compress, no reconstruction pass")
    if args.pos_shift and max(make_cache.capacities) > model.args.max_seq_len:
        raise KVFastError(f"--pos-shift: the cache holds {max(make_cache.capacities)} slots, more ranks than the "
                          f"model's maximum length of {model.args.max_seq_len}; lower --cache-budget")
    model.setup_caches(make_cache)
    batch_caches = model.caches
    decoder = Decoder(model, compile=args.compile, compile_prefill=args.compile_prefill,
                      mode=args.compile_mode, scope=args.compile_scope, dynamic_capacity=args.dynamic_capacity)
    runner = decoder if args.speculate is None else speculator(model, decoder, args, len(ids), dtype)
    stop_ids = None if args.ignore_eos else tokenizer.stop_ids
    weight_bytes = model.weight_bytes()
    compiled = args.compile or args.compile_prefill
    if compiled:
        warm_up(runner, idx, args)

    timings = []
    for i in range(args.num_samples):
        graphs_before = graph_count()
        for c in model.caches:
            c.reset()
        if runner is not decoder:
            runner.reset()
        t0 = time.perf_counter()
        with torch.inference_mode():
            if single_rows:
                first = ragged.prefill_rows(model, rows, batch_caches, single_rows, runner.prefill, args.temperature,
                                            args.top_k)
            else:
                first = runner.prefill(model, idx, args.temperature, args.top_k)
            t_prefill = time.perf_counter() - t0
            new = runner.decode(first, len(ids), args.max_new_tokens - 1, args.temperature, args.top_k, stop_ids)
        synchronize(args.device)
        elapsed = time.perf_counter() - t0
        tokens = torch.cat([first, new], dim=1)
        if compiled and graph_count() > graphs_before:  # the warm-up missed a function or a guard failed
            print(f"warning: sample {i} compiled {graph_count() - graphs_before} new graphs; its figures include "
                  "compile time", file=sys.stderr)
        n_new = tokens.shape[1]
        timings.append((t_prefill, (n_new - 1) / max(elapsed - t_prefill, 1e-9), n_new))
        for row in range(B):
            out = tokens[row].tolist()
            text = tokenizer.decode(out if stop_ids is None else truncate_at_stop(out, stop_ids))
            print(("" if args.chat else texts[min(row, len(texts) - 1)]) + text)
            print("-" * 40)
        scoring = getattr(model, "kvzip_scoring_s", 0.0)
        extra = f", of which kvzip reconstruction scoring {scoring * 1000:.1f} ms" if scoring else ""
        size = f"{len(ids)} tokens" if not args.prompts else f"{B} prompts of {min(map(len, rows))}-{len(ids)} tokens"
        print(f"sample {i}: prefill {t_prefill * 1000:.1f} ms ({size}{extra}), decode "
              f"{timings[-1][1]:.2f} tok/s x {B} rows, {n_new} new tokens")
        if args.prompts:
            print("\n".join(ragged.row_report(model, rows, tokens, stop_ids)))

    t_prefill = sum(t[0] for t in timings) / len(timings)
    tok_s = sum(t[1] for t in timings) / len(timings)
    print(f"prefill time: {t_prefill * 1000:.1f} ms")
    print(f"decode: {tok_s:.2f} tok/s per row, {tok_s * B:.2f} tok/s total")
    print(f"bandwidth achieved: {weight_bytes * tok_s / 1e9:.2f} GB/s (weights {weight_bytes / 1e6:.1f} MB per step)")
    print(f"peak memory: {_peak_memory_gb(args.device):.2f} GB" + tp.describe(model))
    if compiled:
        print(f"compile mode: {decoder.mode or 'eager decode'}" + (f", scope {decoder.scope}" if decoder.scope else "")
              + (", dynamic capacity" if decoder.dynamic_capacity else "")
              + (", prefill compiled (dynamic shapes)" if args.compile_prefill else "")
              + f"; {graph_count()} graphs, {dynamo_count('recompiles')} recompiles, "
              f"{dynamo_count('graph_break')} graph breaks")
    print_cache_stats(model, make_cache)
    if runner is not decoder:
        print(runner.report())


def speculator(model: Transformer, decoder: Decoder, args: argparse.Namespace, prompt_len: int, dtype: torch.dtype):
    """--speculate: the draft caches beside the full ones (whose factory left room for K drafts past the end)."""
    from speculate import Speculator

    draft = kvcache.make_cache_factory(args.draft_cache, 1, model.args, prompt_len, args.max_new_tokens + args.speculate,
                                       budget=args.draft_budget, dtype=dtype, device=args.device)
    if draft.prompt_compression == "kvzip":
        raise KVFastError("--draft-cache: kvzip's prompt compression needs a pass of its own; choose another")
    return Speculator(model, decoder, [draft(i) for i in range(model.args.n_layers)], args.speculate)


def warm_up(decoder: Decoder, idx: Tensor, args: argparse.Namespace) -> None:
    """Compile every function once (a few throwaway steps, not a whole sample) and print how long it took;
    with --compile-cache, load the cache before and save it after."""
    from compilecache import CompileCache

    graphs, t0 = graph_count(), time.perf_counter()  # loading the cache counts: it replaces compiling
    cache = CompileCache(args.compile_cache, args.device) if args.compile_cache else None
    if cache:
        cache.load()
    steps, refreshes = decoder.warm_up(idx, args.temperature, args.top_k)
    synchronize(args.device)
    elapsed = time.perf_counter() - t0
    if cache:
        cache.save()
    warm = f"{steps} decode steps" + (f", {refreshes} refreshes" if refreshes else "")
    print(f"compile time: {elapsed:.2f} s ({graph_count() - graphs} graphs; warm-up: {warm})")
    if cache:
        print(cache.report())


def print_cache_stats(model: Transformer, factory: kvcache.CacheFactory) -> None:
    """Policy, capacities, tokens seen / kept / evicted, KV bytes vs the full cache's, hybrid's / fastgen's head
    classes (read once, at the end)."""
    print(factory.describe())
    for line in kvcache.format_cache_report(kvcache.cache_report(model.caches)):
        print(line)
    for line in kvcache.format_head_class_report(kvcache.head_class_report(model.caches), factory.policy):
        print(line)
    for line in format_tier_report(tier_report(model.caches)):
        print(line)


def synchronize(device: str) -> None:
    """Wait for the device (CUDA kernels are asynchronous) before reading a clock."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_memory_gb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def cli(argv: list[str] | None = None) -> int:
    return run_cli(main, argv)


def run_cli(entry, argv: list[str] | None = None) -> int:
    """Run a CLI's main(); a user error is one line on stderr and exit code 2, never a traceback."""
    try:
        entry(argv)
    except KVFastError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    tp.exit_process(cli())
