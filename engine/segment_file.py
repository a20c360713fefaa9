"""The disk tier's file format: one self-describing safetensors file per tree node.

A file is a plain safetensors file (so `mx.load` and the `safetensors` tools read it),
whose `__metadata__["radix_mlx"]` is a JSON header saying what the file is:

- `format`: this module's version; another version is skipped.
- `fingerprint`: the model (weights, dtype, cache layout) the KV belongs to.
- `key` (also the file name), `start_chain` and `start_tail` (the `PathState` of the
  path it follows, whose key is its parent's), `start` and `tokens`: the token span it
  holds and its place in the tree, so the tree can be rebuilt from the files alone.
- `parent`: that key written out (the fingerprint for a span at the root), so a tool
  walks a file's chain from the JSON alone, as shared/evidence's verify.py does; a file
  whose `parent` is not its start's key is refused.
- `kind`: "segment" (per-layer keys and values of the span) or "snapshot" (the whole
  cache state after the span, with the cache `classes` and non-array `scalars`).
- `kv_bits`, `kv_group_size`: a segment's quantization (engine/kv_quant.py; 0: none,
  the model's dtype), which the server reading it must have too.
- `crc32`: a crc32 of each tensor's bytes (8 hex digits each, in the table's order),
  all checked on every load, in parallel while the arrays are read.

Writes go to a temporary name, are fsynced and renamed, so a file under a final name is
complete; a crash leaves at most a temporary file, removed at the next start. Anything
that does not add up (truncated, torn, foreign, corrupt) raises `BadSegmentFile`.

Each tensor is stored under its own dtype's safetensors name (bfloat16 as BF16), so a
reader gets back the dtype that was written. Pure Python and numpy: the MLX side (which
arrays, and how they are read back) is disk_store.py's.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import struct
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

# Version 1 stored bfloat16 tensors under U16 and read them back as integers; version 2
# keyed a file by its parent's key and its own tokens, so a split of a parent orphaned
# the files below it; version 3's folders were named by a fingerprint that sampled the
# weights' bytes, so a fine-tune could share its base model's folder. Their files are not
# read (the version is part of the model fingerprint, so of the folder's name), and the
# next start deletes them.
FORMAT = "radix-mlx-kv/4"
SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
METADATA_KEY = "radix_mlx"
# A header bigger than this is not one of ours (a 1M-token span is ~8 MB of JSON).
MAX_HEADER_BYTES = 64 * 2**20
# Below this much data a file's checksums are computed inline, not on the pool.
PARALLEL_CHECK_BYTES = 4 * 2**20

# safetensors dtype names; numpy has no bfloat16, so BF16 data is held as its uint16 bits.
NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
                "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
                "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
                "BOOL": np.bool_}


class BadSegmentFile(Exception):
    """A file that must not be loaded: truncated, torn, foreign or corrupt."""


# A path's hash chain takes its tokens this many at a time (`PathState`).
PAGE_TOKENS = 64


@dataclass(frozen=True)
class PathState:
    """A token path as content keys see it: a hash chain, from the model's fingerprint,
    over its whole pages of PAGE_TOKENS tokens, and the tokens after the last page. Its
    `key` names the path, whatever nodes the tree cuts it into: a node split in two keeps
    its key for the part that ends where it ended, so the files below it still name
    their parent (a key over the parent's key and the node's own tokens changed, and a
    restart found those files orphaned)."""

    chain: str
    tail: tuple[int, ...] = ()

    def follow(self, tokens: tuple[int, ...]) -> PathState:
        """The state of this path followed by `tokens`."""
        chain, tail = self.chain, self.tail + tuple(tokens)
        whole = len(tail) - len(tail) % PAGE_TOKENS
        data = _token_bytes(tail[:whole])
        page = PAGE_TOKENS * TOKEN_BYTES
        for start in range(0, len(data), page):
            chain = _digest(chain, b"page", data[start:start + page])
        return PathState(chain, tail[whole:])

    @functools.cached_property
    def key(self) -> str:
        """The path's content key: its chain where it ends on a page boundary (the
        fingerprint for the empty path), else a hash of the chain and the tail; hashed
        once (a node's key is asked for at each save and each child's)."""
        return _digest(self.chain, b"tail", _token_bytes(self.tail)) if self.tail else self.chain


TOKEN_BYTES = 8  # a token id in a key's hash: little-endian int64


def _token_bytes(tokens: tuple[int, ...]) -> bytes:
    return np.asarray(tokens, dtype="<i8").tobytes()


def _digest(chain: str, part: bytes, data: bytes) -> str:
    digest = hashlib.blake2b(chain.encode() + b":" + part + b":", digest_size=16)
    digest.update(data)
    return digest.hexdigest()


@dataclass
class SegmentHeader:
    fingerprint: str
    key: str
    start_chain: str
    start_tail: list[int]
    start: int
    tokens: list[int]
    kind: str  # "segment" or "snapshot"
    classes: list[str] = field(default_factory=list)
    scalars: dict[str, Any] = field(default_factory=dict)
    kv_bits: int = 0  # 0: not quantized (and files written before quantization)
    kv_group_size: int = 0
    # One per tensor, hex of fixed width: a file's size is known before its checksums.
    crc32: list[str] = field(default_factory=list)
    format: str = FORMAT

    @property
    def start_state(self) -> PathState:
        return PathState(self.start_chain, tuple(self.start_tail))

    @property
    def parent(self) -> str:
        """The key of the path the span follows: its parent's (the fingerprint's for the
        root)."""
        return self.start_state.key


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # a NUMPY_DTYPES key
    data: np.ndarray  # C-contiguous, in that dtype's numpy type


Loaded = TypeVar("Loaded")


def encode(header: SegmentHeader,
           table: list[tuple[str, str, tuple[int, ...], int]]) -> tuple[bytes, int]:
    """The safetensors head (length prefix and JSON) of a file holding tensors (name,
    dtype, shape, bytes), and its data length: a file's size is known before its data."""
    # vars, not asdict: asdict copies the token list element by element, on the engine
    # thread (`DiskStore.save`), and json writes the same from the fields themselves.
    metadata = {**vars(header), "parent": header.parent}
    entries: dict[str, Any] = {"__metadata__": {METADATA_KEY: json.dumps(metadata)}}
    offset = 0
    for name, dtype, shape, nbytes in table:
        end = offset + nbytes
        entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data section to 8 bytes
    return struct.pack("<Q", len(text)) + text, offset


