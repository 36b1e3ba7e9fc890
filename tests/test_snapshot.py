"""Saved contexts (kv.snapshot, generate.py --save-context / --load-context / --questions): a context compressed
once answers like the run that compressed it, bit for bit; a file from another model, tokenizer, policy, capacity
or format version, or a damaged one, is one line and exit code 2; a save never leaves half a file."""

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from cache_testing import single_thread_fixture, small_factory, tiny_model

import generate
from decode import Decoder, prefill
from kv import snapshot

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)

CONTEXT = "The quick brown fox jumps over the lazy dog. It is 12:30 and we eat 3 apples, said Ann."
QUESTIONS = ["What time is it?", '{"question": "How many apples?"}', "Who said it"]
SEP = "-" * 40
FIGURES = re.compile(r"^(context[ :]|question \d+ \(|continuation: |sample \d+: |compile time: )")
POLICIES = {  # the flags of each case: small windows for a context of ~40 tokens
    "h2o": ["--cache", "h2o", "--cache-budget", "16"],
    "snapkv-4bit": ["--cache", "snapkv", "--cache-budget", "40", "--kv-bits", "4", "--obs-window", "4"],
    "scissorhands": ["--cache", "scissorhands", "--cache-budget", "16", "--history-window", "8",
                     "--drop-interval", "4", "--obs-window", "4"],
    "adakv-pool-4bit": ["--cache", "adakv", "--cache-budget", "16", "--kv-bits", "4", "--obs-window", "4",
                        "--recent-window", "4"],
    "window-tiers": ["--cache", "window", "--cache-budget", "16", "--warm-tokens", "1.0", "--page-size", "4",
                     "--recall-slots", "8"],
}
COMMON = ["--temperature", "0", "--max-new-tokens", "5", "--ignore-eos"]


def run(capsys, ckpt: Path, *argv: str) -> tuple[int, str, str]:
    code = generate.cli(["--checkpoint", str(ckpt), *COMMON, *argv])
    out, err = capsys.readouterr()
    return code, out, err


def answers(out: str) -> list[str]:
    """The texts printed before each separator, without the figure lines around them."""
    return ["\n".join(line for line in block.split("\n") if not FIGURES.match(line)).strip("\n")
            for block in out.split(SEP + "\n")[:-1]]


@pytest.fixture(scope="module")
def questions(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("q") / "questions.txt"
    path.write_text("\n".join(QUESTIONS) + "\n")
    return path


# ---- in memory --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, kv_bits, tiers", [
    ("h2o", None, None), ("scissorhands", 4, None), ("adakv", 4, None), ("window", None, {"warm_tokens": 1.0, "page_size": 4, "recall_slots": 4}),
])
def test_restore_is_bit_for_bit_and_decodes_the_same(policy, kv_bits, tiers):
    model = tiny_model()
    extra = {"tiers": tiers} if tiers else {}
    model.setup_caches(small_factory(policy, 2, model.args, 30, 12, kept=16, kv_bits=kv_bits, **extra))
    prompt = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(3))
    decoder = Decoder(model)
    with torch.inference_mode():
        first = prefill(model, prompt, 0.0, None)
    snap = snapshot.snapshot(model)
    with torch.inference_mode():
        once = decoder.decode(first, 30, 10)
    after = snapshot.snapshot(model)
    assert any(not torch.equal(snap[n], after[n]) for n in snap)  # decoding moved the state
    snapshot.restore(model, snap)
    for name, b in snapshot.cache_buffers(model).items():
        assert b.dtype == snap[name].dtype and torch.equal(b, snap[name]), name
    with torch.inference_mode():
        again = decoder.decode(first, 30, 10)
    assert torch.equal(again, once)
    assert all(torch.equal(b, after[n]) for n, b in snapshot.cache_buffers(model).items())


# ---- the CLI ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(POLICIES))
def test_saved_context_answers_like_the_run_that_saved_it(case, tiny_checkpoint, questions, tmp_path, capsys):
    flags, saved = POLICIES[case], tmp_path / "context.kvf"
    code, out, err = run(capsys, tiny_checkpoint, "--prompt", CONTEXT, *flags, "--save-context", str(saved),
                         "--questions", str(questions))
    assert code == 0, err
    fresh = answers(out)
    assert len(fresh) == len(QUESTIONS) and len(set(fresh)) > 1, out
    assert "ms saved" in out
    code, out, err = run(capsys, tiny_checkpoint, *flags, "--load-context", str(saved), "--questions", str(questions))
    assert code == 0, err
    assert answers(out) == fresh
    assert out.count("ms saved") == len(QUESTIONS)


