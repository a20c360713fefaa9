"""Prefill-only requests (readouts): what each prompt's last position gives is the model's
own, whichever way the engine computes it.

A list of readouts sharing a prefix (a classify list's instruction) caches that prefix
once, and nothing of each prompt's own part.
"""

from __future__ import annotations

import asyncio

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine.api import Finish, LastPosition, Readout, RequestFailed, SamplingParams
from engine.engine import Engine
from tests.engine.kv_integrity import check_tree_kv
from tests.engine.support import Reference, settled

pytestmark = pytest.mark.asyncio(loop_scope="module")

LOGPROB_TOLERANCE = 1e-4  # float32: a padded batch's forward against one prompt's alone
PREAMBLE = "Classify the sentiment of each review as positive or negative. Review:"
REVIEWS = ["I loved it.", "Terrible, never again.", "Fine, I guess.",
           "Best purchase of the year!", "Broke after a day.", "ok", "Meh."]


def params(readout: Readout) -> SamplingParams:
    return SamplingParams(max_tokens=0, temperature=0.0, readout=readout)


def encode(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, special_tokens=False)


def a_list(engine: Engine, reviews: list[str] = REVIEWS) -> tuple[list[list[int]], int]:
    """The prompts of a classify list and how many first tokens they share."""
    preamble = encode(engine, PREAMBLE)
    return [preamble + encode(engine, " " + review) for review in reviews], len(preamble)


async def read(engine: Engine, prompts: list[list[int]], readout: Readout
               ) -> list[tuple[LastPosition | None, Finish | Exception]]:
    """Submit the prompts as one list (one params object, as a server's job does) and
    return each one's reading and its Finish (or the error it ended with)."""
    shared = params(readout)
    streams = [engine.submit(prompt, shared) for prompt in prompts]

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


async def test_lists_on_every_cache_kind_read_what_mlx_lm_reads(engine, reference):
    """On sliding-window and recurrent models as on plain KV: a
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


