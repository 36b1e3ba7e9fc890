"""bench.py engine --peers llama.cpp: the peer runs in its own environment, fails in one line, and (where its
environment exists) decodes the default model's GGUF greedily into the tokens our model produces."""

import subprocess
import sys

import pytest
import torch

import bench
from benchmarks.common import interleaved, time_ours
from benchmarks.engine import agreement
from model import KVFastError, Transformer
from scripts import peer_llamacpp
from scripts.prepare import default_gguf


def test_install_uses_no_deps_and_fails_in_one_line(tmp_path, monkeypatch) -> None:
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text("")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    seen = []

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for "
                                                       "llama-cpp-cffi==0.4.20\n")

    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(KVFastError) as e:
        peer_llamacpp.time_llamacpp(gguf, [1, 2, 3], 4, 1, 1, env=env)
    assert "\n" not in str(e.value) and str(e.value).startswith("cannot install llama-cpp-cffi==0.4.20")
    assert "--no-deps" in seen[0]  # the wheel's own dependencies (transformers, ...) stay out


def test_worker_failure_is_one_line(tmp_path) -> None:
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").symlink_to(sys.executable)
    (env / ".kvfast-installed").write_text("\n".join(peer_llamacpp.LLAMACPP_REQUIREMENTS) + "\n")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(KVFastError) as e:  # our python has no llama.cpp module: the worker dies at import
        peer_llamacpp.time_llamacpp(gguf, [1, 2, 3], 4, 1, 1, env=env)
    assert str(e.value).startswith("llama.cpp worker failed (exit 1)") and "\n" not in str(e.value)


def test_missing_gguf_and_unknown_peer(tmp_path) -> None:
    with pytest.raises(KVFastError, match="needs the GGUF"):
        peer_llamacpp.time_llamacpp(tmp_path / "none.gguf", [1], 2, 1, 1, env=tmp_path)
    with pytest.raises(KVFastError, match="invalid choice: 'vllm'"):
        bench.main(["--peers", "vllm"])


def test_engine_runs_alternate_after_one_untimed_round() -> None:
    """The engine table times every engine's repeats in turn (a shared host drifts between separately timed
    rows): the first round is untimed, then the medians of the rest."""
    calls = []

    def engine(name: str, times: list[float]):
        def run() -> dict:
            calls.append(name)
            t = times[len([c for c in calls if c == name]) - 1]
            return {"prefill_s": t, "tok_s": 1 / t, "tokens": [len(calls)]}
        return run

    rows = interleaved({"a": engine("a", [9, 1, 3, 2]), "b": engine("b", [9, 4, 6, 5])}, repeats=3)
    assert calls == ["a", "b"] * 4
    assert rows["a"]["prefill_s"] == 2 and rows["b"]["prefill_s"] == 5  # 9: the untimed round
    assert rows["a"]["tok_s"] == 1 / 2 and rows["b"]["tokens"] == [8]


def test_floors_are_each_rounds_bandwidths_and_the_read_of_each_steps_own_bytes(monkeypatch) -> None:
    """With bandwidth, a run that reports its step's bytes gets its share of each round's copy and read floors,
    and of a read of a buffer as large as its own step, measured at each round's start: on a host whose L3 holds a
    share of a small model's bytes, the stream from memory is not the floor (medians over the rounds)."""
    from benchmarks import common

    reads = []
    monkeypatch.setattr(common, "copy_bandwidth", lambda repeats: 10e9)
    monkeypatch.setattr(common, "read_bandwidth", lambda n_bytes=1 << 30: reads.append(n_bytes) or
                        (20e9 if n_bytes == 1 << 30 else 40e9))
    runs = {"ours": lambda: {"prefill_s": 1.0, "tok_s": 100.0, "step_bytes": 50_000_000},
            "big": lambda: {"prefill_s": 1.0, "tok_s": 1.0, "step_bytes": 3 << 30},
            "peer": lambda: {"prefill_s": 1.0, "tok_s": 50.0}}
    rows = common.interleaved(runs, repeats=2, bandwidth=True)
    # each round's stream, then each step's own bytes; a step of 1 GiB or more takes the stream's rate
    assert reads == [1 << 30, 50_000_000] * 2
    ours = rows["ours"]
    assert (ours["floor_pct"], ours["read_floor_pct"], ours["step_read_floor_pct"]) == (50, 25, 12.5)
    assert ours["step_read_bw_GBs"] == [40.0, 40.0] and "floor_pct" not in rows["peer"]
    assert rows["big"]["step_read_floor_pct"] == rows["big"]["read_floor_pct"] == 100 * (3 << 30) / 20e9


def test_cache_sizes_come_from_the_first_cores_caches(tmp_path) -> None:
    from benchmarks.common import cache_sizes

    for i, (level, kind, size) in enumerate([("1", "Data", "48K"), ("1", "Instruction", "64K"), ("2", "Unified", "2048K"),
                                             ("3", "Unified", "491520K")]):
        (tmp_path / f"index{i}").mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (tmp_path / f"index{i}" / name).write_text(value + "\n")
    assert cache_sizes(tmp_path) == "L2 2 MB, L3 480 MB"
    (tmp_path / "index3" / "size").unlink()  # unreadable: left out, not guessed
    assert cache_sizes(tmp_path) == "L2 2 MB"
    assert cache_sizes(tmp_path / "missing") == ""


