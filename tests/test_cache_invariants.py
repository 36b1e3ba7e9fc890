"""Invariants of every registered policy, property-tested over budgets, sinks, windows, GQA shapes, lengths
and prompt compressors: never more valid slots than the capacity (and no empty slot once full), sinks and the
recent window always present, positions unique and <= the current one; with capacity >= the sequence the
logits equal the full cache's exactly; each row of a batch evicts on its own."""

import pytest
import torch
from cache_testing import (
    head_positions,
    single_thread_fixture,
    tiny_args,
    tiny_model,
    used_params,
    within_memory,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numerics import assert_numerically_close, model_depth

from attention import attend
from cache import POLICIES, PROMPT_COMPRESSORS, make_cache_factory
from decode import Decoder, prefill
from kv.policies import FullCache
from kv.pool import PoolCache

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def configs(draw, policy: str):
    """A valid configuration of `policy`: shapes, lengths, compressor, hyper-parameters and a budget."""
    cls = POLICIES[policy]
    compressor = None if policy == "full" else draw(st.sampled_from([None, *PROMPT_COMPRESSORS]))
    used = used_params(policy, compressor)
    p = {}
    if "n_sinks" in used:
        p["n_sinks"] = draw(st.integers(0, 3))
    if "recent_window" in used and not cls.window_fills_capacity:
        p["recent_window"] = draw(st.integers(1, 6))
    if "history_window" in used:
        p["history_window"] = draw(st.integers(1, 12))
    if "obs_window" in used:
        p["obs_window"] = draw(st.integers(1, 6))
    if "pool_kernel" in used:
        p["pool_kernel"] = draw(st.sampled_from([1, 3, 5]))
    if "pool" in used:
        p["pool"] = draw(st.sampled_from(["max", "avg"]))
    if "gqa_reduce" in used:
        p["gqa_reduce"] = draw(st.sampled_from(["mean", "max"]))
    if "h2o_normalize" in used:
        p["h2o_normalize"] = draw(st.booleans())
    if "adakv_floor" in used:
        p["adakv_floor"] = draw(st.sampled_from([0.0, 0.2, 0.5, 1.0]))
    if "adakv_normalize" in used:
        p["adakv_normalize"] = draw(st.booleans())
    prompt_len, steps = draw(st.integers(1, 40)), draw(st.integers(1, 30))
    sinks, recent, window = p.get("n_sinks", 0), p.get("recent_window", 1), p.get("obs_window", 0)
    if policy == "full":
        budget = None
    elif cls.evicts:
        least = sinks + max(recent, window) + 1
        budget = draw(st.integers(least, max(least, prompt_len + steps + 4)))
    else:
        least = max(sinks + window, 1)
        budget = steps + draw(st.integers(least, max(least, prompt_len + 4)))
    if "drop_interval" in used:
        room = min(budget, prompt_len + steps) - sinks - recent + 1
        p["drop_interval"] = draw(st.integers(1, max(1, room)))
    shape = {"batch": draw(st.integers(1, 2)), "n_kv": draw(st.integers(1, 2)), "g": draw(st.integers(1, 3)),
             "head_dim": draw(st.sampled_from([4, 8]))}
    return {"shape": shape, "prompt_len": prompt_len, "steps": steps, "budget": budget,
            "compressor": compressor, "params": p, "seed": draw(st.integers(0, 2**16))}


def check(cache, t: int, after_prefill: bool = False) -> None:
    """Invariants after the token at position t was written (or the prompt 0..t at prefill)."""
    kept = cache.kept()
    assert within_memory(cache)
    window = cache.recent_window - (1 if after_prefill else 0)  # prefill: the next token completes it
    must = set(range(min(cache.n_sinks, t + 1))) | set(range(max(0, t - window + 1), t + 1))
    for row in head_positions(cache):
        for pos in row:
            assert len(pos) == len(set(pos)), "a position is cached twice"
            assert all(0 <= p <= t for p in pos)  # a pool head may hold nothing (adakv, floor 0, no window)
            assert must <= set(pos), f"protected positions {sorted(must - set(pos))} missing"
    if isinstance(cache, PoolCache):  # H_kv in, H_kv out across the heads: no empty slot once full
        assert (kept.sum(-1) == min((t + 1) * cache.n_kv_heads, cache.pool_size)).all()
    elif cache.evicts:  # one in, one out: no empty slot once full
        assert (kept == min(t + 1, cache.capacity)).all()


@pytest.mark.parametrize("policy", list(POLICIES))
@SETTINGS
@given(data=st.data())
def test_cache_invariants(policy, data):
    cfg = data.draw(configs(policy))
    sh, S = cfg["shape"], cfg["prompt_len"]
    args = tiny_args(n_layers=1, n_heads=sh["n_kv"] * sh["g"], n_kv_heads=sh["n_kv"], head_dim=sh["head_dim"])
    cache = make_cache_factory(policy, sh["batch"], args, S, cfg["steps"], budget=cfg["budget"],
                               prompt_compression=cfg["compressor"], **cfg["params"])(0)
    gen = torch.Generator().manual_seed(cfg["seed"])
    B, H, Hkv, D = sh["batch"], args.n_heads, args.n_kv_heads, args.head_dim

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = randn(B, H, S, D), randn(B, Hkv, S, D)
    memo = {}
    if getattr(cache.compressor, "needs_model_pass", False):  # KVzip: random stand-ins for its model pass
        memo[cache.compressor.memo_key()] = randn(B, Hkv, S)
    cache.prefill(q, k, randn(B, Hkv, S, D), memo=memo)
    check(cache, S - 1, after_prefill=True)
    if S > cache.prompt_capacity and cache.compressor.window:  # SnapKV's observation window is kept
        window = set(range(S - cache.compressor.window, S))
        assert all(window <= set(head) for row in head_positions(cache) for head in row)
    for t in range(S, S + cfg["steps"]):
        if cache.refresh_interval and t % cache.refresh_interval == 0:  # as decode.Decoder does
            cache.refresh()
        k_all, v_all, mask = cache.update(torch.tensor([t]), randn(B, Hkv, 1, D), randn(B, Hkv, 1, D))
        _, probs = attend(randn(B, H, 1, D), k_all, v_all, mask, want_probs=cache.needs_attention,
                          layout=cache.layout)
        if probs is not None:
            cache.observe(probs)
        check(cache, t)
    assert cache.tokens_seen() == S + cfg["steps"]


class FullWithProbs(FullCache):
    """The full cache on the explicit-probabilities attention path, the exact reference for policies on it."""

    needs_attention = True


@pytest.mark.parametrize("policy", list(POLICIES))
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n_kv=st.integers(1, 2), g=st.integers(1, 2), prompt_len=st.integers(1, 20), steps=st.integers(1, 12),
       n_sinks=st.integers(0, 2), seed=st.integers(0, 100))
