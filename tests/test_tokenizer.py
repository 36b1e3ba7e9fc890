"""Tokenizer tests: parity with transformers on the default model, llama.cpp's digit rule, missing bytes,
chat formatting; plus the tiktoken / SentencePiece formats on small trained tokenizers."""

import json
import random

import pytest
import regex

from tokenizer import DIGITS_GPT2_PATTERN, GPT2_PATTERN, format_chat, load_tokenizer

# llama.cpp's "smollm" pre-tokenizer: these two regexes, applied one after the other; text that a regex
# does not match stays a piece of its own (llama.cpp keeps the gaps).
LLAMA_CPP_SMOLLM = [r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"]

MISSING_BYTES = [4, 6, 19, 20, 22, 29, 192, 193, 241, 242, *range(245, 256)]
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def split_keep_gaps(pattern: str, text: str) -> list[str]:
    pieces, pos = [], 0
    for m in regex.finditer(pattern, text):
        if m.start() > pos:
            pieces.append(text[pos:m.start()])
        if m.end() > m.start():
            pieces.append(m.group())
        pos = m.end()
    if pos < len(text):
        pieces.append(text[pos:])
    return pieces


def llama_cpp_pieces(text: str) -> list[str]:
    pieces = [text]
    for pattern in LLAMA_CPP_SMOLLM:
        pieces = [p for piece in pieces for p in split_keep_gaps(pattern, piece)]
    return pieces


# --------------------------------------------------------------------------------------------------
# Random text (fixed seed)

WORDS = ["the", "of", "and", "to", "in", "is", "was", "he", "for", "it", "with", "as", "his", "on", "be",
         "at", "by", "had", "are", "but", "from", "or", "have", "an", "they", "which", "one", "you",
         "were", "her", "all", "she", "there", "would", "their", "we", "him", "been", "has", "when", "who",
         "will", "more", "no", "if", "out", "so", "said", "what", "up", "its", "about", "into", "than",
         "them", "can", "only", "other", "new", "some", "could", "time", "these", "two", "may", "then",
         "do", "first", "any", "my", "now", "such", "like", "our", "over", "man", "me", "even", "most",
         "made", "after", "also", "did", "many", "before", "must", "through", "back", "years", "Hello",
         "World", "Python", "JavaScript", "TODO", "README", "HTTPServer", "getElementById", "snake_case",
         "kebab-case"]
CODE = ["def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }", "if __name__ == '__main__':",
        "#include <stdio.h>", "x = {'a': [1, 2], \"b\": None}", "SELECT * FROM users WHERE id = ?;", "a->b; c::d",
        "console.log(`${name}`);", "<div class=\"x\">&amp;</div>", "λx. x + y", "fn main() -> Result<(), E> {}",
        "    \t\tindented();", "// comment\n/* block */", "$HOME/.config && echo $?"]
UNICODE = ["naïve", "café", "Ångström", "straße", "東京タワー", "日本語のテキスト", "Привет", "мир", "مرحبا بالعالم",
           "שלום", "नमस्ते", "한국어", "ελληνικά", "Tiếng Việt", "ÆØÅ", "e\u0301", "ﬁ", "ℕ", "…", "—", "“quoted”",
           "«guillemets»", "¿Qué?", "¡Olé!", "€£¥", "°C", "±", "≤≥≠", "→⇒", "™©®"]
EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇫🇷", "🏴\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f", "❤️",
         "🤖", "✨🎉", "🧑🏿‍💻", "\U0001F9EC"]
SPACES = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \n", "\n ", "  \n\t ", "\u00a0", "\u3000",
          "\u2009", "\x0b", "\x0c", "\u200b", "\u2028", "\x85"]
