"""llama.cpp's peers at its own weight formats: the default model's Q4_1 GGUF re-quantized with the gguf package to
Q8_0 (int8's peer) or Q4_0 (beside Q4_1, int4's), written once beside it and reused. The linear layers' Q4_1 blocks
are dequantized and quantized again (gguf.quants, bit-exact with ggml's reference quantizers); the token
embedding (also the tied head) stays the file's Q8_0, the norms fp32, the metadata as it was."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from model import KVFastError

FORMATS = ("Q4_1", "Q4_0", "Q8_0")


def requantized(src: Path, fmt: str) -> Path:
    """The GGUF `src` with its 2-D Q4_1 weights in `fmt` (one of FORMATS): `src` itself for its own format,
    else <stem with fmt>.gguf beside it, written on first use."""
    import gguf

    if fmt not in FORMATS:
        raise KVFastError(f"unknown llama.cpp weight format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if f".{fmt}." in src.name:
        return src
    dest = src.with_name(src.name.replace(".Q4_1.", f".{fmt}.") if ".Q4_1." in src.name else f"{src.stem}.{fmt}.gguf")
    if dest.exists():
        return dest
    qtype = gguf.GGMLQuantizationType[fmt]
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(dest) + ".tmp", arch=arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    tensors = []
    for t in reader.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.Q4_1:
            rows = gguf.quants.dequantize(t.data, t.tensor_type)  # [out, in] float32
            tensors.append((t.name, gguf.quants.quantize(np.ascontiguousarray(rows), qtype), qtype))
        else:
            tensors.append((t.name, t.data, t.tensor_type))
    for name, data, tt in tensors:
        writer.add_tensor(name, data, raw_dtype=tt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(dest) + ".tmp").rename(dest)
    return dest
