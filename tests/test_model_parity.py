"""Our Transformer against transformers' LlamaForCausalLM, fp32: logits and greedy continuations.

Greedy parity is checked teacher-forced: transformers generates 32 tokens greedily, then one forward of
our model over prompt + continuation must pick every generated token as its argmax.
"""

import random

import pytest
import torch
from conftest import save_tiny_hf
from numerics import assert_numerically_close, model_depth

from model import Transformer
from scripts.convert_hf_checkpoint import convert_hf_checkpoint
from tokenizer import load_tokenizer

N_NEW = 32


def hf_greedy(hf, ids: torch.Tensor) -> torch.Tensor:
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW, min_new_tokens=0,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.shape[1] == ids.shape[1] + N_NEW
    return out


def assert_parity(ours: Transformer, hf, prompt: list[int]) -> None:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids, all_logits=True)
        assert got.shape == expected.shape
        assert_numerically_close(got, expected, depth=model_depth(ours.args, len(prompt)))

        full = hf_greedy(hf, ids)
        ours_next = ours(full[:, :-1], all_logits=True).argmax(-1)[0, len(prompt) - 1:]
        assert ours_next.tolist() == full[0, len(prompt):].tolist()


@pytest.mark.parametrize("tied, rope_scaling", [(True, False), (False, True)])
def test_tiny_hf_model_parity(tmp_path, tied, rope_scaling):
    hf = save_tiny_hf(tmp_path / "hf", tie=tied, rope_scaling=rope_scaling, seed=1)
    ours = Transformer.from_checkpoint(convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out"))
    rng = random.Random(0)
    prompt = [rng.randrange(3, 400) for _ in range(96)]  # past original_max_position_embeddings (64)
    assert_parity(ours, hf, prompt)


@pytest.mark.real_model
@pytest.mark.slow
def test_default_model_parity(default_checkpoint, hf_gguf_model):
    tok = load_tokenizer(default_checkpoint)
    prompt = tok.encode(tok.chat_prompt(
        "Write a short story about a lighthouse keeper who finds a message in a bottle. Describe the sea, "
        "the weather and the keeper's feelings, and give the story a surprising ending."))
    assert len(prompt) >= 64
    assert_parity(Transformer.from_checkpoint(default_checkpoint), hf_gguf_model, prompt)