def test_no_compression_equals_full_exactly(policy, n_kv, g, prompt_len, steps, n_sinks, seed):
    model = tiny_model(seed, n_layers=2, n_heads=n_kv * g, n_kv_heads=n_kv)
    B, total = 2, prompt_len + steps
    tokens = torch.randint(0, 64, (B, total + 1), generator=torch.Generator().manual_seed(seed))
    params = {"n_sinks": n_sinks} if "n_sinks" in POLICIES[policy].params else {}
    if "recent_window" in POLICIES[policy].params and not POLICIES[policy].window_fills_capacity:
        params["recent_window"] = 1
    budget = None if policy == "full" else 10 * total  # clamped to the sequence: nothing is ever evicted

    def logits_with(make_cache):
        model.setup_caches(make_cache)
        seen = []
        with torch.inference_mode():
            seen.append(model(tokens[:, :prompt_len]))
            Decoder(model).decode(tokens[:, prompt_len:prompt_len + 1], prompt_len, steps,
                                  forced=tokens[:, prompt_len + 1:],
                                  on_logits=lambda i, logits: seen.append(logits))
        return torch.cat(seen, dim=1)

    factory = make_cache_factory(policy, B, model.args, prompt_len, steps, budget=budget, **params)
    assert all(c == total for c in factory.capacities)
    ours = logits_with(factory)
    a = model.args
    reference_cls = FullWithProbs if POLICIES[policy].needs_attention else FullCache
    reference = logits_with(lambda _: reference_cls(B, a.n_kv_heads, a.head_dim, total, n_groups=a.n_groups))
    if issubclass(POLICIES[policy], PoolCache):  # one product over the pool sums in another order: rounding,
        # which grows over the decode steps like SDPA's below (hypothesis found 1.5e-5 on a fastgen logit)
        assert torch.equal(ours.argmax(-1), reference.argmax(-1))
        assert_numerically_close(ours, reference, depth=model_depth(a, total))
    else:
        assert torch.equal(ours, reference)
    plain = logits_with(make_cache_factory("full", B, model.args, prompt_len, steps))
    # SDPA vs explicit softmax: rounding only, which grows over 12 decode steps (hypothesis found 1.4e-5 on a logit)
    assert_numerically_close(ours, plain, depth=model_depth(a, total))


