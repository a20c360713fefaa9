"""Prefill-only requests (readouts): what each prompt's last position gives is the model's
own, whichever way the engine computes it.

A list of readouts sharing a prefix the tree holds (a classify list's instruction) is read
together: one forward per batch over that prefix, nothing new cached. Where the tree lacks
the prefix, one prompt of the list goes the general way, which computes and publishes it,
and the rest are read together over it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from mlx_lm.models.cache import make_prompt_cache

from engine.api import Finish, LastPosition, QueueFull, Readout, RequestFailed, SamplingParams
from engine.engine import Engine
from tests.engine.kv_integrity import check_tree_kv
from tests.engine.support import Reference, settled, start_engine
from tests.faults import FaultInjectingModel, failing_first, loader_wrapping

pytestmark = pytest.mark.asyncio(loop_scope="module")

LOGPROB_TOLERANCE = 1e-4  # float32: a padded batch's forward against one prompt's alone
CHUNK = 96  # the engine's prefill chunk: the positions (padding included) of a forward
PREAMBLE = "Classify the sentiment of each review as positive or negative. Review:"
REVIEWS = ["I loved it.", "Terrible, never again.", "Fine, I guess.",
           "Best purchase of the year!", "Broke after a day.", "ok", "Meh."]


class CountingModel:
    """The model, recording the shape of every forward's inputs and the kind of attention
    mask its cache gives it: "causal", "array" or None."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self.shapes: list[tuple[int, ...]] = []
        self.masks: list[str | None] = []

    def __call__(self, inputs: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        self.shapes.append(tuple(inputs.shape))
        cache = kwargs.get("cache")
        mask = (cache[0].make_mask(inputs.shape[1], return_array=False, window_size=None)
                if cache else None)
        self.masks.append("array" if isinstance(mask, mx.array) else mask)
        return self._model(inputs, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


@pytest.fixture(scope="module")
def llama_dir(family_model_dir) -> str:
    return family_model_dir("llama")


def counting_engine(model_dir: str, **config) -> tuple[Engine, CountingModel]:
    """An engine whose forwards are counted, with prefill chunks of CHUNK tokens."""
    models: list[CountingModel] = []

    def wrap(model: nn.Module) -> CountingModel:
        models.append(CountingModel(model))
        return models[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("engine.engine.load_model", loader_wrapping(wrap))
        engine = start_engine(model_dir, prefill_chunk_tokens=CHUNK, **config)
    return engine, models[0]


@pytest.fixture(scope="module")
def counted(llama_dir) -> Iterator[tuple[Engine, CountingModel]]:
    """A plain-KV engine whose forwards are counted."""
    engine, model = counting_engine(llama_dir, cache_bytes=1 << 30)
    yield engine, model
    engine.shutdown()


@pytest.fixture(scope="module")
def llama_reference(llama_dir) -> Reference:
    return Reference(llama_dir)


def params(readout: Readout) -> SamplingParams:
    return SamplingParams(max_tokens=0, temperature=0.0, readout=readout)


def encode(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, special_tokens=False)


def a_list(engine: Engine, reviews: list[str] = REVIEWS) -> tuple[list[list[int]], int]:
    """The prompts of a classify list and how many first tokens they share."""
    preamble = encode(engine, PREAMBLE)
    return [preamble + encode(engine, " " + review) for review in reviews], len(preamble)


def failing_on_terrible(llama_dir: str, reviews: list[str]
                        ) -> tuple[Engine, list[list[int]], int, int]:
    """An engine whose forward raises for any input holding the first token of
    " Terrible", the prompts of a list of `reviews` and how many tokens they share, and
    that token."""
    probe = start_engine(llama_dir)
    prompts, shared = a_list(probe, reviews)
    culprit = encode(probe, " Terrible")[0]
    probe.shutdown()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("engine.engine.load_model",
                      loader_wrapping(lambda model: FaultInjectingModel(model, culprit)))
        engine = start_engine(llama_dir, cache_bytes=1 << 30)
    return engine, prompts, shared, culprit


async def read(engine: Engine, prompts: list[list[int]], readout: Readout
               ) -> list[tuple[LastPosition | None, Finish | Exception]]:
    """Submit the prompts together, as a server's job does, and return each one's
    reading and its Finish (or the error it ended with)."""
    streams = engine.submit_all(prompts, params(readout))

    async def one(stream) -> tuple[LastPosition | None, Finish | Exception]:
        last = None
        try:
            async for event in stream:
                if isinstance(event, LastPosition):
                    last = event
                elif isinstance(event, Finish):
                    return last, event
        except RequestFailed as error:
            return last, error
        raise AssertionError("stream ended without a Finish")

    return await asyncio.gather(*(one(stream) for stream in streams))


def direct(reference: Reference, prompt: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """mlx-lm's logprobs at the prompt's last position, and its last hidden state: one
    forward over a fresh cache, as `mlx_lm.generate` runs a prompt (a sliding-window
    model masks its window through its cache)."""
    model = reference.model
    hidden = model.model(mx.array([prompt]), cache=make_prompt_cache(model))[0, -1]
    logits = model(mx.array([prompt]), cache=make_prompt_cache(model))[0, -1]
    logits = logits.astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits)), np.array(hidden.astype(mx.float32))


def assert_reads(last: LastPosition, reference: Reference, prompt: list[int],
                 readout: Readout) -> None:
    logprobs, hidden = direct(reference, prompt)
    top = np.argsort(-logprobs)[:max(readout.top_logprobs, 1)].tolist()
    assert last.token.token == top[0]
    assert abs(last.token.logprob - logprobs[top[0]]) < LOGPROB_TOLERANCE
    assert [t.token for t in last.top] == top[:readout.top_logprobs]
    for t in last.top:
        assert abs(t.logprob - logprobs[t.token]) < LOGPROB_TOLERANCE
    assert len(last.token_logprobs) == len(readout.token_ids)
    for value, token in zip(last.token_logprobs, readout.token_ids):
        assert abs(value - logprobs[token]) < LOGPROB_TOLERANCE
    if readout.hidden:
        assert np.allclose(last.hidden, hidden, atol=1e-4)
    else:
        assert last.hidden == ()


async def test_a_list_over_a_cached_prefix_is_read_in_one_forward(counted, llama_reference):
    """The first list's first prompt computes and publishes the shared preamble (and
    nothing of its review), and the rest of the list is one forward over it; the next
    list over that preamble is one forward of all its rows. Each reads what a direct
    forward of its prompt reads."""
    engine, model = counted
    engine.clear_cache().result(timeout=30)
    prompts, shared = a_list(engine)
    assert len(prompts) * max(len(prompt) - shared for prompt in prompts) <= CHUNK
    readout = Readout(top_logprobs=3, token_ids=(5, 17), cached_prefix=shared)
    model.shapes.clear()
    first = await read(engine, prompts, readout)
    *opener, rest = [shape[0] for shape in model.shapes]
    assert set(opener) == {1} and rest == len(prompts) - 1
    assert [finish.cached_tokens for _, finish in first] == [0] + [shared] * (len(prompts) - 1)
    assert (await settled(engine)).tree.total_tokens == shared
    model.shapes.clear()
    model.masks.clear()
    again = await read(engine, prompts, readout)
    assert [shape[0] for shape in model.shapes] == [len(prompts)]
    # Every row over the one preamble: no row left-padded, so no mask array to build
    # and read (MLX's CUDA backend attends far slower under one: `causal_rows`).
    assert model.masks == ["causal"]
    for prompt, (last, finish), (cold, _) in zip(prompts, again, first):
        assert isinstance(finish, Finish) and finish.reason == "length"
        assert finish.cached_tokens == shared
        assert finish.prompt_tokens == len(prompt)
        assert last.token.token == cold.token.token
        assert_reads(last, llama_reference, prompt, readout)
    stats = await settled(engine)
    assert stats.tree.total_tokens == shared  # the reviews were read, not kept
    assert stats.tree.pinned_bytes == 0 and stats.waiting == 0 and stats.running == 0
    assert check_tree_kv(engine, llama_reference.model).memory > 0


async def test_lists_of_a_new_preamble_wait_for_one_prompt_to_compute_it(counted,
                                                                         llama_reference):
    """Four lists arriving together with a preamble the tree lacks: one prompt of them
    all computes it (in forwards of one row), and every other prompt is read over it,
    many rows a forward (as many as a prefill chunk's positions hold)."""
    engine, model = counted
    lists = [a_list(engine, [f"{i} {r}" for r in REVIEWS]) for i in range(4)]
    readout = Readout(top_logprobs=2, cached_prefix=lists[0][1])
    engine.clear_cache().result(timeout=30)
    model.shapes.clear()
    results = await asyncio.gather(*(read(engine, prompts, readout) for prompts, _ in lists))
    cached = [finish.cached_tokens for readings in results for _, finish in readings]
    assert sorted(cached) == [0] + [lists[0][1]] * (len(cached) - 1)
    first_read = next(i for i, (rows, _) in enumerate(model.shapes) if rows > 1)
    computing, reads = model.shapes[:first_read], model.shapes[first_read:]
    assert all(rows == 1 for rows, _ in computing)
    assert sum(rows for rows, _ in reads) == len(cached) - 1
    assert all(rows * width <= CHUNK for rows, width in reads)
    for (prompts, _), readings in zip(lists, results):
        for prompt, (last, _) in zip(prompts, readings):
            assert_reads(last, llama_reference, prompt, readout)
    assert (await settled(engine)).tree.pinned_bytes == 0


async def test_a_list_whose_opener_fails_is_read_all_the_same(llama_dir, llama_reference):
    """The prompt a list sent to compute its new preamble fails (its forward raises):
    it gets the error, another prompt of the list computes the preamble, and every other
    prompt reads what it alone reads."""
    engine, prompts, shared, culprit = failing_on_terrible(
        llama_dir, [REVIEWS[1], *REVIEWS[:1], *REVIEWS[2:]])
    try:
        assert [culprit in prompt[shared:] for prompt in prompts].index(True) == 0
        assert sum(culprit in prompt for prompt in prompts) == 1
        readout = Readout(top_logprobs=2, cached_prefix=shared)
        (_, failed), *readings = await read(engine, prompts, readout)
        assert isinstance(failed, RequestFailed)
        assert sorted(f.cached_tokens for _, f in readings) == [0] + [shared] * (len(prompts) - 2)
        for prompt, (last, _) in zip(prompts[1:], readings):
            assert_reads(last, llama_reference, prompt, readout)
        stats = await settled(engine)
        assert stats.tree.pinned_bytes == 0 and stats.waiting == 0 and stats.running == 0
    finally:
        engine.shutdown()


async def test_a_preamble_the_cache_cannot_keep_is_computed_by_every_prompt(llama_dir,
                                                                            llama_reference):
    """A cache too small for the preamble: its opener's prompt publishes nothing, so the
    list does not wait for another; each prompt computes it the general way and reads
    what its prompt alone reads."""
    engine = start_engine(llama_dir, cache_bytes=16 * 512)  # 16 of the tiny llama's tokens
    try:
        prompts, shared = a_list(engine)
        assert shared > 16
        readout = Readout(top_logprobs=2, cached_prefix=shared)
        for _ in range(2):
            for prompt, (last, finish) in zip(prompts, await read(engine, prompts, readout)):
                assert isinstance(finish, Finish)
                assert_reads(last, llama_reference, prompt, readout)
        stats = await settled(engine)
        assert stats.tree.pinned_bytes == 0 and stats.waiting == 0 and stats.running == 0
    finally:
        engine.shutdown()


async def test_hidden_states_read_together_are_each_prompts_own(counted, llama_reference):
    """An embedding list (the last hidden state, no logprobs asked) over a cached
    instruction: each row's hidden state is its prompt's alone."""
    engine, _ = counted
    prompts, shared = a_list(engine, REVIEWS[:4])
    readout = Readout(hidden=True, cached_prefix=shared)
    await read(engine, prompts, readout)
    for prompt, (last, finish) in zip(prompts, await read(engine, prompts, readout)):
        assert finish.cached_tokens == shared
        assert_reads(last, llama_reference, prompt, readout)


async def test_a_cache_only_readout_caches_its_prompt_and_reads_nothing(counted,
                                                                       llama_reference):
    """A chat's next turn, prefilled to be cached (server/next_turn.py): the first time
    its prompt is computed and kept, with no LastPosition; sent again (the chat repeated)
    with the tree holding it, it finishes with no forward at all. A request after it
    reuses what it cached, and answers as it would cold."""
    engine, model = counted
    engine.clear_cache().result(timeout=30)
    prompts = [encode(engine, f"{PREAMBLE} {review} Thanks.") for review in REVIEWS[:4]]
    readout = Readout(cache_only=True)
    model.shapes.clear()
    for last, finish in await read(engine, prompts, readout):
        assert last is None and isinstance(finish, Finish) and finish.reason == "length"
    assert model.shapes
    kept = (await settled(engine)).tree.total_tokens
    assert kept >= max(map(len, prompts)) - 1
    model.shapes.clear()
    before = engine.stats().counters
    for prompt, (last, finish) in zip(prompts, await read(engine, prompts, readout)):
        assert last is None and finish.cached_tokens == len(prompt) - 1
    after = (await settled(engine))
    assert model.shapes == []
    assert after.counters.prefill_tokens == before.prefill_tokens
    assert after.tree.total_tokens == kept and after.tree.pinned_bytes == 0
    for prompt, (last, finish) in zip(prompts, await read(engine, prompts, Readout())):
        assert finish.cached_tokens == len(prompt) - 1
        assert_reads(last, llama_reference, prompt, Readout())


async def test_a_next_turn_guess_beside_a_request_changes_none_of_its_numbers(llama_dir):
    """A guess computed in the same steps as a client's request (a chat's next turn as
    another chat comes in) shares none of its forwards, nor its prefill budget: the
    request's tokens and logprobs are bit for bit those it gets alone. In one padded
    forward with the guess, or in one decode batch, they were not, and a quantized KV
    cache (`--kv-bits`) can turn such a difference into another token."""
    engine = start_engine(llama_dir, cache_bytes=1 << 30, prefill_chunk_tokens=16)
    try:
        client = encode(engine, REVIEWS[1])[:12]
        guess = encode(engine, " ".join([PREAMBLE, *REVIEWS] * 8))  # many steps' prefill
        options = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)

        async def answer(stream) -> list[tuple[int, float]]:
            return [(event.token, event.logprob.logprob) async for event in stream
                    if not isinstance(event, Finish)]

        alone = await answer(engine.submit(client, options))
        engine.clear_cache().result(timeout=30)
        guessed = engine.submit(guess, params(Readout(cache_only=True)))
        await asyncio.sleep(0.02)  # the guess is being prefilled
        beside = await answer(engine.submit(client, options))
        finish = [event async for event in guessed][-1]
        assert finish.reason == "length" and finish.prompt_tokens == len(guess)
        assert (await settled(engine)).tree.pinned_bytes == 0
        assert beside == alone
    finally:
        engine.shutdown()


async def test_guesses_of_different_chats_are_computed_in_one_forward_and_kept(counted):
    """Chats ending together each leave a next-turn guess: over prefixes of their own,
    they are fed together (all but each one's last token, which none reads), in one
    forward, and the tree keeps every one."""
    engine, model = counted
    engine.clear_cache().result(timeout=30)
    prompts = [encode(engine, f"{review} Thanks, {i}.") for i, review in enumerate(REVIEWS[:4])]
    model.shapes.clear()
    finishes = await asyncio.gather(*(
        read(engine, [prompt], Readout(cache_only=True)) for prompt in prompts))
    assert all(finish.reason == "length" for [(_, finish)] in finishes)
    assert [rows for rows, _ in model.shapes] == [len(prompts)]
    stats = await settled(engine)
    assert stats.tree.total_tokens == sum(len(p) - 1 for p in prompts)
    assert stats.tree.pinned_bytes == 0


async def test_a_guess_a_client_waits_for_is_fed_as_the_clients_are(llama_dir):
    """Background work is fed with what clients leave of a step, unless a client waits
    for the prefix it computes: then it is fed in turn, ahead of a client's prompt that
    came after it, not once every client's prompt is done."""
    engine = start_engine(llama_dir, cache_bytes=1 << 30, prefill_chunk_tokens=16)
    try:
        busy = engine.submit(encode(engine, REVIEWS[0]), SamplingParams(
            max_tokens=2000, temperature=0.0, ignore_eos=True))
        await anext(busy)  # decoding throughout: no burst holds first tokens back
        long = encode(engine, " ".join([PREAMBLE, *REVIEWS] * 6))
        other = encode(engine, " ".join([*REVIEWS, PREAMBLE] * 6))
        guess = engine.submit(long, params(Readout(cache_only=True)))
        await asyncio.sleep(0.02)  # its prefill under way, its prefix reserved
        one = SamplingParams(max_tokens=1, temperature=0.0)
        other_client = engine.submit(other, one)
        waiting_client = engine.submit(long + encode(engine, " Why?"), one)
        order = []

        async def until_first(name: str, stream) -> None:
            async for event in stream:
                if isinstance(event, Finish) or name != "guess":
                    order.append(name)
                    return

        await asyncio.gather(until_first("guess", guess), until_first("other", other_client),
                             until_first("waiting", waiting_client))
        assert order.index("guess") < order.index("other")
        engine.cancel(busy.request_id)
    finally:
        engine.shutdown()


async def test_a_guess_counts_as_background_work_not_as_a_running_request(llama_dir):
    """/metrics' running_requests counts clients; a guess being computed shows in
    background_prefills (its KV still counts in tokens_in_flight)."""
    engine = start_engine(llama_dir, cache_bytes=1 << 30, prefill_chunk_tokens=16)
    try:
        long = encode(engine, " ".join([PREAMBLE, *REVIEWS] * 6))
        guess = engine.submit(long, params(Readout(cache_only=True)))
        deadline = asyncio.get_running_loop().time() + 10
        while (stats := engine.stats()).background == 0:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.005)
        assert (stats.running, stats.background) == (0, 1)
        assert stats.tokens_in_flight >= len(long)
        assert [event async for event in guess][-1].reason == "length"
        stats = await settled(engine)
        assert (stats.running, stats.background, stats.tokens_in_flight) == (0, 0, 0)
    finally:
        engine.shutdown()


