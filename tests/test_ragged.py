"""Ragged batches (generate.py --prompts, ragged.py): rows of different lengths decode as they would alone."""

import json

import pytest
import torch
from cache_testing import generate_tokens, single_thread_fixture, small_params, tiny_model
from numerics import assert_numerically_close, model_depth

import generate
import ragged
from cache import make_cache_factory
from decode import Decoder, prefill

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)

LENGTHS = [5, 23, 11, 30]
N_NEW = 24


def prompts(lengths=LENGTHS, seed=0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (n,), generator=gen).tolist() for n in lengths]


def factories(policy: str, batch: int, longest: int, args, **kwargs):
    params = small_params(policy)
    params.update(kwargs.pop("params", {}))
    budget = kwargs.pop("budget", 16 if policy != "full" else None)
    batched = make_cache_factory(policy, batch, args, longest, N_NEW, budget=budget, **params, **kwargs)
    single = make_cache_factory(policy, 1, args, longest, N_NEW, budget=budget, **params,
                                **{k: v for k, v in kwargs.items() if k not in ("kv_bits", "kv_group_size")})
    return batched, single


def ragged_run(model, rows, policy, decoder=None, **kwargs):
    """Greedy tokens [B, N_NEW] and each step's logits of a ragged batch."""
    longest = max(map(len, rows))
    batched, single = factories(policy, len(rows), longest, model.args, **kwargs)
    batch_caches = [batched(i) for i in range(model.args.n_layers)]
    single_caches = [single(i) for i in range(model.args.n_layers)]
    logits = []
    decoder = decoder or Decoder(model)
    with torch.inference_mode():
        first = ragged.prefill_rows(model, rows, batch_caches, single_caches, prefill, 0.0, None)
        rest = decoder.decode(first, longest, N_NEW - 1, on_logits=lambda i, lg: logits.append(lg[:, -1]))
    return torch.cat([first, rest], 1), logits


def separate_runs(model, rows, policy, **kwargs):
    """Each prompt alone, with the caches sized as the batch's (same capacity: budgets are slots)."""
    longest = max(map(len, rows))
    tokens, logits = [], []
    for ids in rows:
        factory, _ = factories(policy, 1, longest, model.args, **kwargs)
        model.setup_caches(factory)
        steps = []
        with torch.inference_mode():
            tokens.append(generate_tokens(model, torch.tensor([ids]), N_NEW, on_logits=lambda i, lg, s=steps: s.append(lg[0, -1])))
        logits.append(steps)
    return torch.cat(tokens), logits


# scissorhands is left out: its queue refresh runs every drop_interval steps of the batch's clock, so a row
# re-ranks at other steps than it would alone (expected_attention's refresh too, hence the long interval here)
@pytest.mark.parametrize("policy,kwargs", [
    ("full", {}), ("window", {}), ("h2o", {}), ("snapkv", {"budget": 16 + N_NEW}), ("tova", {}), ("random", {}),
    ("knorm", {}), ("adakv", {}), ("hybrid", {}), ("fastgen", {}),
    ("expected_attention", {"params": {"refresh_interval": 1000}}),
    ("h2o", {"pos_shift": True}), ("window", {"pos_shift": True}),
])
def test_ragged_rows_decode_as_they_would_alone(policy, kwargs):
    model = tiny_model()
    rows = prompts()
    batch_tokens, batch_logits = ragged_run(model, rows, policy, **kwargs)
    alone_tokens, alone_logits = separate_runs(model, rows, policy, **kwargs)
    assert torch.equal(batch_tokens, alone_tokens)
    for r in range(len(rows)):
        for step in range(N_NEW - 1):
            assert_numerically_close(batch_logits[step][r], alone_logits[r][step],
                                     depth=model_depth(model.args, max(len(p) for p in rows) + N_NEW))


