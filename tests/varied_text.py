"""Varied strings for tokenizer parity tests, in named groups so that a mismatch says what kind of text it
was: source code, unicode, digit runs, whitespace runs, a tokenizer's special tokens inside text, and random
mixtures of all of them. Fixed seeds: the same strings on every run."""

import random

from test_tokenizer import CODE, EMOJI, SPACES, UNICODE, random_text

SNIPPETS = [  # written with 4-space indents and "\n"; NAME takes a generated identifier
    ("def NAME(x, *args, **kw):\n    if x >= 10 and not kw:\n        return x ** 2 // 3\n"
     "    return [y for y in args if y != x]\n"),
    ("class NAME(Base):\n    def __init__(self) -> None:\n        super().__init__()\n"
     "        self._cache: dict[str, int] = {}\n"),
    ("import os, sys\nfrom pathlib import Path\n\nif __name__ == \"__main__\":\n    NAME = Path(sys.argv[1])\n"
     "    print(f\"{NAME!r:>10}\")\n"),
    ("@decorator(key='v')\nasync def NAME(self, *, timeout: float = 1e-3) -> 'NAME':\n"
     "    try:\n        await self.q.put(None)\n    except (KeyError, ValueError) as e:\n        raise\n"),
    ("#include <stdio.h>\n\nint NAME(const char *s, size_t n) {\n    for (size_t i = 0; i < n; ++i) {\n"
     "        if (s[i] == '\\0') return -1;\n    }\n    return n << 2 | 0x1F;\n}\n"),
    "static inline uint32_t NAME(uint32_t x) { x ^= x >> 16; x *= 0x7feb352dU; return x; }\n",
    "#define NAME(a, b) ((a) > (b) ? (a) : (b))\n#ifdef DEBUG\n#  pragma once\n#endif\n",
    "typedef struct {\n    int *p;\n    unsigned long long NAME;\n} node_t;\n/* block\n * comment */\n",
    ("const NAME = async (req, res) => {\n    const { id } = req.params ?? {};\n"
     "    if (id === undefined || id !== 0) return res?.status(404);\n"
     "    await db.query(`SELECT * FROM t WHERE id = ${id}`);\n};\n"),
    "function NAME(a) {\n    let s = 0;\n    for (let i = 0; i < a.length; i++) s += a[i] >>> 0;\n    return s;\n}\n",
    ("#!/usr/bin/env bash\nset -euo pipefail\nfor f in \"$@\"; do\n    [[ -f \"$f\" ]] && NAME=\"${f%.*}\" || continue\n"
     "    echo \"$NAME\" >> out.log 2>&1\ndone\n"),
    ("NAME() {\n    local x=$1; shift\n    if [ \"$x\" -gt 0 ]; then echo $((x * 2)); fi\n}\n"
     "ls -la | grep -v '^d' | awk '{print $9}' > /dev/null\n"),
    "SELECT NAME, COUNT(*) AS n FROM users u JOIN orders o ON o.user_id = u.id WHERE u.age >= 18 GROUP BY 1;\n",
    "fn NAME<'a>(xs: &'a [u8]) -> Option<&'a u8> {\n    xs.iter().max()\n}\n",
    *CODE,
]
OPERATORS = ["+", "-", "*", "/", "%", "**", "//", "==", "!=", "===", "!==", "<=", ">=", "<<", ">>", ">>>", "&&",
             "||", "!", "~", "^", "&", "|", "->", "=>", "::", "?.", "??", "+=", "-=", "*=", "/=", "<<=", ">>=",
             "**=", "//=", ":=", "...", "..", "#", "@", "$", "${", "$(", "2>&1", "|&", ";;", "\\", "();", "[]", "{}"]
IDENT_PARTS = ["get", "set", "user", "id", "count", "total", "max", "buffer", "size", "http", "request", "handler",
               "tmp", "x", "i", "num", "tokens", "cache", "kv", "layer", "Attention", "Manager", "Factory", "v2"]
INDENTS = ["    ", "  ", "\t", "        ", "\t\t", " \t", "   "]

CJK = ["中文分词测试", "我爱北京天安门", "機械学習モデル", "ひらがなとカタカナ", "한국어 텍스트", "繁體中文字", "「引用」、。",
       "〇一二三", "\U00020000\U00020001", "（全角）", "東京タワー", "人工智能"]
