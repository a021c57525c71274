"""Manifest parsing: every defect is reported with file:line and its reason; nothing crashes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cosybatch.manifest import ManifestError, parse_manifest_bytes, read_manifest
from fake_synth import write_prompt


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    (tmp_path / "p").mkdir()
    write_prompt(tmp_path / "p" / "ok16.wav", 1.0, 16000)
    write_prompt(tmp_path / "p" / "ok24.wav", 2.0, 24000)
    return tmp_path


def _read(folder: Path, text: str | bytes):
    path = folder / "meta.lst"
    path.write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
    return read_manifest(path)


def _one_problem(man, line: int) -> str:
    msgs = [str(p) for p in man.problems if p.line == line]
    assert len(msgs) == 1, msgs
    assert msgs[0].startswith(f"{man.path}:{line}: "), msgs[0]
    return msgs[0]


def test_good_rows_parse_with_resolved_paths_and_header_info(folder):
    absolute = folder / "p" / "ok24.wav"
    man = _read(folder, "\ufeff# comment\n\n a | Prompt one. | p/ok16.wav | Target one. \r\n"
                        f"b|Prompt two.|{absolute}|Target two.|ref/b.wav\n   \n#x|y\n")
    assert man.problems == []
    a, b = man.rows
    assert (a.utt_id, a.prompt_text, a.target_text, a.extra, a.line) == ("a", "Prompt one.", "Target one.", None, 3)
    assert a.prompt_wav == folder / "p" / "ok16.wav"
    assert (a.prompt_sr, round(a.prompt_s, 3)) == (16000, 1.0)
    assert a.prompt_size == os.path.getsize(a.prompt_wav)
    assert (b.prompt_wav, b.extra, b.prompt_sr, b.line) == (absolute, "ref/b.wav", 24000, 4)


def test_trailing_pipe_is_tolerated(folder):
    man = _read(folder, "a|P.|p/ok16.wav|T.|\n")
    assert man.problems == [] and man.rows[0].extra is None


@pytest.mark.parametrize("line,expect", [
    ("a|P.|p/ok16.wav", "expected 4 or 5 '|'-separated fields"),
    # a '|' in the target text: refused with the text in view, never cut into a 5th field
    ("a|P.|p/ok16.wav|T.|x|y", "the target text contains '|' ('T.|x|y')"),
    ("a|P.|p/ok16.wav|Choose A|B.", "the target text contains '|' ('Choose A|B.')"),
    ("a|P.|p/ok16.wav|A|B|ref.wav", "the target text contains '|'"),
    # nothing left to synthesize once normalized
    ("a|P.|p/ok16.wav|...!?", "target text has nothing to synthesize after normalization (wetext): '...!?'"),
    ("a|P.|p/ok16.wav|\U0001F600\U0001F389", "nothing to synthesize"),
    ("a|P.|p/ok16.wav|。！……", "nothing to synthesize"),
    # a prompt too short for one speech token
    ("a|P.|p/short40ms.wav|T.", "40.0 ms long; a prompt must be longer than 40 ms to give a speech token"),
    ("just some text", "found 1"),
    ("|P.|p/ok16.wav|T.", "empty field: utt_id"),
    ("a||p/ok16.wav|T.", "empty field: prompt_text"),
    ("a|P.||T.", "empty field: prompt_wav"),
    ("a|P.|p/ok16.wav|  ", "empty field: target_text"),
    ("a|P.|p/missing.wav|T.", "prompt wav not found"),
    ("a|P.|p/empty.wav|T.", "prompt wav is empty (0 bytes)"),
    ("a|P.|p/zero_frames.wav|T.", "prompt wav is empty (no audio frames)"),
    ("a|P.|p/garbage.wav|T.", "prompt wav unreadable"),
    ("a|P.|p|T.", "not a regular file"),
    ("a|P.|p/low8k.wav|T.", "sample rate 8000 Hz is below 16000 Hz"),
    ("a|P.|p/long31s.wav|T.", "31.0 s long, over the 30 s limit"),
    ("a/b|P.|p/ok16.wav|T.", "not a safe file name: contains a path separator"),
    ("a\\b|P.|p/ok16.wav|T.", "contains a path separator"),
    ("..|P.|p/ok16.wav|T.", "contains '..'"),
    ("x..y|P.|p/ok16.wav|T.", "contains '..'"),
    (".hidden|P.|p/ok16.wav|T.", "starts with '.'"),
    ("a\x07b|P.|p/ok16.wav|T.", "contains control character U+0007"),
    ("a\x1bb|P.|p/ok16.wav|T.", "contains control character U+001B"),
    ("x" * 201 + "|P.|p/ok16.wav|T.", "longer than 200 bytes"),
])
def test_each_bad_case_has_its_message_and_line(folder, line, expect):
    (folder / "p" / "empty.wav").write_bytes(b"")
    (folder / "p" / "garbage.wav").write_bytes(b"RIFF not really a wav file at all" * 4)
    sf.write(str(folder / "p" / "zero_frames.wav"), np.zeros(0, np.float32), 16000)
    write_prompt(folder / "p" / "low8k.wav", 1.0, 8000)
    write_prompt(folder / "p" / "long31s.wav", 31.0, 16000)
    write_prompt(folder / "p" / "short40ms.wav", 0.040, 24000)
    man = _read(folder, f"# header\ngood|P.|p/ok16.wav|T.\n{line}\n")
    assert [r.utt_id for r in man.rows] == ["good"]
    assert expect in _one_problem(man, 3)


def test_exactly_30_seconds_and_16k_are_accepted(folder):
    write_prompt(folder / "p" / "edge.wav", 30.0, 16000)
    man = _read(folder, "a|P.|p/edge.wav|T.\n")
    assert man.problems == [] and man.rows[0].prompt_s == 30.0


def test_prompt_length_edge_is_one_speech_token(folder):
    # 40 ms exactly is refused (the frontend has no room to pad its prompt mel); one sample more
    # gives a token (scripts/min_prompt.py) and is accepted, at every rate
    for sr in (16000, 22050, 24000, 48000):
        sf.write(str(folder / "p" / f"at{sr}.wav"), np.full(sr // 25, 0.1, np.float32), sr)
        sf.write(str(folder / "p" / f"over{sr}.wav"), np.full(sr // 25 + 1, 0.1, np.float32), sr)
    man = _read(folder, "".join(f"a{sr}|P.|p/at{sr}.wav|T.\nb{sr}|P.|p/over{sr}.wav|T.\n"
                                for sr in (16000, 22050, 24000, 48000)))
    assert [r.utt_id for r in man.rows] == ["b16000", "b22050", "b24000", "b48000"]
    assert all("must be longer than 40 ms" in p.reason for p in man.problems) and len(man.problems) == 4


def test_an_audio_file_name_may_follow_the_target_text(folder):
    man = _read(folder, "a|P.|p/ok16.wav|T.|gt/a.WAV\nb|P.|p/ok16.wav|T.|gt/b.flac\nc|P.|p/ok16.wav|T.|b.\n")
    assert [(r.utt_id, r.extra) for r in man.rows] == [("a", "gt/a.WAV"), ("b", "gt/b.flac")]
    assert "the target text contains '|' ('T.|b.')" in _one_problem(man, 3)


def test_what_is_left_to_synthesize_follows_the_normalizer(folder):
    # wetext reads a lone "$" as "dollar"; without a normaliser it is punctuation and dropped
    text = "a|P.|p/ok16.wav|$\nb|P.|p/ok16.wav|Item 1.\n"
    (folder / "meta.lst").write_text(text)
    assert [r.utt_id for r in read_manifest(folder / "meta.lst").rows] == ["a", "b"]
    man = read_manifest(folder / "meta.lst", "none")
    assert [r.utt_id for r in man.rows] == ["b"]
    assert "nothing to synthesize after normalization (none): '$'" in _one_problem(man, 1)


def test_duplicate_ids_reported_at_the_later_line(folder):
    man = _read(folder, "a|P.|p/ok16.wav|T.\nb|P.|p/ok16.wav|T.\na|Q.|p/ok24.wav|U.\n")
    assert [r.utt_id for r in man.rows] == ["a", "b"]
    assert "duplicate utt_id 'a' (first seen at line 1)" in _one_problem(man, 3)


def test_invalid_utf8_line_is_reported_and_others_survive(folder):
    man = _read(folder, b"a|P.|p/ok16.wav|T.\nb|\xff\xfe|p/ok16.wav|T.\nc|P.|p/ok16.wav|T.\n")
    assert [r.utt_id for r in man.rows] == ["a", "c"]
    assert "not valid UTF-8" in _one_problem(man, 2)


def test_several_problems_on_one_line_are_all_listed(folder):
    man = _read(folder, "a/b||p/missing.wav|T.\n")
    reasons = sorted(p.reason for p in man.problems)
    assert len(reasons) == 3 and all(p.line == 1 and p.utt_id == "a/b" for p in man.problems)
    assert any("empty field: prompt_text" in r for r in reasons)
    assert any("path separator" in r for r in reasons)
    assert any("not found" in r for r in reasons)


def test_unreadable_manifest_raises_manifest_error(tmp_path):
    with pytest.raises(ManifestError, match="not found"):
        read_manifest(tmp_path / "nope.lst")
    with pytest.raises(ManifestError, match="directory"):
        read_manifest(tmp_path)


def test_relative_prompts_resolve_against_the_manifest_folder_not_cwd(folder, tmp_path, monkeypatch):
    sub = tmp_path / "elsewhere"
    sub.mkdir()
    monkeypatch.chdir(sub)
    man = _read(folder, "a|P.|p/ok16.wav|T.\n")
    assert man.problems == [] and man.rows[0].prompt_wav.is_file()


_alphabet = st.sampled_from(list(b"ab|./\\\n\r#\x00\xff\xef\xbb\xbf p.wavok16 ") + [0x7f, 0xc3, 0xa9])


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=400), st.lists(_alphabet, max_size=200).map(bytes)))
@example(data=b"a|P.|p/ok\x0016.wav|T.\n")
@example(data=b"a|P.|" + b"x" * 5000 + b".wav|T.\n")
@example(data=b"\xef\xbb\xbfa|P.|p/ok16.wav|T.\na|P.|p/ok16.wav|T.\n")
@example(data=b"a|P.|~|T.\n")
def test_parser_never_crashes_on_arbitrary_bytes(folder, data):
    man = parse_manifest_bytes(data, "fuzz.lst", folder)
    for p in man.problems:
        assert p.line >= 1 and str(p).startswith(f"fuzz.lst:{p.line}: ")
    for r in man.rows:
        assert r.utt_id and "/" not in r.utt_id and r.prompt_sr >= 16000
    ids = [r.utt_id for r in man.rows]
    assert len(ids) == len(set(ids))
