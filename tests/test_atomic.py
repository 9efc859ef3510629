"""Atomic writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os
import threading

import pytest

from memfit.atomic import replace_dir, write_json_atomic, write_text_atomic


def test_write_creates_parents_and_replaces_leaving_no_temporaries(tmp_path):
    path = tmp_path / "deep" / "out.txt"
    write_text_atomic(path, "one\n")
    write_text_atomic(path, "two\n")
    assert path.read_text() == "two\n"
    assert os.listdir(path.parent) == ["out.txt"]


def test_json_is_sorted_indented_and_round_trips(tmp_path):
    path = tmp_path / "x.json"
    write_json_atomic(path, {"b": 1, "a": [1.5, None]})
    assert json.loads(path.read_text()) == {"a": [1.5, None], "b": 1}
    assert path.read_text().startswith('{\n  "a"') and path.read_text().endswith("}\n")


def test_an_object_that_cannot_be_written_leaves_the_old_file_untouched(tmp_path):
    path = tmp_path / "x.json"
    write_json_atomic(path, {"ok": True})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"bad": object()})
    assert json.loads(path.read_text()) == {"ok": True}
    assert os.listdir(tmp_path) == ["x.json"]


def test_a_write_that_fails_midway_leaves_the_destination_whole(tmp_path, monkeypatch):
    path = tmp_path / "x.txt"
    write_text_atomic(path, "old\n")

    def disk_full(_fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_text_atomic(path, "new, but never finished\n")
    assert path.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["x.txt"]  # and no half-written temporary beside it


def test_a_concurrent_reader_never_sees_a_partial_file(tmp_path):
    path = tmp_path / "big.txt"
    versions = ["a" * 200_000, "b" * 300_000]
    write_text_atomic(path, versions[0])
    seen, stop = set(), threading.Event()

    def read():
        while not stop.is_set():
            seen.add(len(path.read_text()))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(60):
            write_text_atomic(path, versions[i % 2])
    finally:
        stop.set()
        reader.join()
    assert seen <= {200_000, 300_000}, seen


def test_replace_dir_swaps_a_finished_directory_in(tmp_path):
    dst = tmp_path / "model"
    for content in ("first", "second"):
        src = tmp_path / f"build-{content}"
        src.mkdir()
        (src / "weights").write_text(content)
        replace_dir(src, dst)
        assert (dst / "weights").read_text() == content
        assert not src.exists()
    assert sorted(os.listdir(tmp_path)) == ["model"]  # the old copy is gone, no `.model.old-*` left
