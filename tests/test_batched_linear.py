"""Batched decode's GEMM (kernels.batched_linear): from gemm_rows one-token rows a compiled CPU projection leaves
the per-row reductions for a blocked GEMM where the CPU has one; it equals the product it replaces, a
verification's tokens of one sequence keep the reductions, and a batched compiled decode packs each weight once
and follows eager. The choices are asserted under each forced CPU kind (conftest.cpu_kind)."""

import pytest
import torch
import torch.nn.functional as F
from cache_testing import greedy_with_logits, single_thread_fixture
from numerics import assert_numerically_close
from test_generate import TINY, tiny_model
from test_int_kernels import int8_reference
from torch._dynamo.testing import EagerAndRecordGraphs
from torch._dynamo.utils import counters

import cache as kvcache
import decode
import kernels
import quantize
from model import Linear

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)
ROWS = 5
ALL = {torch.float32: ROWS, torch.bfloat16: ROWS, torch.int8: ROWS}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}
BF16_PATHS = ("gemm-onednn-bf16", "int8pack-mm")  # activations and output rounded to bfloat16


@pytest.fixture
def every_kernel(monkeypatch):
    """Every GEMM from ROWS rows whatever the CPU: the bfloat16 / int8 kernels run (emulated) on CPUs without
    bfloat16 dot products too, so their results are tested anywhere."""
    monkeypatch.setattr(kernels, "GEMM_MIN_ROWS", ALL)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def product(layer, x: torch.Tensor, dense: torch.Tensor, path: str) -> torch.Tensor:
    """What `path` computes for x @ dense.T: the float product, or for the integer dot products the float64 product
    of their Q8_0 activations and the int8 codes."""
    if path.startswith("int-dot"):
        return int8_reference(x, layer.weight, layer.scales, kernels.int_ops()).float()
    return F.linear(x, dense)


def layout_path(path: str) -> str:
    """The path of this file's layers, kept in rows: where the integer kernels read tiles, codes left in rows take
    the reductions (kernels._path)."""
    return "reductions" if path in kernels.TILED_PATHS else path


def layer_and_dense(mode: str, w: torch.Tensor):
    if mode == "fp32":
        layer = Linear(w.shape[1], w.shape[0])
        layer.weight.data = w
        return layer, w.clone()
    if mode == "bf16":
        layer = quantize.BF16Linear(w.shape[1], w.shape[0])
        layer.weight = w.bfloat16()
        return layer, layer.weight.float()
    layer = quantize.Int8Linear(w.shape[1], w.shape[0])
    layer.weight, layer.scales = quantize.quantize_int8(w)
    return layer, layer.weight.float() * layer.scales[:, None]


def graph_path(graph: torch.fx.GraphModule, dtype: torch.dtype) -> str:
    """The kernel a traced projection took, named as kernels.linear_path names it."""
    targets = {n.target for n in graph.graph.nodes}
    if targets & {torch.ops.kvfast.batched_linear, torch.ops.kvfast.batched_linear.default}:
        return kernels.gemm_path(dtype)
    if torch._weight_int8pack_mm in targets:
        return "int8pack-mm"
    if any("int8_linear" in str(t) or "int4_linear" in str(t) for t in targets):
        return kernels.int_path(dtype)
    return "f-linear" if F.linear in targets else "reductions"


@pytest.mark.parametrize("mode", ["fp32", "bf16", "int8"])
def test_batched_rows_take_the_gemm_and_equal_the_product(mode, every_kernel):
    layer, dense = layer_and_dense(mode, torch.randn(80, 192))
    graphs = EagerAndRecordGraphs()
    traced = torch.compile(layer, fullgraph=True, dynamic=False, backend=graphs)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    shapes = [(ROWS - 1, 1, 192), (1, 6, 192), (ROWS, 1, 192), (16, 1, 192)]
    with torch.inference_mode():
        for shape in shapes:
            x = torch.randn(shape)
            gemm = shape[1] == 1 and shape[0] >= ROWS
            if mode != "fp32" and gemm:  # activations and output rounded to bfloat16, as a bfloat16 model's
                expected = F.linear(x.bfloat16().float(), dense)
                assert_numerically_close(compiled(x), expected, depth=192, storage=torch.bfloat16, roundings=1)
            else:
                path = layout_path(kernels.linear_path(DTYPES[mode], x.shape[:-1].numel(), x.shape[1] == 1))
                assert_numerically_close(compiled(x), product(layer, x, dense, path), depth=192)
            traced(x)
    # 4 rows and a verification's 6 tokens of one sequence: reductions (int8: the integer products where chosen);
    # 5 and 16 one-token rows: the GEMM
    gemm, small = kernels.gemm_path(DTYPES[mode]), layout_path(kernels.linear_path(DTYPES[mode], 1))
    assert [graph_path(g, DTYPES[mode]) for g in graphs.graphs] == [small, small, gemm, gemm]
    if mode != "int8":  # a weight changed in place (load_state_dict) is packed again, not read stale
        with torch.no_grad():
            layer.weight.mul_(2)
        with torch.inference_mode():
            x = torch.randn(ROWS, 1, 192)
            expected = F.linear(x if mode == "fp32" else x.bfloat16().float(), 2 * dense)
            rounded = {} if mode == "fp32" else {"storage": torch.bfloat16, "roundings": 1}
            assert_numerically_close(compiled(x), expected, depth=192, **rounded)


