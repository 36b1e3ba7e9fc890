"""Capacities: how many slots each layer's cache holds.

`--cache-budget` is a fraction in (0, 1] of prompt + max new tokens, or an absolute number of slots (> 1)
per layer; with a layer schedule it is the *average* over layers, and `--layer-budget` divides the total:

- uniform: every layer gets the same capacity;
- pyramid: PyramidKV's linear schedule (Cai et al., arXiv:2406.02069; KVCache-Factory `PyramidKVCluster`):
  the lowest layer gets the most, the top layer about 1/beta of the average, beta = 20; a sequence shorter
  than 2 (B - w) keeps the uniform budget, as the reference does;
- funnel: the same ramp mirrored (more slots in later layers, as Scissorhands' persistence plot suggests and
  cold-compress's `funnel` pattern does).

Windows and intervals (`--recent-window`, `--drop-interval`) may likewise be given as a fraction (< 1) of a
layer's capacity or as a number of tokens (>= 1); `resolve_count` turns them into tokens.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from model import KVFastError

LAYER_SCHEDULES = ("uniform", "pyramid", "funnel")


def resolve_capacity(budget: float | None, total_len: int) -> int:
    """--cache-budget: a fraction in (0, 1] of prompt + new tokens, or an absolute number of slots (> 1).

    None means no compression (the full length). The result never exceeds total_len: memory is allocated for
    what can actually be used."""
    if budget is None:
        return total_len
    if budget <= 0:
        raise KVFastError(f"--cache-budget must be > 0, got {budget:g}")
    if budget <= 1:
        return max(1, math.ceil(budget * total_len))
    if budget != int(budget):
        raise KVFastError(f"--cache-budget above 1 is a number of slots and must be whole, got {budget:g}")
    return min(int(budget), total_len)


def resolve_count(value: float, capacity: int) -> int:
    """A window or interval: a fraction (< 1) of the layer's capacity, or a number of tokens (>= 1)."""
    if value < 1:
        return max(1, int(value * capacity))
    return int(value)


def pyramid_capacities(average: int, n_layers: int, protected: int, seq_len: int, beta: int) -> list[int]:
    """PyramidKV's per-layer capacities, layer 0 first (the largest).

    `average` is the per-layer budget B (window included), `protected` the slots every layer keeps on top of
    its selection (SnapKV's observation window w, or sinks + recent window), `seq_len` the length L being
    compressed. The rule of KVCache-Factory's `PyramidKVCluster.update_kv` (pyramidkv/pyramidkv_utils.py at
    commit c97f9d706d63d1b56e980f8b81b2a924c21162b3, its kv-head path included; unchanged since 98e8228bfe4f,
    2024-10):
    - L < B: nothing is compressed; L < 2 (B - w): every layer selects B - w. Both are a uniform B here.
    - otherwise min = (B - w) // beta, max = 2 (B - w) - min, clamped so no layer selects more than L - w
      tokens, then a linear ramp with integer steps (so the total can exceed n_layers * B by less than
      n_layers^2 / 2 slots, as in the reference).
    Its first version (74a0a8926649) differed: no compression only below B - w,
    a clamp to L - w - 1 and steps // 31."""
    extra = average - protected
    # n_layers == 1 would divide by zero in the reference; a single layer simply gets the whole budget
    if seq_len < average or seq_len < 2 * extra or n_layers == 1:
        return [average] * n_layers
    min_num = extra // beta
    max_num = 2 * extra - min_num
    if max_num >= seq_len - protected:
        max_num = seq_len - protected
        min_num = 2 * extra - max_num
    steps = (max_num - min_num) // (n_layers - 1)
    return [protected + max_num - layer * steps for layer in range(n_layers)]


def layer_capacities(schedule: str, average: int, n_layers: int, protected: int, seq_len: int,
                     beta: int = 20) -> list[int]:
    """Capacity of each layer under `schedule` (see the module docstring)."""
    if schedule not in LAYER_SCHEDULES:
        raise KVFastError(f"unknown --layer-budget {schedule!r} (choose from {', '.join(LAYER_SCHEDULES)})")
    if schedule == "uniform":
        return [average] * n_layers
    caps = pyramid_capacities(average, n_layers, protected, seq_len, beta)
    return caps if schedule == "pyramid" else caps[::-1]


# ---- capacity buckets (--capacity-buckets) --------------------------------------------------------------
# A compiled step is specialized to its buffers' shapes, so every new capacity compiles again. Buckets round
# the *allocated* slots up to a few sizes where that cannot change what the cache keeps: the room for new
# tokens of a cache that never evicts (full, snapkv, pyramidkv), and any cache the whole sequence fits in.
# A budget that evicts stays exact: there the capacity is the method's budget.
BUCKET_LADDERS = {"x2": 2, "x4": 4}  # powers of 2 or of 4 from SMALLEST_BUCKET
SMALLEST_BUCKET = 256


def parse_buckets(spec: str) -> tuple[int, ...] | int | None:
    """--capacity-buckets: 'off' -> None, 'x2' / 'x4' -> the ladder's ratio, '1024,4096' -> sorted sizes."""
    if spec == "off":
        return None
    if spec in BUCKET_LADDERS:
        return BUCKET_LADDERS[spec]
    try:
        sizes = tuple(sorted({int(s) for s in spec.split(",")}))
    except ValueError:
        sizes = ()
    if not sizes or sizes[0] < 1:
        raise KVFastError(f"--capacity-buckets must be off, {', '.join(BUCKET_LADDERS)} or a comma-separated "
                          f"list of positive slot counts (e.g. 1024,4096), got {spec!r}")
    return sizes


def bucket_capacity(slots: int, buckets: tuple[int, ...] | int | None, limit: int) -> int:
    """The smallest bucket >= slots (never above `limit`, the model's maximum length; a sequence longer
    than every bucket keeps its own size)."""
    if buckets is None:
        return slots
    if isinstance(buckets, int):
        size = SMALLEST_BUCKET
        while size < slots:
            size *= buckets
    else:
        size = next((b for b in buckets if b >= slots), slots)
    return max(slots, min(size, limit))


# --dynamic-capacity (decode.Decoder): dynamo keeps module buffers (and the ints of a module) static by default,
# so a new prompt length (a new capacity) would compile the step again. These let the slot dimension, and ints
# such as a recent window resolved from it, be symbolic: capacity_buckets' other answer to shapes that multiply
# compiles.
DYNAMIC_CAPACITY_CONFIG = {"force_nn_module_property_static_shapes": False,
                           "force_parameter_static_shapes": False, "allow_unspec_int_on_nn_module": True}


def mark_capacity_dynamic(caches: list[nn.Module]) -> None:
    """Mark the slot dimension of every cache buffer dynamic (the dims of the capacity's size; a pool's P),
    so the first compile already serves every capacity; what else changes with the capacity (a queue's
    length, a window) becomes dynamic at its first change, by dynamo's automatic dynamic shapes."""
    for c in caches:
        slots = {c.capacity, c.n_slots} - {0, 1}
        for buffer in c.buffers():
            for dim, size in enumerate(buffer.shape):
                if size in slots:
                    torch._dynamo.maybe_mark_dynamic(buffer, dim)