def file_bytes(header: SegmentHeader, table: list[tuple[str, str, tuple[int, ...], int]]
               ) -> int:
    """The size of the file `write` makes of these tensors, its checksums included (each
    of a fixed width), known before they are computed."""
    head, data = encode(replace(header, crc32=[crc(b"")] * len(table)), table)
    return len(head) + data


def crc(data: memoryview | np.ndarray) -> str:
    return f"{zlib.crc32(memoryview(data).cast('B')):08x}"


@functools.cache
def _checker() -> ThreadPoolExecutor:
    """Threads for checksums: zlib lets go of the GIL, so a file's tensors are checked
    side by side, and beside the reading of its arrays."""
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                              thread_name_prefix="radix-mlx-crc")


def write(path: Path, header: SegmentHeader, tensors: list[Tensor]) -> int:
    """Write atomically: a temporary name, fsync, rename, fsync the directory. Returns
    the file's size. `header.crc32` is filled in here."""
    header.crc32 = [crc(tensor.data) for tensor in tensors]
    head, _ = encode(header, [(t.name, t.dtype, t.data.shape, t.data.nbytes) for t in tensors])
    temp = path.with_name(f"{path.name}.{os.getpid()}{TEMP_SUFFIX}")  # see `written_by`
    try:
        with open(temp, "wb") as f:
            f.write(head)
            f.writelines(memoryview(tensor.data).cast("B") for tensor in tensors)
            size = f.tell()
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a power cut
    finally:
        os.close(directory)
    return size


def written_by(temp: Path, pid: int) -> bool:
    """Whether `temp`, a temporary file of `write`, is process `pid`'s."""
    return temp.name.endswith(f".{pid}{TEMP_SUFFIX}")


def read_header(path: Path) -> tuple[SegmentHeader, dict[str, Any], int]:
    """The header, the tensor table and the data section's offset, after checking that
    the file is exactly as long as its table says (a truncated file is not)."""
    try:
        with open(path, "rb") as f:
            return _read_header(f)
    except OSError as error:
        raise BadSegmentFile(f"unreadable header: {error!r}") from None


