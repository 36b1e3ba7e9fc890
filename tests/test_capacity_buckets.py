"""Shapes that do not multiply compiles. --capacity-buckets: slots allocated in a few sizes, only where that
cannot change what a cache keeps (room for new tokens of a cache that never evicts, or a sequence the budget
holds whole); evicting budgets stay exact. --dynamic-capacity: the slot count is a symbolic size, so one
compiled step serves every capacity."""

from functools import partial

import pytest
import torch
from cache_testing import generate_tokens, recorded_graphs, single_thread_fixture, tiny_model
from numerics import assert_numerically_close, model_depth
from torch._dynamo.utils import counters

import decode
from cache import make_cache_factory
from kv.budgets import DYNAMIC_CAPACITY_CONFIG, bucket_capacity, parse_buckets
from model import KVFastError

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)
N_NEW = 12


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(**{k: not v for k, v in DYNAMIC_CAPACITY_CONFIG.items()}):
        yield  # configure_torch(dynamic_capacity=True) changes dynamo's process-wide config: restored here
    torch._dynamo.reset()


@pytest.mark.parametrize("slots, spec, limit, expected", [
    (1, "x4", 8192, 256), (256, "x4", 8192, 256), (257, "x4", 8192, 1024), (3064, "x4", 8192, 4096),
    (5000, "x4", 8192, 8192), (9000, "x4", 8192, 9000),  # never above the model's length, never below the need
    (300, "x2", 8192, 512), (3000, "x2", 2048, 3000), (300, "1024,4096", 8192, 1024),
    (5000, "1024,4096", 8192, 5000), (300, "off", 8192, 300),
])
def test_bucket_ladders(slots, spec, limit, expected):
    assert bucket_capacity(slots, parse_buckets(spec), limit) == expected


@pytest.mark.parametrize("spec", ["x3", "", "1024,abc", "0,512", "-4"])
def test_bad_bucket_spec_is_one_clear_error(spec):
    with pytest.raises(KVFastError, match="--capacity-buckets must be off, x2, x4 or"):
        parse_buckets(spec)


def capacities(policy: str, prompt_len: int, buckets: str | None, **kw) -> tuple[list[int], list[int]]:
    factory = make_cache_factory(policy, 1, tiny_model().args, prompt_len, N_NEW, capacity_buckets=buckets, **kw)
    return factory.capacities, factory.prompt_capacities


def test_only_room_that_is_never_evicted_into_is_rounded_up():
    assert capacities("full", 100, "x4") == ([256, 256], [112, 112])  # the prompt's slots unchanged
    exact_caps, exact_prompt = capacities("snapkv", 400, None, budget=0.5)
    caps, prompt = capacities("snapkv", 400, "x4", budget=0.5)
    assert prompt == exact_prompt and exact_caps == [206, 206] and caps == [256, 256]
    assert capacities("h2o", 400, "x4", budget=0.5) == capacities("h2o", 400, None, budget=0.5)  # evicts: exact
    # an absolute budget the sequence fits in: rounded up, never past the budget
    assert capacities("h2o", 100, "x4", budget=200)[0] == [200, 200]
    assert capacities("h2o", 100, "x4", budget=600)[0] == [256, 256]
    assert capacities("h2o", 300, "x4", budget=200)[0] == [200, 200]  # evicts: the budget


@pytest.mark.parametrize("policy, kw, what", [
    ("h2o", {"tiers": {"warm_tokens": 1.0}}, "recall slots"), ("adakv", {"budget": 0.5}, "pool")])
def test_buckets_refuse_caches_whose_slots_are_the_budget(policy, kw, what):
    with pytest.raises(KVFastError, match=f"--capacity-buckets cannot round up .*{what}"):
        capacities(policy, 100, "x4", **kw)


@pytest.mark.parametrize("policy, budget", [("full", None), ("snapkv", 0.5), ("h2o", 600)])
def test_bucketed_tokens_equal_exact_capacity(policy, budget):
    """Extra allocated slots stay empty: greedy tokens and logits equal the exact-capacity cache."""
    model = tiny_model()
    prompt = torch.randint(0, 64, (2, 150), generator=torch.Generator().manual_seed(3))
    tokens, logits, slots = {}, {}, {}
    for buckets in (None, "x4"):
        model.setup_caches(make_cache_factory(policy, 2, model.args, 150, N_NEW, budget=budget,
                                              capacity_buckets=buckets))
        seen = logits[buckets] = []
        tokens[buckets] = generate_tokens(model, prompt, N_NEW, on_logits=lambda i, x, seen=seen: seen.append(x))
        slots[buckets] = model.caches[0].capacity
    assert slots[None] < slots["x4"] == 256  # the bucketed cache really is larger
    assert torch.equal(tokens[None], tokens["x4"])
    for a, b in zip(logits[None], logits["x4"], strict=True):
        assert_numerically_close(a, b, depth=model_depth(model.args, slots["x4"]))


@pytest.mark.parametrize("scope", ["step", "block"])
def test_ten_prompt_lengths_compile_at_most_twice(scope):
    """Ten prompt lengths in one process (one Decoder): x4 buckets give two capacities, so the decode step
    compiles twice; without buckets every length compiles its own graph (three lengths show it: each new one
    is a graph more; dynamo's recompile limit of 8 would end a tenth)."""
    model = tiny_model()
    with recorded_graphs(inductor=False):  # dynamo's graphs and recompiles are the claim, not Inductor's code
        decoder = decode.Decoder(model, compile=True, scope=scope)
    lengths = [20, 60, 110, 160, 200, 240, 300, 420, 600, 900]
    for buckets, most in (("x4", 2), (None, 3)):
        torch._dynamo.reset()
        counters.clear()
        caps = set()
        for n in lengths[: 10 if buckets else most]:
            model.setup_caches(make_cache_factory("full", 1, model.args, n, N_NEW, capacity_buckets=buckets))
            caps.add(model.caches[0].capacity)
            decoder.warm_up(torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(n)))
        assert len(caps) == most
        assert counters["stats"]["unique_graphs"] == most  # block scope too: one graph per step
        if buckets:
            assert not counters["recompiles"]  # a bucket seen before reuses its graph


