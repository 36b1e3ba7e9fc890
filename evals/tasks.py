"""Tasks for eval.py: passkey retrieval, RULER-style needles in real prose, text windows for perplexity, scoring.

Every generator is deterministic for (seed, task, length, index) and builds its prompts at the token level:
each prompt of a cell has exactly `length` tokens, split into a context (compressed in query-agnostic mode)
and a question (the second chunk), and every question of a cell has the same number of tokens, so that the
samples of a cell decode as one batch. Needles are inserted at sentence (or filler-unit) boundaries; the depth
recorded in `meta` is the exact fraction of haystack tokens before the needle.

Texts are never shipped with the repository: `scripts/fetch_data.py` (make data) downloads Debian's
jargon-text and bible-kjv(-text) packages with apt-get and unpacks them into data/.
"""

from __future__ import annotations

import gzip
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from model import KVFastError

ROOT = Path(__file__).resolve().parent.parent  # the repository
DATA_DIR = ROOT / "data"
# text sources by name: the files scripts/fetch_data.py unpacks (or writes) under data/
TEXT_SOURCES = {
    "jargon": "jargon-text/usr/share/doc/jargon-text/jargon.txt.gz",
    "kjv": "kjv.txt",
}
SHARED = "shared_context"  # several needles, each asked in turn of one compressed context (evals.shared)
RETRIEVAL_TASKS = ("passkey", "niah_single", "niah_multikey", "niah_multivalue", SHARED)
# answer tokens decoded per task (the answer is short; RULER allows more, our budget is the CPU)
ANSWER_TOKENS = {"passkey": 12, "niah_single": 16, "niah_multikey": 16, "niah_multivalue": 48, SHARED: 16}
SPLIT_MARK = "\x00KVFAST-QUESTION\x00"


