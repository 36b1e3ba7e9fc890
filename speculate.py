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
The rounds run in Decoder.decode's loop (decode.Rounds): its scheduled step drafts (refreshing the draft cache
on its interval), its guard state lets the draft steps, verifications and hand-overs skip dynamo's cache lookup
after a decode call's first two rounds (~1 ms a call with both caches installed), its stop checks end the call.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from decode import DecodeCall, Decoder, logits_to_probs, run_block, specialized
from kv.contract import AttentionCache
from model import KVFastError, Transformer


class Prefill(AttentionCache):
    """Stands in for a layer's cache during the prompt: both caches keep the prompt from one forward pass."""

    def __init__(self, target: nn.Module, draft: nn.Module):
        super().__init__()
        self.target, self.draft = target, draft

    def prefill(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        self.target.prefill(q, k, v)
        self.draft.prefill(q, k, v)


def verify_tokens(model: Transformer, tokens: Tensor, input_pos: Tensor, run_block=None) -> Tensor:
    """The full cache's logits [B, K+1, V] for tokens [B, K+1] at positions input_pos [K+1]; run_block runs each
    layer (--compile-scope block)."""
    return model(tokens, input_pos, all_logits=True, run_block=run_block)


VERIFY = {False: verify_tokens, True: specialized(verify_tokens, run_block=run_block)}  # by block scope


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
    """Both caches per layer, the Decoder (its step drafts) and the compiled verification: the rounds
    (decode.Rounds) that Decoder.decode runs."""

    stop_every = 1  # a round decides several tokens: check after each

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
        self.verify = decoder.compiled(VERIFY[decoder.scope == "block"])
        self.absorb = decoder.compiled(absorb_token)
        # keys stored before RoPE in either cache: the full cache's K/V do not fit the draft's; it decodes dK
        self.absorbs = not any(c.pos_shift for c in (*self.target, *draft_caches))
        self.rounds = self.drafted = self.accepted = 0

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

    def draft_tokens(self, x: Tensor, pos: int, input_pos: Tensor, call: DecodeCall) -> tuple[Tensor, Tensor | None]:
        """K draft tokens [K] after x [1, 1] at pos, and (sampling) the distributions they came from [K, V]."""
        self.use(self.draft)
        schedule = self.decoder.schedule()  # the draft cache's refresh
        drafts, probs = [], []
        for i in range(self.k):
            x, logits = self.decoder.step(x, pos + i, input_pos, call, role="draft", schedule=schedule)
            drafts.append(x)
            if call.temperature > 0:
                probs.append(logits_to_probs(logits[0, -1], call.temperature, call.top_k))
            input_pos = input_pos + 1
        self.use(self.target)
        return torch.cat(drafts, 1)[0], torch.stack(probs) if probs else None

    def round(self, x: Tensor, pos: int, input_pos: Tensor, call: DecodeCall) -> tuple[Tensor, Tensor, None]:
        """One draft-and-verify round from x [1, 1] at pos: the n + 1 tokens it decides [1, n + 1], the last
        as the next input. The warm-up hands a token over whatever was accepted, to compile absorb_token."""
        drafts, draft_probs = self.draft_tokens(x, pos, input_pos, call)
        chunk = torch.cat([x[0], drafts]).view(1, -1)
        positions = torch.arange(pos, pos + self.k + 1, device=x.device)
        logits = call.run("verify", self.verify, self.model, chunk, positions)[0]
        n, following = accept(drafts, draft_probs, logits, call.temperature, call.top_k)
        for cache in (*self.target, *self.draft):
            cache.truncate(pos + n + 1)
        if n == self.k or (call.warm and self.absorbs):  # the draft has not read its own last token
            last = torch.tensor([pos + self.k if n == self.k else pos], device=x.device)
            if self.absorbs:
                call.run("absorb", self.absorb, self.target, self.draft, last)
            else:
                self.use(self.draft)
                call.run("catch-up", self.decoder.steps[False], self.model, drafts[-1].view(1, 1), last,
                         call.temperature, call.top_k)
                self.use(self.target)
        self.rounds += 1
        call.passed += 1
        self.drafted += self.k
        self.accepted += n
        return (torch.tensor([[*drafts[:n].tolist(), following]], device=x.device),
                torch.tensor([[following]], device=x.device), None)

    def decode(self, x: Tensor, start_pos: int, n: int, temperature: float = 0.0, top_k: int | None = None,
               stop_ids: set[int] | None = None) -> Tensor:
        """Up to n tokens after x [1, 1] at start_pos, through Decoder.decode's loop: [1, <=n]."""
        return self.decoder.decode(x, start_pos, n, temperature, top_k, stop_ids, rounds=self)

    def warm_up(self, idx: Tensor, temperature: float = 0.0, top_k: int | None = None) -> tuple[int, int]:
        """Decoder.warm_up for one round: the draft steps, the verification and the draft's take of dK
        (absorb_token). Returns (draft steps, refreshes)."""
        return self.decoder.warm_up(idx, temperature, top_k, steps=1, rounds=self)

    def report(self) -> str:
        rate = self.accepted / max(self.drafted, 1)
        per_round = (self.accepted + self.rounds) / max(self.rounds, 1)
        return (f"speculate: {self.k} drafts per round through {self.draft[0].name} "
                f"({self.draft[0].capacity} slots per layer): {self.rounds} rounds, {self.accepted} of "
                f"{self.drafted} drafts accepted ({100 * rate:.0f} %), {per_round:.2f} tokens per verification")
