"""Ollama's /api/chat and /api/generate requests as `GenerationRequest`s, and the
pipeline's neutral events as Ollama's JSON objects.

A thin adapter, as the other front ends: messages (their base64 images, tool calls and
tool results), tools, `format`, `think` and `options` map onto the internal request;
events come back as Ollama's objects, the answer's text as it is written, each tool call
whole (Ollama's arguments are an object, not JSON text), and a last object with
`done: true`, the reason, the counts and the durations.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from pydantic_core import to_json

from engine.api import SamplingKnobs, TokenEvent
from engine.image_tokens import MARKER
from server.clock import Clock
from server.events import (
    ChoiceFinished,
    Event,
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallStarted,
)
from server.http.errors import APIError
from server.model_registry import Lease
from server.ollama.protocol import (
    ChatChunk,
    ChatRequest,
    Format,
    GenerateChunk,
    GenerateRequest,
    GenerationFields,
    Logprob,
    Message,
    Options,
    OutCall,
    OutMessage,
    Timings,
    TokenLogprob,
)
from server.pipeline import first_that_fits
from server.prompts import assistant_prefill, image_marks
from server.request import (
    TEXT,
    FunctionTool,
    GenerationRequest,
    Infill,
    JsonObjectOutput,
    JsonSchemaOutput,
    OutputFormat,
    TemplateMessage,
    template_arguments,
    template_call,
    thinking_kwargs,
    unset_knobs,
)

# An image's media type by its first bytes: Ollama's clients send bare base64, where the
# other APIs' data: URLs name it.
IMAGE_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"),
                    (b"GIF8", "image/gif"), (b"RIFF", "image/webp"), (b"BM", "image/bmp"))
# Ollama's sampling where a request's options and the model's own defaults (its table's
# `sampling`, as a Modelfile's parameters) say nothing: its clients' users expect its
# answers, not the whole vocabulary at temperature 1 (OpenAI's defaults).
OLLAMA_TEMPERATURE, OLLAMA_TOP_K, OLLAMA_TOP_P = 0.8, 40, 0.9
# The smallest context Ollama's scheduler loads a runner with, whatever num_ctx says.
LEAST_NUM_CTX = 4
# Where an image of a raw prompt goes (N: its index in `images`), as Ollama's runner reads it.
IMAGE_TAG = "[img-{}]"
# The tags Ollama knows a harmony template (gpt-oss's) by (its shouldUseHarmony).
HARMONY_TAGS = ("<|start|>", "<|end|>")


def chat_request(body: ChatRequest) -> GenerationRequest:
    messages: list[TemplateMessage] = []
    images: list[str] = []
    # The history's calls, which tool results answer, with the ids clients sent them with.
    calls: list[tuple[str | None, dict[str, Any]]] = []
    # Continue sends a reply's thinking as a message of its own before the reply's: the
    # assistant message after it gets it as its thinking (Ollama's templates skip a role
    # they do not know; these show a turn's thinking where the model's own template does).
    thinking = ""
    for number, message in enumerate(body.messages):
        if message.role == "thinking":
            thinking += message.content
            continue
        if thinking and message.role == "assistant" and not message.thinking:
            message = message.model_copy(update={"thinking": thinking})
        thinking = ""
        out, message_images = _template_message(message, number, calls)
        messages.append(out)
        images += message_images
    if not messages:  # the engine has no prompt to answer: it was a 500
        raise APIError(400, "messages are only thinking messages, each the thinking of the "
                       "assistant message after it: send the conversation to answer")
    # Ollama's templates leave a final assistant message open: the reply continues it. An
    # empty one is left out, unless it is all there is to render.
    prefilled, chat_end = assistant_prefill(messages)
    return _generation(body, messages=tuple(prefilled or messages), images=tuple(images),
                       chat_end=chat_end,
                       tools=tuple(FunctionTool(tool.function.name, tool.function.description,
                                                tool.function.parameters)
                                   for tool in body.tools or ()))


def generate_request(body: GenerateRequest) -> GenerationRequest:
    for name in ("template", "context"):
        if getattr(body, name):  # "" and [] say nothing
            raise APIError(400, f"{name} is not supported by this server", param=name)
    if body.raw:
        if body.system:
            raise APIError(400, "raw mode does not support system: a raw prompt is the "
                           "model's whole input", param="system")
        # Ollama's raw prompt is the whole input, a suffix's fill-in-the-middle included.
        prompt, images = _raw_images(body.prompt, body.images or [])
        return _generation(body, prompts=(prompt,), images=images)
    if body.suffix:
        # Ollama's insert: the model writes what goes between prompt and suffix; its
        # fill-in-the-middle templates leave the system prompt out.
        if body.images:
            raise APIError(400, "a suffix asks for the code between prompt and suffix, "
                           "which reads no images", param="images")
        return _generation(body, prompts=(body.prompt,), infill=Infill(body.suffix))
    images = [image_url(image, f"images.{i}") for i, image in enumerate(body.images or ())]
    messages = [{"role": "system", "content": body.system}] if body.system else []
    messages.append({"role": "user", "content": MARKER * len(images) + body.prompt})
    return _generation(body, messages=tuple(messages), images=tuple(images))


def _raw_images(prompt: str, images: list[str]) -> tuple[str, tuple[str, ...]]:
    """A raw prompt with its images where their tags are, as Ollama's runner places them:
    the first [img-N] of each image (N: its index), and its images in the order the tags
    come. An image without its tag is a 400: llama-server's count of markers makes it
    one for Ollama."""
    places = []
    for index, image in enumerate(images):
        tag = IMAGE_TAG.format(index)
        if tag not in prompt:
            raise APIError(400, f"images.{index}: a raw prompt places each image where its "
                           f"tag is, and the prompt has no {tag}", param=f"images.{index}")
        places.append((prompt.index(tag), tag, image_url(image, f"images.{index}")))
    for _, tag, _ in places:
        prompt = prompt.replace(tag, MARKER, 1)
    return prompt, tuple(url for _, _, url in sorted(places))


def _generation(body: GenerationFields, **prompt: Any) -> GenerationRequest:
    options = body.options or Options()
    limit = options.num_predict
    return GenerationRequest(
        **prompt,
        output=output_format(body.format),
        sampling=SamplingKnobs(
            temperature=OLLAMA_TEMPERATURE if options.temperature is None
            else options.temperature,
            top_p=OLLAMA_TOP_P if options.top_p is None else options.top_p,
            top_k=OLLAMA_TOP_K if options.top_k is None else options.top_k,
            min_p=options.min_p or 0.0,
            seed=None if options.seed in (None, -1) else options.seed,
            repetition_penalty=options.repeat_penalty,
            repetition_context=options.repeat_last_n,
            presence_penalty=options.presence_penalty,
            frequency_penalty=options.frequency_penalty,
            stop=tuple(options.stop or ()),
        ),
        unset_sampling=unset_knobs(options),
        max_tokens=limit if limit is not None and limit > 0 else None,
        fit_context=True,  # Ollama's num_predict is a cap; none fills the context
        context_window=context_window(options),
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        stream=body.stream,
        include_usage=True,
        chat_template_kwargs=thinking_kwargs(body.think),
    )


def context_window(options: Options | None) -> int | None:
    """num_ctx as the request's own context window (None: the model's), at least the
    smallest one Ollama's scheduler loads a runner with."""
    if options is None or options.num_ctx is None:
        return None
    return max(options.num_ctx, LEAST_NUM_CTX)


