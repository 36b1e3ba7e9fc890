"""Self-speculative decoding (--speculate K): the model drafts K tokens with a compressed cache of its own and
verifies them with its full cache in one (K + 1)-token step. MagicDec (Chen et al. 2024, arXiv:2408.11049) and
TriForce (Sun et al. 2024, arXiv:2404.11912): at long context the full cache dominates a step's bytes, so a
draft step over a small cache (--draft-cache window|h2o|..., --draft-budget) costs a fraction of a full step,
and one verification reads the full cache once for K + 1 positions.

Greedy output is token for token plain decoding's (the full cache decides every token; tested). Sampled
output follows the speculative sampling rule (Leviathan et al., ICML 2023): draft token d is kept with
probability min(1, p(d) / q(d)), a rejection samples from max(0, p - q), so tokens are distributed as plain
sampling from the full cache. One row at a time (rows would accept different counts).

A round, with x the last token (not yet in either cache) at position t:
    draft:   x, d1 .. d_{K-1} through the draft cache at t .. t+K-1  ->  d1 .. dK
    verify:  x, d1 .. dK through the full cache at t .. t+K          ->  K + 1 target distributions
    accept n drafts, then the target's own token at t+n+1 (a correction, or a bonus when n = K)
    both caches forget positions > t+n (KVCache.truncate); when n = K the draft never saw dK: it takes dK's
    K/V from the full cache (absorb_token: a copy per layer, not a draft step, which cost ~6 ms of a ~70 ms
    round at 4096 tokens with int8 weights).
The draft cache's evictions during a rejected stretch are not undone: they only change later drafts.
After a decode call's first two rounds the draft steps and verifications skip dynamo's cache lookup, as
Decoder.decode's plain steps do (~1 ms a call with both caches installed).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from compilecache import guard_free
from generate import Decoder, logits_to_probs, run_block, without_guards
from model import KVFastError, Transformer


class Prefill(nn.Module):
    """Stands in for a layer's cache during the prompt: both caches keep the prompt from one forward pass."""

    needs_attention = False

    def __init__(self, target: nn.Module, draft: nn.Module):
        super().__init__()
        self.target, self.draft = target, draft

    def prefill(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        self.target.prefill(q, k, v)
        self.draft.prefill(q, k, v)


def verify_tokens(model: Transformer, tokens: Tensor, input_pos: Tensor) -> Tensor:
    """The full cache's logits [B, K+1, V] for tokens [B, K+1] at positions input_pos [K+1]."""
    return model(tokens, input_pos, all_logits=True)


def verify_by_blocks(model: Transformer, tokens: Tensor, input_pos: Tensor) -> Tensor:
    """verify_tokens with every layer through generate.run_block (--compile-scope block)."""
    return model(tokens, input_pos, all_logits=True, run_block=run_block)


def absorb_token(target: list[nn.Module], draft: list[nn.Module], input_pos: Tensor) -> None:
    """Each layer's draft cache takes the full cache's K/V of the token at input_pos [1] as if it had decoded it
    (the full cache's are computed over every token, the draft's would be over its compressed cache)."""
    for full, compressed in zip(target, draft):
        compressed.update(input_pos, *full.token_kv(input_pos))


def accept(drafts: Tensor, draft_probs: Tensor | None, logits: Tensor, temperature: float,
           top_k: int | None) -> tuple[int, int]:
    """How many of the K drafts [K] to keep and the token that follows them, from the full cache's logits
    [K+1, V]; draft_probs [K, V] are the distributions the drafts were sampled from (None when greedy)."""
    K = drafts.shape[0]
    if temperature <= 0:
        target = logits.argmax(-1)
        n = int((drafts == target[:K]).int().cumprod(0).sum())
        return n, int(target[n])
    p = logits_to_probs(logits, temperature, top_k)
    for i in range(K):
        d = drafts[i]
        if torch.rand(()) * draft_probs[i, d] <= p[i, d]:  # accepted with probability min(1, p / q)
            continue
        residual = (p[i] - draft_probs[i]).clamp(min=0)
        return i, int(torch.multinomial(residual / residual.sum(), 1))
    return K, int(torch.multinomial(p[K], 1))


class Speculator:
    """Holds both caches per layer and the compiled draft step (the Decoder's) and verification step."""

    def __init__(self, model: Transformer, decoder: Decoder, draft_caches: list[nn.Module], k: int):
        if k < 1:
            raise KVFastError(f"--speculate must be >= 1, got {k}")
        if model.caches[0].name != "full":
            raise KVFastError(f"--speculate verifies with the full cache: use --cache full, not "
                              f"{model.caches[0].name!r}")
        if model.caches[0].batch_size != 1:
            raise KVFastError("--speculate decodes one row (rows would accept different numbers of drafts): "
                              "use --batch-size 1")
        self.model, self.decoder, self.k = model, decoder, k
        self.target, self.draft = model.caches, draft_caches
        self.verify = verify_by_blocks if decoder.scope == "block" else verify_tokens
        self.absorb = absorb_token
        if decoder.scope:  # dynamic=False: another K is another static graph, never a dynamic chunk length
            compiled = partial(torch.compile, mode=decoder.mode, fullgraph=True, dynamic=False)
            self.verify, self.absorb = compiled(self.verify), compiled(absorb_token)
        # keys stored before RoPE in either cache: the full cache's K/V do not fit the draft's; it decodes dK
        self.absorbs = not any(c.pos_shift for c in (*self.target, *draft_caches))
        self.rounds = self.drafted = self.accepted = 0
        self.guarded = 0  # rounds of this decode call run with dynamo's guards
        self.guard_free: dict[str, Callable] = {}  # then each role's guard-free call

    def use(self, caches: list[nn.Module]) -> None:
        for layer, cache in zip(self.model.layers, caches):
            layer.attention.kv_cache = cache

    def reset(self) -> None:
        for cache in (*self.target, *self.draft):
            cache.reset()
        self.rounds = self.drafted = self.accepted = 0

    def prefill(self, model: Transformer, idx: Tensor, temperature: float, top_k: int | None) -> Tensor:
        """Both caches take the prompt from one forward pass; the first token is the full cache's."""
        self.use([Prefill(t, d) for t, d in zip(self.target, self.draft)])
        try:
            return self.decoder.prefill(model, idx, temperature, top_k)
        finally:
            self.use(self.target)

    def unguarded(self, role: str, fn, *args):
        """fn(*args); once this decode call's first two rounds have passed dynamo's guards with these caches and
        shapes, without dynamo's cache lookup (compilecache.guard_free, as Decoder.decode's plain steps; the tests
        count 0 recompiles). role: which call this is (the draft step and a plain step share one function)."""
        if not (self.decoder.skip_guards and self.guarded >= 2):
            return fn(*args)
        if role not in self.guard_free:
            self.guard_free[role] = guard_free(fn, *args) or partial(without_guards, fn)
        return self.guard_free[role](*args)

    def draft_tokens(self, x: Tensor, pos: int, temperature: float, top_k: int | None
                     ) -> tuple[Tensor, Tensor | None]:
        """K draft tokens [K] after x [1, 1] at pos, and (sampling) the distributions they came from [K, V]."""
        self.use(self.draft)
        interval = self.decoder.refresh_interval()
        drafts, probs = [], []
        input_pos = torch.tensor([pos], device=x.device)
        for i in range(self.k):
            if interval and (pos + i) % interval == 0:
                self.decoder.refresh(self.model)
            x, logits = self.unguarded("draft", self.decoder.step, self.model, x, input_pos, temperature, top_k)
            x = x.clone()
            drafts.append(x)
            if temperature > 0:
                probs.append(logits_to_probs(logits[0, -1], temperature, top_k))
            input_pos = input_pos + 1
        self.use(self.target)
        return torch.cat(drafts, 1)[0], torch.stack(probs) if probs else None

    def round(self, x: Tensor, pos: int, temperature: float, top_k: int | None) -> list[int]:
        """One draft-and-verify round from x [1, 1] at pos: the n + 1 tokens it decides."""
        drafts, draft_probs = self.draft_tokens(x, pos, temperature, top_k)
        chunk = torch.cat([x[0], drafts]).view(1, -1)
        positions = torch.arange(pos, pos + self.k + 1, device=x.device)
        logits = self.unguarded("verify", self.verify, self.model, chunk, positions)[0]
        n, following = accept(drafts, draft_probs, logits, temperature, top_k)
        for cache in self.target:
            cache.truncate(pos + n + 1)
        for cache in self.draft:
            cache.truncate(pos + n + 1)
        if n == self.k:  # the draft has not read its own last token
            last = torch.tensor([pos + self.k], device=x.device)
            if self.absorbs:
                self.unguarded("absorb", self.absorb, self.target, self.draft, last)
            else:
                self.use(self.draft)
                self.unguarded("catch-up", self.decoder.step, self.model, drafts[-1].view(1, 1), last, temperature,
                               top_k)
                self.use(self.target)
        self.rounds += 1
        self.guarded += 1
        self.drafted += self.k
        self.accepted += n
        return [*drafts[:n].tolist(), following]

    def decode(self, x: Tensor, start_pos: int, n: int, temperature: float = 0.0, top_k: int | None = None,
               stop_ids: set[int] | None = None) -> Tensor:
        """Up to n tokens after x [1, 1] at start_pos, like Decoder.decode: [1, <=n]."""
        out: list[int] = []
        pos = start_pos
        self.guarded, self.guard_free = 0, {}
        while len(out) < n:
            new = self.round(x, pos, temperature, top_k)
            out.extend(new)
            pos += len(new)
            x = torch.tensor([[new[-1]]], device=x.device)
            if stop_ids and any(t in stop_ids for t in new):
                break
        return torch.tensor([out[:n]], device=x.device)

    def warm_up(self, idx: Tensor, temperature: float = 0.0, top_k: int | None = None) -> tuple[int, int]:
        """Compile the draft step and the verification on throwaway state (no prefill), as Decoder.warm_up
        does, and the draft's take of dK after a fully accepted round (absorb_token: the full cache holds the
        round's first position whatever it accepted). Returns (draft steps, refreshes)."""
        with torch.random.fork_rng(), torch.inference_mode():
            self.reset()
            S = idx.shape[1]
            self.round(idx[:, -1:].clone(memory_format=torch.contiguous_format), S, temperature, top_k)
            if self.absorbs:
                self.absorb(self.target, self.draft, torch.tensor([S], device=idx.device))
            self.reset()
        return self.k, 0

    def report(self) -> str:
        rate = self.accepted / max(self.drafted, 1)
        per_round = (self.accepted + self.rounds) / max(self.rounds, 1)
        return (f"speculate: {self.k} drafts per round through {self.draft[0].name} "
                f"({self.draft[0].capacity} slots per layer): {self.rounds} rounds, {self.accepted} of "
                f"{self.drafted} drafts accepted ({100 * rate:.0f} %), {per_round:.2f} tokens per verification")