def test_continuation_and_single_questions_match(tiny_checkpoint, questions, tmp_path, capsys):
    """--load-context without --prompt continues as the saving run did; --prompt Q answers as --questions does."""
    flags, saved = POLICIES["h2o"], tmp_path / "context.kvf"
    code, out, err = run(capsys, tiny_checkpoint, "--prompt", CONTEXT, *flags, "--save-context", str(saved))
    assert code == 0, err
    (sample,) = answers(out)
    assert sample.startswith(CONTEXT)
    code, out, err = run(capsys, tiny_checkpoint, *flags, "--load-context", str(saved))
    assert code == 0, err
    assert answers(out) == [sample[len(CONTEXT):]]
    # the questions' room was not reserved by this save: the evicting h2o cache needs none
    code, out, err = run(capsys, tiny_checkpoint, *flags, "--load-context", str(saved), "--questions", str(questions))
    assert code == 0, err
    together = answers(out)
    for i, line in enumerate(QUESTIONS):
        question = json.loads(line)["question"] if line.startswith("{") else line
        code, out, err = run(capsys, tiny_checkpoint, *flags, "--load-context", str(saved), "--prompt", question)
        assert code == 0, err
        assert answers(out) == [together[i]], question


def test_compiled_questions_match_eager_without_recompiles(tiny_checkpoint, questions, tmp_path, capsys,
                                                            monkeypatch):
    from compilecache import dynamo_count

    flags, saved = POLICIES["snapkv-4bit"], tmp_path / "context.kvf"
    code, out, err = run(capsys, tiny_checkpoint, "--prompt", CONTEXT, *flags, "--save-context", str(saved),
                         "--questions", str(questions))
    assert code == 0, err
    eager = answers(out)
    seen, restore = [], snapshot.restore

    def counting(model, snap):  # before each question: nothing compiled since the previous one
        seen.append(dynamo_count("recompiles"))
        restore(model, snap)

    monkeypatch.setattr(snapshot, "restore", counting)
    torch._dynamo.reset()
    code, out, err = run(capsys, tiny_checkpoint, *flags, "--load-context", str(saved), "--questions", str(questions),
                         "--compile")
    assert code == 0, err
    assert "new graphs" not in err
    assert len(seen) == 1 + len(QUESTIONS)  # the file's restore, then one before each question
    assert len(set(seen + [dynamo_count("recompiles")])) == 1
    assert answers(out) == eager


# ---- refusals ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tiny_checkpoint, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("saved") / "context.kvf"
    assert generate.cli(["--checkpoint", str(tiny_checkpoint), *COMMON, "--prompt", CONTEXT, *POLICIES["h2o"],
                         "--save-context", str(path)]) == 0
    return path


def other_checkpoint(tiny_checkpoint: Path, tmp_path: Path, what: str) -> Path:
    if what == "weights":
        from conftest import save_tiny_hf

        from scripts.convert_hf_checkpoint import convert_hf_checkpoint

        save_tiny_hf(tmp_path / "hf", tie=True, rope_scaling=False, seed=1)
        return convert_hf_checkpoint(tmp_path / "hf", tmp_path / "other")
    other = tmp_path / "other"
    shutil.copytree(tiny_checkpoint, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["default_system"] = "You are terse."  # another tokenizer setup: another chat prompt
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    return other


def damaged(saved: Path, tmp_path: Path, how: str) -> Path:
    path, data = tmp_path / "damaged.kvf", saved.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) * 3 // 4])
    elif how == "corrupt":
        path.write_bytes(data[:-40] + bytes(b ^ 0xFF for b in data[-40:]))
    elif how == "garbage":
        path.write_bytes(b"\x00not a saved context" * 5)
    else:  # another format version, or a header without the context: the file otherwise intact
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(str(saved), "pt") as f:
            header = json.loads(f.metadata()[snapshot.HEADER_KEY])
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        if how == "version":
            header["format_version"] = 0
        else:
            del header["context_ids"]
        save_file(tensors, str(path), metadata={snapshot.HEADER_KEY: json.dumps(header)})
    return path


@pytest.mark.parametrize("case, expected", [
    ("weights", "does not match this checkpoint's model weights"),
    ("tokenizer", "does not match this checkpoint's tokenizer"),
    ("policy", 'policy "h2o", these flags give "window"'),
    ("capacity", "capacities [16, 16], these flags give [14, 14]"),
    ("kv_format", "kv format kv_bits null, these flags give 8"),
    ("version", "format version 0"),
    ("truncated", "corrupt or truncated"),
    ("corrupt", "is corrupt"),
    ("garbage", "not a saved context"),
    ("fields", "its header lacks fields"),
])
def test_mismatched_or_damaged_context_is_one_line(case, expected, saved, tiny_checkpoint, tmp_path, capsys):
    ckpt, flags, path = tiny_checkpoint, POLICIES["h2o"], saved
    if case in ("weights", "tokenizer"):
        ckpt = other_checkpoint(tiny_checkpoint, tmp_path, case)
        capsys.readouterr()  # the conversion's progress bar
    elif case == "policy":
        flags = ["--cache", "window", "--cache-budget", "16"]
    elif case == "capacity":
        flags = ["--cache", "h2o", "--cache-budget", "14"]
    elif case == "kv_format":
        flags = [*flags, "--kv-bits", "8"]
    elif case in ("version", "truncated", "corrupt", "garbage", "fields"):
        path = damaged(saved, tmp_path, case)
    code, out, err = run(capsys, ckpt, *flags, "--load-context", str(path), "--prompt", "What time is it?")
    assert code == 2, out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], err


