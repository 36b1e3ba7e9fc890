"""eval.py's tier combos (POLICY+warm, kv.tiers) on the tiny model of test_eval: they run through every task,
record their settings and counters, are cached apart from the plain policy, and bad combos are one-line errors;
the attention-loss probe (ShadowCaches) flushes and recalls a tiered follower as decoding alone does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cache_testing import single_thread_fixture
from test_eval import PROSE, ByteTokenizer, run_eval, tiny_model

import cache as kvcache
import eval as ev_mod
from decode import Decoder
from evals import report
from evals.caches import TIER_DEFAULTS, Combo, Evaluator, ShadowCaches, split_combo_policy
from evals.evaluator import combos_of, evaluate
from evals.store import Store, record_key
from model import KVFastError

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)

TASKS = ("passkey", "fidelity", "ppl", "attention-loss")
FLAGS = ("--tasks", *TASKS, "--budgets", "0.4", "--lengths", "600", "--samples", "2", "--ppl-length", "384",
         "--ppl-samples", "2", "--ppl-every", "128", "--fidelity-tokens", "8", "--recent-window", "8", "--n-sinks", "2",
         "--page-size", "8", "--recall-slots", "16")
WARM = "h2o+warm[page-size=8,recall-slots=16]"
# one warm page of one (row, KV head) of the tiny model (head_dim 8, one quantization group): per token, K and V
# each 8 4-bit codes (4 bytes) + an fp32 scale and zero point (8 bytes); 8 tokens per page
PAGE_BYTES = 8 * 2 * 4 + 2 * 2 * 8 + 8 * 2 * 2  # 4-bit codes of K and V; fp16 scale + zero per key channel, per value


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "prose.txt"
    path.write_text("\n\n".join(PROSE * 4))
    return path


def test_warm_combo_runs_every_task_and_records_its_counters(text_file, tmp_path):
    model = tiny_model(2)
    out = tmp_path / "out"
    records = run_eval(text_file, out, *FLAGS, "--policies", "h2o", "h2o+warm", model=model)
    warm = [r for r in records if r["policy"] == WARM]
    plain = [r for r in records if r["policy"] == "h2o"]
    assert {r["task"] for r in warm} == set(TASKS) and len(warm) == len(plain) == 4 * 2
    for r in plain:
        assert "tiers" not in r and "tier_counters" not in r
    for r in warm:
        assert r["key"].split("|")[3] == WARM and r["budget"] == 0.4
        assert r["tiers"] == {**TIER_DEFAULTS, "page_size": 8, "recall_slots": 16}
        c = r["tier_counters"]  # per sample: the batch's sums / its 2 rows
        assert c["page_size"] == 8 and c["warm_bits"] == 4 and c["recall_slots"] == 16 and c["layers"] == 2
        assert c["rows_heads_layers"] == 2 * 2  # KV heads x layers per sample
        assert c["demoted_tokens"] > 0 and c["flushed_pages"] > 0 and c["recalls"] > 0 and c["recall_misses"] > 0
        # bytes moved are pages x page bytes, counted apart from the pages
        assert c["hot_to_warm_bytes"] == pytest.approx((c["flushed_pages"] + c["prompt_pages"]) * PAGE_BYTES)
        assert c["warm_to_hot_bytes"] == pytest.approx(c["recall_misses"] * PAGE_BYTES)
        assert 0 < c["recalled_tokens"] <= 16 * c["rows_heads_layers"]
        if r["task"] == "passkey":  # the 562-token context is compressed to 266 - 16 slots: its rest is demoted
            assert c["prompt_pages"] > 0
    # plain and tiered sit side by side in the summary, the tiered row right below its policy's
    text = report.summary(records, {"checkpoint": "tiny", "answer_room": 64, "fidelity_tokens": 8}, 1.0)
    rows = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| ")]
    assert rows[:4] == ["| policy", "| full", "| h2o", f"| {WARM}"]

    # a rerun computes nothing; other tier settings are other cells (the plain ones stay cached)
    args = ev_mod.parse_args(["--haystack", str(text_file), "--ppl-text", str(text_file), "--out", str(out),
                              "--device", "cpu", *FLAGS, "--policies", "h2o", "h2o+warm"])
    store = Store(out, {"run": "test"}, False)
    evaluate(Evaluator(model, ByteTokenizer(), args), store)
    assert not store.fresh
    more = run_eval(text_file, out, *FLAGS, "--policies", "h2o", "h2o+warm", "--warm-bits", "8", model=model)
    assert len(more) == len(records) + 8
    assert {r["policy"] for r in more} == {"full", "h2o", WARM, "h2o+warm[warm-bits=8,page-size=8,recall-slots=16]"}
    saved = json.loads((out / "results.json").read_text())["records"]
    assert {r["key"] for r in saved} == {r["key"] for r in more}


def test_warm_combo_without_recall_slots_equals_its_policy(text_file, tmp_path):
    """--recall-slots 0: tiers demote and count, but the hot slots are the policy's alone, as without tiers;
    every task then gives the plain policy's numbers exactly (prefill length, decoding, shadow probe)."""
    records = run_eval(text_file, tmp_path / "out", *FLAGS[:-2], "--recall-slots", "0", "--policies", "h2o",
                       "h2o+warm", model=tiny_model(2))
    by = {r["key"]: r for r in records}
    tiered = [r for r in records if r["policy"] == "h2o+warm[page-size=8,recall-slots=0]"]
    assert len(tiered) == 8
    for r in tiered:
        p = by[r["key"].replace("+warm[page-size=8,recall-slots=0]", "")]
        assert (r.get("prediction"), r["score"], r.get("metrics")) == (p.get("prediction"), p["score"],
                                                                         p.get("metrics")), r["key"]
        assert r["tier_counters"]["demoted_tokens"] > 0 and r["tier_counters"]["recalls"] == 0


