"""Reference checks: the slot/bit/queue implementations against slow, obviously-correct versions in token
space fed the same attention trace or keys (Scissorhands, H2O, TOVA, KNorm); SnapKV's kept set against a brute
force from the dense attention; blockwise prompt statistics against the dense ones; PyramidKV's layer budgets;
TOVA's per-layer set."""

import math
import struct

import pytest
import torch
from cache_testing import single_thread_fixture, tiny_args

import kv.prompt as prompt_stats
from attention import attend
from cache import PROMPT_COMPRESSORS, make_cache_factory
from kv.budgets import layer_capacities

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)
B, H_KV, G, D = 2, 2, 2, 8


def dense_attention(q, k):
    """softmax(q k^T / sqrt(d)) with a causal mask, all S x S at once: [B, H_kv, g, S, S]."""
    Bq, H, S, _ = q.shape
    scores = q.view(Bq, k.shape[1], H // k.shape[1], S, -1) @ k.unsqueeze(2).transpose(-1, -2) / math.sqrt(D)
    return torch.softmax(scores.masked_fill(torch.ones(S, S).triu(1).bool(), -math.inf), dim=-1)


def random_qkv(S, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H_KV * G, S, D, generator=gen), torch.randn(B, H_KV, S, D, generator=gen),
            torch.randn(B, H_KV, S, D, generator=gen))


def decode_trace(cache, start, steps, seed):
    """Drive a cache like the model does (refresh on schedule, update, attend, observe); yield after each
    step."""
    gen = torch.Generator().manual_seed(seed)
    for t in range(start, start + steps):
        refreshed = bool(cache.refresh_interval) and t % cache.refresh_interval == 0
        if refreshed:
            cache.refresh()
        k, v = torch.randn(B, H_KV, 1, D, generator=gen), torch.randn(B, H_KV, 1, D, generator=gen)
        k_all, v_all, mask = cache.update(torch.tensor([t]), k, v)
        _, probs = attend(torch.randn(B, H_KV * G, 1, D, generator=gen), k_all, v_all, mask, want_probs=True)
        cache.observe(probs)
        yield t, probs, refreshed


def positions(cache, b, h):
    return {p for p in cache.slot_pos[b, h].tolist() if p >= 0}


# ---- Scissorhands ------------------------------------------------------------------------------------
class SlowScissorhands:
    """The policy as stated, over token positions: a history of (step, low?) per token, low = the query's
    attention, over the tokens it sees among those kept, below 1 / their number (prompt queries: their
    attention renormalised over the kept prompt tokens up to them, per query head, then averaged over the
    group); every `interval` steps, rank the evictable tokens by their fraction of low steps in the last
    `history` steps (ties: older first) behind any empty slots; each step evicts the next in that queue."""

    def __init__(self, capacity, n_sinks, recent, history, interval):
        self.capacity, self.n_sinks, self.recent, self.history, self.interval = (capacity, n_sinks, recent,
                                                                                 history, interval)
        self.low: dict[int, dict[int, bool]] = {}  # token -> {step: low?}
        self.queue: list = []

    def prefill(self, kept, attention):
        """attention[head][j][i]: causal attention of each query head of the group over the whole prompt."""
        S = len(attention[0])
        self.low = {i: {} for i in kept}
        for j in range(max(0, S - self.history), S):  # the last queries
            visible = [i for i in kept if i <= j]
            for i in visible:
                shares = [a[j][i] / sum(a[j][v] for v in visible) for a in attention]
                self.low[i][j] = sum(shares) / len(shares) < 1 / len(visible)
        self.t = S
        self.refresh()

    def counts(self):
        window = range(self.t - self.history, self.t)
        return {i: (sum(low for s, low in h.items() if s in window), sum(1 for s in h if s in window))
                for i, h in self.low.items()}

    def refresh(self):
        counts = self.counts()
        evictable = [i for i in self.low if i >= self.n_sinks and i <= self.t - self.recent]
        ranked = sorted(evictable, key=lambda i: (-counts[i][0] / counts[i][1], i))
        self.queue = (["empty"] * (self.capacity - len(self.low)) + ranked)[: self.interval]

    def step(self, t, attention_of):
        victim = self.queue.pop(0)
        if victim != "empty":
            del self.low[victim]
        self.low[t] = {}
        for i in self.low:
            self.low[i][t] = attention_of[i] < 1 / len(self.low)
        self.t = t + 1


