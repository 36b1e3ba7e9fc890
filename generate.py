"""Generate text with a compressible KV cache: the command line (flags -> model, caches, Decoder), figures at
the end. The decode schedule itself is decode.Decoder's.

    python generate.py --prompt "Hello, my name is" --max-new-tokens 64 --compile
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

import cache as kvcache
import ragged
import tp
from cli import (
    DEFAULT_CHECKPOINT,
    ArgumentParser,
    load,
    read_prompt,
    resolve_checkpoint,
    run_cli,
)
from compilecache import CompileCache, dynamo_count, graph_count
from decode import (
    COMPILE_MODES,
    COMPILE_SCOPES,
    DEFAULT_PREFILL_CHUNK,
    PREFILL_DTYPES,
    Decoder,
    configure_torch,
    prefill_dtype,
    synchronize,
    truncate_at_stop,
)
from kv import snapshot
from kv.quant import kv_format
from kv.tiers import format_tier_report, tier_report
from model import KVFastError, Transformer
from speculate import Speculator

DEFAULT_PROMPT = "Hello, my name is"


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
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, metavar="N",
                   help="prefill layer by layer in query blocks of N prompt rows: memory grows with the prompt "
                        "only by its hidden states and one layer's q / k / v, never by an S x S product "
                        f"(default {DEFAULT_PREFILL_CHUNK}; a shorter prompt is one block; 0: one block whatever "
                        "the length)")
    p.add_argument("--prefill-dtype", choices=PREFILL_DTYPES, default="auto",
                   help="precision of the prefill's products; K/V and statistics stay in the compute dtype. "
                        "int8: int8 / int4 codes times int8 activations, as a decode step's, the rest in bfloat16 "
                        "(eager, AVX-512 VNNI CPUs). auto: int8 for int8 / int4 weights on an AVX-512 VNNI CPU "
                        "without AMX; else bfloat16 for bf16 / int8 / int4 weights on a CPU with AMX or "
                        "AVX512-BF16 (1.4-3x fp32's speed, +0.2%% perplexity at most); else the compute dtype")
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
    g = p.add_argument_group("saved contexts: compress once, ask many (kv/snapshot.py, docs/contexts.md)")
    g.add_argument("--save-context", type=Path, default=None, metavar="FILE",
                   help="after the prompt's prefill and compression, write the compressed caches to FILE; then "
                        "continue as usual")
    g.add_argument("--load-context", type=Path, default=None, metavar="FILE",
                   help="restore a saved context instead of prefilling (same checkpoint and cache flags): --prompt "
                        "is then the next chunk, e.g. a question, fed after the context; without --prompt decoding "
                        "continues where the saving run did")
    g.add_argument("--questions", type=Path, default=None, metavar="FILE",
                   help="one question per line, or JSONL {\"question\": ...}: each answered from the same "
                        "compressed context (--prompt's or --load-context's), restored before each")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    args = p.parse_args(argv)
    contexts = [f for f in ("save_context", "load_context", "questions") if getattr(args, f)]
    for flag, bad in (("--prompts", args.prompts), ("--speculate", args.speculate is not None),
                      ("--num-samples", args.num_samples > 1)):
        if contexts and bad:
            p.error(f"--{contexts[0].replace('_', '-')} does not combine with {flag}")
    if args.save_context and args.load_context:
        p.error("give --save-context or --load-context, not both")
    if contexts and tp.rank_and_world()[1] > 1:  # each rank holds other KV heads: one file could not serve them all
        p.error(f"--{contexts[0].replace('_', '-')} does not combine with tensor parallelism (torchrun)")
    if args.load_context and args.compile_prefill:
        p.error("--load-context restores the context instead of prefilling it: leave out --compile-prefill")
    if args.save_context and not args.save_context.resolve().parent.is_dir():
        p.error(f"--save-context: no folder {args.save_context.resolve().parent}")
    if args.load_context and args.questions and args.prompt is not None:
        p.error("--load-context: give the question as --prompt or the questions as --questions, not both")
    if args.max_new_tokens <= 0:
        p.error(f"--max-new-tokens must be > 0, got {args.max_new_tokens}")
    if args.num_samples <= 0 or args.batch_size <= 0:
        p.error("--num-samples and --batch-size must be > 0")
    if args.prefill_chunk < 0:
        p.error(f"--prefill-chunk must be >= 0 (0: one block), got {args.prefill_chunk}")
    if args.compile_prefill and args.prefill_chunk and args.prefill_chunk != DEFAULT_PREFILL_CHUNK:
        p.error("--compile-prefill compiles the prefill as one block (dynamic shapes): leave out --prefill-chunk")
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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.device = tp.init(args.device)  # under torchrun: join the ranks (tp.py); alone, nothing
    configure_torch(args.compile or args.compile_prefill, args.dynamic_capacity)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if args.device == "cpu" else torch.bfloat16)
    torch.manual_seed(args.seed)
    if args.prompts:
        ragged.check_args(args)
    texts = ragged.read_prompts(args.prompts) if args.prompts else [read_prompt(args.prompt or DEFAULT_PROMPT)]
    questions = ragged.read_prompts(args.questions, "question", "--questions") if args.questions else None
    header = (snapshot.read_header(args.load_context, ("next_token", "room", "prefill_s", "chat_open"))
              if args.load_context else None)
    if header is not None and args.prompt is not None:  # the prompt is the chunk after the context
        questions, texts = [texts[0]], [header["context_preview"]]
    kvcache.check_cache_args(args)  # bad policy, preset or flag: fail before loading the model
    checkpoint = resolve_checkpoint(args.checkpoint)
    model, tokenizer = load(checkpoint, args.device, dtype)
    tp.shard(model)  # this rank's heads and FFN columns, before the caches are sized for its heads
    # --chat with a context asked after (saved, loaded or --questions): the context opens a user turn, each
    # question closes it, so every question reads as the end of the message that holds the context
    args.chat_open = header["chat_open"] if header else bool(args.chat and (questions or args.save_context))
    if header and args.chat and not args.chat_open:
        raise KVFastError(f"--chat: {args.load_context} was saved without --chat; load it without --chat")
    opening, closing = tokenizer.chat_turn_parts() if args.chat_open else ("", "")
    if header is None and args.chat_open:
        texts = [opening + texts[0] + "\n\n"]
    elif args.chat and header is None:
        texts = [tokenizer.chat_prompt(t) for t in texts]
    rows = ([tokenizer.encode(t, bos=tokenizer.add_bos) for t in texts] if header is None else
            [header["context_ids"][0]])
    chunks = [tokenizer.encode(q + closing) for q in questions] if questions else None
    if chunks and not all(chunks):
        raise KVFastError(f"question {[bool(c) for c in chunks].index(False) + 1} is empty")
    asked = max(map(len, chunks)) if chunks else 0  # the longest question, read after the context
    for number, row in enumerate(rows, 1):
        if not row:
            raise KVFastError("the prompt is empty" if not args.prompts else f"prompt {number} of {args.prompts} is empty")
    ids = max(rows, key=len)  # a ragged batch is sized by its longest prompt
    prompt = "the prompt" if not args.prompts else f"the longest prompt (line {rows.index(ids) + 1})"
    total = len(ids) + asked + args.max_new_tokens + (args.speculate or 0)
    if args.pos_shift and len(ids) > model.args.max_seq_len:  # the prompt is prefilled at its own positions
        raise KVFastError(f"{prompt} ({len(ids)} tokens) exceeds the model's maximum length of "
                          f"{model.args.max_seq_len} tokens (--pos-shift lets decoding, not the prompt, go past it)")
    if total > model.args.max_seq_len and not args.pos_shift:
        drafts = f" + --speculate ({args.speculate})" if args.speculate else ""
        drafts += f" + the longest question ({asked})" if asked else ""
        raise KVFastError(f"{prompt} ({len(ids)} tokens) + --max-new-tokens ({args.max_new_tokens}){drafts} exceeds "
                          f"the model's maximum length of {model.args.max_seq_len} tokens")
    idx = (ragged.padded(rows, args.device) if args.prompts else
           torch.tensor([ids] * args.batch_size, dtype=torch.long, device=args.device))
    B = idx.shape[0]
    room = args.max_new_tokens + (args.speculate or 0)  # a verification writes up to K positions past the end
    room = header["room"] if header else room + asked  # a saved context: the room it was sized with
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
    if header and not (make_cache.cls.evicts and make_cache.cls.compresses) and asked + args.max_new_tokens > room:
        raise KVFastError(f"{make_cache.policy} keeps every new token: the saved context has room for {room} more "
                          f"(its --max-new-tokens + questions), not {asked} + --max-new-tokens {args.max_new_tokens}")
    model.setup_caches(make_cache)
    batch_caches = model.caches
    decoder = Decoder(model, compile=args.compile, compile_prefill=args.compile_prefill,
                      mode=args.compile_mode, scope=args.compile_scope, dynamic_capacity=args.dynamic_capacity,
                      prefill_chunk=args.prefill_chunk or None,
                      prefill_dtype=prefill_dtype(args.prefill_dtype, model, args.compile_prefill))
    runner = decoder if args.speculate is None else speculator(model, decoder, args, len(ids), dtype)
    stop_ids = None if args.ignore_eos else tokenizer.stop_ids
    weight_bytes = model.weight_bytes(step=True)
    compiled = args.compile or args.compile_prefill
    if compiled:
        warm_up(runner, idx, args)
    expect = snapshot.expectations(make_cache, model, checkpoint) if args.save_context or header else None
    if args.load_context or chunks:
        ask(args, model, tokenizer, runner, idx, chunks, expect, room)
        print_cache_stats(model, make_cache)
        return

    timings = []
    for i in range(args.num_samples):
        graphs_before = graph_count()
        runner.reset()
        t0 = time.perf_counter()
        with torch.inference_mode():
            if single_rows:
                first = ragged.prefill_rows(model, rows, batch_caches, single_rows, runner.prefill, args.temperature,
                                            args.top_k)
            else:
                first = runner.prefill(model, idx, args.temperature, args.top_k)
            t_prefill = time.perf_counter() - t0
            if args.save_context:  # not timed: the figures are the sample's
                t_save = time.perf_counter()
                save(args, model, tokenizer, idx, first, room, t_prefill, expect)
                t0 += time.perf_counter() - t_save
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
    products = str(decoder.prefill_dtype or dtype).removeprefix("torch.")
    print(f"prefill time: {t_prefill * 1000:.1f} ms ({products} products)")
    print(f"decode: {tok_s:.2f} tok/s per row, {tok_s * B:.2f} tok/s total")
    print(f"bandwidth achieved: {weight_bytes * tok_s / 1e9:.2f} GB/s (weights {weight_bytes / 1e6:.1f} MB per step)")
    print(f"peak memory: {peak_memory(args.device)}" + tp.describe(model))
    if compiled:
        print(f"compile mode: {decoder.mode or 'eager decode'}" + (f", scope {decoder.scope}" if decoder.scope else "")
              + (", dynamic capacity" if decoder.dynamic_capacity else "")
              + (", prefill compiled (dynamic shapes)" if args.compile_prefill else "")
              + f"; {graph_count()} graphs, {dynamo_count('recompiles')} recompiles, "
              f"{dynamo_count('graph_break')} graph breaks")
    print_cache_stats(model, make_cache)
    if runner is not decoder:
        print(runner.report())


def ask(args: argparse.Namespace, model: Transformer, tokenizer, runner: Decoder, idx: Tensor,
        chunks: list[list[int]] | None, expect: dict, room: int) -> None:
    """--load-context / --questions: the context restored from its file, or prefilled (and saved) once; then each
    chunk (question) fed after it from the restored snapshot, each answer printed with the time it saved."""
    S, B, T, k = idx.shape[1], idx.shape[0], args.temperature, args.top_k
    stop_ids = None if args.ignore_eos else tokenizer.stop_ids
    runner.reset()
    t0 = time.perf_counter()
    if args.load_context:
        header = snapshot.load_context(args.load_context, model, tokenizer, expect)
        first, t_prefill = torch.tensor(header["next_token"], device=idx.device), header["prefill_s"]
        print(f"context: {S} tokens restored from {args.load_context} in {(time.perf_counter() - t0) * 1000:.1f} ms "
              f"(its prefill took {t_prefill * 1000:.1f} ms when saved)")
    else:
        with torch.inference_mode():
            first = runner.prefill(model, idx, T, k)
        synchronize(args.device)
        t_prefill = time.perf_counter() - t0
        print(f"context: {S} tokens prefilled in {t_prefill * 1000:.1f} ms")
        if args.save_context:
            save(args, model, tokenizer, idx, first, room, t_prefill, expect)
    snap = snapshot.snapshot(model)
    for number, chunk in enumerate(chunks or [None], 1):
        graphs = graph_count()
        t0 = time.perf_counter()
        snapshot.restore(model, snap)
        synchronize(args.device)
        t_restore = time.perf_counter() - t0
        with torch.inference_mode():
            x = first if chunk is None else runner.feed(torch.tensor([chunk] * B, device=idx.device), S, T, k)
            new = runner.decode(x, S + len(chunk or []), args.max_new_tokens - 1, T, k, stop_ids)
        synchronize(args.device)
        elapsed = time.perf_counter() - t0
        tokens = torch.cat([x, new], dim=1)
        for row in range(B):
            out = tokens[row].tolist()
            print(tokenizer.decode(out if stop_ids is None else truncate_at_stop(out, stop_ids)))
            print("-" * 40)
        if graph_count() > graphs:
            print(f"warning: question {number} compiled {graph_count() - graphs} new graphs", file=sys.stderr)
        what = "continuation" if chunk is None else f"question {number} ({len(chunk)} tokens)"
        print(f"{what}: {tokens.shape[1]} new tokens in {elapsed * 1000:.1f} ms; context restored in "
              f"{t_restore * 1000:.2f} ms instead of a {t_prefill * 1000:.1f} ms prefill: "
              f"{(t_prefill - t_restore) * 1000:.1f} ms saved")


def save(args: argparse.Namespace, model: Transformer, tokenizer, idx: Tensor, first: Tensor, room: int,
         t_prefill: float, expect: dict) -> None:
    """--save-context: the caches right after the context's prefill, with what a later run needs to go on."""
    meta = {"context_ids": idx.tolist(), "next_token": first.tolist(), "room": room, "prefill_s": t_prefill,
            "chat_open": args.chat_open, **expect}
    snapshot.save_context(args.save_context, model, tokenizer, meta)
    print(f"context saved to {args.save_context} ({idx.shape[1]} tokens, {args.save_context.stat().st_size} bytes)")


