"""Weight-only int8 / int4: the quantizers' error bounds, the compiled multiply-and-sum equals the dequantized
product, a quantized checkpoint round-trips through quantize.py and generate.py, and bad input is one line."""

import shutil

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_numerically_close, model_depth
from test_generate import TINY, greedy, tiny_checkpoint, tiny_model  # noqa: F401 -- fixture reused
from torch._dynamo.testing import EagerAndRecordGraphs

import cache as kvcache
import cli
import decode
import generate
import kernels
import quantize
from kernels import MAX_REDUCTION_ROWS, dequantize_int4
from model import KVFastError, Linear, Transformer

torch.manual_seed(0)


def test_int8_codes_are_within_half_a_step():
    w = torch.randn(40, 96) * torch.linspace(0.01, 3, 40)[:, None]  # rows of very different ranges
    codes, scales = quantize.quantize_int8(w)
    assert codes.dtype == torch.int8 and scales.shape == (40,)
    assert torch.all((codes.float() * scales[:, None] - w).abs() <= scales[:, None] / 2 + 1e-6)
    assert torch.equal(codes.abs().amax(-1), torch.full((40,), 127, dtype=torch.int8))  # full range used


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_packing_and_error_bound(group_size):
    w = torch.randn(24, 128) + torch.linspace(-2, 2, 128)  # groups with different offsets
    packed, scales, offsets = quantize.quantize_int4(w, group_size)
    assert packed.dtype == torch.uint8 and packed.shape == (24, 64)
    assert scales.shape == offsets.shape == (24, 128 // group_size)
    # the layout quantize.py documents: column j in the low nibble, column j + in/2 in the high one
    col = 70
    code = (packed[:, col - 64] >> 4).float()
    group = col // group_size
    assert torch.allclose(code * scales[:, group] + offsets[:, group], dequantize_int4(packed, scales, offsets)[:, col])
    err = (dequantize_int4(packed, scales, offsets) - w).view(24, -1, group_size).abs()
    assert torch.all(err <= scales[..., None] / 2 + 1e-5)
    # scales and offsets are float16 values (the tiles keep them in 16 bits) that still span each group
    assert all(torch.equal(t.half().float(), t) for t in (scales, offsets))
    groups = w.view(24, -1, group_size)
    assert torch.all(offsets <= groups.amin(-1)) and torch.all(offsets + 15 * scales >= groups.amax(-1))


@pytest.mark.parametrize("mode", ["fp32", "int8", "int4", "bf16"])
def test_compiled_reduction_equals_dequantized_product(mode):
    """The decode path (multiply-and-sum with the dequantization fused in, one reduction per row up to
    MAX_REDUCTION_ROWS rows) against F.linear on the weight; more rows take F.linear inside the graph too. int8 /
    int4: the reductions, which CPUs without the integer dot products take (those: tests/test_int_kernels.py)."""
    with kernels.integer_products("nowhere"):
        check_reduction_equals_dequantized_product(mode)


def check_reduction_equals_dequantized_product(mode: str) -> None:
    w = torch.randn(80, 192)
    layers = {"fp32": Linear(192, 80), "int8": quantize.Int8Linear(192, 80), "int4": quantize.Int4Linear(192, 80, 64),
              "bf16": quantize.BF16Linear(192, 80)}
    layer = layers[mode]
    if mode == "fp32":
        layer.weight.data, dense = w, w
    elif mode == "int8":
        layer.weight, layer.scales = quantize.quantize_int8(w)
        dense = layer.weight.float() * layer.scales[:, None]
    elif mode == "bf16":
        layer.weight = w.bfloat16()
        dense = w.bfloat16().float()
    else:
        layer.weight, layer.scales, layer.offsets = quantize.quantize_int4(w, 64)
        dense = dequantize_int4(layer.weight, layer.scales, layer.offsets)
    torch._dynamo.reset()
    graphs = EagerAndRecordGraphs()
    traced = torch.compile(layer, fullgraph=True, backend=graphs)
    compiled = torch.compile(layer, fullgraph=True)
    with torch.inference_mode():
        for shape in [(1, 1, 192), (2, 3, 192), (1, MAX_REDUCTION_ROWS + 1, 192)]:
            x = torch.randn(shape)
            expected = F.linear(x, dense)
            assert_numerically_close(layer(x), expected, depth=192)  # eager: F.linear on the fly
            assert_numerically_close(compiled(x), expected, depth=192)
            traced(x)
    uses_linear = [any(n.target is F.linear for n in g.graph.nodes) for g in graphs.graphs]
    assert uses_linear == [False, False, True]  # 1 and 6 rows: reductions; 17: torch's GEMM


def dequantized_copy(base: Transformer, mode: str, group_size: int) -> Transformer:
    """A float model whose weights are exactly what the quantized model represents."""
    model = tiny_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and mode == "bf16":
                p.copy_(p.bfloat16().float())
            elif p.dim() == 2 and (mode == "int8" or name == "tok_embeddings.weight"):
                codes, scales = quantize.quantize_int8(p)
                p.copy_(codes.float() * scales[:, None])
            elif p.dim() == 2:
                p.copy_(dequantize_int4(*quantize.quantize_int4(p, group_size)))
    return model


@pytest.mark.parametrize("mode", ["int8", "int4", "bf16"])
def test_quantized_model_is_its_dequantized_weights_and_decodes_compiled_as_eager(mode):
    """Compiled through the reductions, as eager's fp32 products (the integer dot products' decode against eager
    through the same kernel: tests/test_int_kernels.py)."""
    with kernels.integer_products("nowhere"):
        check_dequantized_weights_and_compiled_decode(mode)


def check_dequantized_weights_and_compiled_decode(mode: str) -> None:
    base, model = tiny_model(), quantize.quantize_model(tiny_model(), mode, 32)
    assert not any(p.dim() > 1 for p in model.parameters())  # every matrix became a quantized buffer
    assert model.weight_bytes() < base.weight_bytes() / {"int8": 3.5, "int4": 4.5, "bf16": 1.9}[mode]
    ids = torch.randint(0, TINY.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        got = model(ids, all_logits=True)
        # the same weights, multiplied in another order (int8: the row scale after the sum)
        assert_numerically_close(got, dequantized_copy(base, mode, 32)(ids, all_logits=True),
                                 depth=model_depth(TINY, ids.shape[1]))
        if mode == "int8":  # and int8 barely moves the distribution
            ref = F.log_softmax(base(ids, all_logits=True), -1)
            kl = (ref.exp() * (ref - F.log_softmax(got, -1))).sum(-1).mean()
            assert kl < 0.01, kl

    prompt = ids[:, :16]
    model.setup_caches(kvcache.make_cache_factory("h2o", 1, TINY, 16, 40, budget=24))
    eager = greedy(model, decode.Decoder(model), prompt, 32)
    torch._dynamo.reset()
    decoder = decode.Decoder(model, compile=True)
    greedy(model, decoder, prompt, 4)  # warm-up
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert torch.equal(greedy(model, decoder, prompt, 32), eager)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_explicit_prefill_dtypes():
    model = tiny_model()
    assert decode.prefill_dtype("float32", model) == torch.float32
    assert decode.prefill_dtype("bfloat16", model) == torch.bfloat16
    with pytest.raises(KVFastError, match="unknown prefill dtype 'float8'"):
        decode.prefill_dtype("float8", model)


def test_int8_prompt_product_in_bfloat16_stays_bfloat16():
    """A prompt's bfloat16 rows through int8 weights come back in bfloat16 (the fp32 row scales once promoted
    them, so the next product ran in fp32), equal to the float product up to the output's two roundings."""
    layer = quantize.quantize_model(tiny_model(), "int8", 32).layers[0].feed_forward.w13
    x = torch.randn(40, TINY.dim).bfloat16()
    with torch.inference_mode():
        y = layer(x)
    assert y.dtype == torch.bfloat16
    expected = x.float() @ (layer.weight.float() * layer.scales[:, None]).T
    assert_numerically_close(y.float(), expected, depth=TINY.dim, storage=torch.bfloat16, roundings=2)


@pytest.mark.parametrize("mode", ["int8", "int4", "bf16"])
def test_quantize_cli_round_trip_and_generate(mode, tiny_checkpoint, tmp_path, capsys):  # noqa: F811
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    out = quantize.main(["--checkpoint", str(ckpt), "--mode", mode, "--group-size", "32"])
    assert out.name == ("model_int4-g32.pth" if mode == "int4" else f"model_{mode}.pth")
    assert "MB ->" in capsys.readouterr().out
    loaded = Transformer.from_checkpoint(out)
    in_memory = quantize.quantize_model(Transformer.from_checkpoint(ckpt), mode, 32)
    ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        assert torch.equal(loaded(ids, all_logits=True), in_memory(ids, all_logits=True))
    code = generate.cli(["--checkpoint", str(out), "--prompt", "Hello there", "--max-new-tokens", "8",
                         "--temperature", "0", "--ignore-eos"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "bandwidth achieved" in captured.out


def run_quantize(capsys, *argv: str) -> tuple[int, str]:
    code = cli.run_cli(quantize.main, list(argv))
    return code, capsys.readouterr().err


def test_quantize_cli_errors_are_one_line(tiny_checkpoint, tmp_path, capsys):  # noqa: F811
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    cases = [
        (["--mode", "int3"], "invalid choice: 'int3'"),
        (["--mode", "int4", "--group-size", "64"], "--group-size 64 does not divide the input width 96"),
        (["--checkpoint", str(tmp_path / "nowhere")], "checkpoint not found"),
        (["--out", str(tmp_path / "elsewhere.pth")], "--out must lie in the checkpoint folder"),
        (["--out", str(ckpt / "model.safetensors")], "give a new .pth name"),
        (["--out", str(ckpt / "model.pth")], "give a new .pth name"),
    ]
    for argv, expected in cases:
        code, err = run_quantize(capsys, "--checkpoint", str(ckpt), *argv)
        assert code == 2 and expected in err and err.count("\n") == 1, err
    quantized = quantize.main(["--checkpoint", str(ckpt)])
    capsys.readouterr()
    code, err = run_quantize(capsys, "--checkpoint", str(quantized))
    assert code == 2 and "already quantized" in err
    # a quantized file that lost its layers' scales is refused in one line, not by load_state_dict
    state = torch.load(quantized)
    del state["layers.0.attention.wqkv.scales"]
    torch.save(state, ckpt / "broken.pth")
    with pytest.raises(KVFastError, match="not a checkpoint written by quantize.py"):
        Transformer.from_checkpoint(ckpt / "broken.pth")


@pytest.mark.real_model
def test_default_model_int8_is_nearly_lossless(default_checkpoint):
    from tokenizer import load_tokenizer

    model = Transformer.from_checkpoint(default_checkpoint)
    text = ("The lighthouse keeper climbed the stairs at dusk, as he had every evening for thirty years. "
            "Below him the sea was grey and restless, and the wind carried the smell of salt and rain. ") * 4
    ids = torch.tensor([load_tokenizer(default_checkpoint).encode(text)])
    with torch.inference_mode():
        ref = F.log_softmax(model(ids, all_logits=True), -1)
        got = F.log_softmax(quantize.quantize_model(model, "int8")(ids, all_logits=True), -1)
    kl = (ref.exp() * (ref - got)).sum(-1).mean()
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean()
    assert kl < 0.02 and top1 > 0.9, (kl, top1)