@pytest.mark.parametrize("prompt_len", [7, 20])  # empty slots at first / a compressed prompt
def test_scissorhands_matches_slow_reference(prompt_len):
    C, n_sinks, recent, history, m = 12, 1, 3, 6, 4
    args = tiny_args(n_layers=1, n_heads=H_KV * G, n_kv_heads=H_KV, head_dim=D)
    cache = make_cache_factory("scissorhands", B, args, prompt_len, 40, budget=C, n_sinks=n_sinks,
                               recent_window=recent, history_window=history, drop_interval=m, obs_window=4,
                               pool_kernel=3)(0)
    q, k, v = random_qkv(prompt_len, 0)
    cache.prefill(q, k, v)
    prompt_attention = dense_attention(q, k)  # [B, H_kv, g, S, S]
    refs = {}
    for b in range(B):
        for h in range(H_KV):
            refs[b, h] = SlowScissorhands(C, n_sinks, recent, history, m)
            refs[b, h].prefill(sorted(positions(cache, b, h)), prompt_attention[b, h].tolist())

    def compare_ranking():
        counts = cache.low_counts()
        for (b, h), ref in refs.items():
            slots = cache.slot_pos[b, h].tolist()
            ref_counts = ref.counts()
            assert {p: counts[b, h, c].item() for c, p in enumerate(slots) if p >= 0} == \
                   {p: n for p, (n, _) in ref_counts.items()}
            queue = [slots[c] if slots[c] >= 0 else "empty" for c in cache.queue[b, h].tolist()]
            assert queue == ref.queue

    compare_ranking()
    for t, probs, refreshed in decode_trace(cache, prompt_len, 40, 1):
        reduced = probs[:, :, :, 0].mean(dim=2)
        for (b, h), ref in refs.items():
            if refreshed:
                ref.refresh()
            slots = cache.slot_pos[b, h].tolist()
            ref.step(t, {p: reduced[b, h, c].item() for c, p in enumerate(slots) if p >= 0})
            assert positions(cache, b, h) == set(ref.low), f"step {t}: kept sets differ"
        if (t + 1) % m == 0:
            cache.refresh()
            for ref in refs.values():
                ref.refresh()
            compare_ranking()