def test_ragged_quantized_kv_matches_alone_up_to_rounding():
    """--kv-bits 8: a row's keys are quantized after the rotation by its offset, a run alone's before it, so the
    codes round differently: the first step's logits differ from the run alone by no more than 8-bit K/V moves a
    run alone's from full precision."""
    model = tiny_model()
    rows = prompts()
    _, batch = ragged_run(model, rows, "h2o", kv_bits=8)
    _, alone = separate_runs(model, rows, "h2o", kv_bits=8)
    _, exact = separate_runs(model, rows, "h2o")
    for r in range(len(rows)):
        rounding = (alone[r][0] - exact[r][0]).abs().max()
        assert 0 < (batch[0][r] - alone[r][0]).abs().max() <= 2 * rounding, r


def test_sinks_count_from_each_rows_first_token():
    model = tiny_model()
    rows = prompts()
    longest = max(map(len, rows))
    batched, single = factories("h2o", len(rows), longest, model.args)
    batch_caches = [batched(i) for i in range(model.args.n_layers)]
    single_caches = [single(i) for i in range(model.args.n_layers)]
    with torch.inference_mode():
        ragged.prefill_rows(model, rows, batch_caches, single_caches, prefill, 0.0, None)
    c = batch_caches[0]
    for r, ids in enumerate(rows):
        start = longest - len(ids)
        assert int(c.row_start[r]) == start
        pos = c.slot_pos[r]
        assert int(pos[pos >= 0].min()) == start  # the row's first token, kept as a sink
        assert c.is_sink(torch.tensor(start + 1)).flatten()[r] and not c.is_sink(torch.tensor(start + 2)).flatten()[r]


@pytest.mark.parametrize("scope", ["step", "block"])
def test_compiled_ragged_equals_eager_and_never_recompiles_across_mixes(scope):
    """Two mixes of lengths with the same longest prompt (so the same capacity): compiled == eager, one graph set."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = tiny_model()
    decoder = Decoder(model, compile=True, scope=scope)
    graphs = []
    for seed, lengths in [(0, [5, 23, 11, 30]), (1, [30, 2, 17, 9])]:
        rows = prompts(lengths, seed)
        eager, _ = ragged_run(model, rows, "h2o")
        compiled, _ = ragged_run(model, rows, "h2o", decoder=decoder)
        assert torch.equal(compiled, eager), lengths
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1], "recompiled for another mix of lengths"


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_cli_decodes_a_prompts_file_in_order(tiny_checkpoint, tmp_path, capsys):
    lines = [json.dumps({"prompt": "Hello there"}), "The quick brown fox jumps over the lazy dog " * 3, "",
             "In 2024\\nnew paragraph"]
    path = write(tmp_path, "prompts.jsonl", "\n".join(lines) + "\n")
    argv = ["--checkpoint", str(tiny_checkpoint), "--prompts", path, "--max-new-tokens", "12", "--temperature", "0",
            "--cache", "h2o", "--cache-budget", "16"]
    assert generate.cli(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.index("Hello there") < out.index("The quick brown fox") < out.index("In 2024\nnew paragraph")
    assert "3 prompts of" in out and "row 2: prompt" in out and "tok/s x 3 rows" in out


@pytest.mark.parametrize("content,flags,message", [
    ("\n\n", [], "holds no prompt"),
    ("hi\n", ["--batch-size", "2"], "--prompts does not combine with --batch-size"),
    ("hi\n", ["--prompt", "hello"], "--prompts does not combine with --prompt"),
    ('{"text": "hi"}\n', [], 'an object with a "prompt" string'),
    ("hi\n" + "word " * 600 + "\n", [], "the longest prompt (line 2)"),
])
def test_bad_prompts_files_are_one_line(tiny_checkpoint, tmp_path, capsys, content, flags, message):
    path = write(tmp_path, "p.txt", content)
    code = generate.cli(["--checkpoint", str(tiny_checkpoint), "--prompts", path, "--max-new-tokens", "4", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err


def test_missing_prompts_file_is_one_line(tiny_checkpoint, tmp_path, capsys):
    code = generate.cli(["--checkpoint", str(tiny_checkpoint), "--prompts", str(tmp_path / "nope.txt")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "not found" in err and len(err.splitlines()) == 1
