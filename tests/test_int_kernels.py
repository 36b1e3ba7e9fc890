"""The integer dot-product kernels (kernels_cpu.cpp, Q8_0 activations times int8 / int4 codes): each instruction set
against a float64 product of the same quantized operands, the activation quantization's error within its analytic
bound, the choice under every CPU kind, and a compiled decode step through them: no recompiles, and eager's
tokens.

int32 accumulation is exact, so a kernel differs from the float64 product of its own operands only by fp32
rounding: each block's scale product and the fp32 sums over blocks (numerics.tolerance, depth = the terms).
Against the float product of the unquantized activations, each activation moves by at most half its block's
step (d / 2, d = max |x| / 127), so |y - x W^T| <= sum_c d(c) / 2 |W[o, c]| per output (plus that rounding)."""

import pytest
import torch
import torch.nn.functional as F
from cache_testing import greedy_with_logits, single_thread_fixture
from cache_testing import tiny_model as tiny_model_wide
from numerics import assert_numerically_close, model_depth, tolerance
from test_generate import TINY, tiny_model
from torch._dynamo.utils import counters

import attention
import cache as kvcache
import decode
import kernels
import kernels_cpu
import quantize
from kernels import dequantize_int4
from kv.quant import kv_format

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)
QK = 32


def built(isa: str):
    if isa != "scalar" and not getattr(kernels.native_cpu(), "avx512_vnni" if isa == "avx512-vnni" else "avx2"):
        pytest.skip(f"this CPU does not run {isa}")
    ops = kernels_cpu.ops(isa)
    if ops is None:
        pytest.skip(f"the {isa} kernels could not be built here")
    return ops


def dequantized_activations(x: torch.Tensor, ops) -> torch.Tensor:
    """The activations as the integer products see them (Q8_0 codes times their block's scale), in float64."""
    q, d = ops.quantize_activations(x)
    return (q.double().view(*q.shape[:-1], -1, QK) * d.double()[..., None]).flatten(-2)


def int8_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, ops) -> torch.Tensor:
    return (dequantized_activations(x, ops) @ codes.double().T) * scales.double()


def int4_reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                   ops) -> torch.Tensor:
    """The codes meet the quantized activations, the offsets each group's exact activation sum."""
    out, n_groups = scales.shape
    codes = torch.cat([packed & 15, packed >> 4], 1).double().view(out, n_groups, -1)
    w = (codes * scales.double()[..., None]).view(out, -1)
    group_sums = x.double().view(*x.shape[:-1], n_groups, -1).sum(-1)
    return dequantized_activations(x, ops) @ w.T + group_sums @ offsets.double().T


