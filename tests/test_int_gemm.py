"""The integer GEMM of a prompt's products (gemm_cpu.cpp int8_gemm / int4_gemm, --prefill-dtype int8): each row of
its product is the one-token tiled kernel's product of that row, bit for bit, from tiles or rows; it equals the
float64 product of its operands; it takes and gives bfloat16 rows; an int8 prefill is the prefill in its work dtype
with every projection's rows through the decode step's kernel; and auto chooses it on the CPUs it was measured on.
The AVX-512 VNNI and the AVX2 builds each."""

import pytest
import torch
from test_generate import TINY, run_cli, tiny_model
from test_int_kernels import built, check_against_float64

import decode
import kernels
import kernels_cpu
import quantize
from cache import make_cache_factory
from kernels_cpu import tile_groups, tile_int4, tile_int8
from model import KVFastError, prompt_work_dtype

GEMM_ISAS = ("avx512-vnni", "avx2")


def gemm_ops(isa: str = "avx512-vnni"):
    ops = built(isa)
    if not hasattr(ops, "int8_gemm"):
        pytest.skip(f"no integer GEMM in the {isa} build")
    return ops


@pytest.fixture(params=["avx512-bf16", "avx2"])
def gemm_kind(request):
    """The CPU kinds whose builds have the integer GEMM (AVX-512 VNNI, AVX2), each forced in turn where this CPU
    runs it."""
    if not kernels.native_runs(request.param):
        pytest.skip(f"this CPU does not run the {request.param} kind")
    with kernels.force_cpu(request.param):
        if not kernels.int_gemm_runs():
            pytest.skip(f"no integer GEMM built for the {request.param} kind")
        yield request.param


@pytest.mark.parametrize("out, n_in, group", [(16, 64, 32), (48, 256, 32), (80, 512, 64), (32, 384, 128)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 13, 37])
@pytest.mark.parametrize("isa", GEMM_ISAS)
def test_each_row_of_the_gemm_is_the_one_token_kernels_product(rows, out, n_in, group, isa):
    """Whatever the micro-tile a row lands in (AVX-512: 6 rows x 2 tiles, AVX2: 3 rows x 1, their edges, one
    tile for a few rows), its outputs are int8_linear_tiled's / int4_linear_tiled's for that row alone: the same
    sums in the same order."""
    ops = gemm_ops(isa)
    g = torch.Generator().manual_seed(rows * n_in)
    w, x = torch.randn(out, n_in, generator=g), torch.randn(rows, n_in, generator=g)
    x[0, :32] = 0  # an all-zero block
    codes, scales = quantize.quantize_int8(w)
    packed, s4, offsets = quantize.quantize_int4(w, group)
    t8, t4, ts, to = tile_int8(codes), tile_int4(packed), tile_groups(s4), tile_groups(offsets)
    one8 = torch.cat([ops.int8_linear_tiled(x[i:i + 1], t8, scales) for i in range(rows)])
    one4 = torch.cat([ops.int4_linear_tiled(x[i:i + 1], t4, ts, to) for i in range(rows)])
    assert torch.equal(ops.int8_gemm(x, t8, scales, True), one8)
    assert torch.equal(ops.int8_gemm(x, codes, scales, False), one8)
    assert torch.equal(ops.int4_gemm(x, t4, ts, to, True), one4)
    assert torch.equal(ops.int4_gemm(x, t4, ts.half(), to.half(), True), one4)  # quantize_int4's are float16 values
    assert torch.equal(ops.int4_gemm(x, packed, s4, offsets, False), one4)


@pytest.mark.parametrize("shape", [(5, 576, 96, 32), (7, 1536, 48, 32), (9, 192, 32, 64), (6, 128, 16, 128)])
@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("isa", GEMM_ISAS)
def test_the_gemm_equals_the_float64_product_of_its_operands(shape, tiled, isa):
    ops = gemm_ops(isa)

    def int8(x, codes, scales):
        return ops.int8_gemm(x, tile_int8(codes) if tiled else codes, scales, tiled)

    def int4(x, packed, scales, offsets):
        if tiled:
            packed, scales, offsets = tile_int4(packed), tile_groups(scales), tile_groups(offsets)
        return ops.int4_gemm(x, packed, scales, offsets, tiled)

    check_against_float64(shape, ops, int8, int4)


@pytest.mark.parametrize("isa", GEMM_ISAS)
def test_bfloat16_rows_in_and_out(isa):
    """bfloat16 activations are quantized from their values as fp32 ones are, and the outputs are the fp32
    products rounded to nearest even, as .bfloat16() rounds them."""
    ops = gemm_ops(isa)
    w, x = torch.randn(48, 256), torch.randn(21, 256).bfloat16()
    codes, scales = quantize.quantize_int8(w)
    packed, s4, offsets = quantize.quantize_int4(w, 32)
    y8 = ops.int8_gemm(x, codes, scales, False)
    y4 = ops.int4_gemm(x, packed, s4, offsets, False)
    assert y8.dtype == y4.dtype == torch.bfloat16
    assert torch.equal(y8, ops.int8_gemm(x.float(), codes, scales, False).bfloat16())
    assert torch.equal(y4, ops.int4_gemm(x.float(), packed, s4, offsets, False).bfloat16())


@pytest.mark.parametrize("isa", GEMM_ISAS)
def test_the_gemm_rejects_what_it_cannot_multiply(isa):
    ops = gemm_ops(isa)
    codes, scales = quantize.quantize_int8(torch.randn(24, 64))
    with pytest.raises(RuntimeError, match="out a multiple of 16"):
        ops.int8_gemm(torch.randn(3, 64), codes, scales, False)
    codes, scales = quantize.quantize_int8(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="float32 or bfloat16 x"):
        ops.int8_gemm(torch.randn(3, 64).half(), codes, scales, False)


