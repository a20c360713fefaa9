"""Requests into prompt token ids: chat through the model's own chat template, legacy
prompts by encoding (or taking token ids as given, after a range check), or around a
suffix with the model's fill-in-the-middle tokens."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from functools import partial

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from engine.api import ImageFile, Prompt
from engine.fill_in_middle import INFILL_BATCH, infill_prompt
from engine.image_tokens import MARKER, ImageTokens
from engine.tokenizer import ChatEnd, ModelTokenizer
from server import generic_tools as generic
from server.conversation import SYSTEM_ROLES, knows_developer, normalize, renders_late_system
from server.http.errors import APIError
from server.request import GenerationRequest, Infill, TemplateMessage

# apply_chat_template's own options, which chat_template_kwargs must not set: they are no
# template variables, and would let a client swap in any template (a Jinja loop of 10^10
# steps froze the event loop), ask for tensors (a 500) or pad its prompt to any length.
# And `messages`, the name the template sees the conversation by (a 500 when set twice);
# `conversation`, apply_chat_template's name for it, set twice answered with Python's
# TypeError text.
TEMPLATE_OPTIONS = frozenset(
    inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
) - {"self", "kwargs"} | {"messages"}


# How many of a chat's last messages end where the engine may snapshot a whole-state cache
# (engine.api.Prompt), besides the end of its leading system messages (which other
# conversations share): the next turn of the conversation, or a retry of this one, shares
# these.
LAST_MESSAGE_ENDS = 3


def check_token_ids(token_ids: Iterable[int], vocab_size: int, param: str) -> None:
    """A token id the model has no embedding for would fail inside the engine."""
    bad = [token for token in token_ids if token >= vocab_size]
    if bad:
        raise APIError(
            400, f"token id {bad[0]} is out of range for a vocabulary of {vocab_size}",
            code="invalid_request", param=param,
        )


def _image_counts(image_tokens: ImageTokens | None, images: Sequence[ImageFile]
                  ) -> list[int]:
    """How many tokens each image becomes (from its decoded size); a 400 naming the first
    image the model's processor refuses (Qwen's: a side under 1/200 of the other)."""
    counts = []
    for index, image in enumerate(images):
        try:
            counts.append(image_tokens.count(image.size))
        except ValueError as error:
            raise APIError(400, f"image {index + 1}: this model does not take it: {error}",
                           code="invalid_image") from error
    return counts


def chat_prompt(tokenizer: ModelTokenizer, request: GenerationRequest,
                message_ends: bool = False, images: Sequence[ImageFile] = (),
                most_tokens: int | None = None) -> Prompt:
    """The prompt through the model's chat template; for a template without a tool format,
    tools and tool turns are rewritten first (`server.generic_tools`), then runs of one
    role merged and late system messages fitted to the template (`server.conversation`).
    With `message_ends`
    (the engine snapshots there, `Engine.wants_message_ends`), where the system messages
    and the last few messages end: each costs another render (`_heads`). `images`: the
    request's, loaded (`server.images`), each keyed in the prompt on its digest. A prompt
    whose text is too long to hold at most `most_tokens` raises `TooManyTokens` before it
    is encoded (`ModelTokenizer.check_length`)."""
    if not tokenizer.has_chat_template:
        raise APIError(
            400, "this model has no chat template; use /v1/completions", code="invalid_request",
            param="messages",
        )
    variables = request.chat_template_kwargs
    reserved = sorted(TEMPLATE_OPTIONS.intersection(variables))
    if reserved:
        raise APIError(
            400, f"chat_template_kwargs sets template variables only, not {reserved[0]!r}",
            code="invalid_request", param="chat_template_kwargs",
        )
    # Every tool is shown, whatever tool_choice, which agents toggle between requests: the
    # prompt, and so its cached prefix, stays the same ("none" only stops calls).
    messages, tools = list(request.messages), request.tools
    if request.chat_end == "continue" and not (messages[-1].get("content") or "").strip():
        raise APIError(
            400, "continuing the final message needs a final message with text",
            code="invalid_request", param="messages",
        )
    if generic.template_ignores_tools(tokenizer):
        messages, tools = generic.rewrite(request.messages, tools), ()
    messages = normalize(messages, renders_late_system(tokenizer), knows_developer(tokenizer))
    if tokenizer.images is not None and sum(map(image_marks, messages)) != len(images):
        # The front ends put one per image; more is a client that typed the pair, which
        # would take an attached image's place in its text.
        raise APIError(400, "the messages' text holds U+F0000 U+FFFC, the mark of an "
                       "image's place, beside their images", code="invalid_image",
                       param="messages")
    template_tools = [tool.template_form() for tool in tools] or None
    counts = _image_counts(tokenizer.images, images)
    try:
        prompt = tokenizer.chat_prompt(messages, template_tools, variables, request.chat_end,
                                       counts, most_tokens)
    except (TemplateError, ValueError, TypeError) as error:
        # Templates reject what they cannot render (e.g. roles that do not alternate, or
        # a variable of a type the template cannot use).
        raise APIError(
            400, f"the chat template rejected the messages: {error}", code="invalid_request",
            param="messages",
        ) from error
    ends = ()
    if message_ends:
        ends = tokenizer.shared_lengths(prompt, _heads(messages), template_tools, variables,
                                        counts)
    if tokenizer.images is None or not images:
        # A text chat runs as on the language model: an image token the user wrote as
        # text (a coding agent pasting a vision model's code) is one of its tokens.
        return Prompt(prompt, ends)
    return _keyed(tokenizer.images, prompt, images, ends, "messages")


def image_marks(message: TemplateMessage) -> int:
    """How many images `message` places: the `MARKER`s in its text."""
    return str(message.get("content") or "").count(MARKER)


def _keyed(image_tokens: ImageTokens, prompt: list[int], images: Sequence[ImageFile],
           ends: tuple[int, ...], param: str) -> Prompt:
    """`prompt` with its images' tokens keyed on their digests."""
    try:
        keyed, placed = image_tokens.key(prompt, images)
    except ValueError as error:
        raise APIError(400, f"the prompt's image placeholders do not match its images: "
                       f"{error}", code="invalid_image", param=param) from error
    return Prompt(keyed, ends, placed)


