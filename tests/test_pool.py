"""The pool layout (kv.pool) and Ada-KV on it: property-tested invariants (every slot owned by one head,
the pool's occupancy, per-head floors, unique positions), Ada-KV's allocation against a transcription of
its reference code, KVzip's joint ranking across heads, compiled == eager without recompiling over 1,000
steps and prompts of other lengths, memory independent of the split, one-line CLI errors, eval.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from cache_testing import (
    generate_tokens,
    head_positions,
    kept_counts_over_prompts,
    kvzip_prefill,
    single_thread_fixture,
    tiny_args,
    tiny_model,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import generate
from attention import attend, halves_product
from cache import PROMPT_COMPRESSORS, make_cache_factory
from kv.pool import AdaKVCache, adakv_budgets

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)


# ---- invariants ------------------------------------------------------------------------------------------
@st.composite
def pool_configs(draw):
    compressor = draw(st.sampled_from(list(PROMPT_COMPRESSORS)))
    p = {"n_sinks": draw(st.integers(0, 3)), "recent_window": draw(st.integers(1, 6)),
         "adakv_floor": draw(st.sampled_from([0.0, 0.2, 0.5, 1.0])), "adakv_normalize": draw(st.booleans()),
         "gqa_reduce": draw(st.sampled_from(["mean", "max"]))}
    if "obs_window" in PROMPT_COMPRESSORS[compressor].params:
        p["obs_window"] = draw(st.integers(1, 6))
        p["pool_kernel"] = draw(st.sampled_from([1, 3]))
    least = p["n_sinks"] + max(p["recent_window"], p.get("obs_window", 0)) + 1
    prompt_len, steps = draw(st.integers(1, 40)), draw(st.integers(1, 30))
    return {"batch": draw(st.integers(1, 2)), "n_kv": draw(st.integers(1, 3)), "g": draw(st.integers(1, 2)),
            "prompt_len": prompt_len, "steps": steps, "compressor": compressor, "params": p,
            "budget": draw(st.integers(least, max(least, prompt_len + steps + 4))),
            "seed": draw(st.integers(0, 2**16))}


def check_pool(cache: AdaKVCache, t: int) -> None:
    """Invariants of the pool after position t was written."""
    B, H, P = cache.batch_size, cache.n_kv_heads, cache.pool_size
    assert cache.slot_head.shape == cache.slot_pos.shape == (B, P)
    assert ((cache.slot_head >= 0) & (cache.slot_head < H)).all(), "a slot without exactly one owner"
    owners = torch.nn.functional.one_hot(cache.slot_head, H).sum(1)  # [B, H]: owned, empty ones included
    assert (owners.sum(-1) == P).all()
    occupancy = cache.kept()  # [B, H]: valid slots per head
    assert (occupancy.sum(-1) == min((t + 1) * H, P)).all(), "H_kv in, H_kv out once the pool is full"
    if (t + 1) * H >= P:
        assert (occupancy >= cache.head_floor).all(), f"below the floor {cache.head_floor}: {occupancy}"
    for row in head_positions(cache):
        for pos in row:
            assert len(pos) == len(set(pos)) and all(0 <= p <= t for p in pos)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfg=pool_configs())
def test_pool_invariants(cfg):
    B, S = cfg["batch"], cfg["prompt_len"]
    args = tiny_args(n_layers=1, n_heads=cfg["n_kv"] * cfg["g"], n_kv_heads=cfg["n_kv"], head_dim=4)
    cache = make_cache_factory("adakv", B, args, S, cfg["steps"], budget=cfg["budget"],
                               prompt_compression=cfg["compressor"], **cfg["params"])(0)
    gen = torch.Generator().manual_seed(cfg["seed"])
    H, Hkv, D = args.n_heads, args.n_kv_heads, args.head_dim

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    memo = {}
    if getattr(cache.compressor, "needs_model_pass", False):
        memo[cache.compressor.memo_key()] = torch.rand(B, Hkv, S, generator=gen)
    cache.prefill(randn(B, H, S, D), randn(B, Hkv, S, D), randn(B, Hkv, S, D), memo=memo)
    bytes_before = cache.physical_bytes()
    check_pool(cache, S - 1)
    for t in range(S, S + cfg["steps"]):
        k_all, v_all, mask = cache.update(torch.tensor([t]), randn(B, Hkv, 1, D), randn(B, Hkv, 1, D))
        assert mask.shape == (B, Hkv, 1, cache.pool_size) and mask[:, :, 0].sum(1).max() <= 1
        _, probs = attend(randn(B, H, 1, D), k_all, v_all, mask, want_probs=True, layout=cache.layout)
        assert torch.isfinite(probs).all()  # every head holds at least its new token
        cache.observe(probs)
        check_pool(cache, t)
    assert cache.physical_bytes() == bytes_before == B * cache.pool_size * 2 * D * 4


# ---- Ada-KV's selection against its reference code ---------------------------------------------------
def reference_budgets(scores: torch.Tensor, base: int, alpha: float, normalize: bool) -> list[list[int]]:
    """FFY0/AdaKV AdaptiveSnapKVCluster.update_kv_gqa, transcribed one row at a time (its bsz == 1):
    sort per head, optionally scale by the top-base share, top-(H base) over the concatenation, count per
    head, budget = round(count (1 - alpha) + int(alpha base))."""
    out = []
    for row in scores:
        H = row.shape[0]
        ranked = [sorted(row[h].tolist(), reverse=True) for h in range(H)]
        if normalize:
            ranked = [[x * sum(r[:base]) / sum(r) for x in r] for r in ranked]
        flat = sorted(((x, h) for h in range(H) for x in ranked[h]), key=lambda e: -e[0])[: H * base]
        counts = [sum(1 for _, h in flat if h == head) for head in range(H)]
        out.append([round(c * (1 - alpha) + int(base * alpha)) for c in counts])
    return out


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 1.0])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_budgets_follow_the_reference(alpha, normalize, seed):
    gen = torch.Generator().manual_seed(seed)
    B, H, n, base = 2, 4, 30, 7
    # heads with different concentration: exponentials scaled per head (positive, like attention)
    scores = (torch.rand(B, H, n, generator=gen) ** (1 + 4 * torch.rand(B, H, 1, generator=gen))).double()
    ours, _ = adakv_budgets(scores, base, alpha, normalize)
    ref = torch.tensor(reference_budgets(scores, base, alpha, normalize))
    assert (ours.sum(-1) == H * base).all()
    if alpha in (0.0, 1.0):  # no rounding: the reference exactly
        assert torch.equal(ours, ref)
    else:
        assert (ours - ref).abs().max() <= 1
    assert (ours >= int(alpha * base)).all()


def test_prefill_keeps_each_heads_top_budget_and_the_protected():
    """The cache's kept pairs: per head the protected tokens and its top-b_h candidates, b_h from the
    reference (floor 0: pure top-k across heads, no rounding), on the snapkv compressor's scores."""
    args = tiny_args(n_layers=1, n_heads=6, n_kv_heads=3, head_dim=8)
    B, S, budget = 2, 50, 12
    cache = make_cache_factory("adakv", B, args, S, 4, budget=budget, n_sinks=1, recent_window=3,
                               obs_window=4, pool_kernel=3, adakv_floor=0.0, adakv_normalize=True)(0)
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(B, 6, S, 8, generator=gen), torch.randn(B, 3, S, 8, generator=gen), None
    memo = {}
    cache.prefill(q, k, torch.randn(B, 3, S, 8, generator=gen), memo=memo)
    scores = cache.compressor.cached_scores(q, k, memo, v).double()
    protected = {0} | set(range(S - 4, S))
    candidates = [p for p in range(S) if p not in protected]
    base = budget - len(protected)
    budgets = reference_budgets(scores[..., candidates], base, 0.0, True)
    kept = head_positions(cache)
    for b in range(B):
        assert sum(len(h) for h in kept[b]) == 3 * budget
        for h in range(3):
            top = sorted(candidates, key=lambda p: -scores[b, h, p].item())[: budgets[b][h]]
            assert set(kept[b][h]) == protected | set(top), (b, h)
    assert len({len(h) for row in kept for h in row}) > 1, "the heads' budgets should differ"