async def test_a_cache_clear_cancels_the_guesses_in_flight(llama_dir):
    """A guess computed on after the clear would put back what it let go of."""
    engine = start_engine(llama_dir, cache_bytes=1 << 30, prefill_chunk_tokens=16)
    try:
        guess = engine.submit(encode(engine, " ".join([PREAMBLE, *REVIEWS] * 6)),
                              params(Readout(cache_only=True)))
        await asyncio.sleep(0.02)
        engine.clear_cache().result(timeout=30)
        assert [event async for event in guess][-1].reason == "cancelled"
        stats = await settled(engine)
        assert stats.tree.total_tokens == 0 and stats.tree.pinned_bytes == 0
    finally:
        engine.shutdown()


async def test_a_next_turn_guess_waits_behind_clients_and_is_dropped_when_stale(llama_dir):
    """One row, busy: a cache-only readout (a chat's next turn) and ten client requests
    wait. Every client goes first, and the guess, passed over as each starts, is dropped
    (cancelled) once it is stale, not run after them all."""
    engine = start_engine(llama_dir, max_batch_size=1, cache_bytes=1 << 30)
    try:
        busy = engine.submit(encode(engine, PREAMBLE), SamplingParams(
            max_tokens=400, temperature=0.0, ignore_eos=True))
        await anext(busy)  # decoding: the row is taken
        order: list[str] = []

        async def until_finish(name: str, stream) -> Finish:
            async for event in stream:
                if isinstance(event, Finish):
                    order.append(name)
                    return event
            raise AssertionError("stream ended without a Finish")

        guess = engine.submit(encode(engine, f"{PREAMBLE} {REVIEWS[0]} Next."),
                              params(Readout(cache_only=True)))
        await asyncio.sleep(0.05)  # the guess waits first
        clients = [engine.submit(encode(engine, f"{review} {i}"), SamplingParams(
            max_tokens=1, temperature=0.0)) for i, review in enumerate(REVIEWS * 2)][:10]
        finishes = await asyncio.gather(
            until_finish("guess", guess), until_finish("busy", busy),
            *(until_finish(f"client{i}", c) for i, c in enumerate(clients)))
        assert finishes[0].reason == "cancelled"
        assert all(f.reason == "length" for f in finishes[1:])
        assert order.index("guess") > order.index("client0")
        assert (await settled(engine)).tree.pinned_bytes == 0
    finally:
        engine.shutdown()


