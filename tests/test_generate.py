"""The engine core: compiled decode equals eager and never recompiles; the CLI's errors are one line."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cache as kvcache
import decode
import generate
from model import ModelArgs, Transformer

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=96, vocab_size=256,
                 rope_base=10000.0, max_seq_len=256, tie_embeddings=True)


def tiny_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(TINY).eval()
    with torch.no_grad():  # wider than the default init so greedy decoding is not a constant
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 1.0)
    return model


def greedy(model: Transformer, decoder: decode.Decoder, prompt: torch.Tensor, n: int) -> torch.Tensor:
    for c in model.caches:
        c.reset()
    with torch.inference_mode():
        first = decoder.prefill(model, prompt, 0.0, None)
        return torch.cat([first, decoder.decode(first, prompt.shape[1], n - 1)], dim=1)


def test_compiled_decode_matches_eager_and_never_recompiles():
    model = tiny_model()
    prompt = torch.randint(0, TINY.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    model.setup_caches(kvcache.make_cache_factory("full", 2, TINY, 24, 80))
    eager = greedy(model, decode.Decoder(model), prompt, 72)
    torch._dynamo.reset()
    compiled_decoder = decode.Decoder(model, compile=True)
    greedy(model, compiled_decoder, prompt, 8)  # warm-up: the one compilation
    counters = torch._dynamo.utils.counters
    frames_before = counters["stats"]["unique_graphs"]
    recompiles_before = sum(counters["recompiles"].values())
    compiled = greedy(model, compiled_decoder, prompt, 72)  # 71 decode steps
    assert counters["stats"]["unique_graphs"] == frames_before
    assert sum(counters["recompiles"].values()) == recompiles_before
    assert torch.equal(compiled, eager)
    assert len(set(eager[0].tolist())) > 3  # the test would be vacuous on a constant stream


def test_sampling_is_seeded_and_respects_top_k():
    logits = torch.tensor([[[0.0, 5.0, 4.9, -3.0]]])
    torch.manual_seed(0)
    picks = {decode.sample(logits, temperature=1.0, top_k=2).item() for _ in range(200)}
    assert picks == {1, 2}
    assert decode.sample(logits, temperature=0.0).item() == 1


# ---- the CLI --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from conftest import save_tiny_hf

    from scripts.convert_hf_checkpoint import convert_hf_checkpoint

    hf_dir = tmp_path_factory.mktemp("hf")
    save_tiny_hf(hf_dir, tie=True, rope_scaling=False)
    return convert_hf_checkpoint(hf_dir, tmp_path_factory.mktemp("ckpt") / "tiny")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = generate.cli(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_generates_and_reports(tiny_checkpoint, capsys):
    code, out, err = run_cli(capsys, "--checkpoint", str(tiny_checkpoint), "--prompt", "Hello there",
                             "--max-new-tokens", "12", "--temperature", "0", "--ignore-eos", "--batch-size", "2")
    assert code == 0, err
    for figure in ("prefill time", "decode:", "bandwidth achieved", "peak memory", "KV cache physical bytes"):
        assert figure in out
    assert "(float32 products)" in out  # fp32 weights: --prefill-dtype auto keeps fp32 on every CPU


def corrupt(tmp_path: Path, checkpoint: Path, how: str) -> Path:
    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    weights = bad / "model.safetensors"
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "garbage":
        weights.write_bytes(b"\x00not a safetensors file" * 10)
    elif how == "config":
        cfg = (bad / "config.json").read_text().replace('"n_layers": 2', '"n_layers": 3')
        assert cfg != (bad / "config.json").read_text()
        (bad / "config.json").write_text(cfg)
    return bad


@pytest.mark.parametrize("case, expected", [
    ("missing", "checkpoint not found"),
    ("truncated", "corrupt or truncated"),
    ("garbage", "corrupt or truncated"),
    ("config", "does not match the weights"),
    ("unknown_cache", "unknown cache policy"),
    ("too_long", "exceeds the model's maximum length"),
    ("zero_new", "--max-new-tokens must be > 0"),
    ("bad_file", "cannot read prompt file"),
    ("bad_flag", "unrecognized arguments"),
])
def test_cli_errors_are_one_line(case, expected, tiny_checkpoint, tmp_path, capsys):
    ckpt = str(tiny_checkpoint)
    if case in ("truncated", "garbage", "config"):
        ckpt = str(corrupt(tmp_path, tiny_checkpoint, case))
    argv = {
        "missing": ["--checkpoint", str(tmp_path / "nope")],
        "truncated": ["--checkpoint", ckpt],
        "garbage": ["--checkpoint", ckpt],
        "config": ["--checkpoint", ckpt],
        "unknown_cache": ["--checkpoint", ckpt, "--cache", "nosuchpolicy"],
        "too_long": ["--checkpoint", ckpt, "--prompt", "word " * 400],
        "zero_new": ["--checkpoint", ckpt, "--max-new-tokens", "0"],
        "bad_file": ["--checkpoint", ckpt, "--prompt", f"@{tmp_path / 'missing.txt'}"],
        "bad_flag": ["--checkpoint", ckpt, "--no-such-flag"],
    }[case]
    code, _, err = run_cli(capsys, *argv, "--max-new-tokens", "4") if case != "zero_new" else \
        run_cli(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], err


def test_cli_exit_code_in_a_real_process(tmp_path):
    proc = subprocess.run([sys.executable, "generate.py", "--checkpoint", str(tmp_path / "missing")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: checkpoint not found: {tmp_path / 'missing'}"]
