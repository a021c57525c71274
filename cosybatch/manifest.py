"""Seed-TTS manifests (``meta.lst``): parsing and validation with ``file:line`` reasons.

A row is ``utt_id|prompt_text|prompt_wav|target_text[|extra]``; ``extra``, when present, is
an audio file name (Seed-TTS lists carry the ground-truth recording there) and is not read.
Everything is checked before any model work so that a 100k-row run never dies on row 73,412
because of a typo, or on a row that can only fail: bad rows become :class:`Problem`s, good
rows become :class:`ManifestRow`s.
"""

from __future__ import annotations

import os
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

from cosybatch.text.normalize import TextNormalizer, has_speech

MIN_PROMPT_SR = 16000
MAX_PROMPT_SECONDS = 30.0
# A prompt must be longer than one speech-token period (1/25 s): at 40 ms the frontend has no
# room to reflect-pad the 24 kHz prompt mel, one sample more gives one token and a speaker
# embedding (measured sample by sample at 16-48 kHz with the reference frontend and the tiny
# fixture checkpoint, scripts/min_prompt.py; docs/design.md D23). Compared in whole
# frames: frames / rate <= 1 / MIN_PROMPT_PER_SECOND.
MIN_PROMPT_PER_SECOND = 25
# What may follow the target text: an audio file's name (by its extension). Anything else
# means the target text held a '|' and the row would be cut there.
AUDIO_SUFFIXES = frozenset({".wav", ".flac", ".mp3", ".ogg", ".oga", ".opus", ".m4a", ".aac", ".aif", ".aiff",
                            ".aifc", ".au", ".snd", ".caf", ".w64", ".rf64", ".sph", ".nist", ".wv", ".webm", ".pcm"})
# Leaves room for the audio suffix (".flac" at most) and the writer's temp-file decoration
# inside NAME_MAX (255 bytes).
MAX_UTT_ID_BYTES = 200
_REQUIRED = ("utt_id", "prompt_text", "prompt_wav", "target_text")
_BOM = b"\xef\xbb\xbf"


class ManifestError(Exception):
    """The manifest as a whole cannot be used (unreadable file)."""


@dataclass(frozen=True)
class Problem:
    path: str
    line: int
    reason: str
    utt_id: str | None = None

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass(frozen=True)
class ManifestRow:
    utt_id: str
    prompt_text: str
    prompt_wav: Path  # resolved against the manifest's folder
    target_text: str
    extra: str | None = None
    line: int = 0
    prompt_sr: int = 0
    prompt_s: float = 0.0
    prompt_size: int = 0
    prompt_mtime_ns: int = 0


@dataclass
class Manifest:
    path: str
    rows: list[ManifestRow] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    @property
    def n_lines(self) -> int:
        """Data lines seen (good rows plus lines with at least one problem)."""
        return len(self.rows) + len({p.line for p in self.problems})

    def problems_by_line(self) -> dict[int, list[Problem]]:
        out: dict[int, list[Problem]] = {}
        for p in self.problems:
            out.setdefault(p.line, []).append(p)
        return out


@dataclass(frozen=True)
class PromptInfo:
    sample_rate: int
    seconds: float
    size: int
    mtime_ns: int


def unsafe_id_reason(utt_id: str) -> str | None:
    """Why ``utt_id`` cannot be used as a file name in OUT (``<utt_id>.wav`` and the like), or None."""
    if "/" in utt_id or "\\" in utt_id:
        return "contains a path separator"
    if ".." in utt_id:
        return "contains '..'"
    if utt_id.startswith("."):
        return "starts with '.' (hidden file)"
    for ch in utt_id:
        if unicodedata.category(ch) in ("Cc", "Cs", "Zl", "Zp"):
            return f"contains control character U+{ord(ch):04X}"
    if len(utt_id.encode("utf-8", "surrogatepass")) > MAX_UTT_ID_BYTES:
        return f"is longer than {MAX_UTT_ID_BYTES} bytes"
    return None


def probe_prompt(path: Path) -> PromptInfo | str:
    """Header-only look at a prompt WAV: its info, or the reason it cannot be used."""
    import soundfile as sf

    try:
        st = os.stat(path)
    except FileNotFoundError:
        return f"prompt wav not found: {path}"
    except (OSError, ValueError) as e:  # ValueError: embedded NUL in the path
        return f"prompt wav unreadable: {path} ({_short(e)})"
    if not os.path.isfile(path):
        return f"prompt wav is not a regular file: {path}"
    if st.st_size == 0:
        return f"prompt wav is empty (0 bytes): {path}"
    try:
        info = sf.info(str(path))
    except Exception as e:  # libsndfile raises RuntimeError/LibsndfileError/TypeError variants
        return f"prompt wav unreadable: {path} ({_short(e)})"
    if info.frames <= 0 or info.samplerate <= 0:
        return f"prompt wav is empty (no audio frames): {path}"
    if info.samplerate < MIN_PROMPT_SR:
        return f"prompt wav sample rate {info.samplerate} Hz is below {MIN_PROMPT_SR} Hz: {path}"
    seconds = info.frames / info.samplerate
    if seconds > MAX_PROMPT_SECONDS:
        return f"prompt wav is {seconds:.1f} s long, over the {MAX_PROMPT_SECONDS:g} s limit: {path}"
    if info.frames * MIN_PROMPT_PER_SECOND <= info.samplerate:
        return (f"prompt wav is {seconds * 1000:.1f} ms long; a prompt must be longer than "
                f"{1000 // MIN_PROMPT_PER_SECOND} ms to give a speech token: {path}")
    return PromptInfo(int(info.samplerate), float(seconds), int(st.st_size), int(st.st_mtime_ns))


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return msg[:200]


