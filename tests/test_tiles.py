"""Tiled int8 / int4 weights (kernels_cpu.tile_int8 / tile_int4, kernels.tile_weights): the layouts round-trip,
the tiled products (AVX-512 and AVX2 builds) equal the float64 product of their operands, and a tiled layer keeps
quantize.py's rows in its state_dict, its dense weight and every other kernel's product."""

import pytest
import torch
from numerics import assert_numerically_close
from test_int_kernels import built, check_against_float64
from torch._dynamo.testing import EagerAndRecordGraphs

import kernels
import kernels_cpu
import quantize
from kernels import dequantize_int4

SHAPES = [(1, 576, 96, 32), (3, 1536, 48, 32), (2, 192, 32, 64), (1, 128, 16, 128), (1, 96, 16, 32)]


TILED_ISAS = ("avx512-vnni", "avx2")


def tiled_ops(isa: str = "avx512-vnni"):
    ops = built(isa)
    if not hasattr(ops, "int8_linear_tiled"):
        pytest.skip("no tiled kernels in this build")
    return ops


@pytest.mark.parametrize("shape", [(16, 64, 32), (48, 96, 32), (576, 1536, 64), (32, 896, 128)])
def test_tiles_round_trip_and_hold_16_rows_side_by_side(shape):
    out, n_in, group = shape
    w = torch.randn(out, n_in, generator=torch.Generator().manual_seed(n_in))
    codes, _ = quantize.quantize_int8(w)
    packed, scales, _ = quantize.quantize_int4(w, group)
    tiled8, tiled4 = kernels_cpu.tile_int8(codes), kernels_cpu.tile_int4(packed)
    assert tiled8.shape == codes.shape and tiled8.dtype == torch.int8 and tiled4.shape == packed.shape
    assert torch.equal(kernels_cpu.untile_int8(tiled8), codes)
    assert torch.equal(kernels_cpu.untile_int4(tiled4), packed)
    assert torch.equal(kernels_cpu.untile_groups(kernels_cpu.tile_groups(scales)), scales)
    # the first 64 bytes: columns 0-3 of rows 0-15, code + 128 (int8); columns 0-7 of rows 0-15 as nibbles (int4)
    assert torch.equal(tiled8.flatten()[:64].view(torch.uint8).view(16, 4).int(), codes[:16, :4].int() + 128)
    first = tiled4.flatten()[:64].view(16, 4)
    full = torch.cat([packed & 15, packed >> 4], 1)
    assert torch.equal(first & 15, full[:16, :4]) and torch.equal(first >> 4, full[:16, 4:8])
    assert torch.equal(kernels_cpu.tile_groups(scales).view(-1, scales.shape[1], 16)[0], scales[:16].T)


@pytest.mark.parametrize("isa", TILED_ISAS)
@pytest.mark.parametrize("shape", SHAPES)
def test_tiled_kernels_equal_the_float64_product_of_their_operands(shape, isa):
    ops = tiled_ops(isa)
    check_against_float64(
        shape, ops, lambda x, codes, scales: ops.int8_linear_tiled(x, kernels_cpu.tile_int8(codes), scales),
        lambda x, packed, scales, offsets: ops.int4_linear_tiled(
            x, kernels_cpu.tile_int4(packed), kernels_cpu.tile_groups(scales), kernels_cpu.tile_groups(offsets)))


