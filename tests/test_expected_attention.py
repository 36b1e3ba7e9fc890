"""Expected Attention (kv/expected.py) against slow references written from kvpress's formula with explicit
RoPE matrices: the prompt scores (plain and llama3-scaled RoPE), the recovered pre-RoPE queries, the decode
policy's choices over a trace with refreshes, the effect of refresh(), memoization and errors."""

import dataclasses
import math

import pytest
import torch
from cache_testing import single_thread_fixture, tiny_args, tiny_model

import cache as kvcache
import decode
import generate
from kv import expected
from kv.expected import ExpectedAttentionCache, ExpectedAttentionPrompt, prerope_queries
from model import KVFastError, Transformer, rope_frequencies, rope_tables

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # small enough to rescale some of a tiny head's frequencies


def model_args(llama3: bool = False, n_heads: int = 4, n_kv_heads: int = 2, head_dim: int = 8):
    args = tiny_args(n_layers=1, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim)
    return dataclasses.replace(args, rope_scaling=LLAMA3) if llama3 else args


# ---- the slow reference: kvpress's formula, one head and one key at a time, explicit D x D rotations -------
def rope_matrix(args, p: int) -> torch.Tensor:
    """R(p) = diag(cos) + diag(sin) P (kvpress's apply_avg_rope), P x = [-x2, x1], from the model's table."""
    cos, sin = (t[p].double() for t in rope_tables(args))
    half = args.head_dim // 2
    P = torch.zeros(args.head_dim, args.head_dim, dtype=torch.float64)
    P[half:, :half], P[:half, half:] = torch.eye(half), -torch.eye(half)
    return torch.diag(cos) + torch.diag(sin) @ P


def mean_rotation(args, start: int, n: int) -> torch.Tensor:
    return torch.stack([rope_matrix(args, p) for p in range(start, start + n)]).mean(0)


def post_rope(args, pre_q: torch.Tensor) -> torch.Tensor:
    """What the model hands the cache: every query rotated to its position."""
    out = torch.empty_like(pre_q)
    for p in range(pre_q.shape[2]):
        out[:, :, p] = pre_q[:, :, p].double() @ rope_matrix(args, p).T
    return out.float()


def head_moments(pre_q: torch.Tensor, b: int, h: int, n_sink: int = 4):
    """Mean and covariance (divided by the count) of one head's queries after the first n_sink."""
    queries = pre_q[b, h, n_sink:].double()
    mu = queries.mean(0)
    centered = queries - mu
    return mu, centered.T @ centered / len(queries)


def expected_logit(key: torch.Tensor, mu: torch.Tensor, cov: torch.Tensor, rotation: torch.Tensor) -> float:
    d = len(key)
    key = key.double()
    mu_r, cov_r = rotation @ mu, rotation @ cov @ rotation.T
    return float(mu_r @ key / math.sqrt(d) + 0.5 * key @ cov_r @ key / d)


def reference_scores(args, pre_q, k, v, n_future: int, epsilon: float, n_sink: int = 4) -> torch.Tensor:
    """[B, H_kv, S - n_sink]: (softmax over the non-sink keys of z, mean over the group + epsilon) * ||v||."""
    B, H, S, _ = pre_q.shape
    n_kv = k.shape[1]
    g = H // n_kv
    rotation = mean_rotation(args, S, n_future)
    out = torch.zeros(B, n_kv, S - n_sink, dtype=torch.float64)
    for b in range(B):
        for kv in range(n_kv):
            for j in range(g):
                mu, cov = head_moments(pre_q, b, kv * g + j, n_sink)
                z = torch.tensor([expected_logit(k[b, kv, i], mu, cov, rotation) for i in range(n_sink, S)],
                                 dtype=torch.float64)
                out[b, kv] += torch.softmax(z, 0) / g
            out[b, kv] = (out[b, kv] + epsilon) * v[b, kv, n_sink:].double().norm(dim=-1)
    return out


def random_prompt(args, S: int, seed: int, B: int = 2):
    gen = torch.Generator().manual_seed(seed)
    pre_q = torch.randn(B, args.n_heads, S, args.head_dim, generator=gen) + 0.5  # a mean away from 0
    k = torch.randn(B, args.n_kv_heads, S, args.head_dim, generator=gen)
    scale = torch.rand(B, args.n_kv_heads, S, 1, generator=gen)  # ||v|| varies: the rescaling matters
    v = torch.randn(B, args.n_kv_heads, S, args.head_dim, generator=gen) * scale
    return pre_q, post_rope(args, pre_q), k, v


