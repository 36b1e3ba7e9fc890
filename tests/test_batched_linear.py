"""Batched decode's GEMM (model.batched_linear): from GEMM_MIN_ROWS one-token rows a compiled CPU projection
leaves the per-row reductions for a blocked GEMM; it equals the product it replaces, a verification's tokens of
one sequence keep the reductions, and a batched compiled decode packs each weight once and follows eager."""

import pytest
import torch
import torch.nn.functional as F
from cache_testing import single_thread_fixture
from test_generate import TINY, tiny_model
from torch._dynamo.testing import EagerAndRecordGraphs
from torch._dynamo.utils import counters

import cache as kvcache
import generate
import model as mdl
import quantize

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)
ROWS = 5
ALL = {torch.float32: ROWS, torch.bfloat16: ROWS, torch.int8: ROWS}


@pytest.fixture(autouse=True)
def every_kernel(monkeypatch):
    """The bfloat16 / int8 kernels run (emulated) on CPUs without bfloat16 dot products too: test them anywhere."""
    monkeypatch.setattr(mdl, "GEMM_MIN_ROWS", ALL)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def layer_and_dense(mode: str, w: torch.Tensor):
    if mode == "fp32":
        layer = mdl.Linear(w.shape[1], w.shape[0])
        layer.weight.data = w
        return layer, w.clone()
    if mode == "bf16":
        layer = quantize.BF16Linear(w.shape[1], w.shape[0])
        layer.weight = w.bfloat16()
        return layer, layer.weight.float()
    layer = quantize.Int8Linear(w.shape[1], w.shape[0])
    layer.weight, layer.scales = quantize.quantize_int8(w)
    return layer, layer.weight.float() * layer.scales[:, None]


def gemm_nodes(graph: torch.fx.GraphModule) -> int:
    targets = (torch.ops.kvfast.batched_linear, torch.ops.kvfast.batched_linear.default, torch._weight_int8pack_mm)
    return sum(n.target in targets for n in graph.graph.nodes)


@pytest.mark.parametrize("mode", ["fp32", "bf16", "int8"])
def test_batched_rows_take_the_gemm_and_equal_the_product(mode):
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
                torch.testing.assert_close(compiled(x), expected, rtol=2 ** -7, atol=1e-3)
            else:
                torch.testing.assert_close(compiled(x), F.linear(x, dense), rtol=1e-5, atol=1e-4)
            traced(x)
    # 4 rows and a verification's 6 tokens of one sequence: reductions; 5 and 16 one-token rows: the GEMM
    assert [gemm_nodes(g) > 0 for g in graphs.graphs] == [False, False, True, True]
    if mode != "int8":  # a weight changed in place (load_state_dict) is packed again, not read stale
        with torch.no_grad():
            layer.weight.mul_(2)
        with torch.inference_mode():
            x = torch.randn(ROWS, 1, 192)
            expected = F.linear(x if mode == "fp32" else x.bfloat16().float(), 2 * dense)
            torch.testing.assert_close(compiled(x), expected, rtol=2 ** -7 if mode != "fp32" else 1e-5, atol=1e-3)


def test_cpus_without_bfloat16_dot_products_keep_the_reductions_for_bf16_and_int8(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert set(mdl.gemm_min_rows()) == {torch.float32}
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert set(mdl.gemm_min_rows()) == set(ALL)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert mdl.gemm_min_rows() == {}


@pytest.mark.parametrize("mode", ["fp32", "bf16", "int8"])
def test_batched_compiled_decode_packs_once_follows_eager_and_never_recompiles(mode):
    B, S, N = 6, 12, 16
    model = tiny_model() if mode == "fp32" else quantize.quantize_model(tiny_model(), mode, 32)
    prompt = torch.randint(0, TINY.vocab_size, (B, S), generator=torch.Generator().manual_seed(4))
    model.setup_caches(kvcache.make_cache_factory("full", B, TINY, S, N))

    def run(decoder):
        logits = []
        for c in model.caches:
            c.reset()
        with torch.inference_mode():
            first = decoder.prefill(model, prompt, 0.0, None)
            rest = decoder.decode(first, S, N - 1, on_logits=lambda i, lg: logits.append(lg[:, -1].float()))
        return torch.cat([first, rest], 1), torch.stack(logits)

    eager_tokens, eager_logits = run(generate.Decoder(model))
    mdl._packed.clear()
    decoder = generate.Decoder(model, compile=True)
    decoder.warm_up(prompt)
    recompiles = sum(counters["recompiles"].values())
    tokens, logits = run(decoder)
    assert sum(counters["recompiles"].values()) == recompiles
    matrices = {m.weight.data_ptr() for m in model.modules() if getattr(m, "weight", None) is not None and m.weight.dim() == 2}
    assert len(matrices) == 1 + 4 * TINY.n_layers  # the projections and the (tied) head
    assert len(mdl._packed) == (0 if mode == "int8" else len(matrices))  # each packed once (int8: ATen's own layout)
    if mode == "fp32":  # the same products in another order
        torch.testing.assert_close(logits, eager_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(tokens, eager_tokens)
    else:  # eager multiplies in fp32: the GEMM's bfloat16 rounding moves the logits by a bfloat16 model's error
        err = (logits[0] - eager_logits[0]).abs().max() / eager_logits[0].abs().max()
        assert 0 < err < 0.03, err
