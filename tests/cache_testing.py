"""Helpers for the cache tests: a tiny random model, small valid hyper-parameters per policy, a decode
driver."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor, nn

from attention import prompt_attention
from cache import POLICIES, PROMPT_COMPRESSORS, CacheFactory, make_cache_factory
from decode import Decoder, prefill
from kv.pool import PoolCache
from model import ModelArgs, Transformer

# hyper-parameters small enough for sequences of a few dozen tokens (the paper defaults need thousands)
SMALL = {"n_sinks": 2, "recent_window": 4, "history_window": 16, "drop_interval": 4, "obs_window": 4,
         "pool_kernel": 3, "n_future_positions": 16, "refresh_interval": 8}


@contextmanager
def one_thread():
    """Tiny tensors on 2 shared cores: one intra-op thread is ~50x faster than oversubscribed ones.
    Test modules: `_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def single_thread_fixture():
    with one_thread():
        yield


@contextmanager
def recorded_graphs(inductor: bool = True):
    """Every graph torch.compile hands to Inductor inside the block (the list it yields), compiled as usual;
    compile modes are dropped (CPU: default). inductor=False runs each graph as traced instead: for tests whose
    claim is about dynamo's graphs, guards and recompiles (the same with any backend), not about Inductor's
    code, it skips Inductor's C++ builds, most of a cold test run."""
    from torch._inductor.compile_fx import compile_fx

    graphs, compile = [], torch.compile

    def backend(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs) if inductor else gm.forward

    def recording(fn, **kw):
        return compile(fn, backend=backend, fullgraph=kw.get("fullgraph", False), dynamic=kw.get("dynamic"))

    torch.compile = recording
    try:
        yield graphs
    finally:
        torch.compile = compile


def block_regions(graph: torch.fx.GraphModule) -> int:
    """Nested compile regions a graph holds: the TransformerBlock's distinct compiled versions (generate.run_block
    under --compile-scope block: each is traced and compiled once, then called for every layer it fits)."""
    return sum(name.startswith("subgraph") for name, _ in graph.named_children())


def tiny_args(n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2, head_dim: int = 8) -> ModelArgs:
    return ModelArgs(dim=32, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                     intermediate_size=48, vocab_size=64, max_seq_len=1024, tie_embeddings=False)


def tiny_model(seed: int = 0, **kwargs) -> Transformer:
    """Random weights at std 0.3 (untied), so greedy decoding produces varied tokens, not one repeated."""
    torch.manual_seed(seed)
    model = Transformer(tiny_args(**kwargs)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model


def used_params(policy: str, prompt_compression: str | None = None) -> set[str]:
    cls = POLICIES[policy]
    name = prompt_compression or cls.default_prompt_compressor
    return set(cls.params) | (set(PROMPT_COMPRESSORS[name].params) if name else set())


def small_params(policy: str, prompt_compression: str | None = None, **override) -> dict:
    """SMALL restricted to what the policy and its compressor use (window: capacity from the budget)."""
    used = used_params(policy, prompt_compression)
    if POLICIES[policy].window_fills_capacity:
        used.discard("recent_window")
    params = {k: v for k, v in SMALL.items() if k in used}
    params.update(override)
    return params


def budget_for(policy: str, kept: int, max_new_tokens: int) -> int | None:
    """Slots so that about `kept` prompt/context tokens stay (append-only policies add a slot per new
    token)."""
    if policy == "full":
        return None
    return kept + max_new_tokens if not POLICIES[policy].evicts else kept


def small_factory(policy: str, batch_size: int, args: ModelArgs, prompt_len: int, max_new_tokens: int,
                  kept: int = 16, **override) -> CacheFactory:
    params = small_params(policy, override.pop("prompt_compression", None), **override)
    return make_cache_factory(policy, batch_size, args, prompt_len, max_new_tokens,
                              budget=budget_for(policy, kept, max_new_tokens), **params)


def head_positions(cache) -> list[list[list[int]]]:
    """[row][KV head] -> the positions the head holds, slot order, uniform layout or pool (kv.pool)."""
    if isinstance(cache, PoolCache):
        return [[[p for p, h in zip(pos.tolist(), head.tolist()) if h == kv and p >= 0]
                 for kv in range(cache.n_kv_heads)] for pos, head in zip(cache.slot_pos, cache.slot_head)]
    return [[[p for p in head.tolist() if p >= 0] for head in row] for row in cache.slot_pos]


def within_memory(cache) -> bool:
    """No more valid slots than allocated: C per KV head, or P per row for a pool (heads share it)."""
    if isinstance(cache, PoolCache):
        return bool((cache.kept().sum(-1) <= cache.pool_size).all())
    return bool((cache.kept() <= cache.capacity).all())


def generate_tokens(model: Transformer, prompt: Tensor, n_new: int, decoder: Decoder | None = None,
                    on_logits=None) -> Tensor:
    """Greedy: reset the caches, prefill, decode n_new - 1 more tokens; [B, n_new]."""
    decoder = decoder or Decoder(model)
    for c in model.caches:
        c.reset()
    with torch.inference_mode():
        first = prefill(model, prompt, 0.0, None)
        rest = decoder.decode(first, prompt.shape[1], n_new - 1, on_logits=on_logits)
    return torch.cat([first, rest], dim=1)


def kvzip_prefill(model: Transformer, factory: CacheFactory, idx: Tensor, chunk: int) -> list[Tensor]:
    """Prefill idx through kv.kvzip into the factory's caches, check the logits are the plain prefill's, and
    return KVzip's reference scores per layer ([B, H_kv, S]) computed afresh."""
    from kv import kvzip

    with torch.inference_mode():
        plain = model(idx)
        model.setup_caches(factory)
        logits = kvzip.prefill(model, idx)
        kv, _ = kvzip.record_prefill(model, idx)
        scores = kvzip.context_scores(model, idx, kv, None, chunk=chunk)
    torch.testing.assert_close(logits, plain)
    return scores


def kept_counts_over_prompts(policy: str, **params) -> set[tuple[int, ...]]:
    """One set of caches (2 rows, prompt 20, 1,001 new tokens) reused for prompts of 20, 18 and 10 tokens
    decoded 1,000 / 40 / 40 steps: compiled == eager every time and the compiled step never recompiles.
    Returns the valid slots per (row, KV head) seen after each prompt (per-head budgets move between them)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = tiny_model()
    model.setup_caches(make_cache_factory(policy, 2, model.args, 20, 1001, **params))
    gen = torch.Generator().manual_seed(1)
    decoder = Decoder(model, compile=True)
    graphs = None

    def warm(step: int, logits: Tensor) -> None:
        nonlocal graphs
        if step == 4 and graphs is None:
            graphs = counters["stats"]["unique_graphs"]

    kept = set()
    for length, n_new in [(20, 1001), (18, 41), (10, 41)]:
        prompt = torch.randint(0, 64, (2, length), generator=gen)
        eager = generate_tokens(model, prompt, n_new)
        assert torch.equal(generate_tokens(model, prompt, n_new, decoder, on_logits=warm), eager), length
        kept |= {tuple(c.kept().flatten().tolist()) for c in model.caches}
    assert counters["stats"]["unique_graphs"] == graphs, "recompiled"
    return kept


def greedy_with_logits(model: Transformer, decoder: Decoder, prompt: Tensor, n_new: int) -> tuple[Tensor, Tensor]:
    """Greedy tokens [B, n_new] from fresh caches (the prefill's, then the decode steps') and the steps' last-position
    logits in fp32, stacked [n_new - 1, B, V]."""
    logits = []
    for c in model.caches:
        c.reset()
    with torch.inference_mode():
        first = decoder.prefill(model, prompt, 0.0, None)
        rest = decoder.decode(first, prompt.shape[1], n_new - 1,
                              on_logits=lambda i, lg: logits.append(lg[:, -1].float()))
    return torch.cat([first, rest], 1), torch.stack(logits)


def prompt_attention_of(attention: nn.Module, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """One Attention module over a prompt x [B, S, dim] at positions 0..S-1, no cache: what
    TransformerBlock.prefill computes for it in one block."""
    return attention.output(prompt_attention(*attention.project(x, cos, sin)))
