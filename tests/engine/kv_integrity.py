"""The cache trust check: every KV a tree holds, in memory or in a disk file, against a
fresh forward of the node's own token path.

A node stands for the positions [start, end) of its path; its memory handle and its disk
copy must both hold exactly those positions' keys and values, as a forward of the path
from scratch computes them (within float tolerance: the engine computes in chunks and
batches). A whole-state snapshot is checked by the answer it gives instead (its layout
depends on how the state was reached): the logits of one more token after it, against a
forward of its path and that token from scratch.

A quantized segment (`--kv-bits`, engine/kv_quant.py) is checked against a forward that
computes as a quantized engine does, every token attending over the KV its path keeps
(`_AsKept`), its own new KV rounded by the engine's own `round`; each node of a path is
checked so against the nodes above it, down to the root. Not a forward from scratch:
rounding turns the float noise of forwards of other shapes into whole grid steps where a
value lies near a step's edge, each step moves every later layer's KV a little, which
rounds into more steps (on SmolLM2 at 8 bits, up to 6% of a correct node's values came
out a step or two off). Over the kept KV what remains is rounding noise: a value a step
off, or a group's whole grid moved (mlx's scale depends on how the group's largest value
rounds); and where a node was computed over another computation of its prefix than the
one kept (a request that computed it beside another, or before a restart's rebuild put
the old files below it), that prefix's own steps moved through the later layers. So, in
grid steps (the group's scale in the segment):
- the first layer's keys and values, which depend on the token and its position alone,
  may be at most `MAX_STEPS` off: KV of other tokens, or shifted by two positions
  (shared/evidence/disk-tier-wrong-kv), are 8 to 2,400 off;
- at most `MAX_FAR` of all the segment's values may be more than `FAR_STEPS` off: the
  same tokens after another prefix put 2.2% (SmolLM2, 4 bits) to 48% there.
Measured (the tiny demo llama with 64-wide heads under mixed traffic, clears and
restarts; SmolLM2-135M's soak folders, 67 and 84 files; at 8 and 4 bits): the first
layer at most 1.04 off, no value more than 2.0. 40 tokens of SmolLM2 checked over another
computation of the 600 before them: up to 10% of their values more than half a step off,
0.1% more than 2.5 (bench/results/cpu-intel-r-xeon-r-processor-2c/kv-integrity-rounding).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx_lm.models.cache import make_prompt_cache

from engine import segment_file
from engine.disk_store import DiskCopy, read_copy
from engine.engine import Engine
from engine.kv import CacheSnapshot, KVSegment, assemble
from engine.kv_quant import KVQuantization
from engine.mlx_lm_internals import RoundedWrites, clone_cache, kv_layout
from engine.platform_info import apply_mlx_env_defaults
from engine.scheduler import Cancel
from tests.engine.support import idle

# Float32 demo models: a correct node differs from a fresh forward by ~1e-5, a node
# holding other positions' KV by ~1 (shared/evidence: 1.4-18.7). In bfloat16 a chunked
# forward and a whole one round apart by up to a few of its steps (~1e-2 here).
TOLERANCE = {mx.float32: 1e-3, mx.float16: 2e-2, mx.bfloat16: 0.1}
# A quantized segment's values against a forward as a quantized engine computes it (see
# the module's docstring): how many grid steps a value of the first layer may be off,
# and the share of all its values that may be more than FAR_STEPS off.
MAX_STEPS = 2.0
FAR_STEPS = 2.5
MAX_FAR = 0.005


@dataclass
class Checked:
    memory: int = 0  # nodes whose memory handle was compared
    disk: int = 0  # nodes whose disk file was compared
    snapshots: int = 0  # nodes whose whole-state snapshot was compared


@dataclass
class FolderChecked:
    segments: int = 0  # KV segment files compared
    snapshots: int = 0  # whole-state snapshot files compared
    orphans: int = 0  # files no chain of parents leads to: a rebuild deletes them unread
    problems: list[str] = field(default_factory=list)  # a line per wrong file


def check_tree_kv(engine: Engine, model: nn.Module) -> Checked:
    """Assert that every span the engine's tree holds is the KV of its tokens. Call it
    while the engine is idle; its worker is held meanwhile (`worker_held`)."""
    # A request's stream ends before its KV goes to the tree (and its disk copy is
    # queued): a check straight after its Finish found a copy queued after the flush.
    deadline = time.monotonic() + 30
    while not idle(engine.stats()):
        assert time.monotonic() < deadline, "the engine never went idle"
        time.sleep(0.01)
    if engine.disk is not None:
        assert engine.disk.flush(30), "disk writes still queued"
    with worker_held(engine):
        return _check_tree(engine, model)


@contextmanager
def worker_held(engine: Engine) -> Iterator[None]:
    """The engine's worker held between two turns of its loop, where it has settled what
    the last turn made and touches no MLX array, while this thread evaluates the tree's
    handles. Its stats read idle before it settles a cancelled prefill's chunks (lazy
    slices of that prefill's cache): a check in between evaluated the same graph from
    two threads, and MLX crashed now and then (SIGSEGV in a forward here)."""
    scheduler = engine._scheduler
    arrived, release = threading.Event(), threading.Event()
    take_inbox = scheduler._take_inbox

    def held(block: bool) -> list:
        arrived.set()
        release.wait()
        return take_inbox(block)

    scheduler._take_inbox = held
    try:
        # An idle worker waits on its inbox for up to half a second: a cancel of no
        # request wakes it, and it comes round at once.
        scheduler.post(Cancel("no-such-request"))
        assert arrived.wait(30), "the engine's worker never came round"
        mx.synchronize()  # its last step's work, queued on MLX's stream
        yield
    finally:
        del scheduler._take_inbox
        release.set()


def _check_tree(engine: Engine, model: nn.Module) -> Checked:
    scheduler = engine._scheduler
    with scheduler.tree._mutex:
        held = {node: (node.tokens, node.path_tokens_locked(), node.handle, node.stored)
                for node in tree_nodes(scheduler.tree.root)}
    quantization = scheduler.kv.quantization
    copies: dict = {}

    def copy_of(node) -> KVSegment:
        """The node's disk copy, read once."""
        if node not in copies:
            edge, path, _, stored = held[node]
            copies[node] = _read(stored, edge, len(path) - len(edge), quantization)
        return copies[node]

    def kept(node) -> list[KVSegment]:
        """The segments the tree keeps for `node`'s path, memory before disk."""
        segments = []
        while node in held:
            _, path, handle, stored = held[node]
            assert isinstance(handle, KVSegment) or isinstance(stored, DiskCopy), (
                f"the node ending at token {len(path)} of a quantized path keeps no KV")
            segments.append(handle if isinstance(handle, KVSegment) else copy_of(node))
            node = node.parent
        return segments[::-1]

    checked = Checked()
    forwards: dict[tuple[int, ...], list] = {}
    for node, (edge, path, handle, stored) in sorted(held.items(), key=lambda h: -len(h[1][1])):
        if isinstance(handle, CacheSnapshot):
            _compare_answers(model, handle, path)
            checked.snapshots += 1
            continue
        if not isinstance(handle, KVSegment) and not (stored and stored.splittable):
            continue  # junctions
        fresh = _fresh(model, path, forwards, quantization and (quantization, kept(node)))
        start = len(path) - len(edge)
        if isinstance(handle, KVSegment):
            _compare(handle, fresh, start, path, "memory")
            checked.memory += 1
        if isinstance(stored, DiskCopy) and stored.splittable:
            copy = copy_of(node)
            _compare(copy, fresh, start, path, "disk")
            if isinstance(handle, KVSegment):
                _same_bits(copy, handle, start, path)
            checked.disk += 1
    return checked


