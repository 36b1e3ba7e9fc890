"""Saved contexts: compress a context once, ask it many questions.

A layer cache's whole state lives in its buffers (K/V as stored, quantized codes and scales included, slot_pos,
the policy's statistics, the tiers' staging and warm pages, counters such as `seen`, Scissorhands' queue_next,
the tiers' page_ptr and traffic). The Python-side state was looked for and is all either fixed at construction
(capacities, parameters, rank tables) or alive only inside one prefill (FastGen's prompt_classes and masks). The
decode loop's own state is the position: its refresh, flush and recall schedule is a function of the absolute
position (decode.Decoder.step), so a context restored at its length continues on the schedule it left. That
position (the context's length) and the token sampled after it travel in the header.

snapshot / restore copy the buffers in place (compiled code holds on to them, so nothing recompiles);
save_context / load_context write them as safetensors with a JSON header (FORMAT_VERSION, the cache layout the
factory resolved, the context ids, fingerprints of the checkpoint) and refuse, in one line, a file that another
model, tokenizer, policy, layout or version wrote, or a truncated or corrupt one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from compilecache import write_atomically
from model import KVFastError

FORMAT_VERSION = 2  # 2: the header says whether the context opens a chat turn (chat_open)
HEADER_KEY = "kvfast_context"
TOKENIZER_FILES = ("tokenizer.tiktoken", "tokenizer.model", "tokenizer_config.json")
WHOLE_FILE_LIMIT = 64 << 20  # weights files up to this are hashed whole; larger ones by a sample (weights_digest)
SAMPLE_CHUNKS, CHUNK = 64, 1 << 16


# ---- in memory ------------------------------------------------------------------------------------------------
def cache_buffers(model: nn.Module) -> dict[str, Tensor]:
    """Every layer cache's buffers by "layer.name" (the tensors themselves, not copies)."""
    return {f"{layer}.{name}": b for layer, cache in enumerate(model.caches) if cache is not None
            for name, b in cache.named_buffers()}


def snapshot(model: nn.Module) -> dict[str, Tensor]:
    """A copy of every layer cache's state (see the module doc): restore() puts it back."""
    return {name: b.detach().clone() for name, b in cache_buffers(model).items()}


def restore(model: nn.Module, snap: dict[str, Tensor]) -> None:
    """Copy a snapshot back into the caches' own buffers, in place (compiled steps keep reading them)."""
    buffers = cache_buffers(model)
    if buffers.keys() != snap.keys():
        missing = sorted(buffers.keys() ^ snap.keys())[:3]
        raise KVFastError(f"the snapshot does not fit these caches (buffers {', '.join(missing)} differ)")
    with torch.no_grad():
        for name, b in buffers.items():
            b.copy_(snap[name])


