"""cisjax.files: an atomic write replaces the file whole or leaves the old one and no temp file behind."""

import json

import pytest

from cisjax import files


def test_atomic_open_replaces_whole_and_creates_the_directory(tmp_path):
    path = tmp_path / "new" / "out.txt"
    with files.atomic_open(path) as f:
        f.write("one\n")
    with files.atomic_open(path) as f:
        f.write("two\n")
    assert path.read_text() == "two\n" and [p.name for p in path.parent.iterdir()] == ["out.txt"]


def test_a_failed_write_keeps_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old\n")
    with pytest.raises(RuntimeError, match="mid-write"):
        with files.atomic_open(path) as f:
            f.write("half")
            raise RuntimeError("mid-write")
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_write_jsonl_atomic_keeps_the_keys_asked_for(tmp_path):
    path = tmp_path / "r.jsonl"
    files.write_jsonl_atomic(path, [{"a": 1, "b": 2}, {"b": 3}], ["a", "b"])
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"a": 1, "b": 2}, {"b": 3}]