def check_folder_kv(folder: Path, model: nn.Module) -> list[str]:
    """The same check for the files of a disk tier's model folder alone, each against a
    forward of its token path (its chain of parents): what a restart would load. Returns
    one line per file that is wrong (`check_folder` says what it checked as well)."""
    return check_folder(folder, model).problems


def check_folder(folder: Path, model: nn.Module) -> FolderChecked:
    """`check_folder_kv`, with the count of files checked. Its forwards compute as the
    engine's do: a process with no engine of its own (the soak's, after its servers)
    would otherwise multiply in MLX's defaults, TF32 on a GPU, ~1e-3 from the engine's
    float32."""
    apply_mlx_env_defaults()
    headers = {}
    for path in folder.glob(f"*{segment_file.SUFFIX}"):
        header, _, _ = segment_file.read_header(path)
        headers[header.key] = (path, header)
    checked, chains = FolderChecked(), []
    for path, header in headers.values():
        chain, parent = [(path, header)], header.parent
        while parent in headers:
            chain.append(headers[parent])
            parent = chain[-1][1].parent
        if parent != header.fingerprint:
            checked.orphans += 1
            continue
        chains.append(chain[::-1])
    read = _file_reader(model)
    forwards: dict[tuple[int, ...], list] = {}
    # Longest paths first: a prefix's forward is then a slice of one already made.
    for chain in sorted(chains, key=len, reverse=True):
        path, header = chain[-1]
        tokens = tuple(t for _, part in chain for t in part.tokens)
        try:
            handle = read(path, header)
            if isinstance(handle, CacheSnapshot):
                _compare_answers(model, handle, tokens)
                checked.snapshots += 1
                continue
            kept = handle.quantization and (handle.quantization,
                                            [read(*link) for link in chain])
            _compare(handle, _fresh(model, tokens, forwards, kept), header.start, tokens,
                     "disk")
            checked.segments += 1
        except AssertionError as error:
            checked.problems.append(f"{path.name}: {error}")
    return checked