def test_scissorhands_prompt_bits_follow_the_decode_rule():
    """A prompt compressed to C slots: the bits seeded for the last prompt query equal those observe() records
    when that query attends to the cache as a decode step does, so a prompt token and a decoded token with the
    same share of the cache's attention get the same bit (judging the prompt against 1 / (j + 1) over the
    whole prompt did not)."""
    S, C, history = 40, 12, 16
    args = tiny_args(n_layers=1, n_heads=H_KV * G, n_kv_heads=H_KV, head_dim=D)
    for reduce in ("mean", "max"):
        cache = make_cache_factory("scissorhands", B, args, S, 8, budget=C, recent_window=3,
                                   history_window=history, drop_interval=4, obs_window=4, pool_kernel=3,
                                   gqa_reduce=reduce)(0)
        q, k, v = random_qkv(S, 9)
        cache.prefill(q, k, v)
        seeded = cache.low_bits.clone()
        column = ((seeded[..., (S - 1) % history // 8] >> (S - 1) % history % 8) & 1).bool()  # [B, H_kv, C]
        assert column.any() and not column.all()
        k_all, v_all = cache.keys_values()
        _, probs = attend(q[:, :, S - 1:], k_all, v_all, (cache.slot_pos >= 0).unsqueeze(2), want_probs=True)
        cache.observe(probs)  # seen == S: rewrites the ring column of step S - 1, the last prompt query's
        assert torch.equal(cache.low_bits, seeded)


# ---- H2O -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("normalize", [False, True])
def test_h2o_matches_slow_reference(normalize):
    C, recent, S = 10, 3, 16
    args = tiny_args(n_layers=1, n_heads=H_KV * G, n_kv_heads=H_KV, head_dim=D)
    factory = make_cache_factory("h2o", B, args, S, 30, budget=C, recent_window=recent,
                                 h2o_normalize=normalize)
    cache = factory(0)
    q, k, v = random_qkv(S, 2)
    cache.prefill(q, k, v)
    prompt = dense_attention(q, k)  # [B, H_kv, g, S, S]
    # per token: accumulated attention of each query head (every prompt query, then every decode query)
    acc = {(b, h): {i: prompt[b, h, :, :, i].sum(dim=1).tolist() for i in positions(cache, b, h)}
           for b in range(B) for h in range(H_KV)}
    for t, probs, _ in decode_trace(cache, S, 30, 3):
        for (b, h), scores in acc.items():
            def score(i, scores=scores, t=t):
                value = sum(scores[i]) / G
                return value / (t - i) if normalize else value
            evictable = [i for i in scores if i <= t - recent]
            if len(scores) == C:
                del scores[min(evictable, key=score)]
            scores[t] = [0.0] * G
            for c, p in enumerate(cache.slot_pos[b, h].tolist()):
                scores[p] = [s + probs[b, h, j, 0, c].item() for j, s in enumerate(scores[p])]
            assert positions(cache, b, h) == set(scores), f"step {t}: kept sets differ"


# ---- TOVA ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("S,n_sinks,recent", [(20, 0, 1), (20, 2, 3), (5, 0, 1)])  # compressed / fits
def test_tova_matches_slow_reference(S, n_sinks, recent):
    """TOVA as stated, over token positions, one kept set per row shared by the layer's KV heads: a token's
    score is the newest query's attention to it averaged over every query head of the layer (after prefill:
    the last prompt query's, over the whole prompt). The prompt keeps its top-C tokens, the sinks and the last
    recent - 1 forced in; each decode step, if the cache is full, the evictable token (not a sink, older than
    the recent window) with the lowest score leaves before the new token enters."""
    C, steps = 8, 25
    args = tiny_args(n_layers=1, n_heads=H_KV * G, n_kv_heads=H_KV, head_dim=D)
    cache = make_cache_factory("tova", B, args, S, steps, budget=C, n_sinks=n_sinks, recent_window=recent)(0)
    q, k, v = random_qkv(S, 12)
    cache.prefill(q, k, v)
    last = dense_attention(q, k)[:, :, :, -1].mean(dim=(1, 2)).tolist()  # [B][S]: every head of the layer
    kept = []
    for b in range(B):
        protected = {i for i in range(S) if i < n_sinks or i >= S - (recent - 1)}
        rest = sorted((i for i in range(S) if i not in protected), key=lambda i, b=b: -last[b][i])
        chosen = range(S) if S <= C else protected | set(rest[: C - len(protected)])
        kept.append({i: last[b][i] for i in chosen})
        assert all(positions(cache, b, h) == set(kept[b]) for h in range(H_KV))
    for t, probs, _ in decode_trace(cache, S, steps, 13):
        for b, scores in enumerate(kept):
            if len(scores) == C:
                evictable = [i for i in scores if n_sinks <= i <= t - recent]
                del scores[min(evictable, key=scores.get)]
            scores[t] = None
            assert all(positions(cache, b, h) == set(scores) for h in range(H_KV)), f"step {t}: sets differ"
            attention = {i: [] for i in scores}  # every query head's attention to each token
            for h in range(H_KV):
                for c, p in enumerate(cache.slot_pos[b, h].tolist()):
                    if p >= 0:
                        attention[p] += probs[b, h, :, 0, c].tolist()
            scores.update({i: sum(a) / len(a) for i, a in attention.items()})
    assert set(kept[0]) != set(kept[1])


# ---- KNorm -----------------------------------------------------------------------------------------------
def fp16(x: float) -> float:
    """x rounded to the nearest IEEE half-precision value (ties to even)."""
    return struct.unpack("e", struct.pack("e", x))[0]


@pytest.mark.parametrize("S,n_sinks,recent", [(20, 0, 1), (20, 2, 3), (5, 1, 2)])  # compressed / fits
def test_knorm_matches_slow_reference(S, n_sinks, recent):
    """KNorm as stated, over token positions, per KV head: a key's norm is its L2 norm rounded to fp16, so
    norms that agree to fp16 precision tie. The prompt keeps the C lowest (ties: the newer token), the sinks
    and the last recent - 1 forced in; each decode step, if the cache is full, the evictable token (not a
    sink, older than the recent window) with the highest leaves (ties: the older) before the new token
    enters. Keys come from a small pool, so exact ties are frequent, and one pool key is another scaled by
    1 + 2^-13: different in fp32, equal in fp16."""
    C, steps = 8, 30
    gen = torch.Generator().manual_seed(14)
    pool = torch.randn(5, D, generator=gen)
    pool[0] *= 2 / pool[0].norm()
    pool[1] = pool[0] * (1 + 2 ** -13)
    norms = pool.norm(dim=-1).tolist()
    assert norms[0] != norms[1] and fp16(norms[0]) == fp16(norms[1])

    def keys(n):
        return pool[torch.randint(0, len(pool), (B, H_KV, n), generator=gen)]  # [B, H_kv, n, D]

    args = tiny_args(n_layers=1, n_heads=H_KV * G, n_kv_heads=H_KV, head_dim=D)
    cache = make_cache_factory("knorm", B, args, S, steps, budget=C, n_sinks=n_sinks, recent_window=recent)(0)
    k = keys(S)
    cache.prefill(torch.randn(B, H_KV * G, S, D, generator=gen), k, torch.randn(B, H_KV, S, D, generator=gen))
    norm = [[dict(enumerate(fp16(x) for x in k[b, h].norm(dim=-1).tolist())) for h in range(H_KV)]
            for b in range(B)]
    kept = {}
    for b in range(B):
        for h in range(H_KV):
            protected = {i for i in range(S) if i < n_sinks or i >= S - (recent - 1)}
            rest = sorted((i for i in range(S) if i not in protected), key=lambda i, n=norm[b][h]: (n[i], -i))
            kept[b, h] = set(range(S)) if S <= C else protected | set(rest[: C - len(protected)])
            assert positions(cache, b, h) == kept[b, h]
    for t in range(S, S + steps):
        k_new = keys(1)
        cache.update(torch.tensor([t]), k_new, torch.randn(B, H_KV, 1, D, generator=gen))
        for (b, h), tokens in kept.items():
            n = norm[b][h]
            n[t] = fp16(k_new[b, h, 0].norm().item())
            if len(tokens) == C:
                evictable = [i for i in tokens if n_sinks <= i <= t - recent]
                tokens.remove(max(evictable, key=lambda i, n=n: (n[i], -i)))
            tokens.add(t)
            assert positions(cache, b, h) == tokens, f"step {t}: kept sets differ"


# ---- SnapKV ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pool,kernel,reduce", [("max", 3, "mean"), ("avg", 5, "max"), ("max", 1, "max")])
def test_snapkv_selection_equals_brute_force(pool, kernel, reduce):
    S, w, n, n_sinks = 30, 5, 14, 1
    q, k, _ = random_qkv(S, 4)
    compressor = PROMPT_COMPRESSORS["snapkv"](obs_window=w, pool_kernel=kernel, pool=pool, gqa_reduce=reduce)
    kept = compressor.select(q, k, n, n_sinks=n_sinks, recent_window=1)
    votes = dense_attention(q, k)[:, :, :, S - w:, : S - w].sum(dim=3).tolist()  # [B, H_kv, g, S - w]
    for b in range(B):
        for h in range(H_KV):
            pooled = []
            for j in range(G):
                row = votes[b][h][j]
                near = [row[max(0, i - kernel // 2): i + kernel // 2 + 1] for i in range(S - w)]
                pooled.append([max(x) if pool == "max" else sum(x) / kernel for x in near])
            score = [(sum(col) / G if reduce == "mean" else max(col)) for col in zip(*pooled, strict=True)]
            protected = set(range(n_sinks)) | set(range(S - w, S))
            rest = sorted((i for i in range(S - w) if i not in protected), key=lambda i: -score[i])
            assert set(kept[b, h].tolist()) == protected | set(rest[: n - len(protected)])


# ---- blockwise statistics ----------------------------------------------------------------------------------
def test_blockwise_prompt_statistics_equal_dense(monkeypatch):
    S = 23
    q, k, _ = random_qkv(S, 5)
    dense = dense_attention(q, k)
    rows_seen = []
    original = prompt_stats.attention_rows

    def spy(q, k, start, stop, key_pos=None):
        rows_seen.append(stop - start)
        return original(q, k, start, stop, key_pos)

    monkeypatch.setattr(prompt_stats, "attention_rows", spy)
    monkeypatch.setattr(prompt_stats, "PREFILL_BLOCK_ELEMENTS", B * H_KV * G * S * 4)  # 4 rows at a time
    # on CPU: two flash-attention passes, not one row of probabilities in memory
    torch.testing.assert_close(prompt_stats.column_sums(q, k), dense.sum(dim=3))
    assert rows_seen == []
    torch.testing.assert_close(prompt_stats.column_sums(q, k, block_rows=4), dense.sum(dim=3))
    assert max(rows_seen) == 4, "column sums must be computed in query blocks, never S x S at once"
    gen = torch.Generator().manual_seed(11)
    for block in (1, 3, 7):
        torch.testing.assert_close(prompt_stats.column_sums(q, k, block_rows=block), dense.sum(dim=3))
        low = prompt_stats.low_attention(q, k, 9, "max", block_rows=block)
        j = torch.arange(S - 9, S).view(-1, 1)
        expected = (dense.amax(dim=2)[:, :, S - 9:] < 1.0 / (j + 1)) & (torch.arange(S) <= j)
        assert torch.equal(low, expected)
        # over a kept subset: each query head's attention renormalised over the kept tokens it sees
        keep = torch.stack([torch.randperm(S, generator=gen)[:10].sort().values for _ in range(B * H_KV)])
        keep = keep.view(B, H_KV, 10)
        low = prompt_stats.low_attention(q, k, 9, "mean", keep, block_rows=block)
        sub = dense[:, :, :, S - 9:].gather(-1, keep[:, :, None, None].expand(B, H_KV, G, 9, 10))
        visible = keep.unsqueeze(2) <= j  # [B, H_kv, 9, n]
        shares = (sub / sub.sum(-1, keepdim=True)).mean(dim=2)
        assert torch.equal(low, (shares < 1.0 / visible.sum(-1, keepdim=True)) & visible)
    torch.testing.assert_close(prompt_stats.window_votes(q, k, 6), dense[:, :, :, S - 6:].sum(dim=3))
    torch.testing.assert_close(prompt_stats.last_query_attention(q, k), dense[:, :, :, -1])


def test_memo_reuses_prompt_statistics():
    """A caller that prefills once and tries several budgets computes the statistics once."""
    q, k, v = random_qkv(30, 6)
    args = tiny_args(n_layers=1, n_heads=H_KV * G, n_kv_heads=H_KV, head_dim=D)
    memo = {}
    kept = []
    for budget in (12, 16):
        cache = make_cache_factory("h2o", B, args, 30, 4, budget=budget)(0)
        cache.prefill(q, k, v, memo=memo)
        kept.append(cache.kept())
        fresh = make_cache_factory("h2o", B, args, 30, 4, budget=budget)(0)
        fresh.prefill(q, k, v)
        assert torch.equal(fresh.slot_pos, cache.slot_pos) and torch.equal(fresh.acc, cache.acc)
    assert ("column_sums",) in memo and (kept[0] == 12).all() and (kept[1] == 16).all()


# ---- budgets and per-layer sets ----------------------------------------------------------------------------
def factory_pyramid_kept(B, w, L, n_layers, layer, beta=20):
    """Tokens KVCache-Factory's PyramidKVCluster.update_kv keeps in `layer` for a prompt of L tokens
    (pyramidkv/pyramidkv_utils.py at c97f9d706d63d1b56e980f8b81b2a924c21162b3, transcribed line by line)."""
    min_num = (B - w) // beta
    max_num = (B - w) * 2 - min_num
    if max_num >= L - w:
        max_num = L - w
        min_num = (B - w) * 2 - max_num
    steps = (max_num - min_num) // (n_layers - 1)
    max_capacity_prompt = max_num - layer * steps
    if L < B:
        return L
    elif L < (B - w) * 2:
        return B - w + w
    return max_capacity_prompt + w


def test_pyramid_layer_budgets_follow_pyramidkv():
    # B = 128, w = 8: the reference ramps only from L = 2 (B - w) = 240 on
    assert layer_capacities("pyramid", 128, 4, 8, 239, beta=20) == [128] * 4
    assert layer_capacities("pyramid", 128, 4, 8, 1000, beta=20) == [242, 166, 90, 14]
    assert layer_capacities("funnel", 128, 4, 8, 1000, beta=20) == [14, 90, 166, 242]
    assert layer_capacities("uniform", 128, 4, 8, 1000) == [128] * 4
    # just past the threshold, max clamps to L - w and min absorbs the rest
    assert layer_capacities("pyramid", 128, 3, 8, 240, beta=20) == [240, 128, 16]
    assert layer_capacities("pyramid", 128, 4, 8, 100, beta=20) == [128] * 4  # L < B: nothing to compress
    caps = layer_capacities("pyramid", 300, 30, 32, 4000)
    assert caps == sorted(caps, reverse=True) and 300 * 30 <= sum(caps) < 300 * 30 + 30 * 30
    # every length on both sides of L = B and L = 2 (B - w), against the transcribed reference
    for B, w, n_layers, beta in ((128, 8, 4, 20), (40, 32, 3, 20), (300, 32, 30, 20), (64, 8, 5, 3)):
        for L in range(B - 3, 2 * (B - w) + 60):
            caps = layer_capacities("pyramid", B, n_layers, w, L, beta=beta)
            assert [min(c, L) for c in caps] == [factory_pyramid_kept(B, w, L, n_layers, i, beta)
                                                 for i in range(n_layers)], (B, w, L)


def test_pyramidkv_factory_uses_pyramid_layer_budgets():
    factory = make_cache_factory("pyramidkv", 1, tiny_args(n_layers=4), 500, 20, budget=148, obs_window=8)
    assert factory.layer_budget == "pyramid"
    assert factory.prompt_capacities == layer_capacities("pyramid", 128, 4, 8, 500)
    assert factory.capacities == [c + 20 for c in factory.prompt_capacities]


def test_tova_keeps_one_set_per_layer():
    args = tiny_args(n_layers=1, n_heads=H_KV * G, n_kv_heads=H_KV, head_dim=D)
    cache = make_cache_factory("tova", B, args, 20, 25, budget=8)(0)
    q, k, v = random_qkv(20, 7)
    cache.prefill(q, k, v)
    for _ in decode_trace(cache, 20, 25, 8):
        assert all(positions(cache, b, 0) == positions(cache, b, h) for b in range(B) for h in range(H_KV))
    assert positions(cache, 0, 0) != positions(cache, 1, 0)