def _clip(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _decode(raw: bytes) -> tuple[str | None, str | None]:
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as e:
        return None, f"line is not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"


def _resolve(base_dir: Path, raw: str) -> Path:
    p = Path(os.path.expanduser(raw))
    return p if p.is_absolute() else base_dir / p


def is_audio_name(field: str) -> bool:
    return Path(field).suffix.lower() in AUDIO_SUFFIXES


def parse_manifest_bytes(data: bytes, source: str, base_dir: Path, normalizer: TextNormalizer = "wetext") -> Manifest:
    """Parse manifest bytes; never raises, every defect becomes a Problem. ``normalizer``: the
    run's ``text.normalizer``, which decides whether a target leaves anything to synthesize."""
    man = Manifest(path=source)
    if data.startswith(_BOM):
        data = data[len(_BOM):]
    probed: dict[Path, PromptInfo | str] = {}
    first_line_of: dict[str, int] = {}
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        text, err = _decode(raw)
        if err is not None:
            man.problems.append(Problem(source, lineno, err))
            continue
        stripped = text.strip()
        if not stripped or stripped.startswith("#"):
            continue
        fields = [f.strip() for f in text.split("|")]
        if len(fields) == 5 and not fields[4]:
            fields = fields[:4]  # a trailing '|' is a harmless slip, not a missing field
        if len(fields) < 4:
            man.problems.append(Problem(
                source, lineno,
                f"expected 4 or 5 '|'-separated fields (utt_id|prompt_text|prompt_wav|target_text[|audio file]),"
                f" found {len(fields)}"))
            continue
        if len(fields) > 5 or (len(fields) == 5 and not is_audio_name(fields[4])):
            # Never cut the text: the row is refused with the rest of the line in view.
            rest = "|".join(fields[3:])
            man.problems.append(Problem(
                source, lineno,
                f"the target text contains '|' ({_clip(rest)!r}); only an audio file name may follow it "
                f"as a 5th field -- write the text without '|'"))
            continue
        row_problems = _check_fields(fields, source, lineno)
        if fields[3] and not has_speech(fields[3], normalizer):
            row_problems.append(Problem(source, lineno, f"target text has nothing to synthesize after "
                                        f"normalization ({normalizer}): {_clip(fields[3])!r}"))
        utt_id = fields[0]
        if utt_id:
            if utt_id in first_line_of:
                row_problems.append(Problem(
                    source, lineno, f"duplicate utt_id '{utt_id}' (first seen at line {first_line_of[utt_id]})"))
            else:
                first_line_of[utt_id] = lineno
        info: PromptInfo | str | None = None
        if fields[2]:
            wav = _resolve(base_dir, fields[2])
            if wav not in probed:
                probed[wav] = probe_prompt(wav)
            info = probed[wav]
            if isinstance(info, str):
                row_problems.append(Problem(source, lineno, info))
        if row_problems:
            man.problems.extend(Problem(p.path, p.line, p.reason, utt_id or None) for p in row_problems)
            continue
        assert isinstance(info, PromptInfo)
        man.rows.append(ManifestRow(
            utt_id=utt_id, prompt_text=fields[1], prompt_wav=_resolve(base_dir, fields[2]),
            target_text=fields[3], extra=fields[4] if len(fields) == 5 else None, line=lineno,
            prompt_sr=info.sample_rate, prompt_s=info.seconds, prompt_size=info.size,
            prompt_mtime_ns=info.mtime_ns))
    return man


def _check_fields(fields: list[str], source: str, lineno: int) -> list[Problem]:
    out = [Problem(source, lineno, f"empty field: {name}")
           for name, value in zip(_REQUIRED, fields) if not value]
    if fields[0]:
        why = unsafe_id_reason(fields[0])
        if why:
            out.append(Problem(source, lineno, f"utt_id {fields[0]!r} is not a safe file name: {why}"))
    return out


def read_manifest(path: str | os.PathLike, normalizer: TextNormalizer = "wetext") -> Manifest:
    """Read and validate a manifest file; ManifestError only if the file itself is unusable."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except IsADirectoryError:
        raise ManifestError(f"{p}: is a directory, not a manifest file") from None
    except FileNotFoundError:
        raise ManifestError(f"{p}: manifest not found") from None
    except OSError as e:
        raise ManifestError(f"{p}: cannot read manifest ({_short(e)})") from None
    # The manifest's own folder (not a symlink target) anchors relative prompt paths.
    return parse_manifest_bytes(data, str(p), p.absolute().parent, normalizer)
