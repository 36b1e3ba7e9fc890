"""FastGen on the pool (kv.pool): each KV head profiled at prefill, keeping only what its attention needs.

FastGen (Ge et al., ICLR 2024, arXiv:2310.01801) tries, per head and in order of cost, the hybrid policies
special tokens < + punctuation < + frequent (heavy hitters) < + local (recent) < full, and keeps the first whose
kept tokens recover at least T of the head's attention on the prompt (T = 0.95). The paper's code is not
public; this follows the community reproduction it points to (cold-compress's KVCacheFastGen: recovery =
attention mass on the kept tokens averaged over the prompt's queries; r_f = r_l = 0.3 of the prompt; 4 global
tokens always kept), on a pool of fixed size. Decisions, each a deviation or a choice where the paper is silent:

Profile. The recovery of a candidate set is measured on the observation window (SnapKV's last w = obs_window
prompt queries, memoized votes, group-reduced over the KV head's query heads by gqa_reduce) instead of every
prompt query: O(w S) instead of the S x S attention the paper profiles (its pitfall 1). Heavy hitters are the
prompt compressor's top tokens (default SnapKV, whose pooling keeps a needle's neighbouring tokens with it: on raw
votes a 5-digit pass key lost digits and query-aware passkey scored 0 of 30 at 25 %), as hybrid's static heads. "Local" is then the
last local_ratio x S prompt tokens. Special = the first n_sinks tokens and the tokenizer's special ids (BOS,
chat markers); punctuation = ids whose text is only punctuation (token_classes). Without a tokenizer (tests,
bench) only the sinks are special and no id is punctuation, so the punctuation profile equals the special one.

Every head also keeps, at prefill, the prompt's sinks and last max(obs window, recent_window - 1) tokens, as
every pool policy does (the question of a prompt usually sits there), and counts them in its demand.

Memory. FastGen's heads hold as many tokens as their profile keeps; here the layer's pool is P slots whatever
the split (GQA, per KV head). A head demands its profile's tokens + 1 slot for the newest token (full: the
whole prompt); the pool is water-filled: if the demands exceed P, every head gets min(demand, level) with the
level that fills P; if they fall short, the rest goes evenly to the heads whose profile grows with slots
(frequent, local, full), then to any (a head holds at most the prompt's S tokens). A prompt that fits the even split keeps it (as hybrid does); the profile
then only decides what each head evicts first. Budgets are fixed for the sequence: every head evicts its own.

Decode (compiled, static shapes), per head by its profile: special tokens, and punctuation for a profile that
keeps it, are evicted last; heads with frequent keep heavy hitters (accumulated attention: the window's votes
for prompt tokens, decode attention added every step, new tokens start at 0); for special / punctuation heads a
token of another class is evicted first (FastGen: it is not kept). Deviation: every head protects the recent
window (recent_window, 32), not only local and full ones: with FastGen's profiles as they are, a heavy-hitter
head evicts a new token before it can gather attention, and perplexity over 512 tokens of the Jargon File at 50 %
read 54.25 against 43.78 with the window protected (full 43.01, hybrid 43.91, h2o 43.32). No tiers (not built
for this policy).
"""

from __future__ import annotations

import functools
import string
import unicodedata
from typing import Any

import torch
from torch import Tensor

from kv.hybrid import PROTECTED, HybridCache
from kv.params import GQA_REDUCE, N_SINKS, RECENT_WINDOW, Param, fraction
from kv.prompt import OBS_WINDOW
from kv.storage import put_rows

PROFILES = ("special", "punct", "frequent", "local", "full")
SPECIAL, PUNCT, FREQUENT, LOCAL, FULL = range(len(PROFILES))
OTHER_TOKEN, PUNCT_TOKEN, SPECIAL_TOKEN = 0, 1, 2
KEPT_CLASS = 1e6  # added to the score of a token its head's profile keeps by class: evicted after every other


def is_punctuation(text: str) -> bool:
    """A token's text made of punctuation (and spaces) only."""
    text = text.strip()
    return bool(text) and all(c in string.punctuation or unicodedata.category(c).startswith("P") for c in text)


@functools.cache  # one table per tokenizer, whatever the number of layers and caches
def token_classes(tokenizer: Any, vocab_size: int) -> Tensor:
    """[vocab_size] uint8 per id: SPECIAL_TOKEN for the tokenizer's special ids, PUNCT_TOKEN for ids whose text
    is punctuation, OTHER_TOKEN otherwise (ids the tokenizer does not know included)."""
    classes = torch.zeros(vocab_size, dtype=torch.uint8)
    special = set(tokenizer.special_tokens.values()) | ({tokenizer.bos_id} - {None})
    for i in range(min(vocab_size, tokenizer.vocab_size)):
        if i in special:
            classes[i] = SPECIAL_TOKEN
        elif is_punctuation(tokenizer.decode([i])):
            classes[i] = PUNCT_TOKEN
    return classes