class TokenizerLike(Protocol):
    bos_id: int | None

    def encode(self, text: str, bos: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class Prompt:
    """One sample: context ids (what is compressed without the question), question ids, references."""

    task: str
    length: int
    index: int
    context: list[int]
    question: list[int]
    answers: list[str]
    meta: dict[str, Any] = field(default_factory=dict)
    # shared_context: the later questions asked of the same context, each (question ids, references)
    followups: list[tuple[list[int], list[str]]] = field(default_factory=list)

    @property
    def turns(self) -> list[tuple[list[int], list[str]]]:
        """Every question asked of the context, in turn, with its references."""
        return [(self.question, self.answers), *self.followups]

    @property
    def uid(self) -> str:
        return f"{self.task}/{self.length}/{self.index}"


@dataclass
class Framing:
    """How a user message becomes tokens: raw (optional bos) or wrapped in the model's chat template.

    In chat mode the question, the end of the user turn and the assistant header form the second chunk, and the
    answer prefix starts the assistant's reply (as RULER does with chat templates)."""

    head: list[int]  # before the context: bos, or the chat template up to the user message
    tail: str  # after the question: "" raw, else the end of the user turn and the assistant header
    chat: bool = False

    @classmethod
    def make(cls, tok: TokenizerLike, chat: bool) -> Framing:
        if not chat:
            bos = getattr(tok, "add_bos", tok.bos_id is not None) and tok.bos_id is not None
            return cls([tok.bos_id] if bos else [], "", False)
        if not hasattr(tok, "chat_prompt"):
            raise KVFastError("--chat needs a tokenizer with a chat template")
        wrapped = tok.chat_prompt(SPLIT_MARK)
        if wrapped.count(SPLIT_MARK) != 1:
            raise KVFastError("the chat template does not wrap the user message once")
        before, after = wrapped.split(SPLIT_MARK)
        return cls(tok.encode(before, bos=False) if before else [], after, True)

    def question(self, tok: TokenizerLike, question: str, answer_prefix: str) -> list[int]:
        if self.chat:
            return tok.encode("\n" + question + self.tail + answer_prefix)
        return tok.encode("\n" + question + " " + answer_prefix)


# ---- scoring --------------------------------------------------------------------------------------------
def score_passkey(prediction: str, key: str) -> float:
    """Exact match of the key: the first run of digits in the prediction must be the key."""
    m = re.search(r"\d+", prediction)
    return float(m is not None and m.group(0) == key)


def string_match_all(prediction: str, references: list[str]) -> float:
    """RULER's niah metric: the fraction of references found (case-insensitive substring) in the prediction."""
    low = prediction.lower()
    return sum(ref.lower() in low for ref in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """RULER's qa metric: 1 if any reference is found in the prediction."""
    low = prediction.lower()
    return float(any(ref.lower() in low for ref in references))


def score(task: str, prediction: str, answers: list[str]) -> float:
    if task == "passkey":
        return score_passkey(prediction, answers[0])
    return string_match_all(prediction, answers)


# ---- texts ----------------------------------------------------------------------------------------------
def text_path(source: str, data_dir: Path = DATA_DIR) -> Path:
    """A named source's file under data/ (fetched on first use), or `source` itself as a file path."""
    if source not in TEXT_SOURCES:
        path = Path(source)
        if not path.is_file():
            raise KVFastError(f"text file not found: {source} (or use one of: {', '.join(TEXT_SOURCES)})")
        return path
    path = data_dir / TEXT_SOURCES[source]
    if not path.exists():
        from scripts.fetch_data import fetch

        print(f"fetching the {source!r} text with apt-get into {data_dir} (first use)...", flush=True)
        try:
            fetch(data_dir, [source])
        except (RuntimeError, OSError, ValueError) as e:  # apt, dpkg or the bible program failed
            raise KVFastError(f"cannot fetch the {source!r} text ({e}); run `make data` on a Debian system "
                              f"or pass a text file instead") from None
    return path


def read_text(path: Path) -> str:
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, gzip.BadGzipFile) as e:
        raise KVFastError(f"cannot read text {path}: {e}") from None


def clean_text(raw: str) -> str:
    """Plain prose paragraphs: wrapped lines joined, rules and table-of-contents lines dropped.

    For the Jargon File the text starts at its first chapter (the table of contents before it is a list of
    titles, not prose), and lexicon cross-reference braces {like this} are removed."""
    raw = raw.replace("\xa0", " ")
    start = raw.find("Chapter 1.")
    if start > 0:
        raw = raw[start:]
    paragraphs = []
    for block in re.split(r"\n\s*\n", raw):
        lines = [line.strip() for line in block.splitlines()]
        lines = [line for line in lines if line and not re.fullmatch(r"[\W_]+", line)]
        if not lines:
            continue
        text = re.sub(r"\s+", " ", " ".join(lines)).replace("{", "").replace("}", "")
        paragraphs.append(text)
    return "\n\n".join(paragraphs)


def load_text(source: str, data_dir: Path = DATA_DIR) -> str:
    return clean_text(read_text(text_path(source, data_dir)))


def prose_sentences(text: str, min_chars: int = 30, max_chars: int = 400) -> list[str]:
    """Sentences of the paragraphs that read as prose (long enough, ending like a sentence)."""
    out = []
    for para in text.split("\n\n"):
        if len(para) < 200 or para.startswith(":"):
            continue  # headings, lexicon headwords, short list items
        for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"“‘(])", para):
            if min_chars <= len(s) <= max_chars and s[-1] in ".!?\"”’)":
                out.append(s)
    return out


# ---- building prompts of an exact length -----------------------------------------------------------------
def rng_for(seed: int, *parts: object) -> random.Random:
    """A generator for one sample; string seeds are hashed with SHA-512, independent of PYTHONHASHSEED."""
    return random.Random("/".join(map(str, (seed,) + parts)))


def assemble(units: list[list[int]], needles: list[tuple[float, list[int]]], budget: int,
             what: str = "the prompt") -> tuple[list[int], list[float], list[int]]:
    """Haystack of exactly `budget` tokens: needle tokens inserted at the unit boundary nearest to each depth
    (fraction of haystack tokens before the needle), the last unit cut at the token level.

    Returns (tokens, actual depths, token offsets of the needles in the returned list)."""
    needle_tokens = sum(len(n) for _, n in needles)
    hay_budget = budget - needle_tokens
    if hay_budget < 16:
        raise KVFastError(f"{what} is too short: the instructions, question and needles leave "
                          f"{hay_budget} tokens of haystack")
    # take whole units, then a partial one
    hay: list[list[int]] = []
    total, i = 0, 0
    while total < hay_budget:
        unit = units[i % len(units)]
        take = unit[: hay_budget - total]
        hay.append(take)
        total += len(take)
        i += 1
    boundaries = [0]
    for unit in hay:
        boundaries.append(boundaries[-1] + len(unit))
    # needle positions: nearest boundary to depth * haystack (never after the partial last unit)
    inserts = []
    for depth, tokens in needles:
        target = depth * total
        j = min(range(len(hay)), key=lambda b: (abs(boundaries[b] - target), b))
        inserts.append((j, tokens))
    out: list[int] = []
    offsets = [0] * len(needles)
    depths = [0.0] * len(needles)
    order = sorted(range(len(needles)), key=lambda n: inserts[n][0])
    k = 0
    for j, unit in enumerate(hay):
        while k < len(order) and inserts[order[k]][0] == j:
            n = order[k]
            offsets[n] = len(out)
            depths[n] = boundaries[j] / max(total, 1)
            out.extend(inserts[n][1])
            k += 1
        out.extend(unit)
    return out, depths, offsets


