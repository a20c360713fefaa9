"""`--warm-prompts FILE`: prefill operator-chosen prompts (an agent's system prompt, a
shared few-shot block) at start, so the first real request finds them cached.

The file is JSON Lines, one request body per line, validated like the API's own:
`{"messages": [...]}` renders through the chat template as /v1/chat/completions would,
`{"prompt": "..."}` tokenizes as /v1/completions would. Each runs once, for one token,
after the model is ready and the disk tier has been read back (what is already cached
there is then a hit, not a second computation). A bad line is logged and skipped.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from engine.api import EngineError, Lifecycle, Prompt, SamplingParams
from server.http.errors import APIError
from server.openai.adapter import chat_request, completion_request
from server.openai.protocol import ChatCompletionRequest, CompletionRequest
from server.prompts import chat_prompt, raw_prompts
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
            prompts = await asyncio.to_thread(_prompts, engine.tokenizer, line,
                                              engine.wants_message_ends)
            for prompt in prompts:
                stream = engine.submit(prompt, SamplingParams(max_tokens=1, temperature=0.0))
                async for event in stream:
                    cached += getattr(event, "cached_tokens", 0)
                prefilled += 1
        except (ValueError, APIError, EngineError) as error:  # ValidationError included
            log.warning("warm prompts: %s line %d skipped: %s", path, number, error)
    log.info("warm prompts: %d prefilled from %s (%d tokens were cached already)",
             prefilled, path, cached)


def _prompts(tokenizer, line: str, message_ends: bool) -> list[Prompt]:
    body = json.loads(line)
    if isinstance(body, dict) and "messages" in body:
        request = chat_request(ChatCompletionRequest.model_validate(body))
        return [chat_prompt(tokenizer, request, message_ends)]
    if isinstance(body, dict) and "prompt" in body:
        request = completion_request(CompletionRequest.model_validate(body))
        return raw_prompts(tokenizer, request)
    raise ValueError('each line must be an object with "messages" or "prompt"')
