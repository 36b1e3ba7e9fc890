"""shared_context (evals.shared): one context with N needles, each asked in turn of one compressed cache. The
generator asks every key once with equally long questions; each turn is scored against its own key's value;
reuse (compress once, snapshot, restore before each question) answers every question with the same greedy
tokens as a fresh compression for that question, eager and compiled, for plain, quantized, tiered and pool
caches; eval.py records it in its grid and its report."""

from __future__ import annotations

import argparse

import pytest
import torch
from cache_testing import single_thread_fixture
from test_eval import PROSE, ByteTokenizer, run_eval, sentences, tiny_model

import eval as ev_mod
from decode import configure_torch
from evals import report, shared, tasks
from evals.caches import Combo, Evaluator

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "prose.txt"
    path.write_text("\n\n".join(PROSE * 4))
    return path


def prompts(n: int = 2, questions: int = 3, length: int = 700) -> list[tasks.Prompt]:
    tok = ByteTokenizer()
    return tasks.make_prompts(tasks.SHARED, tok, tasks.Framing.make(tok, False), length, n, 0, [0.2, 0.8],
                              sentences(), questions)


def test_every_key_is_asked_once_with_its_own_value():
    for p in prompts(questions=4):
        assert len(p.turns) == 4 and len(p.context) + len(p.question) == 700
        keys = p.meta["keys"]
        assert len(set(keys)) == 4 and len({len(q) for q, _ in p.turns}) == 1  # one batch, one question length
        text = bytes(p.context).decode()
        for key, (question, refs) in zip(keys, p.turns):
            assert key in bytes(question).decode()
            assert f" One of the special magic numbers for {key} is: {refs[0]}." in text
    assert prompts() == prompts()  # seeded
    # niah_multikey's prompts are untouched by the parameter: one question, no follow-ups
    tok = ByteTokenizer()
    one = tasks.make_prompts("niah_multikey", tok, tasks.Framing.make(tok, False), 700, 1, 0, [0.5], sentences())[0]
    assert one.followups == [] and len(one.turns) == 1


def test_turns_are_scored_each_against_its_own_key(text_file, tmp_path):
    records = run_eval(text_file, tmp_path, "--tasks", "shared_context", "--lengths", "700", "--samples", "2",
                       "--shared-questions", "3", "--policies", "window", "--budgets", "0.5", "--ppl-every", "64")
    by_index = {p.index: p for p in prompts(questions=3)}
    assert {r["policy"] for r in records} == {"full", "window"} and len(records) == 4
    for r in records:
        p = by_index[r["index"]]
        assert r["answers"] == [refs for _, refs in p.turns] and len(r["prediction"]) == 3
        assert r["turns"] == [tasks.score(tasks.SHARED, pred, refs) for pred, (_, refs) in zip(r["prediction"], p.turns)]
        assert r["score"] == pytest.approx(sum(r["turns"]) / 3)
        assert r["fresh_s"] > r["reuse_s"] > 0 and r["restore_s"] >= 0 and len(r["answer_s"]) == 3
        assert 0 < r["bytes_frac"]
    # a hand-made prediction: the second key's value found, the others not
    assert tasks.score(tasks.SHARED, "are: 1234567.", ["1234567"]) == 1.0
    assert tasks.score(tasks.SHARED, "are: 1234568.", ["1234567"]) == 0.0
    table = report.summary(records, {})
    assert "## Shared context" in table and "| q1 | q2 | q3 |" in table


CASES = [Combo("h2o", 0.3), Combo("snapkv", 0.4, kv_bits=4), Combo("adakv", 0.3),
         Combo("window", 0.3, (("warm_tokens", 1.0), ("warm_bits", 4), ("page_size", 4), ("recall_slots", 8),
                               ("recall_interval", 1), ("recall_installs", 0.25)))]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_reuse_answers_as_a_fresh_compression_for_every_question(compile):
    configure_torch(compile)
    args = argparse.Namespace(params={}, compile=compile, compile_scope=None, budget_unit="slots")
    model = tiny_model()
    ev = Evaluator(model, ByteTokenizer(), args)
    batch = prompts(n=2, questions=3)
    ctx = torch.tensor([p.context for p in batch])
    turns = [torch.tensor([p.turns[t][0] for p in batch]) for t in range(3)]
    S, room = ctx.shape[1], len(batch[0].question) + 20
    with torch.inference_mode():
        kv, _ = ev.record(ctx)
        for combo in CASES if not compile else CASES[1:]:  # compiled: quantized, pool and tiered
            caches = ev.caches(combo, 2, S, room)
            ev.install(caches)
            memos = [{} for _ in caches]
            reused, _ = shared.answer_turns(ev, caches, kv, ctx, turns, memos, 12, reuse=True)
            fresh, _ = shared.answer_turns(ev, caches, kv, ctx, turns, memos, 12, reuse=False)
            for t, (a, b) in enumerate(zip(reused, fresh)):
                assert torch.equal(a, b), f"{combo.label()}: question {t + 1}"
            assert any(not torch.equal(reused[0], r) for r in reused[1:])  # the questions do differ


def test_shared_context_needs_the_agnostic_mode(capsys):
    assert ev_mod.cli(["--tasks", "shared_context", "--mode", "aware"]) == 2
    assert "needs --mode agnostic" in capsys.readouterr().err