async def test_texts_sent_again_are_read_in_one_forward_over_their_own_prefixes(
        counted, llama_reference):
    """Texts of different lengths read one by one (each its own request, as single
    embeddings are): sent again together, every text's prompt but its last token is in
    the tree, a prefix of its own, and all of them are read in one forward, each row over
    its own prefix, reading what its prompt alone reads (they were a forward each, all
    in one engine step)."""
    engine, model = counted
    engine.clear_cache().result(timeout=30)
    texts = [encode(engine, text) for text in ("Short one.", "A somewhat longer text here.",
                                               "Mid length, this.", "x")]
    readout = Readout(top_logprobs=2)
    for text in texts:
        await read(engine, [text], readout)
    model.shapes.clear()
    model.masks.clear()
    again = await read(engine, texts, readout)
    assert model.shapes == [(len(texts), 1)]
    assert model.masks == ["array"]  # prefixes of different lengths: rows left-padded
    for text, (last, finish) in zip(texts, again):
        assert finish.cached_tokens == len(text) - 1
        assert_reads(last, llama_reference, text, readout)
    assert (await settled(engine)).tree.pinned_bytes == 0


async def test_a_list_longer_than_a_forward_is_read_in_batches(counted, llama_reference):
    """Eighty reviews of many lengths behind a cached preamble: several forwards, none
    over what a step reads on the CPU (one prefill chunk, padding included, whether or
    not anything decodes), shortest first, each row read as its prompt alone."""
    engine, model = counted
    reviews = [" ".join(["word"] * (1 + i % 13)) + f" {i}" for i in range(80)]
    prompts, shared = a_list(engine, reviews)
    readout = Readout(top_logprobs=2, cached_prefix=shared)
    await read(engine, prompts[:2], readout)
    model.shapes.clear()
    results = await read(engine, prompts, readout)
    assert len(model.shapes) > 1
    assert all(rows * width <= CHUNK for rows, width in model.shapes)
    assert sum(rows for rows, _ in model.shapes) == len(prompts)
    for prompt, (last, finish) in zip(prompts, results):
        assert finish.cached_tokens == shared
        assert_reads(last, llama_reference, prompt, readout)
    assert (await settled(engine)).tree.pinned_bytes == 0


