"""Every registered policy under torch.compile(fullgraph=True): same tokens as eager, no recompilation over
256 decode steps after warm-up (Scissorhands' eager and expected_attention's compiled refresh included)."""

import pytest
import torch
from cache_testing import (
    generate_tokens,
    recorded_graphs,
    single_thread_fixture,
    small_factory,
    small_params,
    tiny_model,
    within_memory,
)
from torch._dynamo.utils import counters

from cache import POLICIES, setup_decode_benchmark
from decode import Decoder

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)

PROMPT_LEN, WARMUP, STEPS = 24, 8, 256


@pytest.mark.parametrize("policy", list(POLICIES))
def test_compiled_matches_eager_without_recompiling(policy):
    torch._dynamo.reset()  # each policy compiles the same step function afresh
    model = tiny_model()
    prompt = torch.randint(0, 64, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    n_new = WARMUP + STEPS + 1
    model.setup_caches(small_factory(policy, 2, model.args, PROMPT_LEN, n_new))
    eager = generate_tokens(model, prompt, n_new)

    graphs = {}

    def after_warmup(step, logits):
        if step == WARMUP:  # the step (and a compiled refresh: expected_attention's) have compiled by now
            graphs["warm"] = counters["stats"]["unique_graphs"]

    compiled = generate_tokens(model, prompt, n_new, Decoder(model, compile=True), on_logits=after_warmup)
    assert counters["stats"]["unique_graphs"] == graphs["warm"], "recompiled during decoding"
    assert torch.equal(compiled, eager)
    assert len(set(eager[0].tolist())) > 5  # the tiny model really generates (a constant would prove little)
    assert all(within_memory(c) for c in model.caches)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_decode_benchmark_setup(policy):
    """bench.py can time one decode step of any policy at a long context without a prefill."""
    model = tiny_model()
    setup_decode_benchmark(model, policy, context_len=300, budget=64 if policy != "full" else None,
                           **small_params(policy))
    with torch.inference_mode():
        logits = model(torch.zeros(1, 1, dtype=torch.long), torch.tensor([300]))
    assert torch.isfinite(logits).all()
    assert all(c.tokens_seen() == 301 for c in model.caches)
    if policy != "full":  # memory for the budget only (pyramid layers vary around it)
        assert sum(c.capacity for c in model.caches) <= 64 * len(model.caches) + 4


def test_bench_interleaves_the_policies_steps():
    """bench.py --section policies' one-process comparison: every policy timed each round (one Decoder, its
    compiled step per policy), nothing recompiled after the first round, ratios against the first policy."""
    import argparse

    from benchmarks.policies import interleaved_caches

    model = tiny_model()
    counters.clear()
    args = argparse.Namespace(steps=4, budget=0.25, compile_scope="block")
    setups = {"h2o": {"policy": "h2o", "budget": 0.25}, "hybrid": {"policy": "hybrid", "budget": 0.25}}
    with recorded_graphs(inductor=False):  # the rounds and recompiles are the claim, not Inductor's code
        out = interleaved_caches(model, setups, 300, args, rounds=3)
    assert set(out) == {"h2o", "hybrid"} and out["h2o"]["ratio"] == 1.0
    assert all(len(r["rounds_ms"]) == 3 and min(r["rounds_ms"]) > 0 for r in out.values())
    assert counters["stats"]["unique_graphs"] == 2 and counters["recompiles"] == {}
