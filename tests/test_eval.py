"""eval.py on a tiny random model with a byte tokenizer and inline text: task generators, scoring, the
prefill-once replay, budget 1.0 == full, perplexity against one batched forward pass, attention loss,
reruns, reports and one-line CLI errors. The passkey sanity check on the real model is marked real_model."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from cache_testing import single_thread_fixture
from numerics import model_depth, tolerance

import eval as ev_mod
from evals import report, tasks
from evals.caches import Combo, Evaluator
from evals.evaluator import batches, evaluate
from evals.store import Store
from model import KVFastError, ModelArgs, Transformer

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)

PROSE = (
    ("The harbor was quiet in the early morning, and the fishing boats rocked gently against the old wooden pier. "
     "A few gulls circled above the water, calling to each other while the sun rose slowly over the hills. "
     "Nobody in the village remembered when the lighthouse had last been painted, but everyone agreed it needed it."),
    ("In the library the clocks ticked at slightly different speeds, which annoyed the head librarian greatly. "
     "She had written three letters to the council about the matter and received no reply to any of them. "
     "Children who visited on Saturdays liked to count the seconds between the ticks and argue about the result."),
    ("Farmers from the valley brought apples, pears and cheese to the market every Thursday afternoon. "
     "The baker on the corner sold bread that was still warm, and the queue often reached the fountain. "
     "When it rained, the stalls were moved under the arches of the town hall, where the echo made bargaining "
     "loud."),
)


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0..255); a plain-text chat template."""

    bos_id = None
    add_bos = False
    stop_ids = frozenset()

    def encode(self, text: str, bos: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def chat_prompt(self, user: str, system: str | None = None) -> str:
        return f"[user] {user} [assistant] "


def tiny_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=48, vocab_size=256,
                     max_seq_len=2048, tie_embeddings=False)
    model = Transformer(args).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "prose.txt"
    path.write_text("\n\n".join(PROSE * 4))
    return path


def run_eval(text_file: Path, out: Path, *flags: str, model: Transformer | None = None) -> list[dict]:
    """eval.evaluate on the tiny model (main() would load a checkpoint); returns the records."""
    args = ev_mod.parse_args(["--haystack", str(text_file), "--ppl-text", str(text_file), "--out", str(out),
                              "--device", "cpu", *flags])
    evaluator = Evaluator(model or tiny_model(), ByteTokenizer(), args)
    store = Store(out, {"run": "test"}, args.overwrite)
    evaluate(evaluator, store)
    return list(store.records.values())


# ---- generators --------------------------------------------------------------------------------------------
def sentences() -> list[list[int]]:
    tok = ByteTokenizer()
    return tasks.encode_sentences(tok, tasks.prose_sentences("\n\n".join(PROSE)))


@pytest.mark.parametrize("task", tasks.RETRIEVAL_TASKS)
@pytest.mark.parametrize("chat", [False, True])
def test_generators_are_deterministic_and_exact(task, chat):
    tok = ByteTokenizer()
    framing = tasks.Framing.make(tok, chat)
    def make(seed: int) -> list[tasks.Prompt]:
        return tasks.make_prompts(task, tok, framing, 700, 5, seed, [0.2, 0.5, 0.8], sentences())

    a, b, c = make(0), make(0), make(1)
    assert [(p.context, p.question, p.answers) for p in a] == [(p.context, p.question, p.answers) for p in b]
    assert [p.answers for p in a] != [p.answers for p in c]
    assert {len(p.context) + len(p.question) for p in a} == {700}  # every prompt exactly `length` tokens
    assert len({len(p.question) for p in a}) == 1  # one question length per cell: the samples batch
    for p in a:
        question = tok.decode(p.question)
        if chat:
            assert question.rstrip().endswith(("is", "are")) and "[assistant]" in question
        if task != "passkey":
            assert p.meta["key"] in question


