"""Tensor parallelism (as gpt-fast's tp.py): every rank holds a share of each layer's attention heads and FFN
columns, and one all-reduce after attention and one after the FFN add the shares up.

    torchrun --nproc-per-node 2 generate.py --cache h2o --cache-budget 0.5 --compile --temperature 0

Attention splits by KV head: a rank takes whole GQA groups (its KV heads' rows of wqkv with their query heads',
and the matching columns of wo), so its caches hold only its own KV heads and every policy evicts for them as
it would alone (a policy that ranks slots across heads, adakv or hybrid, ranks across the rank's heads). The
FFN's gate and up rows and w2's columns split alike. Shares may be uneven: SmolLM2's 3 KV heads on 2 ranks are
1 + 2. Embeddings, norms and the LM head are replicated, so every rank samples the same token from the same
logits (an all-reduce leaves the same sum on every rank). CPU ranks talk over gloo, CUDA ranks over NCCL;
only rank 0 prints.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import _functional_collectives as funcol

from model import KVFastError, Transformer


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of ranks, as torchrun sets them (0 and 1 when run alone)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def init(device: str) -> str:
    """Join torchrun's process group (nothing alone) and silence stdout off rank 0. Returns the device this
    rank computes on (its own GPU under CUDA)."""
    rank, world = rank_and_world()
    if world == 1:
        return device
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- for the life of the process
    return device


def exit_process(code: int) -> NoReturn:
    """End the process. Under torchrun without interpreter finalization: gloo's worker threads can still be
    dropping the last collective's tensors, which takes the GIL, and a thread that asks for the GIL while the
    interpreter finalizes aborts the whole process (std::terminate, exit -6: one run in six on 2 cores)."""
    if not dist.is_initialized():
        sys.exit(code)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def split(n: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """[start, end) of `parts` contiguous shares of n, each a multiple of unit, as even as possible."""
    units = n // unit
    if n % unit or units < parts:
        raise KVFastError(f"cannot split {n} into {parts} shares of whole {unit}s")
    return [(unit * (units * r // parts), unit * (units * (r + 1) // parts)) for r in range(parts)]


def shard(model: Transformer, rank: int | None = None, world: int | None = None) -> Transformer:
    """Keep this rank's share of every layer in place and add the all-reduces; model.args then describes the
    rank's share (n_heads, n_kv_heads, intermediate_size), which is what its caches are built for. Call before
    setup_caches; rank and world default to torchrun's."""
    if rank is None or world is None:
        rank, world = rank_and_world()
    if world == 1:
        return model
    a = model.args
    if a.n_kv_heads < world:
        raise KVFastError(f"--nproc-per-node {world} exceeds the model's {a.n_kv_heads} KV heads (a rank takes "
                          "whole KV heads)")
    kv0, kv1 = split(a.n_kv_heads, world)[rank]
    g, D = a.n_groups, a.head_dim
    ffn0, ffn1 = split(a.intermediate_size, world, unit=_ffn_unit(model))[rank]
    q_rows = torch.arange(kv0 * g * D, kv1 * g * D)
    k_rows = a.n_heads * D + torch.arange(kv0 * D, kv1 * D)
    v_rows = k_rows + a.n_kv_heads * D
    gate_up = torch.cat([torch.arange(ffn0, ffn1), a.intermediate_size + torch.arange(ffn0, ffn1)])
    for layer in model.layers:
        attention, ffn = layer.attention, layer.feed_forward
        take_rows(attention.wqkv, torch.cat([q_rows, k_rows, v_rows]))
        take_columns(attention.wo, kv0 * g * D, kv1 * g * D)
        attention.n_heads, attention.n_kv_heads = (kv1 - kv0) * g, kv1 - kv0
        take_rows(ffn.w13, gate_up)
        take_columns(ffn.w2, ffn0, ffn1)
        for out in (attention.wo, ffn.w2):  # the hook also serves callers of the linears (kv.kvzip's pass)
            out.register_forward_hook(all_reduce_output)
    model.args = replace(a, n_heads=(kv1 - kv0) * g, n_kv_heads=kv1 - kv0, intermediate_size=ffn1 - ffn0)
    return model


def describe(model: Transformer) -> str:
    """'' alone; else what rank 0 holds (its memory, weight bytes and cache figures are its share)."""
    rank, world = rank_and_world()
    if world == 1:
        return ""
    a = model.args
    return (f"; tensor parallel over {world} ranks ({dist.get_backend()}): rank {rank} holds {a.n_kv_heads} KV "
            f"heads, {a.n_heads} query heads, {a.intermediate_size} FFN columns per layer (figures are its share)")


def all_reduce_output(module: nn.Module, inputs: tuple, output: Tensor) -> Tensor:
    """The sum of every rank's partial product; traceable by dynamo, so compiled steps keep it in their graph."""
    return funcol.all_reduce(output, "sum", dist.group.WORLD)


def _ffn_unit(model: Transformer) -> int:
    """int4 weights pack column j with column j + in / 2 and group columns: a share of w2's columns must keep
    both halves whole groups, so it is a multiple of twice the group size."""
    w2 = model.layers[0].feed_forward.w2
    offsets = getattr(w2, "offsets", None)
    return 1 if offsets is None else 2 * (2 * w2.weight.shape[1] // offsets.shape[1])


def take_rows(linear: nn.Module, rows: Tensor) -> None:
    """Keep output rows `rows` of a float, bf16, int8 or int4 linear (its weight, per-row scales / offsets and
    bias: qwen2's q / k / v biases go with their rows)."""
    for name in ("weight", "scales", "offsets", "bias"):
        t = getattr(linear, name, None)
        if t is not None:
            _set(linear, name, t[rows].contiguous())
    linear.out_features = len(rows)


def take_columns(linear: nn.Module, start: int, end: int) -> None:
    """Keep input columns [start, end) (int4: unpacked, sliced and packed again, groups kept whole)."""
    if getattr(linear, "bias", None) is not None:  # every rank would add it before the all-reduce sums them
        raise KVFastError("tensor parallelism cannot split the input columns of a linear layer with a bias")
    weight = linear.weight
    offsets = getattr(linear, "offsets", None)
    if offsets is not None:
        # quantize.quantize_int4's packing: column j in the low nibble of byte j, column j + in / 2 in the high
        n_in = 2 * weight.shape[1]
        group = n_in // offsets.shape[1]
        width = end - start
        if start % group or width % (2 * group):
            raise KVFastError(f"int4 weights with groups of {group} cannot be split at columns {start}-{end} of "
                              f"{n_in}; use int8 or float weights with tensor parallelism")
        codes = torch.cat([weight & 15, weight >> 4], dim=1)[:, start:end]
        _set(linear, "weight", (codes[:, : width // 2] | (codes[:, width // 2 :] << 4)).contiguous())
        for name in ("scales", "offsets"):
            _set(linear, name, getattr(linear, name)[:, start // group : end // group].contiguous())
    else:
        _set(linear, "weight", weight[:, start:end].contiguous())
    linear.in_features = end - start


def _set(module: nn.Module, name: str, value: Tensor) -> None:
    if isinstance(getattr(module, name), nn.Parameter):
        value = nn.Parameter(value, requires_grad=False)
    setattr(module, name, value)
