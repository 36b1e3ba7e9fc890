"""fastgen (kv.fastgen, FastGen on the pool): token classes from a tokenizer, the profile choice against a slow
reference, water-filled budgets, what each profile keeps while decoding, the CLI's report and one-line errors.
(Invariants under hypothesis, compiled == eager and exact equality with `full` come from the tests that run
every policy: test_cache_invariants, test_cache_compile.)"""

from __future__ import annotations

import string

import pytest
import torch
from cache_testing import head_positions, kept_counts_over_prompts, single_thread_fixture, tiny_args
from hypothesis import given, settings
from hypothesis import strategies as st

import generate
from attention import attend
from cache import make_cache_factory
from kv import fastgen
from kv.fastgen import choose_profiles, profile_masks, token_classes, water_fill

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)


class FakeTokenizer:
    def __init__(self):
        self.special_tokens = {"<|im_start|>": 3, "<|im_end|>": 4}
        self.bos_id, self.vocab_size = 1, 10
        self.pieces = ["a", "<s>", " the", "", "", ",", " (", "...", "cat!", "\u2014"]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)


def test_token_classes_mark_special_ids_and_punctuation():
    classes = token_classes(FakeTokenizer(), vocab_size=12)  # ids past the tokenizer's vocabulary: other
    S, P, O = fastgen.SPECIAL_TOKEN, fastgen.PUNCT_TOKEN, fastgen.OTHER_TOKEN
    assert classes.tolist() == [O, S, O, S, S, P, P, P, O, P, O, O]


def reference_profiles(votes: torch.Tensor, classes: torch.Tensor, n_sinks: int, n_heavy: int, n_local: int,
                       recovery: float) -> tuple[list[list[int]], list[list[set[int]]]]:
    """One head at a time with Python sets: FastGen's five nested sets and the first that holds `recovery`
    of the votes."""
    B, H, S = votes.shape
    profiles, chosen = [], []
    for b in range(B):
        row_p, row_s = [], []
        for h in range(H):
            v = votes[b, h].tolist()
            special = {i for i in range(S) if i < n_sinks or classes[b, i] == fastgen.SPECIAL_TOKEN}
            punct = special | {i for i in range(S) if classes[b, i] == fastgen.PUNCT_TOKEN}
            heavy = set(sorted(range(S), key=lambda i: (-v[i], i))[:n_heavy])
            frequent = punct | heavy
            local = frequent | set(range(S - n_local, S))
            sets = [special, punct, frequent, local, set(range(S))]
            share = [sum(v[i] for i in s) / sum(v) for s in sets]
            p = next(i for i, x in enumerate(share) if x >= recovery or i == fastgen.FULL)
            row_p.append(p)
            row_s.append(sets[p])
        profiles.append(row_p)
        chosen.append(row_s)
    return profiles, chosen


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("recovery", [0.3, 0.6, 0.95, 0.9999])
def test_profiles_match_the_slow_reference(seed, recovery):
    gen = torch.Generator().manual_seed(seed)
    B, H, S = 2, 4, 24
    # a few heads concentrated on a few tokens, others diffuse: every profile gets chosen somewhere
    votes = torch.rand(B, H, S, generator=gen) ** torch.tensor([1.0, 4.0, 12.0, 30.0]).view(1, H, 1)
    votes = votes.double()
    classes = torch.randint(0, 3, (B, S), generator=gen, dtype=torch.uint8)
    classes[classes == fastgen.SPECIAL_TOKEN] = torch.randint(0, 2, classes[classes == 2].shape, generator=gen,
                                                              dtype=torch.uint8)  # special ids are rare
    masks = profile_masks(votes, classes, n_sinks=2, n_heavy=5, n_local=6)
    profile, recovered = choose_profiles(votes, masks, recovery)
    want, sets = reference_profiles(votes, classes, 2, 5, 6, recovery)
    assert profile.tolist() == want
    for b in range(B):
        for h in range(H):
            kept = masks[b, h, profile[b, h]].nonzero().flatten().tolist()
            assert set(kept) == sets[b][h]
            assert recovered[b, h, profile[b, h]] >= recovery or profile[b, h] == fastgen.FULL