@pytest.mark.parametrize("task", tasks.RETRIEVAL_TASKS)
def test_needle_is_present_at_the_stated_depth(task):
    tok = ByteTokenizer()
    framing = tasks.Framing.make(tok, False)
    depths = [0.0, 0.25, 0.5, 0.75, 1.0]
    for p in tasks.make_prompts(task, tok, framing, 1200, 5, 3, depths, sentences()):
        text = tok.decode(p.context)
        for answer in p.answers:
            assert text.count(answer) == (2 if task == "passkey" else 1)  # passkey states its key twice
        offset = p.meta["needle_offset"] if task == "passkey" else p.meta["needle_offsets"][0]
        needle = tok.decode(p.context[offset : offset + 80])
        assert needle.lstrip().startswith("The pass key is" if task == "passkey" else "One of the special magic")
        assert p.answers[0] in needle
        # the recorded depth is the exact fraction of haystack before the needle, close to the requested one
        intro = len(tok.encode(tasks.PASSKEY_INTRO if task == "passkey" else tasks.NIAH_INTRO))
        n_needles = 1 if task == "passkey" else len(p.meta["needle_offsets"])
        needle_len = p.meta["needle_tokens"] if task == "passkey" else 56
        hay = len(p.context) - intro - n_needles * needle_len
        before = offset - intro - sum(1 for o in p.meta.get("needle_offsets", [])[1:] if o < offset) * needle_len
        assert abs(before / hay - p.meta["depth"]) < 0.02
        unit = 100 if task == "passkey" else 250  # needles sit on unit boundaries
        assert abs(p.meta["depth"] - p.meta["requested_depth"]) <= unit / hay + 1e-9


def test_noise_haystack_is_rulers_filler():
    """--haystack noise: the needles sit in the passkey filler (RULER's niah_single_1 haystack), exact length."""
    tok = ByteTokenizer()
    units = tasks.haystack_units(tok, tasks.NOISE)
    assert units == [tok.encode(tasks.PASSKEY_FILLER)]
    for p in tasks.make_prompts("niah_multikey", tok, tasks.Framing.make(tok, False), 900, 3, 0, [0.5], units):
        text = tok.decode(p.context)
        assert len(p.context) + len(p.question) == 900 and text.count("One of the special magic numbers") == 4
        assert text.count("The grass is green.") >= 3 and p.answers[0] in text


def test_text_cleaning_and_windows():
    raw = "Table of Contents\n\n1. Intro\n\nChapter\xa01. Hello\n\n   A wrapped\n   paragraph {with} braces.\n\n" \
          "═══════\n\n   Second  paragraph."
    assert tasks.clean_text(raw) == "Chapter 1. Hello\n\nA wrapped paragraph with braces.\n\nSecond paragraph."
    ids = list(range(1000))
    w = tasks.text_windows(ids, 100, 4, seed=0, bos=7)
    assert w == tasks.text_windows(ids, 100, 4, seed=0, bos=7)
    assert all(len(x) == 100 and x[0] == 7 for x in w)
    starts = [x[1] for x in w]
    assert all(b - a >= 99 for a, b in itertools.pairwise(starts))  # non-overlapping
    with pytest.raises(KVFastError):
        tasks.text_windows(ids, 600, 2, seed=0)


