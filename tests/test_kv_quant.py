"""Quantized K/V storage (--kv-bits): error bounds per group, each token quantized exactly once (no drift), every
policy compiled == eager without recompiling, memory as reported, and attention that stays close to fp32."""

import pytest
import torch
import torch.nn.functional as F
from cache_testing import generate_tokens, single_thread_fixture, small_factory, tiny_model
from numerics import assert_numerically_close
from torch._dynamo.utils import counters

import attention
import cache as kvcache
import kernels
from attention import Codes, attend, attend_one_query
from decode import Decoder
from kv.quant import (
    dequantize_channels,
    dequantize_halves,
    dequantize_tokens,
    kv_format,
    quantize_channels,
    quantize_tokens,
)

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group_size", [16, 64])
def test_round_trip_is_within_half_a_step_per_group(bits, group_size):
    x = torch.randn(2, 3, 10, 64) * torch.logspace(-2, 1, 64)  # channels of very different ranges
    codes, scale, zero = quantize_tokens(x, bits, group_size)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == (64 if bits == 8 else 32)
    assert scale.dtype == zero.dtype == torch.float32 and scale.shape[-1] == 64 // group_size
    back = dequantize_tokens(codes, scale, zero, bits, torch.float32)
    step = scale.float().repeat_interleave(group_size, -1)
    assert torch.all((back - x).abs() <= step / 2 * (1 + 1e-4))


@pytest.mark.parametrize("bits", [8, 4])
def test_per_channel_round_trip_ignores_the_tokens_left_out(bits):
    """KIVI's key layout: one range per channel over a group of tokens; tokens marked invalid (an unfilled page)
    neither widen the range nor break the codes of the others."""
    x = torch.randn(2, 3, 16, 64) * torch.logspace(-2, 1, 64)  # an outlier-channel spread, as keys have
    valid = torch.rand(2, 3, 16) < 0.7
    valid[..., 0] = True
    junk = x.masked_fill(~valid.unsqueeze(-1), 1e6)  # what an empty slot may hold
    codes, scale, zero = quantize_channels(junk, bits, valid)
    assert codes.shape == (2, 3, 16, 64 if bits == 8 else 32) and scale.shape == zero.shape == (2, 3, 1, 64)
    back = dequantize_channels(codes, scale, zero, bits, torch.float32)
    inside = valid.unsqueeze(-1)
    assert torch.all(((back - x).abs() <= scale / 2 * (1 + 1e-4)) | ~inside)
    lo = x.masked_fill(~inside, torch.inf).amin(-2, keepdim=True)
    hi = x.masked_fill(~inside, -torch.inf).amax(-2, keepdim=True)
    torch.testing.assert_close(zero, lo)
    torch.testing.assert_close(scale, ((hi - lo) / (2**bits - 1)).clamp(min=1e-6))


def test_four_bit_layout():
    x = torch.arange(16.0).view(1, 16)  # one group: scale 1, zero 0, codes = values
    codes, scale, zero = quantize_tokens(x, 4, 16)
    assert (scale.item(), zero.item()) == (1.0, 0.0)
    assert codes.tolist() == [[j | ((j + 8) << 4) for j in range(8)]]  # channel j low, j + D/2 high


@pytest.mark.parametrize("group_size", [2, 4, 16])
def test_four_bit_halves_are_the_dequantized_channels(group_size):
    x = torch.randn(2, 3, 5, 16)
    parts = quantize_tokens(x, 4, group_size)
    lo, hi = dequantize_halves(*parts, torch.float32)
    assert torch.equal(torch.cat([lo, hi], -1), dequantize_tokens(*parts, 4, torch.float32))


