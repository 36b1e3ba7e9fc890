r"""Tokenizers: a tiktoken wrapper (byte-level BPE) and a SentencePiece wrapper behind one interface.

Checkpoint files (load_tokenizer picks the first kind present):

- ``tokenizer.tiktoken``: byte-level BPE, tiktoken's own format: one ``base64(token bytes) rank`` per
  line (what ``tiktoken.load.load_tiktoken_bpe`` reads). A rank is the BPE merge priority; it is the
  token id unless ``id_of_rank`` is given (see below). Special tokens are not in this file.
- ``tokenizer.model``: a SentencePiece model.
- ``tokenizer_config.json`` (required for tiktoken, optional for SentencePiece)::

    {"type": "tiktoken" | "sentencepiece",
     "pattern": "<pre-tokenizer regex>",          # tiktoken only
     "special_tokens": {"<|im_start|>": 1, ...},   # text -> id; matched in the input text
     "bos_id": 1 | null, "eos_id": 2, "stop_ids": [0, 2],
     "add_bos": false,                             # whether prompts should start with bos
     "chat_format": "chatml" | "llama3" | "llama2" | "none",
     "default_system": "You are ..." | null,       # used when chat_prompt() gets no system
     "vocab_size": 49152,                          # max id + 1 (specials included)
     "missing_bytes": [4, 6, ...],                 # single bytes the vocabulary lacks (for readers;
                                                   # the loader derives them from tokenizer.tiktoken)
     "normalizer": null | "NFC",                   # applied to the text before encoding
     "id_of_rank": null | [id of rank 0, id of rank 1, ...]}

Why ranks can differ from ids: tiktoken merges the adjacent pair whose *merged token* has the lowest
rank, Hugging Face BPE the pair whose *merge rule* comes first. Both agree when ranks follow the merge
order. ``save_bpe`` checks whether token ids already do (they do for SmolLM2: the id of the i-th merge
result is 17 + 235 + i); if not, it writes ranks in merge order and the rank -> id table.

Bytes the vocabulary cannot express are dropped; they never give an id. SmolLM2 lacks 21 single bytes:
the ASCII controls 0x04 0x06 0x13 0x14 0x16 0x1d, and 0xc0 0xc1 0xf1 0xf2 0xf5-0xff, which never occur in
UTF-8 text (0xf1/0xf2 only lead the unassigned planes 4-11). We drop them as Hugging Face tokenizers
(the tokenizer the model was trained with) does: pre-tokenize the original text, remove the missing
bytes from each piece, byte-pair encode what is left (so " \x16!" gives the ids of " !"). llama.cpp's
BPE code appears to keep the byte as a barrier to merges and drop it afterwards; that can differ rarely.
tiktoken itself would panic on such a byte, so it never sees one: text that contains one takes a slower
path (pre-tokenize with the `regex` module, filter, tiktoken per piece).
"""

import base64
import itertools
import json
import re
import unicodedata
from pathlib import Path

import regex
import tiktoken