def profile_masks(heavy: Tensor, classes: Tensor, n_sinks: int, n_heavy: int, n_local: int) -> Tensor:
    """[B, H, 5, S] bool: the prompt tokens each of FastGen's hybrid profiles keeps, per KV head, from
    heavy-hitter scores [B, H, S] (the top n_heavy) and the prompt's token classes [B, S]."""
    B, H, S = heavy.shape
    pos = torch.arange(S, device=heavy.device)
    special = ((pos < n_sinks) | (classes == SPECIAL_TOKEN)).unsqueeze(1).expand(B, H, S)
    punct = special | (classes == PUNCT_TOKEN).unsqueeze(1)
    top = heavy.topk(min(n_heavy, S), dim=-1).indices
    frequent = punct.scatter(-1, top, True)
    local = frequent | (pos >= S - n_local)
    return torch.stack([special, punct, frequent, local, torch.ones_like(local)], dim=2)


def choose_profiles(votes: Tensor, masks: Tensor, recovery: float) -> tuple[Tensor, Tensor]:
    """(profile [B, H] long: the cheapest whose tokens hold >= recovery of the votes, recovered [B, 5] share
    each profile holds). A head with no votes (a prompt shorter than the window has them all) recovers 1."""
    total = votes.sum(-1, keepdim=True)
    recovered = torch.where(total > 0, (votes.unsqueeze(2) * masks).sum(-1) / total.clamp(min=1e-30), 1.0)
    enough = recovered >= recovery
    enough[..., FULL] = True
    return enough.long().argmax(-1), recovered


