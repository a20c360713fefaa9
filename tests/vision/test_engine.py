"""The engine on a vision model of each family served (Gemma 3; Qwen2.5-VL and Qwen2-VL,
whose tokens have M-RoPE positions and whose images have as many tokens as their size
makes): image prompts give mlx_vlm.generate's greedy tokens cold, on a cache hit and
batched, and the radix tree keys each image on its pixels."""

from __future__ import annotations

import asyncio
import threading
import time

import mlx_vlm
import PIL
import pytest
import transformers

from engine import vision as engine_vision
from engine.api import RequestFailed, SamplingParams, SpeculationConfig
from engine.demo_vlm import build_demo_vlm
from engine.engine import ENGINE_THREAD
from engine.image_files import open_image
from engine.image_tokens import MARKER
from engine.loader import load_model
from tests.engine.support import cancel_after, complete, settled, start_engine
from tests.vision.support import VlmReference, image_prompt, png, prompt_text, user_turn

MAX_TOKENS = 12
SLIDING_WINDOW = 24


@pytest.fixture(scope="module", params=["gemma3", "qwen2_5_vl", "qwen2_vl"])
def vlm_dir(request, demo_vlm_dir, demo_qwen_vl_dir, demo_qwen2_vl_dir):
    return {"gemma3": demo_vlm_dir, "qwen2_5_vl": demo_qwen_vl_dir,
            "qwen2_vl": demo_qwen2_vl_dir}[request.param]


@pytest.fixture(scope="module")
def reference(vlm_dir) -> VlmReference:
    return VlmReference(vlm_dir)


@pytest.fixture(scope="module")
def engine(vlm_dir):
    engine = start_engine(str(vlm_dir), cache_bytes=1 << 28)
    yield engine
    engine.shutdown()


def reference_text(engine, prompt) -> str:
    return prompt_text(engine.tokenizer, prompt.tokens)


async def rebuilt_from_disk(engine, timeout: float = 60.0) -> None:
    """Wait for the tree's rebuild from the disk tier, which runs beside serving."""
    deadline = asyncio.get_running_loop().time() + timeout
    while engine.stats().disk.restored_nodes == 0 or engine.stats().disk.rebuilding:
        assert asyncio.get_running_loop().time() < deadline, "nothing rebuilt from disk"
        await asyncio.sleep(0.05)


async def test_an_image_prompt_gives_mlx_vlm_generates_tokens_cold_and_cached(
        engine, reference):
    engine.clear_cache().result()
    image = png(1)
    prompt = image_prompt(engine.tokenizer, [user_turn(engine.tokenizer)], [image])
    expected = reference.greedy(reference_text(engine, prompt), [image], MAX_TOKENS)

    encoded = engine.stats().counters.images_encoded
    cold = await complete(engine, prompt, MAX_TOKENS, ignore_eos=True)
    after_cold = engine.stats().counters.images_encoded
    hit = await complete(engine, prompt, MAX_TOKENS, ignore_eos=True)

    assert cold.tokens == expected
    assert cold.finish.cached_tokens == 0
    assert hit.tokens == expected
    assert hit.finish.cached_tokens == len(prompt.tokens) - 1
    # The vision tower ran for the cold prompt only.
    assert after_cold == encoded + 1 == engine.stats().counters.images_encoded


async def test_a_cold_image_prompt_decodes_and_processes_each_image_once_and_a_hit_none(
        engine, monkeypatch):
    """The processor's pixels are for the vision tower alone: Qwen's positions take the
    images' grids from their sizes, and a cached image is not read at all."""
    engine.clear_cache().result()
    vision, seen = engine._loaded.vision, {"decoded": 0, "processed": 0}
    processor = vision.image_processor

    def counted_open(data):
        seen["decoded"] += 1
        return open_image(data)

    def counted_processor(images, **options):
        seen["processed"] += len(images)
        return processor(images, **options)

    monkeypatch.setattr(engine_vision, "open_image", counted_open)
    monkeypatch.setattr(vision, "image_processor", counted_processor)
    tokenizer = engine.tokenizer
    turn = {"role": "user", "content": MARKER + "This one, and "
            + MARKER + "that one?"}
    prompt = image_prompt(tokenizer, [turn], [png(21, size=(20, 64)), png(22)])

    cold = await complete(engine, prompt, 2, ignore_eos=True)
    after_cold = dict(seen)
    hit = await complete(engine, prompt, 2, ignore_eos=True)

    assert after_cold == {"decoded": 2, "processed": 2}
    assert seen == after_cold
    assert cold.tokens == hit.tokens
    assert hit.finish.cached_tokens == len(prompt.tokens) - 1


