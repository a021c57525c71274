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
                        f"b|Prompt two.|{absolute}|Target two.|extra stuff\n   \n#x|y\n")
    assert man.problems == []
    a, b = man.rows
    assert (a.utt_id, a.prompt_text, a.target_text, a.extra, a.line) == ("a", "Prompt one.", "Target one.", None, 3)
    assert a.prompt_wav == folder / "p" / "ok16.wav"
    assert (a.prompt_sr, round(a.prompt_s, 3)) == (16000, 1.0)
    assert a.prompt_size == os.path.getsize(a.prompt_wav)
    assert (b.prompt_wav, b.extra, b.prompt_sr, b.line) == (absolute, "extra stuff", 24000, 4)


def test_trailing_pipe_is_tolerated(folder):
    man = _read(folder, "a|P.|p/ok16.wav|T.|\n")
    assert man.problems == [] and man.rows[0].extra is None


@pytest.mark.parametrize("line,expect", [
    ("a|P.|p/ok16.wav", "expected 4 or 5 '|'-separated fields"),
    ("a|P.|p/ok16.wav|T.|x|y", "found 6"),
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
    man = _read(folder, f"# header\ngood|P.|p/ok16.wav|T.\n{line}\n")
    assert [r.utt_id for r in man.rows] == ["good"]
    assert expect in _one_problem(man, 3)


def test_exactly_30_seconds_and_16k_are_accepted(folder):
    write_prompt(folder / "p" / "edge.wav", 30.0, 16000)
    man = _read(folder, "a|P.|p/edge.wav|T.\n")
    assert man.problems == [] and man.rows[0].prompt_s == 30.0


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
