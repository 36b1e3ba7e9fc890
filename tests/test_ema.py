"""The ema policy (Adaptive KV's attention utility, kv.policies.EMACache): decode choices against a slow
reference over token positions; the prompt utilities against the EMA run token by token over the dense prompt
attention, and against decoding the prompt's last token; the cache through the tiny model, compiled == eager
without recompiling."""

import math

import pytest
import torch
from cache_testing import (
    generate_tokens,
    single_thread_fixture,
    small_factory,
    tiny_args,
    tiny_model,
    within_memory,
)
from test_cache_reference import H_KV, B, D, G, decode_trace, dense_attention, positions, random_qkv
from torch._dynamo.utils import counters

from attention import attend
from cache import make_cache_factory
from decode import Decoder
from kv.slots import reduce_groups

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)
SMALL_EMA = {"obs_window": 4, "pool_kernel": 3}  # snapkv prompt compression at a few dozen tokens


def ema_cache(S, steps, budget, **params):
    args = tiny_args(n_layers=1, n_heads=H_KV * G, n_kv_heads=H_KV, head_dim=D)
    return make_cache_factory("ema", B, args, S, steps, budget=budget, **SMALL_EMA, **params)(0)


def token_by_token(q, k, beta, reduce):
    """The EMA run as decoding runs it, over the whole prompt: token i enters at 1.0, then query i updates
    every token up to i with its dense causal attention (group-reduced). [B, H_kv, S], float64."""
    a = reduce_groups(dense_attention(q, k).double(), reduce)  # [B, H_kv, S (query), S (key)]
    u = torch.zeros(a.shape[:2] + a.shape[3:], dtype=torch.float64)
    for i in range(a.shape[2]):
        u[..., i] = 1.0
        u[..., : i + 1] = beta * u[..., : i + 1] + (1 - beta) * a[:, :, i, : i + 1]
    return u


# ---- prefill -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("beta,reduce", [(0.9, "mean"), (0.5, "max"), (0.0, "mean"), (1.0, "mean")])
def test_prompt_utility_equals_the_ema_token_by_token(beta, reduce):
    """S = 40 (every query computed): the kept tokens' utilities, uncompressed and compressed, equal the EMA run
    token by token over the dense S x S attention."""
    S = 40
    q, k, v = random_qkv(S, 21)
    expected = token_by_token(q, k, beta, reduce)
    for budget in (S + 8, 12):  # fits (empty slots left) / compressed by snapkv
        cache = ema_cache(S, 8, budget, recent_window=3, ema_beta=beta, gqa_reduce=reduce)
        cache.prefill(q, k, v)
        n = min(S, budget)
        kept = cache.slot_pos[..., :n]
        assert (kept >= 0).all()
        torch.testing.assert_close(cache.utility[..., :n].double(), expected.gather(-1, kept), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("beta", [0.9, 0.97])
def test_prompt_utility_truncated_to_the_last_queries(beta):
    """S = 300: beta 0.9 reads only the last 256 queries (the rest weigh beta^256 ~ 2e-12 in all); beta 0.97
    (0.97^256 ~ 4e-4) looks further back. Both within fp32 noise of the full EMA."""
    S = 300
    q, k, v = random_qkv(S, 22)
    cache = ema_cache(S, 4, S + 4, recent_window=3, ema_beta=beta)
    cache.prefill(q, k, v)
    torch.testing.assert_close(cache.utility[..., :S].double(), token_by_token(q, k, beta, "mean"),
                               atol=1e-6, rtol=1e-5)


def test_prompt_utility_follows_the_decode_rule():
    """Prefilling S - 1 tokens and decoding the S-th (insert at 1.0, attend, observe) gives every token the
    utility a prefill of all S gives it: prompt and decoded tokens are judged by one rule."""
    S = 30
    q, k, v = random_qkv(S, 23)
    for reduce in ("mean", "max"):
        whole = ema_cache(S, 4, S + 4, recent_window=3, gqa_reduce=reduce)
        whole.prefill(q, k, v)
        stepped = ema_cache(S, 4, S + 4, recent_window=3, gqa_reduce=reduce)
        stepped.prefill(q[:, :, : S - 1], k[:, :, : S - 1], v[:, :, : S - 1])
        k_all, v_all, mask = stepped.update(torch.tensor([S - 1]), k[:, :, S - 1:], v[:, :, S - 1:])
        _, probs = attend(q[:, :, S - 1:], k_all, v_all, mask, want_probs=True)
        stepped.observe(probs)
        assert torch.equal(stepped.slot_pos, whole.slot_pos)
        torch.testing.assert_close(stepped.utility[..., :S], whole.utility[..., :S], atol=1e-6, rtol=1e-5)


def test_prompt_utility_memo_is_keyed_by_beta_and_reduce():
    """One memo (sample, layer) shared by ema caches of different beta / gqa_reduce: each gets its own."""
    S = 24
    q, k, v = random_qkv(S, 24)
    memo: dict = {}
    for beta, reduce in [(0.9, "mean"), (0.5, "mean"), (0.9, "max"), (0.9, "mean")]:
        cache = ema_cache(S, 4, S + 4, recent_window=3, ema_beta=beta, gqa_reduce=reduce)
        cache.prefill(q, k, v, memo)
        torch.testing.assert_close(cache.utility[..., :S].double(), token_by_token(q, k, beta, reduce),
                                   atol=1e-6, rtol=1e-5)
    assert sum(1 for key in memo if key[0] == "ema_utility") == 3


# ---- decode ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("S,n_sinks,recent,reduce", [(20, 0, 1, "mean"), (20, 2, 3, "max"), (5, 1, 2, "mean"),
                                                     (30, 1, 2, "max")])