# GPT-2 pre-tokenizer (Hugging Face ByteLevel with use_regex=True).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# llama.cpp's "smollm"/"starcoder" rule: split off every digit (\p{N}), then apply GPT-2 to each piece.
# As one regex: digits are single pieces, " ?\p{N}+" can never match, and a whitespace run may end
# right before a digit (the piece boundary) as well as before whitespace: (?!\S) -> (?![^\s\p{N}]).
DIGITS_GPT2_PATTERN = r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
# Llama 3 (tiktoken cl100k style; llama.cpp "llama-bpe").
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen2 / Qwen2.5 (llama.cpp "qwen2", tokenizer.json's Split regex): Llama 3's with single digits; NFC first.
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")

STOP_TOKEN_NAMES = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>", "</s>")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(token: str) -> bytes:
    """Bytes of a byte-level BPE vocabulary entry (written in GPT-2's printable characters)."""
    return bytes(_UNICODE_TO_BYTE[c] for c in token)


# ---------------------------------------------------------------------------------------------------
# Chat formats

def chat_format_from_template(template: str | None) -> tuple[str, str | None]:
    """Recognise a chat template (Jinja text) as one of our formats; also its default system prompt."""
    if not template:
        return "none", None
    if "<|im_start|>" in template:
        # SmolLM2 / Qwen inject a system message when none is given; the template holds it literally, as the
        # one system turn whose text has no Jinja in it (Qwen's tools branch opens a system turn first).
        m = re.search(r"<\|im_start\|>system(?:\n|\\n)([^{}'+<]*?)<\|im_end\|>", template)
        return "chatml", m.group(1) if m else None
    if "<|start_header_id|>" in template:
        return "llama3", None
    if "[INST]" in template:
        return "llama2", None
    return "none", None


def format_chat(chat_format: str, user: str, system: str | None) -> str:
    """The prompt text for one user turn, ending with the assistant header (no bos: encode adds it)."""
    if chat_format == "chatml":
        head = f"<|im_start|>system\n{system}<|im_end|>\n" if system is not None else ""
        return f"{head}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    if chat_format == "llama3":
        head = f"<|start_header_id|>system<|end_header_id|>\n\n{system}<|eot_id|>" if system is not None else ""
        return (f"{head}<|start_header_id|>user<|end_header_id|>\n\n{user}<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n")
    if chat_format == "llama2":
        sys_block = f"<<SYS>>\n{system}\n<</SYS>>\n\n" if system is not None else ""
        return f"[INST] {sys_block}{user.strip()} [/INST]"
    if chat_format == "none":
        return f"{system}\n\n{user}" if system is not None else user
    raise ValueError(f"unknown chat format {chat_format!r}")


# ---------------------------------------------------------------------------------------------------
# Wrappers

class Tokenizer:
    """Common interface; subclasses implement encode and decode."""

    bos_id: int | None
    eos_id: int
    stop_ids: set[int]
    vocab_size: int
    add_bos: bool
    special_tokens: dict[str, int]
    chat_format: str
    default_system: str | None

    def _init_common(self, cfg: dict, special_tokens: dict[str, int]) -> None:
        self.special_tokens = special_tokens
        self.chat_format = cfg.get("chat_format", "none")
        self.default_system = cfg.get("default_system")
        self.add_bos = bool(cfg.get("add_bos", False))
        # Longest first, so a special token that is a prefix of another never wins.
        names = sorted(special_tokens, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None
        self._special_by_id = {i: s for s, i in special_tokens.items()}

    def _split_special(self, text: str) -> list[str]:
        """Text pieces alternating ordinary text (even indices) and special tokens (odd indices)."""
        return self._special_re.split(text) if self._special_re else [text]

    def encode(self, text: str, bos: bool = False) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def chat_prompt(self, user: str, system: str | None = None) -> str:
        """One user turn in the model's chat format, ending with the assistant header."""
        return format_chat(self.chat_format, user, system if system is not None else self.default_system)

    def chat_turn_parts(self, system: str | None = None) -> tuple[str, str]:
        """chat_prompt's text before and after the user's words: a saved context is the opening of a user turn
        (opening + context), and each question asked after it closes the turn (question + closing)."""
        opening, closing = self.chat_prompt("\x00", system).split("\x00")
        return opening, closing


class TiktokenTokenizer(Tokenizer):
    """Byte-level BPE through tiktoken; special tokens are split off in Python before BPE."""

    def __init__(self, ranks_path: Path, config: dict):
        ranks = load_ranks(ranks_path)
        id_of_rank = config.get("id_of_rank")
        special = {k: int(v) for k, v in config.get("special_tokens", {}).items()}
        self.missing_bytes = [b for b in range(256) if bytes([b]) not in ranks]
        self._missing = bytes(self.missing_bytes)
        self._pattern = regex.compile(config["pattern"])  # the slow path's pre-tokenizer (same regex)
        self._enc = tiktoken.Encoding("kvfast", pat_str=config["pattern"], mergeable_ranks=ranks,
                                      special_tokens={})
        self._n_ranks = max(ranks.values()) + 1
        self._id_of_rank = id_of_rank
        self._rank_of_id = {i: r for r, i in enumerate(id_of_rank)} if id_of_rank is not None else None
        self._normalizer = config.get("normalizer")
        self._init_common(config, special)
        ids = id_of_rank if id_of_rank is not None else ranks.values()
        self.vocab_size = int(config.get("vocab_size", max([*ids, *special.values()]) + 1))
        self.bos_id = config.get("bos_id")
        self.eos_id = int(config["eos_id"])
        self.stop_ids = set(config.get("stop_ids", [])) | {self.eos_id}

    def _ordinary(self, text: str) -> list[int]:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: replaced the way tiktoken does
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            data = text.encode("utf-8")
        if len(data.translate(None, self._missing)) == len(data):
            ranks = self._enc.encode_ordinary(text)
        else:  # rare: drop the missing bytes inside each pre-tokenized piece, then BPE the rest
            ranks, pos = [], 0
            for m in self._pattern.finditer(text):
                pieces = [text[pos:m.start()], m.group()]  # a gap the regex skipped is a piece too
                pos = m.end()
                for piece in pieces:
                    piece = piece.encode("utf-8").translate(None, self._missing)
                    if piece:
                        ranks += self._enc._encode_single_piece(piece)
            tail = text[pos:].encode("utf-8").translate(None, self._missing)
            if tail:
                ranks += self._enc._encode_single_piece(tail)
        if self._id_of_rank is not None:
            return [self._id_of_rank[r] for r in ranks]
        return ranks

    def encode(self, text: str, bos: bool = False) -> list[int]:
        ids = [self.bos_id] if bos and self.bos_id is not None else []
        for i, piece in enumerate(self._split_special(text)):
            if i % 2:
                ids.append(self.special_tokens[piece])
            elif piece:  # normalized after special tokens are split off, as Hugging Face tokenizers does
                ids.extend(self._ordinary(unicodedata.normalize("NFC", piece) if self._normalizer == "NFC"
                                          else piece))
        return ids

    def decode(self, ids: list[int]) -> str:
        out = bytearray()
        for i in ids:
            i = int(i)
            if i in self._special_by_id:
                out += self._special_by_id[i].encode()
                continue
            r = self._rank_of_id.get(i) if self._rank_of_id is not None else i
            # Ids the tokenizer does not know (padding rows of a larger embedding) decode to nothing.
            if r is not None and 0 <= r < self._n_ranks:
                try:
                    out += self._enc.decode_single_token_bytes(r)
                except KeyError:
                    pass
        return out.decode("utf-8", errors="replace")


class SentencePieceTokenizer(Tokenizer):
    """SentencePiece model; control pieces (<s>, </s>) and configured specials are matched in text."""

    def __init__(self, model_path: Path, config: dict):
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor(model_file=str(model_path))
        sp = self._sp
        special = {sp.id_to_piece(i): i for i in range(sp.vocab_size()) if sp.is_control(i)}
        special.update({k: int(v) for k, v in config.get("special_tokens", {}).items()})
        self._init_common(config, special)
        bos = config.get("bos_id", sp.bos_id())
        self.bos_id = bos if bos is not None and bos >= 0 else None
        self.eos_id = int(config.get("eos_id", sp.eos_id()))
        self.stop_ids = set(config.get("stop_ids", [])) | {self.eos_id}
        self.vocab_size = int(config.get("vocab_size", max([sp.vocab_size() - 1, *special.values()]) + 1))
        if "add_bos" not in config:
            self.add_bos = self.bos_id is not None
        self.missing_bytes = []

    def encode(self, text: str, bos: bool = False) -> list[int]:
        ids = [self.bos_id] if bos and self.bos_id is not None else []
        for i, piece in enumerate(self._split_special(text)):
            if i % 2:
                ids.append(self.special_tokens[piece])
            elif piece:
                ids.extend(self._sp.encode(piece))
        return ids

    def decode(self, ids: list[int]) -> str:
        out, run = [], []
        n = self._sp.vocab_size()
        for i in map(int, ids):
            if i in self._special_by_id:
                out.append(self._sp.decode(run))
                out.append(self._special_by_id[i])
                run = []
            elif 0 <= i < n:
                run.append(i)
        out.append(self._sp.decode(run))
        return "".join(out)


def load_tokenizer(checkpoint_dir: Path) -> Tokenizer:
    """The tokenizer of a checkpoint folder (tokenizer.tiktoken or tokenizer.model)."""
    checkpoint_dir = Path(checkpoint_dir)
    cfg_path = checkpoint_dir / "tokenizer_config.json"
    config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    if (checkpoint_dir / "tokenizer.tiktoken").exists():
        if not config:
            raise FileNotFoundError(f"{cfg_path} is missing (needed next to tokenizer.tiktoken)")
        return TiktokenTokenizer(checkpoint_dir / "tokenizer.tiktoken", config)
    if (checkpoint_dir / "tokenizer.model").exists():
        return SentencePieceTokenizer(checkpoint_dir / "tokenizer.model", config)
    raise FileNotFoundError(f"no tokenizer.tiktoken or tokenizer.model in {checkpoint_dir}")


# ---------------------------------------------------------------------------------------------------
# Writing the tiktoken files (used by the converters)

def load_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in Path(path).read_text().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def bpe_ranks(vocab: dict[str, int], merges: list[tuple[str, str]]) -> tuple[dict[bytes, int], list[int] | None]:
    """tiktoken ranks for a byte-level BPE (tokens in GPT-2 characters -> id, merges in order).

    Returns (bytes -> rank, id_of_rank or None when rank == id for every token).
    """
    first_merge = {}
    for k, (a, b) in enumerate(merges):
        if a + b in vocab:  # a merge into a token that is now a special token is never used
            first_merge.setdefault(a + b, k)
    merged = sorted(first_merge, key=first_merge.get)
    merged_ids = [vocab[t] for t in merged]
    singles = sorted((t for t in vocab if len(token_bytes(t)) == 1), key=vocab.get)
    # Multi-byte tokens no merge produces: HF BPE never outputs them, tiktoken could if they outranked a
    # merge, so they must rank after every merge result.
    orphans = sorted((t for t in vocab if t not in first_merge and len(token_bytes(t)) > 1), key=vocab.get)
    # Single bytes never compete in a pair merge, so their ranks do not matter.
    increasing = all(x < y for x, y in itertools.pairwise(merged_ids))
    if increasing and (not orphans or not merged_ids or vocab[orphans[0]] > merged_ids[-1]):
        return {token_bytes(t): i for t, i in vocab.items()}, None
    order = singles + merged + orphans
    return {token_bytes(t): r for r, t in enumerate(order)}, [vocab[t] for t in order]


def save_bpe(out_dir: Path, vocab: dict[str, int], merges: list[tuple[str, str]],
             special_tokens: dict[str, int], pattern: str, bos_id: int | None, eos_id: int,
             stop_ids: list[int], add_bos: bool, chat_template: str | None,
             normalizer: str | None = None) -> None:
    """Write tokenizer.tiktoken + tokenizer_config.json for a byte-level BPE vocabulary."""
    out_dir = Path(out_dir)
    vocab = {t: i for t, i in vocab.items() if t not in special_tokens}
    ranks, id_of_rank = bpe_ranks(vocab, merges)
    lines = [f"{base64.b64encode(b).decode()} {r}" for b, r in sorted(ranks.items(), key=lambda x: x[1])]
    (out_dir / "tokenizer.tiktoken").write_text("\n".join(lines) + "\n")
    chat_format, default_system = chat_format_from_template(chat_template)
    config = {
        "type": "tiktoken",
        "pattern": pattern,
        "special_tokens": special_tokens,
        "bos_id": bos_id,
        "eos_id": eos_id,
        "stop_ids": sorted(set(stop_ids) | {eos_id}),
        "add_bos": add_bos,
        "chat_format": chat_format,
        "default_system": default_system,
        "vocab_size": max([*vocab.values(), *special_tokens.values()]) + 1,
        "missing_bytes": [b for b in range(256) if bytes([b]) not in ranks],
        "normalizer": normalizer,
        "id_of_rank": id_of_rank,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False) + "\n")


def stop_ids_for(special_tokens: dict[str, int], eos_id: int) -> list[int]:
    """eos plus the usual end-of-turn / end-of-text specials the vocabulary has."""
    return sorted({eos_id} | {special_tokens[s] for s in STOP_TOKEN_NAMES if s in special_tokens})
