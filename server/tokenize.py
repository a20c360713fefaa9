"""/tokenize and /detokenize, as vLLM's and llama.cpp's servers answer them.

Clients count tokens against a model's context window with them (chat front ends, agent
frameworks trimming a history) and inspect what a text becomes. A chat is rendered by
the model's template exactly as a request's prompt would be, so its count is the
`prompt_tokens` that request reports. One body takes both servers' shapes: vLLM's
`prompt` or `messages` (special tokens added by default, `return_token_strs`), or
llama.cpp's `content` (none added unless `add_special`, `with_pieces`); the detokenized
text is given under both servers' names. An encoder (an embedding model, a cross-encoder)
tokenizes a text too, with its own tokenizer: clients count chunks against its window.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from pydantic import Field, model_validator

from server.http.json_body import AnyTypeJSONRoute
from server.http.openapi import error_responses
from server.openai.adapter import chat_end, content_images, function_tool, template_message
from server.openai.protocol import AnyTool, ChatRequestMessage, ErrorResponse, TokenId
from server.pipeline import render
from server.prompts import check_token_ids
from server.request import GenerationRequest
from server.schema import RequestModel, ResponseModel
from server.state import server_state

router = APIRouter(responses=error_responses(ErrorResponse), route_class=AnyTypeJSONRoute)


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None  # vLLM's text
    content: str | None = None  # llama.cpp's
    messages: list[ChatRequestMessage] | None = Field(None, min_length=1)
    tools: list[AnyTool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    add_special_tokens: bool = True  # vLLM's name and default
    add_special: bool | None = None  # llama.cpp's; unsaid, none are added to its content
    return_token_strs: bool = False  # vLLM's
    with_pieces: bool = False  # llama.cpp's

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        given = [name for name in ("prompt", "content", "messages")
                 if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("send exactly one of prompt, content (text) and messages (a "
                             f"chat), not {' and '.join(given) or 'none'}")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt to be false")
        return self

    @property
    def special_tokens(self) -> bool:
        if self.add_special is not None:
            return self.add_special
        return self.content is None and self.add_special_tokens


class TokenPiece(ResponseModel):
    id: int
    piece: str | list[int]  # llama.cpp's: the bytes of a piece that is no whole character


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int] | list[TokenPiece]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    # Required as vLLM's: a body without them (or none at all, which a route that reads
    # any Content-Type takes as {}) is a mistake, not a request for "".
    tokens: list[TokenId]


class DetokenizeResponse(ResponseModel):
    prompt: str  # vLLM's name
    content: str  # llama.cpp's


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    state = server_state(request)
    async with state.models.use(body.model) as lease:
        model = lease.model
        # An encoder's is loaded on its first use: off the loop.
        tokenizer = await asyncio.to_thread(model.text_tokenizer)
        if body.messages is None:
            text = body.prompt if body.prompt is not None else body.content
            tokens = await asyncio.to_thread(tokenizer.encode, text,
                                             special_tokens=body.special_tokens)
        else:
            tokens = (await render(model, _chat(body)))[0].tokens
            if tokenizer.images is not None:
                # An image's tokens hold its radix key (engine/image_tokens.py), past the
                # vocabulary: the client is given the image token the model reads, as vLLM.
                tokens = tokenizer.images.model_ids(tokens)
        pieces = [tokenizer.token_piece(token) for token in tokens] \
            if body.with_pieces or body.return_token_strs else []
        limit = model.engine.context_length
    return TokenizeResponse(
        count=len(tokens), max_model_len=limit,
        tokens=[TokenPiece(id=token, piece=_llama_piece(*piece))
                for token, piece in zip(tokens, pieces)]
        if body.with_pieces else list(tokens),
        token_strs=[text for text, _ in pieces] if body.return_token_strs else None)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    state = server_state(request)
    async with state.models.use(body.model) as lease:
        tokenizer = await asyncio.to_thread(lease.model.text_tokenizer)
        check_token_ids(body.tokens, tokenizer.vocab_size, "tokens")
        text = tokenizer.decode(body.tokens)
    return DetokenizeResponse(prompt=text, content=text)


def _llama_piece(text: str, data: bytes) -> str | list[int]:
    """A piece as llama.cpp gives it: its text, or where its bytes are not whole UTF-8
    characters (part of an emoji's), those bytes, which its text would show as U+FFFD."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)
    return text


def _chat(body: TokenizeRequest) -> GenerationRequest:
    """The chat as a request's prompt is rendered (images and tools included)."""
    messages = body.messages or []
    return GenerationRequest(
        messages=tuple(template_message(message) for message in messages),
        images=tuple(url for message in messages for url in content_images(message.content)),
        tools=tuple(function_tool(tool) for tool in body.tools or ()),
        chat_template_kwargs=body.chat_template_kwargs or {},
        chat_end=chat_end(messages, body.add_generation_prompt, body.continue_final_message))
