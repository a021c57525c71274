"""Target-text normalisation and splitting, as the official CosyVoice3 frontend does it.

Two settings (profile key ``text.normalizer``):

* ``wetext`` (the default): what the official frontend does with ``wetext`` installed (its
  requirements pin it; 0.1.x carries its grammars in the wheel and works offline).
* ``none``: what it does with no normaliser at all (no ttsfrd, no wetext) -- how the parity
  fixtures were made, so every comparison with them uses it.

English: strip -> ``wetext.Normalizer().normalize`` (``wetext`` only) -> every digit run still
left read by ``inflect``'s ``number_to_words`` -> ``split_paragraph`` counting *tokenizer
tokens*. Chinese (any CJK ideograph present): strip -> wetext (``wetext`` only) -> newlines
dropped -> blanks between non-ASCII characters dropped -> ``²``/``³`` -> 平方/立方 -> ``.`` ->
``。`` -> `` - `` -> ``，`` -> brackets removed -> trailing commas -> ``。`` -> ``split_paragraph``
counting *characters*. Pieces made only of punctuation/symbols are dropped. Text holding both
``<|`` and ``|>`` (markup) is passed through untouched.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import unicodedata
from itertools import groupby
from typing import Callable, Literal, Sequence, get_args

__all__ = [
    "NORMALIZERS",
    "PROMPT_PREFIX",
    "TextNormalizer",
    "contains_chinese",
    "has_speech",
    "is_only_punctuation",
    "normalize_text",
    "prepare_normalizer",
    "prompt_text_for",
    "spell_out_number",
    "split_paragraph",
    "split_target_text",
    "wetext_normalize",
]

log = logging.getLogger("cosybatch.text")

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


# ---------------------------------------------------------------- engines -----------------
# The profile's ``text.normalizer``: what the official frontend would find installed.
TextNormalizer = Literal["wetext", "none"]
NORMALIZERS: tuple[str, ...] = get_args(TextNormalizer)

# wetext and inflect keep per-call state on shared objects (inflect's engine stores the
# arguments of the call in progress; wetext fills its grammar cache on first use), and the
# frontend prepares texts on several worker threads: one text is normalised at a time.
_LOCK = threading.Lock()


@functools.cache
def _wetext():
    """The one ``wetext.Normalizer`` of the process, built on first use: the official frontend
    builds its two (zh with remove_erhua=False, en) with wetext's defaults -- language detected,
    text normalisation -- which makes them the same normaliser."""
    import wetext

    return wetext.Normalizer()


@functools.cache
def _inflect():
    import inflect

    return inflect.engine()


def prepare_normalizer(normalizer: TextNormalizer) -> None:
    """Import and build what ``normalize_text`` will use under ``normalizer``, so that the first
    row does not wait for it: wetext's normaliser; without one, inflect (every digit reaches it
    then; wetext leaves it few, and its import alone takes 1-3 s, paid only when one comes)."""
    _check_normalizer(normalizer)
    with _LOCK:
        if normalizer == "wetext":
            _wetext()
        else:
            _inflect()


def spell_out_number(text: str) -> str:
    """Every maximal run of ``str.isdigit()`` characters replaced by inflect's
    ``number_to_words`` (official ``spell_out_number``). Two departures where the official
    raises: a digit that is not ASCII (``²``) is read as its value, and a run too long for
    inflect is read digit by digit."""
    if not any(c.isdigit() for c in text):  # nothing to read: inflect's import (~1-3 s) not paid
        return text
    import inflect

    out = []
    for is_digit, run in groupby(text, key=str.isdigit):
        run_text = "".join(run)
        if not is_digit:
            out.append(run_text)
            continue
        digits = "".join(str(unicodedata.digit(c)) for c in run_text)
        try:
            out.append(_inflect().number_to_words(digits))
        except inflect.NumOutOfRangeError:
            out.append(" ".join(_inflect().number_to_words(d) for d in digits))
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


def _chinese_rules(text: str) -> str:
    text = text.replace("\n", "")
    text = _drop_blanks_between_non_ascii(text)
    text = text.replace("²", "平方").replace("³", "立方")
    text = text.replace(".", "。").replace(" - ", "，")
    text = text.replace("（", "").replace("）", "").replace("【", "").replace("】", "")
    text = text.replace("`", "").replace("——", " ")
    return re.sub(r"[，,、]+$", "。", text)


def _check_normalizer(normalizer: str) -> None:
    if normalizer not in NORMALIZERS:
        raise ValueError(f"text normalizer must be one of {', '.join(NORMALIZERS)}, got {normalizer!r}")


def wetext_normalize(text: str) -> str:
    """wetext's reading of ``text`` (a module-level function, so that a helper process can run it)."""
    return _wetext().normalize(text)


