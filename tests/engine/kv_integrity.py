"""The cache trust check: every KV a tree holds, in memory or in a disk file, against a
fresh forward of the node's own token path.

A node stands for the positions [start, end) of its path; its memory handle and its disk
copy must both hold exactly those positions' keys and values, as a forward of the path
from scratch computes them (within float tolerance: the engine computes in chunks and
batches). A whole-state snapshot is checked by the answer it gives instead (its layout
depends on how the state was reached): the logits of one more token after it, against a
forward of its path and that token from scratch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx_lm.models.cache import make_prompt_cache

from engine import segment_file
from engine.disk_store import DiskCopy, read_copy
from engine.engine import Engine
from engine.kv import CacheSnapshot, KVSegment
from engine.mlx_lm_internals import clone_cache
from engine.platform_info import apply_mlx_env_defaults

# Float32 demo models: a correct node differs from a fresh forward by ~1e-5, a node
# holding other positions' KV by ~1 (shared/evidence: 1.4-18.7). In bfloat16 a chunked
# forward and a whole one round apart by up to a few of its steps (~1e-2 here).
TOLERANCE = {mx.float32: 1e-3, mx.float16: 2e-2, mx.bfloat16: 0.1}


@dataclass
class Checked:
    memory: int = 0  # nodes whose memory handle was compared
    disk: int = 0  # nodes whose disk file was compared
    snapshots: int = 0  # nodes whose whole-state snapshot was compared


def check_tree_kv(engine: Engine, model: nn.Module) -> Checked:
    """Assert that every span the engine's tree holds is the KV of its tokens. Call it
    while the engine is idle (it reads the tree's handles from this thread)."""
    scheduler = engine._scheduler
    if engine.disk is not None:
        assert engine.disk.flush(30), "disk writes still queued"
    with scheduler.tree._mutex:
        nodes = tree_nodes(scheduler.tree.root)
        held = [(node.tokens, node.path_tokens_locked(), node.handle, node.stored) for node in nodes]
    checked = Checked()
    forwards: dict[tuple[int, ...], list] = {}
    for edge, path, handle, stored in sorted(held, key=lambda h: -len(h[1])):
        if isinstance(handle, CacheSnapshot):
            _compare_answers(model, handle, path)
            checked.snapshots += 1
            continue
        if not isinstance(handle, KVSegment) and not (stored and stored.splittable):
            continue  # junctions
        fresh = _fresh(model, path, forwards)
        start = len(path) - len(edge)
        if isinstance(handle, KVSegment):
            _compare(handle, fresh, start, path, "memory")
            checked.memory += 1
        if isinstance(stored, DiskCopy) and stored.splittable:
            copy = _read(stored, edge, start)
            _compare(copy, fresh, start, path, "disk")
            if isinstance(handle, KVSegment):
                _same_bits(copy, handle, start, path)
            checked.disk += 1
    return checked


def check_folder_kv(folder: Path, model: nn.Module) -> list[str]:
    """The same check for the files of a disk tier's model folder alone, each against a
    forward of its token path (its chain of parents): what a restart would load. Returns
    one line per file that is wrong, or whose chain is broken. Its forwards compute as the
    engine's do: a process with no engine of its own (the soak's, after its servers) would
    otherwise multiply in MLX's defaults, TF32 on a GPU, ~1e-3 from the engine's float32."""
    apply_mlx_env_defaults()
    headers = {}
    for path in folder.glob(f"*{segment_file.SUFFIX}"):
        header, _, _ = segment_file.read_header(path)
        headers[header.key] = (path, header)
    spans = []
    for path, header in headers.values():
        if header.kind != "segment":
            continue
        chain, parent = [header], header.parent
        while parent in headers:
            chain.append(headers[parent][1])
            parent = chain[-1].parent
        if parent != header.fingerprint:
            continue  # an orphan: a rebuild deletes it unread
        spans.append((path, header, tuple(t for part in reversed(chain) for t in part.tokens)))
    problems, forwards = [], {}
    # Longest paths first: a prefix's forward is then a slice of one already made.
    for path, header, tokens in sorted(spans, key=lambda span: -len(span[2])):
        try:
            segment = _read_file(path)
            _compare(segment, _fresh(model, tokens, forwards), header.start, tokens, "disk")
        except AssertionError as error:
            problems.append(f"{path.name}: {error}")
    return problems


def tree_nodes(root) -> list:
    """Every node under `root`, depth first."""
    found, stack = [], list(root.children.values())
    while stack:
        node = stack.pop()
        found.append(node)
        stack.extend(node.children.values())
    return found


def _fresh(model: nn.Module, path: tuple[int, ...], forwards: dict) -> list:
    """Per layer (keys, values) of a forward of `path` from scratch, reusing a longer
    path's forward when `path` is its prefix (causal: later tokens change nothing)."""
    for longer, layers in forwards.items():
        if longer[:len(path)] == path:
            return layers
    cache = make_prompt_cache(model)
    model(mx.array([path]), cache=cache)
    layers = [(c.keys[..., :len(path), :], c.values[..., :len(path), :]) for c in cache]
    mx.eval(layers)
    forwards[path] = layers
    return layers


def _compare_answers(model: nn.Module, snapshot: CacheSnapshot, path: tuple[int, ...],
                     probe: int = 1) -> None:
    """The logits of `probe` after the snapshot's state, against those after `path`."""
    after = model(mx.array([[probe]]), cache=clone_cache(snapshot.cache))[0, -1]
    fresh = model(mx.array([[*path, probe]]), cache=make_prompt_cache(model))[0, -1]
    error = mx.abs(after.astype(mx.float32) - fresh.astype(mx.float32)).max().item()
    assert error <= TOLERANCE[after.dtype], (
        f"the snapshot at {len(path)} tokens answers as another state (max diff {error:.3g})")


def _read(stored: DiskCopy, edge: tuple[int, ...], start: int) -> KVSegment:
    """The file's KV as the engine would load it, after checking its header says the
    same span as the node (from the copy's `skip` on: a rebuild found the span's first
    tokens in nodes of their own)."""
    if stored.pending is not None:  # the flush above wrote it; a copy is never re-queued
        raise AssertionError(f"{stored!r} still queued")
    header, _, _ = segment_file.read_header(stored.path)
    skip = stored.skip
    assert (header.start + skip, tuple(header.tokens[skip:])) == (start, edge), (
        f"{stored.path.name}: file says {header.start}+{len(header.tokens)} from {skip} "
        f"on, node is {start}+{len(edge)}")
    segment = _read_file(stored.path)
    return segment.split(skip)[1] if skip else segment


def _read_file(path: Path) -> KVSegment:
    _, segment = read_copy(path)
    assert isinstance(segment, KVSegment)
    return segment


def _same_bits(copy: KVSegment, handle: KVSegment, start: int, path: tuple[int, ...]) -> None:
    """A disk copy is its memory handle's arrays written out: it must come back bit for
    bit, in the same dtype."""
    for side, copied, held in (("keys", copy.keys, handle.keys),
                               ("values", copy.values, handle.values)):
        for layer, (a, b) in enumerate(zip(copied, held, strict=True)):
            assert a.dtype == b.dtype and mx.array_equal(a, b).item(), (
                f"disk {side}[{layer}] of tokens {start}-{len(path)} is not its memory "
                f"copy ({a.dtype} against {b.dtype})")


def _compare(segment: KVSegment, fresh: list, start: int, path: tuple[int, ...],
             tier: str) -> None:
    end = len(path)
    for layer, (keys, values) in enumerate(fresh):
        for name, stored, expected in (("keys", segment.keys[layer], keys),
                                       ("values", segment.values[layer], values)):
            positions = stored.shape[-2]
            assert positions == end - start, (
                f"{tier} {name}[{layer}] of tokens {start}-{end} holds {positions} positions")
            want = expected[..., start:end, :]
            assert stored.dtype == want.dtype, (
                f"{tier} {name}[{layer}] of tokens {start}-{end} is {stored.dtype}, "
                f"the model computes {want.dtype}")
            worst = float(mx.abs(stored.astype(mx.float32) - want.astype(mx.float32)).max())
            assert worst < TOLERANCE[want.dtype], (
                f"{tier} {name}[{layer}] of tokens {start}-{end}: max |stored - fresh| = "
                f"{worst:.3g}")