@settings(max_examples=200, deadline=None)
@given(demand=st.lists(st.integers(1, 60), min_size=1, max_size=6), data=st.data())
def test_water_fill_fills_the_pool_within_the_demands_and_the_ceiling(demand, data):
    H = len(demand)
    ceiling = data.draw(st.integers(max(demand), 80))
    pool = data.draw(st.integers(H, H * ceiling))
    grows = data.draw(st.lists(st.booleans(), min_size=H, max_size=H))
    budget = water_fill(demand, pool, grows, ceiling)
    assert sum(budget) == pool and all(0 <= b <= ceiling for b in budget)
    if sum(demand) >= pool:  # min(demand, level): a head below its demand is within one slot of the largest
        assert all(b <= d for b, d in zip(budget, demand))
        top = max(budget)
        assert all(b >= top - 1 for b, d in zip(budget, demand) if b < d)
    else:  # every demand met; the rest to the growing heads first
        assert all(b >= d for b, d in zip(budget, demand))
        if any(grows) and any(b > d for b, d, g in zip(budget, demand, grows) if not g):
            assert all(b == ceiling for b, g in zip(budget, grows) if g)


def fastgen_cache(B: int, S: int, steps: int, budget: int, **params):
    args = tiny_args(n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8)
    defaults = {"n_sinks": 1, "recent_window": 3, "obs_window": 3, "pool_kernel": 3}
    cache = make_cache_factory("fastgen", B, args, S, steps, budget=budget, **{**defaults, **params})(0)
    table = torch.zeros(64, dtype=torch.uint8)  # ids 0-9 punctuation, 10-11 special, the rest other
    table[:10], table[10:12] = fastgen.PUNCT_TOKEN, fastgen.SPECIAL_TOKEN
    cache.bind_classes(table)
    return cache, table


@pytest.mark.parametrize("profile", [fastgen.SPECIAL, fastgen.PUNCT, fastgen.LOCAL])
def test_decoding_keeps_what_the_profile_keeps(profile):
    """Every head forced to one profile after prefill, 40 steps of random ids: special tokens (and punctuation
    for punct) are never evicted while the head holds other unprotected tokens; every head keeps its sink and
    recent window; the budgets never move."""
    B, S, steps, budget = 2, 30, 40, 12
    cache, table = fastgen_cache(B, S, steps, budget)
    gen = torch.Generator().manual_seed(profile)
    ids = torch.randint(0, 64, (B, S + steps), generator=gen)
    q, k, v = torch.randn(B, 4, S, 8, generator=gen), torch.randn(B, 2, S, 8, generator=gen), torch.randn(B, 2, S, 8)
    cache.see_tokens(ids[:, :S])
    cache.prefill(q, k, v)
    cache.profile.fill_(profile)
    budgets = cache.kept().clone()
    kept_class = {fastgen.SPECIAL: (fastgen.SPECIAL_TOKEN,),
                  fastgen.PUNCT: (fastgen.SPECIAL_TOKEN, fastgen.PUNCT_TOKEN)}.get(profile, ())
    for t in range(S, S + steps):
        before = head_positions(cache)
        cache.see_tokens(ids[:, t : t + 1])
        k_all, v_all, mask = cache.update(torch.tensor([t]), torch.randn(B, 2, 1, 8), torch.randn(B, 2, 1, 8))
        _, probs = attend(torch.randn(B, 4, 1, 8, generator=gen), k_all, v_all, mask, want_probs=True, layout=cache.layout)
        cache.observe(probs)
        assert torch.equal(cache.kept(), budgets)
        after = head_positions(cache)
        for b in range(B):
            for h in range(2):
                (victim,) = set(before[b][h]) - set(after[b][h])
                assert 0 not in {victim} and t in after[b][h]  # the sink stays, the new token comes in
                in_class = int(table[ids[b, victim]]) in kept_class and victim < t
                others = [p for p in before[b][h] if 0 < p <= t - 3 and int(table[ids[b, p]]) not in kept_class]
                assert not in_class or not others, (t, victim)
                assert {0, t - 2, t - 1, t} <= set(after[b][h])  # the sink and the recent window (3)


