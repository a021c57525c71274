"""A deterministic stand-in Synthesizer for the runner/CLI tests (no torch, no model).

Used in-process (``FakeSynth(...)``) and through the CLI's hidden option
``--synthesizer fake_synth:build`` with settings passed as ``--set key=value``:
  fail=a,b     rows whose synthesize() raises
  nan=c        rows whose audio contains a NaN
  inf=c        rows whose audio contains an infinity
  empty=d      rows whose audio is empty
  sleep=0.2    seconds each row takes
  slow=3       seconds each row takes after this process's first two (the rest of a run is
               still going when its first rows are back)
  freq=220     base tone (part of the fingerprint: changing it is a settings change)
  calls=PATH   append each synthesized utt_id to PATH (to see what was redone)
  closed=PATH  close() appends "closed" to PATH (to see that every way out closes it)
  kill=e:TERM  send this process SIGTERM (or INT) when row e starts, as `kill` would
  setup_kill=TERM  the same while the synthesizer is being built (model loading)
  setup_ready=PATH  write PATH when the build starts (a test then knows it can signal)
  setup_sleep=5  spend this long in a set-up step that behaves like a native extension
               loading (an exception inside it comes out as ImportError)
  straggler=1  start a daemon thread that never ends and that close() does not stop
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import soundfile as sf


@dataclass
class FakeResult:
    audio: np.ndarray
    sample_rate: int
    tokens: int
    timings: dict
    chunks: int


@dataclass
class FakeSynth:
    fail: set = field(default_factory=set)
    nan: set = field(default_factory=set)
    inf: set = field(default_factory=set)
    empty: set = field(default_factory=set)
    sleep: float = 0.0
    slow: float | None = None
    freq: float = 220.0
    sample_rate: int = 24000
    calls_file: str | None = None
    model: str = "fake"
    calls: list = field(default_factory=list)
    interrupt_at: str | None = None  # raise KeyboardInterrupt when this row starts
    kill: tuple | None = None  # (utt_id, signal number): signal this process when that row starts
    closed_file: str | None = None
    closed: int = 0

    def close(self) -> None:
        self.closed += 1
        if self.closed_file:
            with open(self.closed_file, "a") as f:
                f.write("closed\n")

    def fingerprint(self) -> dict:
        return {"model": self.model, "engine": "fake", "freq": self.freq, "sample_rate": self.sample_rate}

    def describe(self) -> dict:
        return {"model": self.model, "device": "cpu", "engine": "fake", "versions": {"fake": "1"}}

    def synthesize(self, row, stream: bool) -> FakeResult:
        if row.utt_id == self.interrupt_at:
            raise KeyboardInterrupt
        if self.kill and row.utt_id == self.kill[0]:
            os.kill(os.getpid(), self.kill[1])  # the handler runs (and raises) right here
        t0 = time.perf_counter()
        self.calls.append(row.utt_id)
        if self.calls_file:
            with open(self.calls_file, "a") as f:
                f.write(row.utt_id + "\n")
        pause = self.slow if self.slow is not None and len(self.calls) > 2 else self.sleep
        if pause:
            time.sleep(pause)
        if row.utt_id in self.fail:
            raise RuntimeError(f"synthetic failure for {row.utt_id}")
        audio = expected_audio(row.utt_id, row.target_text, self.freq, self.sample_rate)
        if row.utt_id in self.nan:
            audio[len(audio) // 2] = np.nan
        if row.utt_id in self.inf:
            audio[len(audio) // 3] = np.inf
        if row.utt_id in self.empty:
            audio = audio[:0]
        chunks = 3 if stream else 1
        total = time.perf_counter() - t0
        timings = {"frontend_s": 0.001, "llm_s": 0.002, "flow_s": 0.003, "hift_s": 0.004,
                   "first_chunk_s": total / chunks, "total_s": total}
        return FakeResult(audio, self.sample_rate, tokens=len(row.target_text), timings=timings, chunks=chunks)


class SignalReachedTheTest(Exception):
    pass


@contextlib.contextmanager
def guard_signals():
    """While a test makes the fake signal its own process: a SIGINT/SIGTERM that the code under
    test fails to handle fails the test, instead of killing pytest."""
    def guard(signum, frame):
        raise SignalReachedTheTest(signum)

    saved = {s: signal.signal(s, guard) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield guard
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def expected_audio(utt_id: str, text: str, freq: float = 220.0, sr: int = 24000) -> np.ndarray:
    n = int(sr * (0.1 + 0.01 * len(text)))
    f = freq + zlib.crc32(utt_id.encode()) % 200
    return (0.5 * np.sin(2 * np.pi * f * np.arange(n) / sr)).astype(np.float32)


def build(model: str, device: str, profile: str | None, overrides: list[str], stream: bool | None = None) -> FakeSynth:
    kw: dict = {"model": model}
    for item in overrides:
        key, _, value = item.partition("=")
        if key in ("fail", "nan", "inf", "empty"):
            kw[key] = set(filter(None, value.split(",")))
        elif key in ("sleep", "freq", "slow"):
            kw[key] = float(value)
        elif key in ("calls", "closed"):
            kw[f"{key}_file"] = value
        elif key == "kill":
            utt, _, sig = value.partition(":")
            kw["kill"] = (utt, getattr(signal, f"SIG{sig or 'TERM'}"))
        elif key == "setup_kill":
            os.kill(os.getpid(), getattr(signal, f"SIG{value}"))
        elif key == "setup_ready":
            Path(value).write_text("building\n")  # the test may signal from now on
        elif key == "setup_sleep":
            _native_init(float(value))
        elif key == "straggler":
            threading.Thread(target=threading.Event().wait, name="cosybatch-fake-straggler", daemon=True).start()
        elif key == "boom":
            raise ValueError(f"fake synthesizer setup failed: {value}")
        elif key.startswith("text."):
            pass  # a profile key the CLI reads itself to validate the manifest's texts
        else:
            raise ValueError(f"unknown fake setting {key!r}")
    return FakeSynth(**kw)


# It reads --set as its own settings, not as profile keys: the CLI must not check them as such.
build.free_settings = True


def _native_init(seconds: float) -> None:
    """A set-up step that behaves like a native extension loading (onnxruntime's pybind11
    module): an exception raised inside it, Ctrl-C included, comes out as ImportError."""
    try:
        time.sleep(seconds)
    except BaseException as e:
        raise ImportError("initialization failed") from e


BUILT: list = []  # what build_profiled was called with, in this process


def build_profiled(model: str, device: str, profile: str | None, overrides: list[str],
                   stream: bool | None = None) -> FakeSynth:
    """A factory that takes --profile/--set as profile settings (as the real one does) and
    records that it was called: a configuration error must stop the CLI before it is."""
    BUILT.append((model, profile, list(overrides)))
    return FakeSynth(model=model)


def write_prompt(path: Path, seconds: float = 1.0, sr: int = 16000) -> Path:
    t = np.arange(int(seconds * sr)) / sr
    sf.write(str(path), (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), sr, subtype="PCM_16")
    return path


def make_manifest(folder: Path, n: int = 4, text: str = "Hello there, this is row {i}.") -> Path:
    """n good rows sharing two prompts (16 kHz and 24 kHz) under folder/prompts."""
    (folder / "prompts").mkdir(parents=True, exist_ok=True)
    write_prompt(folder / "prompts" / "a.wav", 1.0, 16000)
    write_prompt(folder / "prompts" / "b.wav", 1.5, 24000)
    lines = [f"u{i}|Prompt words {i}.|prompts/{'ab'[i % 2]}.wav|{text.format(i=i)}" for i in range(n)]
    path = folder / "meta.lst"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