async def test_lists_on_every_cache_kind_read_what_mlx_lm_reads(engine, reference):
    """On sliding-window and recurrent models (read the general way) as on plain KV: a
    list, then the same list over its now cached preamble. (Those models cache whole-state
    snapshots: the tree once took the state after a whole prompt as the state after its
    preamble, and every later list read from the wrong state.)"""
    prompts, shared = a_list(engine, REVIEWS[:4])
    readout = Readout(top_logprobs=2, token_ids=(3,), cached_prefix=shared)
    for _ in range(2):
        for prompt, (last, finish) in zip(prompts, await read(engine, prompts, readout)):
            assert isinstance(finish, Finish)
            assert_reads(last, reference, prompt, readout)
    assert (await settled(engine)).tree.pinned_bytes == 0
    checked = check_tree_kv(engine, reference.model)
    assert checked.memory + checked.snapshots > 0


async def test_a_failing_prompt_fails_alone(llama_dir, llama_reference):
    """A forward that raises for one prompt of a list read together: that prompt gets the
    error, the others their readings, and nothing stays pinned."""
    engine, prompts, shared, culprit = failing_on_terrible(llama_dir, REVIEWS[:5])
    try:
        assert sum(culprit in prompt[shared:] for prompt in prompts) == 1
        readout = Readout(cached_prefix=shared)
        innocent = [p for p in prompts if culprit not in p[shared:]]
        await read(engine, innocent, readout)  # the preamble is cached now
        for prompt, (last, finish) in zip(prompts, await read(engine, prompts, readout)):
            if culprit in prompt[shared:]:
                assert isinstance(finish, RequestFailed) and last is None
            else:
                assert finish.cached_tokens == shared
                assert_reads(last, llama_reference, prompt, readout)
        stats = await settled(engine)
        assert stats.tree.pinned_bytes == 0 and stats.running == 0
    finally:
        engine.shutdown()


