"""A prompt's causal attention in bfloat16 through attention_cpu.cpp's AVX512-BF16 kernel
(attention.prompt_attention_path): equal to fp32 attention over the same bfloat16 inputs up to the kernel's
roundings, chosen only where it runs."""

import math

import pytest
import torch
import torch.nn.functional as F
from numerics import tolerance

import attention
import kernels
import kernels_cpu


def kernel_ops():
    if not kernels.native_cpu().avx512_bf16:
        pytest.skip("this CPU has no AVX512-BF16")
    ops = kernels_cpu.ops("avx512-vnni")
    if ops is None or not hasattr(ops, "prompt_attention"):
        pytest.skip("no prompt attention kernel in this build")
    return ops


def check_against_fp32(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """fp32 sums over the keys and channels in another order, the probabilities rounded to bfloat16 before their
    product with V (which moves an output by at most u * max |v|) and the output rounded to bfloat16."""
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    S, D = q.shape[2], q.shape[3]
    torch.testing.assert_close(out.float(), ref, **tolerance(v.float().abs().max().item(), depth=S + D,
                                                             storage=torch.bfloat16, roundings=2))


@pytest.mark.parametrize("B, H, H_kv, S, D", [(1, 9, 3, 1, 64), (1, 9, 3, 33, 64), (1, 9, 3, 300, 64),
                                              (2, 4, 2, 70, 128), (1, 14, 2, 129, 64), (1, 2, 2, 17, 128)])
def test_the_kernel_equals_fp32_attention_over_the_same_bfloat16_inputs(B, H, H_kv, S, D):
    """Query blocks of 16 positions in rows of 4, keys in steps of 32: lengths that end inside each, one
    position alone, GQA groups of 1 to 7, heads 64 and 128 wide."""
    ops = kernel_ops()
    gen = torch.Generator().manual_seed(S)
    q = torch.randn(B, H, S, D, generator=gen).bfloat16()
    k, v = (torch.randn(B, H_kv, S, D, generator=gen).bfloat16() for _ in "kv")
    out = ops.prompt_attention(q, k, v, 1 / math.sqrt(D))
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    check_against_fp32(out, q, k, v)


def test_a_bfloat16_prefill_attends_through_the_kernel_where_chosen(cpu_kind):
    """AVX512-BF16 without AMX takes the kernel; AMX keeps ATen's flash attention (its tiles), AVX2 too."""
    q = torch.randn(1, 6, 40, 64).bfloat16()
    k, v = torch.randn(1, 2, 40, 64).bfloat16(), torch.randn(1, 2, 40, 64).bfloat16()
    chosen = attention.prompt_attention_path()
    if cpu_kind != "avx512-bf16":
        assert chosen == "flash"
    else:
        kernel_ops()
        assert chosen == "causal-avx512-bf16"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = attention.prompt_attention(q, k, v)
    called = any(e.key.endswith("::prompt_attention") for e in prof.key_averages())
    assert called == (chosen == "causal-avx512-bf16")
    check_against_fp32(out, q, k, v)


def test_the_kernel_refuses_what_it_cannot_read():
    ops = kernel_ops()
    q = torch.randn(1, 4, 8, 64).bfloat16()
    with pytest.raises(RuntimeError, match="all bfloat16"):
        ops.prompt_attention(q.float(), q[:, :2], q[:, :2], 0.125)
    with pytest.raises(RuntimeError, match="D 64 or 128"):
        ops.prompt_attention(q[..., :32], q[:, :2, :, :32], q[:, :2, :, :32], 0.125)
    with pytest.raises(RuntimeError, match="multiple of H_kv"):
        ops.prompt_attention(q, q[:, :3], q[:, :3], 0.125)
