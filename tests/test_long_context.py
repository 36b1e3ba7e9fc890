"""Long prompts in query blocks (model.TransformerBlock.prefill, decode.prefill's chunk): the blockwise attention
equals a dense causal one; a prompt prefilled in small blocks leaves every policy's cache (K/V, positions, every
statistic) and the first token as the one-block prefill does, to fp32's rounding; compiled decoding after it never
recompiles; the CLI takes --prefill-chunk / --prefill-dtype and prints one peak-memory line."""

import math

import pytest
import torch
from cache_testing import single_thread_fixture, small_factory, tiny_model
from numerics import assert_numerically_close

import generate
from attention import attention_lse, prompt_attention
from cache import POLICIES
from decode import Decoder, prefill
from model import KVFastError

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)

PROMPT, CHUNK = 100, 16  # seven blocks, the last one short


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """The reference: queries at positions start.. over every key up to their own, as one masked matrix."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1).double(), v.repeat_interleave(g, 1).double()
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    rows = torch.arange(start, start + q.shape[2]).view(-1, 1)
    scores = scores.masked_fill(torch.arange(k.shape[2]) > rows, float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start", [0, 1, 37])
def test_prompt_attention_is_causal_attention_over_the_earlier_keys(start, dtype):
    gen = torch.Generator().manual_seed(start)
    L, D = 24, 16
    q = torch.randn(2, 6, L, D, generator=gen).to(dtype)
    k, v = (torch.randn(2, 2, start + L, D, generator=gen).to(dtype) for _ in range(2))
    out = prompt_attention(q, k, v, start)
    assert out.dtype == dtype and out.shape == q.shape
    # bfloat16: q, k, v, the scores, probabilities and output each rounded once (4 stages); fp32: sums of D and of
    # start + L terms in another order
    assert_numerically_close(out.double(), dense_causal(q, k, v, start), depth=D + start + L,
                             storage=dtype if dtype != torch.float32 else None, roundings=4)


def test_attention_lse_reads_kv_heads_per_group():
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 6, 5, 8, generator=gen), torch.randn(1, 2, 9, 8, generator=gen), torch.randn(1, 2, 9, 8)
    out, lse = attention_lse(q, k, v)
    logits = q @ k.repeat_interleave(3, 1).transpose(-1, -2) / math.sqrt(8)
    assert_numerically_close(lse, logits.logsumexp(-1), depth=8 + 9)
    assert_numerically_close(out, torch.softmax(logits, -1) @ v.repeat_interleave(3, 1), depth=8 + 9)


def prefilled(model, factory, idx, chunk):
    """The first token and every layer's cache buffers after a prefill in blocks of `chunk` rows."""
    model.setup_caches(factory)
    with torch.inference_mode():
        first = prefill(model, idx, 0.0, None, chunk=chunk)
    return first, {f"{i}.{n}": b.clone() for i, c in enumerate(model.caches) for n, b in c.named_buffers()}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_prefill_in_blocks_leaves_the_caches_of_a_one_block_prefill(policy):
    """Each policy compresses the 100-token prompt (16 slots kept) or keeps it whole (full): positions, kept
    K/V and every statistic (H2O's column sums, SnapKV's votes, Scissorhands' ring, Expected Attention's moments,
    KVzip's reconstruction scores, the pool's heads ...) equal the one-block prefill's."""
    model = tiny_model()
    idx = torch.randint(0, 64, (2, PROMPT), generator=torch.Generator().manual_seed(3))
    factory = small_factory(policy, 2, model.args, PROMPT, 8)
    first, whole = prefilled(model, factory, idx, None)
    first_blocks, blocks = prefilled(model, factory, idx, CHUNK)
    assert torch.equal(first, first_blocks)
    assert whole.keys() == blocks.keys()
    for name, expected in whole.items():
        got = blocks[name]
        if not expected.dtype.is_floating_point:  # positions, heads, classes, queues: the same choice exactly
            assert torch.equal(got, expected), name
            continue
        finite = expected.isfinite()
        assert torch.equal(finite, got.isfinite()), name
        # a statistic sums up to PROMPT probabilities, each from a softmax over up to PROMPT scores of head_dim
        # terms, behind two layers whose blockwise attention sums in another order
        assert_numerically_close(got[finite], expected[finite], depth=4 * (PROMPT + model.args.dim), msg=name)


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "expected_attention", "kvzip"])
def test_compiled_decode_after_a_prefill_in_blocks_never_recompiles(policy):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = tiny_model()
    gen = torch.Generator().manual_seed(5)
    model.setup_caches(small_factory(policy, 1, model.args, PROMPT, 40))
    eager = Decoder(model, prefill_chunk=CHUNK)
    decoder = Decoder(model, compile=True, prefill_chunk=CHUNK)

    def run(dec: Decoder, idx: torch.Tensor) -> torch.Tensor:
        for c in model.caches:
            c.reset()
        with torch.inference_mode():
            first = dec.prefill(model, idx, 0.0, None)
            return torch.cat([first, dec.decode(first, idx.shape[1], 39)], 1)

    idx = torch.randint(0, 64, (1, PROMPT), generator=gen)
    decoder.warm_up(idx)
    graphs, recompiles = counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())
    for _ in range(2):  # two prompts of the same length: the second compiles nothing either
        assert torch.equal(run(decoder, idx), run(eager, idx))
        idx = torch.randint(0, 64, (1, PROMPT), generator=gen)
    assert counters["stats"]["unique_graphs"] == graphs
    assert sum(counters["recompiles"].values()) == recompiles


