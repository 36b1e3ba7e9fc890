"""Convert a llama or qwen2 GGUF file (any quantization gguf can dequantize) into a checkpoint folder.

    python scripts/convert_gguf.py --gguf model.gguf --out checkpoints/name

Weights are dequantized to fp32, so the checkpoint is the quantized model, not the original one.
"""

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tokenizer.py when run as a script

import tokenizer as tok
from scripts.convert_hf_checkpoint import check_shapes, fail, save_checkpoint

# llama.cpp's tokenizer.ggml.pre names -> our single tiktoken regex (see tokenizer.py for the digit rule) and
# the normalizer Hugging Face's tokenizer of that family applies first.
PRE_TOKENIZERS = {
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell"), (tok.DIGITS_GPT2_PATTERN, None)),
    **dict.fromkeys(("gpt-2", "gpt2"), (tok.GPT2_PATTERN, None)),
    **dict.fromkeys(("llama-bpe", "llama3"), (tok.LLAMA3_PATTERN, None)),
    "qwen2": (tok.QWEN2_PATTERN, "NFC"),
}
TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 3, 4, 5
# general.architecture -> whether llama.cpp permuted its q / k rows (llama's interleaved RoPE pairs; qwen2
# keeps Hugging Face's rotate-half layout: llama.cpp runs it with NEOX RoPE)
ARCHITECTURES = {"llama": True, "qwen2": False}


def read_gguf(path: Path):
    import gguf

    path = Path(path)
    if not path.is_file():
        fail(f"{path}: GGUF file not found")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, KeyError, IndexError, TypeError) as e:  # bad magic, truncated file
        fail(f"{path}: not a readable GGUF file ({e})")


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return f.contents() if f is not None else default


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF rotate-half halves)."""
    out, dim = w.shape
    return w.reshape(n_head, out // n_head // 2, 2, dim).transpose(1, 2).reshape(out, dim)


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert permutation (HF -> GGUF), for tests."""
    out, dim = w.shape
    return w.reshape(n_head, 2, out // n_head // 2, dim).transpose(1, 2).reshape(out, dim)


def llama3_factors(cfg: dict, head_dim: int, rope_base: float) -> np.ndarray:
    """llama.cpp's rope_freqs tensor (the divisor of each frequency) for a llama3 rope_scaling dict."""
    inv = 1.0 / rope_base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    old = cfg["original_max_position_embeddings"]
    lo, hi, factor = cfg["low_freq_factor"], cfg["high_freq_factor"], cfg["factor"]
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - lo) / (hi - lo)
    out = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < old / hi, 1.0, out)
    return np.where(wavelen > old / lo, factor, out)


def rope_scaling_from_freqs(freqs: np.ndarray, head_dim: int, rope_base: float) -> dict:
    """GGUF stores llama3 scaling as per-frequency factors; find the parameters that give them."""
    factor = float(np.round(freqs.max(), 4))  # the lowest frequencies are divided by the full factor
    for old in [8192, *(2**k for k in range(4, 21))]:
        for lo, hi in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 4.0), (0.5, 4.0)):
            cand = {"rope_type": "llama3", "factor": factor, "low_freq_factor": lo, "high_freq_factor": hi,
                    "original_max_position_embeddings": old}
            if np.allclose(llama3_factors(cand, head_dim, rope_base), freqs, rtol=1e-4):
                return cand
    fail("rope_freqs.weight does not match a llama3 rope scaling")