def assistant_prefill(messages: list[TemplateMessage]) -> tuple[list[TemplateMessage], ChatEnd]:
    """A chat that ends with an assistant message, as Anthropic's API reads it: the
    message's text is the start of the reply, which continues it; an empty one asks for a
    plain reply and is left out. One that made tool calls is a whole turn, which the reply
    follows: continuing its text would cut its calls out of the prompt."""
    last = messages[-1] if messages else {}
    if last.get("role") != "assistant" or last.get("tool_calls"):
        return messages, "reply"
    if (last.get("content") or "").strip():
        return messages, "continue"
    return messages[:-1], "reply"


def _heads(messages: list[TemplateMessage]) -> list[list[TemplateMessage]]:
    """The first messages of a chat that end where the engine may snapshot: the leading
    system messages, followed by an empty user message (as mlx-lm's server finds them:
    templates that want a user message, or fold the system prompt into the first user
    turn, then render it as in the chat, up to where the user's text starts), and the
    chat up to each of its last `LAST_MESSAGE_ENDS` messages."""
    system = next((i for i, message in enumerate(messages)
                   if message.get("role") not in SYSTEM_ROLES), len(messages))
    heads = [[*messages[:system], {"role": "user", "content": ""}]] if system else []
    first = max(system + 1, len(messages) - LAST_MESSAGE_ENDS + 1)
    return heads + [messages[:count] for count in range(first, len(messages) + 1)]


def raw_prompts(tokenizer: ModelTokenizer, request: GenerationRequest, token_limit: int,
                images: Sequence[ImageFile] = (), most_tokens: int | None = None
                ) -> list[Prompt]:
    """Legacy completions' prompts: text is encoded, token ids are taken as given (no
    message ends: they are no chat). An infill that fits (llama.cpp's) is cut to leave
    its reply room in `token_limit`, the request's context window. `images`: the loaded
    images of a one-text prompt (Ollama's raw one), placed where its markers are. A text
    too long to hold at most `most_tokens` raises `TooManyTokens` before it is encoded."""
    prompts = request.prompts
    for prompt in prompts if request.infill is None else ():
        if isinstance(prompt, str):
            tokenizer.check_length(prompt, most_tokens)
    if images:
        [text] = prompts
        assert isinstance(text, str) and tokenizer.images is not None
        expanded = tokenizer.images.expand(text, _image_counts(tokenizer.images, images))
        return [_keyed(tokenizer.images, tokenizer.encode(expanded), images, (), "prompt")]
    if request.infill is not None:
        fit = None
        if request.infill.fit:
            reply = INFILL_BATCH if request.max_tokens is None else request.max_tokens
            fit = max(0, token_limit - min(reply, token_limit // 2))
        return [Prompt(_infill(tokenizer, prefix, request.infill, fit)) for prefix in prompts]
    if isinstance(prompts[0], str):
        encoded = [tokenizer.encode(prompt) for prompt in prompts]
        if not all(encoded):
            raise APIError(400, "the prompt encodes to no tokens", param="prompt")
        return [Prompt(tokens) for tokens in encoded]
    check_token_ids(
        (token for prompt in prompts for token in prompt), tokenizer.vocab_size, "prompt"
    )
    return [Prompt(list(prompt)) for prompt in prompts]


def _infill(tokenizer: ModelTokenizer, prefix: str, infill: Infill, fit: int | None
            ) -> list[int]:
    """The prompt for the middle between `prefix` and the infill's suffix."""
    tokens = tokenizer.fill_in_middle
    if tokens is None:
        raise APIError(400, "this model has no fill-in-the-middle tokens, so it does not "
                       "support insert: send the prompt without a suffix",
                       code="invalid_request", param=infill.param)
    return infill_prompt(tokens, partial(tokenizer.encode, special_tokens=False), prefix,
                         infill.suffix, infill.files, tokenizer.prompt_head, fit)

