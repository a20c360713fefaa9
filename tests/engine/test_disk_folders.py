"""The folders of a disk cache directory that an older file format wrote: an upgrade
changes the format version, so the model's folder name (the version is in the
fingerprint), and the old folder would keep its disk space for good."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from engine import segment_file
from engine.demo_model import demo_model_path
from engine.disk_store import lock_folder, remove_older_format
from engine.segment_file import SegmentHeader, Tensor
from tests.engine.support import start_engine

OLD_FORMAT = "radix-mlx-kv/1"


def write_file(folder: Path, name: str, version: str = segment_file.FORMAT) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    header = SegmentHeader(fingerprint="f" * 32, key=name, start_chain="f" * 32,
                           start_tail=[], start=0, tokens=[1, 2], kind="segment",
                           format=version)
    path = folder / f"{name}{segment_file.SUFFIX}"
    segment_file.write(path, header, [Tensor("keys.0", "F32", np.ones((1, 1, 2, 4), np.float32))])
    return path


def test_a_folder_an_older_format_wrote_is_removed_with_its_files(tmp_path):
    folder = tmp_path / "old"
    files = [write_file(folder, name, OLD_FORMAT) for name in ("a", "b")]
    (folder / "departures.json").write_text("[]")
    (folder / f"c{segment_file.SUFFIX}.123{segment_file.TEMP_SUFFIX}").write_bytes(b"torn")
    sizes = sum(path.stat().st_size for path in files) + len("[]") + len(b"torn")
    assert remove_older_format(folder) == sizes
    assert not folder.exists()


def test_folders_of_this_format_or_with_files_not_ours_are_left_alone(tmp_path):
    current = tmp_path / "current"
    write_file(current, "a")
    mixed = tmp_path / "mixed"
    write_file(mixed, "a", OLD_FORMAT)
    write_file(mixed, "b")
    foreign = tmp_path / "foreign"
    write_file(foreign, "a", OLD_FORMAT)
    (foreign / f"weights{segment_file.SUFFIX}").write_bytes(b"\0" * 16)  # not ours
    empty = tmp_path / "empty"
    empty.mkdir()
    for folder in (current, mixed, foreign, empty):
        before = sorted(p.name for p in folder.iterdir())
        assert remove_older_format(folder) == 0
        assert sorted(p.name for p in folder.iterdir()) == before


def test_a_folder_a_live_process_holds_is_left_alone(tmp_path):
    """An older server still running on its folder keeps it."""
    folder = tmp_path / "old"
    path = write_file(folder, "a", OLD_FORMAT)
    held = lock_folder(folder)
    try:
        assert remove_older_format(folder) == 0
        assert path.exists()
    finally:
        os.close(held)
    assert remove_older_format(folder) > 0


def test_an_engine_removes_older_formats_beside_its_folder_and_keeps_the_rest(tmp_path):
    old = tmp_path / "0ld-fingerprint"
    write_file(old, "a", OLD_FORMAT)
    other_model = tmp_path / "other-model"
    kept = write_file(other_model, "a")
    engine = start_engine(str(demo_model_path("tiny")), disk_cache_dir=str(tmp_path),
                          disk_cache_bytes=2**20)
    try:
        assert engine.disk.rebuilt.wait(30)
        assert not old.exists()
        assert kept.exists()
        assert engine.disk.directory.is_dir()
    finally:
        engine.shutdown()