def quantization_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_c d(c) / 2 |W[o, c]|: the largest move of each output from rounding the activations to Q8_0."""
    step = x.abs().view(*x.shape[:-1], -1, QK).amax(-1, keepdim=True).expand(*x.shape[:-1], -1, QK) / 127
    return (step.flatten(-2).double() / 2) @ w.abs().double().T


def check_against_float64(shape: tuple[int, int, int, int], ops, int8_product, int4_product) -> None:
    """int8_product(x, codes, scales) and int4_product(x, packed, scales, offsets) (quantize.py's layouts) equal the
    float64 product of the operands the kernel sees, and the exact product up to the activations' rounding."""
    rows, n_in, n_out, group = shape
    g = torch.Generator().manual_seed(n_in + n_out)
    w, x = torch.randn(n_out, n_in, generator=g), torch.randn(rows, 1, n_in, generator=g)
    x[..., :QK] = 0  # an all-zero block: scale 0, not a division by zero
    codes, scales = quantize.quantize_int8(w)
    packed, s4, offsets = quantize.quantize_int4(w, group)
    for y, ref, dense in ((int8_product(x, codes, scales), int8_reference(x, codes, scales, ops),
                           codes.double() * scales.double()[:, None]),
                          (int4_product(x, packed, s4, offsets), int4_reference(x, packed, s4, offsets, ops),
                           dequantize_int4(packed, s4, offsets).double())):
        assert y.shape == (rows, 1, n_out) and y.dtype == torch.float32
        assert_numerically_close(y, ref.float(), depth=n_in + n_in // group)
        exact = x.double() @ dense.T
        slack = tolerance(float(exact.abs().max()), depth=n_in)["atol"]
        assert ((y.double() - exact).abs() <= quantization_bound(x, dense) + slack).all()


@pytest.mark.parametrize("isa", kernels_cpu.ISAS)
@pytest.mark.parametrize("shape", [(1, 576, 96, 32), (3, 1536, 40, 32), (2, 192, 33, 64), (1, 128, 7, 128)])
def test_each_kernel_equals_the_float64_product_of_its_operands(isa, shape):
    ops = built(isa)
    check_against_float64(shape, ops, ops.int8_linear, ops.int4_linear)


@pytest.mark.parametrize("isa", kernels_cpu.ISAS)
@pytest.mark.parametrize("group", [32, 64, 448])
def test_int4_dequantize_is_codes_times_scale_plus_offset(isa, group):
    """The prompt's dense copy of an int4 weight (model.PromptWeight): each value code * scale + offset, in fp32 one
    multiply-add from the float64 value, in bfloat16 that rounded once more."""
    ops = built(isa)
    w = torch.randn(40, 896, generator=torch.Generator().manual_seed(group))
    packed, scales, offsets = quantize.quantize_int4(w, group)
    codes = torch.cat([packed & 15, packed >> 4], 1).double().view(40, scales.shape[1], group)
    exact = (codes * scales.double()[..., None] + offsets.double()[..., None]).view(40, -1)
    dense = ops.int4_dequantize(packed, scales, offsets, torch.float32)
    assert dense.dtype == torch.float32
    assert_numerically_close(dense, exact.float(), depth=2)
    half = ops.int4_dequantize(packed, scales, offsets, torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert_numerically_close(half.float(), exact.float(), depth=2, storage=torch.bfloat16, roundings=1)
    assert torch.equal(half, dense.bfloat16())  # rounded to nearest even, as torch rounds


@pytest.mark.parametrize("isa", kernels_cpu.ISAS)
def test_activation_codes_round_to_nearest_within_127(isa):
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(0)) * 10
    q, d = built(isa).quantize_activations(x)
    assert torch.equal(d, x.abs().view(2, -1, QK).amax(-1) / 127) and q.abs().max() == 127
    assert torch.equal(q, torch.round(x * (1 / d).repeat_interleave(QK, -1)).to(torch.int8))


def test_every_kind_chooses_integer_products_it_can_run(cpu_kind):
    chip = kernels.cpu()
    isa = kernels_cpu.isa_of(chip, kernels.native_cpu())
    assert isa == ({"avx2": "avx2"}.get(cpu_kind, "avx512-vnni") if kernels.native_runs(cpu_kind) else isa)
    paths = kernels.int_paths()
    if kernels_cpu.ops(isa) is not None and isa != "scalar":
        assert paths == {torch.int8: f"int-dot-{isa}", torch.uint8: f"int-dot-{isa}"}
        assert kernels.linear_path(torch.uint8, 1) == f"int-dot-{isa}"
    assert kernels.linear_path(torch.float32, 1) == "reductions"


def test_a_failed_build_warns_once_and_keeps_the_reductions(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels_cpu, "SOURCES", (tmp_path / "broken.cpp",))
    (tmp_path / "broken.cpp").write_text("this is not C++\n")
    monkeypatch.setattr(kernels_cpu, "_loaded", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.warns(UserWarning, match="could not be built"):
        assert kernels_cpu.ops("scalar") is None
    assert kernels_cpu.ops("scalar") is None  # no second build, no second warning
    monkeypatch.setattr(kernels, "_INT_PATHS", None)
    with kernels.force_cpu(None):
        monkeypatch.setattr(kernels_cpu, "_loaded", {isa: None for isa in kernels_cpu.ISAS})
        assert kernels.int_paths() == {} and kernels.linear_path(torch.int8, 1) == "reductions"


def test_build_names_differ_by_instruction_set_and_source():
    names = {kernels_cpu.build_name(isa)[0] for isa in kernels_cpu.ISAS}
    assert len(names) == len(kernels_cpu.ISAS)
    assert all(name.startswith("kvfast_") for name in names)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_compiled_decode_through_integer_products(mode, monkeypatch):
    """One row, 16 steps: the step calls the kernel (no recompiles after warm-up) and equals an eager decode whose
    one-token projections call the same kernel: the same logits up to the order of the step's other fp32 sums,
    the same tokens up to a near tie."""
    if not kernels.linear_path(torch.int8, 1).startswith("int-dot"):
        pytest.skip("no integer kernels on this CPU")
    S, N = 12, 16
    model = quantize.quantize_model(tiny_model(), mode, 32)
    prompt = torch.randint(0, TINY.vocab_size, (1, S), generator=torch.Generator().manual_seed(4))
    model.setup_caches(kvcache.make_cache_factory("full", 1, TINY, S, N))

    def run(decoder):
        return greedy_with_logits(model, decoder, prompt, N)

    decoder = decode.Decoder(model, compile=True)  # tiles the weights where the AVX-512 kernels read tiles
    layers = [m for m in model.modules() if isinstance(m, (quantize.Int8Linear, quantize.Int4Linear))]
    assert all(m.tiled for m in layers) == (kernels.int_path(model.layers[0].attention.wqkv.weight.dtype)
                                            in kernels.TILED_PATHS)
    with monkeypatch.context() as m:  # eager one-token products through the kernel too (the prefill: the same in both)
        path = kernels._path
        m.setattr(kernels, "_path", lambda x, dtype, *layout: kernels.int_path(dtype) if x.shape[:-1].numel() == 1
                  and dtype in kernels.INT_DTYPES else path(x, dtype, *layout))
        eager_tokens, eager_logits = run(decode.Decoder(model))
    decoder.warm_up(prompt)
    recompiles = sum(counters["recompiles"].values())
    tokens, logits = run(decoder)
    assert sum(counters["recompiles"].values()) == recompiles
    # depth: one layer's reductions (projections, attention over the sequence, FFN), each layer. Both sides quantize
    # the activations to Q8_0, whose step is 2^-7 of a block's largest value: where compiled and eager compute an
    # activation in another order a code may flip, an error of 2^-8 relative, as one bfloat16 rounding's (u = 2^-8),
    # once per layer's projections
    args = model.args
    bound = {"depth": args.n_layers * (2 * args.dim + S + N + args.intermediate_size), "storage": torch.bfloat16,
             "roundings": args.n_layers}
    # logits[i] chose token i + 1. The greedy tokens agree until the logits' difference can flip an argmax: a
    # step where eager's two best are within twice the bound; past a flip the two decodes differ by design
    flips = (tokens != eager_tokens)[0].nonzero()
    steps = logits.shape[0] if len(flips) == 0 else int(flips[0])
    assert steps >= 1  # the prefill's token: the same eager computation in both
    assert_numerically_close(logits[:steps], eager_logits[:steps], **bound)
    if len(flips):
        top = eager_logits[steps - 1, 0].topk(2).values
        tol = tolerance(eager_logits[:steps].abs().max().item(), **bound)
        assert top[0] - top[1] <= 2 * (tol["atol"] + tol["rtol"] * top[0].abs()), "a token flipped without a near tie"


def test_a_layer_in_eager_and_compiled_calls_the_same_kernel():
    """The compiled graph's extern call and a direct call of the op agree bit for bit; F.linear past 16 rows."""
    if not kernels.linear_path(torch.uint8, 1).startswith("int-dot"):
        pytest.skip("no integer kernels on this CPU")
    layer = quantize.Int4Linear(192, 40, 32)
    layer.weight, layer.scales, layer.offsets = quantize.quantize_int4(torch.randn(40, 192), 32)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        x = torch.randn(3, 1, 192)
        direct = kernels.int_ops().int4_linear(x, layer.weight, layer.scales, layer.offsets)
        assert torch.equal(compiled(x), direct)
        x = torch.randn(1, 20, 192)
        dense = dequantize_int4(layer.weight, layer.scales, layer.offsets)
        assert_numerically_close(compiled(x), F.linear(x, dense), depth=192)


def test_integer_products_everywhere_and_nowhere():
    """bench.py quantize's switch: eager products of any rows through the kernel, or none through it."""
    if not kernels.linear_path(torch.int8, 1).startswith("int-dot"):
        pytest.skip("no integer kernels on this CPU")
    layer = quantize.Int8Linear(192, 40)
    layer.weight, layer.scales = quantize.quantize_int8(torch.randn(40, 192))
    x = torch.randn(1, 30, 192)
    with torch.inference_mode():
        with kernels.integer_products("everywhere"):
            assert torch.equal(layer(x), kernels.int_ops().int8_linear(x, layer.weight, layer.scales))
        with kernels.integer_products("nowhere"):
            assert kernels.linear_path(torch.int8, 1) == "reductions"
        assert kernels.linear_path(torch.int8, 1).startswith("int-dot")
        dense = layer.weight.float() * layer.scales[:, None]
        assert_numerically_close(layer(x), F.linear(x, dense), depth=192)  # eager, 30 rows: F.linear
    with pytest.raises(kernels.KVFastError, match="everywhere"):
        kernels.integer_products("sometimes")


# ---- one-query attention (attention_cpu.cpp, AVX-512 and AVX2) --------------------------------------------------
ONE_QUERY_ISAS = ("avx512-vnni", "avx2")


def one_query_kernel(isa: str = "avx512-vnni"):
    ops = built(isa)
    if not hasattr(ops, "one_query_attention"):
        pytest.skip("no one-query attention kernel in this build")
    return ops


@pytest.mark.parametrize("isa", ONE_QUERY_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B, n_kv, g, D, T", [(1, 3, 3, 64, 1030), (2, 2, 7, 64, 37), (1, 1, 1, 128, 130),
                                              (1, 2, 8, 128, 5)])
def test_one_query_attention_equals_the_reductions(isa, dtype, B, n_kv, g, D, T, monkeypatch):
    """The kernel against attend_one_query's reductions on the same K/V: the output and the probabilities up to
    the order of the fp32 sums over the keys and channels; bfloat16 K/V round the query, the scores, the
    probabilities and the output to bfloat16 at the same points (each may pick the adjacent bfloat16 where the
    sums differ in order). Several key blocks of 128, partly masked, and blocks whose every slot is masked; tails
    of the key blocks shorter than either build's vector."""
    ops = one_query_kernel(isa)
    gen = torch.Generator().manual_seed(T)
    q = torch.randn(B, n_kv * g, 1, D, generator=gen)
    k, v = (torch.randn(B, n_kv, T, D, generator=gen).to(dtype) for _ in "kv")
    mask = torch.rand(B, n_kv, 1, T, generator=gen) < 0.7
    mask[..., 128:256] = False
    mask[..., 0] = True
    out, probs = ops.one_query_attention(q.view(B, n_kv, g, D), k, v, mask.view(B, n_kv, T), D ** -0.5)
    monkeypatch.setattr(attention, "attention_path", lambda: "reductions")
    ref, ref_probs = attention.attend_one_query(q, k, v, mask, want_probs=True)
    bf16 = {"storage": torch.bfloat16, "roundings": 3} if dtype == torch.bfloat16 else {}
    assert_numerically_close(out.view_as(ref), ref, depth=T + D, **bf16)
    assert_numerically_close(probs, ref_probs.squeeze(3), depth=T + D, **bf16)
    assert torch.all(probs[~mask.view(B, n_kv, 1, T).expand_as(probs)] == 0)


@pytest.mark.parametrize("isa", ONE_QUERY_ISAS)
def test_one_query_attention_gives_the_same_bits_on_one_thread_and_two(isa):
    """Each key block's share is one task's and the shares add up in block order, also where the heads' sums
    run in parallel (many blocks: 2 KV heads of 7 over 4,700 slots)."""
    ops = one_query_kernel(isa)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 7, 64, generator=gen)
    k, v = (torch.randn(2, 2, 4700, 64, generator=gen).half() for _ in "kv")
    mask = torch.rand(2, 2, 4700, generator=gen) < 0.9
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.one_query_attention(q, k, v, mask, 0.125)
        torch.set_num_threads(2)
        two = ops.one_query_attention(q, k, v, mask, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@pytest.mark.parametrize("isa", ONE_QUERY_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_query_attention_reads_slot_positions_as_its_mask(isa, dtype):
    """A slot cache's positions as the mask (live where >= 0: position 0 live, -1 empty, positions past 2^32)
    give the bool mask's outputs bit for bit; a mask of another dtype is refused."""
    ops = one_query_kernel(isa)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, 3, 64, generator=gen)
    k, v = (torch.randn(2, 2, 300, 64, generator=gen).to(dtype) for _ in "kv")
    mask = torch.rand(2, 2, 300, generator=gen) < 0.6
    mask[..., 0], mask[..., 1], mask[..., 128:256] = True, False, False
    positions = torch.randint(0, 2**40, (2, 2, 300), generator=gen)
    positions[..., 0] = 0
    positions[~mask] = -1
    by_bool = ops.one_query_attention(q, k, v, mask, 0.125)
    by_positions = ops.one_query_attention(q, k, v, positions, 0.125)
    assert torch.equal(by_bool[0], by_positions[0]) and torch.equal(by_bool[1], by_positions[1])
    with pytest.raises(RuntimeError, match="mask"):
        ops.one_query_attention(q, k, v, positions.int(), 0.125)


@pytest.mark.parametrize("isa", ONE_QUERY_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_one_query_attention_never_reads_a_masked_slot(isa, dtype):
    """NaN in every masked slot's K and V (a static buffer past its fill, an evicted slot) leaves the output
    equal to the output with zeros there: those slots are skipped, not multiplied by a zero probability (bfloat16
    K/V on AVX512-BF16 read two keys' values at once: a masked one next to a live one is read as zeros)."""
    ops = one_query_kernel(isa)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 64, generator=gen)
    k, v = (torch.randn(1, 2, 301, 64, generator=gen).to(dtype) for _ in "kv")
    mask = torch.rand(1, 2, 301, generator=gen) < 0.5
    mask[..., 0] = True
    poisoned_k, poisoned_v = (x.masked_fill(~mask.unsqueeze(-1), float("nan")) for x in (k, v))
    clean = ops.one_query_attention(q, k.masked_fill(~mask.unsqueeze(-1), 0), v.masked_fill(~mask.unsqueeze(-1), 0),
                                    mask, 0.125)
    poisoned = ops.one_query_attention(q, poisoned_k, poisoned_v, mask, 0.125)
    assert torch.equal(poisoned[0], clean[0]) and torch.equal(poisoned[1], clean[1])


def test_one_query_attention_is_chosen_where_a_build_has_it(cpu_kind):
    isa = kernels_cpu.isa_of(kernels.cpu(), kernels.native_cpu())
    expected = {"avx512-vnni": "one-query-avx512", "avx2": "one-query-avx2"}.get(isa, "reductions")
    assert attention.attention_path() == (expected if kernels_cpu.ops(isa) is not None else "reductions")


@pytest.mark.parametrize("kind", ["native", "avx2"])
@pytest.mark.parametrize("kv_bits", [None, 16])
def test_compiled_decode_attends_through_the_kernel(kv_bits, kind):
    """A model whose heads are 64 wide: the compiled step calls the kernel (seen by the profiler), never
    recompiles, and gives eager's tokens and logits (eager attends through SDPA over the same K/V); natively and
    as an AVX2 CPU would (the AVX2 build of the kernel)."""
    with kernels.force_cpu(kind):
        if attention.attention_path() == "reductions":
            pytest.skip("no one-query kernel is chosen on this CPU kind")
        model = tiny_model_wide(head_dim=64, n_heads=6, n_kv_heads=2)
        S, N = 20, 12
        prompt = torch.randint(0, model.args.vocab_size, (1, S), generator=torch.Generator().manual_seed(3))
        model.setup_caches(kvcache.make_cache_factory("full", 1, model.args, S, N, **kv_format(kv_bits, "auto")[0]))
        eager_tokens, eager_logits = greedy_with_logits(model, decode.Decoder(model), prompt, N)
        decoder = decode.Decoder(model, compile=True)
        decoder.warm_up(prompt)
        recompiles = sum(counters["recompiles"].values())
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            tokens, logits = greedy_with_logits(model, decoder, prompt, N)
        assert sum(counters["recompiles"].values()) == recompiles
        assert any(e.key.endswith("::one_query_attention") for e in prof.key_averages())
        assert_numerically_close(logits, eager_logits, depth=model_depth(model.args, S + N))
        assert torch.equal(tokens, eager_tokens)


# ---- the choice by timing -------------------------------------------------------------------------------------
def int8_layers(n: int, width: int = 256) -> list:
    from model import Int8Linear

    layers = []
    for _ in range(n):
        layer = Int8Linear(width, 64)
        layer.weight, layer.scales = quantize.quantize_int8(torch.randn(64, width))
        layers.append(layer)
    return layers


@pytest.mark.parametrize("integer_wins", [True, False])
def test_timed_choice_follows_the_faster_and_is_remembered(integer_wins, monkeypatch, tmp_path):
    """time_int_paths takes the faster of the two for each dtype, remembers it per machine (a second process
    reads it instead of timing), and times again where the key differs (the shapes here)."""
    built("avx512-vnni" if kernels.native_cpu().avx512_vnni else "avx2")
    if not kernels.linear_path(torch.int8, 1).startswith("int-dot"):
        pytest.skip("no integer kernels on this CPU")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(kernels, "_TIMED", {})
    timings = iter([1.0, 2.0] if integer_wins else [2.0, 1.0])
    monkeypatch.setattr(kernels_cpu, "time_calls", lambda fn, *a, **k: (fn(), next(timings))[1])
    assert kernels.time_int_paths(int8_layers(2)) == {torch.int8: integer_wins}
    assert kernels.linear_path(torch.int8, 1).startswith("int-dot") == integer_wins
    saved = (tmp_path / "kvfast" / "choices.json").read_text()
    assert '"integer": ' + ("true" if integer_wins else "false") in saved

    monkeypatch.setattr(kernels, "_TIMED", {})  # another process: read, not timed
    monkeypatch.setattr(kernels_cpu, "time_calls", lambda *a, **k: pytest.fail("timed again"))
    assert kernels.time_int_paths(int8_layers(2)) == {torch.int8: integer_wins}
    with pytest.raises(pytest.fail.Exception, match="timed again"):
        kernels.time_int_paths(int8_layers(3))


def test_timed_choice_skips_forced_kinds_and_narrow_products(monkeypatch, tmp_path, cpu_kind):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(kernels_cpu, "time_calls", lambda *a, **k: pytest.fail("timed"))
    assert kernels.time_int_paths(int8_layers(1)) == {}  # a forced kind keeps the choice by instruction set
    with kernels.force_cpu("native"):
        assert kernels.time_int_paths(int8_layers(1, width=64)) == {}
    assert not (tmp_path / "kvfast" / "choices.json").exists()


def test_timed_choice_times_both_kernels(monkeypatch, tmp_path):
    """Unmocked: both sides run (the reductions compiled), and the file holds their timings."""
    built("avx512-vnni" if kernels.native_cpu().avx512_vnni else "avx2")
    if not kernels.linear_path(torch.int8, 1).startswith("int-dot"):
        pytest.skip("no integer kernels on this CPU")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(kernels, "_TIMED", {})
    layers = int8_layers(2)
    codes = [m.weight.clone() for m in layers]
    chosen = kernels.time_int_paths(layers)
    assert set(chosen) == {torch.int8}
    # timed in tiles where the kernels read tiles, handed back in rows (the Decoder tiles after choosing)
    assert not any(m.tiled for m in layers) and all(torch.equal(m.weight, c) for m, c in zip(layers, codes))
    import json

    (entry,) = json.loads((tmp_path / "kvfast" / "choices.json").read_text()).values()
    assert entry["int8"]["integer_us"] > 0 and entry["int8"]["other_us"] > 0
    assert entry["int8"]["integer"] == (entry["int8"]["integer_us"] <= entry["int8"]["other_us"])

    monkeypatch.setattr(kernels, "_TIMED", {})  # whatever won: tile where the tiled kernels are built
    monkeypatch.setattr(kernels, "_INT_PATHS", None)
    if kernels.tile_weights(layers):  # a model tiled by an earlier Decoder keeps the integer kernels, untimed
        monkeypatch.setattr(kernels, "_TIMED", {})
        monkeypatch.setattr(kernels_cpu, "time_calls", lambda *a, **k: pytest.fail("timed a tiled model"))
        assert kernels.time_int_paths(layers + int8_layers(1)) == {torch.int8: True}
        assert all(m.tiled for m in layers)
