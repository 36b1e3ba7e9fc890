"""Run under torchrun by tests/test_tp.py (and alone, in-process, for the reference): a tiny model with 3 KV
heads (an uneven split on 2 ranks), prefill logits and greedy decoding per policy, saved by rank 0."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from cache_testing import small_params, tiny_model

import tp
from cache import make_cache_factory
from decode import Decoder, configure_torch

PROMPT_LEN, N_NEW = 20, 16
RUNS = (("full", False), ("h2o", False), ("h2o", True))  # (policy, compiled)


def run(policy: str, compiled: bool) -> dict:
    """Every position's prefill logits, the greedy tokens and each decode step's logits."""
    model = tp.shard(tiny_model(n_heads=6, n_kv_heads=3))
    budget = None if policy == "full" else 12
    model.setup_caches(make_cache_factory(policy, 1, model.args, PROMPT_LEN, N_NEW, budget=budget,
                                          **small_params(policy)))
    idx = (torch.arange(PROMPT_LEN).view(1, -1) * 7) % 64
    decoder = Decoder(model, compile=compiled)
    steps = []
    with torch.inference_mode():
        prompt_logits = model(idx, all_logits=True)
        for c in model.caches:
            c.reset()
        first = model(idx).argmax(-1)
        rest = decoder.decode(first, PROMPT_LEN, N_NEW - 1, on_logits=lambda i, lg: steps.append(lg[0, -1]))
    return {"prompt_logits": prompt_logits[0], "tokens": torch.cat([first, rest], 1)[0],
            "step_logits": torch.stack(steps), "n_kv_heads": model.args.n_kv_heads}

if __name__ == "__main__":
    configure_torch(compile=True)
    tp.init("cpu")
    results = {f"{policy}{'+compile' if compiled else ''}": run(policy, compiled) for policy, compiled in RUNS}
    rank, world = tp.rank_and_world()
    if rank == 0:
        torch.save({"world": world, **results}, sys.argv[1])
    tp.exit_process(0)
