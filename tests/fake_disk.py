"""A disk that fills up, for the output files: stands in for the ``os`` module of ``cosybatch.atomic`` and ``cosybatch.output.ledger``.

    install(monkeypatch, FullDisk("u2.wav", nth=1, partial=100))

Writes to files whose name contains ``match`` (temp names too: ``.u2.wav.cbtmp``) succeed
until the ``nth`` such write; that one writes ``partial`` bytes and returns, as the kernel
does when the space runs out mid-write, or fails at once when ``partial`` is 0. From then
on every write to any file fails with ``err`` (the disk stays full) until ``free()``.
Everything else (open, fsync, replace, ftruncate, unlink) is the real ``os``.
"""

from __future__ import annotations

import errno
import os


class FullDisk:
    def __init__(self, match: str = "", nth: int = 1, partial: int = 0, err: int = errno.ENOSPC):
        self.match, self.nth, self.partial, self.err = match, nth, partial, err
        self.names: dict[int, str] = {}
        self.seen = 0
        self.full = False
        self.failed_writes = 0

    def __getattr__(self, name: str):
        return getattr(os, name)

    def open(self, path, flags, mode=0o777, *args, **kwargs):
        fd = os.open(path, flags, mode, *args, **kwargs)
        self.names[fd] = os.path.basename(os.fspath(path))
        return fd

    def write(self, fd: int, data) -> int:
        if self.full:
            self.failed_writes += 1
            raise OSError(self.err, os.strerror(self.err))
        name = self.names.get(fd)
        if name is not None and self.match in name:
            self.seen += 1
            if self.seen >= self.nth:
                self.full = True
                if self.partial:
                    return os.write(fd, bytes(data[:self.partial]))
                self.failed_writes += 1
                raise OSError(self.err, os.strerror(self.err))
        return os.write(fd, data)

    def free(self) -> None:
        """Space was freed: every write succeeds from now on."""
        self.full = False
        self.nth = float("inf")


def install(monkeypatch, disk) -> None:
    """Every module that writes OUT's files sees ``disk`` as its ``os``."""
    from cosybatch import atomic
    from cosybatch.output import ledger

    for mod in (atomic, ledger):
        monkeypatch.setattr(mod, "os", disk)