def test_attention_over_channel_blocks_equals_attention_over_the_whole():
    """attend_one_query reads 4-bit K/V as two halves of channels (KVCache.channel_blocks), each reduced apart:
    the same output and probabilities as the concatenated K/V through the same function and through SDPA."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 6, 1, 16, generator=g), torch.randn(2, 3, 40, 16, generator=g), torch.randn(2, 3, 40, 16)
    mask = torch.rand(2, 3, 1, 40, generator=g) < 0.8
    whole, probs = attend_one_query(q, k, v, mask, want_probs=True)
    halves, probs_halves = attend_one_query(q, k.split(8, -1), v.split(8, -1), mask, want_probs=True)
    torch.testing.assert_close(halves, whole)
    torch.testing.assert_close(probs_halves, probs)
    torch.testing.assert_close(halves, attend(q, k, v, mask, want_probs=False)[0], rtol=1e-5, atol=1e-5)


def values(block):
    """A channel block as attention must read it: a tensor as it is, Codes dequantized."""
    if not isinstance(block, Codes):
        return block
    return torch.cat([c.squeeze(2) * block.scale + block.zero for c in block.channels(torch.float32)], -1)


def test_attention_over_codes_equals_attention_over_their_values():
    """Codes blocks (one scale and zero point per token) are read with the scale and zero point outside the
    reductions: the same output and probabilities as over the dequantized values, 8-bit whole and 4-bit halves."""
    g = torch.Generator().manual_seed(1)
    q, mask = torch.randn(2, 6, 1, 16, generator=g), torch.rand(2, 3, 1, 40, generator=g) < 0.8
    for bits, width, packed in ((8, 16, False), (4, 8, False), (4, 8, True)):
        k, v = ([Codes(torch.randint(0, 2**bits if not packed else 256, (2, 3, 40, width), dtype=torch.uint8,
                                     generator=g),
                       torch.rand(2, 3, 40, 1, generator=g), torch.randn(2, 3, 40, 1, generator=g), packed)
                 for _ in range(16 // width // (2 if packed else 1))] for _ in "kv")
        ref, ref_probs = attend_one_query(q, tuple(map(values, k)), tuple(map(values, v)), mask, want_probs=True)
        out, probs = attend_one_query(q, tuple(k), tuple(v), mask, want_probs=True)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(probs, ref_probs, rtol=1e-5, atol=1e-6)


def test_quantized_caches_fuse_their_attention_where_the_blocks_fit():
    """One scale group per block of channels: Codes (8-bit: the head; 4-bit: each half); 4-bit groups within the
    halves: the halves dequantized; otherwise (or with pos_shift) keys_values()."""
    model = tiny_model()
    D = model.args.head_dim
    for kw, blocks in [({"kv_bits": 4}, Codes), ({"kv_bits": 4, "kv_group_size": D // 2}, Codes),
                       ({"kv_bits": 4, "kv_group_size": D // 4}, torch.Tensor), ({"kv_bits": 8}, Codes),
                       ({"kv_bits": 8, "kv_group_size": D // 2}, None), ({"kv_bits": 4, "pos_shift": True}, None)]:
        policy = "window" if kw.get("pos_shift") else "h2o"
        model.setup_caches(small_factory(policy, 1, model.args, 24, 8, **kw))
        cache = model.caches[0]
        assert (cache.channel_blocks is not None) == (blocks is not None), kw
        assert cache.fuse_one_query == (blocks is not None or kw["kv_bits"] == 8), kw
        if blocks:
            k_blocks, v_blocks = cache.channel_blocks()
            assert all(isinstance(b, blocks) for b in (*k_blocks, *v_blocks)), kw
            k, v = cache.keys_values()
            for got, want in ((k_blocks, k), (v_blocks, v)):
                torch.testing.assert_close(torch.cat([values(b) for b in got], -1), want, rtol=0, atol=1e-6)
    model.setup_caches(small_factory("adakv", 1, model.args, 24, 8, kv_bits=4))
    assert model.caches[0].channel_blocks is None and not model.caches[0].fuse_one_query  # the pool: whole


@pytest.mark.parametrize("bits, group_size, read", [(4, None, Codes), (4, 2, torch.Tensor), (8, None, Codes)])
def test_quantized_compiled_step_reads_the_blocks_and_equals_eager(bits, group_size, read, monkeypatch):
    torch._dynamo.reset()
    model = tiny_model()
    prompt = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(3))
    model.setup_caches(small_factory("h2o", 2, model.args, 24, 24, kv_bits=bits, kv_group_size=group_size))
    eager = generate_tokens(model, prompt, 24)
    seen = {}
    original = attention.attend_one_query

    def spy(q, k, v, *args, **kwargs):
        seen[type(k[0]) if isinstance(k, tuple) else "whole"] = True  # a write: no guard, replayed per step
        return original(q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention, "attend_one_query", spy)
    compiled = generate_tokens(model, prompt, 24, Decoder(model, compile=True))
    assert seen == {read: True}  # traced through the blocks
    assert torch.equal(compiled, eager)


FLOATS = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@pytest.mark.parametrize("bits, kv_float", [(16, "float16"), (16, "bfloat16"), (8, None), (4, None)])
def test_each_token_is_stored_once_and_never_drifts(bits, kv_float):
    """What attention reads for a slot (in the compute dtype) is the storage of the K/V written there: its
    quantization (8 / 4 bits) or its 16-bit float rounding, however many tokens come after (no re-quantization);
    memory is the codes plus fp32 scale/zero per group, or 16-bit values."""
    model = tiny_model()
    group = {"kv_group_size": 4} if bits != 16 else {"kv_float": kv_float}
    model.setup_caches(kvcache.make_cache_factory("h2o", 1, model.args, 12, 30, budget=16, kv_bits=bits, **group))
    written = {}
    cache = model.caches[0]
    original_update = cache.update

    def spy(input_pos, k, v):
        written[int(input_pos)] = (k.clone(), v.clone())
        return original_update(input_pos, k, v)

    def stored_as(x):
        if bits == 16:
            return x.to(FLOATS[kv_float]).float()
        return dequantize_tokens(*quantize_tokens(x, bits, 4), bits, torch.float32)

    cache.update = spy
    generate_tokens(model, torch.randint(0, 64, (1, 12)), 30)
    k_all, v_all = cache.keys_values()
    assert k_all.dtype == v_all.dtype == torch.float32
    checked = 0
    for slot, pos in enumerate(cache.slot_pos[0, 0].tolist()):
        if pos in written:
            for new, stored in zip(written[pos], (k_all, v_all)):
                assert torch.equal(stored[0, 0, slot], stored_as(new[0, 0, 0]))
            checked += 1
    assert checked >= 8  # decoded tokens that survived eviction
    D, C, H = model.args.head_dim, cache.capacity, model.args.n_kv_heads
    per_value = {16: 2 * D, 8: D + 2 * 4 * D // 4, 4: D // 2 + 2 * 4 * D // 4}[bits]
    assert cache.physical_bytes() == 2 * H * C * per_value
    if bits == 16:
        assert cache.k.dtype == cache.v.dtype == FLOATS[kv_float]
        factory = small_factory("h2o", 1, model.args, 12, 30, kv_bits=16, kv_float=kv_float)
        assert f"K/V stored as {kv_float}" in factory.describe()


@pytest.mark.parametrize("kv_float", ["float16", "bfloat16"])
@pytest.mark.parametrize("policy", ["full", "h2o", "adakv", "hybrid"])
def test_float16_kv_compiles_and_equals_eager(policy, kv_float):
    """Uniform layout and pool: the compiled step reads 16-bit K/V inside its fused attention as eager does; with
    bfloat16 K/V the uniform layout's one-query reductions round where eager's bfloat16 matmuls do (the pool
    attends in fp32 either way)."""
    torch._dynamo.reset()
    model = tiny_model()
    prompt = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    model.setup_caches(small_factory(policy, 2, model.args, 24, 40, kv_bits=16, kv_float=kv_float))
    eager_logits, compiled_logits = [], []
    eager = generate_tokens(model, prompt, 40, on_logits=lambda i, lg: eager_logits.append(lg))
    compiled = generate_tokens(model, prompt, 40, Decoder(model, compile=True),
                               on_logits=lambda i, lg: compiled_logits.append(lg))
    assert torch.equal(compiled, eager)
    # fp32 sums in another order (depth: the reductions along one layer's path, twice, and the head) may round a
    # stored K/V value to its other 16-bit neighbour (k and v each layer), and with bfloat16 K/V also the four
    # bfloat16 roundings of attention (query, scores, probabilities, output); without those matching roundings
    # bfloat16 K/V's logits differ by ~7, far outside this bound
    args = model.args
    depth = args.n_layers * (args.dim + args.head_dim + 64 + args.intermediate_size) + args.dim
    roundings = args.n_layers * (2 + (4 if kv_float == "bfloat16" else 0))
    assert_numerically_close(torch.cat(compiled_logits), torch.cat(eager_logits), depth=depth,
                             storage=FLOATS[kv_float], roundings=roundings)
    assert model.caches[0].k.dtype == FLOATS[kv_float]


def test_bfloat16_kv_attends_in_bfloat16():
    """attend with bfloat16 K/V under fp32 queries: the one-query reductions (compiled) and the matmuls (eager, and
    several queries) both equal attention computed from the bfloat16-rounded query, scores, probabilities and
    output, and differ from fp32 attention over the same K/V by more than that agreement."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(*shape, generator=g) * 3 for shape in ((1, 6, 1, 16), (1, 3, 40, 16), (1, 3, 40, 16)))
    k, v = k.bfloat16(), v.bfloat16()
    mask = torch.rand(1, 3, 1, 40, generator=g) < 0.8
    bf = lambda x: x.bfloat16().float()
    scores = bf(bf(q).view(1, 3, 2, 16) @ k.float().transpose(-1, -2)) / 4
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
    expected = bf(bf(probs) @ v.float()).view(1, 6, 1, 16)
    fp32 = (torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v.float()).view(1, 6, 1, 16)
    eager, _ = attend(q, k, v, mask, want_probs=False)
    Decoder(tiny_model(), compile=True)  # Inductor then rounds where eager does (emulate_precision_casts)
    compiled, _ = torch.compile(attend, fullgraph=True)(q, k, v, mask, want_probs=False)
    for got in (eager, compiled):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (fp32 - expected).abs().max() > 1e-3