def test_kvzip_with_floor_zero_is_the_joint_ranking_across_heads():
    """--cache adakv --prompt-compression kvzip --adakv-floor 0 --no-adakv-normalize: the kept (head, token)
    pairs are the top H_kv x B' of KVzip's reconstruction scores across the layer's heads (kvpress's
    KVzipPress ranking within a layer), plus the sinks."""
    model = tiny_model(4)
    S, budget = 40, 12
    idx = torch.randint(0, 64, (2, S), generator=torch.Generator().manual_seed(2))
    factory = make_cache_factory("adakv", 2, model.args, S, 4, budget=budget, prompt_compression="kvzip",
                                 kvzip_chunk=16, n_sinks=2, recent_window=1, adakv_floor=0.0,
                                 adakv_normalize=False)
    scores = kvzip_prefill(model, factory, idx, chunk=16)
    H = model.args.n_kv_heads
    for cache, s in zip(model.caches, scores):
        kept = head_positions(cache)
        for b in range(2):
            pairs = sorted(((s[b, h, p].item(), h, p) for h in range(H) for p in range(2, S)), reverse=True)
            sinks = {(h, p) for h in range(H) for p in (0, 1)}
            expected = {(h, p) for _, h, p in pairs[: H * (budget - 2)]} | sinks
            assert {(h, p) for h in range(H) for p in kept[b][h]} == expected