def test_combo_labels_round_trip():
    args = ev_mod.parse_args(["--policies", "h2o", "h2o+warm", "snapkv+warm", "--budgets", "0.25", "0.5"])
    combos = combos_of(args)
    assert [c.label() for c in combos] == ["full", "h2o@0.25", "h2o@0.5", "h2o@0.25+warm", "h2o@0.5+warm",
                                           "snapkv@0.25+warm", "snapkv@0.5+warm"]
    for c in combos[1:]:
        policy, warm, shift = split_combo_policy(c.name)  # the recorded name gives the combo back
        assert Combo(policy, c.budget, tuple(TIER_DEFAULTS.items()) if warm else None, shift) == c
        assert record_key("passkey", 600, 0, c, "agnostic") == f"passkey|600|0|{c.name}|{c.budget}|agnostic"
    shifted = combos_of(ev_mod.parse_args(["--policies", "window", "--pos-shift", "--budgets", "0.25"]))[1]
    assert shifted.label() == "window@0.25+shift" and split_combo_policy(shifted.name) == ("window", False, True)
    plain = record_key("passkey", 600, 0, combos[1], "agnostic")
    assert plain == "passkey|600|0|h2o|0.25|agnostic"  # plain keys as before tiers: old results stay cached
    args = ev_mod.parse_args(["--policies", "h2o+warm", "--budgets", "0.25", "--warm-bits", "8", "--recall-slots",
                              "32", "--warm-tokens", "1"])
    c = combos_of(args)[1]
    assert c.label() == "h2o@0.25+warm[warm-bits=8,recall-slots=32]" and c.name.startswith("h2o+warm[")
    assert dict(c.tiers) == {**TIER_DEFAULTS, "warm_bits": 8, "recall_slots": 32}


