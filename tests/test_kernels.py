"""The CPU probe and its forcing switch: each kind's kernel choices, KVFAST_CPU and force_cpu (which drop the choices
made before, compiled graphs included), the one-line report, and a bad kind as a one-line error."""

import dataclasses

import pytest
import torch
from torch._dynamo.testing import EagerAndRecordGraphs

import kernels
import kernels_cpu
from kernels import KVFastError, cpu, force_cpu, gemm_min_rows, linear_path
from kv.quant import kv_float_dtype
from model import BF16Linear, Transformer

FP32, BF16, INT8, INT4 = torch.float32, torch.bfloat16, torch.int8, torch.uint8

# per kind: the flags the choices see, the GEMM thresholds, --kv-float auto for a verification, the instruction
# set of the integer dot products (kernels_cpu) where this CPU runs the kind
KINDS = {
    "avx2": (["avx2"], {FP32: 5}, torch.float16, "avx2"),
    "avx512-bf16": (["avx2", "avx512", "avx512_vnni", "avx512_bf16"], {FP32: 5, BF16: 8, INT8: 8}, torch.bfloat16,
                    "avx512-vnni"),
    "amx": (list(kernels.FLAGS), {FP32: 5, BF16: 8, INT8: 8}, torch.bfloat16, "avx512-vnni"),
}


@pytest.fixture(autouse=True)
def no_forced_kind(monkeypatch):
    """Each test starts and ends on this CPU as KVFAST_CPU unset chooses, whatever the environment says."""
    monkeypatch.delenv("KVFAST_CPU", raising=False)
    force_cpu(None)
    yield
    monkeypatch.delenv("KVFAST_CPU", raising=False)
    force_cpu(None)


def test_each_kind_decides_its_paths(cpu_kind):
    flags, gemm, verify, isa = KINDS[cpu_kind]
    chip = cpu()
    assert chip.forced == cpu_kind and chip.flags() == flags and chip.bf16_dot == (cpu_kind != "avx2")
    assert (chip.model, chip.aten, chip.onednn) == (kernels.native_cpu().model, kernels.native_cpu().aten,
                                                   kernels.native_cpu().onednn)  # only the vector features change
    expected_gemm = gemm if chip.onednn else {}
    assert gemm_min_rows() == expected_gemm
    assert kv_float_dtype("auto", "cpu", verifies=True) == verify
    assert kv_float_dtype("auto", "cpu") == kv_float_dtype("auto", "cuda", verifies=True) == torch.float16
    if not kernels.native_runs(cpu_kind):  # the best instruction set this CPU runs below the kind's
        isa = kernels_cpu.isa_of(chip, kernels.native_cpu())
    integer = f"int-dot-{isa}" if isa != "scalar" and kernels_cpu.ops(isa) is not None else "reductions"
    assert kernels.int_paths() == ({INT8: integer, INT4: integer} if integer != "reductions" else {})
    for dtype in (FP32, BF16, INT8, INT4):
        first = expected_gemm.get(dtype)
        small = integer if dtype in kernels.INT_DTYPES else "reductions"  # few rows: each row on its own
        if first is None:  # no GEMM for these weights here: reductions / integer products, then ATen's F.linear
            assert [linear_path(dtype, r) for r in (8, 16, 17)] == [small, small, "f-linear"]
        else:
            assert linear_path(dtype, first - 1) == small
            assert linear_path(dtype, first) == linear_path(dtype, 64) == kernels.gemm_path(dtype)
        # a verification's tokens of one sequence keep the per-row kernels; eager and dynamic shapes take F.linear
        assert linear_path(dtype, 8, one_token=False) == small
        assert linear_path(dtype, 17, one_token=False) == "f-linear"
        assert linear_path(dtype, 8, compiled=False) == "f-linear"
        assert linear_path(dtype, 2, compiled=False) == ("int8-gemv" if dtype == INT8 else "f-linear")
    assert "\n" not in kernels.cpu_report() and f"kernels chosen as for {cpu_kind}" in kernels.cpu_report()


def test_without_onednn_every_kind_keeps_the_reductions():
    for kind in KINDS:
        assert gemm_min_rows(dataclasses.replace(kernels.as_kind(kernels.native_cpu(), kind), onednn=False)) == {}


def test_native_is_this_cpu_and_the_report_names_it():
    native = kernels.native_cpu()
    assert cpu() is native and native.forced is None
    caps = torch.cpu.get_capabilities()
    assert native.avx512_bf16 == caps.get("avx512_bf16", False) and native.amx_bf16 == caps.get("amx_bf16", False)
    report = kernels.cpu_report()
    assert "\n" not in report and native.model in report and "chosen as for" not in report
    assert all(flag in report for flag in native.flags())
    for kind in KINDS:  # a kind runs natively when this CPU has every feature it claims
        assert kernels.native_runs(kind) == (set(KINDS[kind][0]) <= set(native.flags()))
    assert kernels.native_runs("native")


def test_kvfast_cpu_chooses_the_kind_and_force_cpu_overrides_it(monkeypatch):
    monkeypatch.setenv("KVFAST_CPU", "avx2")
    force_cpu(None)  # read KVFAST_CPU again
    assert cpu().forced == "avx2" and not cpu().bf16_dot
    with force_cpu("amx") as chip:
        assert chip is cpu() and chip.forced == "amx" and chip.amx_int8
    assert cpu().forced == "avx2"  # back to what KVFAST_CPU says
    monkeypatch.setenv("KVFAST_CPU", "native")
    force_cpu(None)
    assert cpu() is kernels.native_cpu()


def test_a_bad_kind_is_a_one_line_error(monkeypatch, tmp_path):
    with force_cpu("avx2"):
        with pytest.raises(KVFastError, match="unknown CPU kind 'avx3'") as err:
            force_cpu("avx3")
        assert "\n" not in str(err.value) and all(kind in str(err.value) for kind in kernels.CPU_KINDS)
        assert cpu().forced == "avx2"  # unchanged
    monkeypatch.setenv("KVFAST_CPU", "AMX")
    force_cpu(None)
    with pytest.raises(KVFastError, match=r"unknown CPU kind 'AMX' \(KVFAST_CPU\)"):
        cpu()
    with pytest.raises(KVFastError, match="unknown CPU kind"):  # loading reads it first, before any compile
        Transformer.from_checkpoint(tmp_path / "nowhere")


def test_force_cpu_drops_the_graphs_compiled_for_the_kind_before():
    """gemm_rows is a constant of a compiled graph, unguarded: a forced kind must retrace it."""
    layer = BF16Linear(64, 32)
    layer.weight = torch.randn(32, 64).bfloat16()
    graphs = EagerAndRecordGraphs()
    traced = torch.compile(layer, fullgraph=True, dynamic=False, backend=graphs)
    x = torch.randn(8, 1, 64)
    with torch.inference_mode():
        for kind in ("amx", "avx2", "avx512-bf16"):
            with force_cpu(kind):
                traced(x)
    ops = [{n.target for n in g.graph.nodes} for g in graphs.graphs]
    gemm = [torch.ops.kvfast.batched_linear.default in t or torch.ops.kvfast.batched_linear in t for t in ops]
    assert gemm == ([True, False, True] if kernels.native_cpu().onednn else [False, False, False])
