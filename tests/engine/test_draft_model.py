"""Speculative decoding with a draft model: greedy output stays the served model's own,
under batching, whether the draft model guesses well (the served model itself) or badly
(other weights of the same tokenizer); a draft model that cannot draft for the served
model stops it loading with a clear error."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from engine.api import EngineConfig, SpeculationConfig
from engine.demo_model import build_demo_model
from engine.draft_model import DraftModel, DraftModelError
from engine.engine import Engine
from engine.loader import load_model
from tests.engine.kv_integrity import check_tree_kv
from tests.engine.support import Reference, complete, start_engine


@pytest.fixture(scope="module")
def reference(demo_model_dir) -> Reference:
    return Reference(str(demo_model_dir))


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory) -> str:
    """The demo model's tokenizer with other random weights: its guesses mostly fail."""
    return str(build_demo_model(tmp_path_factory.mktemp("draft") / "tiny-seed1", seed=1))


def prompts(engine) -> list[list[int]]:
    return [engine.tokenizer.encode(f"draft model prompt {i} " * (2 + i)) for i in range(4)]


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("draft", ["itself", "other weights"])
async def test_greedy_output_is_the_served_models_under_batching(
        draft, demo_model_dir, other_weights, reference):
    path = str(demo_model_dir) if draft == "itself" else other_weights
    engine = start_engine(str(demo_model_dir), cache_bytes=1 << 30, speculation=(
        SpeculationConfig(mode="on", sources=("model",), draft_model=path)))
    try:
        asked = prompts(engine)
        got = await asyncio.gather(*(complete(engine, p, 24) for p in asked))
        assert [g.tokens for g in got] == [reference.greedy(p, 24) for p in asked]
        drafted = sum(g.finish.draft_tokens for g in got)
        accepted = sum(g.finish.accepted_draft_tokens for g in got)
        assert drafted > 0
        if draft == "itself":  # the same weights guess the same argmax
            assert accepted >= 0.9 * drafted
        check_tree_kv(engine, reference.model)
    finally:
        engine.shutdown()


def test_a_session_catches_up_and_rolls_back_to_where_the_context_parted(
        demo_model_dir, reference):
    """A session guesses as the model does from scratch, after its context moved on
    past its last guess, and after the context took another turn."""
    loaded = load_model(str(demo_model_dir))
    session = DraftModel.load(str(demo_model_dir), loaded).session()
    prompt = loaded.tokenizer.encode("a session keeps its cache " * 3)
    first = reference.greedy(prompt, 12)
    assert session(prompt, 4) == first[:4]
    assert session(prompt + first[:6], 4) == first[6:10]  # two guesses kept, more fed
    other = [*prompt[:-3], 7, 8]
    assert session(other, 5) == reference.greedy(other, 5)


def test_a_draft_model_of_another_tokenizer_is_refused(demo_model_dir, real_model_dir):
    engine = Engine(EngineConfig(model=str(demo_model_dir), speculation=SpeculationConfig(
        mode="on", sources=("model",), draft_model=str(real_model_dir))))
    engine.start()
    assert engine.wait_ready(120) == "failed"
    assert "another tokenizer" in engine.error and "DraftModelError" in engine.error


def test_a_draft_model_whose_cache_cannot_roll_back_is_refused(demo_model_dir,
                                                               demo_model_family):
    loaded = load_model(str(demo_model_dir))
    with pytest.raises(DraftModelError, match="cannot be rolled back"):
        DraftModel.load(str(demo_model_family("gemma3_text")), loaded)


def with_embedded_ids(source: Path, target: Path, rows: int) -> Path:
    """A copy of the model at `source` whose embedding and output layer keep their first
    `rows` ids (its tokenizer unchanged)."""
    shutil.copytree(source, target)
    config = json.loads((source / "config.json").read_text())
    weights = mx.load(str(source / "model.safetensors"))
    mx.save_safetensors(str(target / "model.safetensors"), {
        name: array[:rows] if array.shape[0] == config["vocab_size"] else array
        for name, array in weights.items()})
    (target / "config.json").write_text(json.dumps({**config, "vocab_size": rows}))
    return target


def test_a_draft_model_that_embeds_fewer_ids_than_its_tokenizer_is_refused(
        demo_model_dir, tmp_path):
    """Fed a larger id, MLX's embedding would read past its rows: such a draft model
    would guess from other memory."""
    loaded = load_model(str(demo_model_dir))
    small = with_embedded_ids(Path(demo_model_dir), tmp_path / "small", rows=1024)
    with pytest.raises(DraftModelError, match="embeds 1024 token ids, fewer than"):
        DraftModel.load(str(small), loaded)


def test_a_session_drafts_nothing_after_an_id_past_its_embedding(demo_model_dir, reference):
    """The served model may embed more ids than its tokenizer makes (padding rows, which
    sampling or a logit bias can pick): past the draft model's rows, a context gets no
    guess, and fed nothing, the session guesses as before once the context leaves it."""
    loaded = load_model(str(demo_model_dir))
    session = DraftModel.load(str(demo_model_dir), loaded).session()
    prompt = loaded.tokenizer.encode("a padding id ends the guesses " * 2)
    assert session([*prompt, session.vocab_size], 4) == []
    assert session(prompt, 4) == reference.greedy(prompt, 4)
