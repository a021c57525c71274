"""A deterministic stand-in Synthesizer for the runner/CLI tests (no torch, no model).

Used in-process (``FakeSynth(...)``) and through the CLI's hidden option
``--synthesizer fake_synth:build`` with settings passed as ``--set key=value``:
  fail=a,b     rows whose synthesize() raises
  nan=c        rows whose audio contains a NaN
  sleep=0.2    seconds each row takes
  freq=220     base tone (part of the fingerprint: changing it is a settings change)
  calls=PATH   append each synthesized utt_id to PATH (to see what was redone)
"""

from __future__ import annotations

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
    sleep: float = 0.0
    freq: float = 220.0
    sample_rate: int = 24000
    calls_file: str | None = None
    model: str = "fake"
    calls: list = field(default_factory=list)
    interrupt_at: str | None = None  # raise KeyboardInterrupt when this row starts

    def fingerprint(self) -> dict:
        return {"model": self.model, "engine": "fake", "freq": self.freq, "sample_rate": self.sample_rate}

    def describe(self) -> dict:
        return {"model": self.model, "device": "cpu", "engine": "fake", "versions": {"fake": "1"}}

    def synthesize(self, row, stream: bool) -> FakeResult:
        if row.utt_id == self.interrupt_at:
            raise KeyboardInterrupt
        t0 = time.perf_counter()
        self.calls.append(row.utt_id)
        if self.calls_file:
            with open(self.calls_file, "a") as f:
                f.write(row.utt_id + "\n")
        if self.sleep:
            time.sleep(self.sleep)
        if row.utt_id in self.fail:
            raise RuntimeError(f"synthetic failure for {row.utt_id}")
        audio = expected_audio(row.utt_id, row.target_text, self.freq, self.sample_rate)
        if row.utt_id in self.nan:
            audio[len(audio) // 2] = np.nan
        chunks = 3 if stream else 1
        total = time.perf_counter() - t0
        timings = {"frontend_s": 0.001, "llm_s": 0.002, "flow_s": 0.003, "hift_s": 0.004,
                   "first_chunk_s": total / chunks, "total_s": total}
        return FakeResult(audio, self.sample_rate, tokens=len(row.target_text), timings=timings, chunks=chunks)


def expected_audio(utt_id: str, text: str, freq: float = 220.0, sr: int = 24000) -> np.ndarray:
    n = int(sr * (0.1 + 0.01 * len(text)))
    f = freq + zlib.crc32(utt_id.encode()) % 200
    return (0.5 * np.sin(2 * np.pi * f * np.arange(n) / sr)).astype(np.float32)


def build(model: str, device: str, profile: str | None, overrides: list[str], stream: bool | None = None) -> FakeSynth:
    kw: dict = {"model": model}
    for item in overrides:
        key, _, value = item.partition("=")
        if key in ("fail", "nan"):
            kw[key] = set(filter(None, value.split(",")))
        elif key in ("sleep", "freq"):
            kw[key] = float(value)
        elif key == "calls":
            kw["calls_file"] = value
        elif key == "boom":
            raise ValueError(f"fake synthesizer setup failed: {value}")
        else:
            raise ValueError(f"unknown fake setting {key!r}")
    return FakeSynth(**kw)


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