def tree_nodes(root) -> list:
    """Every node under `root`, depth first."""
    found, stack = [], list(root.children.values())
    while stack:
        node = stack.pop()
        found.append(node)
        stack.extend(node.children.values())
    return found


def _fresh(model: nn.Module, path: tuple[int, ...], forwards: dict,
           kept: tuple[KVQuantization, list[KVSegment]] | None = None) -> list:
    """Per layer (keys, values) of a forward of `path` from scratch, or with `kept` (a
    quantized tree's segments of the path) as a quantized engine computes it, reusing a
    longer path's forward when `path` is its prefix (causal: later tokens change
    nothing; and a prefix's segments are the longer path's first)."""
    for longer, layers in forwards.items():
        if longer[:len(path)] == path:
            return layers
    if kept is None:
        cache = make_prompt_cache(model)
        model(mx.array([path]), cache=cache)
        layers = [(c.keys[..., :len(path), :], c.values[..., :len(path), :]) for c in cache]
    else:
        quantization, segments = kept
        cache = [_AsKept(layer, held, quantization.round) for layer, held
                 in zip(make_prompt_cache(model), assemble(segments, model), strict=True)]
        model(mx.array([path]), cache=cache)
        layers = [layer.computed for layer in cache]
    mx.eval(layers)
    forwards[path] = layers
    return layers


class _AsKept(RoundedWrites):
    """A cache layer whose forward attends over the KV a quantized tree keeps for its path
    (`held`, the engine's own `assemble` of the path's segments) and records the keys and
    values it computed instead, rounded as the engine rounds them (`computed`)."""

    def __init__(self, layer, held, round: Callable[[mx.array], mx.array]) -> None:
        super().__init__(layer, round)
        self._held, self.computed = held, None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        start, end = self.offset, self.offset + keys.shape[-2]
        self.computed = (self._round(keys), self._round(values))
        return self._layer.update_and_fetch(self._held.keys[..., start:end, :],
                                            self._held.values[..., start:end, :])


def _compare_answers(model: nn.Module, snapshot: CacheSnapshot, path: tuple[int, ...],
                     probe: int = 1) -> None:
    """The logits of `probe` after the snapshot's state, against those after `path`."""
    after = model(mx.array([[probe]]), cache=clone_cache(snapshot.cache))[0, -1]
    fresh = model(mx.array([[*path, probe]]), cache=make_prompt_cache(model))[0, -1]
    error = mx.abs(after.astype(mx.float32) - fresh.astype(mx.float32)).max().item()
    assert error <= TOLERANCE[after.dtype], (
        f"the snapshot at {len(path)} tokens answers as another state (max diff {error:.3g})")


