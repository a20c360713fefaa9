"""Stats that describe themselves: a dataclass field made with `stat` carries its metric
kind and help text, so whoever exports the dataclass (the server's /metrics) walks its
fields instead of keeping a second list that must follow every new counter."""

from __future__ import annotations

from dataclasses import field
from typing import Any, Literal

MetricKind = Literal["counter", "gauge"]


def stat(kind: MetricKind, help_text: str, *, name: str | None = None,
         default: float = 0) -> Any:
    """A numeric dataclass field exported as metric `name` (default: the field's name)."""
    return field(default=default, metadata={"kind": kind, "help": help_text, "name": name})