async def test_a_list_the_queue_cannot_take_is_refused_whole(llama_dir):
    """Prompts submitted together are queued together or not at all: a list longer than
    the room left in the queue is refused, and nothing of it stays counted."""
    engine = start_engine(llama_dir, max_queue=8)
    try:
        prompts, shared = a_list(engine, [f"review {i}" for i in range(9)])
        with pytest.raises(QueueFull):
            engine.submit_all(prompts, params(Readout(cached_prefix=shared)))
        assert engine.waiting == 0
        results = await read(engine, prompts[:8], Readout(cached_prefix=shared))
        assert all(isinstance(finish, Finish) for _, finish in results)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("first_load_fails", [False, True])
async def test_a_preamble_on_disk_is_loaded_back_for_a_list(llama_dir, llama_reference,
                                                           tmp_path, first_load_fails):
    """A list's preamble that memory could not keep, left on disk by a server that
    stopped, is loaded back for the next server's first list, which is read together
    over it. Where that load raises, the list computes its preamble again (once), each
    prompt answering as before."""
    for run in range(2):
        # Memory for 16 of the tiny llama's tokens: the 25-token preamble lives on disk.
        engine = start_engine(llama_dir, cache_bytes=16 * 512, disk_cache_dir=str(tmp_path),
                              disk_cache_bytes=1 << 24)
        try:
            assert engine.disk.rebuilt.wait(30)
            failures = [OSError("the disk went away")] if run and first_load_fails else []
            engine.disk.load = failing_first(engine.disk.load, failures)
            prompts, shared = a_list(engine)
            readout = Readout(top_logprobs=2, cached_prefix=shared)
            readings = await read(engine, prompts, readout)
            cached = [finish.cached_tokens for _, finish in readings]
            for prompt, (last, _) in zip(prompts, readings):
                assert_reads(last, llama_reference, prompt, readout)
            if run and first_load_fails:  # one computes the preamble, the others share it
                assert sorted(cached) == [0] + [shared] * (len(prompts) - 1)
            elif run:
                assert cached == [shared] * len(prompts)
                assert engine.stats().disk.loads > 0
            assert not failures
            assert engine.disk.flush(30)
            assert (await settled(engine)).tree.pinned_bytes == 0
        finally:
            engine.shutdown()