# ---- compiled decoding -------------------------------------------------------------------------------
def test_compiled_equals_eager_over_1000_steps_and_other_prompt_lengths():
    """One set of caches, budget 12 slots per head: a prompt of 20 tokens decoded 1,000 steps, then prompts
    of 18 and 10 tokens (the last fits: no compression) 40 steps each; the compiled step compiles once."""
    splits = kept_counts_over_prompts("adakv", budget=12, n_sinks=2, recent_window=4, obs_window=4,
                                      pool_kernel=3)
    assert len(splits) > 1  # the split between heads really changed


@pytest.mark.parametrize("layout", ["uniform", "positions", "pool"])
def test_one_query_attention_compiled_equals_the_matmul_path(layout):
    """The compiled CPU decode step's fused one-query attention (attention.attend_one_query / attend_pool_one_query:
    a pool slot scored only by its owner's query heads) == attend's matmul path: outputs and the probabilities
    a policy observes, with empty slots and a head that owns nothing in one row. "positions": the mask given as
    a slot cache gives it, the slots' positions (-1: empty), on both paths."""
    gen = torch.Generator().manual_seed(0)
    B, n_kv, g, D, T = 2, 3, 3, 16, 40
    q = torch.randn(B, n_kv * g, 1, D, generator=gen)
    if layout != "pool":
        k, v = (torch.randn(B, n_kv, T, D, generator=gen) for _ in "kv")
        mask = torch.rand(B, n_kv, 1, T, generator=gen) > 0.3
    else:
        k, v = (torch.randn(B, T, D, generator=gen) for _ in "kv")
        owner = torch.randint(0, n_kv, (B, T), generator=gen)
        owner[1] = torch.where(owner[1] == 2, 0, owner[1])  # row 1: KV head 2 owns no slot
        owner[1, -1] = 2  # ... but an empty one (slot_pos -1)
        held = torch.rand(B, T, generator=gen) > 0.2
        held[1, -1] = False
        mask = ((owner.unsqueeze(1) == torch.arange(n_kv).view(1, -1, 1)) & held.unsqueeze(1)).unsqueeze(2)
    attend_layout = "pool" if layout == "pool" else "uniform"
    out, probs = attend(q, k, v, mask, want_probs=True, layout=attend_layout)
    if layout == "positions":
        mask = torch.where(mask, torch.arange(T), -1)
        assert all(torch.equal(a, b) for a, b in zip(attend(q, k, v, mask, want_probs=True), (out, probs)))
    fused = torch.compile(lambda *a: attend(*a, want_probs=True, layout=attend_layout), fullgraph=True,
                          backend="inductor")
    fused_out, fused_probs = fused(q, k, v, mask)
    rows = slice(None) if layout != "pool" else slice(0, 1)  # row 1's head 2 attends to nothing: NaN either way
    torch.testing.assert_close(fused_out[rows], out[rows])
    torch.testing.assert_close(fused_probs[rows], probs[rows])
    assert fused_probs.shape == probs.shape
    if layout == "pool":  # each query head's probabilities sit on its own KV head's held slots only
        assert torch.equal(fused_probs[0, :, :, 0] > 0, mask[0, :, 0].unsqueeze(1).expand(-1, g, -1))