@pytest.mark.parametrize("policy", [p for p, cls in POLICIES.items() if not cls.position_only])
def test_rows_evict_independently(policy):
    """Two rows with different prompts keep different tokens, each exactly what it keeps when run alone."""
    model = tiny_model(3)
    S, steps, kept = 30, 20, 12
    tokens = torch.randint(0, 64, (2, S + steps), generator=torch.Generator().manual_seed(5))
    params = {k: v for k, v in {"n_sinks": 1, "recent_window": 3, "history_window": 8, "drop_interval": 4,
                                "obs_window": 3, "pool_kernel": 3}.items() if k in used_params(policy)}
    budget = kept + steps if not POLICIES[policy].evicts else kept

    def kept_positions(rows):
        factory = make_cache_factory(policy, len(rows), model.args, S, steps, budget=budget, **params)
        model.setup_caches(factory)
        with torch.inference_mode():
            prefill(model, tokens[rows, :S], 0.0, None)  # kvzip: with its reconstruction pass
            Decoder(model).decode(tokens[rows, S:S + 1], S, steps - 1, forced=tokens[rows, S + 1:])
        return [[sorted(head) for head in row] for c in model.caches for row in head_positions(c)]

    both = kept_positions([0, 1])
    n_layers = len(model.caches)
    by_row = [[both[layer * 2 + row] for layer in range(n_layers)] for row in range(2)]
    assert by_row[0] != by_row[1], "rows with different attention kept the same tokens"
    # random draws per (layer, row, head): a row alone is row 0, so only row 0 can be compared there
    for row in [0] if policy == "random" else [0, 1]:
        assert by_row[row] == kept_positions([row]), f"row {row} kept other tokens than when run alone"


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("layout", ["slots", "pool", "strided view"])
def test_put_rows_writes_exactly_the_rows_scatter_would(layout, compiled):
    """kv.storage.put_rows (the decode write: in place, never a copy of the whole buffer) == scatter_ along the slot
    dimension, for the uniform layout [B, H, C, W], the pool [B, P, W], a strided view (eval's MultiCache) and a
    row shape of two dims (warm pages [B, H, pages, P, W])."""
    from kv.storage import put_rows

    g = torch.Generator().manual_seed(0)
    shapes = {"slots": ((2, 3, 10, 4), 2), "pool": ((2, 12, 4), 3), "strided view": ((2, 3, 16, 4), 2)}
    shape, n = shapes[layout]
    base = torch.randn(shape, generator=g)
    outside = base[:, :, 10:].clone()
    buffer = base[:, :, :10] if layout == "strided view" else base
    lead = buffer.shape[:-2]
    slot = torch.stack([torch.randperm(buffer.shape[-2], generator=g)[:n] for _ in range(lead.numel())]).view(*lead, n)
    value = torch.randn(*lead, n, buffer.shape[-1], generator=g)
    expected = buffer.clone().scatter_(len(lead), slot.unsqueeze(-1).expand(value.shape), value)
    write = torch.compile(put_rows, fullgraph=True) if compiled else put_rows
    write(buffer, slot, value)
    assert torch.equal(buffer, expected)
    if layout == "strided view":
        assert torch.equal(base[:, :, 10:], outside)  # nothing outside the view
    pages = torch.randn(2, 3, 5, 4, 4, generator=g)  # a row of [P, W]
    at = torch.tensor([[[1], [4], [0]], [[2], [2], [3]]])
    page = torch.randn(2, 3, 1, 4, 4, generator=g)
    expected = pages.clone().scatter_(2, at.view(2, 3, 1, 1, 1).expand(page.shape), page)
    write(pages, at, page)
    assert torch.equal(pages, expected)
