"""Finding a marker (a tool-call tag, a thinking tag) in text that arrives in pieces."""

from __future__ import annotations


def split_at(buffer: str, marker: str) -> tuple[str, str, bool]:
    """`(released, kept, found)`: if `marker` is in `buffer`, the text before it and the
    text after it; otherwise the text that cannot be part of a marker and the tail that
    might be its beginning, held back until more text arrives."""
    at = buffer.find(marker)
    if at >= 0:
        return buffer[:at], buffer[at + len(marker):], True
    cut = len(buffer) - _marker_prefix_length(buffer, marker)
    return buffer[:cut], buffer[cut:], False


def _marker_prefix_length(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
