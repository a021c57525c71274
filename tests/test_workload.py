import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import soundfile as sf

from cosybatch.bench import workload
from cosybatch.manifest import read_manifest
from cosybatch.scheduler.protocol import CHARS_PER_SECOND, force_tokens

REPO = Path(__file__).resolve().parents[1]


def test_en1088_shape_and_length_statistics():
    prompts, rows = workload.plan()
    assert len(rows) == 1088 and len(prompts) == 666
    assert {r.prompt for r in rows} == set(range(666))  # every prompt used
    assert len({(p.start_s, p.seconds, p.sample_rate, p.gain) for p in prompts}) == 666
    assert all(3.0 <= p.seconds <= 7.0 for p in prompts)
    texts = [r.target_text for r in rows]
    assert len(set(texts)) == 1088
    assert all(t[0].isupper() and t.endswith(".") and t.isascii() for t in texts)
    toks = np.array([force_tokens(t) for t in texts])
    secs = toks / 25.0
    assert 4.95 <= secs.mean() <= 5.25  # EN1088-shaped: ~5.1 s of audio per row
    assert abs(toks.mean() - 128) < 4
    assert secs.min() >= 1.0 and secs.max() <= 15.0
    assert secs.std() > 1.0  # varied lengths, not one size
    words = np.array([len(t.split()) for t in texts])
    assert 8 <= words.mean() <= 20


def test_force_tokens_is_deterministic_and_scales():
    t = "The quiet river went past the old garden."
    assert force_tokens(t) == force_tokens(t)
    assert force_tokens(t, 50.0) in (2 * force_tokens(t) - 1, 2 * force_tokens(t),
                                              2 * force_tokens(t) + 1)
    assert force_tokens("") == 1
    # the jitter stays within +-10 % of the length-based estimate
    for text in workload.target_texts(50, seed=3):
        base = len(text) / CHARS_PER_SECOND * 25
        assert 0.89 * base - 1 <= force_tokens(text) <= 1.11 * base + 1


def test_plan_is_seeded():
    a = workload.plan(40, 20, seed=0)
    assert a == workload.plan(40, 20, seed=0)
    assert a != workload.plan(40, 20, seed=1)


def test_written_workload_is_a_valid_manifest(tmp_path):
    m = workload.write(tmp_path / "w", (), n_rows=14, n_prompts=9, seed=2)
    man = read_manifest(m)
    assert man.problems == [] and len(man.rows) == 14
    digests = set()
    for r in man.rows[:9]:
        info = sf.info(str(r.prompt_wav))
        assert info.samplerate in (16000, 24000) and 3.0 <= info.duration <= 7.01
        digests.add(hashlib.sha256(r.prompt_wav.read_bytes()).hexdigest())
    assert len(digests) == 9  # distinct files
    wav, _ = sf.read(str(man.rows[0].prompt_wav))
    assert 0.3 < np.max(np.abs(wav)) <= 0.91 and np.std(wav) > 0.01
    # same arguments, same bytes
    m2 = workload.write(tmp_path / "w2", (), n_rows=14, n_prompts=9, seed=2)
    assert m2.read_text() == m.read_text()
    assert (tmp_path / "w2/prompts/p0003.wav").read_bytes() == (tmp_path / "w/prompts/p0003.wav").read_bytes()


def test_sources_are_cut_into_prompts(tmp_path):
    src = tmp_path / "src.wav"
    sf.write(str(src), workload.speechlike(2.5, 22050, seed=7), 22050)
    out = tmp_path / "w"
    m = workload.ensure(out, [src], n_rows=5, n_prompts=5)
    stamp = (out / "workload.json").read_text()
    mtime = m.stat().st_mtime_ns
    assert workload.ensure(out, [src], n_rows=5, n_prompts=5) == m and m.stat().st_mtime_ns == mtime  # reused
    assert (out / "workload.json").read_text() == stamp
    assert len(read_manifest(m).rows) == 5


def test_script_runs(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "scripts/make_workload.py"), "--out", str(tmp_path / "w"),
                        "--rows", "6", "--prompts", "4", "--sources"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert '"rows": 6' in r.stdout and (tmp_path / "w/meta.lst").is_file()
