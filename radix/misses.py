"""Why a prompt's first uncached token was not cached: what agent users ask of every
prefix cache, and what no server tells them.

A request reuses its prompt up to some position; `explain` says why the token there was
not reused too, from the tree as the request found it and from a bounded record of the
paths the tree let go of (`Departures`): nothing there ever (`NOT_SEEN`), a cached branch
that continues differently (`DIVERGED`: a volatile header, a date, a reordered tool
list), the branch was evicted from memory or from disk or cleared, its disk copy could not
be read, the tokens are there but hold no state a request can start from (`NO_SNAPSHOT`,
models whose caches are whole-state snapshots), another request is computing them
(`IN_FLIGHT`), they were cached in memory only when the model was last stopped
(`RELOADED`), or there is no cache to hold them (`CACHE_OFF`: a budget of no token and
no disk tier). With a disk tier the record outlives the process, kept in its folder.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass

# Paths let go of that are remembered; older ones are forgotten (a miss there then says
# NOT_SEEN). An entry is a hash and a reason: ~100 bytes.
DEPARTURES = 16384
# Tokens of the cached branch a DIVERGED miss reports.
BRANCH_TOKENS = 16


class MissReason(str, enum.Enum):
    NOT_SEEN = "not_seen"
    DIVERGED = "diverged"
    EVICTED_MEMORY = "evicted_from_memory"
    EVICTED_DISK = "evicted_from_disk"
    CLEARED = "cleared"
    UNREADABLE = "disk_copy_unreadable"
    NO_SNAPSHOT = "no_snapshot"
    IN_FLIGHT = "in_flight"
    RELOADED = "model_reloaded"
    CACHE_OFF = "cache_off"


@dataclass(frozen=True)
class Miss:
    """The first prompt position a request did not reuse, and why. `branch` is what the
    cache holds at that position instead (DIVERGED): its first tokens."""

    position: int
    reason: MissReason
    branch: tuple[int, ...] = ()


class Departures:
    """The paths whose cached state the tree let go of, each keyed by its tokens up to
    and including the first one it held, with the reason; bounded, oldest forgotten."""

    def __init__(self, capacity: int = DEPARTURES) -> None:
        self.capacity = capacity
        self._reasons: collections.OrderedDict[int, MissReason] = collections.OrderedDict()

    def record(self, path: tuple[int, ...], reason: MissReason) -> None:
        key = hash(path)
        self._reasons.pop(key, None)
        self._reasons[key] = reason
        if len(self._reasons) > self.capacity:
            self._reasons.popitem(last=False)

    def reason(self, path: tuple[int, ...]) -> MissReason | None:
        return self._reasons.get(hash(path))

    def forget(self) -> None:
        self._reasons.clear()

    def entries(self) -> list[tuple[int, str]]:
        """The record, oldest first, to keep across a restart (a tuple of ints hashes
        alike in every process)."""
        return [(key, reason.value) for key, reason in self._reasons.items()]

    def extend(self, entries: list[tuple[int, str]]) -> None:
        """Take back what `entries` gave (entries that make no sense are skipped)."""
        for key, reason in entries:
            if isinstance(key, int) and reason in MissReason._value2member_map_:
                self._reasons[key] = MissReason(reason)
        while len(self._reasons) > self.capacity:
            self._reasons.popitem(last=False)