async def test_a_new_image_is_prepared_while_running_streams_decode(
        engine, reference, monkeypatch):
    """Decoding a new image and running the processor over it take tens of milliseconds
    of CPU for a photo: on a thread of their own, so the streams already decoding go on
    meanwhile. Here the processor holds until the engine has stepped four more times;
    on the engine's thread it would never see a step."""
    engine.clear_cache().result()
    vision = engine._loaded.vision
    processor, threads = vision.image_processor, []

    def held_processor(images, **options):
        threads.append(threading.current_thread().name)
        steps, deadline = engine.stats().counters.steps, time.monotonic() + 60
        while engine.stats().counters.steps < steps + 4:
            assert time.monotonic() < deadline, "no engine step while an image is prepared"
            time.sleep(0.01)
        return processor(images, **options)

    monkeypatch.setattr(vision, "image_processor", held_processor)
    tokenizer, image = engine.tokenizer, png(31)
    text = tokenizer.chat_prompt([{"role": "user", "content": "Count to a thousand."}])
    running = engine.submit(text, SamplingParams(max_tokens=4000, temperature=0.0,
                                                 ignore_eos=True))
    first = await anext(aiter(running))
    prompt = image_prompt(tokenizer, [user_turn(tokenizer)], [image])
    pictured = await complete(engine, prompt, MAX_TOKENS, ignore_eos=True)
    running.cancel()

    assert first.token is not None and threads and ENGINE_THREAD not in threads
    assert pictured.tokens == reference.greedy(reference_text(engine, prompt), [image],
                                               MAX_TOKENS)
    assert (await settled(engine)).tree.pinned_bytes == 0


async def test_an_image_the_processor_refuses_fails_its_request_alone(
        engine, reference, monkeypatch):
    vision = engine._loaded.vision
    processor, refused = vision.image_processor, png(32)

    def choosy_processor(images, **options):
        if images[0].tobytes() == open_image(refused).convert("RGB").tobytes():
            raise ValueError("an image this processor cannot size")
        return processor(images, **options)

    monkeypatch.setattr(vision, "image_processor", choosy_processor)
    tokenizer, image = engine.tokenizer, png(33)
    bad = image_prompt(tokenizer, [user_turn(tokenizer)], [refused])
    good = image_prompt(tokenizer, [user_turn(tokenizer)], [image])
    failed, answered = await asyncio.gather(
        complete(engine, bad, MAX_TOKENS), complete(engine, good, MAX_TOKENS, ignore_eos=True),
        return_exceptions=True)

    assert isinstance(failed, RequestFailed) and "cannot size" in str(failed)
    assert answered.tokens == reference.greedy(reference_text(engine, good), [image],
                                               MAX_TOKENS)
    assert (await settled(engine)).tree.pinned_bytes == 0


