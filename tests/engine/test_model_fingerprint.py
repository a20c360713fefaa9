"""The disk tier's folder is named by every byte of the model's weights: a model that
differs from another only in the middle of a weights file (a fine-tune of a few layers)
never reads the other's KV, and a changed file is never taken for the one hashed before."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine import disk_store
from engine import weights_digest as digests
from engine.demo_model import demo_model_path, random_weights
from engine.disk_store import model_fingerprint
from engine.loader import load_model
from engine.weights_digest import MEMO_FILE, weights_digest
from tests.engine.support import Reference, complete, settled, start_engine

MIB = 1 << 20
PROMPT = list(range(100, 200))
TUNED_WEIGHT = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    """The tiny llama with an MLP wide enough that its weights file is several MiB, so
    that a change can be far from both ends of it."""
    tiny = demo_model_path("tiny")
    path = tmp_path_factory.mktemp("wide-base")
    for item in tiny.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, path / item.name)
    config = {**json.loads((tiny / "config.json").read_text()), "intermediate_size": 4096}
    (path / "config.json").write_text(json.dumps(config))
    save(path, {name: mx.array(value) for name, value in random_weights(config, 0).items()})
    return path


@pytest.fixture(scope="module")
def tuned_model(base_model, tmp_path_factory) -> Path:
    """A copy of the base model with one middle layer's MLP changed, as a fine-tune would."""
    path = tmp_path_factory.mktemp("wide-tuned")
    shutil.copytree(base_model, path, dirs_exist_ok=True)
    weights = dict(mx.load(str(base_model / "model.safetensors")))
    weights[TUNED_WEIGHT] = weights[TUNED_WEIGHT] * 1.5
    save(path, weights)
    return path


def save(path: Path, weights: dict[str, mx.array]) -> None:
    mx.save_safetensors(str(path / "model.safetensors"), dict(sorted(weights.items())),
                        metadata={"format": "mlx"})


def ends(path: Path) -> tuple[int, bytes, bytes]:
    data = path.read_bytes()
    return len(data), data[:MIB], data[-MIB:]


def test_the_tuned_copy_differs_only_where_a_sample_would_not_look(base_model, tuned_model):
    """The premise: same size, same first and last MiB, different bytes in between."""
    base, tuned = base_model / "model.safetensors", tuned_model / "model.safetensors"
    assert ends(base) == ends(tuned)
    assert base.read_bytes() != tuned.read_bytes()


async def test_a_fine_tune_gets_its_own_folder_and_none_of_the_base_models_kv(
        base_model, tuned_model, tmp_path):
    base = start_engine(str(base_model), disk_cache_dir=str(tmp_path),
                        disk_cache_bytes=64 * MIB)
    try:
        await complete(base, PROMPT, max_tokens=4)
        await settled(base)
        assert base.disk.flush(30)
        assert list(base.disk.directory.glob("*.safetensors"))
        base_folder = base.disk.directory
    finally:
        base.shutdown()
    tuned = start_engine(str(tuned_model), disk_cache_dir=str(tmp_path),
                         disk_cache_bytes=64 * MIB)
    try:
        assert tuned.disk.rebuilt.wait(30)
        assert tuned.disk.directory != base_folder
        assert tuned.stats().disk.restored_nodes == 0
        done = await complete(tuned, PROMPT, max_tokens=8)
        assert done.finish.cached_tokens == 0
        assert done.tokens == Reference(str(tuned_model)).greedy(PROMPT, 8)
    finally:
        tuned.shutdown()
    assert any(base_folder.glob("*.safetensors"))  # the base model's own KV is kept


async def test_a_folder_of_weights_changed_in_place_goes_once_no_process_holds_it(
        base_model, tuned_model, tmp_path):
    """New weights at the same path (or a new MLX) name a new folder; the old one would
    keep its disk space for good. It goes at a start of the same model directory, once
    no live server holds it; another model's folder stays, and so does a copy of this
    fingerprint's."""
    model = tmp_path / "model"
    shutil.copytree(base_model, model)
    other = start_engine(str(tuned_model), disk_cache_dir=str(tmp_path / "kv"),
                         disk_cache_bytes=64 * MIB)
    old = start_engine(str(model), disk_cache_dir=str(tmp_path / "kv"),
                       disk_cache_bytes=64 * MIB)
    await complete(old, PROMPT, max_tokens=2)
    assert old.disk.flush(30)
    other.shutdown()
    shutil.copy(tuned_model / "model.safetensors", model / "model.safetensors")
    held = old.disk.directory
    new = start_engine(str(model), disk_cache_dir=str(tmp_path / "kv"),
                       disk_cache_bytes=64 * MIB)
    assert new.disk.rebuilt.wait(30) and new.disk.directory != held
    assert held.exists()  # its server still runs
    old.shutdown()
    new.shutdown()
    aside = shutil.copytree(new.disk.directory, tmp_path / "kv" / "aside")  # same fingerprint
    again = start_engine(str(model), disk_cache_dir=str(tmp_path / "kv"),
                         disk_cache_bytes=64 * MIB)
    try:
        assert again.disk.rebuilt.wait(30) and again.disk.directory == new.disk.directory
        assert not held.exists()
        assert other.disk.directory.exists() and aside.exists()
    finally:
        again.shutdown()