async def truncated(lease: Lease, generation: GenerationRequest, options: Options | None
                    ) -> GenerationRequest:
    """A request whose prompt is over its context window (num_ctx, within the model's),
    truncated as Ollama truncates it: a chat without its oldest messages, as few as let
    it fit, its system messages and its last message staying (their images with them);
    then what still does not fit (a long last message, a prompt) cut in its middle
    (`GenerationRequest.keep_tokens`).
    """
    keep = (options or Options()).num_keep
    messages = generation.messages
    if len(messages) > 1:
        starts = range(1, len(messages))
        start = await first_that_fits(lease, starts, lambda start: _from(generation, start))
        generation = _from(generation, starts[-1] if start is None else start)
    return replace(generation, keep_tokens=keep)


def _from(generation: GenerationRequest, start: int) -> GenerationRequest:
    """The chat from its message `start` on, with the system messages before it."""
    messages, images, image = [], [], 0
    for number, message in enumerate(generation.messages):
        count = image_marks(message)
        if number >= start or message["role"] == "system":
            messages.append(message)
            images += generation.images[image:image + count]
        image += count
    return replace(generation, messages=tuple(messages), images=tuple(images))


def output_format(value: Format | None) -> OutputFormat:
    if not value:
        return TEXT
    if value == "json":
        return JsonObjectOutput()
    return JsonSchemaOutput("format", value, strict=True)


