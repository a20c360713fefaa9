"""A chat's next turn, prefilled before it arrives.

The next turn of a chat sends the reply back as an assistant message, and the chat
template renders it from its text, which is often not the tokens the model generated:
text encoded again merges differently, Gemma 3's template trims it, Qwen3's drops its
reasoning, tool calls come back in the template's own JSON. The next turn's match then
ends where the reply starts, and its prefill computes the reply again while the client
waits.

So a moment after a chat's reply is done, the conversation is rendered again with the
reply as a client sends it back (its text and tool calls; not its reasoning, which
OpenAI's clients drop) and a turn after it (a user message, or the results its tool
calls ask for), twice, with two different texts in that turn. The tokens both renderings
share are how the next turn begins. Where they go past what the request left in the tree
(its prompt and the generated tokens), they are prefilled in the background,
prefill-only: the next turn finds them cached. This only chooses which tokens to
compute; what is cached is still the state of exactly those tokens, so a wrong guess
costs a prefill, never an answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

from engine.api import EngineError, Finish, ImageFile, Prompt, Readout, SamplingParams
from engine.tokenizer import ModelTokenizer
from radix.prefix import common_prefix_length
from server.events import ChoiceResult
from server.http.errors import APIError
from server.model_registry import ServedModel
from server.prompts import chat_prompt
from server.request import GenerationRequest, TemplateMessage, template_arguments, template_call
from server.state import ServerState

log = logging.getLogger("radix_mlx.server")

# Two texts for the turn after the reply: where their renderings part is where the next
# turn's own text begins.
PROBES = ("0", "1")
# A guess that would compute more than the reply and this many tokens besides is not a
# re-rendered reply (a template that renders earlier turns otherwise once one more
# follows): the next turn would not reuse the prompt either, so nothing is prefilled.
MAX_EXTRA_TOKENS = 64
READOUT = SamplingParams(max_tokens=0, temperature=0.0, readout=Readout(cache_only=True))
# Seconds a guess waits after its reply before computing anything. A guess is for the
# pause a person or a slow tool leaves; a client that sends its next turn at once (an
# agent whose tool answers in milliseconds, a script) has sent it by then, and that turn
# computes these tokens itself, where a guess started at once is a forward the turn waits
# behind. On an H200 (8B shape, 8 chats each sending its next turn as its reply ended),
# guesses started at once put multi-turn TTFT p50 at 0.28-0.43 s, none at 0.21-0.26 s
# (bench/experiments/multi-turn-guesses, bench/experiments/cuda-graphs-prefill).
DELAY_SECONDS = 0.25


def reply_message(reply: ChoiceResult) -> TemplateMessage:
    """The reply as the assistant message a client sends back: OpenAI's shape (null
    content for a reply of only tool calls), arguments as the mapping templates read."""
    calls = [template_call(call.id, call.name, template_arguments(call.arguments))
             for call in reply.tool_calls]
    message: TemplateMessage = {
        "role": "assistant",
        "content": None if calls and not reply.text.strip() else reply.text,
    }
    if calls:
        message["tool_calls"] = calls
    return message


def _turn_after(reply: TemplateMessage, text: str) -> list[TemplateMessage]:
    calls = reply.get("tool_calls") or ()
    if not calls:
        return [{"role": "user", "content": text}]
    return [{"role": "tool", "tool_call_id": call["id"], "content": text} for call in calls]


def next_turn_prompt(tokenizer: ModelTokenizer, request: GenerationRequest,
                     images: Sequence[ImageFile], reply: ChoiceResult,
                     message_ends: bool) -> Prompt:
    """The tokens the chat's next turn will start with: `request` (as rendered, volatile
    lines dropped) followed by `reply` and the start of the turn after it."""
    message = reply_message(reply)
    first, second = (
        chat_prompt(tokenizer, replace(request, messages=(*request.messages, message,
                                                          *_turn_after(message, text)),
                                       chat_end="reply"), message_ends, images)
        for text in PROBES)
    # The last shared token may merge with the turn's own text: a prefill-only request
    # caches all but its last token, so that one is computed and not kept.
    shared = common_prefix_length(first.tokens, second.tokens)
    return Prompt(first.tokens[:shared],
                  tuple(end for end in first.message_ends if end < shared),
                  tuple(image for image in first.images if image.start + image.length < shared))


@dataclass
class NextTurn:
    """What a finished chat reply needs to prefill its next turn: the chat as it was
    rendered, and its prompt."""

    state: ServerState
    model: ServedModel
    request: GenerationRequest
    prompt: Prompt

    def prefill(self, reply: ChoiceResult, generated: Sequence[int]) -> None:
        """Start the prefill in the background, `DELAY_SECONDS` from now (the server
        cancels it if it stops first, or unloads the model), unless it would hold up
        other requests: a model that snapshots its cache at message ends computes each
        prompt in a forward of its own, so with others in flight (this request holds one
        lease) a guess in front of their next prompts costs each a whole step. On an
        H100, 8 image chats at once on Gemma 3 4B's shape waited 1.6 s for their first
        tokens with the guesses, 1.1 s without."""
        if self.model.engine.wants_message_ends and self.model.inflight > 1:
            return
        tasks = self.model.background
        task = asyncio.create_task(self._prefill(reply, list(generated)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _prefill(self, reply: ChoiceResult, generated: list[int]) -> None:
        # A guess holds no lease, waiting or computing: it is not a client's use, so a
        # model whose only work is a guess is idle (an unload, its idle timeout or another
        # model's need for room cancels the guess) and its last use is its last request's.
        # With a lease, a guess ending after another model's request made this model look
        # more recently used than that one, and the wrong one was unloaded to make room.
        await asyncio.sleep(DELAY_SECONDS)
        engine = self.model.engine
        if engine is None:
            return
        try:
            images = [image.file for image in self.prompt.images]
            prompt = await asyncio.to_thread(
                next_turn_prompt, engine.tokenizer, self.request, images, reply,
                engine.wants_message_ends)
            known = common_prefix_length(prompt.tokens, self.prompt.tokens + generated)
            extra = len(prompt.tokens) - 1 - known
            if extra <= 0 or extra > len(generated) + MAX_EXTRA_TOKENS:
                return
            if engine.waiting * 2 >= self.model.settings.max_queue:
                return  # a client's request must not meet a queue this filled
            stream = engine.submit(prompt, READOUT)
            try:
                finish = [event async for event in stream if isinstance(event, Finish)][-1]
            except asyncio.CancelledError:
                stream.cancel()
                raise
            if finish.reason == "cancelled":  # left waiting behind clients' requests
                log.debug("next turn not prefilled: it waited behind other requests")
                return
            # What this prefill computed for the tree to keep: nothing where an earlier
            # one (the same chat sent again) left it there.
            computed = finish.prompt_tokens - 1 - finish.cached_tokens
            self.state.metrics.next_turn_tokens.inc(computed)
            log.debug("next turn: %d tokens prefilled past the reply's %d", computed,
                      len(generated))
        except (APIError, EngineError, ValueError) as error:
            log.debug("next turn not prefilled: %s", error)
