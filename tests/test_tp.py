"""Tensor parallelism (tp.py): two gloo ranks on CPU give the single-process logits and greedy tokens."""

import os
import subprocess
import sys

import pytest
import torch
import tp_worker
from cache_testing import one_thread, prompt_attention_of, tiny_model
from numerics import assert_numerically_close, model_depth

import tp
from model import KVFastError
from quantize import Int4Linear, Int8Linear, dequantize_int4, quantize_int4, quantize_int8

REPO = tp_worker.ROOT


def torchrun(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # --standalone: a free rendezvous port per run (the default 29500 can still be held by the previous run)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "rank0.pt"
    proc = torchrun(str(REPO / "tests" / "tp_worker.py"), str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("run", ["full", "h2o", "h2o+compile"])
def test_two_ranks_match_one_process(two_ranks, run):
    with one_thread():
        alone = tp_worker.run(run.split("+")[0], compiled=False)
    sharded = two_ranks[run]
    assert two_ranks["world"] == 2 and sharded["n_kv_heads"] == 1  # 3 KV heads: rank 0 takes 1, rank 1 two
    # the ranks' partial sums are added in another order than one process sums them: rounding only; the tokens,
    # and the quantized shards below, are exact
    depth = model_depth(tp_worker.tiny_model(n_heads=6, n_kv_heads=3).args, tp_worker.PROMPT_LEN + tp_worker.N_NEW)
    assert_numerically_close(sharded["prompt_logits"], alone["prompt_logits"], depth=depth)
    assert_numerically_close(sharded["step_logits"], alone["step_logits"], depth=depth)
    assert torch.equal(sharded["tokens"], alone["tokens"])
    assert len(set(alone["tokens"].tolist())) > 3  # varied tokens, not one repeated


def test_generate_under_torchrun_prints_the_single_process_text(tiny_checkpoint):
    flags = ["--checkpoint", str(tiny_checkpoint), "--prompt", "The quick brown fox jumps over the lazy dog",
             "--temperature", "0", "--max-new-tokens", "12", "--cache", "h2o", "--cache-budget", "10"]
    alone = subprocess.run([sys.executable, "generate.py", *flags], cwd=REPO, capture_output=True, text=True,
                           check=False)
    ranks = torchrun("generate.py", *flags)
    assert alone.returncode == 0 and ranks.returncode == 0, ranks.stderr[-3000:]
    text = alone.stdout.split("-" * 40)[0]
    assert ranks.stdout.split("-" * 40)[0] == text  # only rank 0 prints
    assert ranks.stdout.count(text) == 1
    assert "tensor parallel over 2 ranks (gloo): rank 0 holds 1 KV heads" in ranks.stdout


def test_split_is_contiguous_and_as_even_as_possible():
    assert tp.split(3, 2) == [(0, 1), (1, 3)]
    assert tp.split(1536, 2, unit=64) == [(0, 768), (768, 1536)]
    assert tp.split(10, 4) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    with pytest.raises(KVFastError, match="cannot split 2 into 3"):
        tp.split(2, 3)
    with pytest.raises(KVFastError, match="whole 64s"):
        tp.split(100, 2, unit=64)


def test_more_ranks_than_kv_heads_is_one_clear_error():
    with pytest.raises(KVFastError, match="--nproc-per-node 3 exceeds the model's 2 KV heads"):
        tp.shard(tiny_model(), rank=0, world=3)


def test_shards_sum_to_the_whole_layer():
    """Without a process group: each rank's attention and FFN outputs (before the all-reduce) add up to the
    unsharded ones, for float weights."""
    torch.manual_seed(0)
    whole = tiny_model(n_heads=6, n_kv_heads=3)
    x = torch.randn(1, 5, whole.args.dim)
    cos, sin = whole.rope_cos[:5], whole.rope_sin[:5]
    layer = whole.layers[0]
    expected_attn, expected_ffn = prompt_attention_of(layer.attention, x, cos, sin), layer.feed_forward(x)
    got_attn, got_ffn = 0, 0
    for rank in range(2):
        part = tiny_model(n_heads=6, n_kv_heads=3)
        tp.shard(part, rank=rank, world=2)
        block = part.layers[0]
        for lin in (block.attention.wo, block.feed_forward.w2):
            lin._forward_hooks.clear()  # no process group here: add the shares by hand
        got_attn = got_attn + prompt_attention_of(block.attention, x, cos, sin)
        got_ffn = got_ffn + block.feed_forward(x)
    # two partial sums added: the output projections' reductions in another order
    a = whole.args
    assert_numerically_close(got_attn, expected_attn, depth=a.dim + a.n_heads * a.head_dim + x.shape[1])
    assert_numerically_close(got_ffn, expected_ffn, depth=a.dim + a.intermediate_size)


def test_quantized_weights_split_exactly():
    """int8 keeps its per-row scales on a column split and takes them along on a row split; int4 is unpacked,
    sliced and repacked, its groups kept whole."""
    torch.manual_seed(0)
    w = torch.randn(8, 256)
    lin = Int4Linear(256, 8, 32)
    lin.weight, lin.scales, lin.offsets = quantize_int4(w, 32)
    whole = dequantize_int4(lin.weight, lin.scales, lin.offsets)
    tp.take_columns(lin, 64, 192)
    assert torch.equal(dequantize_int4(lin.weight, lin.scales, lin.offsets), whole[:, 64:192])
    assert lin.in_features == 128
    with pytest.raises(KVFastError, match="cannot be split at columns 16-80"):
        tp.take_columns(Int4Linear(256, 8, 32), 16, 80)
    rows = torch.tensor([1, 3, 5])
    for split in ("rows", "columns"):
        lin8 = Int8Linear(256, 8)
        lin8.weight, lin8.scales = quantize_int8(w)
        whole = lin8.weight.float() * lin8.scales[:, None]
        if split == "rows":
            tp.take_rows(lin8, rows)
            expected = whole[rows]
        else:
            tp.take_columns(lin8, 64, 192)
            expected = whole[:, 64:192]
        assert torch.equal(lin8.weight.float() * lin8.scales[:, None], expected)
