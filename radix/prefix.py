"""How many leading tokens two runs share: the comparison under every match and walk."""

from __future__ import annotations

from collections.abc import Sequence

# Where a common prefix ends inside a long run, tokens are compared this many at a time
# at C speed up to the slice that differs, then one by one. Measured with
# `python -m bench.prefix_bench` (8k-32k tokens, differing at 10, 1000 or 3/4 of the way):
# as fast as comparing one by one where the prefix ends early, up to 1.9x faster where it
# ends late, and 1.3-7x faster than bisecting on slice comparisons (which copies a slice
# per step); the same as both on a whole match.
PREFIX_CHUNK = 64


def common_prefix_length(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """Length of the common prefix of `a` and `b[start:]` (both lists or both tuples).
    A whole match, the common case on a cache hit, is one C-speed comparison."""
    n = min(len(a), len(b) - start)
    if a[:n] == b[start : start + n]:
        return n
    i = 0  # a[:n] differs from b[start:start + n], so both loops stop before n
    while a[i : i + PREFIX_CHUNK] == b[start + i : start + i + PREFIX_CHUNK]:
        i += PREFIX_CHUNK
    while a[i] == b[start + i]:
        i += 1
    return i