def test_interrupted_save_leaves_no_file(tmp_path, monkeypatch):
    model = tiny_model()
    model.setup_caches(small_factory("h2o", 1, model.args, 20, 4))
    with torch.inference_mode():
        prefill(model, torch.randint(0, 64, (1, 20)), 0.0, None)
    target = tmp_path / "context.kvf"

    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        snapshot.save_context(target, model, None, {"context_ids": [[1, 2]]})
    assert list(tmp_path.iterdir()) == []  # neither the target nor a temporary file
    monkeypatch.undo()
    snapshot.save_context(target, model, None, {"context_ids": [[1, 2]]})
    before = target.read_bytes()
    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        snapshot.save_context(target, model, None, {"context_ids": [[3, 4]]})
    assert list(tmp_path.iterdir()) == [target] and target.read_bytes() == before  # the old file, whole


@pytest.mark.parametrize("argv, expected", [
    (["--save-context", "{tmp}/missing/ctx.kvf"], "--save-context: no folder"),
    (["--load-context", "{saved}", "--compile-prefill"], "leave out --compile-prefill"),
])
def test_context_flags_that_cannot_work_are_one_line(argv, expected, saved, tiny_checkpoint, tmp_path, capsys):
    argv = [a.format(tmp=tmp_path, saved=saved) for a in argv]
    code, _, err = run(capsys, tiny_checkpoint, "--prompt", "a question", *argv)
    assert code == 2 and expected in err and err.strip().count("\n") == 0, err


def test_context_flags_refuse_tensor_parallel_ranks(saved, tiny_checkpoint, capsys, monkeypatch):
    """Each rank holds its own KV heads: one file could not restore them all, so the flags are refused."""
    monkeypatch.setattr(generate.tp, "rank_and_world", lambda: (0, 2))
    code, _, err = run(capsys, tiny_checkpoint, "--load-context", str(saved), "--prompt", "a question")
    assert code == 2 and "tensor parallelism" in err, err


def test_an_unwritable_target_is_one_line(tmp_path):
    model = tiny_model()
    model.setup_caches(small_factory("h2o", 1, model.args, 20, 4))
    with torch.inference_mode():
        prefill(model, torch.randint(0, 64, (1, 20)), 0.0, None)
    (tmp_path / "ctx.kvf").mkdir()  # a folder where the file should go
    with pytest.raises(snapshot.KVFastError, match="cannot write the saved context"):
        snapshot.save_context(tmp_path / "ctx.kvf", model, None, {"context_ids": [[1, 2]]})


def test_one_new_token_is_the_prefills_alone(tiny_checkpoint, capsys):
    code, out, err = run(capsys, tiny_checkpoint, "--prompt", "Hello there", "--max-new-tokens", "1")
    assert code == 0 and "1 new tokens" in out, err


def test_chat_questions_close_the_turn_the_context_opened(tiny_checkpoint, questions, tmp_path, capsys,
                                                          monkeypatch):
    """--chat with questions: the context is the opening of a user turn (system turn, user header, context) and
    each question is fed as its end (question, end of turn, assistant header), saved or asked at once; a context
    saved with --chat is loaded as one (its questions closed the same way), and --chat cannot reopen a context
    saved without it."""
    from tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_checkpoint)
    opening, closing = tokenizer.chat_turn_parts()
    assert tokenizer.chat_prompt("hi") == opening + "hi" + closing and opening and closing
    fed = []
    feed = Decoder.feed
    monkeypatch.setattr(Decoder, "feed", lambda self, chunk, *a, **k: fed.append(chunk[0].tolist()) or
                        feed(self, chunk, *a, **k))
    path = tmp_path / "chat.ctx"
    code, out, err = run(capsys, tiny_checkpoint, *POLICIES["h2o"], "--chat", "--prompt", CONTEXT, "--questions",
                         str(questions), "--save-context", str(path))
    assert code == 0, err
    texts = ["What time is it?", "How many apples?", "Who said it"]
    assert fed == [tokenizer.encode(q + closing) for q in texts]
    header = snapshot.read_header(path)
    assert header["chat_open"] and header["context_ids"][0] == tokenizer.encode(opening + CONTEXT + "\n\n",
                                                                                bos=tokenizer.add_bos)
    fed.clear()
    code, out2, err = run(capsys, tiny_checkpoint, *POLICIES["h2o"], "--load-context", str(path), "--prompt",
                          texts[1])
    assert code == 0, err
    assert fed == [tokenizer.encode(texts[1] + closing)]
    assert answers(out2) == [answers(out)[1]]  # the loaded context answers as the run that saved it
    plain = tmp_path / "plain.ctx"
    assert run(capsys, tiny_checkpoint, *POLICIES["h2o"], "--prompt", CONTEXT, "--save-context", str(plain))[0] == 0
    code, _, err = run(capsys, tiny_checkpoint, *POLICIES["h2o"], "--chat", "--load-context", str(plain), "--prompt",
                       texts[0])
    assert code == 2 and err.strip().count("\n") == 0 and "was saved without --chat" in err, err