def test_agreement_counts_the_common_prefix() -> None:
    assert agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert agreement([1, 2], [1, 2, 3]) == 2
    assert agreement([5], [6]) == 0


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.skipif(not (peer_llamacpp.DEFAULT_ENV / ".kvfast-installed").exists(),
                    reason="the llama.cpp peer environment is made by bench.py engine --peers llama.cpp")
def test_llamacpp_decodes_what_our_model_decodes(default_checkpoint) -> None:
    """Same GGUF, same prompt ids, greedy: llama.cpp's tokens are ours (its Q4_1 x Q8 dot products round
    differently from our fp32 ones, so only a short prefix is held to exact equality)."""
    model = Transformer.from_checkpoint(default_checkpoint)
    torch.manual_seed(0)
    prompt = torch.randint(100, model.args.vocab_size - 100, (1, 48))
    ours = time_ours(model, prompt, 8, compile=False, repeats=1)
    theirs = peer_llamacpp.time_llamacpp(default_gguf(), prompt[0].tolist(), 8, 2, 1)
    assert theirs["tok_s"] > 0 and "CPU" in theirs["system_info"]
    assert agreement(ours["tokens"], theirs["tokens"]) >= 4, (ours["tokens"], theirs["tokens"])


def write_gguf(path, tensors) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(1)
    for name, data, kind in tensors:
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_requantized_puts_every_block_matrix_in_the_format_and_keeps_the_rest(tmp_path) -> None:
    """A packaged model's mixed file (Q5_0, Q4_1, Q8_0 blocks) becomes all-Q4_0 blocks; the embedding, the head and
    the norms stay as they were; each weight moves by at most the two quantizations' steps."""
    import gguf
    import numpy as np

    from scripts.peer_llamacpp_formats import requantized

    kinds = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    rows = {n: rng.standard_normal((64, 256)).astype(np.float32) for n in ("q", "k", "down", "embd", "out")}
    norm = rng.standard_normal(256).astype(np.float32)
    src = tmp_path / "Tiny-Model.gguf"
    write_gguf(src, [("token_embd.weight", gguf.quants.quantize(rows["embd"], kinds.Q5_0), kinds.Q5_0),
                     ("blk.0.attn_q.weight", gguf.quants.quantize(rows["q"], kinds.Q5_0), kinds.Q5_0),
                     ("blk.0.attn_k.weight", gguf.quants.quantize(rows["k"], kinds.Q4_1), kinds.Q4_1),
                     ("blk.0.ffn_down.weight", gguf.quants.quantize(rows["down"], kinds.Q8_0), kinds.Q8_0),
                     ("blk.0.attn_norm.weight", norm, kinds.F32),
                     ("output.weight", gguf.quants.quantize(rows["out"], kinds.Q8_0), kinds.Q8_0)])
    dest = requantized(src, "Q4_0")
    assert dest.name == "Tiny-Model.Q4_0.gguf" and requantized(src, "Q4_0") == dest  # written once
    before = {t.name: t for t in gguf.GGUFReader(src).tensors}
    after = {t.name: t for t in gguf.GGUFReader(dest).tensors}
    assert {n: t.tensor_type for n, t in after.items()} == {
        "token_embd.weight": kinds.Q5_0, "blk.0.attn_q.weight": kinds.Q4_0, "blk.0.attn_k.weight": kinds.Q4_0,
        "blk.0.ffn_down.weight": kinds.Q4_0, "blk.0.attn_norm.weight": kinds.F32, "output.weight": kinds.Q8_0}
    for name in ("token_embd.weight", "blk.0.attn_norm.weight", "output.weight"):
        assert np.array_equal(np.asarray(after[name].data), np.asarray(before[name].data))
    for name, key in (("blk.0.attn_q.weight", "q"), ("blk.0.attn_k.weight", "k"), ("blk.0.ffn_down.weight", "down")):
        got = gguf.quants.dequantize(after[name].data, kinds.Q4_0)
        # Q4_0 moves a value by at most a step, a block's max |x| / 8 (half a step where it rounds, a whole one
        # where +8 steps clamps to +7); the source format by at most half its step: Q4_1's (max - min) / 30
        # <= max |x| / 15 is the largest of the three (1 % for the block maximum the source itself moved)
        amax = np.abs(rows[key]).reshape(64, 8, 32).max(-1, keepdims=True)
        assert np.all(np.abs(got - rows[key]).reshape(64, 8, 32) <= amax / 8 * 1.01 + amax / 15)
    assert requantized(dest, "Q4_0") == dest  # nothing left to re-quantize


def test_peers_need_the_gguf_the_checkpoint_came_from(tmp_path) -> None:
    from scripts.prepare import source_gguf

    (tmp_path / "MyModel").mkdir()
    with pytest.raises(KVFastError, match="pass --skip-hf and no --peers") as e:
        source_gguf(tmp_path / "MyModel" / "model.safetensors", tmp_path)
    assert "\n" not in str(e.value)
