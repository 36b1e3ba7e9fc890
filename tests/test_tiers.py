"""Tiers (kv.tiers): every token is in exactly one tier or counted cold, recall installs Quest's top pages and
never a hot token, counters equal an independent count, warm pages hold the tokens quantized once, compiled
== eager without recompiles, and bad tier flags fail in one line."""

import math

import pytest
import torch
from cache_testing import (
    generate_tokens,
    recorded_graphs,
    single_thread_fixture,
    tiny_args,
    tiny_model,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor

import generate
from attention import attend
from cache import make_cache_factory
from decode import Decoder
from kv.quant import dequantize_channels, dequantize_tokens, quantize_channels, quantize_tokens, storage_width
from kv.tiers import tier_report
from model import KVFastError

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)
B, H_KV, G, D = 2, 2, 2, 8
POLICY_PARAMS = {
    "h2o": {"n_sinks": 1, "recent_window": 3},
    "window": {"n_sinks": 2},
    "scissorhands": {"recent_window": 3, "history_window": 8, "drop_interval": 2, "obs_window": 3},
    "tova": {"recent_window": 2},
    "knorm": {"recent_window": 2},
    "random": {"n_sinks": 1, "recent_window": 2},
    "snapkv": {"obs_window": 3},
    "hybrid": {"n_sinks": 1, "recent_window": 3, "obs_window": 3},  # the pool (kv.pool): its own budget per head
}


def managed_positions(c) -> list[list[list[int]]]:
    """Per (row, KV head), the positions in the policy's slots (not the recall slots), either layout."""
    if c.layout == "uniform":
        return [[[p for p in h.tolist() if p >= 0] for h in row] for row in c.slot_pos[..., : c.capacity - c.recall_slots]]
    pos, head = c.slot_pos[:, : c.policy_pool], c.slot_head[:, : c.policy_pool]
    return [[[p for p, o in zip(pos[b].tolist(), head[b].tolist()) if p >= 0 and o == h] for h in range(H_KV)]
            for b in range(B)]


def tier_cache(policy: str, S: int, steps: int, budget: int, *, page: int = 4, recall: int = 8,
               warm: float = 1.0, bits: int | None = None, kv_bits: int | None = None, layer: int = 0,
               installs: int | None = None):
    args = tiny_args(n_heads=H_KV * G, n_kv_heads=H_KV, head_dim=D)
    tiers = {"warm_tokens": warm, "page_size": page, "recall_slots": recall, "warm_bits": bits,
             "recall_installs": installs}
    f = make_cache_factory(policy, B, args, S, steps, budget=budget, kv_bits=kv_bits,
                           tiers={k: v for k, v in tiers.items() if v is not None}, **POLICY_PARAMS[policy])
    return f(layer)


