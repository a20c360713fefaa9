"""Requests into prompt token ids: chat through the model's own chat template, legacy
prompts by encoding (or taking token ids as given, after a range check)."""

from __future__ import annotations

import inspect
from collections.abc import Iterable

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from engine.tokenizer import ModelTokenizer
from server import generic_tools as generic
from server.errors import APIError
from server.generation import GenerationRequest

# apply_chat_template's own options, which chat_template_kwargs must not set: they are no
# template variables, and would let a client swap in any template (a Jinja loop of 10^10
# steps froze the event loop), ask for tensors (a 500) or pad its prompt to any length.
TEMPLATE_OPTIONS = frozenset(
    inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
) - {"self", "conversation", "kwargs"}


def check_token_ids(token_ids: Iterable[int], vocab_size: int, param: str) -> None:
    """A token id the model has no embedding for would fail inside the engine."""
    bad = [token for token in token_ids if token >= vocab_size]
    if bad:
        raise APIError(
            400, f"token id {bad[0]} is out of range for a vocabulary of {vocab_size}",
            code="invalid_request", param=param,
        )


def chat_prompt(tokenizer: ModelTokenizer, request: GenerationRequest) -> list[int]:
    """The prompt through the model's chat template; for a template without a tool format,
    tools and tool turns are rewritten first (`server.generic_tools`)."""
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
    messages, tools = list(request.messages), request.offered_tools
    if generic.template_ignores_tools(tokenizer):
        messages, tools = generic.rewrite(request.messages, tools, request.tool_choice), ()
    try:
        prompt = tokenizer.chat_prompt(
            messages, [tool.template_form() for tool in tools] or None, variables
        )
    except (TemplateError, ValueError) as error:
        # Templates reject what they cannot render (e.g. roles that do not alternate).
        raise APIError(
            400, f"the chat template rejected the messages: {error}", code="invalid_request",
            param="messages",
        ) from error
    return prompt


def raw_prompts(tokenizer: ModelTokenizer, request: GenerationRequest) -> list[list[int]]:
    """Legacy completions' prompts: text is encoded, token ids are taken as given."""
    prompts = request.prompts
    if isinstance(prompts[0], str):
        encoded = [tokenizer.encode(prompt) for prompt in prompts]
        if not all(encoded):
            raise APIError(400, "the prompt encodes to no tokens", param="prompt")
        return encoded
    check_token_ids(
        (token for prompt in prompts for token in prompt), tokenizer.vocab_size, "prompt"
    )
    return [list(prompt) for prompt in prompts]