def water_fill(demand: list[int], pool: int, grows: list[bool], ceiling: int) -> list[int]:
    """Per-head budgets summing to `pool` (at most H x ceiling), each at most `ceiling` (demands included):
    min(demand, level) for the level that fills the pool when the demands exceed it; else each its demand and
    the rest evenly (largest remainders to the lower heads) to the heads that `grow`, then to any head below
    the ceiling."""
    H = len(demand)
    if sum(demand) >= pool:
        budget, left, heads = [0] * H, pool, sorted(range(H), key=lambda h: (demand[h], h))
        for i, h in enumerate(heads):
            budget[h] = min(demand[h], left // (H - i))
            left -= budget[h]
        # integer shares leave at most H - 1 slots: to the unsatisfied heads, lower heads first
        for h in range(H):
            if left and budget[h] < demand[h]:
                budget[h] += 1
                left -= 1
        return budget
    budget, left = list(demand), pool - sum(demand)
    for group in ([h for h in range(H) if grows[h]], list(range(H))):
        while left:
            room = [h for h in group if budget[h] < ceiling]
            if not room:
                break
            share, rest = divmod(left, len(room))
            for i, h in enumerate(room):
                add = min(share + (i < rest), ceiling - budget[h])
                budget[h] += add
                left -= add
    return budget


class FastGenCache(HybridCache):
    """FastGen (Ge et al., arXiv:2310.01801): per KV head the cheapest profile recovering T of its attention."""

    name = "fastgen"
    needs_attention = True
    supports_tiers = False
    params = (N_SINKS(4), RECENT_WINDOW(32), OBS_WINDOW, GQA_REDUCE,
              Param("recovery", 0.95, "each KV head keeps the cheapest profile (special < punctuation < "
                    "heavy hitters < recent < full) holding this share of the window's attention",
                    check=fraction),
              Param("heavy_ratio", 0.3, "heavy hitters of the frequent profile, a share of the prompt",
                    check=fraction),
              Param("local_ratio", 0.3, "recent tokens of the local profile, a share of the prompt",
                    check=fraction))
    default_prompt_compressor = "snapkv"
    head_kinds = PROFILES
    head_letters = "SPHLF"  # special, punct, heavy hitters (frequent), local, full
    token_class_table: Tensor | None = None  # [vocab] uint8, set by the factory from the tokenizer (bind)
    prompt_classes: Tensor | None = None  # [B, S] classes of the prompt being prefilled (see_tokens)

    def init_state(self) -> None:
        B, H = self.batch_size, self.n_kv_heads
        self.add_state("score", (B, self.pool_size))
        self.add_state("profile", (B, H), torch.long, fill=FULL)
        self.add_state("budget", (B, H), torch.long, fill=self.policy_capacity)
        self.add_state("recovered", (B, H), torch.float64)
        self.add_state("slot_class", (B, self.pool_size), torch.uint8)
        self.add_state("new_class", (B,), torch.uint8)

    @property
    def head_floor(self) -> int:
        return min(self.n_sinks + 1, self.policy_capacity)

    def bind(self, tokenizer: Any) -> None:
        vocab_size = self.model_args.vocab_size if self.model_args is not None else tokenizer.vocab_size
        self.bind_classes(token_classes(tokenizer, vocab_size))  # one table (cached) for every layer

    def bind_classes(self, classes: Tensor) -> None:
        self.token_class_table = classes.to(self.device)

    def see_tokens(self, idx: Tensor) -> None:
        """The ids [B, S] the model is about to feed (Transformer.hidden): a prompt's classes for the profile,
        the new token's for its slot."""
        table = self.token_class_table
        classes = table[idx] if table is not None else torch.zeros_like(idx, dtype=torch.uint8)
        self.new_class.copy_(classes[:, -1])
        if not torch.compiler.is_compiling():
            self.prompt_classes = classes

    def classes_for(self, S: int) -> Tensor:
        c = self.prompt_classes
        if c is None or c.shape[-1] != S:  # no ids seen (bench's synthetic prefill): positions only
            return torch.zeros(self.batch_size, S, dtype=torch.uint8, device=self.device)
        return c.to(self.device)

    # ---- prefill -------------------------------------------------------------------------------------
    def heavy_scores(self, q: Tensor, k: Tensor, memo: dict, v: Tensor | None = None) -> Tensor:
        """[B, H_kv, S] >= 0: which prompt tokens are heavy hitters, the prompt compressor's scores (SnapKV's
        pooled window votes: a needle's neighbours come with it) when it compresses the prompt, else the
        window's votes (a prompt that fits keeps every token; the profile then only rules decoding)."""
        B, H, S, _ = k.shape
        if self.compressor is None or S <= self.prompt_capacity:
            return self.votes(q, k, memo).double()
        return self.compressor.cached_scores(q, k, memo, v).double().expand(B, H, S).clamp(min=0)

    def classify(self, q: Tensor, k: Tensor, memo: dict) -> None:
        S = k.shape[2]
        votes = self.votes(q, k, memo).double()
        classes = self.classes_for(S)
        masks = profile_masks(self.heavy_scores(q, k, memo), classes, self.n_sinks, round(self.heavy_ratio * S),
                              round(self.local_ratio * S))
        profile, recovered = choose_profiles(votes, masks, self.recovery)
        self.profile.copy_(profile)
        self.recovered.copy_(recovered.gather(-1, profile.unsqueeze(-1)).squeeze(-1))
        self.masks = masks.gather(2, profile.view(*profile.shape, 1, 1).expand(-1, -1, 1, S)).squeeze(2)
        if S <= self.prompt_capacity:
            self.budget.fill_(self.policy_capacity)
            return
        pos = torch.arange(S, device=votes.device)
        kept = self.masks | (pos < self.n_sinks) | (pos >= S - self.protected_prompt())
        demand = (kept.sum(-1) + 1).clamp(max=S).tolist()
        grows = (profile >= FREQUENT).tolist()
        budgets = [water_fill(d, self.policy_pool, g, S) for d, g in zip(demand, grows)]
        self.budget.copy_(torch.tensor(budgets, device=self.device))

    def select_pairs(self, q: Tensor, k: Tensor, v: Tensor, memo: dict) -> tuple[Tensor, Tensor]:
        S = k.shape[2]
        heavy = self.heavy_scores(q, k, memo, v)  # memoized: classify reads the same scores
        self.classify(q, k, memo)
        share = heavy / heavy.sum(-1, keepdim=True).clamp(min=1e-30)  # in [0, 1]: the profile's set comes first
        pos = torch.arange(S, device=k.device)
        protected = (pos < self.n_sinks) | (pos >= S - self.protected_prompt())
        key = share + 2.0 * self.masks + 4.0 * protected  # the protected tokens first, then the profile's
        order = key.sort(dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(-1, order, pos.expand_as(order))
        return rank < self.budget.unsqueeze(-1), heavy

    def prefill_state(self, q: Tensor, k: Tensor, prior: Tensor | None, memo: dict) -> None:
        super().prefill_state(q, k, prior, memo)  # classifies a prompt that fitted; seeds the scores
        classes = self.classes_for(k.shape[2])
        self.slot_class.copy_(classes.gather(1, self.slot_pos.clamp(min=0)).masked_fill(self.slot_pos < 0, 0))
        self.masks = None

    # ---- decode --------------------------------------------------------------------------------------
    def slot_scores(self, input_pos: Tensor) -> Tensor:
        profile = self.profile.gather(1, self.slot_head)
        cls = self.slot_class
        by_class = (cls == SPECIAL_TOKEN) | ((cls == PUNCT_TOKEN) & (profile >= PUNCT))
        score = torch.where(profile >= FREQUENT, self.score, -1.0)  # special / punct heads keep nothing else
        return torch.where(by_class, KEPT_CLASS + self.score, score).clamp(max=PROTECTED)

    def on_insert(self, slot: Tensor, k: Tensor, input_pos: Tensor) -> None:
        super().on_insert(slot, k, input_pos)
        put_rows(self.slot_class, slot, self.new_class.view(-1, 1).expand_as(slot))

    def synthetic_state(self, generator: torch.Generator | None) -> None:
        self.score.copy_(torch.rand(self.score.shape, generator=generator))
        self.profile.copy_(torch.randint(len(PROFILES), self.profile.shape, generator=generator))

    # ---- reporting (read once at the end) ----------------------------------------------------------------
    def head_classes(self) -> dict[str, Tensor]:
        """Per (row, KV head), on the host: kind (index into PROFILES), budget, recovered (share of the window's
        attention its profile held at prefill)."""
        return {"kind": self.profile.cpu(), "budget": self.budget.cpu(), "recovered": self.recovered.cpu()}