# ---- prompt compressor -------------------------------------------------------------------------------------
@pytest.mark.parametrize("llama3", [False, True])
@pytest.mark.parametrize("n_heads, n_kv_heads, epsilon", [(4, 2, 0.0), (3, 1, 0.05), (2, 2, 0.0)])
def test_scores_match_the_dense_reference(llama3, n_heads, n_kv_heads, epsilon):
    args = model_args(llama3, n_heads, n_kv_heads)
    pre_q, q, k, v = random_prompt(args, S=21, seed=n_heads + 7 * llama3)
    compressor = ExpectedAttentionPrompt(model_args=args, n_future_positions=40, epsilon=epsilon)
    scores = compressor.scores(q, k, None, v)
    assert scores.shape == (2, n_kv_heads, 21)
    torch.testing.assert_close(scores[..., 4:].double(), reference_scores(args, pre_q, k, v, 40, epsilon),
                               rtol=2e-5, atol=1e-6)
    assert (scores[..., :4] > scores[..., 4:].amax(-1, keepdim=True)).all(), "the 4 sinks always rank first"


def test_llama3_scaling_changes_the_scores():
    """The scaled case above is not vacuous: the rescaled frequencies move the expected attention."""
    plain, scaled = model_args(False), model_args(True)
    assert not torch.equal(rope_frequencies(plain), rope_frequencies(scaled))
    _, q, k, v = random_prompt(plain, S=21, seed=3)
    s_plain = ExpectedAttentionPrompt(model_args=plain, n_future_positions=40).scores(q, k, None, v)
    s_scaled = ExpectedAttentionPrompt(model_args=scaled, n_future_positions=40).scores(q, k, None, v)
    assert not torch.allclose(s_plain, s_scaled, rtol=1e-3)


