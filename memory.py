"""Where a CPU process's large blocks live: glibc's reuse of a long prompt's freed blocks, and a model's weights
on 2 MB pages (a decode step streams every weight once)."""

from __future__ import annotations

import ctypes
import functools
import mmap

import torch
from torch import nn

from kv.contract import AttentionCache

# glibc's mallopt: a long prompt's blocks allocate tens of MB per product ([2048, 9728] FFN activations), which
# glibc serves above its 32 MB mmap ceiling with fresh mappings that fault in every page again on first touch;
# with the threshold at 1 GiB they come from the heap and are reused (Qwen2.5-0.5B, 8k tokens: 13.9 -> 11.7 s)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30


def reuse_large_allocations() -> bool:
    """Have glibc keep freed blocks up to 1 GiB for reuse instead of unmapping them; False where not glibc."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def release_free_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim) after a prefill's large blocks, which
    reuse_large_allocations keeps from being unmapped as they are freed."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


HUGE_PAGE = 2 << 20
MIN_HUGE_PAGE_WEIGHTS = 8 * HUGE_PAGE  # smaller models (the tests') gain nothing measurable


@functools.cache
def huge_pages_enabled() -> bool:
    """Whether the kernel backs a region advised MADV_HUGEPAGE with 2 MB pages (transparent huge pages in mode
    "always" or "madvise"); False where not Linux."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read() and hasattr(mmap, "MADV_HUGEPAGE")
    except OSError:
        return False


def huge_page_memory(nbytes: int) -> tuple[mmap.mmap, int]:
    """A fresh anonymous mapping of at least nbytes from a 2 MB boundary, advised MADV_HUGEPAGE where
    huge_pages_enabled(), and that boundary's offset in it; torch.frombuffer(mapping, ..., offset=) views it."""
    # private (a shared anonymous mapping is shmem, whose huge pages are another switch), untouched: each first
    # touch faults in a 2 MB page
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(mapping)) % HUGE_PAGE
    if huge_pages_enabled():
        mapping.madvise(mmap.MADV_HUGEPAGE, start - start % mmap.PAGESIZE, nbytes + start % mmap.PAGESIZE)
    return mapping, start


SLAB = 32 << 20  # one mapping serves many caches' buffers; its untouched pages cost nothing
MIN_HUGE_PAGE_BUFFER = 64 << 10  # smaller buffers (the tests' caches) stay torch's
_slab: list = [None, 0, 0]  # the mapping buffers are carved from, its next free offset, its end


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on 2 MB pages where huge_pages_enabled(), carved from a shared anonymous mapping (a
    storage of its own, from a cache line), for a decode step's K/V buffers: a step streams them as it streams the
    weights, and from 4 KB pages the one-query attention read 1.07-1.2x slower. Elsewhere, or under 64 KB,
    torch.zeros. A mapping is unmapped once its tensors are gone and a later one serves new buffers, so at most one
    mapping outlives its buffers; freed space in it is not reused."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if nbytes < MIN_HUGE_PAGE_BUFFER or not huge_pages_enabled():
        return torch.zeros(shape, dtype=dtype)
    span = -(-nbytes // 64) * 64
    mapping, offset, end = _slab
    if mapping is None or offset + span > end:  # a fresh mapping is zeros
        mapping, offset = huge_page_memory(max(SLAB, span))
        end = offset + max(SLAB, span)
    _slab[:] = [mapping, offset + span, end]
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)


def weights_on_huge_pages(model: nn.Module, min_bytes: int = MIN_HUGE_PAGE_WEIGHTS) -> int:
    """Copy `model`'s weights (its parameters and the buffers outside its caches) into one fresh anonymous
    mapping advised MADV_HUGEPAGE, and point each tensor there (same objects, same values). A decode step streams
    every weight once; on 4 KB pages, as torch allocates them or as a checkpoint's file mapping holds them, each
    page of the stream is a TLB miss: 1 GB summed at 19 GB/s file-mapped, 23 GB/s on 4 KB anonymous pages and
    30 GB/s on 2 MB pages (Intel Xeon, 2 threads; docs/speed.md, "Weights on huge pages"). Tensors already in such
    a mapping stay; returns the bytes moved (0 where THP is off or the weights weigh under min_bytes)."""
    in_caches = {id(t) for m in model.modules() if isinstance(m, AttentionCache) for t in m.buffers()}
    placed = getattr(model, "_huge_page_ptrs", set())
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())
               if id(t) not in in_caches and t.device.type == "cpu" and t.is_contiguous()
               and t.data_ptr() not in placed and t.numel()}
    spans = {key: -(-t.nbytes // 64) * 64 for key, t in tensors.items()}  # each tensor from a cache line
    total = sum(spans.values())
    if not tensors or total < min_bytes or not huge_pages_enabled():
        return 0
    arena, offset = huge_page_memory(total)
    with torch.no_grad():
        for key, t in tensors.items():  # a storage each: a compiled region refuses inputs that share one
            moved = torch.frombuffer(arena, dtype=torch.uint8, count=t.nbytes, offset=offset).view(t.dtype).view(t.shape)
            moved.copy_(t)
            t.data = moved
            offset += spans[key]
    model._huge_page_ptrs = placed | {t.data_ptr() for t in tensors.values()}
    return total
