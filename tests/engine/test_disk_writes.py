"""When the disk tier's copies are computed: with the engine's other new handles, at its
settle, not one evaluation per copy in the middle of a step (each a round trip to the
device), and never by the writer thread."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest

from engine import segment_file
from engine.demo_model import demo_model_path
from engine.disk_store import DiskStore, read_copy
from engine.kv import KVSegment, KVStore
from engine.loader import load_model
from engine.segment_file import BadSegmentFile, PathState, SegmentHeader, Tensor

FINGERPRINT = "d" * 32


def segment(start: float) -> KVSegment:
    """Two layers' keys and values of three tokens, lazily computed."""
    base = mx.arange(2 * 3 * 4, dtype=mx.float32).reshape(1, 2, 3, 4) + start
    return KVSegment([base * 1, base * 2], [base * 3, base * 4])


def test_a_copy_is_written_once_its_arrays_are_evaluated_and_flush_waits_for_it(tmp_path):
    waiting = []
    store = DiskStore(tmp_path, 2**30, FINGERPRINT, True, 2**30)
    store.evaluate = lambda arrays, then: waiting.append((arrays, then))
    handle = segment(1.0)
    copy = store.save("k" * 32, PathState(FINGERPRINT), 0, (5, 6, 7), handle)
    assert copy is not None and copy.pending is handle
    assert not store.flush(0.2), "flush returned with a copy not yet handed to the writer"
    assert not copy.path.exists()

    (arrays, then), = waiting
    mx.eval(arrays)
    then()
    assert store.flush(10)
    assert copy.pending is None and copy.path.exists()
    assert copy.nbytes == copy.path.stat().st_size  # what the tier's budget counts
    header, read = read_copy(copy.path)
    assert header.tokens == [5, 6, 7]
    for written, original in zip(read.arrays, handle.arrays):
        for a, b in zip(written, original):
            np.testing.assert_array_equal(np.array(a), np.array(b))
    store.close(10)


def test_a_header_names_its_parent_and_a_file_naming_another_is_refused(tmp_path):
    """`parent` lets a tool walk a file's chain from the JSON alone (shared/evidence's
    verify.py does); it must say what the start state says."""
    header = SegmentHeader(fingerprint=FINGERPRINT, key="k" * 32, start_chain=FINGERPRINT,
                           start_tail=[1, 2], start=2, tokens=[3], kind="segment")
    path = tmp_path / f"{header.key}.safetensors"
    segment_file.write(path, header, [Tensor("keys.0", "F32", np.zeros(4, np.float32))])
    data = path.read_bytes()
    assert f'\\"parent\\": \\"{header.parent}\\"'.encode() in data
    assert segment_file.read_header(path)[0] == header
    path.write_bytes(data.replace(header.parent.encode(), b"0" * len(header.parent)))
    with pytest.raises(BadSegmentFile, match="parent"):
        segment_file.read_header(path)


def test_a_discarded_copy_waiting_for_its_evaluation_is_never_written(tmp_path):
    waiting = []
    store = DiskStore(tmp_path, 2**30, FINGERPRINT, True, 2**30)
    store.evaluate = lambda arrays, then: waiting.append((arrays, then))
    copy = store.save("k" * 32, PathState(FINGERPRINT), 0, (5, 6, 7), segment(1.0))
    store.discard(copy)
    (arrays, then), = waiting
    mx.eval(arrays)
    then()
    assert store.flush(10)
    assert not copy.path.exists()
    store.close(10)


def test_a_full_disk_hands_its_unwritten_copies_back_and_logs_sparingly(tmp_path, monkeypatch,
                                                                  caplog):
    """Writes that fail (ENOSPC) are counted and their copies handed to the engine's
    thread to leave the tree (`take_failed`); a disk that stays full logs an error a
    minute, not one a write."""
    def full(path, header, tensors):
        raise OSError(28, "No space left on device")

    store = DiskStore(tmp_path, 2**30, FINGERPRINT, True, 2**30)
    store.evaluate = lambda arrays, then: (mx.eval(arrays), then())
    earlier = store.save("0" * 32, PathState(FINGERPRINT), 0, (5, 6, 7), segment(0.0))
    assert store.flush(10) and earlier.path.exists()
    write = segment_file.write
    monkeypatch.setattr(segment_file, "write", full)
    with caplog.at_level(logging.INFO, logger="radix_mlx.disk"):
        copies = [store.save(f"{i}" * 32, PathState(FINGERPRINT), 0, (5, 6, 7), segment(i))
                  for i in range(3)]
        store.discard(earlier)  # after its key's new copy, as a split saves the tail
        assert store.flush(10)
        assert store.take_failed() == copies and store.take_failed() == []
        assert not earlier.path.exists()  # named by no copy once its replacement failed
        monkeypatch.setattr(segment_file, "write", write)
        store.save("9" * 32, PathState(FINGERPRINT), 0, (5, 6, 7), segment(9.0))
        assert store.flush(10)
    assert store.stats.write_errors == 3 and store.stats.writes == 2
    assert [record.levelname for record in caplog.records] == ["ERROR"]
    store.close(10)


def test_settle_evaluates_the_waiting_arrays_with_the_handles_then_hands_them_on():
    kv = KVStore(load_model(str(demo_model_path())).model)
    handed = []
    lazy = mx.arange(4) * 3
    kv.after_settle([lazy], lambda: handed.append("copy"))
    assert handed == []
    kv.settle()
    assert handed == ["copy"]
    kv.settle()
    assert handed == ["copy"], "a waiting write was handed on twice"


def test_a_file_whose_kv_is_not_as_long_as_its_tokens_is_refused(tmp_path):
    """Checksums prove the bytes are the writer's; a file that says 3 tokens and holds the
    KV of 4 positions (the wrong-KV bug's 621 tokens over 623) is not the KV of its
    tokens, and is refused as it is read."""
    header = SegmentHeader(fingerprint=FINGERPRINT, key="k" * 32, start_chain=FINGERPRINT,
                           start_tail=[], start=0, tokens=[5, 6, 7], kind="segment")
    path = tmp_path / f"{header.key}.safetensors"
    four = np.zeros((1, 2, 4, 4), np.float32)
    segment_file.write(path, header, [Tensor(f"{part}.{layer}", "F32", four)
                                      for part in ("keys", "values") for layer in range(2)])
    with pytest.raises(BadSegmentFile, match=r"\[4\] positions for 3 tokens"):
        read_copy(path)
