"""Convert a Hugging Face Llama or Qwen2 folder into a kvfast checkpoint folder.

Input: config.json, model.safetensors or model.safetensors.index.json (+ shards), and a tokenizer:
tokenizer.json with a byte-level BPE (-> tokenizer.tiktoken) or tokenizer.model (SentencePiece, copied).
Output: model.safetensors (fp32, our key names), config.json (ModelArgs), tokenizer files.

    python scripts/convert_hf_checkpoint.py --hf-dir path/to/hf --out checkpoints/name
"""

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import NoReturn

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tokenizer.py when run as a script

import tokenizer as tok

CONFIG_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "intermediate_size", "vocab_size",
               "norm_eps", "rope_base", "rope_scaling", "max_seq_len", "tie_embeddings", "attention_bias")
# model_type -> whether its q / k / v projections carry biases (Qwen2's always do; its o_proj never does)
ARCHITECTURES = {"llama": False, "qwen2": True}


def fail(msg: str) -> NoReturn:
    """Stop with a one-line message (SystemExit, so tests can catch it)."""
    raise SystemExit(f"error: {' '.join(str(msg).split())}")


def save_checkpoint(out_dir: Path, state_dict: dict[str, torch.Tensor], config: dict) -> None:
    """Write model.safetensors (fp32) and config.json; shared by both converters."""
    assert tuple(config) == CONFIG_KEYS, config.keys()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(torch.float32).contiguous() for k, v in state_dict.items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=1) + "\n")


def llama3_scaling(d: dict) -> dict:
    return {"rope_type": "llama3", "factor": float(d["factor"]), "low_freq_factor": float(d["low_freq_factor"]),
            "high_freq_factor": float(d["high_freq_factor"]),
            "original_max_position_embeddings": int(d["original_max_position_embeddings"])}


def hf_model_args(hf: dict) -> dict:
    """ModelArgs fields from an HF LlamaConfig / Qwen2Config dict (transformers 4 and 5 spellings)."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        fail(f"unsupported model_type {model_type!r} (supported: {', '.join(ARCHITECTURES)})")
    if hf.get("attention_bias") or hf.get("mlp_bias"):  # llama's attention_bias also puts one on o_proj
        fail("attention_bias / mlp_bias are not supported")
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or []):
        fail("sliding-window attention is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        fail(f"unsupported hidden_act {hf['hidden_act']!r}")
    # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_base = float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        rope_scaling = llama3_scaling(rope)
    elif rope_type == "default":
        rope_scaling = None
    else:
        fail(f"unsupported rope scaling {rope_type!r} (only llama3)")
    dim, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    return {
        "dim": dim,
        "n_layers": int(hf["num_hidden_layers"]),
        "n_heads": n_heads,
        "n_kv_heads": int(hf.get("num_key_value_heads") or n_heads),
        "head_dim": int(hf.get("head_dim") or dim // n_heads),
        "intermediate_size": int(hf["intermediate_size"]),
        "vocab_size": int(hf["vocab_size"]),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "rope_base": rope_base,
        "rope_scaling": rope_scaling,
        "max_seq_len": int(hf.get("max_position_embeddings", 2048)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "attention_bias": ARCHITECTURES[model_type],
    }


def load_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    single, index = hf_dir / "model.safetensors", hf_dir / "model.safetensors.index.json"
    if single.exists():
        files = [single]
    elif index.exists():
        try:
            files = sorted({hf_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (ValueError, KeyError) as e:
            fail(f"{index}: unreadable index ({e})")
    else:
        fail(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")
    weights = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():  # noqa: SIM118 (safe_open is not a dict)
                    weights[k] = sf.get_tensor(k)
        except (SafetensorError, OSError) as e:  # missing shard, truncated file
            fail(f"{f}: cannot read safetensors ({e})")
    return weights


def hf_state_dict(weights: dict[str, torch.Tensor], args: dict) -> dict[str, torch.Tensor]:
    """Rename and fuse HF weights into our keys (q/k stay in HF's rotate-half layout)."""
    w = {k.removeprefix("model."): v for k, v in weights.items()}

    def take(name: str) -> torch.Tensor:
        if name not in w:
            fail(f"weight {name!r} missing from the checkpoint")
        return w.pop(name)

    sd = {"tok_embeddings.weight": take("embed_tokens.weight")}
    for i in range(args["n_layers"]):
        p = f"layers.{i}."
        sd[p + "attention_norm.weight"] = take(p + "input_layernorm.weight")
        sd[p + "attention.wqkv.weight"] = torch.cat(
            [take(p + f"self_attn.{x}_proj.weight") for x in "qkv"], dim=0)
        if args["attention_bias"]:
            sd[p + "attention.wqkv.bias"] = torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
        sd[p + "attention.wo.weight"] = take(p + "self_attn.o_proj.weight")
        sd[p + "ffn_norm.weight"] = take(p + "post_attention_layernorm.weight")
        sd[p + "feed_forward.w13.weight"] = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], dim=0)
        sd[p + "feed_forward.w2.weight"] = take(p + "mlp.down_proj.weight")
    sd["norm.weight"] = take("norm.weight")
    # lm_head.weight is not under "model."; a tied save usually omits it.
    head = weights.get("lm_head.weight")
    w.pop("lm_head.weight", None)
    if not args["tie_embeddings"]:
        if head is None:
            fail("tie_word_embeddings is false but lm_head.weight is missing")
        sd["output.weight"] = head
    w = {k: v for k, v in w.items() if not k.endswith("rotary_emb.inv_freq")}
    if w:
        fail(f"unexpected weights: {sorted(w)[:5]}")
    return sd