def test_hybrid_warm_combo_demotes_and_recalls_on_the_pool(text_file, tmp_path):
    """hybrid+warm: the pool policy with tiers decodes alone (a pool group and a tiered one at once), demotes what
    each head evicts and recalls pages into each KV head's recall slots."""
    records = run_eval(text_file, tmp_path / "out", "--tasks", "passkey", "--budgets", "0.4", "--lengths", "600",
                       "--samples", "2", "--recent-window", "8", "--n-sinks", "2", "--page-size", "8",
                       "--recall-slots", "16", "--policies", "hybrid", "hybrid+warm", model=tiny_model(2))
    warm = [r for r in records if r["policy"].startswith("hybrid+warm")]
    assert len(warm) == 2 and len([r for r in records if r["policy"] == "hybrid"]) == 2
    for r in warm:
        c = r["tier_counters"]
        assert c["prompt_pages"] > 0 and c["recalls"] > 0 and c["recall_misses"] > 0
        assert c["warm_to_hot_bytes"] == pytest.approx(c["recall_misses"] * PAGE_BYTES)
        assert 0 < c["recalled_tokens"] <= 16 * c["rows_heads_layers"]


@pytest.mark.parametrize("flags, message", [
    (["--policies", "full+warm"], "--policies full\\+warm: tier flags .* full: it never evicts"),
    (["--policies", "h2o", "adakv+warm"], "--policies adakv\\+warm: tier flags .* moves slots between KV heads"),
    (["--policies", "kvzip+warm"], "--policies kvzip\\+warm: tier flags .* do not apply"),
    (["--policies", "h2o+cold"], "unknown cache policy 'h2o\\+cold'"),
    (["--policies", "h2o+warm", "--warm-bits", "3"], "--warm-bits must be 8 or 4"),
    (["--policies", "h2o+warm", "--page-size", "0"], "--page-size must be a whole number >= 1"),
    (["--policies", "h2o+warm", "--page-size", "16", "--warm-tokens", "8"], "smaller than one page"),
    (["--policies", "h2o+warm", "--page-size", "16", "--recall-slots", "24"], "must be a whole number of pages"),
    (["--policies", "h2o", "--warm-bits", "8"], "--warm-bits is used by none of the policies"),
])
def test_bad_warm_combos_are_one_line_errors(flags, message, capsys):
    with pytest.raises(KVFastError, match=message):
        ev_mod.parse_args(flags)
    assert ev_mod.cli(flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_tier_settings_that_do_not_fit_a_length_fail_before_any_work(text_file, tmp_path):
    with pytest.raises(KVFastError, match=r"h2o@0.25\+warm\[recall-slots=128\] at 400 tokens: --recall-slots 128 "
                                          "does not fit the hot budget of 116 slots"):
        run_eval(text_file, tmp_path / "out", "--tasks", "passkey", "--policies", "h2o+warm", "--budgets", "0.25",
                 "--lengths", "400", "--ppl-every", "100", "--recall-slots", "128")
    assert not (tmp_path / "out" / "results.json").exists()


def test_shadow_caches_flush_and_recall_a_tiered_follower_as_decoding_alone():
    """window evicts by position and ignores attention, so its layer-0 cache sees the same keys, queries and
    victims alone and as the attention-loss probe's follower: the tier state (warm pages, recalls, counters)
    must come out identical."""
    model = tiny_model(3)
    B, T, P = 2, 300, 60
    ids = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0))
    tiers = {"warm_tokens": 1.0, "page_size": 8, "recall_slots": 16, "recall_interval": 8}

    def tiered() -> list:
        f = kvcache.make_cache_factory("window", B, model.args, T, 0, budget=80, n_sinks=2, tiers=tiers)
        return [f(i) for i in range(model.args.n_layers)]

    def run(caches: list) -> None:
        model.setup_caches(lambda i: caches[i])
        with torch.inference_mode():
            model(ids[:, :P])
            Decoder(model).decode(ids[:, P : P + 1], P, T - P - 1, forced=ids[:, P + 1 :])

    alone = tiered()
    run(alone)
    followers = tiered()
    full = kvcache.make_cache_factory("full", B, model.args, T, 0)
    run([ShadowCaches(full(i), [followers[i]], T) for i in range(model.args.n_layers)])
    counts = alone[0].tier_counts()
    assert counts["recalls"] > 10 and counts["recall_misses"] > 0 and counts["flushed_pages"] > 0
    assert followers[0].tier_counts() == counts
    for (name, a), (_, b) in zip(alone[0].named_buffers(), followers[0].named_buffers(), strict=True):
        assert torch.equal(a, b), name