@pytest.mark.parametrize("mode", ["fp32", "bf16", "int8"])
def test_the_cpu_kind_decides_each_projection_path(mode, cpu_kind):
    """The traced graph takes the path linear_path names for this kind: its GEMM from gemm_rows one-token rows
    where it has one for the weights (bfloat16 / int8: only with bfloat16 dot products), the reductions below it
    and for a verification's tokens of one sequence, F.linear past MAX_REDUCTION_ROWS rows without a GEMM."""
    dtype = DTYPES[mode]
    layer, dense = layer_and_dense(mode, torch.randn(80, 192))
    has_gemm = mode == "fp32" or cpu_kind != "avx2"
    assert (dtype in kernels.gemm_min_rows()) == has_gemm
    first = min(kernels.gemm_rows(dtype), kernels.MAX_REDUCTION_ROWS + 1)  # the first rows past the reductions
    shapes = [(first - 1, 1), (1, 6), (first, 1)]
    expected = [kernels.linear_path(dtype, rows * tokens, tokens == 1) for rows, tokens in shapes]
    small = kernels.int_paths().get(dtype, "reductions")
    assert expected == [small, small, kernels.gemm_path(dtype) if has_gemm else "f-linear"]
    graphs = EagerAndRecordGraphs()
    traced = torch.compile(layer, fullgraph=True, dynamic=False, backend=graphs)
    with torch.inference_mode():
        for rows, tokens in shapes:
            x = torch.randn(rows, tokens, 192)
            y = traced(x)
            if graphs.graphs and graph_path(graphs.graphs[-1], dtype) in BF16_PATHS:
                assert_numerically_close(y, F.linear(x.bfloat16().float(), dense), depth=192, storage=torch.bfloat16,
                                         roundings=1)
            else:
                path = layout_path(kernels.linear_path(dtype, rows * tokens, tokens == 1))
                assert_numerically_close(y, product(layer, x, dense, path), depth=192)
    assert [graph_path(g, dtype) for g in graphs.graphs] == [layout_path(p) for p in expected]


@pytest.mark.parametrize("mode", ["fp32", "bf16", "int8"])
def test_batched_compiled_decode_packs_once_follows_eager_and_never_recompiles(mode, cpu_kind):
    """8 rows, the threshold of every GEMM: each projection takes the kind's path for its weights."""
    B, S, N = 8, 12, 16
    path = kernels.linear_path(DTYPES[mode], B)
    if path != "reductions" and not kernels.native_runs(cpu_kind):
        pytest.skip(f"{path}: this CPU ({kernels.cpu_report()}) would run it emulated, not as {cpu_kind} does")
    below = kernels.int_paths().get(DTYPES[mode], "reductions")  # no GEMM for bfloat16 / int8 weights on AVX2
    assert path == (below if mode != "fp32" and cpu_kind == "avx2" else kernels.gemm_path(DTYPES[mode]))
    model = tiny_model() if mode == "fp32" else quantize.quantize_model(tiny_model(), mode, 32)
    prompt = torch.randint(0, TINY.vocab_size, (B, S), generator=torch.Generator().manual_seed(4))
    model.setup_caches(kvcache.make_cache_factory("full", B, TINY, S, N))

    def run(decoder):
        return greedy_with_logits(model, decoder, prompt, N)

    eager_tokens, eager_logits = run(decode.Decoder(model))
    kernels._packed.clear()
    decoder = decode.Decoder(model, compile=True)
    decoder.warm_up(prompt)
    recompiles = sum(counters["recompiles"].values())
    tokens, logits = run(decoder)
    assert sum(counters["recompiles"].values()) == recompiles
    matrices = {m.weight.data_ptr() for m in model.modules() if getattr(m, "weight", None) is not None and m.weight.dim() == 2}
    assert len(matrices) == 1 + 4 * TINY.n_layers  # the projections and the (tied) head
    onednn = path.startswith("gemm-onednn")  # each weight packed once (int8: ATen's own layout)
    assert len(kernels._packed) == (len(matrices) if onednn else 0)
    if path.startswith("int-dot"):  # eager multiplies the exact activations: Q8_0's rounding (2^-8 of a block's
        err = (logits[0] - eager_logits[0]).abs().max() / eager_logits[0].abs().max()  # largest) moves the logits
        assert 0 < err < 0.1, err  # by a few bfloat16-like roundings
    elif path not in BF16_PATHS:  # the same products in another order
        args = model.args  # depth: one layer's reductions (projections, attention over the sequence, FFN), each layer
        depth = args.n_layers * (2 * args.dim + S + N + args.intermediate_size) + args.dim
        assert_numerically_close(logits, eager_logits, depth=depth)
        assert torch.equal(tokens, eager_tokens)
    else:  # eager multiplies in fp32: the GEMM's bfloat16 rounding moves the logits by a bfloat16 model's error
        err = (logits[0] - eager_logits[0]).abs().max() / eager_logits[0].abs().max()
        assert 0 < err < 0.03, err