class Driver:
    """Feeds a cache as the model and decode.Decoder do (prefill; per step: refresh and flush on schedule,
    recall when asked, update, attend, observe), keeping every token's original K/V and counting on its own:
    tokens demoted, pages flushed, recall misses."""

    def __init__(self, cache, S: int, seed: int):
        self.cache, self.gen = cache, torch.Generator().manual_seed(seed)
        total = S + 512
        self.k = torch.randn(B, H_KV, total, D, generator=self.gen)
        self.v = torch.randn(B, H_KV, total, D, generator=self.gen)
        self.t = S
        self.demoted = self.flushed = self.misses = 0
        self.staged = torch.zeros(B, H_KV, dtype=torch.long)
        q = torch.randn(B, H_KV * G, S, D, generator=self.gen)
        cache.reset()
        cache.prefill(q, self.k[:, :, :S], self.v[:, :, :S])
        self.demoted += sum(S - len(h) for row in self.hot() for h in row)

    def hot(self) -> list[list[set[int]]]:
        return [[set(h) for h in row] for row in managed_positions(self.cache)]

    def step(self, recall: bool) -> None:
        c, t = self.cache, self.t
        if c.refresh_interval and t % c.refresh_interval == 0:
            c.refresh()
        if t % c.page_size == 0:
            self.flushed += int((self.staged > 0).sum())
            self.staged.zero_()
            c.flush()
        q = torch.randn(B, H_KV * G, 1, D, generator=self.gen)
        if recall:
            self.expect_recall(q)
        before = self.hot()
        k_all, v_all, mask = c.update(torch.tensor([t]), self.k[:, :, t : t + 1], self.v[:, :, t : t + 1])
        after = self.hot()
        for b in range(B):
            for h in range(H_KV):
                gone = len(before[b][h] - after[b][h])
                self.demoted += gone
                self.staged[b, h] += gone
        _, probs = attend(q, k_all, v_all, mask, want_probs=True, layout=c.layout)
        if c.needs_attention:
            c.observe(probs)
        self.t += 1

    def expect_recall(self, q: Tensor) -> None:
        """Quest's bound per warm page from the warm tokens' original keys (quantized and dequantized as kv.quant
        does), max over the group: the top K pages are chosen; a chosen page already in a recall slot stays in
        that slot (a hit); the best `recall_installs` of the others (misses) go, best first, into the slots whose
        page was not chosen, in slot order; every other slot keeps its page. Run the recall and compare slot by
        slot, positions included."""
        c = self.cache
        K, M, P = c.recall_pages, c.tiers.recall_installs, c.page_size
        resident = c.recall_page.clone()
        c.recall(q)
        for b in range(B):
            for h in range(H_KV):
                pages = [[p for p in c.page_pos[b, h, i].tolist() if p >= 0] for i in range(c.page_pos.shape[2])]
                bounds = []
                for i, pos in enumerate(pages):
                    if not pos:
                        continue
                    keys = self.quantized(self.k[b, h, pos], c)
                    qh = q[b, h * G : (h + 1) * G, 0]  # [G, D]
                    bound = torch.maximum(qh[:, None] * keys.amin(0), qh[:, None] * keys.amax(0)).sum(-1)
                    bounds.append((bound.amax().item(), i))
                top = [i for _, i in sorted(bounds, reverse=True)[:K]]
                before = resident[b, h].tolist()
                misses = [i for i in top if i not in before][:M]
                free = [j for j, i in enumerate(before) if i not in top]
                expected = list(before)
                for j, i in zip(free, misses):
                    expected[j] = i
                assert c.recall_page[b, h].tolist() == expected
                slots = c.recall_positions()[b, h].view(K, P)
                for j, i in enumerate(expected):
                    want = c.page_pos[b, h, i].tolist() if i >= 0 else [-1] * P
                    assert slots[j].tolist() == want
                self.misses += len(misses)

    @staticmethod
    def quantized(x: Tensor, c) -> Tensor:
        """A page's keys [n, D] as the warm tier keeps them: per channel over the page, or per token; codes from
        the fp32 scale and zero point, which are then stored in fp16."""
        quantize, dequantize = ((quantize_channels, dequantize_channels) if c.key_channels else
                                (lambda x, bits: quantize_tokens(x, bits, c.warm_group), dequantize_tokens))
        codes, scale, zero = quantize(x, c.warm_bits)
        return dequantize(codes, scale.half().float(), zero.half().float(), c.warm_bits, torch.float32)

    def check(self) -> None:
        """Every position seen is hot, warm or cold, exactly once; recall slots hold warm tokens only."""
        c = self.cache
        hot = self.hot()
        lost = 0
        for b in range(B):
            for h in range(H_KV):
                managed = managed_positions(c)[b][h]
                assert len(managed) == len(set(managed)), "a position twice in the hot slots"
                warm = [p for p in c.page_pos[b, h].flatten().tolist() if p >= 0]
                warm += [p for p in c.stage_pos[b, h].tolist() if p >= 0]
                assert len(warm) == len(set(warm)), "a position twice in the warm tier"
                assert not hot[b][h] & set(warm), "a token both hot and warm"
                assert hot[b][h] | set(warm) <= set(range(self.t))
                recalled = {p for p in c.recall_positions()[b, h].tolist() if p >= 0}
                assert recalled <= set(warm) - set(c.stage_pos[b, h].tolist()), "recalled a token not in a page"
                lost += self.t - len(hot[b][h]) - len(warm)
        assert lost == tier_report([c])["cold_tokens"]


