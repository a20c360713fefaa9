"""Helpers for engine tests: a reference generator and small async drivers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

from engine.api import (
    EngineConfig,
    EngineStats,
    Finish,
    Prompt,
    SamplingParams,
    TokenEvent,
)
from engine.engine import Engine
from engine.speculation import STEP_COST
from engine.streams import RequestStream


@dataclass
class Completion:
    tokens: list[int]
    text: str
    finish: Finish
    events: list[TokenEvent]


class Reference:
    """mlx-lm's own single-sequence greedy generation, the ground truth."""

    def __init__(self, path: str) -> None:
        self.model, self.tokenizer = load(path)

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        tokens = []
        for token in self.greedy_ignoring_eos(prompt, max_tokens):
            if token in self.tokenizer.eos_token_ids:
                break
            tokens.append(token)
        return tokens

    def greedy_ignoring_eos(self, prompt: list[int], max_tokens: int) -> list[int]:
        return [token for token, _ in
                generate_step(mx.array(prompt), self.model, max_tokens=max_tokens)]


async def complete(engine: Engine, prompt: list[int] | Prompt, max_tokens: int = 16,
                   **options) -> Completion:
    options.setdefault("temperature", 0.0)
    stream = engine.submit(prompt, SamplingParams(max_tokens=max_tokens, **options))
    events: list[TokenEvent] = []
    async for event in stream:
        if isinstance(event, Finish):
            text = "".join(e.text for e in events) + event.text
            return Completion([e.token for e in events], text, event, events)
        events.append(event)
    raise AssertionError("stream ended without a Finish")


async def cancel_after(stream: RequestStream, tokens: int) -> Finish:
    """Read `stream`, cancel it once `tokens` tokens have come, and return its Finish."""
    seen = 0
    async for event in stream:
        if isinstance(event, TokenEvent):
            seen += 1
            if seen == tokens:
                stream.cancel()
    return event


def idle(stats: EngineStats) -> bool:
    """Nothing runs, waits or holds a pin: an ended request's KV is in the tree (its
    stream ends a step before its KV is copied there, scheduler.py)."""
    return (stats.running, stats.background, stats.waiting, stats.tree.pinned_bytes) == (
        0, 0, 0, 0)


async def settled(engine: Engine, timeout: float = 10.0) -> EngineStats:
    """Stats once nothing runs or waits: cancellations are processed asynchronously."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        stats = engine.stats()
        if idle(stats):
            return stats
        if asyncio.get_running_loop().time() > deadline:
            return stats
        await asyncio.sleep(0.02)


def start_engine(path: str, **config) -> Engine:
    engine = Engine(EngineConfig(model=path, **config))
    engine.start()
    assert engine.wait_ready(120) == "ready", engine.error
    return engine


def as_on_a_gpu(init):
    """`Generator.__init__`, then the steps a GPU's generator takes: decode pipelined
    (a look drafts past the token still being computed), every verify as wide as the
    longest draft allowed, the GPU's step costs."""
    def init_as_on_a_gpu(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.pipelined, self.step_cost = True, STEP_COST["gpu"]
    return init_as_on_a_gpu