def speculator(model: Transformer, decoder: Decoder, args: argparse.Namespace, prompt_len: int,
               dtype: torch.dtype) -> Speculator:
    """--speculate: the draft caches beside the full ones (whose factory left room for K drafts past the end)."""
    draft = kvcache.make_cache_factory(args.draft_cache, 1, model.args, prompt_len, args.max_new_tokens + args.speculate,
                                       budget=args.draft_budget, dtype=dtype, device=args.device)
    if draft.prompt_compression == "kvzip":
        raise KVFastError("--draft-cache: kvzip's prompt compression needs a pass of its own; choose another")
    return Speculator(model, decoder, [draft(i) for i in range(model.args.n_layers)], args.speculate)


def warm_up(runner: Decoder | Speculator, idx: Tensor, args: argparse.Namespace) -> None:
    """Compile every function once (a few throwaway steps, not a whole sample) and print how long it took;
    with --compile-cache, load the cache before and save it after."""
    graphs, t0 = graph_count(), time.perf_counter()  # loading the cache counts: it replaces compiling
    cache = CompileCache(args.compile_cache, args.device) if args.compile_cache else None
    if cache:
        cache.load()
    steps, refreshes = runner.warm_up(idx, args.temperature, args.top_k)
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


def peak_memory(device: str) -> str:
    """The process's peak memory so far, one figure: CUDA's allocated peak, or the resident set's high-water mark
    (weights, caches, activations, allocator slack: what the machine must hold)."""
    if device.startswith("cuda"):
        return f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB (CUDA allocated)"
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB (RSS)"  # KiB on Linux


def cli(argv: list[str] | None = None) -> int:
    return run_cli(main, argv)


if __name__ == "__main__":
    tp.exit_process(cli())
