"""A row's output as one unit, for every way rows are run (``synth``, its ``--devices`` workers, the
Ray stage): when a row counts as done, and how a finished row is committed.

A row is done when its latest ledger record is ok for the same inputs and the audio file that record
names is in OUT, whole (the size the ledger recorded). Committing writes the file first (atomically)
and its ok line second; when the line cannot be written the file is taken back, so a file under a
row's final name always has its ok line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cosybatch.atomic import OutputFault, remove_quietly
from cosybatch.manifest import ManifestRow
from cosybatch.output.audio_files import AudioFormat, audio_name, format_of, write_audio_atomic
from cosybatch.output.records import input_key, ok_record


class RowFailed(Exception):
    """This row alone could not be finished (its result, its encoding or its file); ``error`` is
    why. The run goes on. (A full disk is an OutputFault instead, and stops the run.)"""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def recorded_file(rec: dict[str, Any]) -> tuple[Any, Any]:
    """(file name, size) an ok record names; ledgers written before other formats existed say
    ``wav``/``wav_bytes``."""
    if "file" in rec:
        return rec.get("file"), rec.get("file_bytes")
    return rec.get("wav"), rec.get("wav_bytes")


def file_intact(out_dir: Path, utt_id: str, rec: dict[str, Any]) -> bool:
    """``rec`` is ok and the audio file it names (the row's, in some format) is in OUT, whole."""
    if rec.get("status") != "ok":
        return False
    name, size = recorded_file(rec)
    if not isinstance(name, str) or format_of(utt_id, name) is None:
        return False
    try:
        return (Path(out_dir) / name).stat().st_size == size
    except OSError:
        return False


def finished_with_inputs(row: ManifestRow, rec: dict[str, Any], out_dir: Path) -> bool:
    """The row's latest ledger record is ok, for these inputs, and its file is intact. Settings are
    not compared: a file in another format is still "done", so that resume can refuse the change
    instead of silently mixing formats in one OUT."""
    return rec.get("input") == input_key(row) and file_intact(out_dir, row.utt_id, rec)


def finish_row(out_dir: Path, row: ManifestRow, result: Any, elapsed: float | None, fp_sha: str,
               audio: AudioFormat, ledger: Any, tag: str = "", helper: Any = None) -> dict[str, Any]:
    """Commit a synthesizer's result: the row's audio file, then its ok ledger line; returns the
    record. Raises RowFailed for this row's own problems; an OutputFault propagates. ``helper``:
    a ``cosybatch.helper_process.HelperProcess`` that encodes the file (loudness measurement
    included) outside this process, with the same bytes; None encodes here."""
    if isinstance(result, BaseException):
        raise RowFailed(result)
    try:
        rec, samples = ok_record(row, result, elapsed, fp_sha)
        encoded = (helper.run(audio.encode, samples, rec["sample_rate"]) if helper is not None
                   else audio.encode(samples, rec["sample_rate"]))
    except Exception as e:
        raise RowFailed(e) from e
    name = audio_name(row.utt_id, audio.format)
    rec = {**rec, **encoded.info, "file": name}  # rate and duration are now the file's
    final = Path(out_dir) / name
    try:
        rec["file_bytes"] = write_audio_atomic(final, encoded, tag)
    except OSError as e:  # this one file's problem (a name taken by a folder, ...)
        raise RowFailed(e) from e
    try:
        ledger.append(rec)
    except OutputFault:
        remove_quietly(final)
        raise
    return rec