def _read(stored: DiskCopy, edge: tuple[int, ...], start: int,
          quantization: KVQuantization | None) -> KVSegment:
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
    _, segment = read_copy(stored.path, quantization)
    assert isinstance(segment, KVSegment)
    return segment.split(skip)[1] if skip else segment


def _file_reader(model: nn.Module) -> Callable[[Path, segment_file.SegmentHeader],
                                               KVSegment | CacheSnapshot]:
    """Reads a file as a server of its header's quantization loads it, each file once."""
    handles: dict[Path, KVSegment | CacheSnapshot] = {}
    dtype = functools.cache(lambda: kv_layout(model)[0])

    def read(path: Path, header: segment_file.SegmentHeader) -> KVSegment | CacheSnapshot:
        if path not in handles:
            quantization = header.kv_bits and KVQuantization(
                header.kv_bits, header.kv_group_size, dtype())
            handles[path] = read_copy(path, quantization or None)[1]
        return handles[path]

    return read


def _kept_arrays(segment: KVSegment) -> list[tuple[str, Sequence[mx.array]]]:
    """What a segment keeps, by name: keys and values, or their quantized triples."""
    if segment.quantization is None:
        return [("keys", segment.keys), ("values", segment.values)]
    return [(f"{side} {part}", arrays)
            for side, triple in zip(("keys", "values"), segment.stored, strict=True)
            for part, arrays in zip(("packed", "scales", "biases"), triple, strict=True)]


def _same_bits(copy: KVSegment, handle: KVSegment, start: int, path: tuple[int, ...]) -> None:
    """A disk copy is its memory handle's arrays written out: it must come back bit for
    bit, in the same dtype."""
    for (side, copied), (_, held) in zip(_kept_arrays(copy), _kept_arrays(handle),
                                         strict=True):
        for layer, (a, b) in enumerate(zip(copied, held, strict=True)):
            assert a.dtype == b.dtype and mx.array_equal(a, b).item(), (
                f"disk {side}[{layer}] of tokens {start}-{len(path)} is not its memory "
                f"copy ({a.dtype} against {b.dtype})")


def _compare(segment: KVSegment, fresh: list, start: int, path: tuple[int, ...],
             tier: str) -> None:
    end = len(path)
    far = values = 0
    for side, (name, stored_layers) in enumerate(
            (("keys", segment.keys), ("values", segment.values))):
        for layer, computed in enumerate(fresh):
            stored, want = stored_layers[layer], computed[side][..., start:end, :]
            where = f"{tier} {name}[{layer}] of tokens {start}-{end}"
            positions = stored.shape[-2]
            assert positions == end - start, f"{where} holds {positions} positions"
            assert stored.dtype == want.dtype, (
                f"{where} is {stored.dtype}, the model computes {want.dtype}")
            off = mx.abs(stored.astype(mx.float32) - want.astype(mx.float32))
            if segment.quantization is None:
                worst = float(off.max())
                assert worst < TOLERANCE[want.dtype], (
                    f"{where}: max |stored - fresh| = {worst:.3g}")
                continue
            steps = off / _step(segment, side, layer, stored)
            worst = float(steps.max())
            assert layer > 0 or worst <= MAX_STEPS, (
                f"{where}: a value {worst:.3g} grid steps from a forward of its tokens "
                f"(max |stored - fresh| = {float(off.max()):.3g})")
            far += int((steps > FAR_STEPS).sum())
            values += steps.size
    if segment.quantization is not None:
        assert far <= MAX_FAR * values, (
            f"{tier} tokens {start}-{end}: {far} of {values} values more than {FAR_STEPS:g} "
            f"grid steps from a forward over the path's kept KV (at most {MAX_FAR:.1%})")


def _step(segment: KVSegment, side: int, layer: int, stored: mx.array) -> mx.array:
    """The grid step of each of a quantized segment's values: its group's scale (float32;
    mlx makes it negative where the group's largest magnitude is its maximum), or where
    the model's dtype is coarser there, that dtype's step."""
    quantization = segment.quantization
    scales = mx.abs(segment.stored[side][1][layer])
    step = mx.repeat(scales, quantization.group_size, axis=-1)
    return mx.maximum(step, mx.abs(stored.astype(mx.float32)) * mx.finfo(stored.dtype).eps)
