"""KVzip: reconstruction scores against a slow reference that runs the model itself over context + repeat chunk,
KVzip+ normalization, the kept set, the prefill paths (generate and eval's replay) and the CLI's messages."""

import math

import pytest
import torch
from cache_testing import kvzip_prefill, single_thread_fixture, tiny_model
from numerics import assert_numerically_close, model_depth

import generate
from cache import make_cache_factory
from kernels import force_cpu
from kv import kvzip
from model import KVFastError

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)
REPEAT = kvzip.RepeatPrompt(first=[5, 6, 7], later=[8, 9], suffix=[10, 11], carry=3)


def slow_scores(model, idx, repeat, chunk, plus=False, n_sinks=4):
    """Per layer [B, H_kv, S]: for each chunk, the model runs over context + reconstruction input as one causal
    sequence (so every repeat token sees the whole context); the chunk's queries score [sinks, own span, own
    tokens] by a dense softmax, KVzip+ factors computed head by head; max over queries and the GQA group."""
    B, S = idx.shape
    a = model.args
    g = a.n_heads // a.n_kv_heads
    out = [torch.zeros(B, a.n_kv_heads, S) for _ in model.layers]
    for start in range(0, S, chunk):
        stop = min(S, start + chunk)
        x_ids = repeat.chunk_ids(idx, start, stop)
        n = x_ids.shape[1]
        kv, hidden_in = [], []
        hooks = [layer.attention_norm.register_forward_hook(lambda m, i, o, acc=hidden_in: acc.append(o))
                 for layer in model.layers]
        try:
            kv, _ = kvzip.record_prefill(model, torch.cat([idx, x_ids], 1))
        finally:
            for h in hooks:
                h.remove()
        s = min(n_sinks, start)
        for layer, (q, k, v) in enumerate(kv):
            keys = torch.cat([k[:, :, :s], k[:, :, start:stop], k[:, :, S:]], 2)
            values = torch.cat([v[:, :, :s], v[:, :, start:stop], v[:, :, S:]], 2)
            wo = model.layers[layer].attention.wo.weight
            for b in range(B):
                for head in range(a.n_heads):
                    kvh = head // g
                    logits = q[b, head, S:] @ keys[b, kvh].T / math.sqrt(a.head_dim)  # [n, m]
                    m = keys.shape[2]
                    for r in range(n):
                        logits[r, m - n + r + 1:] = -math.inf  # own tokens: causal
                    p = torch.softmax(logits, -1)
                    if plus:
                        h_norm = hidden_in[layer][b, S:].norm(dim=-1)  # the normed input of this layer
                        wov = (values[b, kvh] @ wo[:, head * a.head_dim:(head + 1) * a.head_dim].T).norm(dim=-1)
                        p = p / h_norm[:, None] * wov[None, :]
                    best = p[:, s:s + stop - start].amax(0)
                    out[layer][b, kvh, start:stop] = torch.maximum(out[layer][b, kvh, start:stop], best)
    return out