# ---- passkey (Mohtashami & Jaggi, "Landmark Attention", 2023) ----------------------------------------------
PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there.")
PASSKEY_FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key?"
PASSKEY_ANSWER_PREFIX = "The pass key is"


def passkey_prompt(tok: TokenizerLike, framing: Framing, length: int, index: int, seed: int,
                   depths: list[float]) -> Prompt:
    rng = rng_for(seed, "passkey", length, index)
    key = str(rng.randint(10000, 99999))
    depth = depths[index % len(depths)]
    intro = framing.head + tok.encode(PASSKEY_INTRO)
    question = framing.question(tok, PASSKEY_QUESTION, PASSKEY_ANSWER_PREFIX)
    needle = tok.encode(PASSKEY_NEEDLE.format(key=key))
    budget = length - len(intro) - len(question)
    hay, actual, offsets = assemble([tok.encode(PASSKEY_FILLER)], [(depth, needle)], budget, f"passkey@{length}")
    return Prompt("passkey", length, index, intro + hay, question, [key],
                  {"depth": round(actual[0], 4), "requested_depth": depth, "needle_offset": len(intro) + offsets[0],
                   "needle_tokens": len(needle)})


# ---- RULER-style needles (Hsieh et al., arXiv:2404.06654, niah_single_2 / multikey_1 / multivalue) -----------
NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
              "I will quiz you about the numbers afterwards.")
NIAH_NEEDLE = " One of the special magic numbers for {key} is: {value}."
NIAH_QUESTION = "What are all the special magic numbers for {key} mentioned in the provided text?"
NIAH_ANSWER_PREFIX = "The special magic numbers for {key} mentioned in the provided text are"
ADJECTIVES = ("abrasive", "agreeable", "ancient", "bitter", "brave", "calm", "clever", "curious", "damp", "eager",
              "fancy", "fierce", "gentle", "glossy", "grumpy", "hollow", "humble", "icy", "jolly", "keen", "lively",
              "lucky", "mellow", "misty", "nimble", "noisy", "odd", "plain", "proud", "quiet", "rapid", "rusty",
              "shiny", "silent", "sleepy", "sturdy", "tame", "tidy", "vivid", "wise")
NOUNS = ("anchor", "badger", "banjo", "beacon", "blanket", "cactus", "canyon", "carpet", "castle", "cherry",
         "cobweb", "comet", "dolphin", "engine", "falcon", "feather", "garden", "harbor", "helmet", "island",
         "jacket", "kettle", "lantern", "magnet", "meadow", "mirror", "needle", "orchard", "otter", "pencil",
         "pepper", "pillow", "quarry", "rabbit", "saddle", "teapot", "tunnel", "violin", "walrus", "whistle")
NIAH_NEEDLES = {"niah_single": (1, 1), "niah_multikey": (4, 1), "niah_multivalue": (1, 4)}  # (keys, values)
SHARED_QUESTIONS = 4  # shared_context's default: needles in the context, each asked in turn (--shared-questions)

_key_cache: dict[tuple[int, bool], list[str]] = {}


def niah_keys(tok: TokenizerLike, framing: Framing) -> list[str]:
    """Keys whose question has the most common token length, so that every question of a cell is equally long."""
    cache_key = (id(tok), framing.chat)
    if cache_key not in _key_cache:
        keys = [f"{a}-{n}" for a in ADJECTIVES for n in NOUNS]
        lengths = {k: len(niah_question(tok, framing, k)) for k in keys}
        common = Counter(lengths.values()).most_common()
        best = min(common, key=lambda c: (-c[1], c[0]))[0]
        _key_cache[cache_key] = [k for k in keys if lengths[k] == best]
    return _key_cache[cache_key]


