"""Self-speculative decoding (speculate.py): greedy output is plain decoding's, eager and compiled, without
recompiles; the acceptance rule samples from the full cache's distribution; the full cache's multi-token
step equals one token at a time; truncate forgets exactly the rejected positions; bad flags are one line."""

import pytest
import torch
from cache_testing import generate_tokens, single_thread_fixture, small_params, tiny_model
from numerics import assert_numerically_close, model_depth
from torch._dynamo.utils import counters

import generate
from cache import make_cache_factory
from decode import Decoder
from model import KVFastError
from speculate import Speculator, absorb_token, accept

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)

PROMPT, NEW = 40, 48


def speculative_tokens(model, prompt, k: int, draft: str, decoder: Decoder, budget: int = 16):
    """Prefill both caches, then NEW - 1 greedy tokens through draft-and-verify rounds; [1, NEW] and the
    Speculator."""
    drafts = make_cache_factory(draft, 1, model.args, PROMPT, NEW + k, budget=budget, **small_params(draft))
    spec = Speculator(model, decoder, [drafts(i) for i in range(model.args.n_layers)], k)
    spec.reset()
    with torch.inference_mode():
        first = spec.prefill(model, prompt, 0.0, None)
        rest = spec.decode(first, PROMPT, NEW - 1)
    return torch.cat([first, rest], 1), spec


@pytest.mark.parametrize("k, draft, budget", [(1, "window", 16), (3, "h2o", 16), (5, "window", 36),
                                               (3, "window", PROMPT + NEW + 3), (4, "h2o", PROMPT + NEW + 4)])