# ---- scoring -------------------------------------------------------------------------------------------------
def test_scoring_on_hand_made_cases():
    assert tasks.score_passkey(" 12345. Remember it.", "12345") == 1.0
    assert tasks.score_passkey("12345", "12345") == 1.0
    assert tasks.score_passkey(" 123456", "12345") == 0.0  # a longer number is not the key
    assert tasks.score_passkey(" 54321 or 12345", "12345") == 0.0  # the first number counts
    assert tasks.score_passkey(" unknown", "12345") == 0.0
    assert tasks.string_match_all(" 1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert tasks.string_match_all(" 1234567.", ["1234567", "7654321", "1111111", "2222222"]) == 0.25
    assert tasks.string_match_all(" None", ["1234567"]) == 0.0
    assert tasks.string_match_all("The ANSWER", ["answer"]) == 1.0  # case-insensitive, as RULER
    assert tasks.string_match_part(" 7654321", ["1234567", "7654321"]) == 1.0
    assert tasks.score("niah_multivalue", "1, 2", ["1", "3"]) == 0.5


# ---- the evaluation ------------------------------------------------------------------------------------------
ALL_POLICIES = ["full", "window", "random", "h2o", "scissorhands", "snapkv", "pyramidkv", "knorm", "tova", "ema",
                "expected_attention", "kvzip"]
SMALL = ["--n-sinks", "2", "--history-window", "16", "--obs-window", "4", "--pool-kernel", "3"]


def test_budget_one_scores_exactly_as_full(text_file, tmp_path):
    records = run_eval(text_file, tmp_path / "out", "--tasks", "passkey", "niah_single", "fidelity", "ppl",
                       "--policies", *ALL_POLICIES, "--budgets", "1.0", "--lengths", "400", "--samples", "3",
                       "--ppl-length", "256", "--ppl-samples", "2", "--ppl-every", "128", "--fidelity-tokens", "8",
                       "--ppl-decode-all", *SMALL)
    full = {(r["task"], r["index"]): r for r in records if r["policy"] == "full"}
    assert len(full) == 3 + 3 + 3 + 2
    others = [r for r in records if r["policy"] != "full"]
    assert {r["policy"] for r in others} == set(ALL_POLICIES) - {"full"}
    for r in others:
        ref = full[(r["task"], r["index"])]
        if r["task"] == "fidelity":
            assert r["metrics"]["kl"] < 1e-6 and r["metrics"]["top1"] == 1.0 and r["metrics"]["prefix"] == 8
        elif r["task"] == "ppl":
            for k, v in r["metrics"].items():
                assert v == pytest.approx(ref["metrics"][k], rel=1e-5), (r["policy"], k)
        else:
            assert r["prediction"] == ref["prediction"] and r["score"] == ref["score"], r["policy"]
            assert len(r["prediction"]) > 0
    # the answers really vary (a degenerate model would make this test vacuous)
    assert len({r["prediction"] for r in full.values() if r["task"] == "passkey"}) > 1


def test_policies_decoded_together_match_one_at_a_time(text_file, tmp_path):
    """MultiCache batches every policy of a budget in one decode step; with real evictions, the results equal
    those of each policy decoded alone (--group-gb 0 puts every policy in its own batch)."""
    flags = ("--tasks", "passkey", "fidelity", "ppl", "--policies", *ALL_POLICIES, "--budgets", "0.4",
             "--lengths", "600", "--samples", "2", "--ppl-length", "384", "--ppl-samples", "2", "--ppl-every", "128",
             "--fidelity-tokens", "8", "--recent-window", "8", "--drop-interval", "8", *SMALL)
    model = tiny_model(2)
    together = {r["key"]: r for r in run_eval(text_file, tmp_path / "a", *flags, model=model)}
    alone = {r["key"]: r for r in run_eval(text_file, tmp_path / "b", *flags, "--group-gb", "0", model=model)}
    assert together.keys() == alone.keys() and len(together) == len(ALL_POLICIES) * (2 + 2 + 2)
    differs = 0
    for key, a in together.items():
        b = alone[key]
        if a["task"] == "passkey":
            assert a["prediction"] == b["prediction"], key
        else:
            for k, v in a["metrics"].items():
                assert v == pytest.approx(b["metrics"][k], rel=1e-4, abs=1e-5), (key, k)
        if a["task"] == "fidelity" and a["policy"] != "full":
            differs += a["metrics"]["kl"] > 1e-4
    assert differs > 0  # evictions really happened


def test_newest_only_policy_diverges_from_full(text_file, tmp_path):
    """A deliberately broken policy (only the newest tokens, no sinks) loses fidelity and perplexity."""
    records = run_eval(text_file, tmp_path / "out", "--tasks", "fidelity", "ppl", "--policies", "full", "window",
                       "--budgets", "0.25", "--lengths", "700", "--samples", "3", "--ppl-length", "512",
                       "--ppl-samples", "2", "--fidelity-tokens", "12", "--n-sinks", "0")
    fid = [r for r in records if r["task"] == "fidelity" and r["policy"] == "window"]
    assert sum(r["metrics"]["kl"] for r in fid) / len(fid) > 0.01
    ppl = {r["policy"]: r["metrics"]["ppl@512"] for r in records if r["task"] == "ppl" and r["index"] == 0}
    assert ppl["window"] != ppl["full"]


def test_ppl_decode_path_equals_one_batched_forward_pass():
    model = tiny_model(1)
    ids = torch.randint(0, 256, (2, 300), generator=torch.Generator().manual_seed(0))
    args = ev_mod.parse_args(["--device", "cpu"])
    ev = Evaluator(model, ByteTokenizer(), args)
    with torch.inference_mode():
        caches = ev.caches(Combo("full", None), 2, 300, 0)
        ev.install(caches)
        model(ids[:, :1])  # prefill of the first token; every other token goes through the decode step
        first = model.logits(model.hidden(ids[:, :1]))  # (the same logits, for the first prediction)
        nll_decode = torch.cat([-torch.log_softmax(first[:, 0], -1).gather(-1, ids[:, 1:2]),
                                ev.decode_nll(ids, 1)], 1)
        model.setup_caches(lambda i: None)
        logits = model(ids, all_logits=True)  # one batched causal forward pass, no cache at all
        nll_batched = -torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    ppl_decode, ppl_batched = nll_decode.mean().exp().item(), nll_batched.mean().exp().item()
    # one token at a time against one causal pass: the same sums in another order (a logit's depth), and a
    # log-softmax over the vocabulary; the perplexity is exp(mean NLL): its relative error is the NLL's error
    tol = tolerance(float(nll_batched.abs().max()), depth=model_depth(model.args, ids.shape[1]) + model.args.vocab_size)
    torch.testing.assert_close(nll_decode, nll_batched, **tol)
    assert ppl_decode == pytest.approx(ppl_batched, rel=tol["atol"])


def test_attention_loss(text_file, tmp_path):
    records = run_eval(text_file, tmp_path / "out", "--tasks", "attention-loss", "--policies", "full", "window",
                       "h2o", "scissorhands", "--budgets", "1.0", "0.25", "--ppl-length", "384", "--ppl-samples",
                       "2", "--ppl-every", "128", *SMALL[:4])
    by = {(r["policy"], r["budget"], r["index"]): r for r in records}
    assert len(by) == 3 * 2 * 2 and all(r["task"] == "attention-loss" for r in records)
    for (policy, budget, _), r in by.items():
        loss = r["metrics"]["loss@384"]
        assert len(r["per_layer"]) == 2 and 0 <= loss <= 1
        if budget == 1.0:
            assert loss == pytest.approx(0, abs=1e-6)  # nothing evicted, nothing lost
        else:
            assert loss > 1e-3
            assert r["metrics"]["loss@128"] <= loss + 1e-9  # nothing evicted before the cache fills (96 slots)


def test_modes_rerun_and_reports(text_file, tmp_path):
    out = tmp_path / "out"
    flags = ("--tasks", "passkey", "fidelity", "ppl", "--policies", "full", "h2o", "--budgets", "0.5",
             "--lengths", "500", "--fidelity-lengths", "500", "--samples", "2", "--mode", "agnostic", "aware",
             "--ppl-length", "256",
             "--ppl-samples", "1", "--ppl-every", "128", "--fidelity-tokens", "6")
    model = tiny_model()
    first = run_eval(text_file, out, *flags, model=model)
    assert {r["mode"] for r in first} == {"agnostic", "aware", "-"}
    assert len(first) == 2 * 2 * 2 * 2 + 2  # (passkey, fidelity) x 2 samples x 2 combos x 2 modes + ppl
    # a rerun finds every cell finished and computes nothing
    args = ev_mod.parse_args(["--haystack", str(text_file), "--ppl-text", str(text_file), "--out", str(out), *flags])
    store = Store(out, {"run": "test"}, False)
    evaluate(Evaluator(model, ByteTokenizer(), args), store)
    assert not store.fresh and len(store.records) == len(first)
    # another configuration in the same folder is refused, --overwrite recomputes
    with pytest.raises(KVFastError, match="another configuration"):
        Store(out, {"run": "other"}, False)
    again = run_eval(text_file, out, *flags, "--overwrite", "--samples", "1", model=model)
    assert {r["key"] for r in again} == {r["key"] for r in first}
    saved = json.loads((out / "results.json").read_text())
    assert len(saved["records"]) == len(first)

    text = report.summary(first, {"checkpoint": "tiny", "answer_room": 64, "fidelity_tokens": 6}, 12.0)
    assert "| full | 100% | agnostic |" in text and "| h2o | 50% | aware |" in text
    for header in ("passkey@500", "KL@500", "top-1@500", "prefix@500", "ppl@256"):
        assert header in text
    files = report.plots(first, out)
    assert {f.name for f in files} >= {"overview.png", "passkey.png", "fidelity.png", "ppl.png"}
    assert all(f.stat().st_size > 5000 for f in files)


@pytest.mark.parametrize("flags, message", [
    (["--tasks", "passkey", "sudoku"], "unknown task 'sudoku'"),
    (["--policies", "full", "lru"], "unknown cache policy 'lru'"),
    (["--budgets", "0"], "--budgets: 0"),
    (["--budgets", "2.5"], "--budgets: 2.5"),
    (["--lengths", "64"], "at least 128"),
    (["--samples", "0"], "--samples must be > 0"),
    (["--depths", "1.5"], "--depths"),
    (["--history-window", "8", "--policies", "full", "window"], "--history-window is used by none"),
    (["--mode", "sideways"], "invalid choice"),
    (["--fidelity-tokens", "100"], "--fidelity-tokens cannot exceed --answer-room"),
])
def test_bad_flags_are_one_line_errors(flags, message, capsys):
    with pytest.raises(KVFastError, match=message):
        ev_mod.parse_args(flags)
    assert ev_mod.cli(flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_too_short_prompts_fail_before_any_work(text_file, tmp_path):
    with pytest.raises(KVFastError, match="passkey@200 is too short"):
        run_eval(text_file, tmp_path / "out", "--tasks", "passkey", "niah_multivalue", "--lengths", "600", "200")
    assert not (tmp_path / "out" / "results.json").exists()


def test_batches_fit_memory_and_are_even():
    assert sorted(len(b) for b in batches(20, 8, 1000, 100, 3.0)) == [6, 7, 7]
    assert [i for b in batches(20, 8, 1000, 100, 3.0) for i in b] == list(range(20))
    assert [len(b) for b in batches(20, 8, 4096, 115_200, 1.0)] == [2] * 10
    assert [list(b) for b in batches(3, 8, 10, 1, 1.0)] == [[0, 1, 2]]


# ---- the real model -------------------------------------------------------------------------------------------
@pytest.mark.real_model
@pytest.mark.slow
def test_newest_only_policy_fails_passkey_on_the_default_model(default_checkpoint, tmp_path):
    """full finds early passkeys at 512 tokens; a cache of the newest 25% without sinks cannot."""
    out = ev_mod.main(["--checkpoint", str(default_checkpoint), "--tasks", "passkey", "--policies", "full", "window",
                       "--budgets", "0.25", "--n-sinks", "0", "--lengths", "512", "--samples", "6", "--depths",
                       "0.2", "0.4", "--out", str(tmp_path / "out"), "--no-plots"])
    records = json.loads((out / "results.json").read_text())["records"]
    score = {p: sum(r["score"] for r in records if r["policy"] == p) / 6 for p in ("full", "window")}
    assert score["full"] >= 0.5
    assert score["window"] <= score["full"] - 0.4
