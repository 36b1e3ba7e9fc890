"""bench.py --section speculate: self-speculative decoding (speculate.py) against plain decoding with the full
cache, in one process, on real text.

Per weights mode and prompt length: the first N tokens of --quality-text as the prompt (random ids would make
the draft's acceptance meaningless), greedy, --new-tokens tokens, compiled (block scope: each graph compiles in
seconds). Plain: the full cache, one token per step. Speculative: each --drafts cache (POLICY@BUDGET) with
each --draft-k K. Reported: decode tok/s (median of --repeats, prefill excluded), the speedup over plain,
the share of drafts accepted, tokens per verification, and whether the tokens equal plain decoding's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import Tensor

import cache as kvcache
from generate import Decoder
from model import KVFastError, Transformer
from speculate import Speculator


def parse_draft(text: str) -> tuple[str, float]:
    policy, _, budget = text.partition("@")
    try:
        value = float(budget)
    except ValueError:
        raise KVFastError(f"--drafts {text!r}: expected POLICY@BUDGET, e.g. window@0.05") from None
    if policy not in kvcache.POLICIES or not kvcache.POLICIES[policy].evicts:
        raise KVFastError(f"--drafts {text!r}: {policy!r} is not an evicting policy")
    return policy, value


def timed(runner, model: Transformer, ids: Tensor, new_tokens: int, repeats: int) -> tuple[float, list[int]]:
    """Median decode tok/s over the repeats (after one warm-up run) and the greedy tokens."""
    rates = []
    for i in range(repeats + 1):
        for c in model.caches:
            c.reset()
        if isinstance(runner, Speculator):
            runner.reset()
        with torch.inference_mode():
            first = runner.prefill(model, ids, 0.0, None)
            t0 = time.perf_counter()
            rest = runner.decode(first, ids.shape[1], new_tokens - 1)
            elapsed = time.perf_counter() - t0
        if i:
            rates.append((new_tokens - 1) / elapsed)
    return statistics.median(rates), torch.cat([first, rest], 1)[0].tolist()


def bench_speculate(model: Transformer, checkpoint, args: argparse.Namespace) -> dict:
    import evaltasks
    import quantize
    from generate import load

    drafts = [parse_draft(d) for d in args.drafts]
    _, tokenizer = load(checkpoint, "cpu", torch.float32)
    text_ids = tokenizer.encode(evaltasks.load_text(args.quality_text))
    out = {}
    for mode in args.weights:
        m = quantize.quantized_copy(model, mode)
        for length in args.lengths:
            if len(text_ids) < length:
                raise KVFastError(f"--quality-text has {len(text_ids)} tokens, fewer than --lengths {length}")
            ids = torch.tensor([text_ids[:length]])
            room = args.new_tokens + max(args.draft_k)
            m.setup_caches(kvcache.make_cache_factory("full", 1, m.args, length, room))
            decoder = Decoder(m, compile=True, scope="block")
            plain, plain_tokens = timed(decoder, m, ids, args.new_tokens, args.repeats)
            rows = {"plain": {"tok_s": plain}}
            for policy, budget in drafts:
                factory = kvcache.make_cache_factory(policy, 1, m.args, length, room, budget=budget)
                draft = [factory(i) for i in range(m.args.n_layers)]
                for k in args.draft_k:
                    spec = Speculator(m, decoder, draft, k)
                    tok_s, tokens = timed(spec, m, ids, args.new_tokens, args.repeats)
                    rows[f"{policy}@{budget} K={k}"] = {
                        "tok_s": tok_s, "speedup": tok_s / plain, "slots": draft[0].capacity,
                        "accepted": spec.accepted / spec.drafted, "per_round": (spec.accepted + spec.rounds) / spec.rounds,
                        "same_tokens": tokens == plain_tokens}
            torch._dynamo.reset()
            out[f"{mode} {length}"] = rows
            print(f"\n{mode} weights, {length}-token prompt ({args.quality_text}), {args.new_tokens} new tokens, "
                  f"greedy, compiled (block), median of {args.repeats}\n")
            print("| decoding | draft slots per layer | decode tok/s | vs plain | drafts accepted | "
                  "tokens per verification | tokens = plain |")
            print("|---|---|---|---|---|---|---|")
            for name, r in rows.items():
                if name == "plain":
                    print(f"| plain (full cache) | - | {r['tok_s']:.1f} | 1.00x | - | 1.00 | - |")
                    continue
                print(f"| {name} | {r['slots']} | {r['tok_s']:.1f} | {r['speedup']:.2f}x | {100 * r['accepted']:.0f} % "
                      f"| {r['per_round']:.2f} | {'yes' if r['same_tokens'] else 'NO'} |")
    return out