def for_template(generation: GenerationRequest, template: str) -> GenerationRequest:
    """`generation` for the model's chat `template`: a harmony one (gpt-oss's) reads a
    reasoning effort of low, medium or high, so "max" is "high" to it, as Ollama maps it."""
    if (generation.chat_template_kwargs.get("reasoning_effort") != "max"
            or not all(tag in template for tag in HARMONY_TAGS)):
        return generation
    return replace(generation, chat_template_kwargs={**generation.chat_template_kwargs,
                                                     "reasoning_effort": "high"})


def _template_message(message: Message, number: int,
                      calls: list[tuple[str | None, dict[str, Any]]]
                      ) -> tuple[TemplateMessage, list[str]]:
    """A message as chat templates take it, and its images as data: URLs (their markers
    open its text, where Ollama puts a message's images). A call in the history gets an
    id of its place, so a conversation renders alike each time it is sent, whether or
    not its client keeps ids; a tool result answers the call its tool_call_id names, else
    the latest call of its tool (or the latest call)."""
    param = f"messages.{number}.images"
    images = [image_url(image, f"{param}.{i}") for i, image in enumerate(message.images or ())]
    out: TemplateMessage = {"role": message.role,
                            "content": MARKER * len(images) + message.content}
    if message.thinking:
        out["reasoning_content"] = message.thinking
    if message.tool_calls:
        out["tool_calls"] = [
            template_call(f"call_{number}_{i}", call.function.name, call.function.arguments)
            for i, call in enumerate(message.tool_calls)]
        calls += zip([call.id for call in message.tool_calls], out["tool_calls"], strict=True)
    if message.role == "tool":
        answered = next((call for sent, call in reversed(calls)
                         if message.tool_call_id and sent == message.tool_call_id), None)
        answered = answered or next((call for _, call in reversed(calls)
                                     if call["function"]["name"] == message.tool_name), None)
        if answered is None and calls:
            answered = calls[-1][1]
        if answered is not None:
            out["tool_call_id"] = answered["id"]
        if message.tool_name:
            out["name"] = message.tool_name
    return out, images


def image_url(image: str, param: str) -> str:
    """An image Ollama's way, bare base64 (or a data: URL, which some clients send), as
    the data: URL the pipeline reads."""
    if image.startswith("data:"):
        return image
    try:
        head = base64.b64decode("".join(image[:64].split())[:32] + "==", validate=False)
    except (binascii.Error, ValueError):
        head = b""
    kind = next((media for signature, media in IMAGE_SIGNATURES if head.startswith(signature)),
                None)
    if kind is None:
        raise APIError(400, f"{param}: not a base64 PNG, JPEG, GIF, WebP or BMP image",
                       param=param)
    return f"data:{kind};base64,{image}"


def created_at() -> str:
    """Now, as Ollama stamps each object (RFC 3339, UTC)."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def timings(clock: Clock, finished: ChoiceFinished) -> Timings:
    """The last object's counts and durations."""
    durations = clock.durations()
    return Timings(
        done_reason="length" if finished.reason == "length" else "stop",
        total_duration=durations.total, load_duration=durations.load,
        prompt_eval_count=finished.usage.prompt_tokens, prompt_eval_duration=durations.prompt,
        eval_count=finished.usage.completion_tokens, eval_duration=durations.generation)


# Stand-ins cut out of a real object's JSON to make the envelope of a text-only line.
STAMP_MARK, TEXT_MARK = "\x00stamp\x00", "\x00text\x00"


