"""The probe set of first-use verification (``tokenmill.tokenize.tokenizer_verify``): texts every
engine must encode exactly as the reference does before a run may use it.
"""

from __future__ import annotations

import hashlib
import unicodedata

import orjson

_PROBES = (
    "",
    "Hello world",
    " Hello  world   \n",
    "\n\n\nfoo\n \n\t\tbar\t \n",
    "line one\r\nline two\r\n\r\nthree\rfour",
    "x" + " " * 50 + "y" + "\n" * 30 + "z" + "\t" * 17,
    "naïve café, Grüße Zoë; Привет, мир! Ελληνικά مرحبا שלום हिन्दी ภาษาไทย",
    "한국어 텍스트 日本語のテキスト。中文文本，标点符号！",
    "😀👍🏽👨\u200d👩\u200d👧\u200d👦 🇫🇷 ✓ ★ ♥ ∑ ∞ ≠ √ → ⇒",
    "ﬁ ﬂ ﬀ ① ² ³ ｆｕｌｌ ｗｉｄｔｈ Ⅻ ㎏ ℌ ｶﾀｶﾅ e\u0301 é \u212b Å \u2126 ™ …",
    "a\u00a0b\u2028c\u2029d\u3000e\x85f\x0bg\x0ch\x1c\x1d\x1e\x1fi\u200b\u200c\u200d\ufeffj",
    "1234567890 3.14159 1e-10 0x1F 1,000,000 ٣٤٥ ১২৩ 123456789012345678901234567890",
    "I'm you're he's we'll they've she'd IT'S YOU'RE DON'T 's 'S 'll '' 'x",
    "def f(x):\n    return {\"a\": [1, 2], 'b': x ** 2}  # comment\n\n\nclass A:\n\tpass\n",
    'if (a && b) { c = d->e[0]; } // <html class="x">&amp;</html> $x = @y; %z',
    "...!!!???---___***  “quotes” ‘single’ «guillemets» — dash … ellipsis ¿¡",
    "\x00\x01\x02 nul \x7f\x80\x9f ÿ \\u0000 \\n",
    "<|endoftext|> </s> <s> [INST] <unk> <pad> <|im_start|>user <mask> [CLS]",
    "Supercalifragilisticexpialidocious" * 40,
    "a" * 5000 + " " + "ab" * 3000 + " " * 1000 + "\n" * 300,
    "ﷺ ﷽ " + "\u0300" * 20 + "a\u0301\u0302\u0303 Z̤̈ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟘𝟙𝟚 𠀀𠀁 \U0001f600\U0001f3fd",
    "ᄀ각 한\u1100\u1161\u11a8 \u1100\u1161 ᄒᆞᆫ 가\u0300 \u0958\u093c \u0915\u093c \u1e0b\u0323",
    "<|endoftext|>\u0338 </s>\u0338 ＜|endoftext|＞ ＜/s＞ <s\u0338",
)


def _assigned(code_points: range) -> list[str]:
    """The characters of ``code_points`` that ``unicodedata`` knows (the guard routes others)."""
    return [chr(c) for c in code_points if unicodedata.category(chr(c)) not in ("Cn", "Cs")]


def probe_texts(added_tokens: list[str]) -> list[str]:
    """The fixed probe set plus a code-point sweep (in chunks, assigned code points only: a
    chunk with a code point of the guard's is encoded by the reference) and every added token
    written literally."""
    texts = list(_PROBES)
    for start in range(0, 0x3100, 0x400):
        texts.append(" ".join(f"a{ch}b" for ch in _assigned(range(start, start + 0x400))))
    for start in range(0x3100, 0x30000, 0x4000):
        texts.append("".join(_assigned(range(start, start + 0x4000, 7))))
    if added_tokens:
        texts.append(" ".join(f"x{t}y {t}{t}\n{t}" for t in sorted(added_tokens)))
    return texts


def probes_digest(probes: list[str]) -> str:
    """sha256 of the probe set (recorded; the speculation must have probed the same texts)."""
    return hashlib.sha256(orjson.dumps(probes)).hexdigest()