@pytest.mark.parametrize("rows", [1, 3])
def test_halves_product_is_the_matmul(rows):
    """The pool's probabilities x V: one row goes through the two halves of V's channels as a batch of two."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(rows, 9, 37, generator=gen), -1)
    v = torch.randn(rows, 37, 16, generator=gen)
    compiled = torch.compile(halves_product, fullgraph=True, backend="inductor")
    for out in (halves_product(probs, v), compiled(probs, v)):
        torch.testing.assert_close(out, torch.bmm(probs, v))


@pytest.mark.parametrize("kv_bits", [None, 8, 4])
def test_memory_is_the_pool_whatever_the_split(kv_bits):
    model = tiny_model(1)
    B, budget, a = 2, 12, model.args
    model.setup_caches(make_cache_factory("adakv", B, a, 40, 20, budget=budget, kv_bits=kv_bits, n_sinks=1,
                                          recent_window=3, obs_window=3, pool_kernel=3, adakv_floor=0.0))
    P = a.n_kv_heads * budget
    per_slot = 2 * a.head_dim * 4 if kv_bits is None else 2 * (a.head_dim * kv_bits // 8 + 2 * 4)
    seen = set()
    for seed in range(3):
        prompt = torch.randint(0, 64, (B, 40), generator=torch.Generator().manual_seed(seed))
        generate_tokens(model, prompt, 10)
        for c in model.caches:
            assert c.physical_bytes() == B * P * per_slot
            seen.add(tuple(c.kept().flatten().tolist()))
    assert len(seen) > 1


def test_budgets_move_while_decoding_and_keep_the_floor():
    model = tiny_model(2)
    model.setup_caches(make_cache_factory("adakv", 1, model.args, 30, 60, budget=10, n_sinks=1,
                                          recent_window=2, obs_window=2, pool_kernel=3, adakv_floor=0.5))
    prompt = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(0))
    history = []
    generate_tokens(model, prompt, 60, on_logits=lambda i, _: history.append(
        [c.kept().flatten().tolist() for c in model.caches]))
    floor = model.caches[0].head_floor
    assert floor == 1 + 1 + int(0.5 * (10 - 2))
    assert all(n >= floor for step in history for layer in step for n in layer)
    assert len({str(step) for step in history}) > 1


def greedy_pick(pos: list[int], head: list[int], score: list[float], lost: list[int], allowance: list[int],
                picked: list[int], t: int, n_sinks: int, recent_window: int) -> int:
    """The slot the greedy choice takes next: the lowest (tier, score, slot) not yet picked, tier 0 = empty or
    evictable, 1 = evictable with its head at its floor, 2 = protected."""
    def rank(i: int) -> tuple:
        valid = pos[i] >= 0
        protected = valid and (pos[i] < n_sinks or pos[i] > t - recent_window)
        tier = 2 if protected else (1 if valid and lost[head[i]] >= allowance[head[i]] else 0)
        return (tier, score[i] if valid else -math.inf, i)
    return min((i for i in range(len(pos)) if i not in picked), key=rank)


def greedy_victims(cache, t: int) -> list[list[tuple[int, int]]]:
    """The slow reference of PoolCache.choose_slot, one row and one pick at a time (greedy_pick); each valid
    pick counts against its head's allowance (owned + 1 - floor). Evicted (head, position) pairs per row,
    sorted (which physical slot hosts which head's new key is immaterial)."""
    out = []
    for b in range(cache.batch_size):
        pos, head, score = cache.slot_pos[b].tolist(), cache.slot_head[b].tolist(), cache.score[b].tolist()
        owned = [sum(1 for p, h in zip(pos, head) if h == kv and p >= 0) for kv in range(cache.n_kv_heads)]
        allowance = [n + 1 - cache.head_floor for n in owned]
        lost, picked = [0] * cache.n_kv_heads, []
        for _ in range(cache.n_kv_heads):
            i = greedy_pick(pos, head, score, lost, allowance, picked, t, cache.n_sinks, cache.recent_window)
            picked.append(i)
            lost[head[i]] += pos[i] >= 0
        out.append(sorted((head[i], pos[i]) for i in picked))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_choose_slot_evicts_what_the_greedy_reference_does(seed):
    """Random scores, floors and empty slots: choose_slot's one pass evicts the greedy loop's pairs."""
    g = torch.Generator().manual_seed(seed)
    B, S = 2, 40
    args = tiny_args(n_layers=1, n_heads=6, n_kv_heads=3, head_dim=8)
    cache = make_cache_factory("adakv", B, args, S, 30, budget=12, n_sinks=1, recent_window=3, obs_window=3,
                               pool_kernel=3, adakv_floor=[0.0, 0.2, 0.5, 1.0][seed % 4])(0)
    cache.prefill(*(torch.randn(B, h, S, 8, generator=g) for h in (6, 3, 3)))
    for t in range(S, S + 12):
        cache.score.copy_(torch.rand(cache.score.shape, generator=g) * 4)  # equal scores may go either way
        if seed % 3 == 0:
            cache.slot_pos[:, torch.randint(0, cache.pool_size, (2,), generator=g)] = -1
        slot = cache.choose_slot(torch.tensor([t]))
        got = [sorted((int(cache.slot_head[b, i]), int(cache.slot_pos[b, i])) for i in slot[b].tolist())
               for b in range(B)]
        assert got == greedy_victims(cache, t), t
        cache.insert(slot, torch.tensor([t]), torch.randn(B, 3, 1, 8, generator=g), torch.randn(B, 3, 1, 8, generator=g))


# ---- CLI and eval ------------------------------------------------------------------------------------
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


@pytest.mark.parametrize("argv, expected", [
    (["--cache", "adakv", "--cache-budget", "20"],
     ("below adakv's per-head floor 32 = n_sinks (0) + max(obs_window (32), recent_window (32)) x 2 KV heads "
     "= 64")),
    (["--cache", "adakv", "--cache-budget", "20", "--prompt-compression", "knorm", "--recent-window", "30"],
     "per-head floor 30 = n_sinks (0) + recent_window (30) x 2 KV heads"),
    (["--cache", "h2o", "--adakv-floor", "0.1"], "--adakv-floor is not used by --cache h2o"),
    (["--cache", "snapkv", "--no-adakv-normalize"], "--adakv-normalize is not used by --cache snapkv"),
    (["--cache", "adakv", "--adakv-floor", "1.5"], "--adakv-floor must lie in [0, 1], got 1.5"),
])
def test_bad_input_is_one_line(argv, expected, tiny_checkpoint, capsys):
    code = generate.cli(["--checkpoint", str(tiny_checkpoint), "--prompt", PROMPT, "--max-new-tokens", "12",
                         "--temperature", "0", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and expected in err, err


def test_cli_head_adaptive_kvzip(tiny_checkpoint, capsys):
    code = generate.cli(["--checkpoint", str(tiny_checkpoint), "--prompt", " ".join(["hello world"] * 30),
                         "--max-new-tokens", "8", "--temperature", "0", "--cache", "adakv",
                         "--prompt-compression", "kvzip", "--adakv-floor", "0", "--cache-budget", "24",
                         "--recent-window", "4", "--kvzip-chunk", "16", "--compile"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "cache: adakv + kvzip prompt compression, capacity per layer 24 slots; slots per KV head" in out
    assert "kvzip reconstruction scoring" in out and "kept 24.0" in out


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    from test_eval import PROSE

    path = tmp_path / "prose.txt"
    path.write_text("\n\n".join(PROSE * 4))
    return path


def test_eval_runs_pool_policies_in_their_own_group(text_file, tmp_path):
    from test_eval import run_eval
    from test_eval import tiny_model as eval_model

    import eval as ev_mod

    flags = ["--tasks", "passkey", "fidelity", "ppl", "attention-loss", "--policies", "full", "h2o", "adakv",
             "--lengths", "400", "--samples", "2", "--ppl-length", "256", "--ppl-samples", "2", "--ppl-every",
             "128", "--fidelity-tokens", "8", "--n-sinks", "2", "--recent-window", "8", "--obs-window", "4",
             "--pool-kernel", "3"]
    args = ev_mod.parse_args(["--device", "cpu", *flags, "--budgets", "0.4"])
    ev = ev_mod.Evaluator(eval_model(), None, args)
    combos = ev_mod.combos_of(args)
    assert [[c.policy for c in g] for g in ev.groups(combos, 2, 400, 64)] == [["full"], ["adakv"], ["h2o"]]
    same = run_eval(text_file, tmp_path / "one", *flags, "--budgets", "1.0")
    full = {(r["task"], r["index"]): r for r in same if r["policy"] == "full"}
    for r in same:
        if r["policy"] == "adakv" and r["task"] == "passkey":
            assert r["prediction"] == full[(r["task"], r["index"])]["prediction"]
        if r["policy"] == "adakv" and r["task"] == "attention-loss":
            assert r["metrics"]["loss@256"] == pytest.approx(0, abs=1e-6)
    records = run_eval(text_file, tmp_path / "two", *flags, "--budgets", "0.4")
    pool = [r for r in records if r["policy"] == "adakv"]
    assert {r["task"] for r in pool} == {"passkey", "fidelity", "ppl", "attention-loss"}
    loss = [r["metrics"]["loss@256"] for r in pool if r["task"] == "attention-loss"]
    assert all(0 < x <= 1 for x in loss) and all(math.isfinite(r["score"]) for r in pool)
