"""llama.cpp's peers at its own weight formats: a model's GGUF re-quantized with the gguf package to Q8_0 (int8's
peer), Q4_0 or Q4_1 (int4's), written once beside it and reused. The transformer blocks' quantized matrices (the
default model's Q4_1; a packaged Qwen's mix of Q5_0, Q4_K, Q6_K and Q8_0) are dequantized and quantized again
(gguf.quants, bit-exact with ggml's reference quantizers); the token embedding and the output head stay as the file
has them (Q8_0, as our int4 keeps its head int8), the norms fp32, the metadata as it was."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from model import KVFastError

FORMATS = ("Q4_1", "Q4_0", "Q8_0")


def requantized(src: Path, fmt: str) -> Path:
    """The GGUF `src` with its blocks' quantized 2-D weights in `fmt` (one of FORMATS): `src` itself where they
    all are already, else <stem with fmt>.gguf beside it, written on first use."""
    import gguf

    if fmt not in FORMATS:
        raise KVFastError(f"unknown llama.cpp weight format {fmt!r}: choose one of {', '.join(FORMATS)}")
    qtype, kinds = gguf.GGMLQuantizationType[fmt], gguf.GGMLQuantizationType
    reader = gguf.GGUFReader(src)
    redo = {t.name for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2
            and t.tensor_type not in (qtype, kinds.F32, kinds.F16, kinds.BF16)}
    if not redo:
        return src
    stem = re.sub(r"[.](Q[0-9]\w*|F16|F32|BF16)$", "", src.stem)  # SmolLM2-135M-Instruct.Q4_1 -> its name
    dest = src.with_name(f"{stem}.{fmt}.gguf")
    if dest.exists():
        return dest
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(dest) + ".tmp", arch=arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        if t.name in redo:
            try:
                rows = gguf.quants.dequantize(t.data, t.tensor_type)  # [out, in] float32
            except NotImplementedError:
                raise KVFastError(f"the gguf package cannot dequantize {t.name} ({t.tensor_type.name}) of {src}") from None
            writer.add_tensor(t.name, gguf.quants.quantize(np.ascontiguousarray(rows), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(dest) + ".tmp").rename(dest)
    return dest
