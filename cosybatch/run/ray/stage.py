"""The stateful Ray Data stage: one synthesizer per actor, every row committed into OUT.

``SynthStage`` is the callable class given to ``Dataset.map_batches`` (``batch_format=
"pyarrow"``). Each actor builds its engine once, commits rows exactly as ``synth`` does
(``cosybatch.output.rows``: the audio file atomically, then its ledger line) and appends to
its own ledger part, ``ledger.ray-<actor id>.jsonl``, in the record shape ``runner`` writes,
so resume, ``check`` and ``merge`` read a Ray run like any other. It returns the input batch
with result columns added, one output row per input row.

Ray's fault tolerance does the rest: an actor whose process dies is restarted (same actor
id, so the same ledger part) and its batch retried; the new incarnation first reads its part
and returns the rows its predecessor already committed instead of synthesizing them again.
"""

from __future__ import annotations

import logging
import os
import platform
from pathlib import Path
from typing import Any

from cosybatch.manifest import ManifestRow, probe_prompt, unsafe_id_reason
from cosybatch.run.resume import explain_change, fingerprint_sha, run_fingerprint
from cosybatch.output.records import base_record, one_by_one
from cosybatch.output.rows import RowFailed, finish_row, finished_with_inputs, recorded_file
from cosybatch.run.synth import SettingsChanged
from cosybatch.run.options import SynthOptions
from cosybatch.atomic import OutputFault, remove_stale_tmp
from cosybatch.output.ledger import Ledger, latest_rows, read_ledger

log = logging.getLogger("cosybatch.run.ray.api")

INPUT_COLUMNS = ("utt_id", "prompt_text", "prompt_wav", "target_text")
# Written into OUT by a driver that was interrupted, before it disconnects: Ray stops the run's
# actors asynchronously, and an actor mid-row must not commit that row after the driver has
# reported what is done. The next run's driver removes it before its actors start.
STOP_FILE = ".cosybatch-ray-stop"
# (name, arrow type name): what every output row gains; same-named input columns are replaced.
# ``file`` is the audio file's path in whatever format; ``wav`` the same, under the name it had when
# every file was a WAV (kept for pipelines that read it).
RESULT_COLUMNS = (("status", "string"), ("file", "string"), ("wav", "string"), ("audio_s", "float64"),
                  ("tokens", "int64"), ("total_s", "float64"), ("reason", "string"))


def _result(status: str, file: str | None = None, audio_s: float | None = None, tokens: int | None = None,
            total_s: float | None = None, reason: str | None = None) -> dict[str, Any]:
    return {"status": status, "file": file, "wav": file, "audio_s": audio_s, "tokens": tokens,
            "total_s": total_s, "reason": reason}


def settings_changed_message(done_fps: dict[str, Any], fp: dict[str, Any], out: Path) -> str:
    lines = [f"{out} already holds rows made with different settings; refusing to mix outputs."]
    for sha, old in sorted(done_fps.items()):
        lines.append(f"  rows from settings {sha}:")
        lines.extend(f"    {d}" for d in explain_change(old, fp))
    lines.append("Re-run with --overwrite (overwrite=True) to redo every row, or choose another output folder.")
    return "\n".join(lines)


def settings_of(synth: Any, options: SynthOptions) -> tuple[bool, dict[str, Any]]:
    """(stream, fingerprint): exactly the runner's, so `synth` resumes a Ray run's OUT and vice versa."""
    stream = options.stream_for(synth)
    native = getattr(synth, "sample_rate", None)
    return stream, run_fingerprint(synth.fingerprint(), stream, options.audio_format(), native)


def refuse_other_settings(done_fps: dict[str, Any], fp: dict[str, Any], out: Path, overwrite: bool) -> None:
    other = {sha: old for sha, old in done_fps.items() if sha != fingerprint_sha(fp)}
    if other and not overwrite:
        raise SettingsChanged(settings_changed_message(other, fp, out))


