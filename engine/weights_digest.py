"""A digest of every byte of a model's weights files, remembered by each file's identity.

The disk tier may only hand a model the KV its own weights computed. A digest of samples
(the files' sizes and first and last bytes) is not proof: a fine-tune that changes only
middle layers keeps all three, and its server would read the other model's KV as its own.
So each file is hashed whole, once: the digest is kept in a memo beside the disk cache,
under the file's identity (path, device, inode, size, mtime and ctime, all in ns). Any
write to a file changes its mtime and ctime, and ctime cannot be set back, so a file
whose identity matches is the file that was hashed; anything else is hashed again.

A file is hashed in blocks on several threads (hashlib releases the GIL), and the blocks'
digests are hashed in order: a 16 GB model takes seconds at SSD speed, once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("radix_mlx.disk")

MEMO_FILE = "weights-digests.json"
BLOCK_BYTES = 64 << 20
READ_BYTES = 4 << 20
HASH_THREADS = min(8, os.cpu_count() or 1)
# Files of a model directory that hold weights, not what its tokenizer reads.
WEIGHTS_SUFFIXES = frozenset({".safetensors", ".gguf", ".bin", ".pt", ".pth", ".npz"})


def weights_digest(files: Iterable[Path], memo_directory: Path) -> str:
    """One digest of the named files' names and whole contents, in the given order."""
    memo_path = memo_directory / MEMO_FILE
    memo = _read_memo(memo_path)
    digest = hashlib.blake2b(digest_size=16)
    changed = False
    for path in files:
        name, identity = str(path.resolve()), file_identity(path)
        known = memo.get(name)
        if known is None or known[0] != identity:
            started = time.perf_counter()
            known = memo[name] = (identity, file_digest(path))
            changed = True
            log.info("weights digest of %s: %.1f s", path, time.perf_counter() - started)
        digest.update(f"{path.name}:{known[1]}\n".encode())
    if changed:
        _write_memo(memo_path, {name: entry for name, entry in memo.items()
                                if os.path.exists(name)})
    return digest.hexdigest()


def weights_files(model_dir: Path) -> list[Path]:
    """A model directory's weights files, in the order its fingerprint hashes them."""
    return sorted(model_dir.glob("*.safetensors"))


def model_files_identity(model_dir: Path) -> dict[str, list[int]]:
    """The identity of each file a fingerprint reads (config.json and the safetensors),
    by name. Taken before a model loads and again once its fingerprint is computed: equal,
    the bytes hashed are the bytes loaded; a file replaced in between (an update landing
    as a server starts) would name the new weights' folder for KV the old ones compute."""
    paths = [model_dir / "config.json", *weights_files(model_dir)]
    return {path.name: file_identity(path) for path in paths if path.exists()}


def tokenizer_files_identity(model_dir: Path) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The identity of every file of a model directory but its weights: its tokenizer,
    chat template and end-of-sequence ids are read from them."""
    return tuple((path.name, tuple(file_identity(path))) for path in sorted(model_dir.iterdir())
                 if path.is_file() and path.suffix not in WEIGHTS_SUFFIXES)


def file_digest(path: Path) -> str:
    """blake2b of each block of the file, then of the blocks' digests in order."""
    size = path.stat().st_size
    starts = range(0, max(size, 1), BLOCK_BYTES)
    with open(path, "rb") as f, \
            concurrent.futures.ThreadPoolExecutor(HASH_THREADS) as pool:
        blocks = pool.map(lambda start: _block_digest(f.fileno(), start, size), starts)
        whole = hashlib.blake2b(f"{size}:".encode(), digest_size=32)
        for block in blocks:
            whole.update(block)
    return whole.hexdigest()


def _block_digest(fd: int, start: int, size: int) -> bytes:
    digest = hashlib.blake2b(digest_size=32)
    end = min(start + BLOCK_BYTES, size)
    while start < end:
        data = os.pread(fd, min(READ_BYTES, end - start), start)
        if not data:
            raise OSError(f"weights file shrank while being hashed (fd {fd})")
        digest.update(data)
        start += len(data)
    return digest.digest()


def file_identity(path: Path) -> list[int]:
    """What changes when a file is replaced or written in place."""
    stat = path.stat()
    return [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def _read_memo(path: Path) -> dict[str, tuple[list[int], str]]:
    """Resolved path -> (the file's identity when hashed, its digest); a memo that is not
    one is empty: its files are hashed again."""
    try:
        memo = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(memo, dict):
        return {}
    return {name: (entry[0], entry[1]) for name, entry in memo.items()
            if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str)}


def _write_memo(path: Path, memo: dict[str, tuple[list[int], str]]) -> None:
    """Atomically: servers starting at once each write a whole memo, and the last wins
    (a lost entry only costs a hash at a later start). Files gone are dropped."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{MEMO_FILE}.")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(memo, f)
            os.replace(temporary, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