# ---- what a file must agree with --------------------------------------------------------------------------------
def file_digest(path: Path, sample: bool = False) -> str:
    """sha256 of a file; with sample, of a large file's size and SAMPLE_CHUNKS evenly spaced chunks (its header
    included): a weights file of gigabytes is not read whole to open a saved context."""
    h, size = hashlib.sha256(), path.stat().st_size
    with open(path, "rb") as f:
        if not sample or size <= WHOLE_FILE_LIMIT:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
            return h.hexdigest()
        h.update(struct.pack("<Q", size))
        for i in range(SAMPLE_CHUNKS):
            f.seek((size - CHUNK) * i // (SAMPLE_CHUNKS - 1))
            h.update(f.read(CHUNK))
    return h.hexdigest()


def fingerprints(checkpoint: Path) -> dict[str, str]:
    """sha256 of the checkpoint's config.json, of its tokenizer files, and a stable digest of its weights file."""
    checkpoint = Path(checkpoint)
    folder = checkpoint if checkpoint.is_dir() else checkpoint.parent
    weights = checkpoint if not checkpoint.is_dir() else next(
        (folder / n for n in ("model.safetensors", "model.pth") if (folder / n).exists()), None)
    tokenizer = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (folder / name).exists():
            tokenizer.update(name.encode() + bytes.fromhex(file_digest(folder / name)))
    return {"config": file_digest(folder / "config.json"),
            "weights": file_digest(weights, sample=True) if weights else "",
            "tokenizer": tokenizer.hexdigest()}


def cache_layout(factory: Any, model: nn.Module) -> dict[str, Any]:
    """What the caches were built as (a cache.CacheFactory's resolution) and the buffers that resulted: a saved
    context loads only into caches with the same."""
    t = factory.tiers
    return {"policy": factory.policy, "prompt compression": factory.prompt_compression,
            "layer budget": factory.layer_budget, "capacities": list(factory.capacities),
            "prompt capacities": list(factory.prompt_capacities), "layout": model.caches[0].layout,
            "batch size": factory.batch_size,
            "kv format": {"kv_bits": factory.kv_bits, "kv_group_size": factory.kv_group_size if factory.kv_bits
                          else None, "kv_dtype": str(factory.kv_dtype), "dtype": str(factory.dtype)},
            "tiers": dataclasses.asdict(t) if t else None, "pos shift": bool(factory.pos_shift),
            "parameters": factory.layer_values, "buffers": {n: [str(b.dtype)[6:], *b.shape] for n, b in cache_buffers(model).items()}}


def expectations(factory: Any, model: nn.Module, checkpoint: Path) -> dict[str, Any]:
    """What load_context checks a file against: these caches' layout and this checkpoint's fingerprints."""
    return {"layout": cache_layout(factory, model), "fingerprints": fingerprints(checkpoint)}


def tensor_digest(tensors: dict[str, Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# ---- files ------------------------------------------------------------------------------------------------------
def save_context(path: Path, model: nn.Module, tokenizer: Any, meta: dict[str, Any],
                 snap: dict[str, Tensor] | None = None) -> None:
    """Write the caches' state (snap, or a snapshot taken now) and meta (JSON-able: the context ids, the
    `layout` and `fingerprints` load_context checks, ...) to path, atomically: a temporary file in the same
    folder, then os.replace, so an interrupted save leaves no file under the name."""
    from safetensors.torch import save

    tensors = {n: t.detach().cpu().contiguous() for n, t in (snap or snapshot(model)).items()}
    ids = meta.get("context_ids", [])
    header = {"format_version": FORMAT_VERSION, **meta, "digest": tensor_digest(tensors),
              "context_preview": tokenizer.decode(ids[0][:200]) if ids and tokenizer is not None else ""}
    data = save(tensors, metadata={HEADER_KEY: json.dumps(header)})
    try:
        write_atomically(Path(path), data)  # a temporary file in the same folder, then a rename
    except OSError as e:
        raise KVFastError(f"cannot write the saved context {path}: {e.strerror or e}") from None


def read_header(path: Path, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON header of a saved context (its format version checked, and that it has the `required` fields
    beside the layout, fingerprints and context ids), without reading the tensors."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if n <= 0 or n > min(path.stat().st_size - 8, 1 << 30):
                raise ValueError
            meta = json.loads(f.read(n)).get("__metadata__", {})
            header = json.loads(meta[HEADER_KEY])
    except OSError as e:
        raise KVFastError(f"cannot read saved context {path}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise KVFastError(f"{path} is not a saved context, or is corrupt or truncated") from None
    if header.get("format_version") != FORMAT_VERSION:
        raise KVFastError(f"saved context {path} has format version {header.get('format_version')}; this kvfast "
                          f"reads version {FORMAT_VERSION}: save it again")
    ids = header.get("context_ids")
    well_formed = (isinstance(header.get("layout"), dict) and isinstance(header.get("fingerprints"), dict)
                   and isinstance(ids, list) and ids and all(isinstance(r, list) and r and
                                                             all(type(i) is int for i in r) for r in ids))
    if not well_formed or any(k not in header for k in required):
        raise KVFastError(f"saved context {path} is corrupt (its header lacks fields a saved context has)")
    return header


def check_header(path: Path, header: dict[str, Any], expect: dict[str, Any]) -> None:
    """One line naming the first difference between what the file was made with and what loads it."""
    names = {"config": "model config", "weights": "model weights", "tokenizer": "tokenizer"}
    for key, name in names.items():
        saved, now = header.get("fingerprints", {}).get(key), expect["fingerprints"][key]
        if saved != now:
            raise KVFastError(f"saved context {path} does not match this checkpoint's {name} (sha256 "
                              f"{str(saved)[:12]} saved, {now[:12]} here)")
    saved, now = header.get("layout", {}), json.loads(json.dumps(expect["layout"]))  # tuples as the file's lists
    for key in now:
        if saved.get(key) != now[key]:
            there, here = saved.get(key), now[key]
            if key == "parameters" and isinstance(there, list) and len(there) == len(here):
                layer = next(i for i, (a, b) in enumerate(zip(there, here)) if a != b)
                there, here = there[layer], here[layer]
                key = f"layer {layer}'s parameter"
            if isinstance(there, dict) and isinstance(here, dict):  # name the first entry that differs
                name = min(n for n in there.keys() | here.keys() if there.get(n) != here.get(n))
                key, there, here = f"{key} {name}", there.get(name), here.get(name)
            raise KVFastError(f"saved context {path} was made with {key} {json.dumps(there)}, these flags give "
                              f"{json.dumps(here)}: use the flags it was saved with")


def load_context(path: Path, model: nn.Module, tokenizer: Any, expect: dict[str, Any]) -> dict[str, Any]:
    """Restore a saved context into the model's caches, after checking its header against expect (`layout` from
    cache_layout, `fingerprints` from fingerprints); returns the header (context_ids, next_token, ...)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = Path(path)
    header = read_header(path)
    check_header(path, header, expect)
    try:
        tensors = load(path.read_bytes())
    except (SafetensorError, ValueError, RuntimeError):
        raise KVFastError(f"saved context {path} is corrupt or truncated") from None
    if tensor_digest(tensors) != header.get("digest"):
        raise KVFastError(f"saved context {path} is corrupt (its cache contents do not match their checksum)")
    vocab = getattr(tokenizer, "vocab_size", None)
    if vocab and any(i >= vocab for row in header.get("context_ids", []) for i in row):
        raise KVFastError(f"saved context {path} holds token ids outside this tokenizer's vocabulary")
    restore(model, tensors)
    return header