def written_format(path: Path) -> str | None:
    """The format version a file of ours says it was written in; None for any other file."""
    try:
        with open(path, "rb") as f:
            metadata, _, _, _ = _metadata(f)
    except (OSError, BadSegmentFile):
        return None
    version = metadata.get("format")
    return version if isinstance(version, str) else None


def _metadata(f) -> tuple[dict[str, Any], dict[str, Any], int, int]:
    """A file's own header (any format version), its tensor table, the table's length
    and the file's size."""
    try:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise BadSegmentFile("shorter than a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise BadSegmentFile(f"header of {length} bytes in a {size}-byte file")
        table = json.loads(f.read(length))
        metadata = json.loads(table.pop("__metadata__")[METADATA_KEY])
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        raise BadSegmentFile(f"unreadable header: {error!r}") from None
    if not isinstance(metadata, dict):
        raise BadSegmentFile("unreadable header: not an object")
    return metadata, table, length, size


def _read_header(f) -> tuple[SegmentHeader, dict[str, Any], int]:
    metadata, table, length, size = _metadata(f)
    if metadata.get("format") != FORMAT:
        raise BadSegmentFile(f"format {metadata.get('format')!r}, not {FORMAT!r}")
    parent = metadata.pop("parent", None)  # files written before it was: none
    try:
        header = SegmentHeader(**metadata)
        if parent is not None and parent != header.parent:
            raise BadSegmentFile("its parent is not the key of the path it follows")
    except TypeError as error:
        raise BadSegmentFile(f"unreadable header: {error!r}") from None
    try:
        spans = [tuple(entry["data_offsets"]) for entry in table.values()]
        if len(header.crc32) != len(spans) or any(
                entry["dtype"] not in NUMPY_DTYPES for entry in table.values()):
            raise BadSegmentFile("its tensor table and checksums do not match")
    except (KeyError, TypeError) as error:
        raise BadSegmentFile(f"bad tensor table: {error!r}") from None
    data_bytes = max((end for _, end in spans), default=0)
    if 8 + length + data_bytes != size:
        raise BadSegmentFile(f"{size} bytes, the header describes {8 + length + data_bytes}")
    return header, table, 8 + length


def read(path: Path, load: Callable[[str], Loaded]) -> tuple[SegmentHeader, Loaded]:
    """The header, and what `load` makes of the file, once every tensor's checksum is
    right. `load` gets a path to the very file this opened and checks (`/dev/fd/N`) and
    must have read all it needs when it returns; the checksums run on a pool meanwhile."""
    try:
        with open(path, "rb") as f:
            header, table, data_start = _read_header(f)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                sums, loaded, failure = _check_while_loading(
                    memoryview(mapped)[data_start:], table,
                    lambda: load(f"/dev/fd/{f.fileno()}"))
    except (OSError, ValueError) as error:  # opening or mapping it
        raise BadSegmentFile(f"cannot read: {error!r}") from None
    if sums != header.crc32:
        raise BadSegmentFile("checksum mismatch: the data is corrupt")
    if failure is not None:
        raise failure
    return header, loaded


def _check_while_loading(data: memoryview, table: dict[str, Any],
                         load: Callable[[], Loaded]
                         ) -> tuple[list[str], Loaded | None, Exception | None]:
    """Each tensor's crc, and `load`'s result or error."""
    parts = [data[begin:end] for begin, end in (e["data_offsets"] for e in table.values())]
    inline = len(data) < PARALLEL_CHECK_BYTES
    pending = [] if inline else [_checker().submit(crc, part) for part in parts]
    loaded, failure = None, None
    try:
        loaded = load()
    except (OSError, RuntimeError, ValueError) as error:  # MLX's reader's errors
        failure = error  # reported after the checksums: a corrupt file is reported so
    sums = [crc(part) for part in parts] if inline else [p.result() for p in pending]
    for part in parts:
        part.release()  # the map closes only once no view of it is left
    data.release()
    return sums, loaded, failure


def prefetch(path: Path) -> None:
    """Ask the OS to start reading a file we are about to load (no-op where unsupported),
    so the reads of several files overlap their checking and copying."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)
