"""--pos-shift (StreamingLLM's positions): RoPE at each cached token's rank, decoding past max_seq_len."""

import math

import pytest
import torch
import torch.nn.functional as F
from cache_testing import generate_tokens, single_thread_fixture, small_params, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from numerics import assert_numerically_close, model_depth

import generate
from cache import make_cache_factory
from decode import Decoder
from model import Transformer, apply_rope, rope_tables

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)


def short_model(max_seq_len: int = 48, seed: int = 0) -> Transformer:
    model = tiny_model(seed)
    model.args.max_seq_len = max_seq_len
    model.rope_cos, model.rope_sin = rope_tables(model.args)
    return model


def streaming_reference(model: Transformer, ids: list[int], n_sinks: int, capacity: int) -> list[torch.Tensor]:
    """Logits after each token, written out from StreamingLLM's rule alone: per layer a list of pre-RoPE keys and
    values, the oldest non-sink dropped when more than `capacity` are held, keys rotated at ranks 0..n-1 and the
    query at n-1. Shares nothing with kv.slots."""
    a = model.args
    cos, sin = rope_tables(a)
    held: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in model.layers]
    out = []
    for token in ids:
        x = model.tok_embeddings(torch.tensor([[token]]))
        for layer, kept in zip(model.layers, held):
            attn = layer.attention
            q, k, v = attn.project(layer.attention_norm(x), None, None)  # [1, heads, 1, D], unrotated
            kept.append((k[0, :, 0], v[0, :, 0]))
            if len(kept) > capacity:
                del kept[n_sinks]
            n = len(kept)
            keys = torch.stack([kk for kk, _ in kept], 1)  # [H_kv, n, D]
            values = torch.stack([vv for _, vv in kept], 1)
            keys = apply_rope(keys, cos[:n], sin[:n])
            q = apply_rope(q[0], cos[n - 1 : n], sin[n - 1 : n])  # [H, 1, D]
            g = a.n_heads // a.n_kv_heads
            scores = q @ keys.repeat_interleave(g, 0).transpose(-1, -2) / math.sqrt(a.head_dim)
            o = F.softmax(scores, -1) @ values.repeat_interleave(g, 0)  # [H, 1, D]
            h = x + attn.output(o.unsqueeze(0))
            x = h + layer.feed_forward(layer.ffn_norm(h))
        out.append(model.logits(model.norm(x))[0, -1])
    return out


def decoded_logits(model: Transformer, prompt: torch.Tensor, n_new: int, decoder: Decoder | None = None):
    logits = []
    tokens = generate_tokens(model, prompt, n_new, decoder, on_logits=lambda i, lg: logits.append(lg[0, -1]))
    return tokens, logits


def test_window_with_pos_shift_is_streamingllm_past_max_seq_len():
    model = short_model(max_seq_len=48)
    capacity, n_sinks, n_new = 12, 2, 90  # 8 + 90 tokens: twice the model's length
    model.setup_caches(make_cache_factory("window", 1, model.args, 8, n_new, budget=capacity, n_sinks=n_sinks,
                                          pos_shift=True))
    prompt = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        tokens, logits = decoded_logits(model, prompt, n_new)
        fed = prompt[0].tolist() + tokens[0, :-1].tolist()
        reference = streaming_reference(model, fed, n_sinks, capacity)[7:]
    assert len(logits) == n_new - 1
    for step, (ours, ref) in enumerate(zip(logits, reference[1:])):
        assert_numerically_close(ours, ref, depth=model_depth(model.args, capacity), msg=f"step {step}")
    assert int(model.caches[0].slot_pos.max()) == 8 + n_new - 2  # positions went past max_seq_len