RTL_TEXT = ["مرحبا بالعالم", "السلام عليكم", "العربية ١٢٣", "فارسی", "עברית", "اُردو", "שלום עולם"]
RTL_MARKS = ["\u200f", "\u200e", "\u202b", "\u202c", "\u202e", "\u2067", "\u2069", "\u061c"]
ZWJ_EMOJI = ["👩‍💻", "👨‍👩‍👧", "🧑‍🤝‍🧑", "1️⃣", "#️⃣", "🏃‍♀️", "🫶🏻", "🇯🇵🇺🇸", "👁️‍🗨️", "🐻‍❄️"]
# Combining marks; the first five compose under NFC, the rest have no precomposed form and stay as they are
COMBINING = ["e\u0301", "a\u0308", "o\u0302\u0323", "n\u0303", "A\u030a", "q\u0301", "x\u0308", "\u0131\u0307",
             "Z\u0335", "\u0301", "a\u20dd", "\u0915\u093f", "g\u0306\u0306"]
FULL_WIDTH = ["０１２３４５６７８９", "ＡＢＣａｂｃ", "１２３ｋｇ", "！？＃％", "Ｈｅｌｌｏ　Ｗｏｒｌｄ"]
OTHER_SCRIPTS = [*UNICODE, *EMOJI, "ไทย", "ქართული", "Ελλάδα", "ǅ", "ﬃ", "Ω", "㍿", "\u212b", "\ufeff"]

DIGIT_SETS = ["0123456789"] * 6 + ["٠١٢٣٤٥٦٧٨٩", "۰۱۲۳۴۵۶۷۸۹", "०१२३४५६७८९", "０１２３４５６７８９", "¹²³⁰", "½¼ⅠⅡ"]
DIGIT_SEPARATORS = [",", ".", "_", " ", "'", "-", "/", ":", "e", "e-", "x", "\u202f", "\u00a0", "٫", ""]

WHITESPACE = [" ", "\t", "\n", "\r\n", "\r"] * 4 + SPACES


def identifier(rng: random.Random) -> str:
    """Short or long (up to ~100 characters) names in snake, camel or constant case."""
    parts = [rng.choice(IDENT_PARTS) for _ in range(rng.choice([1, 1, 2, 3, 6, 12]))]
    style = rng.randrange(3)
    if style == 0:
        return "_".join(p.lower() for p in parts) + rng.choice(["", "_", "2", "_42"])
    if style == 1:
        return parts[0].lower() + "".join(p[:1].upper() + p[1:] for p in parts[1:])
    return "_".join(p.upper() for p in parts)


def code_strings(rng: random.Random, n: int) -> list[str]:
    """Python / C / JS / shell snippets: re-indented (spaces, tabs), CRLF or CR line ends, long identifiers,
    operator soup, trailing whitespace, two snippets joined."""
    out = []
    for _ in range(n):
        text = rng.choice(SNIPPETS).replace("NAME", identifier(rng)).replace("    ", rng.choice(INDENTS))
        r = rng.random()
        if r < 0.25:
            text = " ".join(rng.choice([*OPERATORS, identifier(rng), str(rng.randrange(1000))])
                            for _ in range(rng.randint(2, 12)))
        elif r < 0.4:
            text += rng.choice(["", "\n", "\n\n"]) + rng.choice(SNIPPETS).replace("NAME", identifier(rng))
        text = text.replace("\n", rng.choice(["\n", "\n", "\r\n", "\r"]))
        out.append(text + rng.choice(["", "", " ", "  ", "\t", "\n", " \n", "\n\n\n"]))
    return out


def unicode_strings(rng: random.Random, n: int) -> list[str]:
    """CJK, Arabic and Hebrew with RTL marks, emoji with ZWJ sequences, combining accents, full-width forms."""
    pools = [CJK, RTL_TEXT, RTL_MARKS, ZWJ_EMOJI, COMBINING, FULL_WIDTH, OTHER_SCRIPTS, ["abc", "Hello", "x=1"]]
    out = []
    for _ in range(n):
        parts = [rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 8))]
        out.append("".join(p + rng.choice(["", "", " ", "\n", "\u200d", *RTL_MARKS[:2]]) for p in parts))
    return out