@pytest.mark.parametrize("llama3", [False, True])
def test_prerope_queries_are_what_the_model_projected(llama3):
    torch.manual_seed(0)
    model = Transformer(model_args(llama3, n_heads=4, n_kv_heads=2)).eval()
    attention = model.layers[0].attention
    B, S, H, D = 2, 30, 4, 8
    x = torch.randn(B, S, model.args.dim)
    with torch.no_grad():
        q, _, _ = attention.project(x, model.rope_cos[:S], model.rope_sin[:S])
        projected = attention.wqkv(x)[..., : H * D].view(B, S, H, D).transpose(1, 2)  # no RoPE
    inv_freq = rope_frequencies(model.args)
    torch.testing.assert_close(prerope_queries(q, inv_freq), projected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(prerope_queries(q, inv_freq, 4), projected[:, :, 4:], rtol=1e-5, atol=1e-5)


def test_query_statistics_are_memoized_for_every_budget(monkeypatch):
    """Several budgets (and the decode policy itself) on one memo recover the pre-RoPE queries once."""
    calls = []
    original = expected.prerope_queries

    def counting(*a, **kw):
        calls.append(1)
        return original(*a, **kw)

    monkeypatch.setattr(expected, "prerope_queries", counting)
    args = model_args()
    _, q, k, v = random_prompt(args, S=40, seed=1)
    memo: dict = {}
    kept = []
    for budget in (12, 20, 30):
        cache = kvcache.make_cache_factory("expected_attention", 2, args, 40, 4, budget=budget, n_sinks=2,
                                           recent_window=3, n_future_positions=16)(0)
        cache.prefill(q, k, v, memo=memo)
        kept.append(set(cache.slot_pos[0, 0].tolist()))
    assert len(calls) == 1
    assert kept[0] < kept[1] < kept[2], "top-k of the same scores: a larger budget keeps a superset"


def test_errors_without_model_args_or_values():
    args = model_args()
    _, q, k, v = random_prompt(args, S=10, seed=0)
    with pytest.raises(KVFastError, match="needs the model's ModelArgs"):
        ExpectedAttentionPrompt().scores(q, k, None, v)
    with pytest.raises(KVFastError, match=r"rescale by \|\|v\|\|"):
        ExpectedAttentionPrompt(model_args=args).scores(q, k)
    with pytest.raises(KVFastError, match="needs the model's ModelArgs"):
        ExpectedAttentionCache(1, 2, 8, 16)


# ---- decode policy -----------------------------------------------------------------------------------------
def test_policy_scores_the_prompt_like_the_compressor():
    """With the prompt kept whole and kvpress's 4 sinks, the slots' scores are the compressor's scores."""
    args = model_args()
    _, q, k, v = random_prompt(args, S=24, seed=2)
    cache = kvcache.make_cache_factory("expected_attention", 2, args, 24, 8, n_future_positions=32,
                                       epsilon=0.01)(0)
    assert cache.capacity == 32
    cache.prefill(q, k, v)
    ours = cache.slot_scores(torch.tensor([24]))[..., 4:24]
    compressor = ExpectedAttentionPrompt(model_args=args, n_future_positions=32, epsilon=0.01)
    theirs = compressor.scores(q, k, None, v)
    torch.testing.assert_close(ours, theirs[..., 4:], rtol=1e-5, atol=1e-7)


def test_decode_choices_match_the_slow_reference():
    """Prompt selection, then one token in and one out per step, refreshed every 5 steps: the kept positions
    equal a token-space reference that rescores every kept token from its K, V at each step."""
    args = model_args()
    B, S, steps, C = 2, 20, 24, 10
    n_sinks, recent, n_future, eps, interval = 2, 3, 16, 0.01, 5
    pre_q, q, k, v = random_prompt(args, S, seed=4, B=B)
    cache = kvcache.make_cache_factory("expected_attention", B, args, S, steps, budget=C, n_sinks=n_sinks,
                                       recent_window=recent, n_future_positions=n_future, epsilon=eps,
                                       refresh_interval=interval)(0)
    cache.prefill(q, k, v)
    n_kv, g = args.n_kv_heads, args.n_heads // args.n_kv_heads

    # the prompt: kvpress scores, its 4 sinks first, the policy's sinks and recent window - 1 forced in
    prompt_scores = reference_scores(args, pre_q, k, v, n_future, eps)
    kept: dict[tuple[int, int], dict[int, tuple]] = {}
    for b in range(B):
        for kv in range(n_kv):
            score = {i: math.inf if i < n_sinks or i >= S - (recent - 1) else
                     (1e9 if i < 4 else float(prompt_scores[b, kv, i - 4])) for i in range(S)}
            best = sorted(score, key=score.get, reverse=True)[:C]
            kept[b, kv] = {i: (k[b, kv, i], v[b, kv, i]) for i in best}
    moments = {(b, h): head_moments(pre_q, b, h) for b in range(B) for h in range(args.n_heads)}

    def check():
        for (b, kv), tokens in kept.items():
            assert set(tokens) == {p for p in cache.slot_pos[b, kv].tolist() if p >= 0}, f"row {b}, head {kv}"

    check()
    gen = torch.Generator().manual_seed(5)
    rotation_at, not_oldest = S, 0
    for t in range(S, S + steps):
        if t % interval == 0:
            cache.refresh()
            rotation_at = t
        rotation = mean_rotation(args, rotation_at, n_future)
        k_new, v_new = (torch.randn(B, n_kv, 1, args.head_dim, generator=gen) for _ in "kv")
        for (b, kv), tokens in kept.items():
            scored = [p for p in tokens if p >= n_sinks]
            probs = torch.zeros(len(scored), dtype=torch.float64)
            for j in range(g):
                mu, cov = moments[b, kv * g + j]
                z = torch.tensor([expected_logit(tokens[p][0], mu, cov, rotation) for p in scored],
                                 dtype=torch.float64)
                probs += torch.softmax(z, 0) / g
            value = {p: (float(pr) + eps) * float(tokens[p][1].double().norm())
                     for p, pr in zip(scored, probs, strict=True)}
            evictable = [p for p in scored if p <= t - recent]
            victim = min(evictable, key=value.get)
            not_oldest += victim != min(evictable)
            del tokens[victim]
            tokens[t] = (k_new[b, kv, 0], v_new[b, kv, 0])
        cache.update(torch.tensor([t]), k_new, v_new)
        check()
    assert not_oldest > steps, "the trace should exercise the scores, not just evict the oldest token"


def test_refresh_moves_the_future_positions():
    """refresh() at the prefill position changes nothing; later it re-rotates the statistics to the new next
    positions and re-scores every slot, as the reference does for those positions."""
    args = model_args()
    S, n_future = 24, 16
    pre_q, q, k, v = random_prompt(args, S, seed=6, B=1)
    cache = kvcache.make_cache_factory("expected_attention", 1, args, S, 40, budget=24, n_sinks=4,
                                       recent_window=2, n_future_positions=n_future)(0)
    cache.prefill(q, k, v)
    at_prefill = cache.log_attn.clone()
    cache.refresh()
    torch.testing.assert_close(cache.log_attn, at_prefill, rtol=1e-5, atol=1e-5)
    before = cache.slot_scores(torch.tensor([S]))

    t = S + 37
    cache.seen.fill_(t)
    cache.refresh()
    assert not torch.allclose(cache.log_attn, at_prefill, rtol=1e-3)
    assert not torch.allclose(cache.slot_scores(torch.tensor([t])), before, rtol=1e-3)
    rotation = mean_rotation(args, t, n_future)
    g = args.n_heads // args.n_kv_heads
    for kv in range(args.n_kv_heads):
        for j in range(g):
            mu, cov = head_moments(pre_q, 0, kv * g + j)
            expect = torch.tensor([expected_logit(k[0, kv, i], mu, cov, rotation) for i in range(S)],
                                  dtype=torch.float64)
            torch.testing.assert_close(cache.log_attn[0, kv, j].double(), expect, rtol=1e-4, atol=1e-5)


def test_generates_with_a_model_and_quantized_kv():
    """End to end through the model: the compressor picks the prompt, the policy evicts, K/V in 4 bits."""
    model = tiny_model()
    factory = kvcache.make_cache_factory("expected_attention", 2, model.args, 40, 20, budget=16, n_sinks=2,
                                         recent_window=4, n_future_positions=32, refresh_interval=6,
                                         kv_bits=4)
    model.setup_caches(factory)
    with torch.inference_mode():
        first = decode.prefill(model, torch.randint(0, 64, (2, 40)), 0.0, None)
        decode.Decoder(model).decode(first, 40, 19)
    for c in model.caches:
        assert (c.kept() == 16).all() and c.tokens_seen() == 59
        assert torch.isfinite(c.slot_scores(c.seen)).all()


# ---- command line ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from conftest import save_tiny_hf

    from scripts.convert_hf_checkpoint import convert_hf_checkpoint

    hf_dir = tmp_path_factory.mktemp("hf")
    save_tiny_hf(hf_dir, tie=True, rope_scaling=False)
    return convert_hf_checkpoint(hf_dir, tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.mark.parametrize("argv, expected_error", [
    (["--cache", "expected_attention", "--n-future-positions", "0"],
     "--n-future-positions must be a whole number >= 1, got 0"),
    (["--cache", "expected_attention", "--epsilon", "-0.5"],
     "--epsilon must be a finite number >= 0, got -0.5"),
    (["--cache", "expected_attention", "--refresh-interval", "2.5"],
     "--refresh-interval must be a whole number >= 1, got 2.5"),
    (["--cache", "h2o", "--n-future-positions", "64"], "--n-future-positions is not used by --cache h2o"),
    (["--cache", "h2o", "--prompt-compression", "expected_attention", "--refresh-interval", "8"],
     "--refresh-interval is not used by --cache h2o / --prompt-compression expected_attention"),
])
def test_bad_values_fail_with_one_line(argv, expected_error, tiny_checkpoint, capsys):
    code = generate.cli(["--checkpoint", str(tiny_checkpoint), "--prompt", "The quick brown fox",
                         "--max-new-tokens", "4", "--temperature", "0", *argv])
    out, err = capsys.readouterr()
    assert code == 2, out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected_error in lines[0], err


def test_cli_runs_with_compression(tiny_checkpoint, capsys):
    code = generate.cli(["--checkpoint", str(tiny_checkpoint), "--prompt", "The quick brown fox jumps. " * 4,
                         "--max-new-tokens", "12", "--temperature", "0", "--ignore-eos", "--cache-config",
                         "expected_attention", "--cache-budget", "24", "--n-future-positions", "64",
                         "--refresh-interval", "4"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "cache: expected_attention + expected_attention prompt compression, capacity per layer 24" in out
