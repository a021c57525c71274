"""Atomic files and storage faults, for every file cosybatch writes (OUT, the prompt cache, generated
checkpoints).

Crash safety rests on two rules: a final name (``<utt_id>.wav``, ``timing.json``) only
ever appears through ``os.replace`` of a fully written and fsynced temp file, and the
ledger is append-only with one fsynced line per event, so a ``kill -9`` at any moment
leaves at worst an orphan temp file, a torn last ledger line, or a WAV whose ok line was
not appended yet (all tolerated: resume redoes a row without its ok line).

A full disk is the other way a long run meets its end. Every write goes through plain
``os.write`` (WAVs too: no soundfile/cffi callback that could swallow the error), so
ENOSPC arrives as an OSError here; a write that fails for a reason every later write
shares (``STORAGE_ERRNOS``) becomes one :class:`OutputFault` naming the final file, after
the temp file is removed and a partial ledger line is cut off again.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from pathlib import Path
from typing import Iterable, Iterator

log = logging.getLogger(__name__)

TMP_MARK = ".cbtmp"  # temp names: .<final name>.cbtmp<tag>; never end in .wav/.json
# The disk (not this one file) is the problem: full, over quota, failing, or remounted read-only.
STORAGE_ERRNOS = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None), errno.EIO, errno.EROFS)
                           if e is not None)


class OutputFault(Exception):
    """Writing into OUT failed in a way every later write would share: the run must stop.

    Deliberately not an OSError, so that code treating an OSError as one row's problem
    cannot mistake a full disk for it.
    """

    def __init__(self, path: Path, err: OSError):
        self.path, self.errno = Path(path), err.errno
        self.reason = _reason(err)
        super().__init__(f"cannot write {self.path}: {self.reason}")


def _reason(err: OSError) -> str:
    text = os.strerror(err.errno) if err.errno else str(err)
    return text[:1].lower() + text[1:]


def is_storage_fault(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in STORAGE_ERRNOS


@contextlib.contextmanager
def faults_as(path: Path, every_oserror: bool = False) -> Iterator[None]:
    """Turn a storage OSError (or, for the run's records, any OSError) into an OutputFault."""
    try:
        yield
    except OSError as e:
        if every_oserror or is_storage_fault(e):
            raise OutputFault(path, e) from e
        raise


def fsync_dir(path: Path) -> None:
    """Make a rename durable; some filesystems refuse directory fds, which is harmless."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _tmp_path(final: Path, tag: str) -> Path:
    return final.with_name(f".{final.name}{TMP_MARK}{tag}")


def write_all(fd: int, data: bytes) -> None:
    """os.write until done: near a full disk the kernel writes part and fails the rest."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _write_synced(path: Path, chunks: Iterable[bytes]) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        size = 0
        for chunk in chunks:
            write_all(fd, chunk)
            size += len(chunk)
        os.fsync(fd)  # some filesystems (NFS, delayed allocation) only report ENOSPC here
    finally:
        os.close(fd)  # ... or here
    return size


def replace_atomically(final: Path, chunks: Iterable[bytes], tag: str) -> int:
    tmp = _tmp_path(final, tag)
    try:
        size = _write_synced(tmp, chunks)
        os.replace(tmp, final)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    fsync_dir(final.parent)
    return size


@contextlib.contextmanager
def replaced_on_success(final: Path) -> Iterator[Path]:
    """A temporary path beside ``final`` for a library that writes to a path (safetensors,
    ONNX): renamed onto ``final`` when the block ends normally, removed otherwise, so no reader
    sees a torn file. Unique per process and thread. (The run's own records go through
    ``atomic_write_bytes``, which also fsyncs and reports storage faults.)"""
    final = Path(final)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        _unlink_quietly(tmp)


def atomic_write_bytes(final: Path, data: bytes, tag: str = "") -> None:
    """Write ``final`` atomically; any OSError is an OutputFault (these files are the run's records)."""
    with faults_as(final, every_oserror=True):
        replace_atomically(final, [data], tag)


# ---- WAV ------------------------------------------------------------------------------------
# What libsndfile (soundfile.write) writes for a mono WAV, byte for byte: PCM_16 is the plain
# 44-byte RIFF header; FLOAT adds a 'fact' chunk (frame count) and a 'PEAK' chunk (largest
# |sample|, its first position, and a Unix timestamp), as libsndfile does for float data.

def _unlink_quietly(p: Path) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


def remove_quietly(p: Path) -> bool:
    """Remove a file (and make that durable) if it is there; False if it could not be removed."""
    try:
        os.unlink(p)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    fsync_dir(p.parent)
    return True


def remove_stale_tmp(out_dir: Path, tag: str) -> int:
    """Delete temp files a killed run with the same shard tag left behind."""
    n = 0
    suffix = f"{TMP_MARK}{tag}"
    for p in out_dir.iterdir():
        if p.name.startswith(".") and p.name.endswith(suffix) and p.is_file():
            _unlink_quietly(p)
            n += 1
    return n


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on path's filesystem (None where unknown)."""
    try:
        st = os.statvfs(path)
    except (AttributeError, OSError):  # not POSIX, or a filesystem that will not say
        return None
    return st.f_bavail * st.f_frsize
