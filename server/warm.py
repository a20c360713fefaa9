"""`--warm-prompts FILE`: prefill operator-chosen prompts (an agent's system prompt, a
shared few-shot block) at start, so the first real request finds them cached.

The file is JSON Lines, one request body per line, validated like the API's own:
`{"messages": [...]}` renders through the chat template as /v1/chat/completions would
(its images loaded), `{"prompt": "..."}` tokenizes as /v1/completions would. Each runs
once, for one token, after the model is ready and the disk tier has been read back (what
is already cached there is then a hit, not a second computation). A bad line is logged
and skipped.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from engine.api import EngineError, Lifecycle, Prompt, SamplingParams
from server.http.errors import APIError
from server.model_registry import ServedModel
from server.openai.adapter import chat_request, completion_request
from server.openai.protocol import ChatCompletionRequest, CompletionRequest
from server.pipeline import render
from server.state import ServerState

log = logging.getLogger("radix_mlx.server")

POLL_SECONDS = 0.2


async def prefill_warm_prompts(state: ServerState, path: Path) -> None:
    """Into the first model, once it is loaded."""
    model = state.models.default
    while model.engine is None or model.engine.state in (Lifecycle.LOADING,
                                                         Lifecycle.WARMING_UP):
        await asyncio.sleep(POLL_SECONDS)
    engine = model.engine
    if engine.state is not Lifecycle.READY:
        return
    if engine.disk is not None:
        await asyncio.to_thread(engine.disk.rebuilt.wait)
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        log.error("warm prompts: cannot read %s: %s", path, error)
        return
    prefilled = cached = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            prompts = await _prompts(model, line)
            for prompt in prompts:
                stream = engine.submit(prompt, SamplingParams(max_tokens=1, temperature=0.0))
                async for event in stream:
                    cached += getattr(event, "cached_tokens", 0)
                prefilled += 1
        except (ValueError, APIError, EngineError) as error:  # ValidationError included
            log.warning("warm prompts: %s line %d skipped: %s", path, number, error)
    log.info("warm prompts: %d prefilled from %s (%d tokens were cached already)",
             prefilled, path, cached)


async def _prompts(model: ServedModel, line: str) -> list[Prompt]:
    """The line's prompts rendered as its request's are (server/pipeline.py): a chat's
    images loaded, the model's template variables and volatile system lines applied, or
    the first real request would find only part of it cached."""
    body = json.loads(line)
    if isinstance(body, dict) and "messages" in body:
        return await render(model, chat_request(ChatCompletionRequest.model_validate(body)))
    if isinstance(body, dict) and "prompt" in body:
        return await render(model, completion_request(CompletionRequest.model_validate(body)))
    raise ValueError('each line must be an object with "messages" or "prompt"')