def test_rows_and_layers_compile_once_and_equal_eager():
    """The shared check (1,000 steps, prompts of other lengths): compiled == eager, no recompile."""
    kept = kept_counts_over_prompts("fastgen", budget=12, n_sinks=2, recent_window=4, obs_window=4,
                                    pool_kernel=3, heavy_ratio=0.2, local_ratio=0.2)
    assert (12, 12, 12, 12) in kept  # the 10-token prompt fits: the even split


def test_budgets_follow_the_profiles():
    """recovery 0: every head takes the special profile, whose demand is far below the pool: the rest is split
    evenly; recovery 1: every head wants the whole prompt: water-filled to the even split."""
    B, S = 2, 40
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(B, 4, S, 8, generator=gen), torch.randn(B, 2, S, 8, generator=gen), torch.randn(B, 2, S, 8)
    for recovery, kind in [(0.0, fastgen.SPECIAL), (1.0, fastgen.FULL)]:
        cache, _ = fastgen_cache(B, S, 8, 10, recovery=recovery)
        cache.see_tokens(torch.randint(12, 64, (B, S), generator=gen))
        cache.prefill(q, k, v)
        r = cache.head_classes()
        assert (r["kind"] == kind).all() and (r["budget"] == 10).all()
        assert all(len(head) == 10 for row in head_positions(cache) for head in row)


# ---- CLI ------------------------------------------------------------------------------------------------
PROMPT = "The quick brown fox, it said, jumps over the lazy dog. Then: what? " * 4


@pytest.mark.parametrize("argv, expected", [
    (["--cache", "fastgen", "--recovery", "1.5"], "--recovery must lie in [0, 1], got 1.5"),
    (["--cache", "h2o", "--heavy-ratio", "0.2"], "--heavy-ratio is not used by --cache h2o"),
    (["--cache", "fastgen", "--cache-budget", "40", "--warm-tokens", "1.0"], "fastgen"),
])
def test_bad_input_is_one_line(argv, expected, tiny_checkpoint, capsys):
    code = generate.cli(["--checkpoint", str(tiny_checkpoint), "--prompt", PROMPT, "--max-new-tokens", "12",
                         "--temperature", "0", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and expected in err, err


def test_cli_prints_the_profiles(tiny_checkpoint, capsys):
    code = generate.cli(["--checkpoint", str(tiny_checkpoint), "--prompt", PROMPT, "--max-new-tokens", "8",
                         "--temperature", "0", "--cache-config", "fastgen", "--cache-budget", "40",
                         "--n-sinks", "2", "--recent-window", "4", "--obs-window", "4", "--recovery", "0.9",
                         "--batch-size", "2", "--compile"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "cache: fastgen + snapkv prompt compression, capacity per layer 40 slots" in out
    assert "recovery 0.9" in out
    lines = [line for line in out.splitlines() if line.startswith("fastgen layer ")]
    assert len(lines) == 2 and all("by row and head: " in line for line in lines), out
    for line in lines:
        rows = line.split("by row and head: ")[1].split()
        assert len(rows) == 2 and all(len(r) == 2 and set(r) <= set("SPHLF") for r in rows)


def test_punctuation_of_the_real_vocabulary_is_punctuation():
    """is_punctuation on text: what FastGen's punctuation profile keeps."""
    assert all(fastgen.is_punctuation(c) for c in string.punctuation)
    assert fastgen.is_punctuation(" ...") and fastgen.is_punctuation("\u00bf")
    assert not any(fastgen.is_punctuation(t) for t in ["", " ", "a.", " the", "3", "é"])
