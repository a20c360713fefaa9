"""Draft tokens for speculative decoding, and when a sequence is worth drafting for.

A draft is a guess at a sequence's next tokens that costs no model: the generator feeds
the sequence's last token and its draft in one forward, keeps the longest prefix of the
draft the model agrees with (generator.py, `Generator._verify`), and rolls the rest back.
Coding agents re-emit text they have seen (file contents, diffs, tool arguments), so two
free sources guess well:

- prompt lookup (llama.cpp's `--lookup`, vLLM's n-gram proposer): the longest recent
  n-gram of the context (prompt and output) that occurred before, and what followed it;
- the radix tree: what followed this exact context in an earlier request, prompt or
  output (`RadixTree.continuation`). No peer drafts from its prefix cache.

A request may bring its own: OpenAI's Predicted Outputs (`prediction`), the text the
client expects back, say a file it asked to have edited (`PredictionLookup`), tried first.

A draft model (engine/draft_model.py), where the server has one, is a third source that
costs its own forwards.

A verify step costs more than a decode step: on a GPU, where a step reads the weights
either way, mostly because it is synchronous (what it keeps decides the next step, so the
host no longer builds one step while the device runs the last); on the CPU in compute
(SmolLM2-135M on 2 cores, 600 cached tokens: 9 positions took 2.4-3x one), and for a
whole batch (16 streams verifying 8-token drafts computed 144 positions, and on the CPU
ran 3x slower than decoding); `StepCost` says how much. So a
draft is as long as recent ones earned (Hugging Face's heuristic: 2 more after a draft
kept whole, 1 less after one cut short); in `auto` mode a step verifies only drafts whose
expected tokens pay for the forward's cost (`best_width`), and a sequence stops drafting
while its drafts are mostly rejected, so traffic that does not repeat does not pay for
guesses (`Drafts.wants_draft`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.api import DraftSource, SpeculationMode

# n-gram sizes prompt lookup tries, longest first: a longer match is a better guess (a
# file of similar functions repeats its short n-grams in every one: a copy of a 1.2k-token
# file, replayed through the lookup, kept 64% of 8-token drafts with (4, 3, 2) and all of
# them with these), and a 2-gram still finds the next line of a file being copied.
NGRAM_SIZES = (12, 8, 4, 2)
# `auto`: the running mean of accepted tokens per draft chance (a step where the sequence
# looked for one) below which drafting pauses, how fast it moves, and how many chances a
# pause skips (doubling while drafts keep failing, up to the most).
MIN_ACCEPTED = 0.6
EMA_WEIGHT = 0.3
FIRST_PAUSE = 4
MAX_PAUSE = 64
FIRST_LENGTH = 4  # a sequence's first drafts, at most
# The chance a draft token is kept given those before it were, estimated from recent
# verifies as kept / (kept + verifies cut short): copying keeps long runs and breaks off
# now and then, which the share of draft tokens kept would undercount. Counts decay by
# this much a verify; before any, as if 7 had been kept and 3 drafts cut short.
RATE_MEMORY = 0.8
FIRST_KEPT, FIRST_CUT = 0.7, 0.3


@dataclass(frozen=True)
class StepCost:
    """What an engine step costs, in one-row decode steps: `fixed` + `per_row` x rows +
    `per_position` x positions computed, plus `verify` for a verify step, whose tokens
    must be read before the next step is built (on a GPU a decode step is queued while
    the last one runs, so a verify also loses that overlap)."""

    fixed: float
    per_row: float
    per_position: float
    verify: float

    def decode(self, rows: int) -> float:
        return self.fixed + (self.per_row + self.per_position) * rows

    def verified(self, rows: int, positions: int) -> float:
        return self.fixed + self.per_row * rows + self.per_position * positions + self.verify


# CPU: SmolLM2-135M on 2 cores (1 position 1, 9 positions 2.4-3, 16 rows 5.6): compute.
# GPU: SmolLM2-135M in bfloat16 on an H200 (bench/experiments/speculation-engine), 1.4k
# tokens of context: one row decodes in 4.7 ms, 16 rows in 13.5; one row verifying 8
# drafted tokens costs 2.4 of its decode steps, 16 rows 28-39 ms. So rows cost more than
# their positions (each reads its own KV) and a verify's lost overlap costs a step.
STEP_COST = {"cpu": StepCost(fixed=0.8, per_row=0.0, per_position=0.2, verify=0.0),
             "gpu": StepCost(fixed=0.87, per_row=0.104, per_position=0.0225, verify=1.22)}

Continuation = Callable[[list[int], int], list[int]]


class PromptLookup:
    """An index of a sequence's n-grams to where each last ended, grown as tokens come."""

    def __init__(self) -> None:
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in `_ends`

    def draft(self, context: list[int], limit: int) -> list[int]:
        """What followed the most recent earlier occurrence of the context's longest
        suffix n-gram, at most `limit` tokens."""
        end = len(context)
        for position in range(self._indexed + 1, end):  # every n-gram but the suffix
            for n in NGRAM_SIZES:
                if position >= n:
                    self._ends[tuple(context[position - n:position])] = position
        self._indexed = max(self._indexed, end - 1)
        for n in NGRAM_SIZES:
            if end > n and (found := self._ends.get(tuple(context[end - n:]))) is not None:
                return context[found:found + limit]
        return []