@st.composite
def tier_configs(draw):
    policy = draw(st.sampled_from(sorted(POLICY_PARAMS)))
    page = draw(st.sampled_from([1, 2, 4]))
    recall_pages = draw(st.integers(0, 3))
    least = 12 + recall_pages * page
    budget = draw(st.integers(least, least + 10))
    S = draw(st.integers(budget if policy == "snapkv" else 4, 36))  # snapkv: a prompt it compresses
    steps = draw(st.integers(max(1, budget - S), 45))  # the cache holds min(budget, S + steps) slots
    if policy == "snapkv":
        budget += steps
    warm = draw(st.integers(max(page, 2, recall_pages * page), 40))  # tokens (1 would be the fraction 1.0); small stores go cold
    recalls = draw(st.lists(st.booleans(), min_size=steps, max_size=steps))
    installs = draw(st.one_of(st.none(), st.integers(1, 3)))  # None: every chosen page (the default)
    return policy, page, recall_pages * page, S, steps, budget, warm, recalls, installs, draw(st.integers(0, 2**16))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tier_configs())
def test_every_token_in_one_tier_and_counters_exact(config):
    policy, page, recall, S, steps, budget, warm, recalls, installs, seed = config
    cache = tier_cache(policy, S, steps, budget, page=page, recall=recall, warm=warm, installs=installs)
    run = Driver(cache, S, seed)
    run.check()
    for r in recalls:
        run.step(recall=r)
        run.check()
    counts = tier_report([cache])
    scales = 2 * 2 * (D // cache.warm_group)  # a value's scale and zero point per group, fp16
    assert cache.key_channels  # keys: a scale and zero point per channel per page, fp16
    page_bytes = page * (2 * storage_width(D, cache.warm_bits) + scales) + 2 * 2 * D
    assert counts["demoted_tokens"] == run.demoted
    assert counts["flushed_pages"] == run.flushed
    assert counts["recall_misses"] == run.misses
    assert counts["hot_to_warm_bytes"] == (run.flushed + counts["prompt_pages"]) * page_bytes
    assert counts["warm_to_hot_bytes"] == run.misses * page_bytes
    assert counts["warm_bytes"] == B * H_KV * math.ceil(warm / page) * page_bytes


@pytest.mark.parametrize("kv_bits", [None, 8, 4])
def test_recalled_tokens_are_quantized_once(kv_bits):
    """A recalled token's K/V are its original ones quantized once: dequantized into fp slots, or the very
    codes the hot slot held (--kv-bits: the warm tier keeps the hot codes)."""
    cache = tier_cache("h2o", 20, 30, 16, kv_bits=kv_bits, warm=1.0)
    run = Driver(cache, 20, seed=3)
    for i in range(30):
        run.step(recall=i % 5 == 4)
    cache.recall(torch.randn(B, H_KV * G, 1, D))
    bits = kv_bits or cache.warm_bits
    region = slice(cache.capacity - cache.recall_slots, cache.capacity)
    pos = cache.slot_pos[..., region]
    assert (pos >= 0).any()
    for name, x in (("k", run.k), ("v", run.v)):
        original = x.gather(2, pos.clamp(min=0).unsqueeze(-1).expand(*pos.shape, D))
        codes, scale, zero = quantize_tokens(original, bits, cache.warm_group)
        valid = (pos >= 0).unsqueeze(-1)
        if kv_bits:
            assert torch.equal(getattr(cache, name)[..., region, :] * valid, codes * valid)
        elif name == "k":  # per channel over each recalled page (KIVI), empty entries left out of the range
            pages = (cache.recall_pages, cache.page_size)
            codes, scale, zero = quantize_channels(original.unflatten(2, pages), bits, (pos >= 0).unflatten(2, pages))
            expected = dequantize_channels(codes, scale.half().float(), zero.half().float(), bits, torch.float32)
            torch.testing.assert_close(getattr(cache, name)[..., region, :] * valid, expected.flatten(2, 3) * valid)
        else:  # codes from the fp32 scale and zero point, stored in fp16
            expected = dequantize_tokens(codes, scale.half().float(), zero.half().float(), bits, torch.float32)
            torch.testing.assert_close(getattr(cache, name)[..., region, :] * valid, expected * valid)


def test_prompt_compression_demotes_the_dropped_prompt_tokens_in_order():
    cache = tier_cache("h2o", 40, 8, 16, page=4, recall=4)
    Driver(cache, 40, seed=1)
    n = cache.prompt_capacity
    for b in range(B):
        for h in range(H_KV):
            kept = {p for p in cache.slot_pos[b, h, :n].tolist()}
            warm = [p for p in cache.page_pos[b, h].flatten().tolist() if p >= 0]
            assert warm == sorted(set(range(40)) - kept)
    assert tier_report([cache])["prompt_pages"] == B * H_KV * math.ceil((40 - n) / 4)


def test_no_recall_slots_decode_exactly_like_the_plain_policy():
    """Demotion alone never changes what the policy keeps or what attention sees."""
    model = tiny_model()
    prompt = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(0))
    for policy in ("h2o", "scissorhands", "window", "hybrid"):
        params = {k: v for k, v in POLICY_PARAMS[policy].items()}
        plain = make_cache_factory(policy, 2, model.args, 30, 40, budget=16, **params)
        model.setup_caches(plain)
        expected = generate_tokens(model, prompt, 40)
        model.setup_caches(make_cache_factory(policy, 2, model.args, 30, 40, budget=16,
                                              tiers={"warm_tokens": 1.0, "page_size": 4, "recall_slots": 0},
                                              **params))
        assert torch.equal(generate_tokens(model, prompt, 40), expected), policy
        assert tier_report(model.caches)["warm_tokens"] > 0


