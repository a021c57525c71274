"""Output formats, sample rates and loudness, through the real ``run_synth`` path around the fake
synthesizer: every format reads back right, resampling is band-limited, loudness lands on target
without a sample over the ceiling, the ledger says what it wrote, resume refuses a changed format,
and a full disk while writing FLAC is handled like one while writing WAV."""

from __future__ import annotations

import json
import logging
import os
import zlib
from pathlib import Path

import numpy as np
import pyloudnorm
import pytest
import soundfile as sf
from click.testing import CliRunner

from cosybatch.atomic import TMP_MARK
from cosybatch.cli import cli
from cosybatch.manifest import read_manifest
from cosybatch.output.audio_files import (FORMATS, AudioFormat, audio_name, audio_path, encode_wav,
                                          format_of)
from cosybatch.output.mastering import PEAK_CEILING_DBFS, change_rate, measure_loudness
from cosybatch.run.disk_estimate import estimated_output_bytes
from cosybatch.run.synth import SettingsChanged, run_synth
from fake_disk import FullDisk, install as install_disk
from fake_synth import FakeResult, FakeSynth, expected_audio, make_manifest

CEILING = 10.0 ** (PEAK_CEILING_DBFS / 20.0)
TEXT = "Hello there, this is row {i}."
FAKE = ["--synthesizer", "fake_synth:build"]


def _run(man_path, synth, out, **kw):
    kw.setdefault("quiet", True)
    return run_synth(read_manifest(man_path), synth, out, **kw)


def _ok_rows(out: Path) -> dict[str, dict]:
    recs = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]
    return {r["utt_id"]: r for r in recs if r.get("event") == "row" and r.get("status") == "ok"}


def _tone_freq(utt_id: str) -> float:
    return 220.0 + zlib.crc32(utt_id.encode()) % 200  # what fake_synth.expected_audio plays


def _snr_db(got: np.ndarray, ref: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(ref ** 2) / max(np.sum((got - ref) ** 2), 1e-30)))