class PredictionLookup:
    """Drafts from the text a client expects the output to be: what follows, in it, the
    output so far. While the output copies it, the next tokens there; where the output
    leaves it (the edit in a file asked back with a change), it is found again by the
    output's longest recent n-gram that occurs in it, the first such place after where
    it left, else the first anywhere."""

    def __init__(self, prediction: Sequence[int], start: int) -> None:
        """`start`: where the output begins in the contexts `draft` is given."""
        self.prediction = list(prediction)
        self._array = np.array(self.prediction, dtype=np.int64)
        self.start = start
        self._next: int | None = 0  # the prediction's token the output is at
        self._left = 0  # where the output last left it
        self._seen = 0  # output tokens followed so far

    def draft(self, context: list[int], limit: int) -> list[int]:
        output = context[self.start:]
        for token in output[self._seen:]:
            if self._next is not None:
                if self._next < len(self.prediction) and self.prediction[self._next] == token:
                    self._next += 1
                else:
                    self._left, self._next = self._next, None
        self._seen = len(output)
        if self._next is None:
            self._next = self._found_again(output)
        if self._next is None:
            return []
        return self.prediction[self._next:self._next + limit]

    def _found_again(self, output: list[int]) -> int | None:
        """Where the prediction goes on after the output's longest suffix n-gram in it.
        A scan, not an index: an index of a long prediction took the engine's thread ~70
        ms per 8k tokens to build; a scan of 32k tokens takes ~3 ms, and runs only while
        the output is off the prediction."""
        if not self._left and output and self.prediction and output[-1] == self.prediction[0]:
            # Not yet into the prediction: its first token, after what the output opened
            # with that the prediction leaves out (a code fence). A longer n-gram through
            # that opening finds the prediction's next copy of its first line instead.
            return 1
        for n in NGRAM_SIZES:  # one token is too common a match to go by
            if len(output) < n or len(self._array) < n:
                continue
            windows = np.lib.stride_tricks.sliding_window_view(self._array, n)
            ends = np.flatnonzero((windows == output[-n:]).all(axis=1)) + n
            if ends.size:
                after = ends[ends >= self._left + n]
                return int(after[0] if after.size else ends[0])
        return None


