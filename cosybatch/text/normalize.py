"""Target-text normalisation and splitting, as the official frontend does it without a
text-normalisation engine (no ttsfrd, no wetext: wetext downloads its grammars at
construction, so an offline official install falls back to exactly this path).

English: strip -> digits spelled out (inflect's ``number_to_words``) -> ``split_paragraph``
counting *tokenizer tokens*.  Chinese (any CJK ideograph present): strip -> newlines dropped ->
blanks between non-ASCII characters dropped -> ``²``/``³`` -> 平方/立方 -> ``.`` -> ``。`` ->
`` - `` -> ``，`` -> brackets removed -> trailing commas -> ``。`` -> ``split_paragraph``
counting *characters*.  Pieces made only of punctuation/symbols are dropped.
"""

from __future__ import annotations

import re
import unicodedata
from itertools import groupby
from typing import Callable, Sequence

__all__ = [
    "PROMPT_PREFIX",
    "contains_chinese",
    "is_only_punctuation",
    "number_to_words",
    "prompt_text_for",
    "spell_out_number",
    "split_paragraph",
    "split_target_text",
]

PROMPT_PREFIX = "You are a helpful assistant.<|endofprompt|>"
_ENDOFPROMPT = "<|endofprompt|>"

_CHINESE = re.compile(r"[\u4e00-\u9fff]+")
_EN_STOPS = (".", "?", "!", ";", ":")
_ZH_STOPS = ("。", "？", "！", "；", "：", "、", ".", "?", "!", ";")
_COMMAS = ("，", ",")
_CLOSING_QUOTES = ('"', "”")


def prompt_text_for(transcript: str) -> str:
    """The LLM prompt text for a zero-shot prompt transcript (CV3 convention).

    Passed through raw, as the official frontend does (it skips normalisation for text that
    contains ``<|...|>``). A transcript that already carries ``<|endofprompt|>`` (an
    instruction-style prompt) is used as is.
    """
    if _ENDOFPROMPT in transcript:
        return transcript
    return PROMPT_PREFIX + transcript


def contains_chinese(text: str) -> bool:
    return bool(_CHINESE.search(text))


def is_only_punctuation(text: str) -> bool:
    """True for strings made only of Unicode punctuation/symbols (or empty); spaces count as content,
    as in the official ``^[\\p{P}\\p{S}]*$``."""
    return all(unicodedata.category(c)[0] in "PS" for c in text)