TWO_PREAMBLES = [PREAMBLE, PREAMBLE.replace("positive", "happy")]


async def two_lists_on_disk(llama_dir, tmp_path, readout_of) -> tuple[Engine, list, int]:
    """An engine over a disk tier holding two lists' 25-token preambles (one params for
    both: the same length), with memory for 16 tokens, neither preamble in it; and the
    lists and their shared length."""
    for run in range(2):
        # Memory for 16 of the tiny llama's tokens: each preamble lives on disk.
        engine = start_engine(llama_dir, cache_bytes=16 * 512, disk_cache_dir=str(tmp_path),
                              disk_cache_bytes=1 << 24)
        assert engine.disk.rebuilt.wait(30)
        lists = [[encode(engine, preamble) + encode(engine, " " + review)
                  for review in REVIEWS] for preamble in TWO_PREAMBLES]
        shared = len(encode(engine, TWO_PREAMBLES[0]))
        assert shared == len(encode(engine, TWO_PREAMBLES[1])) > 16
        if run == 0:
            for prompts in lists:
                await read(engine, prompts, readout_of(shared))
            assert engine.disk.flush(30)
            engine.shutdown()
    return engine, lists, shared


async def test_lists_whose_preambles_are_loaded_from_disk_together_read_over_them_whole(
        llama_dir, llama_reference, tmp_path):
    """Two lists over two preambles on disk, read in one step, with memory for neither:
    loading the second preamble makes room in memory, and must not take the first, found
    just before, from under its list (its rows read over what is left of it: a sweep saw
    a classify answer from another state). Each prompt reads what it alone reads."""
    engine, lists, shared = await two_lists_on_disk(
        llama_dir, tmp_path, lambda shared: Readout(top_logprobs=2, cached_prefix=shared))
    try:
        readout = Readout(top_logprobs=2, cached_prefix=shared)
        results = await asyncio.gather(*(read(engine, prompts, readout) for prompts in lists))
        for prompts, readings in zip(lists, results):
            for prompt, (last, finish) in zip(prompts, readings):
                assert finish.cached_tokens == shared
                assert_reads(last, llama_reference, prompt, readout)
        assert engine.stats().disk.loads >= 2
        assert (await settled(engine)).tree.pinned_bytes == 0
    finally:
        engine.shutdown()