def speech_like(seconds: float = 4.0, sr: int = 24000, seed: int = 0) -> np.ndarray:
    """Voiced stretches (a gliding 100-220 Hz pitch with harmonics to 4 kHz, falling 6 dB/octave,
    under a ~4 Hz syllable envelope), short fricative noise bursts, and pauses: the level structure
    BS.1770's gating was made for (peaks well above the mean, gaps the gate drops)."""
    rng = np.random.default_rng(seed)
    n = int(seconds * sr)
    t = np.arange(n) / sr
    f0 = 160 + 60 * np.sin(2 * np.pi * 0.7 * t) + 5 * np.sin(2 * np.pi * 5.5 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sr
    voiced = sum(np.sin(k * phase) / k for k in range(1, 25) if k * 220 < 4000)
    syllables = np.clip(np.sin(2 * np.pi * 3.8 * t), 0, None) ** 1.5
    pauses = (np.sin(2 * np.pi * 0.45 * t) > -0.6).astype(float)  # ~30 % of the time: silence
    x = voiced * syllables * pauses
    for start in rng.uniform(0, seconds - 0.1, size=int(seconds * 2)):
        a, b = int(start * sr), int((start + rng.uniform(0.04, 0.1)) * sr)
        burst = rng.standard_normal(b - a)
        x[a:b] += 0.4 * np.diff(burst, prepend=0.0) * np.hanning(b - a)  # differenced: hiss, not rumble
    return (x / np.max(np.abs(x))).astype(np.float32)


class SignalSynth(FakeSynth):
    """The fake synthesizer with a chosen waveform per row (utt_id -> samples at 24 kHz)."""

    def __init__(self, signals: dict[str, np.ndarray], **kw):
        super().__init__(**kw)
        self.signals = signals

    def synthesize(self, row, stream):
        res = super().synthesize(row, stream)
        audio = self.signals.get(row.utt_id)
        return res if audio is None else FakeResult(audio.copy(), self.sample_rate, res.tokens, res.timings, 1)


# ---- every format round-trips --------------------------------------------------------------

# SNR floors against the tone computed directly at the file's rate. Lossless (16-bit): the tone's
# abrupt start and end ring through the resampler's filter, so the whole clip is held to 50 dB and
# its inside (20 ms in from either end) to 80 dB (16-bit quantization is ~86 dB). Lossy codecs at
# libsndfile's default settings on a pure tone measured 21-46 dB: held to 15 dB, which a wrong
# rate, a shifted start or a different signal (all near or below 0 dB) cannot reach.
_FLOORS = {"wav": (50, 80), "flac": (50, 80), "ogg": (15, 15), "opus": (15, 15), "mp3": (15, 15)}


@pytest.mark.parametrize("rate", [None, 16000, 48000])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_reads_back_at_its_rate_length_and_content(tmp_path, fmt, rate):
    man = make_manifest(tmp_path, 2)
    out = tmp_path / "out"
    rep = _run(man, FakeSynth(), out, audio_format=AudioFormat(fmt, sample_rate=rate))
    assert rep.exit_code == 0
    want_rate = rate or 24000
    names = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert names == sorted(["ledger.jsonl", "timing.json", audio_name("u0", fmt), audio_name("u1", fmt)])
    for row in read_manifest(man).rows:
        got, sr = sf.read(str(audio_path(out, row.utt_id, fmt)), dtype="float64")
        assert sr == want_rate and got.ndim == 1
        n_src = len(expected_audio(row.utt_id, row.target_text))
        # soxr's one-shot call removes its filter delay: n * new / old samples, rounded
        assert abs(len(got) - n_src * want_rate / 24000) <= 1
        ref = 0.5 * np.sin(2 * np.pi * _tone_freq(row.utt_id) * np.arange(len(got)) / want_rate)
        k = int(0.02 * want_rate)
        whole, inside = _FLOORS[fmt]
        assert _snr_db(got, ref) > whole, fmt
        assert _snr_db(got[k:-k], ref[k:-k]) > inside, fmt
        rec = _ok_rows(out)[row.utt_id]
        assert (rec["file"], rec["format"], rec["sample_rate"]) == (audio_name(row.utt_id, fmt), fmt, want_rate)
        assert rec["file_bytes"] == audio_path(out, row.utt_id, fmt).stat().st_size
        assert rec["audio_s"] == pytest.approx(len(got) / want_rate, abs=1.5 / want_rate)


def test_flac_holds_exactly_the_16_bit_wav_samples(tmp_path):
    man = make_manifest(tmp_path, 2)
    loud = {"u0": np.linspace(-1.5, 1.5, 24000, dtype=np.float32)}  # past full scale: must clip, not wrap
    _run(man, SignalSynth(loud), tmp_path / "w")
    _run(man, SignalSynth(loud), tmp_path / "f", audio_format=AudioFormat("flac"))
    for u in ("u0", "u1"):
        w, _ = sf.read(str(tmp_path / "w" / f"{u}.wav"), dtype="int16")
        f, _ = sf.read(str(tmp_path / "f" / f"{u}.flac"), dtype="int16")
        np.testing.assert_array_equal(f, w)


def test_default_wav_bytes_are_unchanged_even_at_an_explicit_native_rate(tmp_path):
    """Today's WAV path: the bytes the standard-library writer (encode_wav) made before formats
    existed, also when --sample-rate names the model's own rate."""
    man = make_manifest(tmp_path, 1)
    for name, fmt in (("a", AudioFormat()), ("b", AudioFormat(sample_rate=24000)),
                      ("c", AudioFormat(wav_subtype="FLOAT", sample_rate=24000))):
        _run(man, FakeSynth(), tmp_path / name, audio_format=fmt)
        x = expected_audio("u0", TEXT.format(i=0))
        header, data = encode_wav(x, 24000, fmt.wav_subtype)
        got = (tmp_path / name / "u0.wav").read_bytes()
        if fmt.wav_subtype == "PCM_16":
            assert got == header + data
        else:  # FLOAT's PEAK chunk holds a timestamp: compare all else
            assert len(got) == len(header + data) and got[-len(data):] == data


# ---- resampling is band-limited -------------------------------------------------------------

def _level_db(x: np.ndarray, sr: int, f: float) -> float:
    """Level of the component at ``f`` Hz, in dB re a full-scale sine (Blackman window: -58 dB
    sidelobes falling fast, so a tone 1 kHz away does not leak into the bin)."""
    w = np.blackman(len(x))
    spec = np.abs(np.fft.rfft(x * w)) / (w.sum() / 2)
    freqs = np.fft.rfftfreq(len(x), 1 / sr)
    near = np.abs(freqs - f) < 30
    return float(20 * np.log10(spec[near].max() + 1e-30))


@pytest.mark.parametrize("new", [16000, 8000, 22050])
def test_change_rate_passes_below_and_removes_above_the_new_nyquist(new):
    sr, t = 24000, np.arange(2 * 24000) / 24000
    below, above = 0.40 * new, 0.55 * new  # above: folds back to 0.45 * new when not filtered
    x = (0.5 * np.sin(2 * np.pi * below * t) + 0.5 * np.sin(2 * np.pi * above * t)).astype(np.float32)
    y = change_rate(x, sr, new).astype(np.float64)[2000:-2000]
    assert _level_db(y, new, below) == pytest.approx(20 * np.log10(0.5), abs=0.1)  # passes within 0.1 dB
    assert _level_db(y, new, new - above) < 20 * np.log10(0.5) - 100  # its alias at least 100 dB down


def test_a_run_at_16k_drops_a_10k_tone_and_keeps_a_3k_one(tmp_path):
    """End to end, into a float WAV (no 16-bit floor): what the file holds at 16 kHz."""
    man = make_manifest(tmp_path, 1)
    t = np.arange(3 * 24000) / 24000
    x = (0.4 * np.sin(2 * np.pi * 3000 * t) + 0.4 * np.sin(2 * np.pi * 10000 * t)).astype(np.float32)
    out = tmp_path / "out"
    _run(man, SignalSynth({"u0": x}), out, audio_format=AudioFormat(wav_subtype="FLOAT", sample_rate=16000))
    y, sr = sf.read(str(out / "u0.wav"), dtype="float64")
    assert sr == 16000
    y = y[2000:-2000]
    assert _level_db(y, 16000, 3000) == pytest.approx(20 * np.log10(0.4), abs=0.1)
    assert _level_db(y, 16000, 6000) < 20 * np.log10(0.4) - 100  # where 10 kHz would alias to


# ---- loudness -------------------------------------------------------------------------------

def _lufs(x: np.ndarray, sr: int) -> float:
    return pyloudnorm.Meter(sr).integrated_loudness(np.asarray(x, dtype=np.float64))


@pytest.mark.parametrize("fmt,rate", [("wav", None), ("flac", 16000), ("wav", 48000)])
def test_loudness_lands_on_target_without_a_sample_over_the_ceiling(tmp_path, fmt, rate):
    man = make_manifest(tmp_path, 3)
    base = speech_like(4.0)
    # a quiet row, a hot one (peaks at full scale), another voice
    signals = {"u0": 0.01 * base, "u1": base, "u2": 0.5 * speech_like(3.0, seed=1)}
    assert _lufs(signals["u0"], 24000) < -45 and _lufs(signals["u1"], 24000) > -17
    out = tmp_path / "out"
    target = -23.0
    sub = {"wav_subtype": "FLOAT"} if fmt == "wav" else {}
    rep = _run(man, SignalSynth(signals), out, audio_format=AudioFormat(fmt, sample_rate=rate, loudness=target, **sub))
    assert rep.exit_code == 0
    recs = _ok_rows(out)
    for u in ("u0", "u1", "u2"):
        y, sr = sf.read(str(audio_path(out, u, fmt)), dtype="float64")
        assert sr == (rate or 24000)
        assert abs(_lufs(y, sr) - target) <= 0.5, u
        assert np.max(np.abs(y)) <= CEILING
        assert recs[u]["loudness_lufs"] == pytest.approx(target, abs=0.01)
        assert recs[u]["loudness_measure"] == "bs1770" and recs[u]["peak_limited"] is False
        assert recs[u]["peak_dbfs"] <= PEAK_CEILING_DBFS


def test_a_target_past_the_ceiling_stops_at_the_ceiling_and_says_so(tmp_path):
    man = make_manifest(tmp_path, 1)
    x = 0.2 * speech_like(4.0)
    out = tmp_path / "out"
    _run(man, SignalSynth({"u0": x}), out, audio_format=AudioFormat(wav_subtype="FLOAT", loudness=-5.0))
    y, _ = sf.read(str(out / "u0.wav"), dtype="float64")
    rec = _ok_rows(out)["u0"]
    assert np.max(np.abs(y)) <= CEILING and np.max(np.abs(y)) > CEILING * 0.999  # right at it
    assert rec["peak_limited"] is True and rec["peak_dbfs"] == pytest.approx(PEAK_CEILING_DBFS, abs=0.01)
    assert rec["loudness_lufs"] < -5.5  # quieter than asked: the ceiling won
    assert rec["loudness_lufs"] == pytest.approx(_lufs(y, 24000), abs=0.05)  # and the ledger says how loud


def test_short_clips_are_measured_whole_and_silence_is_left_alone(tmp_path):
    man = make_manifest(tmp_path, 2)
    short = 0.05 * speech_like(0.3, seed=2)  # shorter than one 400 ms gating block
    out = tmp_path / "out"
    signals = {"u0": short, "u1": np.zeros(24000, np.float32)}
    rep = _run(man, SignalSynth(signals), out, audio_format=AudioFormat(wav_subtype="FLOAT", loudness=-20.0))
    assert rep.exit_code == 0
    recs = _ok_rows(out)
    y, _ = sf.read(str(out / "u0.wav"), dtype="float64")
    whole = pyloudnorm.Meter(24000, block_size=(len(y) - 1) / 24000).integrated_loudness(y)
    assert recs["u0"]["loudness_measure"] == "short" and abs(whole + 20.0) <= 0.5
    assert np.max(np.abs(y)) <= CEILING
    z, _ = sf.read(str(out / "u1.wav"), dtype="float64")
    assert not z.any()  # no gain on silence
    assert recs["u1"]["loudness_measure"] == "silent" and recs["u1"]["loudness_lufs"] is None
    assert recs["u1"]["gain_db"] == 0.0 and recs["u1"]["peak_dbfs"] is None


def test_without_a_target_the_ledger_still_measures_loudness(tmp_path):
    man = make_manifest(tmp_path, 1)
    out = tmp_path / "out"
    x = 0.3 * speech_like(2.0)
    _run(man, SignalSynth({"u0": x}), out)
    rec = _ok_rows(out)["u0"]
    assert rec["loudness_lufs"] == pytest.approx(_lufs(x, 24000), abs=0.01)
    assert "gain_db" not in rec and rec["format"] == "wav" and rec["sample_rate"] == 24000
    assert measure_loudness(x, 24000).lufs == pytest.approx(rec["loudness_lufs"], abs=0.01)


# ---- resume ---------------------------------------------------------------------------------

def test_resume_skips_finished_rows_of_the_same_format_and_refuses_another(tmp_path):
    man = make_manifest(tmp_path, 3)
    out, calls = tmp_path / "out", tmp_path / "calls.txt"
    flac16 = AudioFormat("flac", sample_rate=16000, loudness=-23.0)
    assert _run(man, FakeSynth(calls_file=str(calls)), out, audio_format=flac16).exit_code == 0
    assert len(calls.read_text().split()) == 3
    rep = _run(man, FakeSynth(calls_file=str(calls)), out, audio_format=flac16)
    assert rep.exit_code == 0 and rep.totals["skipped"] == 3 and len(calls.read_text().split()) == 3
    for other in (AudioFormat(), AudioFormat("ogg", sample_rate=16000, loudness=-23.0),
                  AudioFormat("flac", sample_rate=24000, loudness=-23.0), AudioFormat("flac", sample_rate=16000),
                  AudioFormat("flac", sample_rate=16000, loudness=-16.0)):
        with pytest.raises(SettingsChanged, match="refusing to mix outputs"):
            _run(man, FakeSynth(calls_file=str(calls)), out, audio_format=other)
    assert len(calls.read_text().split()) == 3  # nothing was redone


def test_the_cli_refuses_a_changed_format_with_exit_2_and_overwrite_redoes(tmp_path):
    man = make_manifest(tmp_path, 2)
    out = tmp_path / "out"
    run = CliRunner().invoke
    assert run(cli, ["synth", str(man), "--out", str(out), *FAKE, "--format", "flac"]).exit_code == 0
    res = run(cli, ["synth", str(man), "--out", str(out), *FAKE, "--format", "mp3"])
    assert res.exit_code == 2 and "refusing to mix outputs" in res.stderr
    assert "format: 'flac' before, 'mp3' now" in res.stderr
    assert not list(out.glob("*.mp3"))
    res = run(cli, ["synth", str(man), "--out", str(out), *FAKE, "--format", "mp3", "--overwrite"])
    assert res.exit_code == 0 and sorted(p.name for p in out.glob("*.mp3")) == ["u0.mp3", "u1.mp3"]


def test_an_out_written_before_formats_existed_still_resumes(tmp_path):
    """Ledgers from before this change say wav/wav_bytes and fingerprint only wav_subtype."""
    man = make_manifest(tmp_path, 2)
    out, calls = tmp_path / "out", tmp_path / "calls.txt"
    _run(man, FakeSynth(), out)
    lines = []
    for line in (out / "ledger.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("status") == "ok":
            r["wav"], r["wav_bytes"] = r.pop("file"), r.pop("file_bytes")
            for k in ("format", "loudness_lufs", "loudness_measure", "peak_dbfs"):
                r.pop(k)
        lines.append(json.dumps(r))
    (out / "ledger.jsonl").write_text("\n".join(lines) + "\n")
    rep = _run(man, FakeSynth(calls_file=str(calls)), out)
    assert rep.exit_code == 0 and rep.totals["skipped"] == 2 and not calls.exists()


def test_a_ledger_cannot_point_a_row_at_another_file(tmp_path):
    man = make_manifest(tmp_path, 1)
    out, calls = tmp_path / "out", tmp_path / "calls.txt"
    _run(man, FakeSynth(), out)
    (out / "elsewhere.wav").write_bytes((out / "u0.wav").read_bytes())
    text = (out / "ledger.jsonl").read_text().replace('"file": "u0.wav"', '"file": "elsewhere.wav"')
    (out / "ledger.jsonl").write_text(text)
    assert format_of("u0", "elsewhere.wav") is None and format_of("u0", "u0.opus") == "opus"
    rep = _run(man, FakeSynth(calls_file=str(calls)), out)
    assert rep.totals["skipped"] == 0 and calls.read_text().split() == ["u0"]


# ---- a full disk while writing FLAC, as while writing WAV ----------------------------------

@pytest.fixture
def errors(caplog):
    """ERROR lines of the ``cosybatch`` loggers (the CLI's setup_logging stops their propagation)."""
    lg = logging.getLogger("cosybatch")
    level, propagate = lg.level, lg.propagate
    lg.addHandler(caplog.handler)
    lg.setLevel(logging.DEBUG)
    lg.propagate = False
    yield lambda: [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    lg.removeHandler(caplog.handler)
    lg.setLevel(level)
    lg.propagate = propagate


@pytest.mark.parametrize("partial", [0, 100])
def test_full_disk_while_writing_flac_stops_cleanly_and_resumes(tmp_path, monkeypatch, errors, partial):
    """The same stop, line and OUT as test_runner's WAV case: the FLAC is encoded in memory and
    written by os.write, so ENOSPC is an OutputFault, not an error inside libsndfile."""
    man = make_manifest(tmp_path, 4)
    out = tmp_path / "out"
    disk = FullDisk("u2.flac", nth=1, partial=partial)
    install_disk(monkeypatch, disk)
    flac = AudioFormat("flac", sample_rate=16000)
    rep = _run(man, FakeSynth(), out, audio_format=flac)
    assert rep.exit_code == 1 and rep.failed == [] and disk.failed_writes >= 1
    assert errors() == [f"cannot write {out / 'u2.flac'}: no space left on device; run stopped, "
                        "2 finished row(s) kept: free space and re-run the same command to resume"]
    install_disk(monkeypatch, os)
    assert not list(out.glob(f"*{TMP_MARK}*"))  # no temp file left behind
    ok = _ok_rows(out)
    assert sorted(ok) == ["u0", "u1"] and sorted(p.name for p in out.glob("*.flac")) == ["u0.flac", "u1.flac"]
    for rec in ok.values():  # every file under a final name is whole and has its ok line
        assert (out / rec["file"]).stat().st_size == rec["file_bytes"]
    synth = FakeSynth()
    rep = _run(man, synth, out, audio_format=flac)
    assert rep.exit_code == 0 and synth.calls == ["u2", "u3"] and sorted(_ok_rows(out)) == ["u0", "u1", "u2", "u3"]


# ---- the free-space estimate follows the format -----------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rate", [8000, 24000, 48000])
def test_size_estimate_bounds_what_is_written_even_for_noise(fmt, rate):
    if fmt == "opus" and rate not in (8000, 24000, 48000):
        pytest.skip("rate Opus does not take")
    rng = np.random.default_rng(3)
    audio = AudioFormat(fmt, sample_rate=rate)
    for x in (rng.uniform(-1, 1, 24000 * 3).astype(np.float32), speech_like(3.0)):  # worst case, typical
        enc = audio.encode(x, 24000)
        size = sum(len(c) for c in enc.chunks)
        bound = audio.estimated_bytes(enc.info["audio_s"], 24000)
        assert size <= bound
        if fmt == "wav":
            assert size == bound  # exact


def test_run_estimate_uses_the_format(tmp_path):
    rows = read_manifest(make_manifest(tmp_path, 4)).rows
    wav, secs = estimated_output_bytes(rows, 24000, "PCM_16")
    assert estimated_output_bytes(rows, 24000, AudioFormat())[0] == wav
    mp3 = estimated_output_bytes(rows, 24000, AudioFormat("mp3"))[0]
    flac16 = estimated_output_bytes(rows, 24000, AudioFormat("flac", sample_rate=16000))[0]
    assert mp3 < wav and flac16 < wav  # 40 kB/s < 48 kB/s; 16 kHz FLAC < 24 kHz WAV
    assert mp3 >= secs * 40000


# ---- the command line ----------------------------------------------------------------------

@pytest.mark.parametrize("args,msg", [
    (["--format", "aiff"], "--format 'aiff': expected one of wav, flac, ogg, opus, mp3"),
    (["--format", "flac", "--wav-subtype", "FLOAT"], "--wav-subtype FLOAT applies to --format wav only"),
    (["--sample-rate", "16k"], "--sample-rate '16k': expected a whole number of Hz"),
    (["--sample-rate", "4000"], "--sample-rate 4000: expected 8000 to 192000 Hz"),
    (["--loudness", "loud"], "--loudness 'loud': expected a number of LUFS"),
    (["--loudness=-90"], "--loudness -90.0: expected -70 to 0 LUFS"),
    (["--format", "opus", "--sample-rate", "44100"], "Opus only supports sample rates of"),
    (["--format", "mp3", "--sample-rate", "96000"], "MPEG-1/2/2.5 only supports sample rates of"),
])
def test_bad_output_settings_are_one_line_exit_2_before_the_model(tmp_path, args, msg):
    man = make_manifest(tmp_path, 1)
    closed = tmp_path / "closed.txt"
    res = CliRunner().invoke(cli, ["synth", str(man), "--out", str(tmp_path / "out"), *FAKE,
                                   "--set", f"closed={closed}", *args])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and msg in lines[0], res.stderr
    assert not closed.exists() and not (tmp_path / "out").exists()  # no synthesizer was built, nothing written


def test_cli_flac_16k_at_minus_23_lufs(tmp_path):
    """The README's example (rows long enough for BS.1770's gated measure)."""
    man = make_manifest(tmp_path, 2, text="A sentence long enough to outlast one gating block, row {i}.")
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["synth", str(man), "--out", str(out), *FAKE, "--format", "flac",
                                   "--sample-rate", "16000", "--loudness", "-23"])
    assert res.exit_code == 0, res.output
    for u, rec in _ok_rows(out).items():
        y, sr = sf.read(str(out / f"{u}.flac"), dtype="float64")
        assert sr == 16000 and rec["format"] == "flac" and rec["loudness_lufs"] == pytest.approx(-23, abs=0.01)
        assert abs(_lufs(y, sr) + 23) <= 0.5
    timing = json.loads((out / "timing.json").read_text())
    assert timing["settings"]["format"] == "flac" and timing["settings"]["output_sample_rate"] == 16000


# ---- the Ray stage commits and fingerprints rows exactly as synth does -------------------------

def test_a_ray_actors_flac_rows_are_resumed_by_synth_and_a_format_change_refused(tmp_path, monkeypatch):
    """The actor side without Ray: SynthStage writes FLAC at 16 kHz into its ledger part; plain
    ``synth`` with the same settings skips those rows, and with WAV refuses to mix."""
    pa = pytest.importorskip("pyarrow")
    from cosybatch.run.options import SynthOptions
    from cosybatch.run.ray import stage as stage_mod
    from cosybatch.run.ray.stage import SynthStage

    # asking Ray for the actor id would start a local Ray in this process (and test_ray's own
    # ray.init would then fail): this test is about the commit, not the id
    monkeypatch.setattr(stage_mod, "_actor_id", lambda: "test-actor")

    man = make_manifest(tmp_path, 2)
    rows = [line.split("|") for line in Path(man).read_text().splitlines()]
    out = tmp_path / "out"
    out.mkdir()
    opts = SynthOptions("fake", factory="fake_synth:build", out_format="flac", sample_rate=16000)
    stage = SynthStage(opts, str(out), "cpu", base_dir=str(Path(man).parent))
    got = stage(pa.table({"utt_id": [rows[0][0]], "prompt_text": [rows[0][1]], "prompt_wav": [rows[0][2]],
                          "target_text": [rows[0][3]], "line": [1]}))
    assert got.column("status").to_pylist() == ["ok"]
    assert got.column("file").to_pylist() == [str(out / "u0.flac")] == got.column("wav").to_pylist()
    assert sf.info(str(out / "u0.flac")).samplerate == 16000
    calls = tmp_path / "calls.txt"
    rep = _run(man, FakeSynth(model="fake", calls_file=str(calls)), out, audio_format=opts.audio_format())
    assert rep.exit_code == 0 and rep.totals["skipped"] == 1 and calls.read_text().split() == ["u1"]
    with pytest.raises(SettingsChanged, match="refusing to mix outputs"):
        _run(man, FakeSynth(model="fake"), out, audio_format=AudioFormat(sample_rate=16000))
