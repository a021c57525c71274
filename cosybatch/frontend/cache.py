"""Prompt-feature cache for bulk runs: keyed by audio content, bounded in memory, optionally on disk.

Manifests reach the same WAV through different paths or copies, so entries are keyed by a hash
of the audio bytes, not the path. Memory holds at most ``max_entries`` entries and
``max_bytes`` of tensors (LRU). The optional disk directory lets a resumed or repeated run skip
the work: entries live under a namespace derived from the frontend models (a different
checkpoint, backend or precision reads other entries), are written to a temporary file and
renamed into place (a crash leaves at most a stray temp file, never a torn entry), and an entry
that cannot be read back is treated as missing and rewritten. Disk writes go through one
background thread so the caller (the GPU scheduler) never waits on the filesystem.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import queue
import threading
import weakref
from collections import OrderedDict
from pathlib import Path

import torch

from cosybatch.prompt import PromptFeatures
from cosybatch.atomic import replaced_on_success

log = logging.getLogger("cosybatch.frontend.frontend")
FORMAT = "cosybatch-prompt-features-v1"


def content_key(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def file_digest(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _nbytes(f: PromptFeatures) -> int:
    return sum(t.numel() * t.element_size() for t in (f.speech_tokens, f.embedding, f.mel))


class DiskStore:
    def __init__(self, root: Path, namespace: str):
        self.dir = Path(root) / namespace

    def path(self, key: str) -> Path:
        return self.dir / key[:2] / f"{key}.safetensors"

    def read(self, key: str) -> PromptFeatures | None:
        from safetensors import safe_open

        p = self.path(key)
        if not p.is_file():
            return None
        try:
            with safe_open(str(p), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in ("speech_tokens", "embedding", "mel")}
            tok, emb, mel = tensors["speech_tokens"], tensors["embedding"], tensors["mel"]
            if meta.get("format") != FORMAT or meta.get("key") != key or tok.dim() != 1 or emb.dim() != 2 \
                    or mel.dim() != 3 or tok.numel() == 0 or mel.shape[1] % tok.numel():
                raise ValueError("unexpected contents")
        except Exception as e:  # a damaged entry is a miss; it is rewritten after recomputing
            log.warning("prompt cache: ignoring unreadable entry %s (%s)", p, e)
            return None
        return PromptFeatures(tok.to(torch.long), emb.float(), mel.float())

    def write(self, key: str, f: PromptFeatures) -> None:
        from safetensors.torch import save_file

        p = self.path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        with replaced_on_success(p) as tmp:
            save_file({"speech_tokens": f.speech_tokens.contiguous(), "embedding": f.embedding.contiguous(),
                       "mel": f.mel.contiguous()}, str(tmp), metadata={"format": FORMAT, "key": key})


class PromptCache:
    def __init__(self, max_entries: int = 256, max_bytes: int = 256 << 20,
                 disk_dir: str | Path | None = None, namespace: str = "default"):
        self.max_entries = max(0, int(max_entries))
        self.max_bytes = max(0, int(max_bytes))
        self._mem: OrderedDict[str, PromptFeatures] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.disk = DiskStore(Path(disk_dir), namespace) if disk_dir is not None else None
        self.stats = {"hits": 0, "disk_hits": 0, "misses": 0, "disk_writes": 0, "evictions": 0}
        self._queue: queue.Queue | None = None
        if self.disk is not None:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._writer, name="cosybatch-prompt-cache", daemon=True)
            self._thread.start()
            ref = weakref.ref(self)
            atexit.register(lambda: ref() is not None and ref().flush())

    # ---- lookups ------------------------------------------------------------------------
    def get(self, key: str) -> PromptFeatures | None:
        """The cached entry (shared: callers must clone before handing it out) or None."""
        with self._lock:
            hit = self._mem.get(key)
            if hit is not None:
                self._mem.move_to_end(key)
                self.stats["hits"] += 1
                return hit
        found = self.disk.read(key) if self.disk is not None else None
        with self._lock:
            if found is None:
                self.stats["misses"] += 1
                return None
            self.stats["disk_hits"] += 1
            self._remember(key, found)
        return found

    def peek(self, key: str) -> PromptFeatures | None:
        """Memory lookup without statistics or disk access (entries made since a load())."""
        with self._lock:
            return self._mem.get(key)

    def put(self, key: str, feats: PromptFeatures) -> None:
        with self._lock:
            self._remember(key, feats)
        if self._queue is not None and self._thread.is_alive():
            self._queue.put((key, feats))
        elif self.disk is not None:  # after close(): write it here, now
            self._write(key, feats)

    def _remember(self, key: str, feats: PromptFeatures) -> None:
        if not self.max_entries or _nbytes(feats) > self.max_bytes:
            return
        old = self._mem.pop(key, None)
        if old is not None:
            self._bytes -= _nbytes(old)
        self._mem[key] = feats
        self._bytes += _nbytes(feats)
        while len(self._mem) > self.max_entries or self._bytes > self.max_bytes:
            _, dropped = self._mem.popitem(last=False)
            self._bytes -= _nbytes(dropped)
            self.stats["evictions"] += 1

    # ---- disk writer --------------------------------------------------------------------
    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:  # close()
                self._queue.task_done()
                return
            try:
                self._write(*item)
            finally:
                self._queue.task_done()

    def _write(self, key: str, feats: PromptFeatures) -> None:
        try:
            self.disk.write(key, feats)
            with self._lock:
                self.stats["disk_writes"] += 1
        except Exception as e:  # a full or read-only disk must not stop synthesis
            log.warning("prompt cache: could not write %s (%s)", key, e)

    def flush(self) -> None:
        """Wait until every queued disk write has landed."""
        if self._queue is not None:
            self._queue.join()

    def close(self) -> None:
        """Flush, then stop the writer thread (no thread outlives the run)."""
        if self._queue is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def clear(self) -> None:
        """Drop the in-memory entries (the disk entries stay)."""
        with self._lock:
            self._mem.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._mem)


__all__ = ["PromptCache", "DiskStore", "content_key", "file_digest"]
