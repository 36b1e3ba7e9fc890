"""hybrid (kv.hybrid, HybridKV on the pool): head classification against a slow reference on hand-made
attention (threshold and ratio modes), budgets per type summing to the pool, what each type keeps at prefill
and while decoding, rows classified independently, compiled == eager without recompiling over 1,000 steps and
prompts of other lengths, one-line CLI errors, the report in generate.py and eval.py."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from cache_testing import (
    head_positions,
    kept_counts_over_prompts,
    single_thread_fixture,
    tiny_args,
)

import generate
from attention import attend
from cache import format_head_class_report, head_class_report, make_cache_factory
from kv.hybrid import HybridCache, classify_heads, hybrid_budgets

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)

S, D, BUDGET, WINDOW = 40, 48, 12, 4


def hand_made(rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """q [rows, 6, S, D], k [rows, 3, S, D] (2 query heads per KV head) whose attention is known by design:
    KV head 0 one dominant token (position 5), head 1 uniform (zero queries), head 2 local (each query on
    itself: one-hot queries and keys). A second row swaps heads 0 and 1."""
    q, k = torch.zeros(rows, 6, S, D), torch.zeros(rows, 3, S, D)
    u = torch.ones(D) / math.sqrt(D)
    for r in range(rows):
        dominant, uniform = (0, 1) if r % 2 == 0 else (1, 0)
        q[r, 2 * dominant : 2 * dominant + 2] = 20 * u
        k[r, dominant, 5] = 20 * u
        k[r, uniform] = torch.randn(S, D, generator=torch.Generator().manual_seed(r))
        eye = 20 * torch.eye(D)[:S]
        q[r, 4:6], k[r, 2] = eye, eye
    return q, k


def reference_concentration(q: torch.Tensor, k: torch.Tensor, w: int, capacity: int) -> list[list[float]]:
    """One query row at a time: the last w queries' causal softmax summed, mean over the group, then the top
    (capacity - w) tokens before the window over the whole sum."""
    B, H, S_, Dh = q.shape
    n_kv = k.shape[1]
    g = H // n_kv
    out = []
    for b in range(B):
        row = []
        for h in range(n_kv):
            votes = [0.0] * S_
            for qh in range(h * g, (h + 1) * g):
                for j in range(S_ - w, S_):
                    logits = [float(q[b, qh, j] @ k[b, h, i]) / math.sqrt(Dh) for i in range(j + 1)]
                    top = max(logits)
                    e = [math.exp(x - top) for x in logits]
                    for i, x in enumerate(e):
                        votes[i] += x / sum(e) / g
            before = sorted(votes[: S_ - w], reverse=True)[: max(capacity - w, 0)]
            row.append(sum(before) / sum(votes))
        out.append(row)
    return out


def cache_for(rows: int, prompt_len: int = S, steps: int = 8, **params) -> HybridCache:
    args = tiny_args(n_layers=1, n_heads=6, n_kv_heads=3, head_dim=D)
    defaults = {"n_sinks": 1, "recent_window": 3, "obs_window": WINDOW, "pool_kernel": 3}
    return make_cache_factory("hybrid", rows, args, prompt_len, steps, budget=BUDGET,
                              **{**defaults, **params})(0)


# ---- classification ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, expected", [
    ({"static_threshold": 0.9}, [True, False, False]),  # only the dominant head reaches 0.9
    ({}, [True, True, False]),  # ratio 0.7 of 3 heads: round(2.1) = 2, the two most concentrated
    ({"static_ratio": 0.34}, [True, False, False]),
    ({"static_ratio": 0.0}, [False, False, False]),
    ({"static_ratio": 1.0}, [True, True, True]),
])
def test_classification_matches_the_slow_reference(mode, expected):
    q, k = hand_made()
    cache = cache_for(1, **mode)
    cache.prefill(q, k, torch.randn(1, 3, S, D))
    ref = reference_concentration(q, k, WINDOW, BUDGET)[0]
    got = cache.head_classes()
    assert got["concentration"][0].tolist() == pytest.approx(ref, abs=1e-5)
    assert ref[0] > 0.99 and 0.1 < ref[1] < 0.5 and ref[2] < 0.01, ref  # the attention is as designed
    assert got["static"][0].tolist() == expected


def test_classification_on_random_attention_matches_the_reference():
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 6, S, D, generator=gen) * 2, torch.randn(2, 3, S, D, generator=gen) * 2
    cache = cache_for(2, static_threshold=0.5)
    cache.prefill(q, k, torch.randn(2, 3, S, D, generator=gen))
    ref = torch.tensor(reference_concentration(q, k, WINDOW, BUDGET), dtype=torch.float64)
    torch.testing.assert_close(cache.head_classes()["concentration"], ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(cache.head_classes()["static"], ref >= 0.5)
    for ratio in (0.3, 0.5, 0.7, 0.9):  # the round(ratio x H) largest per row, ties to the lower head
        static = classify_heads(ref, None, ratio)
        for row, flags in zip(ref.tolist(), static.tolist()):
            top = sorted(range(3), key=lambda h: (-row[h], h))[: math.floor(ratio * 3 + 0.5)]
            assert flags == [h in top for h in range(3)]


# ---- budgets ----------------------------------------------------------------------------------------------
def test_budgets_split_by_type_then_evenly_and_sum_to_the_pool():
    static = torch.tensor([[True, False, True, False], [True, True, True, True], [False] * 4])
    # P = 40, floor 4, ceiling 30: share 0.3 -> 12 static slots (6 each), 28 dynamic (14 each)
    assert hybrid_budgets(static[:1], 10, 4, 0.3, 30).tolist() == [[6, 14, 6, 14]]
    assert hybrid_budgets(static[:1], 10, 4, 0.05, 30).tolist() == [[4, 16, 4, 16]]  # 2 -> the floor
    assert hybrid_budgets(static[:1], 10, 4, 0.25, 30).tolist() == [[5, 15, 5, 15]]
    assert hybrid_budgets(static[:1], 10, 4, 0.35, 30).tolist() == [[7, 13, 7, 13]]
    assert hybrid_budgets(static[:1], 10, 4, 0.33, 30).tolist() == [[7, 14, 6, 13]]  # remainders to lower
    assert hybrid_budgets(static[:1], 10, 4, None, 30).tolist() == [[10] * 4]  # default: the heads' share
    assert hybrid_budgets(static[:1], 10, 4, 0.3, 10).tolist() == [[10] * 4]  # the prompt fits: even split
    assert hybrid_budgets(static[1:], 10, 4, 0.1, 30).tolist() == [[10] * 4, [10] * 4]  # one type: all of P
    rng = random.Random(0)
    for _ in range(300):
        H, cap = rng.randint(1, 6), rng.randint(1, 20)
        floor, ceiling = rng.randint(0, cap), rng.randint(cap, 3 * cap)
        mask = torch.tensor([[rng.random() < 0.5 for _ in range(H)] for _ in range(3)])
        share = rng.choice([None, 0.0, 1.0, rng.random()])
        b = hybrid_budgets(mask, cap, floor, share, ceiling)
        assert (b.sum(-1) == H * cap).all() and (b >= floor).all() and (b <= ceiling).all()
        for row, flags in zip(b.tolist(), mask.tolist()):
            for kind in (True, False):
                mine = [x for x, f in zip(row, flags) if f == kind]
                assert not mine or max(mine) - min(mine) <= 1


# ---- what each type keeps ---------------------------------------------------------------------------
def test_static_heads_keep_heavy_hitters_dynamic_heads_the_recent_window():
    """After prefill and at every decode step: budgets fixed per head; a static head evicts its lowest
    accumulated attention, a dynamic head its oldest unprotected token (sinks and recent window kept)."""
    args = tiny_args(n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8)
    B, S_, steps, n_sinks, recent = 2, 30, 40, 1, 3
    cache = make_cache_factory("hybrid", B, args, S_, steps, budget=10, n_sinks=n_sinks,
                               recent_window=recent, obs_window=3, pool_kernel=3, static_share=0.3)(0)
    gen = torch.Generator().manual_seed(7)
    q, k = torch.randn(B, 4, S_, 8, generator=gen), torch.randn(B, 2, S_, 8, generator=gen)
    memo = {}
    cache.prefill(q, k, torch.randn(B, 2, S_, 8, generator=gen), memo=memo)
    static, budget = cache.head_classes()["static"], cache.head_classes()["budget"]
    assert static.sum(-1).tolist() == [1, 1]  # round(0.7 x 2) = 1 static head per row
    assert (budget == torch.where(static, 6, 14)).all()  # round(0.3 x 20) = 6 static slots, floor 1 + 3
    scores = cache.compressor.cached_scores(q, k, memo)
    kept = head_positions(cache)
    for b in range(B):
        for h in range(2):
            protected = {0, 27, 28, 29}
            if static[b, h]:
                top = sorted(range(1, 27), key=lambda p: -scores[b, h, p].item())[:2]
                assert set(kept[b][h]) == protected | set(top)
            else:
                assert set(kept[b][h]) == {0} | set(range(S_ - 13, S_))
    for t in range(S_, S_ + steps):
        before_pos, before_head = cache.slot_pos.clone(), cache.slot_head.clone()
        before_score, before = cache.score.clone(), head_positions(cache)
        new_k, new_v = torch.randn(B, 2, 1, 8, generator=gen), torch.randn(B, 2, 1, 8, generator=gen)
        k_all, v_all, mask = cache.update(torch.tensor([t]), new_k, new_v)
        _, probs = attend(torch.randn(B, 4, 1, 8, generator=gen), k_all, v_all, mask, want_probs=True, layout=cache.layout)
        cache.observe(probs)
        assert torch.equal(cache.kept(), budget)
        after = head_positions(cache)
        for b in range(B):
            for h in range(2):
                gone = set(before[b][h]) - set(after[b][h])
                assert set(after[b][h]) - set(before[b][h]) == {t} and len(gone) == 1
                (victim,) = gone
                own = (before_head[b] == h) & (before_pos[b] >= 0)
                evictable = own & (before_pos[b] >= n_sinks) & (before_pos[b] <= t - recent)
                if static[b, h]:
                    lowest = before_score[b][evictable].min()
                    slot = ((before_pos[b] == victim) & own).nonzero().item()
                    assert before_score[b, slot] == lowest
                else:
                    assert victim == before_pos[b][evictable].min().item()
                    assert set(after[b][h]) == {0} | set(range(t + 1 - 13, t + 1))
                assert {0, t - 1, t} <= set(after[b][h])  # sinks and the recent window


def test_rows_classify_independently():
    """Two rows with swapped dominant / uniform heads: different classes, budgets and kept tokens, each row
    exactly what it gets alone."""
    q, k = hand_made(2)
    v = torch.randn(2, 3, S, D, generator=torch.Generator().manual_seed(1))
    both = cache_for(2, static_ratio=0.34, static_share=0.5)
    both.prefill(q, k, v)
    assert both.head_classes()["static"].tolist() == [[True, False, False], [False, True, False]]
    assert both.head_classes()["budget"].tolist() == [[18, 9, 9], [9, 18, 9]]
    for row in range(2):
        alone = cache_for(1, static_ratio=0.34, static_share=0.5)
        alone.prefill(q[row : row + 1], k[row : row + 1], v[row : row + 1])
        for key in ("static", "budget", "concentration"):
            assert torch.equal(alone.head_classes()[key][0], both.head_classes()[key][row]), key
        assert head_positions(alone)[0] == head_positions(both)[row]


# ---- compiled decoding ---------------------------------------------------------------------------------
def test_compiled_equals_eager_over_1000_steps_and_other_prompt_lengths():
    """One set of caches, budget 12 slots per head, static share 0.3: a prompt of 20 tokens decoded 1,000
    steps, then prompts of 18 and 10 tokens (the last fits: the even split) 40 steps each; compiles once."""
    budgets = kept_counts_over_prompts("hybrid", budget=12, n_sinks=2, recent_window=4, obs_window=4,
                                       pool_kernel=3, static_share=0.3)
    assert {(7, 17), (17, 7)} & {b[:2] for b in budgets} and (12, 12, 12, 12) in budgets

# ---- CLI, report and eval ------------------------------------------------------------------------------
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


@pytest.mark.parametrize("argv, expected", [
    (["--cache", "hybrid", "--static-ratio", "1.5"], "--static-ratio must lie in [0, 1], got 1.5"),
    (["--cache", "hybrid", "--static-threshold", "-0.1"], "--static-threshold must lie in [0, 1], got -0.1"),
    (["--cache", "hybrid", "--cache-budget", "20"],
     ("below hybrid's per-head floor 36 = n_sinks (4) + max(obs_window (32), recent_window (32)) x 2 KV "
      "heads = 72")),
    (["--cache", "snapkv", "--static-share", "0.5"], "--static-share is not used by --cache snapkv"),
    (["--cache", "adakv", "--static-threshold"], "--static-threshold is not used by --cache adakv"),
    (["--cache", "hybrid", "--static-threshold", "--static-ratio", "0.5"],
     "give --static-threshold or --static-ratio, not both"),
])
def test_bad_input_is_one_line(argv, expected, tiny_checkpoint, capsys):
    code = generate.cli(["--checkpoint", str(tiny_checkpoint), "--prompt", PROMPT, "--max-new-tokens", "12",
                         "--temperature", "0", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and expected in err, err


def test_cli_prints_the_classification(tiny_checkpoint, capsys):
    code = generate.cli(["--checkpoint", str(tiny_checkpoint), "--prompt", PROMPT, "--max-new-tokens", "8",
                         "--temperature", "0", "--cache-config", "hybrid", "--cache-budget", "40",
                         "--n-sinks", "2", "--recent-window", "4", "--obs-window", "4", "--static-threshold",
                         "--static-share", "0.5", "--batch-size", "2", "--compile"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "cache: hybrid + snapkv prompt compression, capacity per layer 40 slots" in out
    assert "static-threshold 0.9" in out and "static-share 0.5" in out
    lines = [line for line in out.splitlines() if line.startswith("hybrid layer ")]
    assert len(lines) == 2 and all("by row and head: " in line for line in lines), out
    for line in lines:
        rows = line.split("by row and head: ")[1].split()
        assert len(rows) == 2 and all(len(r) == 2 and set(r) <= {"S", "D"} for r in rows)


def test_report_counts_types_and_slots():
    q, k = hand_made(2)
    cache = cache_for(2, static_ratio=0.34, static_share=0.5)
    cache.prefill(q, k, torch.randn(2, 3, S, D))
    report = head_class_report([cache])
    assert report == [{"kinds": ["static", "dynamic"], "static": [1, 1], "dynamic": [2, 2], "static_slots": [18, 18],
                       "dynamic_slots": [18, 18], "heads": ["SDD", "DSD"]}]
    assert format_head_class_report(report) == [
        ("hybrid layer 0: KV heads 1 static (18.0 slots each), 2 dynamic (9.0 slots each); by row and head: "
         "SDD DSD")]
    assert head_class_report([]) is None


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    from test_eval import PROSE

    path = tmp_path / "prose.txt"
    path.write_text("\n\n".join(PROSE * 4))
    return path


def test_eval_records_the_classification(text_file, tmp_path):
    from test_eval import run_eval

    flags = ["--tasks", "passkey", "ppl", "attention-loss", "--policies", "hybrid", "--lengths", "300",
             "--samples", "2", "--ppl-length", "200", "--ppl-samples", "1", "--ppl-every", "100", "--budgets",
             "0.4", "--n-sinks", "2", "--recent-window", "8", "--obs-window", "4", "--pool-kernel", "3",
             "--static-share", "0.6"]
    records = run_eval(text_file, tmp_path / "out", *flags)
    hybrid = [r for r in records if r["policy"] == "hybrid"]
    assert {r["task"] for r in hybrid} == {"passkey", "ppl", "attention-loss"}
    assert all("head_classes" not in r for r in records if r["policy"] != "hybrid")
    for r in hybrid:
        assert len(r["head_classes"]) == 2 and all(len(h) == 2 for h in r["head_classes"]), r
        for heads, s, d in zip(r["head_classes"], r["static_slots"], r["dynamic_slots"]):
            assert s + d == 2 * r["capacity"] and heads.count("S") == 1  # round(0.7 x 2) static
            # ppl / attention-loss prefill `capacity` tokens: a prompt that fits keeps the even split
            fits = r.get("prefilled", math.inf) <= r["capacity"]
            assert s == (r["capacity"] if fits else math.floor(0.6 * 2 * r["capacity"] + 0.5))