def check_shapes(sd: dict[str, torch.Tensor], a: dict) -> None:
    hd, dim, ffn = a["head_dim"], a["dim"], a["intermediate_size"]
    expect = {"tok_embeddings.weight": (a["vocab_size"], dim), "norm.weight": (dim,)}
    if not a["tie_embeddings"]:
        expect["output.weight"] = (a["vocab_size"], dim)
    for i in range(a["n_layers"]):
        p = f"layers.{i}."
        expect |= {p + "attention_norm.weight": (dim,), p + "ffn_norm.weight": (dim,),
                   p + "attention.wqkv.weight": ((a["n_heads"] + 2 * a["n_kv_heads"]) * hd, dim),
                   p + "attention.wo.weight": (dim, a["n_heads"] * hd),
                   p + "feed_forward.w13.weight": (2 * ffn, dim), p + "feed_forward.w2.weight": (dim, ffn)}
        if a["attention_bias"]:
            expect[p + "attention.wqkv.bias"] = ((a["n_heads"] + 2 * a["n_kv_heads"]) * hd,)
    for k, shape in expect.items():
        if tuple(sd[k].shape) != shape:
            fail(f"{k}: shape {tuple(sd[k].shape)}, config says {shape}")


def hf_tokenizer(hf_dir: Path, out_dir: Path, hf: dict) -> None:
    """tokenizer.json (byte-level BPE) -> tiktoken files; else tokenizer.model copied."""
    tc_path = hf_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
    template = tc.get("chat_template")
    if template is None and (hf_dir / "chat_template.jinja").exists():
        template = (hf_dir / "chat_template.jinja").read_text()
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    tj_path = hf_dir / "tokenizer.json"
    tj = json.loads(tj_path.read_text()) if tj_path.exists() else None
    model = (tj or {}).get("model", {})
    byte_level = model.get("type") == "BPE" and "ByteLevel" in json.dumps(tj.get("decoder"))
    special = {t["content"]: t["id"] for t in (tj or {}).get("added_tokens", [])}
    if not special:
        special = {v["content"]: int(k) for k, v in tc.get("added_tokens_decoder", {}).items()}

    def token_id(name: str, fallback: int | None) -> int | None:
        t = tc.get(name)
        t = t.get("content") if isinstance(t, dict) else t
        return special.get(t, fallback) if t is not None else fallback

    def first(x: int | list[int] | None) -> int | None:
        return x[0] if isinstance(x, list) else x

    bos_id = token_id("bos_token", first(hf.get("bos_token_id")))
    eos_id = token_id("eos_token", first(hf.get("eos_token_id")))
    if tj is not None and byte_level:
        if eos_id is None:
            fail("no eos token in tokenizer_config.json or config.json")
        pattern, normalizer = bpe_pattern(tj)
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        stop = tok.stop_ids_for(special, eos_id)
        if isinstance(hf.get("eos_token_id"), list):
            stop = sorted(set(stop) | set(hf["eos_token_id"]))
        add_bos = tc.get("add_bos_token", adds_bos(tj.get("post_processor"), bos_id, special))
        tok.save_bpe(out_dir, model["vocab"], merges, special, pattern, bos_id, eos_id, stop, bool(add_bos),
                     template, normalizer)
    elif (hf_dir / "tokenizer.model").exists():
        shutil.copy(hf_dir / "tokenizer.model", out_dir / "tokenizer.model")
        chat_format, default_system = tok.chat_format_from_template(template)
        cfg = {"type": "sentencepiece", "special_tokens": special, "chat_format": chat_format,
               "default_system": default_system, "add_bos": bool(tc.get("add_bos_token", True))}
        if bos_id is not None:
            cfg["bos_id"] = bos_id
        if eos_id is not None:
            cfg["eos_id"] = eos_id
            cfg["stop_ids"] = tok.stop_ids_for(special, eos_id)
        (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1, ensure_ascii=False) + "\n")
    else:
        fail(f"{hf_dir}: no byte-level BPE tokenizer.json and no tokenizer.model")