def digit_strings(rng: random.Random, n: int) -> list[str]:
    """Runs of 1..30 digits, plain or grouped by separators, alone or next to letters, signs and units."""
    out = []
    for _ in range(n):
        digits = rng.choice(DIGIT_SETS)
        run = "".join(rng.choice(digits) for _ in range(rng.randint(1, 30)))
        if rng.random() < 0.5:
            sep, step = rng.choice(DIGIT_SEPARATORS), rng.choice([1, 2, 3, 3, 4])
            run = sep.join(run[i:i + step] for i in range(0, len(run), step))
        pre = rng.choice(["", "", " ", "$", "-", "+", "v", "0x", "#", "abc", "x", "\n", "(", "  ", "€"])
        post = rng.choice(["", "", " ", "%", "px", "kg", "th", ")", ".", "\n", " apples", "e10", "ms"])
        out.append(pre + run + post)
    return out


def whitespace_strings(rng: random.Random, n: int) -> list[str]:
    """Runs of spaces, tabs, newlines and unicode spaces: alone, leading, trailing, between words and digits."""
    out = []
    for _ in range(n):
        runs = ["".join(rng.choice(WHITESPACE) for _ in range(rng.choice([1, 1, 2, 3, 5, 12, 40])))
                for _ in range(3)]
        words = [rng.choice(["word", "x", "42", "é", "東京", "(", "!", "'s", "-", "def", "😀"]) for _ in range(2)]
        shape = rng.randrange(4)
        if shape == 0:
            out.append(runs[0])
        elif shape == 1:
            out.append(runs[0] + words[0] + runs[1] + words[1] + runs[2])
        elif shape == 2:
            out.append(words[0] + runs[0])
        else:
            out.append(runs[0] + words[0] + runs[1])
    return out


def special_strings(rng: random.Random, n: int, specials: list[str]) -> list[str]:
    """Special tokens alone, adjacent to each other, glued to words, digits, emoji and whitespace, in chat
    transcripts; and near-misses (cut short, upper-cased, spaced) that must stay ordinary text."""
    near = [s[:-1] for s in specials] + [s[1:] for s in specials] + [s.upper() for s in specials]
    near += [s.replace("|", "| ", 1) for s in specials] + ["<|", "|>", "<||>", "<|im_start|", "<|<|im_end|>|>"]
    glue = ["", "", " ", "\n", "\n\n", "x", "42", "😀", "é", "\t", "  ", "user\n", "<", ">", "|"]
    out = list(specials)
    while len(out) < n:
        r = rng.random()
        if r < 0.3:  # a chat transcript
            turns = [f"<|im_start|>{rng.choice(['system', 'user', 'assistant'])}\n{random_text(rng)}<|im_end|>\n"
                     for _ in range(rng.randint(1, 3))]
            out.append("".join(turns) + rng.choice(["", "<|im_start|>assistant\n"]))
        else:
            k = rng.randint(1, 6)
            pool = specials if rng.random() < 0.8 else specials + near
            out.append("".join(rng.choice(glue) + rng.choice(pool) for _ in range(k)) + rng.choice(glue))
    return out


def mixed_strings(rng: random.Random, n: int) -> list[str]:
    """test_tokenizer's random text (words, code, unicode, emoji, spaces, punctuation, controls, character
    soup) with digit and whitespace runs inserted at random places."""
    numbers = ["0", "42", "2024", "3.14159", "1,000,000", "0x1F", "½", "²", "٣٤", "１２", "99999999999"]
    out = []
    for _ in range(n):
        text = random_text(rng)
        for _ in range(rng.randint(0, 4)):
            i = rng.randint(0, len(text))
            text = text[:i] + rng.choice(["", " ", "   ", "\n\n", "\t "] + SPACES) + rng.choice(numbers) + text[i:]
        out.append(text)
    return out


def text_groups(specials: list[str], seed: int = 11) -> dict[str, list[str]]:
    """About 6,600 strings, by group."""
    rng = random.Random(seed)
    return {"code": code_strings(rng, 1200), "unicode": unicode_strings(rng, 1200),
            "digits": digit_strings(rng, 1000), "whitespace": whitespace_strings(rng, 1000),
            "specials": special_strings(rng, 1000, sorted(specials)), "mixed": mixed_strings(rng, 1200)}