def test_decode_matches_slow_reference(S, n_sinks, recent, reduce):
    """The policy as stated, over token positions, per row and KV head: a utility per kept token (the prompt's
    from the EMA over the prompt's queries); each step, if the cache is full, the evictable token (not a sink,
    older than the recent window) with the lowest utility leaves; the new token enters at 1.0; then every
    kept token's utility becomes beta u + (1 - beta) a, a = the new query's attention on it reduced over the
    group. Attention is continuous and random, so there are no ties."""
    C, steps, beta = 10, 40, 0.8
    cache = ema_cache(S, steps, C, n_sinks=n_sinks, recent_window=recent, ema_beta=beta, gqa_reduce=reduce)
    q, k, v = random_qkv(S, 25)
    cache.prefill(q, k, v)
    prompt = token_by_token(q, k, beta, reduce)
    refs = {(b, h): {p: prompt[b, h, p].item() for p in positions(cache, b, h)}
            for b in range(B) for h in range(H_KV)}
    evictions, not_oldest, differ = 0, 0, False
    for t, probs, _ in decode_trace(cache, S, steps, 26):
        a = reduce_groups(probs[:, :, :, 0], reduce)
        for (b, h), u in refs.items():
            if len(u) == C:
                evictable = [i for i in u if n_sinks <= i <= t - recent]
                victim = min(evictable, key=u.get)
                del u[victim]
                evictions, not_oldest = evictions + 1, not_oldest + (victim != min(evictable))
            u[t] = 1.0
            slots = cache.slot_pos[b, h].tolist()
            assert positions(cache, b, h) == set(u), f"step {t}: kept sets differ"
            for c, p in enumerate(slots):
                if p >= 0:
                    u[p] = beta * u[p] + (1 - beta) * a[b, h, c].item()
                    assert cache.utility[b, h, c].item() == pytest.approx(u[p], rel=1e-4, abs=1e-6)
        differ |= len({frozenset(u) for u in refs.values()}) > 1
    assert evictions > steps  # most steps really evicted, in every row and head
    assert not_oldest > 0  # utility, not age, chose (not a FIFO in disguise)
    assert differ  # rows and heads chose on their own


# ---- through the model ---------------------------------------------------------------------------------------
def test_compiled_matches_eager_without_recompiling():
    """The tiny model with a cache of 16 slots per layer (evicting at almost every step): 200 compiled decode
    steps give eager's tokens, and the step compiles once."""
    torch._dynamo.reset()
    model = tiny_model()
    prompt = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(3))
    n_new, warmup = 201, 4
    model.setup_caches(small_factory("ema", 2, model.args, 24, n_new, gqa_reduce="max", ema_beta=0.7))
    eager = generate_tokens(model, prompt, n_new)
    graphs = {}

    def after_warmup(step, logits):
        if step == warmup:
            graphs["warm"] = (counters["stats"]["unique_graphs"], sum(counters["recompiles"].values()))

    compiled = generate_tokens(model, prompt, n_new, Decoder(model, compile=True), on_logits=after_warmup)
    assert (counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())) == graphs["warm"]
    assert torch.equal(compiled, eager)
    assert len(set(eager[0].tolist())) > 5
    assert all(within_memory(c) for c in model.caches)
    assert all(math.isfinite(x) for c in model.caches for x in c.utility.flatten().tolist())
