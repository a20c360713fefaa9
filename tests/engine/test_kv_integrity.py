"""No cache changes an answer: whatever the tree holds, in memory or on disk, is the KV of
its own tokens, through splits, evictions, demotions, promotions, clears and restarts
with traffic during the rebuild; and greedy answers equal mlx-lm's with no cache at all."""

from __future__ import annotations

import asyncio
import collections
import json
import math
import random
import shutil
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine import segment_file
from engine.demo_model import demo_model_path
from engine.engine import Engine
from engine.kv_quant import KVQuantization, cached_bytes_per_token
from tests.engine import kv_integrity
from tests.engine.kv_integrity import check_folder, check_folder_kv, check_tree_kv, tree_nodes
from tests.engine.support import Reference, complete, settled, start_engine
from tests.faults import failing_first

BYTES_PER_TOKEN = 512  # the tiny llama: 2 layers x (K, V) x 2 heads x 16 dims x 4 bytes


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(demo_model_path("tiny"))


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def bfloat16_model_dir(model_dir, tmp_path_factory) -> str:
    """The tiny demo model with its weights in bfloat16, the dtype most MLX models ship in."""
    path = tmp_path_factory.mktemp("tiny-bfloat16")
    for item in Path(model_dir).iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, path / item.name)
    for item in Path(model_dir).glob("*.safetensors"):
        weights = {name: array.astype(mx.bfloat16) if mx.issubdtype(array.dtype, mx.floating)
                   else array for name, array in mx.load(str(item)).items()}
        mx.save_safetensors(str(path / item.name), weights, metadata={"format": "mlx"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    return str(path)


def start(model_dir: str, directory, memory_tokens: int, disk_tokens: int,
          warm_up: bool | None = None) -> Engine:
    return start_engine(model_dir, cache_bytes=memory_tokens * BYTES_PER_TOKEN,
                        disk_cache_dir=str(directory),
                        disk_cache_bytes=disk_tokens * BYTES_PER_TOKEN, warm_up=warm_up)


async def answer(engine: Engine, reference: Reference, prompt: list[int],
                 max_tokens: int = 4) -> int:
    """Greedy answer of `prompt` through `engine`, asserted equal to mlx-lm's without a
    cache; returns the prompt tokens the engine reused."""
    done = await complete(engine, prompt, max_tokens=max_tokens)
    assert done.tokens == reference.greedy(prompt, max_tokens), (
        f"cached {done.finish.cached_tokens} of {len(prompt)}")
    return done.finish.cached_tokens


async def test_a_file_restored_while_traffic_cut_its_path_keeps_its_answer(
        model_dir, reference, tmp_path):
    """The disk tier's wrong-KV bug, on real KV: a server rebuilds its tree from disk
    while it serves, and a request has already cut off the prompt's first two tokens
    (`<|im_start|>system` in the evidence) as a node of its own."""
    head, system, question = [1, 2], list(range(100, 160)), [300, 301, 302]
    old = start(model_dir, tmp_path / "old", 4096, 4096)
    await answer(old, reference, head + system + question)
    old.shutdown()
    new = start(model_dir, tmp_path / "new", 4096, 4096)
    try:
        await answer(new, reference, head + [7, 8, 9])
        await answer(new, reference, head + [10, 11, 12])  # `1, 2` is a node now
        rebuild_from(new, old.disk.directory)
        check_tree_kv(new, reference.model)
        await answer(new, reference, head + system + question[:2] + [400])
        check_tree_kv(new, reference.model)
    finally:
        new.shutdown()


async def test_files_below_a_split_node_come_back_after_a_restart(model_dir, reference,
                                                                   tmp_path):
    """A system prompt and an answer written to disk, a later turn below them, then a
    prompt that parts from the system prompt midway and splits its node: after a restart
    every file is restored (the later turn's file still names its parent, whose key the
    split kept), each holds its path's KV, and the later turn's prompt is a disk hit."""
    system, question = list(range(100, 180)), [300, 301, 302]
    turn = system + question
    old = start(model_dir, tmp_path, 4096, 4096)
    try:
        await answer(old, reference, turn)
        await answer(old, reference, turn + [500, 501, 502])  # a node below the first
        await answer(old, reference, system[:40] + [600, 601])  # splits the first
        await settled(old)
        assert old.disk.flush(30)
        files = len(list(old.disk.directory.glob("*.safetensors")))
    finally:
        old.shutdown()
    new = start(model_dir, tmp_path, 4096, 4096)
    try:
        assert new.disk.rebuilt.wait(30)
        stats = new.stats().disk
        assert stats.restored_nodes == files and stats.bad_files == 0
        assert check_folder_kv(new.disk.directory, reference.model) == []
        cached = await answer(new, reference, turn + [500, 501, 502, 503])
        assert cached >= len(turn) + 3
    finally:
        new.shutdown()


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_random_traffic_keeps_every_cached_kv_equal_to_a_fresh_forward(
        model_dir, reference, tmp_path, seed):
    """Prompts behind a few shared heads (sharing 2 tokens, a system prompt, earlier
    turns), some at once; a memory budget of ~2 prompts and a disk budget of ~8, so
    nodes split, demote, promote and leave both tiers; clears; restarts whose rebuild
    races the next requests. After every step every node's KV, in memory and on disk,
    is that of its tokens, and every greedy answer is mlx-lm's."""
    rng = random.Random(seed)
    heads = [[1, 2] + [rng.randrange(50, 900) for _ in range(rng.randrange(8, 60))]
             for _ in range(3)]
    conversations: list[list[int]] = []
    engine = start(model_dir, tmp_path, 150, 600)
    checked = reused = 0
    tiers: collections.Counter[str] = collections.Counter()
    aside = None
    try:
        for step in range(16):
            restarted = False
            # The first restart comes after one conversation, when no file yet starts
            # after the 2 tokens the heads share.
            roll = 0.2 if step == 1 else rng.random()
            if roll < 0.1:
                await asyncio.wrap_future(engine.clear_cache())
            elif roll < 0.25:
                # A restart whose rebuild comes before this step's requests (memory is
                # refilled with what it held at the stop), or after them: the worst
                # order a rebuild that runs beside the engine can take.
                tiers.update(_tier_moves(engine))
                engine.shutdown()
                folder = engine.disk.directory
                aside = folder.rename(tmp_path / f"aside-{rng.random()}")
                engine = start(model_dir, tmp_path, 150, 600)
                restarted = True
                if rng.random() < 0.5:
                    rebuild_from(engine, aside)
                    aside = None
            prompts = []
            # After a restart, one prompt behind each head: they cut the path at the
            # 2 tokens all heads share, as `<|im_start|>system` is in real traffic.
            count = rng.choice([1, 1, 2, 3]) if step else 1
            for head in heads if restarted else [None] * count:
                if head is None and conversations and rng.random() < 0.4:
                    base = rng.choice(conversations)  # a later turn of a conversation
                else:
                    base = (head or rng.choice(heads))[:rng.randrange(2, 70)]
                prompt = base + [rng.randrange(50, 900) for _ in range(rng.randrange(1, 30))]
                conversations.append(prompt)
                prompts.append(prompt)
            cached = await asyncio.gather(*(answer(engine, reference, p) for p in prompts))
            reused += sum(cached)
            await settled(engine)
            if aside is not None:
                rebuild_from(engine, aside)
                aside = None
            counted = check_tree_kv(engine, reference.model)
            checked += counted.memory + counted.disk
        tiers.update(_tier_moves(engine))
    finally:
        engine.shutdown()
    # The walk exercised what it is for: reuse, and data moving between the tiers.
    assert reused > 0 and checked > 0
    assert tiers["demoted"] and tiers["written"] and tiers["brought back"], tiers


def rebuild_from(engine: Engine, folder: Path) -> None:
    """Put the files of `folder` (a disk tier of the same model) in the engine's disk
    folder and rebuild its tree from them, beside the engine, as a start does: what the
    old engine held in memory at its stop comes back into memory."""
    # The engine's own start rebuilds from its (empty) folder first: a file copied in
    # meanwhile would be read half written, and deleted as torn.
    assert engine.disk.rebuilt.wait(30)
    for file in folder.iterdir():
        if not (engine.disk.directory / file.name).exists():
            shutil.copy(file, engine.disk.directory / file.name)
    scheduler = engine._scheduler
    rebuild = threading.Thread(target=engine.disk.rebuild,
                               args=(scheduler.tree, scheduler.bring_back, scheduler.restore))
    rebuild.start()
    rebuild.join()


def _tier_moves(engine: Engine) -> dict[str, int]:
    stats = engine.stats()
    return {"demoted": stats.tree.disk_demotions, "promoted": stats.tree.disk_hits,
            "restored": stats.disk.restored_nodes, "written": stats.disk.writes,
            "brought back": stats.disk.brought_back_nodes}


async def test_a_bfloat16_models_kv_comes_back_from_disk_as_it_was_written(
        bfloat16_model_dir, tmp_path):
    """A bfloat16 model's disk copies once came back as the integers of their bits (the
    file named them U16), and a restart answered from garbage. Every copy must come back
    in the model's dtype, bit for bit, and answer as the cold request did."""
    reference = Reference(bfloat16_model_dir)
    prompt = [1, 2] + list(range(100, 170))
    old = start(bfloat16_model_dir, tmp_path, 4096, 4096)
    try:
        cold = await complete(old, prompt, max_tokens=8)
        assert check_tree_kv(old, reference.model).disk > 0
    finally:
        old.shutdown()
    new = start(bfloat16_model_dir, tmp_path, 4096, 4096)
    try:
        assert new.disk.rebuilt.wait(30)
        hit = await complete(new, prompt, max_tokens=8)
        assert hit.finish.cached_tokens >= len(prompt) - 1
        assert hit.tokens == cold.tokens
        assert check_tree_kv(new, reference.model).disk > 0
    finally:
        new.shutdown()


async def test_a_miss_is_explained_and_warm_up_leaves_nothing_to_explain(
        model_dir, reference, tmp_path):
    """The warm-up's prompts start with the token ids chat templates start with; what it
    cached and cleared before the engine was ready is no request's cache."""
    engine = start(model_dir, tmp_path, 4096, 4096, warm_up=True)
    try:
        first = await complete(engine, [1, 2, 3, 4, 5], max_tokens=1)
        assert (first.finish.cache_miss.reason, first.finish.cache_miss.position) == (
            "not_seen", 0)
        again = await complete(engine, [1, 2, 3, 9, 9], max_tokens=1)
        miss = again.finish.cache_miss
        assert (miss.reason, miss.position, miss.cached) == (
            "diverged", 3, reference.tokenizer.decode([4]))
    finally:
        engine.shutdown()


async def test_a_prompt_cached_in_memory_only_before_a_restart_missed_as_reloaded(
        model_dir, reference, tmp_path):
    """A disk budget too small for any copy: everything is memory only, and the next
    process says so instead of "not seen"."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    engine = start(model_dir, tmp_path, 4096, 1)
    await complete(engine, prompt, max_tokens=1)
    engine.shutdown()
    engine = start(model_dir, tmp_path, 4096, 1)
    try:
        assert engine.disk.rebuilt.wait(30)
        miss = (await complete(engine, prompt, max_tokens=1)).finish.cache_miss
        assert (miss.reason, miss.position) == ("model_reloaded", 0)
    finally:
        engine.shutdown()


async def test_a_disk_load_that_raises_is_computed_instead(model_dir, reference, tmp_path):
    """A prefix on disk whose load raises (the disk went away, not a bad file): the
    request that matched it computes those tokens instead and answers as mlx-lm does,
    the disk's nodes leave the tree, and nothing stays pinned."""
    prompt = [1, 2, *range(100, 160), 300]
    # Memory for 16 tokens: the prompt's prefix lives on disk only.
    old = start(model_dir, tmp_path, 16, 4096)
    await answer(old, reference, prompt)
    assert old.disk.flush(30)
    old.shutdown()
    new = start(model_dir, tmp_path, 16, 4096)
    try:
        assert new.disk.rebuilt.wait(30)
        failures: list[Exception] = [OSError("the disk went away")]
        new.disk.load = failing_first(new.disk.load, failures)
        assert await answer(new, reference, prompt) == 0
        assert not failures
        stats = await settled(new)
        assert stats.tree.pinned_bytes == 0 and stats.disk.loads == 0
        assert await answer(new, reference, prompt) > 0  # computed, cached again
    finally:
        new.shutdown()


# -- a quantized server (`--kv-bits`) ---------------------------------------------------------


def start_quantized(model_dir: Path, directory, bits: int, memory_tokens: int,
                    disk_tokens: int) -> Engine:
    """A `--kv-bits` engine on the tiny llama with 64-wide heads, budgets in its tokens."""
    per_token = cached_bytes_per_token(2 * BYTES_PER_TOKEN,  # its float32 KV, heads 64 wide
                                       KVQuantization(bits, 64, mx.float32))
    return start_engine(str(model_dir), kv_bits=bits, cache_bytes=memory_tokens * per_token,
                        disk_cache_dir=str(directory),
                        disk_cache_bytes=disk_tokens * per_token)


@pytest.mark.parametrize("bits", [8, 4])
async def test_a_quantized_tree_and_its_files_hold_the_kv_of_their_tokens(
        head64_model_dir, tmp_path, bits):
    """Mixed traffic behind shared heads (2 tokens, a system prompt, earlier turns), some
    at once, a memory budget of ~2 prompts and a disk budget of ~6, a clear while
    requests run, and a restart whose rebuild races the next requests: after every step
    every node's quantized KV, in memory and on disk, and every file of the folder, is
    that of its tokens as a quantized engine computes it (kv_integrity's docstring)."""
    model = Reference(str(head64_model_dir)).model
    rng = random.Random(bits)
    heads = [[1, 2] + [rng.randrange(50, 900) for _ in range(rng.randrange(20, 60))]
             for _ in range(3)]
    conversations: list[list[int]] = []
    engine = start_quantized(head64_model_dir, tmp_path, bits, 150, 400)
    tiers: collections.Counter[str] = collections.Counter()
    checked = 0
    try:
        for step in range(8):
            if step == 5:
                tiers.update(_tier_moves(engine))
                engine.shutdown()
                engine = start_quantized(head64_model_dir, tmp_path, bits, 150, 400)
            prompts = []
            for _ in range(rng.choice([2, 3])):
                if conversations and rng.random() < 0.4:
                    base = rng.choice(conversations)
                else:
                    base = rng.choice(heads)[:rng.randrange(2, 60)]
                prompts.append(base + [rng.randrange(50, 900) for _ in range(rng.randrange(1, 30))])
            conversations += prompts
            runs = [complete(engine, prompt, max_tokens=4) for prompt in prompts]
            if step == 3:
                runs.append(asyncio.wrap_future(engine.clear_cache()))
            await asyncio.gather(*runs)
            await settled(engine)
            assert engine.disk.rebuilt.wait(30)
            counted = check_tree_kv(engine, model)
            checked += counted.memory + counted.disk
        tiers.update(_tier_moves(engine))
        assert engine.disk.flush(30)
        folder = check_folder(engine.disk.directory, model)
    finally:
        engine.shutdown()
    assert folder.problems == [] and folder.segments > 0
    assert checked > 0
    assert tiers["demoted"] and tiers["promoted"] and tiers["restored"], tiers


@pytest.mark.parametrize("bits", [8, 4])
async def test_quantized_kv_of_another_path_fails_the_check(head64_model_dir, tmp_path, bits,
                                                             monkeypatch):
    """The check is not blind to a quantized span holding another path's KV: the spans
    of equally long token runs T and U after a head A, and of T after another head B,
    swapped in memory and in their files (each file's header kept, as the evidence's
    wrong files were whole and well formed): other tokens at the same positions, and
    the same tokens after another prefix, each fail."""
    rng = random.Random(bits)
    a, b, t, u = ([rng.randrange(50, 900) for _ in range(24)] for _ in range(4))
    engine = start_quantized(head64_model_dir, tmp_path, bits, 4096, 4096)
    model = Reference(str(head64_model_dir)).model
    try:
        for prompt in ([1, 2, *a, *t], [1, 2, *a, *u], [1, 2, *b, 7], [1, 2, *b, *t]):
            await complete(engine, prompt, max_tokens=1)
        await settled(engine)
        assert check_tree_kv(engine, model).disk > 0
        nodes = {tuple(node.path_tokens_locked()): node
                 for node in tree_nodes(engine._scheduler.tree.root)}
        # A prompt's last token is computed by its first decode step, and cached with it.
        at, au, bt = (nodes[(1, 2, *head, *tail[:-1])]
                      for head, tail in ((a, t), (a, u), (b, t)))
        assert len(at.tokens) == len(au.tokens) == len(bt.tokens) == len(t) - 1
        for node, other in ((at, au), (at, bt)):
            node.handle, other.handle = other.handle, node.handle
            with pytest.raises(AssertionError, match="memory"):
                check_tree_kv(engine, model)
            node.handle, other.handle = other.handle, node.handle
        files = {node: node.stored.path for node in (at, au, bt)}
    finally:
        engine.shutdown()
    folder = files[at].parent
    assert check_folder_kv(folder, model) == []
    # Other tokens fail by how far their first layer is off and by how many values are
    # far off, each alone; the same tokens after another prefix by how many are far off.
    for other, rules in ((au, ("MAX_STEPS", "MAX_FAR")), (bt, ("MAX_FAR",))):
        swap_kv(files[at], files[other])
        for rule in (None, *rules):
            for name in {"MAX_STEPS", "MAX_FAR"} - {rule} if rule else ():
                monkeypatch.setattr(kv_integrity, name, math.inf)  # only `rule` speaks
            wrong = check_folder_kv(folder, model)
            assert sorted(line.split(":")[0] for line in wrong) == sorted(
                (files[at].name, files[other].name)), rule
            monkeypatch.undo()
        swap_kv(files[at], files[other])


def swap_kv(first: Path, second: Path) -> None:
    """Give each of two files of equally long spans the other's tensors, keeping its own
    header (its checksums written anew)."""
    tensors = {path: mx.load(str(path)) for path in (first, second)}
    for path, other in ((first, second), (second, first)):
        header, _, _ = segment_file.read_header(path)
        segment_file.write(path, header, [
            segment_file.Tensor(name, {mx.float32: "F32", mx.uint32: "U32"}[array.dtype],
                                np.array(array)) for name, array in tensors[other].items()])