async def test_image_prompts_batched_give_each_its_own_tokens(engine, reference):
    """Images of other sizes (Qwen: other token counts, other position shifts) beside a
    text prompt in one decode batch; rows leave it at different steps."""
    engine.clear_cache().result()
    tokenizer = engine.tokenizer
    images = [png(2), png(3, size=(64, 20)), png(4, size=(30, 30))]
    prompts = [image_prompt(tokenizer, [user_turn(tokenizer)], [image]) for image in images]
    text = tokenizer.chat_prompt([{"role": "user", "content": "Say something."}])
    lengths = [MAX_TOKENS, MAX_TOKENS // 2, MAX_TOKENS, MAX_TOKENS // 3]

    results = await asyncio.gather(*(
        complete(engine, prompt, length, ignore_eos=True)
        for prompt, length in zip([*prompts, text], lengths)))

    for prompt, image, result, length in zip(prompts, images, results, lengths):
        assert result.tokens == reference.greedy(reference_text(engine, prompt), [image],
                                                 length)
    assert results[-1].tokens == reference.greedy(tokenizer.decode(text), [], lengths[-1])
    assert len({tuple(result.tokens[:4]) for result in results}) > 1  # the images decide


async def test_a_second_turn_reuses_the_image_and_another_image_does_not(engine, reference):
    engine.clear_cache().result()
    tokenizer = engine.tokenizer
    image, other = png(5), png(6)
    first = image_prompt(tokenizer, [user_turn(tokenizer)], [image])
    answer = await complete(engine, first, MAX_TOKENS)
    turns = [user_turn(tokenizer), {"role": "assistant", "content": answer.text},
             {"role": "user", "content": "And what else?"}]

    second = image_prompt(tokenizer, turns, [image])
    again = await complete(engine, second, MAX_TOKENS, ignore_eos=True)
    swapped = image_prompt(tokenizer, turns, [other])
    elsewhere = await complete(engine, swapped, MAX_TOKENS, ignore_eos=True)

    image_start = first.images[0].start
    assert again.finish.cached_tokens >= len(first.tokens) - 1 > image_start
    assert elsewhere.finish.cached_tokens == image_start  # the text before it only
    assert again.tokens == reference.greedy(reference_text(engine, second), [image],
                                            MAX_TOKENS)
    assert elsewhere.tokens == reference.greedy(reference_text(engine, swapped), [other],
                                                MAX_TOKENS)
    assert (await settled(engine)).tree.pinned_bytes == 0


def test_the_disk_tiers_fingerprint_names_the_code_that_makes_an_images_pixels(vlm_dir):
    """An image's key is its decoded pixels and the processor's settings; its features
    also depend on the code: mlx-vlm's tower, and transformers' processor class (a fast
    one where torchvision is installed) and Pillow, which make its pixel values. KV on
    disk that other code computed must not be read back for the same key."""
    vision = load_model(str(vlm_dir)).vision
    code = vision.code_version
    assert f"mlx-vlm {mlx_vlm.__version__}" in code
    assert f"transformers {transformers.__version__}" in code
    assert type(vision.image_processor).__name__ in code and PIL.__version__ in code


async def test_text_only_prompts_on_a_vision_model_run_as_they_do_on_its_language_model(
        engine, reference):
    tokens = engine.tokenizer.chat_prompt([{"role": "user", "content": "Say something."}])
    text = engine.tokenizer.decode(tokens)

    result = await complete(engine, tokens, MAX_TOKENS, ignore_eos=True)
    hit = await complete(engine, tokens, MAX_TOKENS, ignore_eos=True)

    assert result.tokens == hit.tokens == reference.greedy(text, [], MAX_TOKENS)
    assert hit.finish.cached_tokens == len(tokens) - 1


async def test_chunks_that_cut_an_image_give_the_same_tokens(vlm_dir, reference):
    engine = start_engine(str(vlm_dir), cache_bytes=1 << 28, prefill_chunk_tokens=7)
    try:
        image = png(7)
        prompt = image_prompt(engine.tokenizer, [user_turn(engine.tokenizer)], [image])
        result = await complete(engine, prompt, MAX_TOKENS, ignore_eos=True)
        assert result.tokens == reference.greedy(reference_text(engine, prompt), [image],
                                                 MAX_TOKENS)
    finally:
        engine.shutdown()


async def test_two_images_in_one_prompt_give_mlx_vlm_generates_tokens(vlm_dir, reference):
    """The second image's positions follow the first's (Qwen: the shifts add up), fed in
    chunks that cut both images, then again from the cache."""
    engine = start_engine(str(vlm_dir), cache_bytes=1 << 28, prefill_chunk_tokens=5)
    try:
        tokenizer, images = engine.tokenizer, [png(19, size=(20, 64)), png(20)]
        turn = {"role": "user", "content": MARKER + "This one, and "
                + MARKER + "that one: which is brighter?"}
        prompt = image_prompt(tokenizer, [turn], images)
        cold = await complete(engine, prompt, MAX_TOKENS, ignore_eos=True)
        hit = await complete(engine, prompt, MAX_TOKENS, ignore_eos=True)
    finally:
        engine.shutdown()
    assert len(prompt.images) == 2
    assert cold.tokens == hit.tokens == reference.greedy(reference_text(engine, prompt),
                                                         images, MAX_TOKENS)
    assert hit.finish.cached_tokens == len(prompt.tokens) - 1


async def test_the_disk_tier_keeps_an_image_prompts_segments_across_a_restart(
        vlm_dir, reference, tmp_path):
    image = png(8)
    options = {"cache_bytes": 1 << 28, "disk_cache_dir": str(tmp_path),
               "disk_cache_bytes": 1 << 28}
    first = start_engine(str(vlm_dir), **options)
    try:
        prompt = image_prompt(first.tokenizer, [user_turn(first.tokenizer)], [image])
        cold = await complete(first, prompt, MAX_TOKENS, ignore_eos=True)
    finally:
        first.shutdown()
    second = start_engine(str(vlm_dir), **options)
    try:
        await rebuilt_from_disk(second)
        restored = await complete(second, prompt, MAX_TOKENS, ignore_eos=True)
        other = image_prompt(second.tokenizer, [user_turn(second.tokenizer)], [png(9)])
        elsewhere = await complete(second, other, MAX_TOKENS, ignore_eos=True)
    finally:
        second.shutdown()
    assert restored.finish.cached_tokens >= prompt.images[0].start + prompt.images[0].length
    assert restored.tokens == cold.tokens
    assert elsewhere.finish.cached_tokens == other.images[0].start


async def test_a_sliding_window_vision_model_reuses_the_image_from_a_message_end_snapshot(
        tmp_path):
    directory = build_demo_vlm(tmp_path / "sliding", sliding_window=SLIDING_WINDOW)
    reference = VlmReference(directory)
    engine = start_engine(str(directory), cache_bytes=1 << 28)
    try:
        tokenizer, image = engine.tokenizer, png(10)
        first = image_prompt(tokenizer, [user_turn(tokenizer)], [image], message_ends=True)
        answer = await complete(engine, first, MAX_TOKENS)
        turns = [user_turn(tokenizer), {"role": "assistant", "content": answer.text},
                 {"role": "user", "content": "And what else?"}]
        second = image_prompt(tokenizer, turns, [image], message_ends=True)
        again = await complete(engine, second, MAX_TOKENS, ignore_eos=True)
    finally:
        engine.shutdown()
    assert engine.wants_message_ends
    assert len(first.tokens) > SLIDING_WINDOW  # the rotating layers wrapped
    assert answer.tokens == reference.greedy(reference_text(engine, first), [image],
                                             len(answer.tokens))
    span = first.images[0]
    assert again.finish.cached_tokens > span.start + span.length
    assert again.tokens == reference.greedy(reference_text(engine, second), [image],
                                            MAX_TOKENS)


async def test_a_cancelled_image_request_leaves_its_prompt_cached(engine, reference):
    engine.clear_cache().result()
    image = png(11)
    prompt = image_prompt(engine.tokenizer, [user_turn(engine.tokenizer)], [image])
    stream = engine.submit(prompt, SamplingParams(max_tokens=64, temperature=0.0,
                                                  ignore_eos=True))
    finish = await cancel_after(stream, 2)
    again = await complete(engine, prompt, MAX_TOKENS, ignore_eos=True)

    assert finish.reason == "cancelled"
    assert again.finish.cached_tokens == len(prompt.tokens) - 1
    assert again.tokens == reference.greedy(reference_text(engine, prompt), [image],
                                            MAX_TOKENS)
    assert (await settled(engine)).tree.pinned_bytes == 0


async def test_drafts_verified_for_an_image_prompt_keep_its_tokens(vlm_dir, reference):
    """A repeated image prompt and a repeated text prompt decode together, their outputs
    drafted from the tree: a verify step feeds several positions of each row, the image
    row's shifted by its prompt's M-RoPE delta (Qwen) and the text row's not."""
    engine = start_engine(str(vlm_dir), cache_bytes=1 << 28, speculation=SpeculationConfig(
        mode="on", sources=("tree",)))
    try:
        tokenizer, image = engine.tokenizer, png(12)
        prompt = image_prompt(tokenizer, [user_turn(tokenizer)], [image])
        text = tokenizer.chat_prompt([{"role": "user", "content": "Say something."}])
        first = await complete(engine, prompt, MAX_TOKENS, ignore_eos=True)
        await complete(engine, text, MAX_TOKENS, ignore_eos=True)
        again, text_again = await asyncio.gather(
            complete(engine, prompt, MAX_TOKENS, ignore_eos=True),
            complete(engine, text, MAX_TOKENS, ignore_eos=True))
    finally:
        engine.shutdown()
    assert first.tokens == again.tokens == reference.greedy(reference_text(engine, prompt),
                                                            [image], MAX_TOKENS)
    assert text_again.tokens == reference.greedy(tokenizer.decode(text), [], MAX_TOKENS)
    assert again.finish.accepted_draft_tokens == again.finish.draft_tokens > 0