class OllamaReply:
    """One reply's events as Ollama's objects: text and thinking as they come, a tool
    call once its arguments are whole, then the last object."""

    def __init__(self, model: str, clock: Clock, chat: bool) -> None:
        self.model, self.clock, self.chat = model, clock, chat
        # The open call: its id, name and arguments.
        self._call: tuple[str, str, list[str]] | None = None
        self._calls = 0
        self._envelope: tuple[str, str, str] | None = None

    def lines(self, event: Event) -> list[str]:
        """`objects(event)` as JSON lines. Answer text without logprobs, the line of almost
        every token, is written into an envelope cut once from a real object: building
        and dumping the models took 11-12 us of the event loop's time a token on the
        2-core CPU, the envelope 4, most of it the timestamp (as
        `server.openai.formats.Format.chunk_json` does for OpenAI's chunks)."""
        if not (isinstance(event, TextDelta) and event.text
                and all(token.logprob is None for token in event.tokens)):
            return [out.model_dump_json(exclude_none=True) for out in self.objects(event)]
        self.clock.token()
        if self._envelope is None:
            marked = self._chunk(content=TEXT_MARK, stamp=STAMP_MARK)
            head, rest = marked.model_dump_json(exclude_none=True).split(
                to_json(STAMP_MARK).decode())
            self._envelope = (head, *rest.split(to_json(TEXT_MARK).decode()))
        head, middle, tail = self._envelope
        return [head + to_json(created_at()).decode() + middle
                + to_json(event.text).decode() + tail]

    def objects(self, event: Event) -> list[ChatChunk | GenerateChunk]:
        self.clock.token()
        if isinstance(event, TextDelta):
            logprobs = _logprobs(event.tokens)
            if not event.text and not logprobs:
                return []
            return [self._chunk(content=event.text, logprobs=logprobs)]
        if isinstance(event, ReasoningDelta):
            return [self._chunk(thinking=event.text)] if event.text else []
        if isinstance(event, ToolCallStarted):
            done = self._close_call()
            self._call = event.id, event.name, []
            return done
        if isinstance(event, ToolCallArguments):
            if self._call is not None:
                self._call[2].append(event.fragment)
            return []
        assert isinstance(event, ChoiceFinished)
        return [*self._close_call(),
                self._chunk(done=True, **timings(self.clock, event).model_dump())]

    def _close_call(self) -> list[ChatChunk | GenerateChunk]:
        if self._call is None:
            return []
        call_id, name, fragments = self._call
        self._call = None
        arguments = template_arguments("".join(fragments) or "{}")
        call = OutCall(id=call_id, function={"index": self._calls, "name": name,
                                 "arguments": arguments if isinstance(arguments, dict) else {}})
        self._calls += 1
        return [self._chunk(tool_calls=[call])]

    def _chunk(self, content: str = "", thinking: str | None = None,
               tool_calls: list[OutCall] | None = None, done: bool = False,
               logprobs: list[Logprob] | None = None, stamp: str | None = None,
               **timings: Any) -> ChatChunk | GenerateChunk:
        stamp = stamp or created_at()
        if self.chat:
            message = OutMessage(content=content, thinking=thinking, tool_calls=tool_calls)
            return ChatChunk(model=self.model, created_at=stamp, message=message,
                             done=done, logprobs=logprobs, **timings)
        return GenerateChunk(model=self.model, created_at=stamp, response=content,
                             thinking=thinking, done=done, logprobs=logprobs, **timings)


def _logprobs(tokens: tuple[TokenEvent, ...]) -> list[Logprob] | None:
    """The answer tokens' logprobs, where the request asked for them (a token whose text
    is still held back comes with the text that shows it, or alone)."""
    listed = [Logprob(token=token.logprob.text, logprob=token.logprob.logprob,
                      bytes=list(token.logprob.bytes),
                      top_logprobs=[TokenLogprob(token=top.text, logprob=top.logprob,
                                                 bytes=list(top.bytes))
                                    for top in token.top_logprobs] or None)
              for token in tokens if token.logprob is not None]
    return listed or None


def whole(objects: list[ChatChunk | GenerateChunk]) -> ChatChunk | GenerateChunk:
    """A reply's objects as the one object a request with `stream: false` gets."""
    logprobs = [logprob for chunk in objects for logprob in chunk.logprobs or ()] or None
    last = objects[-1].model_copy(update={"logprobs": logprobs})
    if isinstance(last, ChatChunk):
        calls = [call for chunk in objects for call in chunk.message.tool_calls or ()]
        message = OutMessage(
            content="".join(chunk.message.content for chunk in objects),
            thinking="".join(chunk.message.thinking or "" for chunk in objects) or None,
            tool_calls=calls or None)
        return last.model_copy(update={"message": message})
    thinking = "".join(chunk.thinking or "" for chunk in objects) or None
    return last.model_copy(update={"response": "".join(chunk.response for chunk in objects),
                                   "thinking": thinking})