async def test_weights_replaced_while_they_load_turn_the_disk_tier_off(
        base_model, tuned_model, tmp_path, monkeypatch, caplog):
    """An update that lands as a server starts (the new file renamed over the old one
    after the weights were read, before their fingerprint hashed the files): the server
    holds the old weights, and its KV, filed under the new weights' fingerprint, was read
    by the next server of the new weights as its own (a wrong answer, cached 8 of 9
    tokens). The tier is off instead, and the next start caches the new weights alone."""
    model = tmp_path / "model"
    shutil.copytree(base_model, model)

    def load_then_update(*args, **kwargs):
        loaded = load_model(*args, **kwargs)
        staged = model / "model.safetensors.new"
        shutil.copy(tuned_model / "model.safetensors", staged)
        os.replace(staged, model / "model.safetensors")
        return loaded

    monkeypatch.setattr("engine.engine.load_model", load_then_update)
    raced = start_engine(str(model), disk_cache_dir=str(tmp_path / "kv"),
                         disk_cache_bytes=64 * MIB)
    try:
        assert raced.disk is None
        assert "changed while it loaded" in caplog.text
        done = await complete(raced, PROMPT, max_tokens=4)
        assert done.tokens == Reference(str(base_model)).greedy(PROMPT, 4)
    finally:
        raced.shutdown()
    monkeypatch.undo()
    fresh = start_engine(str(model), disk_cache_dir=str(tmp_path / "kv"),
                         disk_cache_bytes=64 * MIB)
    try:
        assert fresh.disk.rebuilt.wait(30) and fresh.stats().disk.restored_nodes == 0
        done = await complete(fresh, PROMPT, max_tokens=8)
        assert done.tokens == Reference(str(tuned_model)).greedy(PROMPT, 8)
    finally:
        fresh.shutdown()


def test_a_weights_file_is_hashed_once_until_it_changes(tmp_path, monkeypatch):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(bytes(3 * MIB))
    hashed = []
    real = digests.file_digest
    monkeypatch.setattr(digests, "file_digest", lambda path: hashed.append(path) or real(path))
    first = weights_digest([weights], tmp_path)
    assert weights_digest([weights], tmp_path) == first
    assert hashed == [weights]
    # A write in the middle with the old mtime put back: the ctime still tells.
    stat = weights.stat()
    with open(weights, "r+b") as f:
        f.seek(MIB + 5)
        f.write(b"\1")
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights_digest([weights], tmp_path) != first
    assert len(hashed) == 2


def test_a_memo_that_is_not_one_costs_a_hash_not_a_wrong_digest(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"weights")
    honest = weights_digest([weights], tmp_path)
    memo = tmp_path / MEMO_FILE
    for content in ("{not json", "[1, 2]", json.dumps({str(weights.resolve()): "digest"}),
                    json.dumps({str(weights.resolve()): [[0, 0, 7, 0, 0], "0" * 64]})):
        memo.write_text(content)
        assert weights_digest([weights], tmp_path) == honest


def test_the_memo_forgets_files_that_are_gone(tmp_path):
    kept, gone = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    kept.write_bytes(b"a")
    gone.write_bytes(b"b")
    weights_digest([kept, gone], tmp_path)
    gone.unlink()
    kept.write_bytes(b"aa")
    weights_digest([kept], tmp_path)
    assert list(json.loads((tmp_path / MEMO_FILE).read_text())) == [str(kept.resolve())]


def test_a_vision_models_fingerprint_names_its_mlx_vlm(base_model, tmp_path):
    """An image's features come from mlx-vlm's code: KV on disk that another version
    computed is not reused. A text model's fingerprint is as it was."""
    loaded = load_model(base_model)
    cache = make_prompt_cache(loaded.model)

    def fingerprint(vision_code):
        return model_fingerprint(base_model, loaded.model, cache, tmp_path, vision_code)

    assert len({fingerprint(None), fingerprint("0.7.10"), fingerprint("0.7.11")}) == 3
    assert fingerprint(None) == fingerprint(None)


def test_the_fingerprint_names_the_engines_own_forward_code(base_model, tmp_path, monkeypatch):
    """The engine computes some of a forward pass itself (attention and SwiGLU off Metal):
    KV that another version of that code computed is not reused, as for MLX's own."""
    loaded = load_model(base_model)
    cache = make_prompt_cache(loaded.model)
    before = model_fingerprint(base_model, loaded.model, cache, tmp_path)
    monkeypatch.setattr(disk_store, "FORWARD_CODE", (*disk_store.FORWARD_CODE, "engine.text"))
    assert model_fingerprint(base_model, loaded.model, cache, tmp_path) != before


def test_the_fingerprint_names_where_the_forward_runs(base_model, tmp_path, monkeypatch):
    """Another BLAS, its other kernels, another device or TF32 compute other last bits: a
    cache folder moved to another machine is not read as this one's KV."""
    loaded = load_model(base_model)
    cache = make_prompt_cache(loaded.model)
    before = model_fingerprint(base_model, loaded.model, cache, tmp_path)
    monkeypatch.setattr(disk_store, "numeric_environment", lambda: "('cpu', 'Haswell')")
    assert model_fingerprint(base_model, loaded.model, cache, tmp_path) != before