def test_greedy_speculation_is_plain_decoding(k, draft, budget):
    model = tiny_model()
    prompt = torch.randint(0, 64, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    model.setup_caches(make_cache_factory("full", 1, model.args, PROMPT, NEW + k))
    plain = generate_tokens(model, prompt, NEW)
    tokens, spec = speculative_tokens(model, prompt, k, draft, Decoder(model), budget)
    assert torch.equal(tokens, plain)
    if budget >= PROMPT + NEW:  # the draft evicts nothing: it is the full cache, so every draft is accepted
        # (and keeps being: after a fully accepted round the draft reads its own last token)
        assert spec.accepted == spec.drafted and spec.rounds == -(-(NEW - 1) // (k + 1))
    else:  # this chaotic tiny model answers differently from a compressed cache: mostly rejected
        assert spec.accepted < spec.drafted and spec.rounds == NEW - 1 - spec.accepted
    # the full cache holds the prompt and every decided token at its own position, nothing past them
    for cache in model.caches:
        seen = cache.tokens_seen()
        assert PROMPT + NEW - 1 <= seen <= PROMPT + NEW - 1 + k
        assert sorted(cache.slot_pos[0, 0][cache.slot_pos[0, 0] >= 0].tolist()) == list(range(seen))


def compiled_speculation(spec: Speculator, model, prompt) -> torch.Tensor:
    """Warm up, then speculate NEW greedy tokens, asserting nothing compiles after the warm-up; [1, NEW]."""
    spec.warm_up(prompt)
    graphs = counters["stats"]["unique_graphs"]
    spec.reset()
    with torch.inference_mode():
        first = spec.prefill(model, prompt, 0.0, None)
        tokens = torch.cat([first, spec.decode(first, PROMPT, NEW - 1)], 1)
    assert counters["stats"]["unique_graphs"] == graphs, "compiled again after the warm-up"
    assert sum(counters["recompiles"].values()) == 0
    return tokens


@pytest.mark.parametrize("scope", ["step", "block"])
def test_compiled_speculation_matches_eager_without_recompiling(scope):
    torch._dynamo.reset()
    model = tiny_model()
    prompt = torch.randint(0, 64, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    model.setup_caches(make_cache_factory("full", 1, model.args, PROMPT, NEW + 3))
    eager, _ = speculative_tokens(model, prompt, 3, "h2o", Decoder(model))
    drafts = make_cache_factory("h2o", 1, model.args, PROMPT, NEW + 3, budget=16, **small_params("h2o"))
    spec = Speculator(model, Decoder(model, compile=True, scope=scope),
                      [drafts(i) for i in range(model.args.n_layers)], 3)
    assert torch.equal(compiled_speculation(spec, model, prompt), eager)


def test_full_cache_verifies_a_chunk_as_one_token_at_a_time():
    model = tiny_model()
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(4))
    model.setup_caches(make_cache_factory("full", 1, model.args, 16, 8))
    with torch.inference_mode():
        model(ids[:, :16])
        one = torch.cat([model(ids[:, t : t + 1], torch.tensor([t])) for t in range(16, 24)], 1)
        for c in model.caches:
            c.truncate(16)
        chunk = model(ids[:, 16:], torch.arange(16, 24), all_logits=True)
    assert_numerically_close(chunk, one, depth=model_depth(model.args, 24))


def test_truncate_forgets_exactly_the_later_positions():
    model = tiny_model()
    cache = make_cache_factory("h2o", 1, model.args, 20, 10, budget=12, **small_params("h2o"))(0)
    cache.slot_pos.copy_(torch.tensor([0, 1, 7, 9, 12, 15, 16, 3, 18, 19, -1, -1]).expand_as(cache.slot_pos))
    cache.truncate(16)
    assert cache.slot_pos[0, 0].tolist() == [0, 1, 7, 9, 12, 15, -1, 3, -1, -1, -1, -1]
    assert cache.tokens_seen() == 16


def test_acceptance_rule_samples_the_target_distribution():
    """Draft from q, accept with min(1, p/q), resample from max(0, p - q): the first token is distributed as p."""
    torch.manual_seed(0)
    V, trials = 5, 40000
    p_logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
    q = torch.softmax(torch.tensor([0.0, 2.0, 0.0, 1.0, -1.0]), -1)
    logits = p_logits.expand(2, V)  # K = 1: the target's distribution for the draft and for the bonus
    counts = torch.zeros(V)
    for _ in range(trials):
        d = torch.multinomial(q, 1)
        n, following = accept(d, q.view(1, V), logits, 1.0, None)
        counts[int(d) if n == 1 else following] += 1
    p = torch.softmax(p_logits, -1)
    assert (counts / trials - p).abs().max() < 0.01, (counts / trials, p)


def test_greedy_acceptance_counts_the_matching_prefix():
    logits = torch.full((4, 8), -5.0)
    logits[torch.arange(4), torch.tensor([3, 1, 6, 2])] = 5.0
    assert accept(torch.tensor([3, 1, 0]), None, logits, 0.0, None) == (2, 6)
    assert accept(torch.tensor([3, 1, 6]), None, logits, 0.0, None) == (3, 2)
    assert accept(torch.tensor([0, 1, 6]), None, logits, 0.0, None) == (0, 3)


@pytest.mark.parametrize("flags, message", [
    (["--speculate", "0"], "--speculate must be >= 1"),
    (["--speculate", "4", "--cache", "h2o"], "--speculate decodes one row with --cache full"),
    (["--speculate", "4", "--batch-size", "2"], "--speculate decodes one row"),
    (["--speculate", "4", "--draft-cache", "full"], "--draft-cache must be an evicting policy"),
    (["--speculate", "4", "--draft-cache", "nope"], "--draft-cache must be an evicting policy"),
    (["--draft-budget", "0.1"], "--draft-budget needs --speculate"),
])
def test_bad_speculation_flags_are_one_line(tiny_checkpoint, capsys, flags, message):
    code = generate.cli(["--checkpoint", str(tiny_checkpoint), "--max-new-tokens", "4", *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_cli_speculates(tiny_checkpoint, capsys):
    argv = ["--checkpoint", str(tiny_checkpoint), "--prompt", "Hello there " * 12, "--max-new-tokens", "24",
            "--temperature", "0", "--ignore-eos"]
    assert generate.cli(argv) == 0
    plain = capsys.readouterr().out.split("-" * 40)[0]
    assert generate.cli([*argv, "--speculate", "3", "--draft-budget", "0.5"]) == 0
    out = capsys.readouterr().out
    assert out.split("-" * 40)[0] == plain
    assert "speculate: 3 drafts per round through window" in out


def test_speculator_refuses_a_compressed_target():
    model = tiny_model()
    model.setup_caches(make_cache_factory("h2o", 1, model.args, 20, 10, budget=12, **small_params("h2o")))
    with pytest.raises(KVFastError, match="verifies with the full cache"):
        Speculator(model, Decoder(model), list(model.caches), 2)


@pytest.mark.parametrize("kv", [{}, {"kv_bits": 16, "kv_float": "bfloat16"}, {"kv_bits": 8}])
def test_compiled_speculation_absorbs_accepted_drafts_without_recompiling(kv):
    """A draft cache in the same K/V format that evicts nothing accepts every draft, so every round ends by taking
    dK's K/V from the full cache (absorb_token) instead of a draft step; compiled (block scope), with the full
    cache in fp32, bfloat16 (its verification's bfloat16 matmuls round as the one-query steps do) or 8-bit codes,
    the tokens are plain compiled decoding's and nothing compiles after the warm-up."""
    torch._dynamo.reset()
    model = tiny_model()
    prompt = torch.randint(0, 64, (1, PROMPT), generator=torch.Generator().manual_seed(6))
    model.setup_caches(make_cache_factory("full", 1, model.args, PROMPT, NEW + 3, **kv))
    decoder = Decoder(model, compile=True, scope="block")
    plain = generate_tokens(model, prompt, NEW, decoder)
    drafts = make_cache_factory("window", 1, model.args, PROMPT, NEW + 3, budget=PROMPT + NEW + 3, **kv)
    spec = Speculator(model, decoder, [drafts(i) for i in range(model.args.n_layers)], 3)
    assert torch.equal(compiled_speculation(spec, model, prompt), plain)
    assert spec.accepted == spec.drafted and spec.rounds > 2  # rounds past the guarded two are guard-free


def test_absorb_token_hands_the_full_caches_kv_to_the_draft():
    model = tiny_model()
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(7))
    model.setup_caches(make_cache_factory("full", 1, model.args, 20, 4, kv_bits=8))
    drafts = make_cache_factory("window", 1, model.args, 20, 4, n_sinks=2, recent_window=6)
    draft = [drafts(i) for i in range(model.args.n_layers)]
    with torch.inference_mode():
        model(ids)
        absorb_token(model.caches, draft, torch.tensor([13]))
    for full, small in zip(model.caches, draft):
        slot = small.slot_pos[0, 0].tolist().index(13)
        k, v = full.token_kv(torch.tensor([13]))
        stored = full.keys_values()
        assert torch.equal(k[0, :, 0], stored[0][0, :, 13]) and torch.equal(v[0, :, 0], stored[1][0, :, 13])
        assert torch.equal(small.k[0, :, slot], k[0, :, 0]) and torch.equal(small.v[0, :, slot], v[0, :, 0])
        assert small.tokens_seen() == 14