class Drafts:
    """One sequence's drafting: its sources, its mode, and what its drafts achieved."""

    def __init__(self, mode: SpeculationMode, max_draft: int, sources: tuple[DraftSource, ...],
                 continuation: Continuation, end: int, vocab_size: int,
                 model: Continuation | None = None,
                 prediction: PredictionLookup | None = None,
                 padded: bool = False) -> None:
        """`continuation`: the radix tree's; `model`: this sequence's draft model session
        (engine/draft_model.py), where the server has one; `prediction`: the request's
        own, tried before the sources; `padded`: every verify feeds `max_draft` tokens
        (on a GPU), so a shorter draft would cost as much: drafts are as long as allowed
        from the first, where elsewhere their length adapts."""
        self.mode = mode
        # Ids at or past it are radix keys of image positions (engine/image_tokens.py),
        # not tokens the model can be fed: a draft stops before one.
        self.vocab_size = vocab_size
        self.max_draft = max_draft
        self._adapts = not padded
        # The longest draft it makes now.
        self._length = min(FIRST_LENGTH, max_draft) if self._adapts else max_draft
        lookup = PromptLookup()
        guessers = {"prompt": lookup.draft, "tree": continuation, "model": model}
        self._guessers = [guessers[source] for source in sources if guessers[source]]
        self._prediction = prediction.draft if prediction is not None else None
        if self._prediction is not None:
            self._guessers.insert(0, self._prediction)
        self.end = end  # the most tokens the sequence may hold: a draft never passes it
        self.drafted = 0
        self.accepted = 0
        # Of those, the drafts the prediction made (OpenAI's accepted and rejected
        # prediction tokens), and whether the latest draft is one.
        self.predicted = 0
        self.accepted_predicted = 0
        self._predicting = False
        self._kept, self._cut = FIRST_KEPT, FIRST_CUT  # decayed counts, see RATE_MEMORY
        self._mean = 1.0  # accepted per chance, optimistic until measured
        self._pause = 0  # the length of its latest pause, in decode steps
        self._paused = False  # judged to pause, from the next step asked
        self._resume = 0  # the step it drafts again from

    @property
    def rate(self) -> float:
        """The chance its next draft token is kept, given those before it were."""
        return self._kept / (self._kept + self._cut)

    @property
    def has_prediction(self) -> bool:
        """Whether the request brought a prediction: a draft source known to be worth a
        look from its first step."""
        return self._prediction is not None

    def wants_draft(self, step: int) -> bool:
        """Whether to draft at the batch's decode step `step`: not while pausing. A pause
        lasts until the next step that is a multiple of its length, so rows paused alike
        probe together: a verify pays only for enough rows' drafts (`best_width`), and
        rows probing one at a time had every probe declined and paused longer."""
        if self._paused:
            self._paused = False
            self._resume = (step // self._pause + 1) * self._pause
        return step >= self._resume

    def draft(self, context: list[int]) -> list[int]:
        """Guessed tokens to follow `context` (the sequence's tokens and the one it is fed
        next), none past `end`; [] when no source has a guess."""
        return self._guess(context, 0)

    def draft_past_unread(self, context: list[int]) -> list[int]:
        """`draft` where the token fed next is not read yet (on a GPU it is still being
        computed): `context` is the sequence's tokens without it, the sources guess it
        too, and the draft is what they guess after it."""
        return self._guess(context, 1)

    def _guess(self, context: list[int], unread: int) -> list[int]:
        limit = min(self._length + unread, self.end - len(context))
        if limit <= unread:
            return []
        found: list[int] = []
        for guess in self._guessers:
            if found := guess(context, limit):
                break
        found = list(itertools.takewhile(lambda token: token < self.vocab_size, found))
        found = found[unread:]
        self._predicting = bool(found) and guess is self._prediction
        if not found:
            # No guess is a guess that failed, so a sequence that never repeats pauses its
            # looks: each costs the engine's thread its sources' lookups, and on a GPU a
            # look that reads the token fed costs the step its overlap with the last.
            self._judge(0)
        return found

    def record(self, drafted: int, accepted: int) -> None:
        """What one verify of this sequence's draft kept."""
        self.drafted += drafted
        self.accepted += accepted
        if self._predicting:
            self.predicted += drafted
            self.accepted_predicted += accepted
        self._kept = RATE_MEMORY * self._kept + accepted
        self._cut = RATE_MEMORY * self._cut + (accepted < drafted)
        if self._adapts:
            self._length = (min(self.max_draft, self._length + 2) if accepted == drafted
                            else max(1, self._length - 1))
        self._judge(accepted)

    def unused(self, tokens: int) -> None:
        """The last verify's final `tokens` accepted came after the sequence ended (a stop
        inside the draft): not output, so not counted as accepted."""
        self.accepted -= tokens
        if self._predicting:
            self.accepted_predicted -= tokens

    def declined(self) -> None:
        """`auto` found this draft not worth a verify (`best_width`): a chance that kept
        nothing, as a failed guess is."""
        self._judge(0)

    def _judge(self, accepted: int) -> None:
        """In `auto`, pause drafting while the mean accepted per chance is below
        `MIN_ACCEPTED`. The probe after a pause decides again, verified on the prior
        rate: only verifies measure the rate, so a rate left low by failed drafts would
        veto every later verify (`best_width`), also once the text turns to copying."""
        if self.mode != "auto":
            return
        self._mean += EMA_WEIGHT * (accepted - self._mean)
        if self._mean >= MIN_ACCEPTED:
            self._pause, self._paused = 0, False
            return
        self._pause = min(MAX_PAUSE, 2 * self._pause or FIRST_PAUSE)
        self._paused = True
        self._mean = MIN_ACCEPTED
        self._kept, self._cut = FIRST_KEPT, FIRST_CUT


def expected_kept(rate: float, length: int) -> float:
    """Draft tokens a verify keeps, on average, of a draft of `length` each kept with
    probability `rate` given those before it were."""
    return sum(rate ** j for j in range(1, length + 1))


def best_width(drafts: list[list[int]], rates: list[float], cost: StepCost,
               fed_width: int | None = None) -> int:
    """How many tokens of each row's draft a verify step should feed (0: decode instead):
    the width whose expected tokens per unit of cost beat a decode step's most, a step
    over `rows` x (width + 1) positions costing `cost.verified` (`STEP_COST`), or over
    `rows` x (fed_width + 1) where every verify is padded to one width."""
    rows = len(drafts)
    best, best_yield = 0, rows / cost.decode(rows)
    for width in range(1, max(map(len, drafts)) + 1):
        tokens = sum(1 + expected_kept(rate, min(len(draft), width))
                     for draft, rate in zip(drafts, rates))
        step = cost.verified(rows, rows * ((fed_width or width) + 1))
        if tokens / step > best_yield:
            best, best_yield = width, tokens / step
    return best