@pytest.mark.parametrize("policy", ["window", "h2o", "snapkv", "knorm"])
def test_pos_shift_changes_nothing_while_ranks_are_positions(policy):
    """No eviction and an uncompressed prompt: every rank is the position, so logits equal plain decoding's."""
    model = tiny_model()
    prompt = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    runs = []
    for shift in (False, True):
        params = small_params(policy)
        model.setup_caches(make_cache_factory(policy, 2, model.args, 10, 12, budget=40, pos_shift=shift, **params))
        with torch.inference_mode():
            runs.append(decoded_logits(model, prompt, 12))
    assert torch.equal(runs[0][0], runs[1][0])
    for a, b in zip(runs[0][1], runs[1][1]):
        assert_numerically_close(a, b, depth=model_depth(model.args, 40))


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_ranks_follow_every_eviction(kv_bits):
    """After every step of an h2o cache (content-based eviction, compressed prompt), each slot's rank is its
    token's rank among the cached positions, and the keys attention reads are the stored ones at those ranks."""
    model = tiny_model()
    model.setup_caches(make_cache_factory("h2o", 2, model.args, 30, 40, budget=12, kv_bits=kv_bits, pos_shift=True,
                                          **small_params("h2o")))
    prompt = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(1))

    def check(step, logits):
        for c in model.caches:
            pos = c.slot_pos.masked_fill(c.slot_pos < 0, 1 << 40)
            expected = pos.argsort(-1).argsort(-1).masked_fill(c.slot_pos < 0, -1)
            rank = c.slot_rank.masked_fill(c.slot_pos < 0, -1)
            assert torch.equal(rank, expected), step
            assert int(c.kept().min()) == int(c.kept().max()) == 12

    with torch.inference_mode():
        generate_tokens(model, prompt, 40, on_logits=check)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 11), min_size=1, max_size=40), st.integers(0, 3))
def test_rank_bookkeeping_matches_a_sort(victims, n_prefill):
    """shift_ranks alone, on arbitrary victims (empty slots fill first): ranks always equal a sort of slot_pos."""
    model = tiny_model()
    cache = make_cache_factory("random", 1, model.args, n_prefill, 60, budget=12, pos_shift=True,
                               **small_params("random", n_sinks=0, recent_window=1))(0)
    cache.slot_pos[..., :n_prefill] = torch.arange(n_prefill)
    cache.slot_rank[..., :n_prefill] = torch.arange(n_prefill)
    for t, victim in enumerate(victims, start=n_prefill):
        empty = (cache.slot_pos < 0).nonzero()
        slot = empty[0, -1] if len(empty) else torch.tensor(victim)
        cache.shift_ranks(slot.view(1, 1, 1).expand(1, 2, 1).contiguous())
        cache.slot_pos[..., slot] = t
        pos = cache.slot_pos.masked_fill(cache.slot_pos < 0, 1 << 40)
        valid = cache.slot_pos >= 0
        assert torch.equal(cache.slot_rank[valid], pos.argsort(-1).argsort(-1)[valid])


@pytest.mark.parametrize("scope", ["step", "block"])
def test_compiled_pos_shift_equals_eager_without_recompiling(scope):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = short_model(max_seq_len=64)
    model.setup_caches(make_cache_factory("h2o", 2, model.args, 12, 150, budget=16, pos_shift=True,
                                          **small_params("h2o")))
    prompt = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        eager = generate_tokens(model, prompt, 150)
    decoder = Decoder(model, compile=True, scope=scope)
    graphs = []
    with torch.inference_mode():
        compiled = generate_tokens(model, prompt, 150, decoder,
                                   on_logits=lambda i, lg: graphs.append(counters["stats"]["unique_graphs"]))
    assert torch.equal(compiled, eager)
    assert graphs[3] == graphs[-1], "recompiled"