def tiled_tiny(mode: str):
    model = quantize.quantize_model(tiny_model(), mode, 32)
    for m in model.modules():
        if isinstance(m, (quantize.Int8Linear, quantize.Int4Linear, quantize.Int8Embedding)):
            kernels_cpu.retile(m, True)
    return model


def profiled(fn) -> dict[str, int]:
    with torch.profiler.profile() as prof:
        fn()
    return {e.key.split("::")[-1]: e.count for e in prof.key_averages()}


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_an_int8_prefill_is_the_decode_kernel_on_every_projections_rows(mode, gemm_kind, monkeypatch):
    """--prefill-dtype int8: every projection of every layer takes the GEMM (4 a layer: wqkv, wo, w13, w2), none
    a dense copy of its weight; the logits equal, bit for bit, the prefill in the activations' dtype whose every
    product is the decode step's integer kernel over each row (integer_products("everywhere") on tiles)."""
    model = tiled_tiny(mode)
    ids = torch.randint(0, TINY.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    model.setup_caches(make_cache_factory("full", 1, TINY, 40, 8))
    with torch.inference_mode():
        calls = profiled(lambda: model(ids, prefill_dtype=torch.int8))
        got = model(ids, prefill_dtype=torch.int8)
        gemm = "int8_gemm" if mode == "int8" else "int4_gemm"
        assert calls.get(gemm, 0) >= 4 * TINY.n_layers
        assert not {"int8_dequantize", "int4_dequantize"} & set(calls)
        monkeypatch.setattr(kernels, "int_gemm_ops", lambda x, tiled: None)  # the one-token kernels, row by row
        with kernels.integer_products("everywhere"):
            want = model(ids, prefill_dtype=prompt_work_dtype(torch.int8, torch.float32))
    assert torch.equal(got, want)


def test_an_int8_prefill_in_query_blocks_reads_the_codes_in_every_block(gemm_kind):
    """A prompt longer than its query block (--prefill-chunk) keeps the codes: no dense copy of any weight."""
    model = tiled_tiny("int4")
    ids = torch.randint(0, TINY.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    model.setup_caches(make_cache_factory("full", 1, TINY, 40, 8))
    with torch.inference_mode():
        calls = profiled(lambda: model(ids, prefill_chunk=16, prefill_dtype=torch.int8))
    assert calls.get("int4_gemm", 0) >= 3 * 4 * TINY.n_layers  # three blocks
    assert "int4_dequantize" not in calls


@pytest.mark.parametrize("mode", ["fp32", "bf16", "int8", "int4"])
def test_auto_prefill_dtype_per_weight_format_and_cpu_kind(mode, cpu_kind):
    """int8 / int4 weights: integer products on a CPU without AMX that runs the GEMM (AVX-512 VNNI, AVX2;
    measured faster there than bfloat16's and float32's), bfloat16 with AMX; bf16 weights: bfloat16 on AMX /
    AVX512-BF16; else the model's."""
    model = quantize.quantize_model(tiny_model(), mode, 32) if mode != "fp32" else tiny_model()
    codes = mode in ("int8", "int4")
    integer = codes and cpu_kind in ("avx2", "avx512-bf16") and kernels.int_gemm_runs()
    bf16 = mode != "fp32" and cpu_kind in ("avx512-bf16", "amx")
    assert decode.prefill_dtype("auto", model) == (torch.int8 if integer else torch.bfloat16 if bf16 else None)
    if codes:  # a compiled prefill keeps ATen's GEMMs
        assert decode.prefill_dtype("auto", model, compiled=True) == (torch.bfloat16 if bf16 else None)


def test_int8_prefill_errors():
    fp32 = tiny_model()
    with pytest.raises(KVFastError, match="multiplies int8 / int4 weights; this model's are torch.float32"):
        decode.prefill_dtype("int8", fp32)
    int4 = quantize.quantize_model(tiny_model(), "int4", 32)
    with pytest.raises(KVFastError, match="runs eagerly: leave out --compile-prefill"):
        decode.prefill_dtype("int8", int4, compiled=True)
    if not kernels.int_gemm_runs():
        with pytest.raises(KVFastError, match="needs a CPU with AVX2 or AVX-512 VNNI"):
            decode.prefill_dtype("int8", int4)
    else:
        assert decode.prefill_dtype("int8", int4) == torch.int8


def test_cli_rejects_int8_products_of_float_weights(tiny_checkpoint, capsys):
    code, _, err = run_cli(capsys, "--checkpoint", str(tiny_checkpoint), "--prompt", "Hi", "--max-new-tokens", "2",
                           "--prefill-dtype", "int8")
    assert code != 0 and "--prefill-dtype int8 multiplies int8 / int4 weights" in err
    assert "Traceback" not in err


def test_the_prompt_mode_reaches_untiled_rows_and_ends_with_its_block(gemm_kind):
    ops = kernels.gemm_ops()
    layer = quantize.quantize_model(tiny_model(), "int8", 32).layers[0].feed_forward.w13
    x = torch.randn(1, 20, TINY.dim)
    with torch.no_grad():
        with kernels.integer_products("prompt"):
            inside = layer(x)
        outside = layer(x)
    assert torch.equal(inside, ops.int8_gemm(x, layer.weight, layer.scales, False))
    assert not torch.equal(outside, inside)  # Q8_0 activations against ATen's int8 x fp32 product
    assert kernels_cpu.tileable(*layer.weight.shape)