@pytest.mark.parametrize("policy", ["scissorhands", "hybrid"])
def test_compiled_matches_eager_tokens_and_counters_without_recompiling(policy):
    """1,000 steps with recalls, flushes, refreshes and pages going cold, then a shorter prompt on the same
    caches: compiled tokens and counters equal eager ones, and nothing compiles after the first steps."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = tiny_model()
    tiers = {"warm_tokens": 0.5, "page_size": 4, "recall_slots": 8, "recall_interval": 8}
    model.setup_caches(make_cache_factory(policy, 2, model.args, 20, 1001, budget=24, tiers=tiers,
                                          **POLICY_PARAMS[policy]))
    decoder = Decoder(model, compile=True)
    graphs = {}

    def warm(step: int, logits: Tensor) -> None:
        if step == 16:
            graphs.setdefault("warm", counters["stats"]["unique_graphs"])

    gen = torch.Generator().manual_seed(2)
    for length, n_new in [(20, 1001), (14, 60)]:
        prompt = torch.randint(0, 64, (2, length), generator=gen)
        eager = generate_tokens(model, prompt, n_new)
        eager_counts = tier_report(model.caches)
        assert eager_counts["recall_misses"] > 0 and (n_new < 1000 or eager_counts["cold_pages"] > 0)
        assert torch.equal(generate_tokens(model, prompt, n_new, decoder, on_logits=warm), eager), length
        assert tier_report(model.caches) == eager_counts
    assert counters["stats"]["unique_graphs"] == graphs["warm"], "recompiled"


@pytest.mark.parametrize("tiers, kwargs, message", [
    ({"warm_tokens": 3, "page_size": 4}, {}, "smaller than one page"),
    ({"warm_tokens": 1.0, "recall_slots": 64, "page_size": 4}, {}, "does not fit the hot budget"),
    ({"warm_tokens": 1.0, "warm_bits": 3}, {}, "--warm-bits must be 8 or 4"),
    ({"warm_tokens": 1.0, "warm_bits": 4}, {"kv_bits": 8}, "a token is quantized once"),
    ({"warm_tokens": 1.0, "recall_slots": 6, "page_size": 4}, {}, "whole number of pages"),
    ({"page_size": 4}, {}, "needs --warm-tokens"),
    ({"warm_tokens": 8, "recall_slots": 12, "page_size": 4}, {}, "exceed the warm store"),
    ({"warm_tokens": 1.0, "recall_installs": 0}, {}, "--recall-installs must be"),
    ({"warm_tokens": 1.0, "recall_installs": 2.5}, {}, "--recall-installs must be"),
])
def test_bad_tier_flags(tiers, kwargs, message):
    with pytest.raises(KVFastError, match=message):
        make_cache_factory("h2o", 1, tiny_args(), 40, 20, budget=24, tiers=tiers, n_sinks=1, recent_window=3,
                           **kwargs)


@pytest.mark.parametrize("policy, message", [("full", "not used by --cache full"),
                                             ("adakv", "moves slots between KV heads"), ("kvzip", "do not apply")])
def test_tiers_need_one_victim_per_head(policy, message):
    with pytest.raises(KVFastError, match=message):
        make_cache_factory(policy, 1, tiny_args(), 40, 20, budget=None if policy == "full" else 24,
                           tiers={"warm_tokens": 1.0})


def test_cli_prints_tier_counters_and_rejects_bad_flags(tmp_path, capsys):
    from conftest import save_tiny_hf

    from scripts.convert_hf_checkpoint import convert_hf_checkpoint

    save_tiny_hf(tmp_path / "hf", tie=True, rope_scaling=False)
    ckpt = str(convert_hf_checkpoint(tmp_path / "hf", tmp_path / "tiny"))
    base = ["--checkpoint", ckpt, "--prompt", "word " * 60, "--max-new-tokens", "40", "--temperature", "0",
            "--ignore-eos", "--cache", "h2o", "--cache-budget", "0.25", "--n-sinks", "1", "--recent-window", "4"]
    assert generate.cli([*base, "--warm-tokens", "1.0", "--warm-bits", "4", "--page-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "tiers: tokens per (row, KV head, layer)" in out and "recall steps" in out
    full = ["--checkpoint", ckpt, "--prompt", "hi", "--max-new-tokens", "4", "--warm-tokens", "1"]
    for argv, message in (([*base, "--warm-tokens", "1", "--warm-bits", "3"], "--warm-bits must be 8 or 4"),
                          (full, "not used by --cache full")):
        assert generate.cli(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_tova_keeps_one_set_per_layer_beside_per_head_recalls():
    """TOVA scores a layer's slots together while its KV heads hold the same tokens; each head recalling its own
    pages into the recall slots must not make it fall back to per-head eviction."""
    cache = tier_cache("tova", 24, 40, 20, page=2, recall=4)
    run = Driver(cache, 24, seed=5)
    managed = cache.capacity - cache.recall_slots
    for i in range(40):
        run.step(recall=i % 3 == 0)
        own = cache.slot_pos[..., :managed]
        assert torch.equal(own, own[:, :1].expand_as(own)), f"KV heads' kept sets differ after step {i}"
    recalled = cache.slot_pos[..., managed:]
    assert (recalled >= 0).any() and not torch.equal(recalled[:, 0], recalled[:, 1])  # the heads did differ


@pytest.mark.parametrize("policy", ["h2o", "hybrid"])
def test_hot_bytes_are_the_budgets_and_warm_bytes_are_apart(policy):
    """Tiers take their recall slots out of the budget: the hot K/V buffers are the plain policy's bytes (the pool's
    P = H_kv x budget slots included); the warm store is counted on its own."""
    args = tiny_args(n_heads=H_KV * G, n_kv_heads=H_KV, head_dim=D)
    plain = make_cache_factory(policy, B, args, 40, 20, budget=24, **POLICY_PARAMS[policy])(0)
    tiered = tier_cache(policy, 40, 20, 24, page=4, recall=8)
    assert tiered.physical_bytes() == plain.physical_bytes() == B * H_KV * 24 * 2 * D * 4
    assert tiered.warm_bytes() == B * H_KV * tiered.tiers.warm_pages * tiered.page_bytes()
    Driver(tiered, 40, seed=0)
    assert tiered.kept().tolist() == [[24 - 8] * H_KV] * B  # the policy's slots, full; the recall slots apart


def test_bench_interleaves_the_plain_and_the_tiered_step():
    """bench.py --section tiers' one-process comparison: both caches at the same hot budget, every round timed
    for each, nothing recompiled after the first round."""
    from torch._dynamo.utils import counters

    from benchmarks.tiers import interleaved_steps
    from evals.caches import TIER_DEFAULTS, TIER_FLAGS

    model = tiny_model()
    tiers = {k: TIER_DEFAULTS[k] for k in TIER_FLAGS}
    counters.clear()
    with recorded_graphs(inductor=False):  # the rounds and recompiles are the claim, not Inductor's code
        times = interleaved_steps(model, "h2o", 300, 0.25, tiers, steps=6, rounds=3, scope="block", span_rounds=2)
    assert {kind: {k: len(v) for k, v in t.items()} for kind, t in times.items()} == {
        "step": {"plain": 3, "tiered": 3}, "span": {"plain": 2, "tiered": 2}}
    assert all(x > 0 for t in times.values() for v in t.values() for x in v)
    # the plain step; the tiered step, recall step and flush
    assert counters["stats"]["unique_graphs"] == 4 and not counters["recompiles"]