async def test_a_read_whose_second_prefix_fails_to_load_leaves_nothing_pinned(
        llama_dir, tmp_path):
    """The first list's preamble is found and held, then the second one's load raises
    what nothing expected: the step fails its readouts, and lets go of the first."""
    engine, lists, shared = await two_lists_on_disk(
        llama_dir, tmp_path, lambda shared: Readout(cached_prefix=shared))
    try:
        loads = []
        load = engine.disk.load

        def second_raises(*args: Any) -> Any:
            loads.append(args)
            if len(loads) == 2:
                raise RuntimeError("a bug below the disk tier")
            return load(*args)

        engine.disk.load = second_raises
        await asyncio.gather(*(read(engine, prompts, Readout(cached_prefix=shared))
                               for prompts in lists))
        assert len(loads) >= 2
        assert (await settled(engine)).tree.pinned_bytes == 0
    finally:
        engine.shutdown()


async def test_clearing_the_cache_while_lists_are_read_changes_no_answer(counted,
                                                                         llama_reference):
    """Lists read while the cache is cleared again and again: each reads what its prompts
    alone read, whether its preamble was cached, computed again or cleared under it."""
    engine, _ = counted
    readout = Readout(top_logprobs=2, cached_prefix=None)
    lists = [a_list(engine, [f"{i} {r}" for r in REVIEWS]) for i in range(6)]
    jobs = [read(engine, prompts, Readout(top_logprobs=2, cached_prefix=shared))
            for prompts, shared in lists]

    async def clear() -> None:
        for _ in range(6):
            await asyncio.wrap_future(engine.clear_cache())
            await asyncio.sleep(0)

    *results, _ = await asyncio.gather(*jobs, clear())
    for (prompts, _), readings in zip(lists, results):
        for prompt, (last, finish) in zip(prompts, readings):
            assert isinstance(finish, Finish)
            assert_reads(last, llama_reference, prompt, readout)
    stats = await settled(engine)
    assert stats.tree.pinned_bytes == 0 and stats.waiting == 0 and stats.running == 0