def check_settings(options: SynthOptions, device: str, done_fps: dict[str, Any], out: str) -> None:
    """A Ray task for a run with nothing left to do: still refuse a changed setting, as synth does."""
    synth = options.build(device)
    try:
        refuse_other_settings(done_fps, settings_of(synth, options)[1], Path(out), options.overwrite)
    finally:
        close = getattr(synth, "close", None)
        if callable(close):
            close()


class SynthStage:
    """``map_batches`` callable class: synthesizes a batch of manifest-shaped rows into ``out``.

    ``done_fps``: settings fingerprint sha -> fingerprint of the rows OUT already holds; any
    other than this actor's stops it before it writes anything (as ``synth`` refuses).
    ``done``: utt_id -> ledger record of rows finished before, returned as ``skipped``
    (the CLI filters those rows out before scheduling and passes none).
    """

    def __init__(self, options: SynthOptions, out: str, device: str, done_fps: dict[str, Any] | None = None,
                 done: dict[str, dict[str, Any]] | None = None, base_dir: str | None = None):
        self.options, self.out = options, Path(out)
        self.base_dir = Path(base_dir) if base_dir else Path.cwd()
        self.synth = options.build(device)
        self.stream, self.fp = settings_of(self.synth, options)
        self.audio = options.audio_format()
        self.audio.prepare()
        self.fp_sha = fingerprint_sha(self.fp)
        refuse_other_settings(done_fps or {}, self.fp, self.out, options.overwrite)
        self.done = done or {}
        self.tag = f".ray-{_actor_id()}"
        self.ledger_path = self.out / f"ledger{self.tag}.jsonl"
        restarted = self.ledger_path.exists()  # only a restarted actor finds its part there
        self.mine = self._committed_before() if restarted else {}
        remove_stale_tmp(self.out, self.tag)
        self.ledger = Ledger(self.ledger_path)
        self.ledger.append({"event": "run_start", "fp": self.fp_sha, "fingerprint": self.fp, "shard": "ray",
                            "argv": list(options.argv), "pid": os.getpid(), "host": platform.node(),
                            "restarted": restarted})
        self._probed: dict[Path, Any] = {}

    def _committed_before(self) -> dict[str, dict[str, Any]]:
        """Rows an earlier incarnation of this actor (before a restart) wrote into its part."""
        return {u: r for u, r in latest_rows(list(read_ledger(self.ledger_path))).items()
                if r.get("status") == "ok" and r.get("fp") == self.fp_sha}

    # -- rows in -------------------------------------------------------------------------

    def _row(self, fields: dict[str, Any], line: int) -> ManifestRow | str:
        """The row as ``synth`` would have read it from a manifest, or why it cannot run."""
        values = {k: "" if fields.get(k) is None else str(fields[k]).strip() for k in INPUT_COLUMNS}
        empty = [k for k in INPUT_COLUMNS if not values[k]]
        if empty:
            return f"empty field(s): {', '.join(empty)}"
        why = unsafe_id_reason(values["utt_id"])
        if why:
            return f"utt_id {values['utt_id']!r} is not a safe file name: {why}"
        wav = Path(os.path.expanduser(values["prompt_wav"]))
        wav = wav if wav.is_absolute() else self.base_dir / wav
        if wav not in self._probed:
            self._probed[wav] = probe_prompt(wav)
        info = self._probed[wav]
        if isinstance(info, str):
            return info
        return ManifestRow(values["utt_id"], values["prompt_text"], wav, values["target_text"], line=line,
                           prompt_sr=info.sample_rate, prompt_s=info.seconds, prompt_size=info.size,
                           prompt_mtime_ns=info.mtime_ns)

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa

        cols = {k: batch.column(k).to_pylist() if k in batch.column_names else [None] * batch.num_rows
                for k in (*INPUT_COLUMNS, "line")}
        results: list[dict[str, Any] | None] = [None] * batch.num_rows
        todo: list[tuple[int, ManifestRow]] = []
        for i in range(batch.num_rows):
            row = self._row({k: cols[k][i] for k in INPUT_COLUMNS}, int(cols["line"][i] or 0))
            if isinstance(row, str):
                results[i] = self._invalid(cols["utt_id"][i], int(cols["line"][i] or 0), row)
            elif self._finished(row, self.mine):
                results[i] = self._from_record("ok", row, self.mine[row.utt_id])
            elif not self.options.overwrite and self._finished(row, self.done):
                results[i] = self._from_record("skipped", row, self.done[row.utt_id])
            else:
                todo.append((i, row))
        for i, res in self._synthesize(todo):
            results[i] = res
        out = batch.select([c for c in batch.column_names if c not in dict(RESULT_COLUMNS)])
        for name, kind in RESULT_COLUMNS:
            out = out.append_column(name, pa.array([r[name] for r in results], type=getattr(pa, kind)()))
        return out

    def _finished(self, row: ManifestRow, records: dict[str, dict[str, Any]]) -> bool:
        rec = records.get(row.utt_id)
        return rec is not None and finished_with_inputs(row, rec, self.out)

    def _from_record(self, status: str, row: ManifestRow, rec: dict[str, Any]) -> dict[str, Any]:
        return _result(status, str(self.out / recorded_file(rec)[0]), rec.get("audio_s"), rec.get("tokens"),
                       (rec.get("timings") or {}).get("total_s"))

    # -- synthesis and commit ------------------------------------------------------------

    def _synthesize(self, todo: list[tuple[int, ManifestRow]]) -> Any:
        """(batch position, result) for every row of ``todo``, in completion order."""
        left = {row.utt_id: (i, row) for i, row in todo}
        rows = [row for _, row in todo]
        try:
            batch = getattr(self.synth, "synthesize_batch", None)
            if batch is not None:
                outcomes = ((row, outcome, None) for row, outcome in batch(rows, self.stream))
            else:
                outcomes = one_by_one(self.synth, rows, self.stream)
            for row, outcome, elapsed in outcomes:
                if row.utt_id in left:
                    i, _ = left.pop(row.utt_id)
                    yield i, self._commit(row, outcome, elapsed)
        except OutputFault:
            raise  # the disk, not a row: fail the task (Ray reports it) rather than every row
        except Exception as e:  # the engine broke down as a whole: this batch's remaining rows fail
            log.error("synthesizer failed: %s: %s", type(e).__name__, e)
            reason = f"synthesizer failed: {type(e).__name__}: {e}"
        else:
            reason = "the synthesizer returned no result"
        for i, row in left.values():  # a batch engine that lost a row must not lose it silently
            yield i, self._failed(row, reason)

    def _commit(self, row: ManifestRow, res: Any, elapsed: float | None) -> dict[str, Any]:
        if (self.out / STOP_FILE).exists():  # the run was interrupted: leave the row to the resume
            return _result("pending", reason="the run was interrupted before this row was written")
        try:
            rec = finish_row(self.out, row, res, elapsed, self.fp_sha, self.audio, self.ledger, self.tag)
        except RowFailed as e:  # this one row's problem (a full disk is an OutputFault and propagates)
            return self._failed(row, f"{type(e.error).__name__}: {e.error}")
        return _result("ok", str(self.out / rec["file"]), rec["audio_s"], rec["tokens"], rec["timings"].get("total_s"))

    def _failed(self, row: ManifestRow, reason: str) -> dict[str, Any]:
        reason = reason[:1000]
        log.error("%s (line %d) failed: %s", row.utt_id, row.line, reason)
        self.ledger.append({**base_record(row, self.fp_sha), "status": "failed", "reason": reason})
        return _result("failed", reason=reason)

    def _invalid(self, utt_id: Any, line: int, reason: str) -> dict[str, Any]:
        self.ledger.append({"event": "invalid", "utt_id": utt_id, "line": line, "status": "invalid", "reason": reason})
        return _result("invalid", reason=reason)


def _actor_id() -> str:
    """Stable across Ray's restarts of this actor; unique among the actors of a run."""
    try:
        import ray

        actor = ray.get_runtime_context().get_actor_id()
    except Exception:
        actor = None
    return actor[:16] if actor else f"{platform.node()}-{os.getpid()}"