@pytest.mark.parametrize("policy", list(kvcache.POLICIES))
def test_every_policy_compiles_with_quantized_kv(policy):
    torch._dynamo.reset()
    model = tiny_model()
    prompt = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    n_new = 72
    model.setup_caches(small_factory(policy, 2, model.args, 24, n_new, kv_bits=4))
    eager = generate_tokens(model, prompt, n_new)
    graphs = {}

    def after_warmup(step, logits):
        if step == 8:
            graphs["warm"] = counters["stats"]["unique_graphs"]

    compiled = generate_tokens(model, prompt, n_new, Decoder(model, compile=True), on_logits=after_warmup)
    assert counters["stats"]["unique_graphs"] == graphs["warm"], "recompiled during decoding"
    assert torch.equal(compiled, eager)


@pytest.mark.parametrize("bits, kv_float, max_kl", [(16, "float16", 1e-5), (16, "bfloat16", 1e-3), (8, None, 1e-3),
                                                    (4, None, 0.1)])
def test_logits_stay_close_to_full_precision(bits, kv_float, max_kl):
    model = tiny_model()
    ids = torch.randint(0, 64, (1, 64), generator=torch.Generator().manual_seed(4))

    def teacher_forced(kv_bits):
        floats = {"kv_float": kv_float} if kv_bits == 16 else {}
        model.setup_caches(kvcache.make_cache_factory("full", 1, model.args, 16, 48, kv_bits=kv_bits, **floats))
        for c in model.caches:
            c.reset()
        out = []
        with torch.inference_mode():
            model(ids[:, :16])
            for t in range(16, 64):
                out.append(model(ids[:, t : t + 1], torch.tensor([t])))
        return F.log_softmax(torch.cat(out, 1), -1)

    ref, got = teacher_forced(None), teacher_forced(bits)
    kl = (ref.exp() * (ref - got)).sum(-1).mean()
    assert 0 < kl < max_kl, kl


def test_kv_float_auto_follows_the_cpu_and_the_use(cpu_kind):
    """--kv-bits 16 --kv-float auto (the default): float16, except for a speculative verification on a CPU with
    bfloat16 dot products (bfloat16: AVX512-BF16 or AMX, not AVX2 alone); the table rows name what was chosen."""
    assert kvcache.make_cache_factory("full", 1, tiny_model().args, 8, 8, kv_bits=16).kv_dtype == torch.float16
    verify = "float16" if cpu_kind == "avx2" else "bfloat16"
    assert kernels.cpu().bf16_dot == (verify == "bfloat16")
    assert kv_format(16, verifies=True) == ({"kv_bits": 16, "kv_float": verify}, verify)
    assert kv_format(16) == ({"kv_bits": 16, "kv_float": "float16"}, "float16")
    assert kv_format(16, "bfloat16")[1] == "bfloat16" and kv_format(8) == ({"kv_bits": 8}, "8-bit")
