"""The model's tokenizer as its callers see it: encode/decode, the chat template, and the
markers the model writes around tool calls and reasoning.

It wraps mlx-lm's `TokenizerWrapper` (which knows each model family's markers and tool
parser) behind the few operations the server needs, so the server never drives mlx-lm's
wrapper or a Hugging Face tokenizer itself. It imports nothing from MLX or mlx-lm.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# Parses the text between a tool call's markers: (text, tools) -> one call or a list of
# them, each {"name": ..., "arguments": ...}; raises on text it cannot parse.
ToolParser = Callable[[str, Any], Any]


@dataclass(frozen=True)
class ToolCallFormat:
    """How this model writes a tool call: `start` + body + `end`, the body read by `parse`."""

    start: str
    end: str
    parse: ToolParser


@dataclass(frozen=True)
class ThinkingMarkers:
    """The text (and token ids) around this model's reasoning."""

    start: str
    end: str
    start_tokens: tuple[int, ...]
    end_tokens: tuple[int, ...]


class ModelTokenizer:
    def __init__(self, wrapper: Any) -> None:
        """`wrapper`: mlx-lm's TokenizerWrapper for the model."""
        self._wrapper = wrapper
        self.vocab_size: int = len(wrapper)
        """Token ids the tokenizer knows; an id at or past it is not one of the model's."""
        self.eos_token_ids: frozenset[int] = frozenset(wrapper.eos_token_ids)
        self.has_chat_template: bool = bool(wrapper.has_chat_template)
        self.tool_calls: ToolCallFormat | None = None
        if wrapper.has_tool_calling:
            self.tool_calls = ToolCallFormat(wrapper.tool_call_start, wrapper.tool_call_end,
                                             wrapper.tool_parser)
        self.thinking: ThinkingMarkers | None = None
        if wrapper.has_thinking:
            self.thinking = ThinkingMarkers(wrapper.think_start, wrapper.think_end,
                                            tuple(wrapper.think_start_tokens),
                                            tuple(wrapper.think_end_tokens))

        # The Rust tokenizer under a Hugging Face "fast" tokenizer; None for others.
        self.fast: Any = getattr(wrapper, "backend_tokenizer", None)

    def encode(self, text: str, *, special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `special_tokens` adds what the tokenizer adds to a whole
        prompt (e.g. BOS)."""
        return list(self._wrapper.encode(text, add_special_tokens=special_tokens))

    def decode(self, tokens: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._wrapper.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    def chat_prompt(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None,
                    variables: dict[str, Any] | None = None) -> list[int]:
        """The prompt token ids for `messages`, through the model's chat template, ending
        where the assistant's reply starts. `variables` are extra template variables.

        Raises jinja2's TemplateError or ValueError when the template rejects the
        messages (say, roles that do not alternate)."""
        return list(self._wrapper.apply_chat_template(
            messages, **(variables or {}), tools=tools, add_generation_prompt=True,
            tokenize=True))
