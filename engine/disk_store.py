"""The disk tier: copies of radix nodes' KV in plain files, written off the engine thread.

The tree (radix/tiers.py) decides what is copied and when a copy may go; this module does
the copying. `DiskStore` is the tree's `Store`:

- `save` (engine thread, under the tree's lock) readies a handle's arrays and queues
  them for the writer thread once they are evaluated, with the engine's other new handles
  at its next settle (`KVStore.after_settle`: a step that publishes 64 prompts makes one
  round trip to the device, not 64); when the queue is full it refuses at once and the
  node simply stays memory-only. Until written, a copy keeps its handle, so a load
  meanwhile costs nothing.
- `discard` queues the file's deletion behind any write of it.
- `load` (engine thread) reads a copy back as a handle, in the dtypes it was written
  in, each tensor checksummed while MLX reads the file.
- `rebuild` (its own thread, at start) puts every good file of this model back in the
  tree as a disk node, parents first; bad or foreign files are deleted with a log line.
  First it removes the folders beside this one that no server will read again: those an
  older format version wrote (`remove_older_format`), and those written for this model's
  directory under an earlier fingerprint (`remove_superseded`).

Files live in `<directory>/<model fingerprint>/`, named by content key (see
segment_file.py and docs/disk-cache.md); another model's files are in another directory
and are never read.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as cache_module

from engine import segment_file
from engine.api import DiskStats
from engine.kv import CacheSnapshot, KVSegment
from engine.kv_quant import KVQuantization
from engine.platform_info import numeric_environment
from engine.segment_file import PAGE_TOKENS, BadSegmentFile, PathState, SegmentHeader, Tensor
from engine.weights_digest import weights_digest, weights_files
from radix import Node, RadixTree

log = logging.getLogger("radix_mlx.disk")

# A disk that stays full fails most writes: their error is logged this often at most.
FAILURE_LOG_SECONDS = 60.0
# In each model's folder: held by the process whose disk tier it is (`lock_folder`).
LOCK_FILE = ".lock"
# In each model's folder: the tree's record of what it let go of, kept at each stop.
DEPARTURES_FILE = "departures.json"
# In each model's folder: the keys of the copies of what memory held at the last stop,
# most recently used first, brought back into memory by the next start.
IN_MEMORY_FILE = "in-memory.json"
# In each model's folder: the model directory and fingerprint it was written for
# (`remove_superseded`).
MODEL_FILE = "model.json"

# The tensors of a segment's file, per layer: keys and values, or their quantized triples.
PLAIN_PARTS = ("keys", "values")
QUANTIZED_PARTS = ("keys", "key_scales", "key_biases", "values", "value_scales",
                   "value_biases")

_MX_TO_ST = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.int32: "I32",
             mx.uint32: "U32", mx.int64: "I64", mx.uint64: "U64", mx.int16: "I16",
             mx.uint16: "U16", mx.int8: "I8", mx.uint8: "U8", mx.bool_: "BOOL"}


# The engine's own code that computes a forward pass's numbers where mlx-lm's would
# (attention and SwiGLU off Metal, and their exp: mlx_lm_internals.use_engine_kernels;
# M-RoPE's positions), rounds KV to `--kv-bits`, or feeds a vision model its images.
FORWARD_CODE = ("engine.attention", "engine.cpu_math", "engine.kv_quant",
                "engine.mlx_lm_internals", "engine.mrope", "engine.vision")


def forward_code_digest() -> str:
    """A digest of `FORWARD_CODE`'s source: read from its files, so that a checkout that
    is not pip-installed has one too."""
    digest = hashlib.blake2b(digest_size=16)
    for name in FORWARD_CODE:
        digest.update(Path(importlib.util.find_spec(name).origin).read_bytes())
    return digest.hexdigest()


def model_fingerprint(model_dir: Path, model: nn.Module, cache: list[Any],
                      memo_directory: Path, vision_code: str | None = None) -> str:
    """What KV on disk must match to be reused: every byte of the weights (config and
    each weights file, hashed whole: see weights_digest.py), their dtypes, the cache
    layout, the MLX and mlx-lm that compute the KV and the engine's own code that does
    (`FORWARD_CODE`: an upgrade may change the math), for a vision model the code that
    computes its images' features (`vision_code`: `Vision.code_version`), where it runs
    (`numeric_environment`: a cache folder moved to another machine, or a BLAS or TF32
    changed, computes other bits), and this file format."""
    digest = hashlib.blake2b(segment_file.FORMAT.encode(), digest_size=16)
    config = model_dir / "config.json"
    digest.update(config.read_bytes() if config.exists() else b"")
    digest.update(weights_digest(weights_files(model_dir),
                                 memo_directory).encode())
    dtypes = sorted({str(p.dtype) for _, p in tree_flatten(model.parameters())})
    layout = [type(c).__name__ for c in cache]
    versions = (mx.__version__, mlx_lm.__version__, forward_code_digest(),
                numeric_environment()) + (
        (vision_code,) if vision_code else ())
    digest.update(repr((dtypes, layout, *versions)).encode())
    return digest.hexdigest()


class DiskCopy:
    """One node's copy on disk (the tree's `Stored`)."""

    __slots__ = ("failed", "key", "nbytes", "path", "pending", "skip", "splittable")

    def __init__(self, key: str, path: Path, nbytes: int, splittable: bool,
                 pending: KVSegment | CacheSnapshot | None = None) -> None:
        self.key = key
        self.path = path
        self.nbytes = nbytes
        self.splittable = splittable
        self.pending = pending  # the handle, until its file is written
        self.failed = False
        # The span's first tokens, which the node holding this copy does not stand for:
        # a rebuild found them in nodes of the tree already (`DiskStore.tail`).
        self.skip = 0

    def __repr__(self) -> str:
        return f"DiskCopy({self.path.name}, {self.nbytes} bytes)"


@dataclass
class _Write:
    copy: DiskCopy
    header: SegmentHeader
    arrays: list[tuple[str, str, mx.array]]  # name, safetensors dtype, evaluated array


@dataclass
class _Delete:
    copy: DiskCopy


class FolderInUse(RuntimeError):
    """Another live process keeps its disk tier for this model in the same folder."""


def lock_folder(directory: Path) -> int:
    """Take the folder's lock file for this process (the OS lets go when it dies), or
    raise `FolderInUse`. One writer per folder: two servers on one folder would each
    delete files the other's tree holds, and rebuild from the other's writes in progress.
    Sharing was the other choice; a folder per server is as fast and needs no protocol."""
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise FolderInUse(
            f"the disk cache folder {directory} is in use by {holder}; give this server "
            "its own --disk-cache-dir, or turn its disk tier off with --disk-cache-bytes 0"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"radix-mlx (pid {os.getpid()})".encode(), 0)
    return fd


def remove_older_format(folder: Path) -> int:
    """Delete a model folder that only an older version of the file format wrote, unless
    a live process holds it (an older server still running), and return the bytes freed.
    The format version is part of the fingerprint, so a folder's name changed with it:
    without this, an upgrade would leave the old folder's gigabytes on disk for good. A
    folder with any file that is not ours, or is of this version, is left as it is."""
    files = list(folder.glob(f"*{segment_file.SUFFIX}"))
    # Stops at the first file that keeps the folder: another model's current folder costs
    # one header read at each start, not one per file.
    if not files or any(segment_file.written_format(path) in (None, segment_file.FORMAT)
                        for path in files):
        return 0
    return _remove_folder(folder, files)


def remove_superseded(folder: Path, model_dir: str, fingerprint: str) -> int:
    """Delete a folder written for the same model directory under another fingerprint:
    its weights changed where they lie, or an MLX or mlx-lm upgrade changed how KV is
    computed, so nothing will read it again; unless a live process holds it (a server of
    the old weights or versions still running). Returns the bytes freed."""
    try:
        written_for = json.loads((folder / MODEL_FILE).read_text())
    except (OSError, ValueError):
        return 0
    if (not isinstance(written_for, dict) or written_for.get("model") != model_dir
            or written_for.get("fingerprint") in (None, fingerprint)):
        return 0
    return _remove_folder(folder, list(folder.glob(f"*{segment_file.SUFFIX}")))


def _remove_folder(folder: Path, files: list[Path]) -> int:
    try:
        lock = lock_folder(folder)
    except (FolderInUse, OSError):
        return 0
    freed = 0
    try:
        for path in [*files, *folder.glob(f"*{segment_file.TEMP_SUFFIX}"),
                     folder / DEPARTURES_FILE, folder / IN_MEMORY_FILE, folder / MODEL_FILE]:
            with contextlib.suppress(FileNotFoundError):
                freed += path.stat().st_size
                path.unlink()
        (folder / LOCK_FILE).unlink(missing_ok=True)
    finally:
        os.close(lock)
    with contextlib.suppress(OSError):
        folder.rmdir()  # kept if something else is in it
    return freed


class DiskStore:
    def __init__(self, directory: Path, capacity_bytes: int, fingerprint: str,
                 segments: bool, queue_bytes: int,
                 quantization: KVQuantization | None = None,
                 model_dir: Path | None = None) -> None:
        self.directory = Path(directory) / fingerprint
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = lock_folder(self.directory)
        # Which model directory this folder is for, so that a later fingerprint of the
        # same directory can remove it (`remove_superseded`).
        self.model_dir = None if model_dir is None else str(Path(model_dir).resolve())
        if self.model_dir is not None:
            (self.directory / MODEL_FILE).write_text(
                json.dumps({"model": self.model_dir, "fingerprint": fingerprint}))
        self.capacity_bytes = capacity_bytes
        self.root_key = fingerprint
        self.root_state = PathState(fingerprint)
        self.kind = "segment" if segments else "snapshot"
        # Segments are kept as this server's quantization makes them; a file of another
        # (its kv_bits and kv_group_size differ) is not this server's state of its tokens.
        self.quantization = quantization
        self._kv_fields = ((quantization.bits, quantization.group_size) if quantization
                           else (0, 0))
        self.queue_bytes = queue_bytes
        self.stats = DiskStats()
        self.rebuilt = threading.Event()
        self._jobs: collections.deque[_Write | _Delete] = collections.deque()
        self._queued = 0
        self._unevaluated = 0  # writes saved whose arrays are not evaluated yet
        # How a write's arrays are evaluated before the writer gets them: with the
        # engine's next settle where the scheduler says so (`Scheduler.attach_disk`).
        self.evaluate: Callable[[list[mx.array], Callable[[], None]], None] = _evaluate_now
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        # The live copy of each key: a file is deleted only if no newer copy owns it.
        self._live: dict[str, DiskCopy] = {}
        # Copies whose write failed, for the engine's thread to take out of the tree
        # (`take_failed`), and when a failure was last logged.
        self._failed: list[DiskCopy] = []
        self._failure_logged = -FAILURE_LOG_SECONDS
        self._writer = threading.Thread(target=self._write_loop, name="radix-mlx-disk",
                                        daemon=True)
        self._writer.start()

    # -- the tree's Store --------------------------------------------------------------

    def save(self, key: str, after: PathState, start: int, tokens: tuple[int, ...],
             handle: KVSegment | CacheSnapshot) -> DiskCopy | None:
        header = SegmentHeader(fingerprint=self.root_key, key=key, start_chain=after.chain,
                               start_tail=list(after.tail), start=start, tokens=list(tokens),
                               kind=self.kind,
                               kv_bits=self._kv_fields[0], kv_group_size=self._kv_fields[1])
        arrays = self._arrays(handle, header)
        data_bytes = sum(a.nbytes for _, _, a in arrays)
        with self._cond:
            if self._closed or self._queued + data_bytes > self.queue_bytes:
                self.stats.writes_dropped += 1
                return None
            nbytes = segment_file.file_bytes(header, [
                (name, dtype, a.shape, a.nbytes) for name, dtype, a in arrays])
            copy = DiskCopy(key, self.directory / f"{key}{segment_file.SUFFIX}",
                            nbytes, handle.splittable, pending=handle)
            self._live[key] = copy
            self._queued += data_bytes
            self.stats.queued_bytes = self._queued
            self._unevaluated += 1
        job = _Write(copy, header, arrays)
        self.evaluate([a for _, _, a in arrays], lambda: self._queue(job))
        return copy

    def _queue(self, job: _Write) -> None:
        with self._cond:
            self._unevaluated -= 1
            self._jobs.append(job)
            self._cond.notify_all()

    def tail(self, copy: DiskCopy, at: int) -> DiskCopy:
        """The copy standing for its span from the `at`-th token on: loading it reads the
        whole file and keeps the rest (`_load`)."""
        copy.skip += at
        return copy

    def discard(self, copy: DiskCopy) -> None:
        with self._cond:
            if self._live.get(copy.key) is copy:
                del self._live[copy.key]
            self._jobs.append(_Delete(copy))
            self._cond.notify()

    # -- loading (engine thread) ---------------------------------------------------------

    def load(self, copies: Iterable[DiskCopy]) -> list[KVSegment | CacheSnapshot]:
        """The handles of `copies`, top of a path first. Raises `BadSegmentFile` (after
        deleting the file) for the first copy that cannot be read; the ones before it
        are returned as the exception's `loaded`."""
        copies = list(copies)
        for copy in copies:  # the OS reads ahead while earlier files are checked
            if copy.pending is None:
                segment_file.prefetch(copy.path)
        handles: list[KVSegment | CacheSnapshot] = []
        for copy in copies:
            try:
                handles.append(self._load(copy))
            except BadSegmentFile as error:
                error.loaded = handles
                raise
        return handles

    def _load(self, copy: DiskCopy) -> KVSegment | CacheSnapshot:
        handle = self._read(copy)
        return handle.split(copy.skip)[1] if copy.skip else handle

    def _read(self, copy: DiskCopy) -> KVSegment | CacheSnapshot:
        pending = copy.pending
        if pending is not None:  # still queued or being written: the data is here
            self.stats.loads += 1
            return pending
        if copy.failed:
            raise BadSegmentFile(f"{copy.path.name} was never written")
        started = time.perf_counter()
        try:
            header, handle = read_copy(copy.path, self.quantization)
            if header.key != copy.key or header.fingerprint != self.root_key:
                raise BadSegmentFile(f"{copy.path.name} holds {header.key} of another model")
            self._check_quantization(header)
        except (KeyError, ValueError, TypeError, AttributeError, RuntimeError) as error:
            # Checksummed, yet not what this model's caches are made of.
            self._reject(copy.path, f"cannot rebuild its cache: {error!r}")
            raise BadSegmentFile(str(error)) from error
        except BadSegmentFile as error:
            self._reject(copy.path, str(error))
            raise
        self.stats.loads += 1
        self.stats.load_bytes += copy.nbytes
        self.stats.load_seconds += time.perf_counter() - started
        return handle

    # -- rebuilding the tree at start (its own thread) ------------------------------------

    def rebuild(self, tree: RadixTree,
                bring_back: Callable[[list[Node]], None] | None = None,
                restore: Callable[[list], tuple[int, list[DiskCopy]]] | None = None) -> None:
        """Put every good file of this model in `tree` as a disk node, parents first.
        The engine serves meanwhile; a file the tree has no place for is deleted. Then
        `bring_back` (the scheduler's) gets the nodes of what memory held at the last
        stop, most recently used first, before the tier counts as rebuilt: a model
        reloaded after an idle unload, or a restarted server, answers the prompts it
        held in memory from memory again. `restore` (the scheduler's) turns the copies
        read into nodes on the engine's thread (`tree.restore_all` here without one)."""
        started = time.perf_counter()
        self.stats.rebuilding = 1
        try:
            self._remove_stale_folders()
            restored = self._rebuild(tree, restore or tree.restore_all)
            held = tree.holding(key for key in self._read_record(IN_MEMORY_FILE)
                                if isinstance(key, str))
        except Exception:  # never fatal: the cache just starts emptier
            log.exception("rebuilding the cache from %s failed", self.directory)
            restored, held = 0, []
        log.info("disk cache: %d nodes restored from %s in %.1f s", restored,
                 self.directory, time.perf_counter() - started)
        if held and bring_back is not None:
            bring_back(held)
        self.stats.rebuilding = 0
        self.rebuilt.set()

    def _remove_stale_folders(self) -> None:
        for folder in self.directory.parent.iterdir():
            if folder == self.directory or not folder.is_dir():
                continue
            if freed := remove_older_format(folder):
                log.info("disk cache: removed %s, %.1f MiB written by an older "
                         "version's file format", folder, freed / 2**20)
            elif self.model_dir is not None and (
                    freed := remove_superseded(folder, self.model_dir, self.root_key)):
                log.info("disk cache: removed %s, %.1f MiB written for this model's "
                         "earlier weights or an earlier MLX or mlx-lm", folder,
                         freed / 2**20)

    def _rebuild(self, tree: RadixTree,
                 restore: Callable[[list], tuple[int, list[DiskCopy]]]) -> int:
        tree.remember_departures(self._departures())
        copies = []
        for path in sorted(self.directory.iterdir()):
            if path.name.endswith(segment_file.TEMP_SUFFIX):
                # Ours are being written now: the engine serves while the tree is rebuilt.
                if not segment_file.written_by(path, os.getpid()):
                    log.info("disk cache: removing %s, a write cut short", path.name)
                    path.unlink(missing_ok=True)
                continue
            if not path.name.endswith(segment_file.SUFFIX):
                continue
            try:
                header, _, _ = segment_file.read_header(path)
                self._check(path, header)
            except BadSegmentFile as error:
                self._reject(path, str(error))
                continue
            copy = DiskCopy(header.key, path, path.stat().st_size, self.kind == "segment")
            copies.append((header.parent, tuple(header.tokens), copy))
        restored, rejected = restore(copies)
        for copy in rejected:
            self._delete_unless_live(copy, "no place in the tree (budget, overlap or orphan)")
        self.stats.restored_nodes += restored
        return restored

    def _check(self, path: Path, header: SegmentHeader) -> None:
        if header.fingerprint != self.root_key:
            raise BadSegmentFile("written for another model")
        if header.kind != self.kind:
            raise BadSegmentFile(f"a {header.kind}, this model keeps {self.kind}s")
        self._check_quantization(header)
        if path.name != f"{header.key}{segment_file.SUFFIX}":
            raise BadSegmentFile(f"holds {header.key} under another name")
        if not header.tokens or len(header.start_tail) != header.start % PAGE_TOKENS:
            raise BadSegmentFile("its start and the path it follows disagree")
        if header.key != header.start_state.follow(tuple(header.tokens)).key:
            raise BadSegmentFile("its key does not match its path and tokens")

    def _check_quantization(self, header: SegmentHeader) -> None:
        if (header.kv_bits, header.kv_group_size) != self._kv_fields:
            raise BadSegmentFile(
                f"written with kv_bits {header.kv_bits or 'none'} (group size "
                f"{header.kv_group_size}); this server has kv_bits "
                f"{self._kv_fields[0] or 'none'} (group size {self._kv_fields[1]})")

    def _reject(self, path: Path, reason: str) -> None:
        log.warning("disk cache: skipping and deleting %s: %s", path.name, reason)
        self.stats.bad_files += 1
        path.unlink(missing_ok=True)

    def _delete_unless_live(self, copy: DiskCopy, reason: str) -> None:
        with self._cond:
            if copy.key in self._live:
                return
        log.debug("disk cache: deleting %s: %s", copy.path.name, reason)
        copy.path.unlink(missing_ok=True)

    # -- lifecycle ------------------------------------------------------------------------

    def take_failed(self) -> list[DiskCopy]:
        """The copies whose write failed since the last call: they hold nothing, and
        counted in the tier's bytes, they would make the budget evict copies that are
        there (`RadixTree.forget_copies`)."""
        with self._cond:
            failed, self._failed = self._failed, []
        return failed

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write saved and every delete is done; False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._unevaluated and not self._jobs and not self._busy, timeout)

    def keep_departures(self, entries: list[tuple[int, str]]) -> None:
        """Keep the tree's record of what it let go of (`RadixTree.departures_at_stop`),
        so the next process of this model can say why a prompt missed."""
        self._keep_record(DEPARTURES_FILE, entries)

    def keep_in_memory(self, keys: list[str]) -> None:
        """Keep the keys of the copies of what memory holds (`RadixTree.memory_keys`), so
        the next process of this model brings them back into memory (`rebuild`)."""
        self._keep_record(IN_MEMORY_FILE, keys)

    def _departures(self) -> list[tuple[int, str]]:
        return [tuple(entry) for entry in self._read_record(DEPARTURES_FILE)
                if isinstance(entry, list) and len(entry) == 2]

    def _keep_record(self, name: str, entries: list) -> None:
        path = self.directory / name
        temp = path.with_name(f"{path.name}.{os.getpid()}{segment_file.TEMP_SUFFIX}")
        try:
            temp.write_text(json.dumps(entries))
            os.replace(temp, path)
        except OSError as error:  # a record helps the next start, it is never needed
            log.warning("disk cache: could not keep %s: %s", name, error)

    def _read_record(self, name: str) -> list:
        try:
            entries = json.loads((self.directory / name).read_text())
        except (OSError, ValueError):
            return []
        return entries if isinstance(entries, list) else []

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new copies, finish the queued work (SIGTERM's path) and let go of the
        folder."""
        with self._cond:
            self._closed = True
        flushed = self.flush(timeout)
        if flushed and self._lock is not None:
            os.close(self._lock)  # a write still queued keeps the folder this process's
            self._lock = None
        return flushed

    # -- the writer thread ----------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._jobs)
                job = self._jobs.popleft()
                self._busy = True
            if isinstance(job, _Write):
                self._write(job)
            else:
                with self._cond:
                    owned = self._live.get(job.copy.key) is not None
                if not owned:
                    job.copy.path.unlink(missing_ok=True)

    def _write(self, job: _Write) -> None:
        copy = job.copy
        data_bytes = sum(a.nbytes for _, _, a in job.arrays)
        try:
            with self._cond:
                wanted = self._live.get(copy.key) is copy  # else discarded before its turn
            if wanted:
                tensors = [Tensor(name, dtype, np.asarray(a)) for name, dtype, a in job.arrays]
                segment_file.write(copy.path, job.header, tensors)
                self.stats.writes += 1
                self.stats.write_bytes += copy.nbytes
        except OSError as error:
            copy.failed = True
            self.stats.write_errors += 1
            with self._cond:
                self._failed.append(copy)
                replaced = self._live.get(copy.key) is copy
                if replaced:
                    del self._live[copy.key]
            if replaced:
                # A file of its name is an earlier copy of the key's that this one was to
                # replace (a split saves the tail under its old key), whose delete was
                # skipped for it: nothing in the tree names that file now.
                copy.path.unlink(missing_ok=True)
            # A full disk fails most writes while it stays full: a line a minute at most.
            now = time.monotonic()
            if now - self._failure_logged >= FAILURE_LOG_SECONDS:
                log.error("disk cache: writing %s failed: %s (%d writes failed in all)",
                          copy.path.name, error, self.stats.write_errors)
                self._failure_logged = now
        finally:
            copy.pending = None
            with self._cond:
                self._queued -= data_bytes
                self.stats.queued_bytes = self._queued

    # -- handles <-> arrays -----------------------------------------------------------------

    def _arrays(self, handle: KVSegment | CacheSnapshot,
                header: SegmentHeader) -> list[tuple[str, str, mx.array]]:
        """The arrays to write with their safetensors dtypes, lazy: they are evaluated on
        the engine thread (`evaluate`) before the writer, which only reads their memory,
        gets them. bfloat16 goes to numpy as its uint16 bits (numpy has no bfloat16) and
        is named BF16 in the file."""
        if isinstance(handle, KVSegment):
            names = _parts(self.quantization)
            named = [(f"{name}.{i}", layer) for name, arrays in zip(names, handle.arrays)
                     for i, layer in enumerate(arrays)]
        else:
            header.classes = [type(c).__name__ for c in handle.cache]
            named = []
            for name, value in tree_flatten([c.state for c in handle.cache]):
                if isinstance(value, mx.array):
                    named.append((name, mx.contiguous(value)))
                else:
                    header.scalars[name] = value
        return [(name, _MX_TO_ST[a.dtype], a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)
                for name, a in named]


def _evaluate_now(arrays: list[mx.array], then: Callable[[], None]) -> None:
    mx.eval(arrays)
    then()


def read_copy(path: Path, quantization: KVQuantization | None = None
              ) -> tuple[SegmentHeader, KVSegment | CacheSnapshot]:
    """A file's header and its handle, its arrays read by MLX itself (straight into
    their own memory, in their own dtypes) while segment_file checks them."""
    def load(name: str) -> dict[str, mx.array]:
        arrays = mx.load(name, format="safetensors")
        mx.eval(list(arrays.values()))
        return arrays

    header, arrays = segment_file.read(path, load)
    return header, _handle(header, arrays, quantization)


def _handle(header: SegmentHeader, loaded: dict[str, mx.array],
            quantization: KVQuantization | None) -> KVSegment | CacheSnapshot:
    if header.kind == "segment":
        names = _parts(quantization)
        layers = len(loaded) // len(names)
        parts = [[loaded[f"{name}.{i}"] for i in range(layers)] for name in names]
        # Every array holds one position per token of the header, or the file is not
        # the KV of its tokens (the wrong-KV bug wrote 623 positions for 621 tokens).
        lengths = {array.shape[-2] for arrays in parts for array in arrays}
        if lengths != {len(header.tokens)}:
            raise BadSegmentFile(f"its KV holds {sorted(lengths)} positions for "
                                 f"{len(header.tokens)} tokens")
        if quantization is None:
            return KVSegment(*parts)
        return KVSegment(tuple(parts[:3]), tuple(parts[3:]), quantization=quantization)
    states = tree_unflatten(list({**header.scalars, **loaded}.items()))
    return CacheSnapshot([getattr(cache_module, cls).from_state(state)
                          for cls, state in zip(header.classes, states)])


def _parts(quantization: KVQuantization | None) -> tuple[str, ...]:
    """The names of a segment's `arrays`, in order: its file's tensors are
    `{name}.{layer}`."""
    return PLAIN_PARTS if quantization is None else QUANTIZED_PARTS