def gguf_config(reader, tensors: dict) -> dict:
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        fail(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")

    def meta(key: str, default=None):
        return field(reader, f"{arch}.{key}", default)

    n_heads = int(meta("attention.head_count"))
    dim = int(meta("embedding_length"))
    head_dim = int(meta("attention.key_length", dim // n_heads))
    rope_base = float(meta("rope.freq_base", 10000.0))
    scaling_type = meta("rope.scaling.type", "none")
    if scaling_type not in ("none", None):
        fail(f"unsupported rope scaling {scaling_type!r}")
    rope_scaling = None
    if "rope_freqs.weight" in tensors:
        freqs = tensors["rope_freqs.weight"].data.astype(np.float64)
        rope_scaling = rope_scaling_from_freqs(freqs, head_dim, rope_base)
    eps = float(meta("attention.layer_norm_rms_epsilon", 1e-5))
    biases = [f"blk.0.attn_{x}.bias" in tensors for x in "qkv"]
    if any(biases) and not all(biases):
        fail("q / k / v biases must come together (the GGUF has only some)")
    return {
        "dim": dim,
        "n_layers": int(meta("block_count")),
        "n_heads": n_heads,
        "n_kv_heads": int(meta("attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "intermediate_size": int(meta("feed_forward_length")),
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "norm_eps": float(f"{eps:.7g}"),  # stored as float32: 1e-5 reads back as 9.99999974e-06
        "rope_base": float(f"{rope_base:.7g}"),
        "rope_scaling": rope_scaling,
        "max_seq_len": int(meta("context_length", 2048)),
        "tie_embeddings": "output.weight" not in tensors,
        "attention_bias": all(biases),
    }


def gguf_state_dict(tensors: dict, args: dict, permuted: bool) -> dict[str, torch.Tensor]:
    """Our state dict from the GGUF's tensors; permuted: q / k rows in llama.cpp's order (llama)."""
    from gguf.quants import dequantize

    tensors = dict(tensors)

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            fail(f"tensor {name!r} missing from the GGUF")
        t = tensors.pop(name)
        return torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))  # copy: memmap views are read-only

    sd = {"tok_embeddings.weight": take("token_embd.weight")}
    for i in range(args["n_layers"]):
        b, p = f"blk.{i}.", f"layers.{i}."
        sd[p + "attention_norm.weight"] = take(b + "attn_norm.weight")
        q, k = take(b + "attn_q.weight"), take(b + "attn_k.weight")
        if permuted:
            q, k = unpermute(q, args["n_heads"]), unpermute(k, args["n_kv_heads"])
        sd[p + "attention.wqkv.weight"] = torch.cat([q, k, take(b + "attn_v.weight")], dim=0)
        if args["attention_bias"]:
            sd[p + "attention.wqkv.bias"] = torch.cat([take(b + f"attn_{x}.bias") for x in "qkv"])
        sd[p + "attention.wo.weight"] = take(b + "attn_output.weight")
        sd[p + "ffn_norm.weight"] = take(b + "ffn_norm.weight")
        sd[p + "feed_forward.w13.weight"] = torch.cat(
            [take(b + "ffn_gate.weight"), take(b + "ffn_up.weight")], dim=0)
        sd[p + "feed_forward.w2.weight"] = take(b + "ffn_down.weight")
    sd["norm.weight"] = take("output_norm.weight")
    if not args["tie_embeddings"]:
        sd["output.weight"] = take("output.weight")
    tensors.pop("rope_freqs.weight", None)
    if tensors:
        fail(f"unsupported tensors in the GGUF: {sorted(tensors)[:5]}")
    return sd


def gguf_tokenizer(reader, out_dir: Path) -> None:
    model = field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        fail(f"unsupported GGUF tokenizer {model!r} (only byte-level BPE 'gpt2'; convert from HF instead)")
    pre = field(reader, "tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        fail(f"unsupported GGUF pre-tokenizer {pre!r}")
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", [])]
    special, vocab = {}, {}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty == TOKEN_UNUSED:  # padding rows of the embedding ("[PAD151665]"): no text maps to them
            continue
        # Control and user-defined tokens are matched in the text as a whole (llama.cpp does the same).
        # A token outside GPT-2's byte alphabet cannot be a BPE token either.
        if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED) or any(c not in tok._UNICODE_TO_BYTE for c in t):
            special[t] = i
        else:
            vocab[t] = i
    eos_id = int(field(reader, "tokenizer.ggml.eos_token_id"))
    bos_id = field(reader, "tokenizer.ggml.bos_token_id")
    pattern, normalizer = PRE_TOKENIZERS[pre]
    tok.save_bpe(out_dir, vocab, merges, special, pattern,
                 bos_id=int(bos_id) if bos_id is not None else None, eos_id=eos_id,
                 stop_ids=tok.stop_ids_for(special, eos_id),
                 add_bos=bool(field(reader, "tokenizer.ggml.add_bos_token", bos_id is not None)),
                 chat_template=field(reader, "tokenizer.chat_template"), normalizer=normalizer)


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a llama or qwen2 GGUF into out_dir; returns out_dir."""
    reader = read_gguf(gguf_path)
    try:
        tensors = {t.name: t for t in reader.tensors}
        args = gguf_config(reader, tensors)
    except (TypeError, ValueError, KeyError) as e:
        fail(f"{gguf_path}: incomplete GGUF metadata ({e})")
    sd = gguf_state_dict(tensors, args, permuted=ARCHITECTURES[field(reader, "general.architecture")])
    check_shapes(sd, args)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gguf_tokenizer(reader, out_dir)
    save_checkpoint(out_dir, sd, args)
    return out_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, required=True, help="input .gguf file")
    p.add_argument("--out", type=Path, required=True, help="output checkpoint folder")
    a = p.parse_args()
    print(f"wrote {convert_gguf(a.gguf, a.out)}")


if __name__ == "__main__":
    main()