def niah_question(tok: TokenizerLike, framing: Framing, key: str) -> list[int]:
    return framing.question(tok, NIAH_QUESTION.format(key=key), NIAH_ANSWER_PREFIX.format(key=key))


def niah_prompt(task: str, tok: TokenizerLike, framing: Framing, length: int, index: int, seed: int,
                depths: list[float], sentences: list[list[int]], asked: int = 1) -> Prompt:
    """A RULER-style needle prompt; asked > 1 (shared_context): `asked` keys with one value each, every key asked
    in turn (the first at the grid depth), each question as long as the others."""
    n_keys, n_values = NIAH_NEEDLES[task] if asked == 1 else (asked, 1)
    rng = rng_for(seed, task, length, index)
    keys = rng.sample(niah_keys(tok, framing), n_keys)
    query = keys[0]
    values = [[str(rng.randint(1000000, 9999999)) for _ in range(n_values)] for _ in keys]
    # the first needle (the asked one, or the first value) sits at the grid depth; the others anywhere
    needles = []
    for i, key in enumerate(keys):
        for j, value in enumerate(values[i]):
            depth = depths[index % len(depths)] if i == 0 and j == 0 else rng.random()
            needles.append((depth, tok.encode(NIAH_NEEDLE.format(key=key, value=value))))
    intro = framing.head + tok.encode(NIAH_INTRO)
    question = niah_question(tok, framing, query)
    start = rng.randrange(len(sentences))
    units = sentences[start:] + sentences[:start]
    budget = length - len(intro) - len(question)
    hay, actual, offsets = assemble(units, needles, budget, f"{task}@{length}")
    followups = [(niah_question(tok, framing, key), values[i]) for i, key in enumerate(keys) if 0 < i < asked]
    return Prompt(task, length, index, intro + hay, question, values[0],
                  {"depth": round(actual[0], 4), "requested_depth": needles[0][0], "key": query,
                   "depths": [round(d, 4) for d in actual], "needle_offsets": [len(intro) + o for o in offsets],
                   "haystack_start": start, **({"keys": keys} if asked > 1 else {})}, followups)


def encode_sentences(tok: TokenizerLike, sentences: list[str]) -> list[list[int]]:
    return [tok.encode(" " + s) for s in sentences]


NOISE = "noise"  # RULER's noise haystack (niah_single_1): the passkey filler repeated, no prose


def haystack_units(tok: TokenizerLike, haystack: str) -> list[list[int]]:
    """The token units a niah haystack is assembled from: prose sentences of a text, or RULER's noise."""
    if haystack == NOISE:
        return [tok.encode(PASSKEY_FILLER)]
    return encode_sentences(tok, prose_sentences(load_text(haystack)))


def make_prompts(task: str, tok: TokenizerLike, framing: Framing, length: int, n: int, seed: int,
                 depths: list[float], sentences: list[list[int]] | None = None,
                 questions: int = SHARED_QUESTIONS) -> list[Prompt]:
    """The first n samples of a (task, length) cell; shared_context asks `questions` keys of each context."""
    if task == "passkey":
        return [passkey_prompt(tok, framing, length, i, seed, depths) for i in range(n)]
    if task in NIAH_NEEDLES or task == SHARED:
        if not sentences:
            raise KVFastError("niah needs a haystack text with prose sentences")
        asked = questions if task == SHARED else 1
        return [niah_prompt(task, tok, framing, length, i, seed, depths, sentences, asked) for i in range(n)]
    raise KVFastError(f"unknown retrieval task {task!r}")


# ---- perplexity windows -----------------------------------------------------------------------------------
def text_windows(ids: list[int], length: int, n: int, seed: int, bos: int | None = None) -> list[list[int]]:
    """n windows of `length` tokens at seeded random, non-overlapping offsets (bos first if given)."""
    body = length - (bos is not None)
    if n * body > len(ids):
        raise KVFastError(f"the text has {len(ids)} tokens, too few for {n} windows of {length}")
    rng = rng_for(seed, "ppl", length)
    slack = len(ids) - n * body
    cuts = sorted(rng.randint(0, slack) for _ in range(n))
    windows = []
    for i, cut in enumerate(cuts):
        start = cut + i * body
        windows.append(([bos] if bos is not None else []) + ids[start : start + body])
    return windows