# ---------------------------------------------------------------- numbers -----------------
_UNITS = ["", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
_TEENS = ["ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_SCALES = ["", "thousand", "million", "billion", "trillion", "quadrillion", "quintillion",
           "sextillion", "septillion", "octillion", "nonillion", "decillion"]  # fmt: skip


def _below_hundred(n: int) -> str:
    if n < 10:
        return _UNITS[n]
    if n < 20:
        return _TEENS[n - 10]
    return _TENS[n // 10] + ("-" + _UNITS[n % 10] if n % 10 else "")


def _below_thousand(n: int) -> str:
    hundreds, rest = divmod(n, 100)
    if not hundreds:
        return _below_hundred(rest)
    return f"{_UNITS[hundreds]} hundred" + (f" and {_below_hundred(rest)}" if rest else "")


def number_to_words(digits: str) -> str:
    """inflect's ``engine().number_to_words`` for a plain digit string (its defaults): groups
    of three joined by ", ", and "and" before a final group below one hundred
    ("1986" -> "one thousand, nine hundred and eighty-six", "1001" -> "one thousand and one")."""
    n = int(digits)
    if n == 0:
        return "zero"
    groups = []
    while n:
        n, g = divmod(n, 1000)
        groups.append(g)
    if len(groups) > len(_SCALES):  # inflect raises here; read such runs digit by digit
        return " ".join(number_to_words(d) for d in str(int(digits)))
    words = [
        (_below_thousand(g) + (" " + _SCALES[i] if i else ""))
        for i, g in reversed(list(enumerate(groups)))
        if g
    ]
    last = groups[0]
    if len(words) > 1 and 0 < last < 100:
        return ", ".join(words[:-1]) + " and " + words[-1]
    return ", ".join(words)


def spell_out_number(text: str) -> str:
    """Every maximal run of ``str.isdigit()`` characters replaced by its English words
    (official ``spell_out_number``)."""
    out = []
    for is_digit, run in groupby(text, key=str.isdigit):
        run_text = "".join(run)
        if is_digit:
            # unicodedata.digit maps e.g. "²" to 2; the official passes it to int() and crashes.
            out.append(number_to_words("".join(str(unicodedata.digit(c)) for c in run_text)))
        else:
            out.append(run_text)
    return "".join(out)


# ---------------------------------------------------------------- splitting ---------------
def split_paragraph(
    text: str,
    tokenize: Callable[[str], Sequence[int]],
    lang: str = "zh",
    token_max_n: int = 80,
    token_min_n: int = 60,
    merge_len: int = 20,
    comma_split: bool = False,
) -> list[str]:
    """Official ``split_paragraph``: cut after each stop mark (keeping a closing quote with
    its sentence; the space after the mark starts the next piece), then greedily pack pieces:
    a new segment starts when adding a piece would exceed ``token_max_n`` and the current one
    already has more than ``token_min_n``; a tail shorter than ``merge_len`` joins the
    previous segment. Lengths are characters for ``zh``, tokens otherwise."""
    if not text:
        return []

    def length(s: str) -> int:
        return len(s) if lang == "zh" else len(tokenize(s))

    stops = list(_ZH_STOPS if lang == "zh" else _EN_STOPS)
    if comma_split:
        stops.extend(_COMMAS)
    if text[-1] not in stops:
        text += "。" if lang == "zh" else "."

    pieces: list[str] = []
    start = 0
    for i, c in enumerate(text):
        if c not in stops:
            continue
        if i > start:
            pieces.append(text[start:i] + c)
        if i + 1 < len(text) and text[i + 1] in _CLOSING_QUOTES:
            if pieces:  # the official pops unconditionally; a lone ".\"" would crash it
                pieces[-1] += text[i + 1]
            start = i + 2
        else:
            start = i + 1

    segments: list[str] = []
    cur = ""
    for piece in pieces:
        if length(cur + piece) > token_max_n and length(cur) > token_min_n:
            segments.append(cur)
            cur = ""
        cur += piece
    if cur:
        if segments and length(cur) < merge_len:
            segments[-1] += cur
        else:
            segments.append(cur)
    return segments


# ---------------------------------------------------------------- chinese rules -----------
def _drop_blanks_between_non_ascii(text: str) -> str:
    """Official ``replace_blank``: a space survives only between two ASCII non-space chars."""
    out = []
    for i, c in enumerate(text):
        if c == " ":
            prev = text[i - 1] if i > 0 else ""
            nxt = text[i + 1] if i + 1 < len(text) else ""
            if prev.isascii() and prev not in ("", " ") and nxt.isascii() and nxt not in ("", " "):
                out.append(c)
        else:
            out.append(c)
    return "".join(out)


def _normalize_zh(text: str) -> str:
    text = text.replace("\n", "")
    text = _drop_blanks_between_non_ascii(text)
    text = text.replace("²", "平方").replace("³", "立方")
    text = text.replace(".", "。").replace(" - ", "，")
    text = text.replace("（", "").replace("）", "").replace("【", "").replace("】", "")
    text = text.replace("`", "").replace("——", " ")
    return re.sub(r"[，,、]+$", "。", text)


def split_target_text(text: str, tokenizer, token_max_n: int = 80, token_min_n: int = 60, merge_len: int = 20) -> list[str]:
    """The target text as the official frontend hands it to the model: a list of pieces,
    each synthesised as its own request. Empty or punctuation-only input gives ``[]``."""
    tokenize = tokenizer.encode if hasattr(tokenizer, "encode") else tokenizer
    if "<|" in text and "|>" in text:  # markup: the official skips normalisation and splitting
        return [text] if text.strip() else []
    text = text.strip()
    if not text:
        return []
    if contains_chinese(text):
        pieces = split_paragraph(_normalize_zh(text), tokenize, "zh", token_max_n, token_min_n, merge_len)
    else:
        pieces = split_paragraph(spell_out_number(text), tokenize, "en", token_max_n, token_min_n, merge_len)
    return [p for p in pieces if not is_only_punctuation(p)]
