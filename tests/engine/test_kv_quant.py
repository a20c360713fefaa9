"""KV cache quantization (`kv_bits`): the tree keeps quantized segments, 2-4x more tokens
in its budget, and a cache hit still answers exactly as the same server without one."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest

from engine.api import EngineConfig
from engine.engine import Engine
from engine.generator import Generator
from engine.kv import KVSegment
from engine.kv_quant import KVQuantization, cached_bytes_per_token, kv_quantization
from engine.mlx_lm_internals import kv_bytes_per_token, span_tokens
from tests.engine.kv_integrity import tree_nodes
from tests.engine.support import complete, settled, start_engine

# Long enough to span several 64-token prefill chunks and node splits.
SHARED = "You are a careful assistant who answers questions about the solar system. " * 16
CHUNK = 64
QUESTIONS = ["What is the largest planet?", "How far is Mars from the Sun?",
             "Why is Venus so hot?", "Name the moons of Jupiter."]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("bits", [4, 8])
def test_rounded_kv_is_given_back_exactly_by_its_quantized_copy(dtype, bits) -> None:
    """What a running cache holds (`round`) is what the tree's copy of it dequantizes to,
    bit for bit: otherwise a hit would attend over other values than a cold prompt."""
    quantization = KVQuantization(bits, 64, dtype)
    mx.random.seed(bits)
    scale = mx.random.uniform(0.01, 30, (4, 8, 500, 1))
    x = (mx.random.normal((4, 8, 500, 128)) * scale
         + mx.random.normal((4, 8, 500, 1)) * 5).astype(dtype)
    rounded = quantization.round(x)
    assert rounded.dtype == dtype
    assert mx.array_equal(quantization.dequantize(*quantization.quantize(rounded)), rounded)


def test_a_quantized_tokens_bytes() -> None:
    # SmolLM2-135M's shape: 30 layers x 3 KV heads x 64, keys and values, float32.
    plain = 30 * 3 * 64 * 2 * 4
    assert cached_bytes_per_token(plain, None) == plain
    eight = cached_bytes_per_token(plain, KVQuantization(8, 64, mx.float32))
    four = cached_bytes_per_token(plain, KVQuantization(4, 64, mx.float32))
    assert (eight, four) == (11520 + 1440, 5760 + 1440)  # packed + float32 scale and bias
    assert plain / eight > 3.5 and plain / four > 6.3


def test_the_group_size_must_tile_the_head_dimension() -> None:
    assert kv_quantization(None, 64, mx.float32, (16, 16)) is None
    with pytest.raises(ValueError, match=r"does not divide the model's head dimensions "
                       r"\(16, 16\): choose one of none"):
        kv_quantization(8, 32, mx.float32, (16, 16))
    with pytest.raises(ValueError, match=r"choose one of \[32, 64\]"):
        kv_quantization(4, 128, mx.float32, (64, 64))
    with pytest.raises(ValueError, match="kv_bits must be one of"):
        kv_quantization(3, 64, mx.float32, (64, 64))


# -- engines on the real default model ------------------------------------------------------


@pytest.fixture(scope="module", params=[8, 4])
def quantized(request, real_model_dir: Path) -> Iterator[Engine]:
    engine = start_engine(str(real_model_dir), kv_bits=request.param, cache_bytes=1 << 28,
                          prefill_chunk_tokens=CHUNK)
    yield engine
    engine.shutdown()


def chat(engine: Engine, question: str) -> list[int]:
    return engine.tokenizer.chat_prompt([{"role": "system", "content": SHARED},
                                         {"role": "user", "content": question}])


async def test_a_hit_attends_over_exactly_the_kv_a_cold_prompt_did(quantized) -> None:
    """A hit's prefix is what the tree gives back of it, which is exactly what the request
    that computed it attended over: where the hit ends at a prefill chunk's boundary, so
    that its suffix is computed in the chunks a cold prompt computes it in, its greedy
    answer is the cold one's, token for token, at 8 bits and at 4.

    (Elsewhere the suffix's chunks differ, and so do the float sums of every forward,
    by ~1e-5 in the model's dtype as without quantization; but rounding to a grid turns
    such noise into whole steps where a value lies near a step's edge: at 4 bits a cold
    prompt's answer changes with the chunk size alone. docs/benchmarks.md measures how
    often a hit's answer differs.

    One question at each width, a different one at each: the check is the same for any
    prompt, and two at each width doubled the real-model prompts and answers.)"""
    prompt = chat(quantized, QUESTIONS[0 if quantized.config.kv_bits == 8 else 1])
    await asyncio.wrap_future(quantized.clear_cache())
    cold = await complete(quantized, prompt, max_tokens=24)
    assert cold.finish.cached_tokens == 0
    await asyncio.wrap_future(quantized.clear_cache())
    # Chunks 0-64 and 64-128 published; the next token differs from the prompt's.
    other = (prompt[CHUNK * 2] + 1) % quantized._loaded.vocab_size
    await complete(quantized, [*prompt[:CHUNK * 2], other], max_tokens=1)
    hit = await complete(quantized, prompt, max_tokens=24)
    assert hit.finish.cached_tokens == CHUNK * 2
    assert hit.tokens == cold.tokens
    await settled(quantized)


async def test_the_tree_holds_quantized_bytes(quantized) -> None:
    await asyncio.wrap_future(quantized.clear_cache())
    prompt = chat(quantized, QUESTIONS[0])
    await complete(quantized, prompt, max_tokens=8)
    stats = await settled(quantized)
    plan = quantized.memory
    handles = [node.handle for node in tree_nodes(quantized._scheduler.tree.root)
               if node.handle is not None]
    assert handles and all(isinstance(h, KVSegment) and h.quantization for h in handles)
    assert stats.tree.total_bytes == stats.tree.total_tokens * plan.cached_bytes_per_token
    plain = kv_bytes_per_token(quantized._loaded.model)
    assert plan.kv_bytes_per_token == plain  # the running batch is in the model's dtype
    assert plan.cached_tokens == plan.cache_bytes // plan.cached_bytes_per_token
    assert plan.cached_bytes_per_token < plain / 3


# -- the disk tier ------------------------------------------------------------------------------


async def test_quantized_segments_come_back_from_disk_and_other_bits_are_dropped(
        head64_model_dir: Path, tmp_path: Path) -> None:
    options = {"cache_bytes": 1 << 28, "disk_cache_dir": str(tmp_path),
               "disk_cache_bytes": 1 << 30}
    model = str(head64_model_dir)
    first = start_engine(model, kv_bits=8, **options)
    prompt = chat(first, QUESTIONS[1])
    answer = await complete(first, prompt, max_tokens=16)
    await settled(first)
    first.shutdown()

    again = start_engine(model, kv_bits=8, **options)
    try:
        assert again.disk.rebuilt.wait(30)
        assert again.disk.stats.restored_nodes > 0 and again.disk.stats.bad_files == 0
        restored = await complete(again, prompt, max_tokens=16)
        assert restored.finish.cached_tokens > 150
        assert restored.tokens == answer.tokens
    finally:
        again.shutdown()

    other = start_engine(model, kv_bits=4, **options)
    try:
        assert other.disk.rebuilt.wait(30)
        assert other.disk.stats.restored_nodes == 0 and other.disk.stats.bad_files > 0
        assert not list(other.disk.directory.glob("*.safetensors"))  # dropped
        missed = await complete(other, prompt, max_tokens=16)
        assert missed.finish.cached_tokens == 0
    finally:
        other.shutdown()


@pytest.mark.parametrize(("bits", "refeeds"), [(None, True), (8, False), (4, False)])
async def test_prompts_prefilled_together_attend_over_their_prefixes_as_kept(
        head64_model_dir: Path, bits: int | None, refeeds: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two prompts prefilled in one forward, their cached prefixes 4 tokens apart: an
    unquantized engine feeds the deeper one's last 4 cached tokens again, so that both
    hold their prefixes at the same place. A quantized one must not: a token fed again is
    rounded anew and can land a grid step from its kept value, so the row would attend
    over other KV than the tree's, and the tree would keep KV computed over it below the
    kept prefix (kv_integrity's check saw a value 2.1 steps off at 4 bits)."""
    rows: list[tuple[int, list[int]]] = []  # (cached tokens under the row, tokens fed)
    forward_rows = Generator._forward_rows

    def recorded(self, prefixes, feeds, width):
        rows.extend((span_tokens(spans), list(feed)) for spans, feed in zip(prefixes, feeds))
        return forward_rows(self, prefixes, feeds, width)

    monkeypatch.setattr(Generator, "_forward_rows", recorded)
    engine = start_engine(str(head64_model_dir), kv_bits=bits, cache_bytes=1 << 24)
    try:
        prefix = [1, 2, *range(100, 140)]
        await complete(engine, [*prefix, 7], max_tokens=1)
        first, second = [*prefix, 300, 301, 302], [*prefix[:38], 400, 401, 402]
        done = await asyncio.gather(complete(engine, first, max_tokens=1),
                                    complete(engine, second, max_tokens=1))
    finally:
        engine.shutdown()
    # One forward of both rows: each row's tokens end its prompt.
    depths = {len(prompt): d.finish.cached_tokens for prompt, d in zip((first, second), done)}
    assert depths == {45: len(prefix), 41: 38}
    assert sorted(cached + len(fed) for cached, fed in rows) == [41, 45]
    assert all(cached < depths[cached + len(fed)] for cached, fed in rows) is refeeds
    assert all(cached == depths[cached + len(fed)] for cached, fed in rows) is not refeeds


# -- models it does not apply to ----------------------------------------------------------------


@pytest.mark.parametrize(("family", "message"), [
    ("llama", "kv_group_size 64 does not divide the model's head dimensions"),
    ("gemma3_text", "has sliding-window or recurrent layers"),
])
def test_a_model_kv_bits_cannot_apply_to_fails_to_start_with_the_reason(
        family, message, demo_model_family) -> None:
    engine = Engine(EngineConfig(model=str(demo_model_family(family)), kv_bits=8))
    engine.start()
    assert engine.wait_ready(120) == "failed"
    assert message in engine.error
    engine.shutdown()