def test_bfloat16_prefill_keeps_the_caches_in_the_compute_dtype():
    model = tiny_model()
    idx = torch.randint(0, 64, (1, PROMPT), generator=torch.Generator().manual_seed(4))
    factory = small_factory("full", 1, model.args, PROMPT, 4)
    _, exact = prefilled(model, factory, idx, CHUNK)
    model.setup_caches(factory)
    with torch.inference_mode():
        prefill(model, idx, 0.0, None, chunk=CHUNK, dtype=torch.bfloat16)
    k = model.caches[-1].k
    assert k.dtype == torch.float32
    # bfloat16 products through two layers: each K within a few bfloat16 roundings of the fp32 prefill's
    assert_numerically_close(k, exact["1.k"], compute=torch.bfloat16, depth=model.args.dim,
                             storage=torch.bfloat16, roundings=8)


def test_decoder_refuses_an_empty_chunk():
    with pytest.raises(KVFastError, match="prefill chunk"):
        Decoder(tiny_model(), prefill_chunk=0)


def test_cli_prefills_in_blocks_and_prints_one_peak_memory_line(tiny_checkpoint, capsys):
    common = ["--checkpoint", str(tiny_checkpoint), "--prompt", "Hello there, this is a longer prompt " * 3,
              "--max-new-tokens", "6", "--temperature", "0", "--ignore-eos"]
    outs = []
    for chunk in ("0", "4"):
        assert generate.cli([*common, "--prefill-chunk", chunk]) == 0
        out = capsys.readouterr().out
        outs.append(out.split("-" * 40)[0])
        peak = [line for line in out.splitlines() if line.startswith("peak memory:")]
        assert len(peak) == 1 and peak[0].endswith("GiB (RSS)"), peak
    assert outs[0] == outs[1]  # the same greedy text from one block and from blocks of 4 rows
    assert generate.cli([*common, "--prefill-chunk", "-1"]) == 2
    assert "--prefill-chunk must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("policy, compile_prefill, budget", [("window+warm", False, 0.25),
                                                             ("expected_attention", False, 0.25),
                                                             ("h2o", True, 0.25), ("adakv", True, 0.75)])
def test_bench_longctx_row_compiles_nothing_after_its_warm_up(policy, compile_prefill, budget):
    """bench.py longctx's row (compiled decode after a blockwise bfloat16 prefill, or a compiled one where the
    cache can be traced): POLICY+warm turns kv.tiers on, and the timed prefill and decode add no graph to the
    warm-up's."""
    import argparse

    from benchmarks.longctx import run_cache

    model = tiny_model()
    built = []
    setup = model.setup_caches
    model.setup_caches = lambda factory: (setup(factory), built.append(list(model.caches)))
    ids = torch.randint(0, 64, (PROMPT,), generator=torch.Generator().manual_seed(6)).tolist()
    args = argparse.Namespace(kv_float="float16", prefill_dtype="bfloat16", prefill_chunk=CHUNK, new_tokens=8,
                              tokenizer=None, compile_prefill=compile_prefill)
    row = run_cache(model, ids, policy, policy, budget, 16, args)
    assert row["new_graphs"] == 0
    assert row["cache"].endswith(", compiled prefill") == (compile_prefill and policy != "adakv")  # a pool: eager
    assert row["slots"] == round(budget * 108)  # of the 108 prompt + new tokens
    caches, dropped = built
    assert all((c.tiers is not None) == policy.endswith("+warm") for c in caches)
    assert all(c.k.dtype == torch.float16 for c in caches)
    assert dropped == [None] * model.args.n_layers  # the row's caches are dropped afterwards


def test_bench_longctx_refuses_a_policy_it_cannot_compress_with():
    import argparse

    from benchmarks.longctx import check

    for bad in ("full", "window+shift", "h2o+kv8", "nope"):
        args = argparse.Namespace(policy=[bad], budgets=[0.5], peer_lengths=[], hf_lengths=[])
        with pytest.raises(KVFastError, match="--policy must name compressing policies"):
            check(args)