async def test_a_flood_of_lists_starves_no_chat(counted):
    """A prompt submitted right behind thirty lists over a cached preamble is prefilled
    beside them, not after them: it answers before the flood is over."""
    engine, _ = counted
    prompts, shared = a_list(engine)
    readout = Readout(cached_prefix=shared)
    await read(engine, prompts, readout)  # the preamble is cached now
    lists = [engine.submit_all(a_list(engine, [f"{i} {r}" for r in REVIEWS])[0],
                               params(readout)) for i in range(30)]
    chat = engine.submit(encode(engine, "A chat prompt of some sixty tokens. " * 6),
                         SamplingParams(max_tokens=2, temperature=0.0))
    order: list[str] = []

    async def drain(streams, name: str) -> None:
        for stream in streams:
            async for _ in stream:
                pass
        order.append(name)

    await asyncio.gather(drain([chat], "chat"), *(drain(s, "list") for s in lists))
    assert "list" in order[order.index("chat"):]
    assert (await settled(engine)).tree.pinned_bytes == 0


async def test_a_read_holds_no_more_kv_than_the_plan_has_room_for(llama_dir, llama_reference):
    """With room for 400 tokens of running KV, a list's forwards hold at most that many
    positions, the preamble's copy in every row included (each row's own tokens alone
    would have fitted the chunk many times over)."""
    engine, model = counting_engine(llama_dir, cache_bytes=1 << 24, max_tokens_in_flight=400)
    try:
        prompts, shared = a_list(engine, [f"review {i}" for i in range(40)])
        readout = Readout(cached_prefix=shared)
        await read(engine, prompts[:2], readout)
        model.shapes.clear()
        for prompt, (last, _) in zip(prompts, await read(engine, prompts, readout)):
            assert_reads(last, llama_reference, prompt, readout)
        assert sum(rows for rows, _ in model.shapes) == len(prompts)
        assert all(rows * (shared + width) <= 400 for rows, width in model.shapes)
    finally:
        engine.shutdown()