@pytest.mark.parametrize("isa", TILED_ISAS)
@pytest.mark.parametrize("sign", [1, -1])
def test_tiled_kernels_hold_the_largest_sums_a_block_can_have(isa, sign):
    """Every code at its extreme (int8 127 * sign, int4 15) against activations that all quantize to 127 * sign:
    the largest partial sums (the AVX2 build adds a block's int4 products in int16, its int8 pairs in maddubs)
    come out exact, not saturated."""
    ops = tiled_ops(isa)
    n_in, n_out = 256, 32
    x = torch.full((1, 1, n_in), float(sign))  # Q8_0: codes 127 * sign, scale 1 / 127
    codes = torch.full((n_out, n_in), 127 * sign, dtype=torch.int8)
    y8 = ops.int8_linear_tiled(x, kernels_cpu.tile_int8(codes), torch.ones(n_out))
    packed = torch.full((n_out, n_in // 2), 0xFF, dtype=torch.uint8)
    ones, zeros = torch.ones(n_out, n_in // 32), torch.zeros(n_out, n_in // 32)
    y4 = ops.int4_linear_tiled(x, kernels_cpu.tile_int4(packed), kernels_cpu.tile_groups(ones),
                               kernels_cpu.tile_groups(zeros))
    assert_numerically_close(y8, torch.full_like(y8, 127.0 * n_in), depth=n_in)
    assert_numerically_close(y4, torch.full_like(y4, 15.0 * n_in * sign), depth=n_in)


@pytest.mark.parametrize("isa", TILED_ISAS)
def test_int4_tiles_keep_float16_scales_where_exact_and_multiply_as_with_fp32(isa):
    """quantize_int4's scales and offsets are float16 values: the tiles hold them in 16 bits, and the kernel's
    products are the fp32 tiles' bit for bit. An older checkpoint's fp32 scales stay fp32 in tiles."""
    ops = tiled_ops(isa)
    rows, tiled = layer_pair("int4", 48, 256)
    assert tiled.scales.dtype == tiled.offsets.dtype == torch.float16
    fp32_tiles = [kernels_cpu.tile_groups(t) for t in (rows.scales, rows.offsets)]
    x = torch.randn(3, 256)
    assert torch.equal(ops.int4_linear_tiled(x, tiled.weight, tiled.scales, tiled.offsets),
                       ops.int4_linear_tiled(x, tiled.weight, *fp32_tiles))
    old = layer_pair("int4", 48, 256, tile=False)[0]
    old.scales += 1e-6  # not float16 values
    kernels_cpu.retile(old, True)
    assert old.scales.dtype == torch.float32 and torch.equal(old.rows()["scales"], rows.scales + 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tiled_int4_weight_dequantizes_to_the_rows_values(dtype):
    """The prompt's dense copy: the C++ one-pass kernel reads tiles bit for bit as rows, and so does the torch
    fallback (what a compiled graph or another device runs)."""
    packed, scales, offsets = quantize.quantize_int4(torch.randn(48, 256, generator=torch.Generator().manual_seed(1)), 64)
    tiles = (kernels_cpu.tile_int4(packed), kernels_cpu.tile_groups(scales), kernels_cpu.tile_groups(offsets))
    assert torch.equal(dequantize_int4(*tiles, dtype, tiled=True), dequantize_int4(packed, scales, offsets, dtype))
    assert torch.equal(dequantize_int4(*tiles, torch.float16, tiled=True),  # not the kernel's dtypes: torch's ops
                       dequantize_int4(packed, scales, offsets, torch.float16))


def layer_pair(mode: str, out: int = 48, n_in: int = 128, tile: bool = True):
    """A quantized layer and a copy of it, tiled unless not `tile`."""
    w = torch.randn(out, n_in, generator=torch.Generator().manual_seed(out))
    layers = []
    for _ in range(2):
        layer = quantize.Int8Linear(n_in, out) if mode == "int8" else quantize.Int4Linear(n_in, out, 32)
        if mode == "int8":
            layer.weight, layer.scales = quantize.quantize_int8(w)
        else:
            layer.weight, layer.scales, layer.offsets = quantize.quantize_int4(w, 32)
        layers.append(layer)
    if tile:
        kernels_cpu.retile(layers[1], True)
    return layers


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_tiled_layer_keeps_its_rows_state_dict_and_products(mode):
    rows, tiled = layer_pair(mode)
    assert tiled.tiled and not torch.equal(tiled.weight, rows.weight)
    assert all(torch.equal(tiled.state_dict()[k], v) for k, v in rows.state_dict().items())
    assert torch.equal(tiled.dense_weight(torch.float32), rows.dense_weight(torch.float32))
    x = torch.randn(2, 9, 128)
    with torch.no_grad():
        assert torch.equal(tiled(x), rows(x))  # 18 eager rows: F.linear on the same dense weight
        few = torch.randn(1, 5, 128)  # a short prompt: the step's tiled kernel where it runs, else F.linear
        if kernels.int_gemm_ops(few, tiled=True) is None:
            assert torch.equal(tiled(few), rows(few))
        else:
            with kernels.integer_products("everywhere"):
                assert_numerically_close(tiled(few), rows(few), depth=128 + 4, storage=torch.bfloat16, roundings=1)
        if kernels.int_path(rows.weight.dtype) in kernels.TILED_PATHS:
            one = torch.randn(1, 1, 128)
            with kernels.integer_products("everywhere"):
                assert_numerically_close(tiled(one), rows(one), depth=128 + 4, storage=torch.bfloat16, roundings=1)
    fresh = layer_pair(mode)[1]
    fresh.load_state_dict(rows.state_dict())  # rows copied over the tiles
    assert not fresh.tiled and torch.equal(fresh.weight, rows.weight)
    kernels_cpu.retile(tiled, False)
    assert not tiled.tiled and all(torch.equal(getattr(tiled, k), v) for k, v in rows.state_dict().items())


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_compiled_step_through_reductions_reads_tiles_as_rows(mode):
    """Where the timing chose the reductions after all (or a forced CPU kind), a tiled layer's compiled product
    untiles inside the graph and equals the rows' product."""
    rows, tiled = layer_pair(mode)
    x = torch.randn(1, 1, 128)
    with kernels.integer_products("nowhere"), torch.no_grad():
        want = torch.compile(rows, fullgraph=True, dynamic=False)(x)
        got = torch.compile(tiled, fullgraph=True, dynamic=False)(x)
    assert_numerically_close(got, want, depth=128)


def test_tile_weights_tiles_what_the_tiled_kernels_read_and_nothing_else():
    tiled_ops()
    wide, narrow = layer_pair("int4", 48, tile=False)[0], layer_pair("int4", 40, tile=False)[0]  # 40 rows: no whole tiles
    assert kernels.tile_weights([wide, narrow]) == 1
    assert wide.tiled and not narrow.tiled
    assert kernels.tile_weights([wide]) == 0  # once
    other = layer_pair("int8", tile=False)[0]
    with kernels.integer_products("nowhere"):  # the reductions read rows
        assert kernels.tile_weights([other]) == 0 and not other.tiled
    if kernels.native_cpu().avx2:
        with kernels.force_cpu("avx2"):  # the AVX2 build reads tiles too
            assert kernels.tile_weights([other]) == 1 and other.tiled


def test_a_tiled_int8_embedding_looks_up_its_rows_and_keeps_its_state_dict():
    """The tied head in tiles: an embedding lookup reads the same codes, the state_dict the rows."""
    rows, tiled = quantize.Int8Embedding(48, 64), quantize.Int8Embedding(48, 64)
    codes, scales = quantize.quantize_int8(torch.randn(48, 64, generator=torch.Generator().manual_seed(3)))
    for e in (rows, tiled):
        e.weight, e.scales = codes, scales
    kernels_cpu.retile(tiled, True)
    idx = torch.tensor([[0, 17, 47], [15, 16, 31]])
    assert tiled.tiled and torch.equal(tiled(idx), rows(idx))
    assert torch.equal(torch.compile(tiled, fullgraph=True, dynamic=False)(idx), rows(idx))
    assert torch.equal(tiled.state_dict()["weight"], codes)


def test_a_batch_that_takes_a_gemm_keeps_its_int8_rows():
    """From 8 rows a CPU with bfloat16 dot products multiplies int8 weights in ATen's GEMM, which reads rows;
    int4 keeps the integer products, in tiles."""
    tiled_ops()
    with kernels.force_cpu("avx512-bf16"):
        if kernels.linear_path(torch.int8, 8) in kernels.TILED_PATHS:
            pytest.skip("no int8 GEMM here")
        int8, int4 = layer_pair("int8", tile=False)[0], layer_pair("int4", tile=False)[0]
        assert kernels.tile_weights([int8, int4], rows=8) == 1
        assert int4.tiled and not int8.tiled
        assert kernels.tile_weights([int8], rows=1) == 1 and int8.tiled


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_through_tiled_int8_codes_equals_the_rows_product(dtype):
    """A prompt's rows reach tiled int8 codes through int8_dequantize (one pass, exact codes), a prompt's last row
    through the tied head through the step's tiled kernel: the rows' products, bit for bit and up to the
    activations' Q8_0 rounding respectively."""
    ops = tiled_ops()
    rows, tiled = layer_pair("int8")
    assert torch.equal(ops.int8_dequantize(tiled.weight, dtype, True), rows.weight.to(dtype))
    assert torch.equal(ops.int8_dequantize(rows.weight, dtype, False), rows.weight.to(dtype))
    x = torch.randn(30, 128).to(dtype)
    with torch.no_grad():
        assert torch.equal(tiled(x), rows(x))
        one = torch.randn(1, 1, 128)
        got = kernels.linear(one, tiled.weight, tiled.scales, tiled=True)  # eager, one row: "int8-gemv" in rows
        with kernels.integer_products("everywhere"):
            want = rows(one)
    assert_numerically_close(got, want, depth=128 + 4)


def test_timing_keeps_the_integer_kernels_of_what_a_decoder_tiled(monkeypatch):
    """A model tiled by an earlier Decoder is not timed again: a flip to the reductions would untile its codes
    (and its tied head's) inside every step."""
    tiled_ops()
    linear, head = layer_pair("int8", 48, 256, tile=False)[0], quantize.Int8Embedding(48, 64)
    head.weight, head.scales = quantize.quantize_int8(torch.randn(48, 64))
    kernels_cpu.retile(head, True)
    monkeypatch.setattr(kernels, "_TIMED", {})
    monkeypatch.setattr(kernels_cpu, "remembered_choice", lambda *a: pytest.fail("timed a kept dtype"))
    assert kernels.time_int_paths([linear, head]) == {torch.int8: True}
    assert kernels.int_path(torch.int8) in kernels.TILED_PATHS


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_compiled_product_follows_its_layers_layout_not_a_later_timing(mode, monkeypatch):
    """A later timing of another model's weights of this dtype flips the global choice; a layer a Decoder tiled
    keeps the tiled kernel (untiling it inside every step cost 13 instead of 98 tok/s), and one it left in rows
    keeps the reductions (the row-major kernel: 81 instead of 141 tok/s in a benched step)."""
    tiled_ops()
    rows, tiled = layer_pair(mode, 48, 256)
    op = "int8_linear_tiled" if mode == "int8" else "int4_linear_tiled"
    x = torch.randn(1, 1, 256)
    for flipped_to_integer, layer, kernel in ((False, tiled, op), (True, rows, None)):
        monkeypatch.setattr(kernels, "_INT_PATHS", {} if not flipped_to_integer else None)
        monkeypatch.setattr(kernels, "_TIMED", {layer.weight.dtype: flipped_to_integer})
        torch._dynamo.reset()
        graphs = EagerAndRecordGraphs()
        with torch.no_grad():
            torch.compile(layer, fullgraph=True, dynamic=False, backend=graphs)(x)
        targets = {str(n.target) for g in graphs.graphs for n in g.graph.nodes}
        assert any(op in t for t in targets) == (kernel is not None)
        assert not any("linear" in t and "kvfast" in t for t in targets) or kernel is not None
    torch._dynamo.reset()
