"""Thinking text out of generated text, so it never reaches the answer.

Reasoning models write their thinking between markers (`<think>`/`</think>` for Qwen3
and the DeepSeek-R1 distills; mlx-lm's `TokenizerWrapper` knows each family's). Some
templates open the block in the prompt already (the generation prompt ends with
`<think>\n`), so a choice may start inside it.
"""

from __future__ import annotations

from server.markers import split_at


class ReasoningSplitter:
    """Splits one choice's text into (reasoning, answer) pieces."""

    def __init__(self, start: str, end: str, inside: bool) -> None:
        self._start, self._end = start, end
        self.inside = inside
        self._buffer = ""
        # The blank lines models put after the end marker belong to neither part.
        self._strip_answer = False

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the answer text that `text` completes."""
        self._buffer += text
        reasoning, answer = [], []
        while True:
            released, self._buffer, found = split_at(
                self._buffer, self._end if self.inside else self._start
            )
            if self.inside:
                reasoning.append(released)
            else:
                answer.append(self._answer(released))
            if not found:
                return "".join(reasoning), "".join(answer)
            self.inside = not self.inside
            self._strip_answer = not self.inside

    def close(self) -> tuple[str, str]:
        rest, self._buffer = self._buffer, ""
        return (rest, "") if self.inside else ("", self._answer(rest))

    def _answer(self, text: str) -> str:
        if self._strip_answer:
            text = text.lstrip()
            self._strip_answer = not text
        return text