PUNCT = [".", ",", "!", "?", "...", ";", ":", "-", "--", "'", "\"", "(", ")", "[]", "{}", "@", "#", "%", "&&", "|",
         "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "n't", "'S", "''", "`", "~", "^", "_", "\\", "/", "<", ">"]
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<file_sep>", "<jupyter_code>",
           "<|im_start|>user\n", "<|im_end|>\n", "<|im_start", "im_end|>"]
CONTROL = [chr(b) for b in MISSING_BYTES if b < 0x80] + ["\x00", "\x01", "\x1b", "\x7f", chr(0x40000)]
BUCKETS = [(WORDS, 10), (CODE, 2), (UNICODE, 3), (EMOJI, 2), (SPACES, 4), (PUNCT, 4), (SPECIAL, 1), (CONTROL, 1)]
SOUP = "".join(sorted({c for bucket, _ in BUCKETS for frag in bucket for c in frag}))


def random_text(rng: random.Random) -> str:
    if rng.random() < 0.15:  # character soup: every character of the fragments, in any order
        return "".join(rng.choice(SOUP) for _ in range(rng.randint(1, 40)))
    buckets, weights = zip(*BUCKETS)
    parts = []
    for _ in range(rng.randint(1, 14)):
        parts.append(rng.choice(rng.choices(buckets, weights)[0]))
        parts.append(rng.choice(["", " ", " ", " ", "\n", "  ", "\t", ""]))
    text = "".join(parts)
    if rng.random() < 0.3:
        text = text.upper() if rng.random() < 0.5 else text.title()
    return text


def strings_without_digits(n: int, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    return [regex.sub(r"\p{N}", "", random_text(rng)) for _ in range(n)]


def strings_with_digits(n: int, seed: int = 99) -> list[str]:
    rng = random.Random(seed)
    numbers = ["0", "7", "42", "123", "2024", "3.14159", "1,000,000", "-5", "1e-5", "0x1F", "v2", "½", "²", "٣",
               "Ⅻ", "１２"]
    out = []
    for _ in range(n):
        text = random_text(rng)
        for _ in range(rng.randint(1, 5)):
            i = rng.randint(0, len(text))
            text = text[:i] + rng.choice(["", " ", "  ", "\n", "\t "]) + rng.choice(numbers) + text[i:]
        out.append(text)
    return out


# --------------------------------------------------------------------------------------------------
# The digit rule as one regex (no model needed)

def test_digit_regex_equals_llama_cpp_two_stage_split():
    rng = random.Random(7)
    alphabet = "ab Z1234 5\t\n\r .,'s'tll-_é½²٣😀\u00a0"
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25))) for _ in range(5000)]
    texts += strings_with_digits(500)
    for text in texts:
        assert regex.findall(DIGITS_GPT2_PATTERN, text) == llama_cpp_pieces(text), repr(text)


@pytest.mark.parametrize("text, pieces", [
    ("abc 123", ["abc", " ", "1", "2", "3"]),
    ("abc  123", ["abc", "  ", "1", "2", "3"]),
    ("x\n\n42", ["x", "\n\n", "4", "2"]),
    ("3.14", ["3", ".", "1", "4"]),
    ("v2beta", ["v", "2", "beta"]),
    ("Room 101, floor 7", ["Room", " ", "1", "0", "1", ",", " floor", " ", "7"]),
    ("  12", ["  ", "1", "2"]),
    ("a\t 9", ["a", "\t ", "9"]),
    ("-5 %", ["-", "5", " %"]),
    ("½²٣", ["½", "²", "٣"]),
    ("it's 4pm", ["it", "'s", " ", "4", "pm"]),
])
def test_digit_rule_pieces(text, pieces):
    assert llama_cpp_pieces(text) == pieces
    assert regex.findall(DIGITS_GPT2_PATTERN, text) == pieces
    assert regex.findall(GPT2_PATTERN, text) != pieces or not regex.search(r"\s\p{N}", text)


# --------------------------------------------------------------------------------------------------
# The default model against transformers' tokenizer (read from the same GGUF)

@pytest.fixture(scope="module")
def tok(default_checkpoint):
    return load_tokenizer(default_checkpoint)


@pytest.mark.real_model
def test_encode_decode_parity_with_transformers(tok, hf_tokenizer):
    texts = strings_without_digits(1500)
    assert not any(regex.search(r"\p{N}", t) for t in texts)
    expected = hf_tokenizer(texts, add_special_tokens=False)["input_ids"]
    mismatches = [(t, ids, exp) for t, exp in zip(texts, expected) if (ids := tok.encode(t)) != exp]
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[0]}"
    for text, ids in zip(texts, expected):
        assert tok.decode(ids) == hf_tokenizer.decode(ids)
        if not any(c in text for c in CONTROL):
            assert tok.decode(ids) == text


@pytest.mark.real_model
def test_decode_arbitrary_ids_matches_transformers(tok, hf_tokenizer):
    # Random ids split UTF-8 sequences: the replacement characters must come out the same.
    rng = random.Random(5)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 20))]
        assert tok.decode(ids) == hf_tokenizer.decode(ids), ids


@pytest.mark.real_model
@pytest.mark.parametrize("text, pieces", [
    ("abc 123", ["abc", " ", "1", "2", "3"]),
    ("abc  123", ["abc", "  ", "1", "2", "3"]),
    ("x\n\n42", ["x", "\n\n", "4", "2"]),
    ("Room 101", ["Room", " ", "1", "0", "1"]),
])
def test_digit_rule_ids(tok, hf_tokenizer, text, pieces):
    # Every piece here is one vocabulary token: the expected ids are read off the vocabulary.
    table = str.maketrans({" ": "Ġ", "\n": "Ċ"})
    expected = hf_tokenizer.convert_tokens_to_ids([p.translate(table) for p in pieces])
    assert None not in expected and hf_tokenizer.unk_token_id not in expected
    assert tok.encode(text) == expected


@pytest.mark.real_model
def test_digit_rule_on_random_strings(tok, hf_tokenizer):
    # Expected: llama.cpp's pieces, each byte-pair encoded on its own (by transformers).
    for text in strings_with_digits(400):
        expected = []
        for i, segment in enumerate(regex.split(r"(<\|im_start\|>|<\|im_end\|>|<\|endoftext\|>|<repo_name>|"
                                                r"<file_sep>|<jupyter_code>)", text)):
            if i % 2:
                expected.append(hf_tokenizer.convert_tokens_to_ids(segment))
            else:
                for piece in llama_cpp_pieces(segment):
                    expected += hf_tokenizer.encode(piece, add_special_tokens=False)
        assert tok.encode(text) == expected, repr(text)
    # The digit rule matters: transformers' GGUF converter (GPT-2 split only) gives other ids here.
    assert tok.encode("abc  123") != hf_tokenizer.encode("abc  123", add_special_tokens=False)


@pytest.mark.real_model
def test_missing_bytes_are_dropped(tok, hf_tokenizer, default_checkpoint):
    cfg = json.loads((default_checkpoint / "tokenizer_config.json").read_text())
    assert cfg["missing_bytes"] == MISSING_BYTES == tok.missing_bytes
    for b in MISSING_BYTES:
        if b < 0x80:
            ids = tok.encode(f"ab{chr(b)}cd{chr(b)}")
            assert ids == tok.encode("ab") + tok.encode("cd"), b
            assert tok.decode(ids) == "abcd"
    # Dropped inside the pre-tokenized piece before BPE, as transformers does: " \x16!" is " !".
    assert tok.encode(" \x16!") == tok.encode(" !") == hf_tokenizer.encode(" \x16!", add_special_tokens=False)
    # U+40000 is F1 80 80 80: the lead byte is missing, the continuation bytes are in the vocabulary.
    ids = tok.encode("x" + chr(0x40000) + "\x04")
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    every_char = "".join(chr(c) for c in range(0x20000) if not 0xD800 <= c < 0xE000)
    assert all(0 <= i < tok.vocab_size for i in tok.encode(every_char))


@pytest.mark.real_model
def test_special_tokens_and_ids(tok):
    assert (tok.bos_id, tok.eos_id, tok.stop_ids, tok.vocab_size, tok.add_bos) == (1, 2, {0, 2}, 49152, False)
    for name, i in tok.special_tokens.items():
        assert tok.encode(name) == [i]
        assert tok.decode([i]) == name
    assert tok.encode("<|im_start|>user\nHi<|im_end|>") == [1, *tok.encode("user\nHi"), 2]
    assert tok.encode("hi", bos=True) == [1, *tok.encode("hi")]
    assert tok.encode("") == [] and tok.decode([]) == ""
    assert tok.decode([tok.vocab_size + 5]) == ""  # ids past the vocabulary (padded embeddings) decode to ""


@pytest.mark.real_model
def test_chat_prompt(tok, hf_tokenizer):
    assert tok.chat_prompt("What is 2+2?") == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n")
    for system in (None, "Be brief."):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "Hi"}]
        expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok.chat_prompt("Hi", system=system) == expected
    ids = tok.encode(tok.chat_prompt("Hi"))
    assert ids[0] == 1 and ids.count(2) == 2 and ids[-4:] == tok.encode("<|im_start|>assistant\n")


def test_format_chat_other_formats():
    assert format_chat("llama3", "Hi", "S") == (
        "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        "Hi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert format_chat("llama2", "Hi", None) == "[INST] Hi [/INST]"
    assert format_chat("none", "Hi", None) == "Hi"


def test_load_tokenizer_without_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path)