def adds_bos(post_processor: dict | None, bos_id: int | None, special: dict[str, int]) -> bool:
    """Whether tokenizer.json's TemplateProcessing puts bos in front of a single sequence."""
    pp = post_processor or {}
    steps = pp.get("processors", [pp]) if pp.get("type") == "Sequence" else [pp]
    names = {name for name, i in special.items() if i == bos_id}
    for step in steps:
        if step.get("type") == "TemplateProcessing":
            return any(item.get("SpecialToken", {}).get("id") in names for item in step.get("single", []))
    return False


def bpe_pattern(tj: dict) -> tuple[str, str | None]:
    """The tiktoken regex equivalent to a tokenizer.json pre-tokenizer (+ optional NFC normalizer)."""
    norm = tj.get("normalizer")
    normalizer = None
    if norm is not None:
        if norm.get("type") != "NFC":
            fail(f"unsupported normalizer {norm.get('type')!r}")
        normalizer = "NFC"
    pre = tj.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True) and not steps[0].get("add_prefix_space"):
        return tok.GPT2_PATTERN, normalizer
    if (kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits")
            and steps[1].get("use_regex", True) and not steps[1].get("add_prefix_space")):
        return tok.DIGITS_GPT2_PATTERN, normalizer
    if (kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True)
            and steps[0].get("behavior") == "Isolated" and "Regex" in steps[0].get("pattern", {})):
        return steps[0]["pattern"]["Regex"], normalizer
    fail(f"unsupported pre_tokenizer {json.dumps(pre)[:200]}")


def convert_hf_checkpoint(hf_dir: Path, out_dir: Path) -> Path:
    """Convert an HF Llama or Qwen2 folder; returns out_dir."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    cfg_path = hf_dir / "config.json"
    if not cfg_path.exists():
        fail(f"{cfg_path} not found")
    try:
        hf = json.loads(cfg_path.read_text())
    except ValueError as e:
        fail(f"{cfg_path}: invalid JSON ({e})")
    args = hf_model_args(hf)
    sd = hf_state_dict(load_hf_weights(hf_dir), args)
    check_shapes(sd, args)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_tokenizer(hf_dir, out_dir, hf)
    save_checkpoint(out_dir, sd, args)
    return out_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf-dir", type=Path, required=True, help="Hugging Face model folder")
    p.add_argument("--out", type=Path, required=True, help="output checkpoint folder")
    a = p.parse_args()
    print(f"wrote {convert_hf_checkpoint(a.hf_dir, a.out)}")


if __name__ == "__main__":
    main()