DYNAMIC_CASES = [("full", None, {}), ("snapkv", 0.5, {}), ("h2o", 0.5, {}), ("scissorhands", 0.5, {}),
                 ("tova", 0.5, {"kv_bits": 4})]
# block scope: the layer function with a symbolic capacity, without eviction, with a history (scissorhands) and
# with 4-bit K/V; h2o's second graph under block scope is test_dynamic_capacity_gives_one_block_graph_for_pyramid_layers's
BLOCK_CASES = [case for case in DYNAMIC_CASES if case[0] in ("full", "scissorhands", "tova")]


@pytest.mark.parametrize("scope, policy, budget, kw", [("step", *case) for case in DYNAMIC_CASES]
                         + [("block", *case) for case in BLOCK_CASES])
def test_dynamic_capacity_compiles_once_for_every_prompt_length(scope, policy, budget, kw):
    """--dynamic-capacity: ten prompt lengths (ten capacities) in one Decoder compile each function at most
    twice (once more where a capacity-derived int or queue changes: dynamo then makes it dynamic too), and
    the compiled tokens equal eager decoding at lengths the graph was not compiled for."""
    model = tiny_model()
    counters.clear()
    decode.configure_torch(compile=True, dynamic_capacity=True)
    decoder = decode.Decoder(model, compile=True, scope=scope, dynamic_capacity=True)
    functions = 1  # the step (block scope too); scissorhands' refresh runs eagerly (compile_refresh)
    lengths = [100, 115, 130, 150, 170, 190, 210, 230, 260, 300]
    caps = set()
    for i, n in enumerate(lengths):
        factory = partial(make_cache_factory, policy, 2, model.args, n, N_NEW, budget=budget, **kw)
        prompt = torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(n))
        model.setup_caches(factory())
        caps.add(model.caches[0].capacity)
        decoder.warm_up(prompt)
        if i in (0, 5, 9):
            compiled = generate_tokens(model, prompt, N_NEW, decoder)
            model.setup_caches(factory())
            assert torch.equal(compiled, generate_tokens(model, prompt, N_NEW)), n
    assert len(caps) == len(lengths)
    most = functions if policy in ("full", "snapkv") else 2 * functions
    assert functions <= counters["stats"]["unique_graphs"] <= most, dict(counters["recompiles"])


def test_generate_cli_reports_buckets_and_rejects_bad_ones(tmp_path, capsys):
    from conftest import save_tiny_hf
    from test_generate import run_cli

    from scripts.convert_hf_checkpoint import convert_hf_checkpoint

    hf = tmp_path / "hf"
    hf.mkdir()
    save_tiny_hf(hf, tie=True, rope_scaling=False)
    ckpt = convert_hf_checkpoint(hf, tmp_path / "tiny")
    base = ["--checkpoint", str(ckpt), "--prompt", "Hello there", "--max-new-tokens", "4", "--temperature", "0"]
    code, out, err = run_cli(capsys, *base, "--capacity-buckets", "x4")
    assert code == 0, err
    assert "(allocated in --capacity-buckets x4)" in out
    code, out, err = run_cli(capsys, *base, "--compile", "--dynamic-capacity")
    assert code == 0, err
    assert "dynamic capacity" in out
    code, _, err = run_cli(capsys, *base, "--dynamic-capacity")
    assert code == 2 and "--dynamic-capacity needs --compile" in err
    code, _, err = run_cli(capsys, *base, "--capacity-buckets", "x3")
    assert code == 2 and err.strip().count("\n") == 0 and "--capacity-buckets must be" in err


@pytest.mark.parametrize("policy", ["pyramidkv", "h2o"])
def test_dynamic_capacity_gives_one_block_graph_for_pyramid_layers(policy):
    """--compile-scope block with a pyramid schedule: every layer has its own capacity, so the step runs each
    layer through a compiled layer function (generate.LayerwiseStep): static shapes compile it per layer, a
    dynamic capacity once or twice for all of them."""
    model = tiny_model(n_layers=4)
    prompt = torch.randint(0, 64, (1, 200), generator=torch.Generator().manual_seed(5))
    factory = partial(make_cache_factory, policy, 1, model.args, 200, N_NEW, budget=0.3, layer_budget="pyramid")
    model.setup_caches(factory())
    assert len({c.capacity for c in model.caches}) == 4
    eager = generate_tokens(model, prompt, N_NEW)
    graphs = {}
    for dynamic in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model.setup_caches(factory())
        decode.configure_torch(compile=True, dynamic_capacity=dynamic)
        decoder = decode.Decoder(model, compile=True, scope="block", dynamic_capacity=dynamic)
        assert torch.equal(generate_tokens(model, prompt, N_NEW, decoder), eager)
        graphs[dynamic] = counters["stats"]["unique_graphs"] - 1  # less the head's graph
    # h2o: a second graph, where the first layer's recent window (an int) met another and became symbolic
    assert graphs[False] == 4 and graphs[True] == (1 if policy == "pyramidkv" else 2)
