"""Who joins the running batch next: the admission policy, apart from its mechanics.

Cache-aware order (SGLang's): the longest cached prefix first, so shared prefixes are
reused while they are still in the tree; a request passed over in `MAX_PASSED_OVER`
rounds goes first, oldest first, so none starves; background work (a chat's next turn,
prefilled only to be cached) after every request a client waits on. Limits: batch rows,
prompts being prefilled at once, and the KV the batch may come to hold
(`tokens_reserved`). After a failed step, suspects run one at a time (quarantine) so the
request that breaks a forward pass is found and fails alone.

Fair across requests, not generations (vLLM schedules a request's n samples as one
group): a client request's n choices, or its list of prompts, are generations of one
`owner`, and take free rows in turns with other requests, the fewest rows held first,
then by cache. A request is passed over only in rounds that started none of its own, and
starving, only its oldest generation goes first. Counted per generation, the choices
passed over each other, all starved, and went first one after another: 32 choices of
1,000 tokens in a 4-row batch kept an 8-token chat sent a second later waiting 27 s, for
the last of them (tiny model, 2-core CPU); now 2.2 s, for the first free row.

Rows are shared too: a client request that holds no row, and finds the batch (or its KV
room) full, takes one from the request that holds the most, if that one holds at least
two (`rows_to_free`): the newest of its decoding generations is preempted (its KV goes to
the tree, and it comes back for it once a row is free). Waiting for a free row instead,
a chat sent 5 s into an n=128, max_tokens=8000 request waited 70 s for the first of those
choices to end (tiny model, 2-core CPU). A request is never left without a row this way,
and one that holds a row never takes another's, so nothing is preempted back and forth:
among requests of one row each, a newcomer waits its turn as in any queue. For the same
reason only a request that holds no row can be starving.

A request is counted at its prompt plus what it may add, but at most `output_reserve`
tokens of its `max_tokens` ahead (SGLang clips its estimate the same way, at 4,096):
a client that sets no limit (Ollama's, the Responses and Messages APIs') may add the
whole context window, and reserving all of it let one such request on a 128k-token model
hold every row of the KV room while it wrote a few hundred tokens. What a generation
has written past its reserve is counted as it grows; when the batch's KV would outgrow
`max_tokens_in_flight`, the scheduler preempts the newest (`Scheduler._make_room`).

Short prompts (at most `SHORT_PROMPT_TOKENS` not cached) are left out of the prefill
window: the generator computes those at the front of its queue together, in one forward
(a classification job: a list of 64 one-line sentences behind a cached instruction), so
they do not hold a long prompt back for more than that forward, and counting them would
split such a list into forwards of `prefill_batch_size`: on an H100 every forward and
every step costs milliseconds of host time whatever its size.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from engine.generation import Generation

# After being passed over this many admission rounds a request goes first (no starvation).
MAX_PASSED_OVER = 8
# A prompt with at most this many tokens to compute is short (see above).
SHORT_PROMPT_TOKENS = 32
# The most of a request's max_tokens its admission counts ahead (see above).
OUTPUT_RESERVE = 4096


@dataclass
class SchedulerLimits:
    max_batch_size: int
    prefill_batch_size: int
    prefill_chunk_tokens: int | None  # None: the device's default
    prefill_stall_ratio: float | None  # see prefill_budget.py; None: the device default
    prefill_stall_floor: float  # seconds
    max_tokens_in_flight: int
    cache_bytes: int
    output_reserve: int = OUTPUT_RESERVE


def admit(waiting: list[Generation], running: Collection[Generation],
          limits: SchedulerLimits, cached_length: Callable[[Generation], int],
          start: Callable[[Generation], bool]) -> None:
    """Take requests off `waiting` and `start` them, in policy order, while the limits
    allow; `start` returns whether one joined the batch (it may wait for a shared prefix
    instead), and `running` (a live view) grows with each that did."""
    if any(g.suspect for g in (*waiting, *running)):
        suspects = [g for g in waiting if g.suspect]
        # The last suspect too runs alone: a newcomer beside it could fail it.
        if suspects and not running:
            waiting.remove(suspects[0])
            start(suspects[0])
        return
    rows = limits.max_batch_size - len(running)
    if rows <= 0:
        # Before matching every waiting prompt against the tree: under overload the batch
        # is full at most steps, and 192 waiting 2,000-token prompts took 4-6 ms a step to
        # match on the 2-core CPU, host time every step of a loaded GPU server pays.
        return
    window = _window(limits, running)
    room = token_room(limits, running)
    cached = {g: cached_length(g) for g in waiting}
    served: set[str] = set()  # the requests that had a generation start this round
    starving = _starving(waiting, running)
    for generation in _order(waiting, running, cached, starving):
        if rows <= 0:
            break
        short = len(generation.tokens) - cached[generation] <= SHORT_PROMPT_TOKENS
        if not short and window <= 0:
            continue
        # A request bigger than the whole limit still runs, alone.
        reserved = tokens_reserved(generation, limits)
        if reserved > room and running:
            if generation in starving:
                break  # admit nobody past it, so the batch drains until it fits
            continue
        waiting.remove(generation)
        if start(generation):
            served.add(generation.owner)
            rows -= 1
            window -= not short
            room -= reserved
    if served:
        for generation in waiting:
            # Served, a starving request's other choices no longer go first, one by one.
            generation.passed_over = (0 if generation.owner in served
                                      else generation.passed_over + 1)


def rows_to_free(waiting: list[Generation], running: Collection[Generation],
                 limits: SchedulerLimits, cached_length: Callable[[Generation], int]
                 ) -> list[Generation]:
    """The running generations to preempt so that the first client request in `waiting`
    holding no row gets one (see above): from the request holding the most rows, its
    newest decoding generations first, only while it keeps one, and only as many as the
    newcomer needs; none where it would get a row anyway, or could not even then (the
    prefill window full for its prompt, or too little room freed)."""
    if not waiting or any(g.suspect for g in (*waiting, *running)):
        return []  # nobody waits (most steps), or suspects run alone
    holders = Counter(g.owner for g in running)
    newcomer = next((g for g in waiting if not g.background and not holders[g.owner]), None)
    if newcomer is None or max(holders.values(), default=0) < 2:
        return []
    rows = limits.max_batch_size - len(running)
    room = token_room(limits, running)
    needed = tokens_reserved(newcomer, limits)
    if rows > 0 and needed <= room:
        return []
    short = len(newcomer.tokens) - cached_length(newcomer) <= SHORT_PROMPT_TOKENS
    if not short and _window(limits, running) <= 0:
        return []
    donors = [g for g in running if not g.background and g.prompt_done
              and g.params.readout is None]
    chosen: list[Generation] = []
    while rows <= 0 or needed > room:
        owners = {g.owner for g in donors if holders[g.owner] >= 2}
        if not owners:
            return []
        owner = max(owners, key=lambda o: (holders[o], o))
        generation = [g for g in donors if g.owner == owner][-1]
        donors.remove(generation)
        chosen.append(generation)
        holders[owner] -= 1
        rows += 1
        room += tokens_reserved(generation, limits)
    return chosen


def _window(limits: SchedulerLimits, running: Iterable[Generation]) -> int:
    """How many more long prompts may be prefilled beside the running ones."""
    return limits.prefill_batch_size - sum(
        not g.prompt_done and len(g.tokens) - g.hold.depth > SHORT_PROMPT_TOKENS
        for g in running)


def token_room(limits: SchedulerLimits, running: Iterable[Generation]) -> int:
    """Tokens of KV the running requests leave of `max_tokens_in_flight`."""
    return limits.max_tokens_in_flight - sum(tokens_reserved(g, limits) for g in running)


def tokens_reserved(generation: Generation, limits: SchedulerLimits) -> int:
    """The KV admission counts `generation` for: its prompt and what it may add, at most
    `output_reserve` ahead, or all it has written where that is more."""
    ahead = max(limits.output_reserve, len(generation.generated) + 1)
    return len(generation.prompt) + min(generation.params.max_tokens, ahead)


def tokens_held(generation: Generation) -> int:
    """The KV `generation` holds after its next step: its prompt, what it wrote, and
    the token that step feeds."""
    return len(generation.prompt) + len(generation.generated) + 1


def _starving(waiting: list[Generation], running: Collection[Generation]
              ) -> list[Generation]:
    """The oldest waiting generation of each client request passed over for long that
    holds no row (one that holds a row is being served)."""
    holding = {g.owner for g in running}
    starving: dict[str, Generation] = {}
    for generation in waiting:
        if (not generation.background and generation.passed_over >= MAX_PASSED_OVER
                and generation.owner not in holding):
            starving.setdefault(generation.owner, generation)
    return list(starving.values())


def _order(waiting: list[Generation], running: Collection[Generation],
           cached: dict[Generation, int], first: list[Generation]) -> list[Generation]:
    """`first` (the starving, see `_starving`), then the rest in turns: each
    request's k-th generation after the rows it holds, those of a turn by cached prefix;
    then background work (a chat's next turn, prefilled to be cached): its prefix is the
    longest of all (the chat and its reply), and it went first, ahead of the clients of
    other chats that ended with it. Background work passed over costs a guess, never an
    answer: it never goes first (the scheduler drops it once stale)."""
    clients = [g for g in waiting if not g.background]
    held = Counter(g.owner for g in (*running, *first))
    turn: dict[Generation, int] = {}
    others = (g for g in clients if g not in first)
    for generation in sorted(others, key=lambda g: -cached[g]):
        turn[generation] = held[generation.owner]
        held[generation.owner] += 1
    rest = sorted(turn, key=turn.__getitem__)  # stable: by cached prefix within a turn
    background = sorted((g for g in waiting if g.background), key=lambda g: -cached[g])
    return [*first, *rest, *background]