@pytest.mark.parametrize("flags,message", [
    (["--pos-shift"], "--pos-shift does not apply to --cache full"),
    (["--pos-shift", "--cache", "adakv", "--cache-budget", "0.5"], "--pos-shift does not apply to --cache adakv"),
    (["--pos-shift", "--cache", "expected_attention", "--cache-budget", "0.5"],
     "--pos-shift does not apply to --cache expected_attention"),
    (["--pos-shift", "--cache", "h2o", "--cache-budget", "0.5", "--warm-tokens", "1.0"],
     "--pos-shift does not apply to --cache h2o with tiers"),
    (["--cache", "window", "--cache-budget", "16", "--max-new-tokens", "600"], "exceeds the model's maximum length"),
])
def test_bad_pos_shift_flags_are_one_line(tiny_checkpoint, capsys, flags, message):
    code = generate.cli(["--checkpoint", str(tiny_checkpoint), "--max-new-tokens", "4", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err


def test_cli_streams_past_the_models_length(tiny_checkpoint, capsys):
    """The tiny checkpoint holds 512 positions; a window with --pos-shift generates 600 tokens after the prompt."""
    argv = ["--checkpoint", str(tiny_checkpoint), "--prompt", "Hello there", "--max-new-tokens", "600",
            "--cache", "window", "--cache-budget", "32", "--pos-shift", "--ignore-eos", "--temperature", "0"]
    assert generate.cli(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "--pos-shift" in out and "600" in out


def test_eval_reads_a_ppl_window_past_the_models_length(tmp_path):
    """eval.py --pos-shift: a 600-token window on a 300-position model; full (which cannot read it) is left out,
    each segment's ppl is recorded and the segments add up to the cumulative figure."""
    from test_eval import PROSE, ByteTokenizer
    from test_eval import tiny_model as byte_model

    import eval as ev_mod

    text = tmp_path / "prose.txt"
    text.write_text("\n\n".join(PROSE * 4))
    model = byte_model()
    model.args.max_seq_len = 300
    model.rope_cos, model.rope_sin = rope_tables(model.args)
    args = ev_mod.parse_args(["--ppl-text", str(text), "--out", str(tmp_path / "out"), "--device", "cpu", "--tasks",
                              "ppl", "--policies", "window", "h2o", "--pos-shift", "--budgets", "64", "--lengths", "128",
                              "--ppl-length", "600", "--ppl-samples", "2", "--ppl-every", "100", "--n-sinks", "4"])
    store = ev_mod.Store(tmp_path / "out", {"run": "test"}, False)
    ev_mod.evaluate(ev_mod.Evaluator(model, ByteTokenizer(), args), store)
    records = list(store.records.values())
    assert sorted({r["policy"] for r in records}) == ["h2o+shift", "window+shift"] and len(records) == 4
    for r in records:
        m = r["metrics"]
        assert r["prefilled"] == 64 and math.isfinite(m["ppl@600"])
        segments = sum(m[f"nll_seg@{p}"] * (p - max(q - 1, 0) - 1) for q, p in zip([0, *range(100, 600, 100)],
                                                                              range(100, 601, 100)))
        assert segments == pytest.approx(m["nll@600"] * 599, rel=1e-6)
    from evals import report as evalreport

    files = evalreport.plots(records, tmp_path / "out")
    assert (tmp_path / "out" / "ppl_by_position.png") in files


@pytest.mark.parametrize("policies,message", [(["window"], "policies ['window'] keep original positions"),
                                               (["window+warm"], "policies ['window+warm'] keep")])
def test_eval_refuses_unshifted_policies_past_the_models_length(tiny_checkpoint, policies, message, capsys):
    import eval as ev_mod

    code = ev_mod.cli(["--checkpoint", str(tiny_checkpoint), "--tasks", "ppl", "--policies", *policies,
                       "--ppl-length", "600", "--lengths", "128", "--answer-room", "8"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_eval_rejects_shift_where_it_does_not_apply(capsys):
    import eval as ev_mod

    assert ev_mod.cli(["--policies", "adakv+shift"]) == 2
    assert "--policies adakv+shift: --pos-shift does not apply to --cache adakv" in capsys.readouterr().err