def normalize_text(text: str, normalizer: TextNormalizer, helper=None) -> tuple[str, str]:
    """(the whole target text as the official frontend normalises it before splitting, its
    language: ``zh`` or ``en``). The language is decided on the raw text, as the official does.
    ``helper``: a ``cosybatch.helper_process.HelperProcess`` that runs wetext (pure-Python work
    that would hold this process's GIL for ~2.5 ms a sentence) outside this process, with the
    same result; None runs it here."""
    _check_normalizer(normalizer)
    text = text.strip()
    lang = "zh" if contains_chinese(text) else "en"
    with _LOCK:
        if normalizer == "wetext" and text:
            try:
                text = helper.run(wetext_normalize, text) if helper is not None else wetext_normalize(text)
            except Exception as e:
                # wetext 0.1.8 fails an internal assertion on some texts ("Item #1 is ready.",
                # "100+ people"), where the official frontend would fail the request; a bulk run
                # reads such a text as without a normaliser instead, and says so.
                log.warning("wetext cannot normalize %r (%s); read without a normalizer",
                            text[:80], type(e).__name__)
        if lang == "zh":
            return _chinese_rules(text), lang
        return spell_out_number(text), lang


def split_target_text(text: str, tokenizer, *, normalizer: TextNormalizer, token_max_n: int = 80,
                      token_min_n: int = 60, merge_len: int = 20, helper=None) -> list[str]:
    """The target text as the official frontend hands it to the model: a list of pieces,
    each synthesised as its own request. Empty or punctuation-only input gives ``[]``.
    ``normalizer`` has no default on purpose: a caller comparing with the fixtures needs
    ``none``, a user run ``wetext``; neither should be picked by omission. ``helper``: see
    ``normalize_text``."""
    tokenize = tokenizer.encode if hasattr(tokenizer, "encode") else tokenizer
    _check_normalizer(normalizer)
    if "<|" in text and "|>" in text:  # markup: the official skips normalisation and splitting
        return [text] if text.strip() else []
    if not text.strip():
        return []
    norm, lang = normalize_text(text, normalizer, helper)
    pieces = split_paragraph(norm, tokenize, lang, token_max_n, token_min_n, merge_len)
    return [p for p in pieces if not is_only_punctuation(p)]


def has_speech(text: str, normalizer: TextNormalizer) -> bool:
    """Whether ``split_target_text`` leaves anything to synthesise, without a tokenizer and,
    for nearly every row, without running the normaliser (~5 ms a sentence: minutes over a
    large manifest). A text with a letter or a digit always keeps one: digits become words,
    letters stay letters (or become words) under both settings, and a piece holding a letter
    is not punctuation. Only texts without any (punctuation, symbols, emoji, blanks) are
    normalised -- ``$`` reads ``dollar`` under wetext -- and split: a piece survives by its own
    characters whatever the splitter packs it with, so the token counts do not matter."""
    _check_normalizer(normalizer)
    if "<|" in text and "|>" in text:
        return bool(text.strip())
    if any(unicodedata.category(c)[0] in "LN" for c in text):
        return True
    return bool(split_target_text(text, list, normalizer=normalizer))