@pytest.mark.parametrize("plus", [False, True])
@pytest.mark.parametrize("chunk", [7, 40])
def test_scores_match_the_model_run_over_context_and_repeat(chunk, plus):
    model = tiny_model(1, n_layers=3, n_heads=4, n_kv_heads=2)
    idx = torch.randint(0, 64, (2, 23), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        kv, _ = kvzip.record_prefill(model, idx)
        fast = kvzip.context_scores(model, idx, kv, REPEAT, chunk=chunk, plus=plus)
        slow = slow_scores(model, idx, REPEAT, chunk, plus=plus)
    for layer, (f, s) in enumerate(zip(fast, slow)):
        # probabilities of the same model run in query blocks vs whole: the context and its repeat (with a few
        # prompt tokens) as keys
        assert_numerically_close(f, s, depth=model_depth(model.args, 2 * idx.shape[1] + 16),
                                 msg=f"layer {layer}")


def test_scores_use_bounded_query_blocks(monkeypatch):
    """Blocks of query rows give the same scores as one block."""
    model = tiny_model(2)
    idx = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        kv, _ = kvzip.record_prefill(model, idx)
        whole = kvzip.context_scores(model, idx, kv, REPEAT, chunk=16)
        monkeypatch.setattr(kvzip, "PREFILL_BLOCK_ELEMENTS", 64)
        blocked = kvzip.context_scores(model, idx, kv, REPEAT, chunk=16)
    for a, b in zip(whole, blocked):
        torch.testing.assert_close(a, b)


def test_bf16_reconstruction_ranks_like_fp32():
    """--kvzip-dtype bfloat16 runs the products in bf16 (fast with AMX): the scores stay close and every head
    keeps nearly the same half of the context."""
    model = tiny_model(8)
    S = 48
    idx = torch.randint(0, 64, (2, S), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        kv, _ = kvzip.record_prefill(model, idx)
        exact = kvzip.context_scores(model, idx, kv, REPEAT, chunk=20)
        fast = kvzip.context_scores(model, idx, kv, REPEAT, chunk=20, dtype=torch.bfloat16)
    for a, b in zip(exact, fast):
        assert b.dtype == torch.float32 and (b - a).abs().max() < 0.05
        top_a, top_b = a.topk(S // 2, dim=-1).indices, b.topk(S // 2, dim=-1).indices
        shared = [len(set(x.tolist()) & set(y.tolist())) for x, y in zip(top_a.flatten(0, 1), top_b.flatten(0, 1))]
        assert min(shared) >= 0.8 * S // 2


def test_auto_dtype_follows_the_cpu():
    """auto reads the kernels' CPU, so KVFAST_CPU / force_cpu govern it like every other CPU choice."""
    comp = kvzip.KVzipPrompt(kvzip_dtype="auto")
    with force_cpu("amx"):
        assert comp.compute_dtype(torch.device("cpu")) == torch.bfloat16
    with force_cpu("avx512-bf16"):  # bfloat16 dot products, but no AMX tiles
        assert comp.compute_dtype(torch.device("cpu")) is None  # the model's own dtype
    default = kvzip.KVzipPrompt()  # the prefill's products' precision (--prefill-dtype), else the model's
    assert default.compute_dtype(torch.device("cpu")) is None
    assert default.compute_dtype(torch.device("cpu"), torch.bfloat16) == torch.bfloat16
    assert kvzip.KVzipPrompt(kvzip_dtype="float32").compute_dtype(torch.device("cpu"), torch.bfloat16) == torch.float32


def test_chunk_inputs_follow_kvpress():
    idx = torch.arange(100, 120).view(1, -1)
    assert REPEAT.chunk_ids(idx, 0, 8).tolist() == [[5, 6, 7, 10, 11, *range(100, 108)]]
    # later chunks: instruction, the previous chunk's last `carry` tokens, suffix, the chunk
    assert REPEAT.chunk_ids(idx, 8, 16).tolist() == [[8, 9, 105, 106, 107, 10, 11, *range(108, 116)]]


def test_longest_chunk_is_the_longest_chunk_input():
    for S, chunk in [(20, 8), (20, 20), (20, 64), (17, 8), (9, 8), (3, 2)]:
        lengths = [REPEAT.chunk_ids(torch.zeros(1, S, dtype=torch.long), a, min(S, a + chunk)).shape[1]
                   for a in range(0, S, chunk)]
        assert REPEAT.longest(S, chunk) == max(lengths), (S, chunk)


def test_a_context_without_room_for_its_reconstruction_is_refused_before_the_prefill(monkeypatch):
    """The reconstruction chunks follow the context's positions: a context that leaves no room is one line, before
    the (at 32k, minutes-long) recorded prefill."""
    model = tiny_model()
    S = model.args.max_seq_len - 40  # room for 40 positions: a 64-token chunk and its instruction do not fit
    model.setup_caches(make_cache_factory("snapkv", 1, model.args, S, 4, prompt_compression="kvzip", budget=64,
                                          kvzip_chunk=64))
    monkeypatch.setattr(kvzip, "record_prefill", lambda *a: pytest.fail("prefilled first"))
    idx = torch.randint(0, 64, (1, S), generator=torch.Generator().manual_seed(0))
    with pytest.raises(KVFastError, match=rf"kvzip: context \({S}\) \+ a reconstruction chunk \(\d+\) exceed"):
        kvzip.prefill(model, idx)


def test_repeat_prompt_uses_the_chat_template(tiny_checkpoint):
    from tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_checkpoint)
    repeat = kvzip.RepeatPrompt.from_tokenizer(tok)
    assert tok.decode(repeat.first) == kvzip.FIRST_INSTRUCTION
    assert tok.decode(repeat.later) == kvzip.LATER_INSTRUCTION
    if tok.chat_format != "none":
        assert tok.chat_prompt("X").endswith("X" + tok.decode(repeat.suffix))


def test_prefill_keeps_the_top_scored_tokens_per_head():
    """decode.prefill with KVzip compressing for a uniform cache: every layer and KV head keeps its sinks and
    top reconstruction scores, and the logits are the plain prefill's."""
    model = tiny_model(4)
    S, kept, new = 40, 12, 4
    idx = torch.randint(0, 64, (2, S), generator=torch.Generator().manual_seed(2))
    factory = make_cache_factory("snapkv", 2, model.args, S, new, prompt_compression="kvzip", budget=kept + new,
                                 kvzip_chunk=16, n_sinks=2)
    scores = kvzip_prefill(model, factory, idx, chunk=16)
    assert model.kvzip_scoring_s > 0
    for cache, s in zip(model.caches, scores):
        s = s.clone()
        s[..., :2] = math.inf
        expected = s.topk(kept, dim=-1).indices.sort(-1).values
        assert torch.equal(cache.slot_pos[..., :kept], expected)
        assert (cache.slot_pos[..., kept:] == -1).all()


def test_kvzip_policy_is_adakv_with_kvzip_scores():
    """The kvzip policy is adakv's pool with KVzip's scores, no floor, no per-head normalisation (the joint
    ranking across heads is tests/test_pool.py's): the same (head, token) pairs, and heads hold different
    numbers of them."""
    model = tiny_model(7)
    S, B_head = 40, 14
    idx = torch.randint(0, 64, (1, S), generator=torch.Generator().manual_seed(4))
    params = {"kvzip_chunk": 16, "n_sinks": 2, "recent_window": 3}

    def kept_pairs(policy: str, **extra) -> list:
        model.setup_caches(make_cache_factory(policy, 1, model.args, S, 4, budget=B_head, **params, **extra))
        with torch.inference_mode():
            kvzip.prefill(model, idx)
        return [sorted(zip(c.slot_head[0].tolist(), c.slot_pos[0].tolist())) for c in model.caches]

    ours = kept_pairs("kvzip")
    assert ours == kept_pairs("adakv", prompt_compression="kvzip", adakv_floor=0.0, adakv_normalize=False)
    assert any(sum(h == 0 for h, _ in layer) != B_head for layer in ours)  # budgets differ per head


def test_eval_replay_scores_once_per_sample(monkeypatch):
    """Budgets share the memoized scores: the reconstruction runs once however many caches use it."""
    from evals.caches import MultiCache

    model = tiny_model(5)
    S = 30
    idx = torch.randint(0, 64, (1, S), generator=torch.Generator().manual_seed(3))
    calls = []
    real = kvzip.context_scores
    monkeypatch.setattr(kvzip, "context_scores", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.inference_mode():
        kv, _ = kvzip.record_prefill(model, idx)
        memos = [{} for _ in model.layers]
        for budget in (10, 16):
            factory = make_cache_factory("snapkv", 1, model.args, S, 4, prompt_compression="kvzip",
                                         budget=budget + 4, kvzip_chunk=8)
            caches = [MultiCache([factory(i), factory(i)]) for i in range(len(model.layers))]
            kvzip.score_into(model, idx, kv, caches, memos)
            for c, (q, k, v), memo in zip(caches, kv, memos):
                c.prefill(q, k, v, memo=memo)
    assert len(calls) == 1


def test_layer_by_layer_prefill_is_refused():
    model = tiny_model(6)
    model.setup_caches(make_cache_factory("snapkv", 1, model.args, 30, 2, prompt_compression="kvzip", budget=12))
    with pytest.raises(KVFastError, match="reconstruction pass"), torch.inference_mode():
        model(torch.zeros(1, 30, dtype=torch.long))  # the model's own prefill cannot score


def test_cli_kvzip(tiny_checkpoint, capsys):
    base = ["--checkpoint", str(tiny_checkpoint), "--max-new-tokens", "4", "--temperature", "0",
            "--cache", "kvzip", "--recent-window", "4"]
    long_prompt = " ".join(["hello world"] * 30)
    for dtype in ("float32", "bfloat16"):
        assert generate.cli([*base, "--prompt", long_prompt, "--cache-budget", "24", "--kvzip-chunk", "16",
                             "--kvzip-dtype", dtype]) == 0
        out = capsys.readouterr().out
        assert "kvzip reconstruction scoring" in out and "capacity per layer 24 slots" in out
    # a prompt that fits: said, not failed
    assert generate.cli([*base, "--prompt", "hello", "--cache-budget", "0.9"]) == 0
    assert "nothing to compress" in capsys.readouterr().out
    # bad input: one line, exit 2
    for argv, message in [(["--kvzip-chunk", "0"], "--kvzip-chunk must be a whole number >= 1"),
                          (["--prompt-compression", "kvzipp"], "unknown prompt compressor 'kvzipp'"),
                          (["--compile-prefill"], "--compile-prefill cannot compile kvzip"),
                          (["--kvzip-dtype", "fp8"], "--kvzip-dtype must be one of prefill, float32, bfloat16, auto"),
                          (["--cache", "h2o", "--kvzip-chunk", "64"], "--kvzip-chunk is not used by --cache h2o")]:
        assert generate.cli([*base, "--prompt", long_prompt, "--cache-budget", "24", *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, (argv, err)
