"""Continuous batching on mlx-lm models: each prompt is prefilled on its own cache, in
chunks; its last token alone then gives its first token and adds it to the decode batch,
which runs one forward per step for all (in the step that computes the rest where it is
the only prompt being computed, else at the next decode, with the others ready then).

Why not mlx-lm's `BatchGenerator`: it prefills prompts together, right-padded to the
longest prompt and left-padded to the longest cached prefix, so a 40-token question
batched beside a fresh 1000-token prompt costs a 1000-token prefill (on the 2-core CPU,
three 1043-token prompts beside two cache hits took 42 s instead of 19 s). And it decodes
even a lone sequence through a batch cache with a padding mask: 3.3 ms per step instead of
mlx_lm.generate's 2.1 ms on an H100 (Llama-1B shape). Here a prompt costs its own tokens,
and a batch of one decodes exactly as mlx_lm.generate does.

Prompts waiting together are the exception, where the padding stays bounded: when several
fit the step's chunk whole, padded to the longest at most doubling their tokens, they are
prefilled together in one forward (classification: hundreds of one-line prompts, one
token each, where a forward per prompt made the GPU's per-step latency the cost; the turns
of chats that ended together) and go straight into the decode batch with their first token
sampled. A shorter row re-feeds the end of its own cached history rather than padding;
only what is left is right-padded. Prompts too
long for that take equal chunks of each in one forward, when the chunk could not finish the
first of them anyway. Each forward has a fixed cost on a GPU; on the 2-core CPU (143M
float32, 300 cached tokens each) four prompts' 256 tokens took 7.4 s of CPU in one forward
against 6.8 s in four, and 140 tokens each 3.9-4.0 s against 4.0-4.2 s: no gain there.

Decoding is pipelined like mlx_lm.generate: step n+1 is queued on the device before the
tokens of step n are read back, so building the next graph overlaps the device's work.
A constrained row's mask for step n+1 needs token n, so a batch with one is read back
before step n+1 is sampled; the mask is computed on the CPU while the device runs step
n+1's forward pass, and only the sampling waits for it (`_constrain`).
A sequence's cache always holds exactly the KV (or state) of `SequenceState.tokens`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx_lm.models.cache import make_prompt_cache

from engine.api import SchedulerCounters
from engine.compiled_read import CompiledReads
from engine.grammar import GrammarState, apply_masks, draft_masks, masks
from engine.hidden_states import HiddenStates
from engine.kv import assemble
from engine.kv_quant import KVQuantization
from engine.mlx_lm_internals import (
    BatchRow,
    Span,
    batch_rows,
    causal_rows,
    drop_last,
    keep_rows,
    merge_caches,
    prefix_batch,
    restore_order,
    rounded_writes,
    row_cache,
    row_views,
    span_tokens,
    supports_segments,
)
from engine.mrope import MRoPE, Placement
from engine.sampling import Penalties, Sampler, draw, penalize
from engine.speculation import FIRST_PAUSE, MAX_PAUSE, STEP_COST, Drafts, best_width
from engine.vision import ImageFeed

# What a sequence's KV is copied from (`Generator.caches_of`): a single-sequence cache, or
# a row of the batch's.
KVSource = list[Any] | BatchRow

# Prompts prefilled together are right-padded to the longest of them: at most to this
# many times their own tokens, so a short question is not computed as a long document.
MAX_PADDING_FACTOR = 2
# The fewest tokens per row a forward of prompts too long to finish in it takes.
MIN_GROUP_WIDTH = 64

# Free MLX's buffer cache this often, as mlx_lm.generate does, so memory does not creep.
CLEAR_CACHE_STEPS = 256
# The most cached tokens a prompt prefilled with others feeds again so that it holds its
# prefix where the others do (`Generator._prefill_together`).
REFEED_TOKENS = 8


@dataclass(eq=False)
class SequenceState:
    """One generation's model-side state."""

    uid: int
    # Per layer; this sequence's own until it joins the batch. None: not built yet, and
    # `prefix` holds its `tokens` (built when a chunk is first fed alone; prompts
    # prefilled together never need one: their batch cache is written from `prefix`).
    cache: list[Any] | None
    tokens: list[int]  # what the cache holds
    unfed: list[int]  # prompt tokens still to feed; the last one yields the first logits
    sampler: Sampler | None  # None: greedy
    penalties: Penalties | None  # logit bias and penalties; None: none
    wants_logprobs: bool
    top_logprobs: int = 0  # alternatives reported beside the sampled token's logprob
    # Positions (lengths of `tokens`) where prefill ends a chunk and calls the generator's
    # `at_snapshot`: ascending, inside the prompt's `unfed` tokens but its last. (Only on
    # a model whose caches are not all plain KV, reused as whole-state snapshots.)
    snapshot_at: list[int] = field(default_factory=list)
    # The cached segments (each `length` tokens of per-layer `keys` and `values`) `cache`
    # was built from, the same objects for sequences that share them, until it is fed:
    # prompts prefilled together copy a segment they share into their batch once for all.
    prefix: list[Any] | None = field(default=None, repr=False)
    grammar: GrammarState | None = None  # the output constraint; it takes in every token
    logprobs: Scores | None = field(default=None, repr=False)  # of the token being fed
    # The token it is fed next was output already (sampled when its prompt was prefilled
    # together with others), so the decode step that feeds it outputs nothing for it.
    reported: bool = False
    # A prefill-only request's readout (readout.py): the next tokens whose logprobs it
    # reads, and whether it reads the last hidden state.
    asked: mx.array | None = None
    wants_hidden: bool = False
    # Work no client waits on (a chat's next turn, cached ahead): computed in forwards
    # of its own, never beside a client's rows, and done once all but its last token is
    # fed (the scheduler ends it in `ready`), so that it never changes a client's numbers.
    background: bool = False
    # Speculative decoding: where its drafts come from (None: it never speculates; only
    # rows without penalties do, whose logits need no context per position).
    drafts: Drafts | None = None
    # As a batch row after a verify step rolled it back (`drop_last`): the token each of
    # its first slots holds (None: all in order).
    order: np.ndarray | None = field(default=None, repr=False)
    # A prompt with images (its `tokens` and `unfed` hold their radix keys): the input
    # embeddings of the chunks that hold image tokens (engine/vision.py).
    images: ImageFeed | None = None


@dataclass(frozen=True)
class Scores:
    """A sampled token's logprob and the row's `top_logprobs` most likely tokens, as
    outputs of the step that sampled it. Reading them afterwards launches nothing: a
    slice of the distribution read then was a new graph that, on a GPU, waited for the
    next step's forward already queued, so every step of a request with logprobs lost
    its overlap of host and device."""

    chosen: mx.array  # scalar
    top_ids: mx.array | None = None  # (top,), most likely first
    top_values: mx.array | None = None
    asked: mx.array | None = None  # a readout's: the logprobs of its `token_ids`
    hidden: mx.array | None = None  # a readout's: the last hidden state

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.chosen, self.top_ids, self.top_values, self.asked,
                            self.hidden) if a is not None]


@dataclass(frozen=True)
class Output:
    """A token sampled for sequence `uid`, with its scores when asked for."""

    uid: int
    token: int
    logprobs: Scores | None


@dataclass(frozen=True)
class Readings:
    """What prompts read together (`Generator.read_together`) give at their last
    positions, read back as Python values: per row, the likeliest token and its logprob,
    the `top` likeliest (ids, logprobs), the asked tokens' logprobs and the hidden state
    (empty lists where not asked for)."""

    tokens: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    asked: list[list[float]]
    hidden: list[list[float]]


@dataclass
class PrefillResult:
    # Their prompt is computed: all of it, and they are in the batch already; or, where
    # they `join` the batch at the next `decode` (computed while other prompts wait,
    # background work, models whose caches are not all plain KV), all but its last
    # token. Either way `Generator.caches_of` holds their `tokens`' KV.
    done: list[SequenceState] = field(default_factory=list)
    # The first tokens of those in the batch already (unconstrained ones), sampled and
    # read back in this step: a request that ends at its first token (a classifier's
    # one-token answer) leaves before any decode step feeds it.
    outputs: list[Output] = field(default_factory=list)
    # A prefill chunk raised: only that sequence failed, and it is out of the generator.
    failed: list[tuple[SequenceState, Exception]] = field(default_factory=list)
    tokens: int = 0  # positions the forward passes computed, padding included


class Generator:
    """Sequences being prefilled, one chunk budget per call, and a decode batch."""

    def __init__(self, model: nn.Module,
                 at_snapshot: Callable[[SequenceState], None] = lambda sequence: None,
                 counters: SchedulerCounters | None = None,
                 quantization: KVQuantization | None = None,
                 mrope: MRoPE | None = None) -> None:
        self.model = model
        # A Qwen-VL model's: rows with images are rotated at their prompt's M-RoPE
        # positions (engine/mrope.py); the others, as every row of other models, at the
        # cache's offsets.
        self.mrope = mrope
        self.counters = counters or SchedulerCounters()  # where it counts speculative steps
        self.quantization = quantization  # a quantized server's (kv_quant.py)
        cache = make_prompt_cache(model)
        self.layers = len(cache)
        # Whether a client's prompt enters the batch from prefill (`_finishes`), and
        # reads may run from a trace.
        self.plain_kv = supports_segments(cache)
        # Sees a prefilling sequence's cache at each of its `snapshot_at` positions.
        self.at_snapshot = at_snapshot
        self.hidden = HiddenStates(model)
        # On a GPU, reads of a shape seen before run from a trace (compiled_read.py), on
        # models whose every layer is plain KV and whose head can be narrowed; on the CPU
        # a trace's fused kernels are C++ built by the system's compiler, seconds each,
        # for forwards whose Python is a sliver of their time.
        self.compiled_reads = (
            CompiledReads(model, self.hidden)
            if (mx.default_device() == mx.gpu and quantization is None and mrope is None
                and self.plain_kv and self.hidden.available) else None)
        self.prefilling: list[SequenceState] = []  # in the order their chunks are computed
        # Whether the last prefill let prompts it could finish go first (`_queue`).
        self._overtaken = False
        # Prompts computed but their last token (`_finishes` not): they join at the next
        # decode, or (background work) end there.
        self.ready: list[SequenceState] = []
        self.rows: list[SequenceState] = []  # the decode batch, in the order of its cache rows
        self.cache: list[Any] | None = None  # the batch's; a lone row's own cache when B=1
        self.inputs: mx.array | None = None  # (B,) tokens to feed next: sampled, lazy
        self._inputs_read: list[int] | None = None  # them on the host, where known (a verify's)
        # On a GPU the next step is queued before the last one's tokens are read, so the
        # host builds graphs while the device computes. On the CPU, MLX's async_eval keeps
        # at most 10 tasks of 10 operations in flight, so for any real model it returns
        # only once all but the step's last ~100 operations have run (136 of ~150 ms for
        # the 143M demo model): queuing first would delay every token by most of a step
        # and overlap only that tail.
        self.pipelined = mx.default_device() == mx.gpu
        self.step_cost = STEP_COST["gpu" if self.pipelined else "cpu"]  # speculation's
        self._steps = 0
        # On a GPU, steps left before `auto` looks for drafts again after finding none
        # worth a verify, and how long the last such pause was (`_hold_off`).
        self._undrafted_steps = 0
        self._hold_off_length = 0

    @property
    def decoding(self) -> bool:
        return bool(self.rows or self.ready)

    @property
    def pads_verifies(self) -> bool:
        """Whether every verify feeds the longest draft allowed (on a GPU): on an H200, at
        640 tokens of context, a forward over 16 rows x 9 positions took what one over
        16 x 2 did, but each shape MLX's CUDA backend meets the first time costs 10-70 ms
        more, and verifies as wide as their drafts met a new one at most steps
        (bench/experiments/speculation-engine). Drafts are then as long as allowed too
        (`Drafts`' `padded`)."""
        return self.pipelined

    @property
    def _constrained(self) -> bool:
        """Whether a row's grammar or penalties need the tokens it was fed on the host."""
        return any(row.grammar is not None or row.penalties is not None for row in self.rows)

    @property
    def prompt_tokens_left(self) -> int:
        """Prompt tokens the sequences being prefilled still need fed."""
        return sum(len(s.unfed) for s in self.prefilling)

    def add(self, sequence: SequenceState) -> None:
        if not sequence.unfed:
            raise ValueError("a sequence needs at least one prompt token to feed")
        fed, last = len(sequence.tokens), len(sequence.tokens) + len(sequence.unfed) - 1
        if sequence.snapshot_at != sorted(set(sequence.snapshot_at)) or any(
                not fed < position <= last for position in sequence.snapshot_at):
            raise ValueError(f"snapshot positions {sequence.snapshot_at} are not ascending "
                             f"inside the unfed prompt ({fed}, {last}]")
        self.prefilling.append(sequence)

    # -- steps ------------------------------------------------------------------------

    def _run(self, inputs: mx.array, cache: list[Any], placement: Placement | None = None,
             **kwargs: Any) -> mx.array:
        """The model's logits for `inputs` after what `cache` holds, which takes in their
        KV: on a quantized server, rounded to what the tree will give back of it. Rotated
        at `placement` (None: at the cache's offsets)."""
        if self.quantization is not None:
            cache = rounded_writes(cache, self.quantization.round)
        if placement is None:
            return self.model(inputs, cache=cache, **kwargs)
        with self.mrope.placed(placement):
            return self.model(inputs, cache=cache, **kwargs)

    def _shifts(self) -> Placement | None:
        """Each decode row's positions past its cache offset: its prompt's M-RoPE delta,
        0 without images (None: every row at its offset, as in every text-only batch)."""
        if self.mrope is None:
            return None
        deltas = [row.images.rope_delta if row.images is not None else 0 for row in self.rows]
        return Placement(shifts=mx.array(deltas)) if any(deltas) else None

    def join(self) -> list[Output]:
        """Add the sequences whose prompt is computed but its last token to the decode
        batch, and return their first tokens, read now (`_first_outputs`): the caller can
        send them before the step's decode forward, which they used to wait for (on a
        GPU, where queuing a forward returns once it is nearly done, the whole decode
        step; on the CPU, the running batch's last forward, evaluated with theirs)."""
        together, joined = [], []
        for sequence in self.ready:
            if self.mrope is not None and sequence.images is not None:
                # At its prompt's M-RoPE placement.
                joined.append(([sequence], self._join([sequence])))
            else:
                together.append(sequence)
        if together:
            joined.append((together, self._join(together)))
        self.ready = []
        return [output for sequences, first in joined
                for output in _first_outputs(sequences, first)]

    def decode(self) -> list[Output]:
        """Run one decode step (after `join`ing what is ready). Returns the tokens sampled
        by the previous step, and the first tokens of the sequences that just joined."""
        outputs = self.join()
        if not self.rows:
            return outputs
        self._steps += 1
        if self._steps % CLEAR_CACHE_STEPS == 0:
            mx.clear_cache()
        return outputs + self._decode()

    def prefill(self, budget: int, together: int | None = None) -> PrefillResult:
        """Feed up to `budget` prompt tokens, in chunks, to the sequences in order (those
        it can finish first, every other step: `_queue`), and stop once a prompt is
        complete: its first token (sampled in this step where it `_finishes`, else at
        the next) then does not wait for the prompts behind it (with 8 prompts arriving
        together on an H100, finishing several per step put multi-turn TTFT p50 at 0.37 s
        instead of 0.10 s). Prompts finished together in one forward may hold up to
        `together` tokens in all (default `budget`), each at most `budget`."""
        result = PrefillResult()
        together = budget if together is None else together
        queue = self._queue(budget)
        group, width = self._group(queue, budget, together)
        if not (group and (self._prefill_together(group, result, together) if width is None
                           else self._feed_together(group, width, result))):
            for sequence in queue:
                if not self._feed_one(sequence, budget - result.tokens, result):
                    break
        # Background work takes what the clients left of the budget. Fed at once, as it
        # was in the clients' forwards: waiting, it keeps the rows and token room it holds.
        if budget > result.tokens:
            self._feed_background(budget - result.tokens, result)
        mx.clear_cache()  # a prompt's activations are large and rarely reused as they are
        return result

    def _queue(self, budget: int) -> list[SequenceState]:
        """The client prompts in the order this step feeds them: in arrival order, but
        every other step those it can finish go first. A short chat that arrives behind a
        long document then gets its first token within two steps instead of after the
        document's whole prefill (minutes on a CPU), and the document still takes every
        other step however many short prompts keep coming."""
        queue = [s for s in self.prefilling if not s.background]
        if self._overtaken:
            self._overtaken = False
            return queue
        reordered = ([s for s in queue if len(s.unfed) - 1 <= budget]
                     + [s for s in queue if len(s.unfed) - 1 > budget])
        self._overtaken = any(a is not b for a, b in zip(reordered, queue))
        return reordered

    def _finishes(self, sequence: SequenceState) -> bool:
        """Whether prefill also feeds the prompt's last token, in a forward of its own
        right after the chunk before it (`_join`), and adds the sequence to the batch: a
        client's prompt on a plain KV cache, the only one being computed, with none
        ready. That token used to wait for the next step, behind the running batch's
        decode (on an H200, a 6,000-token document's warm TTFT was ~20 ms in process, of
        it 7.6 ms the joining step). Alone, as it always was: a prompt sent again, whose
        tree match stops short of its last token, then computes its first logits exactly
        as its cold run did (fed with the chunk, they differed in the last bits).

        Prompts computed one per step while others wait (a burst, turns arriving
        together) still join together at the next decode, in one forward: a forward
        each made the CPU's multi-turn ITL p50 10% longer. Background work wants only
        its prompt's KV; a whole-state snapshot is published as the cache holds it at
        the prompt's end but its last token (the tree's key): those `join` too."""
        return (self.plain_kv and not sequence.background
                and all(s.background for s in self.ready)
                and all(s is sequence or s.background for s in self.prefilling))

    def _feed_one(self, sequence: SequenceState, budget: int, result: PrefillResult) -> bool:
        """`_feed` one sequence, into `result`; whether the next may be fed in this step
        (budget left, and no prompt completed)."""
        try:
            fed, first = self._feed(sequence, budget), None
            if fed < budget and len(sequence.unfed) == 1 and self._finishes(sequence):
                first, fed = self._join([sequence]), fed + 1
        except Exception as error:  # noqa: BLE001 - only this sequence's cache is touched
            self.prefilling.remove(sequence)
            result.failed.append((sequence, error))
            return True
        result.tokens += fed
        if first is not None:
            self.prefilling.remove(sequence)
            result.outputs += _first_outputs([sequence], first)
            result.done.append(sequence)
        elif len(sequence.unfed) == 1:
            self._prompt_done(sequence, result)
        return budget > fed and not result.done

    def _prompt_done(self, sequence: SequenceState, result: PrefillResult) -> None:
        """All but its last token fed: it joins the batch at the next decode (background
        work: it ends there)."""
        self.prefilling.remove(sequence)
        self.ready.append(sequence)
        result.done.append(sequence)

    def _feed_background(self, budget: int, result: PrefillResult) -> None:
        """Feed background sequences all but their last tokens, as many as `budget` takes
        padded, in one forward of their own; each keeps its row as its cache (they never
        join the batch). A sequence that cannot be grouped (`_groupable`) is fed alone."""
        waiting = [s for s in self.prefilling if s.background]
        for sequence in [s for s in waiting if len(s.unfed) == 1]:  # nothing to feed
            self._prompt_done(sequence, result)
        group = []
        for sequence in (s for s in waiting if len(s.unfed) > 1):
            if not _groupable(sequence):
                break
            width = max(len(s.unfed) - 1 for s in [*group, sequence])
            if width * (len(group) + 1) > budget:
                break
            group.append(sequence)
        if len(group) < 2 or not self._background_together(group, result):
            first = next((s for s in self.prefilling if s.background), None)
            if first is not None:
                self._feed_one(first, budget, result)

    def _background_together(self, group: list[SequenceState], result: PrefillResult) -> bool:
        """`_feed_background`'s forward; False if it raised (the rows' own caches are
        untouched: the batch is a copy), and they go one by one."""
        feeds = [s.unfed[:-1] for s in group]
        width = max(map(len, feeds))
        try:
            cache, _, _, _ = self._forward_rows([_spans(s, len(s.tokens)) for s in group],
                                                feeds, width)
            for layer in cache:
                layer.finalize()
            caches = [row_cache(cache, row) for row in range(len(group))]
            mx.eval([layer.state for own in caches for layer in own])
        except Exception:  # noqa: BLE001 - the one-by-one path finds and fails the culprit
            return False
        for sequence, own in zip(group, caches):
            sequence.cache, sequence.prefix = own, None
            sequence.tokens += sequence.unfed[:-1]
            del sequence.unfed[:-1]
            self._prompt_done(sequence, result)
        result.tokens += width * len(group)
        return True

    def _feed(self, sequence: SequenceState, budget: int) -> int:
        """Feed up to `budget` of the sequence's prompt tokens (never its last), in chunks
        that end at each of its `snapshot_at` positions, where `at_snapshot` sees the cache.
        Returns how many."""
        self._build_cache(sequence)
        fed = 0
        while fed < budget and len(sequence.unfed) > 1:
            count = min(len(sequence.unfed) - 1, budget - fed)
            if sequence.snapshot_at:
                count = min(count, sequence.snapshot_at[0] - len(sequence.tokens))
            chunk = sequence.unfed[:count]
            sequence.prefix = None  # the cache holds more from now on
            self._forward(sequence, chunk)
            # Computed before the step goes on, as mlx_lm.generate does: a step's wall
            # time is then its own work, which the prefill budget measures.
            mx.eval([c.state for c in sequence.cache])
            sequence.tokens += chunk
            del sequence.unfed[:count]
            fed += count
            if sequence.snapshot_at and sequence.snapshot_at[0] == len(sequence.tokens):
                sequence.snapshot_at.pop(0)
                self.at_snapshot(sequence)
        return fed

    def _forward(self, sequence: SequenceState, chunk: list[int]) -> None:
        """Run `chunk`, the sequence's next prompt tokens, into its cache: as ids, or as
        input embeddings where it holds image tokens."""
        embeddings = placement = None
        if sequence.images is not None:
            prompt, start = sequence.tokens + sequence.unfed, len(sequence.tokens)
            embeddings = sequence.images.inputs(prompt, start, start + len(chunk))
            placement = sequence.images.placement(prompt, start, start + len(chunk))
        if embeddings is None:
            self._run(mx.array([chunk]), sequence.cache, placement)
        else:
            self._run(mx.array([sequence.images.model_ids(chunk)]), sequence.cache, placement,
                      input_embeddings=embeddings[None])

    def _build_cache(self, sequence: SequenceState) -> None:
        """Give a sequence its own cache, assembled from `prefix`, if it has none yet."""
        if sequence.cache is None:
            sequence.cache = assemble(sequence.prefix, self.model)

    def _group(self, queue: list[SequenceState], budget: int, together: int
               ) -> tuple[list[SequenceState], int | None]:
        """Prompts at the front of `queue` (client rows: background work is fed apart,
        `_feed_background`) to compute in one forward, most rows first: either what is
        left of each, right-padded to the longest, if that is at most `budget` tokens a
        row and `together` in all (padding included) and the padding at most doubles the
        forward's tokens (width None); or, if the budget cannot finish even the first
        prompt, `width` tokens of each (`budget` in all), none finished. Only
        `_groupable` rows. ([], None): none."""
        eligible: list[SequenceState] = []
        for sequence in queue:
            if not _groupable(sequence):
                break
            eligible.append(sequence)
        for count in range(len(eligible), 1, -1):
            lengths = [len(s.unfed) for s in eligible[:count]]
            longest = max(lengths)
            if longest <= budget and longest * count <= min(
                    together, MAX_PADDING_FACTOR * sum(lengths)):
                return eligible[:count], None
            width = budget // count
            if width >= MIN_GROUP_WIDTH and budget + 1 < lengths[0] and width < min(lengths):
                return eligible[:count], width
        return [], None

    def _prefill_together(self, group: list[SequenceState], result: PrefillResult,
                          budget: int) -> bool:
        """Feed each prompt's remaining tokens, last one included, in one forward: rows
        right-padded to the longest (causal attention keeps a row's tokens from seeing its
        padding, and `finalize` turns the padding into masked left padding), first tokens
        sampled from each row's last real position, rows into the decode batch. False if
        the forward raised: the group's own caches are untouched (the batch cache is a
        copy), so they go one by one instead and only a faulty one fails.

        A row whose cached prefix is a few tokens longer than the shortest in the group
        feeds those tokens again (`REFEED_TOKENS`, within `budget`): the rows then hold
        their prefixes at the same place, so a preamble they share is one copy, where
        rows that each matched a token or two more of the sentences before them would
        copy it each. And a row shorter than the longest feeds the end of its cached
        prefix again instead of padding, as far as that prefix is its own (not a span
        another row of the group holds too): the forward costs the same, and a row with
        no padding needs no roll afterwards (`BatchKVCache.finalize`: 12 ms for seven
        2000-token multi-turn rows on an H100, `grouped-prefill-1b`). Neither on a
        quantized server, whose rows attend over their cached prefixes as kept."""
        depths = [len(s.tokens) for s in group]
        if self.quantization is not None:
            # A cached token fed again is rounded anew (kv_quant.py), and can land a grid
            # step from the value its prefix keeps: the row would attend over other KV
            # than the tree's, and publish KV computed over it below the tree's.
            cuts, width = depths, max(len(s.unfed) for s in group)
        else:
            cuts, width = self._refeeds(group, depths, budget)
        rows = [(s, s.tokens[c:] + s.unfed, _spans(s, c)) for s, c in zip(group, cuts)]
        # Rows holding the same spans side by side, each run where its first row was.
        first_seen: dict[tuple[int, int], int] = {}
        for _, _, spans in rows:
            for keys, _, n in spans:
                first_seen.setdefault((id(keys), n), len(first_seen))
        rows.sort(key=lambda row: [first_seen[(id(keys), n)] for keys, _, n in row[2]])
        group = [sequence for sequence, _, _ in rows]
        try:
            cache, last, rows, ends = self._forward_rows(
                [spans for _, _, spans in rows], [feed for _, feed, _ in rows], width)
            for layer in cache:
                layer.finalize()
            hidden = (self.hidden.take(rows, ends) if any(s.wants_hidden for s in group)
                      else None)
            mx.eval(last, hidden)  # within this step, as a chunk is
        except Exception:  # noqa: BLE001 - the one-by-one path finds and fails the culprit
            return False
        for sequence in group:
            self.prefilling.remove(sequence)
            sequence.tokens += sequence.unfed
            sequence.unfed = []
        result.outputs += _first_outputs(group, self._enter(group, cache, last, hidden))
        result.done += group
        result.tokens += width * len(group)
        return True

    def _refeeds(self, group: list[SequenceState], depths: list[int], budget: int
                 ) -> tuple[list[int], int]:
        """Where each row of `_prefill_together`'s group is cut (its tokens from there on
        fed), and the forward's width."""
        shallowest = min((d for s, d in zip(group, depths) if s.prefix is not None),
                         default=0)
        cuts = [shallowest if s.prefix is not None and d - shallowest <= REFEED_TOKENS
                else d for s, d in zip(group, depths)]
        width = max(d - c + len(s.unfed) for s, d, c in zip(group, depths, cuts))
        if width * len(group) > budget:
            cuts = depths
            width = max(len(s.unfed) for s in group)
        own_from = _own_from(group)
        # Deep enough that the row feeds `width` tokens, if its own prefix reaches there.
        return [max(d + len(s.unfed) - width, min(own, c))
                for s, d, c, own in zip(group, depths, cuts, own_from)], width

    def _forward_rows(self, prefixes: Sequence[Sequence[Span]], feeds: Sequence[list[int]],
                      width: int) -> tuple[list[Any], mx.array, mx.array, mx.array]:
        """One forward of `feeds`, row i after the spans `prefixes[i]`, right-padded to
        `width`: the batch cache it wrote (its rows' right padding prepared, for
        `finalize`), each row's logits at its last real position (the head computed
        there alone where the model allows), and those (rows, positions), where
        `HiddenStates.take` reads the hidden states. Rows over prefixes of one length (a
        list's rows over its preamble, prompts with nothing cached) are masked
        causally (`causal_rows`)."""
        cache = prefix_batch(prefixes, width, self.layers)
        for layer in cache:
            layer.prepare(right_padding=[width - len(feed) for feed in feeds])
        aligned = len({span_tokens(spans) for spans in prefixes}) == 1
        forward_cache = causal_rows(cache) if aligned else cache
        inputs, ends = _right_padded(feeds, width)
        rows = mx.arange(len(feeds))
        if self.hidden.available:
            with self.hidden.narrowed(rows, ends):
                return cache, self._run(inputs, forward_cache)[:, 0], rows, ends
        return cache, self._run(inputs, forward_cache)[rows, ends], rows, ends

    def read_together(self, prefixes: Sequence[Sequence[Span]], feeds: Sequence[list[int]],
                      top: int, asked: Sequence[int], hidden: bool) -> Readings:
        """Prompts over cached prefixes (row i: the spans `prefixes[i]` of its KV), each
        followed by its own tokens (`feeds`), read at their last positions in one forward,
        as `_prefill_together` computes a group, and nothing kept: a classify list's
        sentences (sharing one prefix), a rerank query's documents, an embedding
        instruction's inputs, texts sent again whose whole prompt the tree holds. Every
        row's scores come out of batch-wide ops and one read back, where a request per
        row cost each sentence its own slices, reads and events (`Scheduler._read`). On a
        GPU, rows over prefixes of one length in a shape read before run from a trace
        (compiled_read.py)."""
        width = max(map(len, feeds))
        lengths = {span_tokens(spans) for spans in prefixes}
        prefix = max(lengths)
        if (self.compiled_reads is not None and len(lengths) == 1 and prefix
                and self.compiled_reads.traced(len(feeds), width, prefix, hidden)):
            cache = prefix_batch(prefixes, width, self.layers)
            inputs, ends = _right_padded(feeds, width)
            logprobs, states = self.compiled_reads.read(
                inputs, [layer.keys for layer in cache], [layer.values for layer in cache],
                ends, hidden)
        else:
            _, logits, rows, ends = self._forward_rows(prefixes, feeds, width)
            states = self.hidden.take(rows, ends).astype(mx.float32) if hidden else None
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tokens = mx.argmax(logprobs, axis=-1)
        chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
        top_ids = top_values = picked = None
        if top:
            top_ids, top_values = _most_likely(logprobs, top)
        if asked:
            picked = logprobs[:, mx.array(asked)]
        read = [a for a in (tokens, chosen, top_ids, top_values, picked, states)
                if a is not None]
        mx.eval(read)
        empty = [[] for _ in feeds]
        return Readings(
            tokens.tolist(), chosen.tolist(),
            top_ids.tolist() if top_ids is not None else empty,
            top_values.tolist() if top_values is not None else empty,
            picked.tolist() if picked is not None else empty,
            states.tolist() if states is not None else empty)

    def _feed_together(self, group: list[SequenceState], width: int,
                       result: PrefillResult) -> bool:
        """Feed `width` tokens of each prompt (each has more left) in one forward over a
        batch cache of their caches, then give each row its own cache back. False if the
        forward raised: the group's own caches are untouched, as in `_prefill_together`."""
        try:
            for sequence in group:
                self._build_cache(sequence)
            cache = merge_caches([s.cache for s in group])
            self._run(mx.array([s.unfed[:width] for s in group]), cache)
            mx.eval([c.state for c in cache])
        except Exception:  # noqa: BLE001 - the one-by-one path finds and fails the culprit
            return False
        for row, sequence in enumerate(group):
            sequence.cache = row_cache(cache, row)
            sequence.prefix = None  # its cache is a copy holding more now
            sequence.tokens += sequence.unfed[:width]
            del sequence.unfed[:width]
        mx.eval([c.state for s in group for c in s.cache])
        result.tokens += width * len(group)
        return True

    def _join(self, sequences: list[SequenceState]) -> mx.array:
        """Feed each prompt's last token (as mlx_lm.generate does), sample the first tokens,
        and add the sequences to the decode batch: several in one forward over one batch
        of their caches. Joined one at a time, each join was a forward of its own and an
        extend of every layer of the batch, evaluated together at the next step: eight
        image turns of a 4B-shaped Gemma 3 (sliding layers) took 15-20 ms each and then a
        270-320 ms step on an H200 (`bench/experiments/snapshot-join-4b`). A Qwen-VL row
        with images joins alone, at its prompt's M-RoPE placement."""
        placement = None
        if len(sequences) == 1 and sequences[0].images is not None:
            sequence = sequences[0]
            last = len(sequence.tokens)
            placement = sequence.images.placement(sequence.tokens + sequence.unfed, last,
                                                  last + 1)
        tokens = [sequence.unfed.pop() for sequence in sequences]
        cache = (sequences[0].cache if len(sequences) == 1
                 else merge_caches([sequence.cache for sequence in sequences]))
        logits = self._run(mx.array(tokens)[:, None], cache, placement)[:, -1, :]
        hidden = None
        if any(sequence.wants_hidden for sequence in sequences):
            hidden = self.hidden.take(mx.arange(len(sequences)),
                                      mx.zeros(len(sequences), mx.int32))
        for sequence, token in zip(sequences, tokens):
            sequence.tokens.append(token)
        return self._enter(sequences, cache, logits, hidden)

    def _enter(self, sequences: list[SequenceState], cache: list[Any],
               logits: mx.array, hidden: mx.array | None = None) -> mx.array:
        """Sample the first token of `sequences` from their last prompt position's logits
        and add them, with `cache` (theirs: one sequence's or a batch of them), to the
        decode batch. Returns the tokens sampled (lazy), which they are fed next.
        `hidden`: their last position's hidden states, for the readouts that want them."""
        mask = None
        if any(s.grammar is not None for s in sequences):
            mask = self._constrain(sequences, None, logits)[1]
        first, logprobs = self._sample(sequences, logits, mask)
        if hidden is not None:
            logprobs = [replace(scores, hidden=hidden[i]) if s.wants_hidden else scores
                        for i, (s, scores) in enumerate(zip(sequences, logprobs))]
        if self.pipelined:  # on its own, so reading it does not wait for the next step
            mx.async_eval(first, *_arrays(logprobs))
        if any(s.drafts is not None and s.drafts.has_prediction for s in sequences):
            self._undrafted_steps = 0  # its prediction is worth a look at once
        for sequence, row_logprobs in zip(sequences, logprobs):
            sequence.logprobs = row_logprobs
            sequence.cache = []  # the batch owns it now
            sequence.prefix = None  # nor hold the arrays it was copied from
        self._inputs_read = None  # the joining rows' first tokens are being computed
        if not self.rows:
            self.cache = cache
            self.inputs = first
        else:
            joining = cache if len(sequences) > 1 else merge_caches([cache])
            if len(self.rows) == 1:
                self.cache = merge_caches([self.cache])
            for layer, new in zip(self.cache, joining):
                layer.extend(new)
            self.inputs = mx.concatenate([self.inputs, first])
        self.rows += sequences
        return first

    def _decode(self) -> list[Output]:
        insisting = any(row.drafts is not None and row.drafts.mode == "on" for row in self.rows)
        # Every row is asked at every step, held off or not: a row's pause ends at a step
        # of the batch's count (`Drafts.wants_draft`), beside the batch's hold-offs.
        eager = [row.drafts is not None and row.drafts.wants_draft(self._steps)
                 for row in self.rows]
        if self._undrafted_steps and not insisting:
            self._undrafted_steps -= 1
            eager = [False]
        if any(eager):
            fed, drafts, waited = self._look(eager)
            width = 0
            if any(drafts):
                width = max(map(len, drafts))
                fed_width = None
                if self.pads_verifies:
                    fed_width = max(row.drafts.max_draft for row in self.rows if row.drafts)
                if not insisting:  # auto: only what pays for itself
                    width = best_width(drafts, [row.drafts.rate if row.drafts else 0.0
                                                for row in self.rows], self.step_cost,
                                       fed_width)
                    if not width:
                        for row, draft in zip(self.rows, drafts):
                            if draft:
                                row.drafts.declined()
            if not insisting:
                self._hold_off(verifies=width > 0, waited=waited)
            if width:
                return self._verify(fed, [draft[:width] for draft in drafts],
                                    fed_width or width)
        fed = self.inputs
        logits = self._run(fed[:, None], self.cache, self._shifts())[:, -1, :]
        tokens = mask = None  # the tokens sampled by the previous step
        if self._constrained:
            tokens, mask = self._constrain(self.rows, fed, logits)
        sampled, logprobs = self._sample(self.rows, logits, mask, tokens)
        if self.pipelined:
            mx.async_eval(sampled, *_arrays(logprobs))
        if tokens is None:
            if not self.pipelined:  # the fed tokens' scores with them, in one evaluation
                mx.eval(fed, *_arrays(row.logprobs for row in self.rows))
            tokens = fed.tolist()
        outputs = []
        for row, token, next_logprobs in zip(self.rows, tokens, logprobs):
            if not row.reported:
                outputs.append(Output(row.uid, token, row.logprobs))
            row.reported = False
            row.tokens.append(token)
            row.logprobs = next_logprobs
        self.inputs, self._inputs_read = sampled, None
        return outputs

    def _look(self, eager: list[bool]) -> tuple[list[int] | None, list[list[int]], bool]:
        """Each eager row's draft: the tokens fed this step (None where not read), the
        drafts, and whether reading the fed tokens waited for the device.
        A draft follows the token fed. On a GPU that token is still being computed where
        the last step decoded: reading it would cost this step its overlap with that one,
        so the rows guess it too and draft past the guess (a wrong guess wastes its
        verify's positions, never a token: each is kept only where the model agrees after
        the true one). Rows with a grammar or penalties read it: their masks need it."""
        known = self._inputs_read
        if self.pipelined and known is None and not self._constrained:
            drafts = [row.drafts.draft_past_unread(row.tokens) if wants else []
                      for row, wants in zip(self.rows, eager)]
            return None, drafts, False
        fed = known if known is not None else self.inputs.tolist()
        drafts = [row.drafts.draft(row.tokens + [token]) if wants else []
                  for row, token, wants in zip(self.rows, fed, eager)]
        return fed, drafts, self.pipelined and known is None

    def _hold_off(self, verifies: bool, waited: bool) -> None:
        """After `auto` found no draft, or none worth a verify, in a look that waited for
        the device (`_look`), decode a few steps without looking (doubling while it keeps
        finding none): that look cost the step its overlap with the last one (on an H200,
        16 streams whose drafts never paid decoded at 0.67x of speculation off; short
        answers that never repeat, each row looking at its own few first steps and
        probes, 0.84x)."""
        if verifies or not waited:
            self._hold_off_length = 0
            return
        self._hold_off_length = min(MAX_PAUSE, 2 * self._hold_off_length or FIRST_PAUSE)
        self._undrafted_steps = self._hold_off_length

    def _verify(self, fed: list[int] | None, drafts: list[list[int]], width: int
                ) -> list[Output]:
        """A speculative step: feed each row its token (`fed`, None where not read yet)
        and `width` more, its draft padded with the token (padding is never kept), in one
        forward; keep each draft's longest prefix the row's own sampling agrees with, and
        the token that sampling gives after it, which the row is fed next. A row keeps a
        draft token where it is the token its sampling gives at that position: the
        argmax, or for a sampled row the token its `Sampler.draws` for that output index
        (rejection sampling with the randomness plain decoding uses), so its tokens are
        those it gives without drafts.
        A constrained row's draft is cut at the first token its grammar forbids, and each
        position is masked as that token would be. Then every row's cache drops what it
        did not keep (`drop_last`). Synchronous: what is kept decides the next step."""
        rows = self.rows
        first_mask, position_masks = self._draft_masks(fed, drafts)
        column = self.inputs[:, None]
        padded = np.array([draft + [-1] * (width - len(draft)) for draft in drafts])
        inputs = mx.concatenate([column, mx.where(mx.array(padded < 0), column,
                                                  mx.array(padded.clip(0), mx.uint32))], axis=1)
        logits = self._run(inputs, self.cache, self._shifts())
        first, first_scores = self._sample(rows, logits[:, 0, :], first_mask, fed)
        targets = _targets(rows, drafts, logits, position_masks)
        mx.eval(first, *targets.values())  # one wait for the device, not one per row
        if fed is None:
            fed = self.inputs.tolist()  # computed by now
        following = first.tolist()  # what rows without a draft are fed next
        kept: list[int] = []
        for i, (row, draft) in enumerate(zip(rows, drafts)):
            accepted = 0
            if draft:
                accepted, following[i] = _agreed(row, draft, following[i],
                                                  targets[i].tolist())
            kept.append(accepted)
        next_inputs = mx.array(following, mx.uint32)
        outputs = []
        for i, (row, draft, accepted) in enumerate(zip(rows, drafts, kept)):
            draft_scores: list[Scores | None] = [None] * accepted
            next_scores = first_scores[i]
            if row.wants_logprobs and draft:
                logprobs = logits[i, :accepted + 1]
                logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
                draft_scores = [_scores(logprobs[j], mx.array(draft[j]), row.top_logprobs)
                                for j in range(accepted)]
                next_scores = _scores(logprobs[accepted], next_inputs[i], row.top_logprobs)
            if not row.reported:
                outputs.append(Output(row.uid, fed[i], row.logprobs))
            outputs += [Output(row.uid, token, scores)
                        for token, scores in zip(draft[:accepted], draft_scores)]
            row.reported = False
            row.tokens += [fed[i], *draft[:accepted]]
            if row.grammar is not None:
                for token in draft[:accepted]:
                    row.grammar.accept(token)
            row.logprobs = next_scores
            if draft:
                row.drafts.record(len(draft), accepted)
                self.counters.verified_rows += 1
                self.counters.draft_tokens += len(draft)
                self.counters.accepted_draft_tokens += accepted
                self.counters.verified_tokens += 1 + accepted
        self._roll_back([width - accepted for accepted in kept])
        self.inputs, self._inputs_read = next_inputs, following
        return outputs

    def _draft_masks(self, fed: list[int] | None, drafts: list[list[int]]
                     ) -> tuple[np.ndarray | None, list[np.ndarray | None]]:
        """Let each constrained row take in its token, and cut its draft (in place) at the
        first token its grammar forbids. Returns the rows' masks of the verify's first
        position, and each constrained drafting row's masks of all its positions. `fed`
        is read wherever a row is constrained (`_look`)."""
        first_mask = None
        position_masks: list[np.ndarray | None] = [None] * len(self.rows)
        if not any(row.grammar is not None for row in self.rows):
            return first_mask, position_masks
        first_mask = masks([row.grammar for row in self.rows], fed)
        for i, row in enumerate(self.rows):
            # A grammar still waiting for its marker checks the draft too: the marker may
            # end inside it.
            if drafts[i] and row.grammar is not None and row.grammar.error is None:
                first = (first_mask[i] if first_mask is not None
                         else np.full(row.grammar.words, -1, np.int32))
                position_masks[i] = draft_masks(row.grammar, first, drafts[i])
                drafts[i] = drafts[i][:len(position_masks[i]) - 1]
        return first_mask, position_masks

    def _roll_back(self, drops: list[int]) -> None:
        """Drop each row's last `drops[i]` cached positions, recording the slots
        `drop_last` moved."""
        moved = drop_last(self.cache, drops, [len(row.tokens) for row in self.rows])
        for row, count in zip(self.rows, moved):
            if count:
                order = np.arange(len(row.tokens))
                if row.order is not None:
                    order[:len(row.order)] = row.order
                row.order = np.concatenate([order[count:], order[:count]])

    def _in_order(self, positions: Iterable[int]) -> None:
        """Put the batch rows at `positions` back in token order before they are copied
        out (`drop_last` moves their first tokens)."""
        for position in positions:
            row = self.rows[position]
            if row.order is not None:
                restore_order(self.cache, position, row.order.tolist())
                row.order = None

    def _constrain(self, rows: list[SequenceState], fed: mx.array | None, logits: mx.array
                   ) -> tuple[list[int] | None, np.ndarray | None]:
        """Start the forward pass that gives `logits`, and meanwhile read the tokens the
        rows were fed (None: none sampled yet; penalized rows count them) and let each
        constrained row take in its token and compute its mask. Returns the fed tokens and
        the masks (None: no row constrained)."""
        if self.pipelined or fed is None:
            mx.async_eval(logits)
            tokens = fed.tolist() if fed is not None else None
        else:  # MLX's CPU backend signals an array only once its whole evaluation is done
            tokens = fed.tolist()
            mx.async_eval(logits)
        return tokens, masks([row.grammar for row in rows], tokens)

    @staticmethod
    def _sample(rows: list[SequenceState], logits: mx.array, mask: np.ndarray | None = None,
                fed: list[int] | None = None) -> tuple[mx.array, list[Scores | None]]:
        """The next token of each row, and its scores where the row asked for logprobs.
        All-greedy batches take one argmax. `fed`: the tokens the rows were fed to give
        `logits`, where their `tokens` do not hold them yet (penalties need them).

        A row's reported logprobs are the model's (after the request's own penalties and
        logit_bias), not renormalized over what its grammar allows, as OpenAI reports them:
        they say how likely the model found each token. Its token is sampled from the
        masked distribution."""
        penalized = [(i, r.penalties, *r.penalties.seen(
                          r.tokens, None if fed is None else fed[i],
                          None if r.images is None else r.images.model_ids),
                      r.penalties.barred(r.tokens, None if fed is None else fed[i]))
                     for i, r in enumerate(rows) if r.penalties is not None]
        if penalized:
            logits = penalize(logits, penalized)
        needs = [r.wants_logprobs or r.sampler is not None for r in rows]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True) if any(needs) else None
        allowed = logprobs
        if mask is not None:
            logits = apply_masks(logits, mask)
            if any(r.sampler is not None for r in rows):
                allowed = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        drawn = [i for i, r in enumerate(rows) if r.sampler is not None]
        if len(drawn) == len(rows):
            sampled = draw([r.sampler for r in rows], allowed)
        else:
            sampled = mx.argmax(logits, axis=-1)
            if drawn:
                at = mx.array(drawn)
                sampled[at] = draw([rows[i].sampler for i in drawn], allowed[at])
        return sampled.astype(mx.uint32), _rows_scores(rows, logprobs, sampled)

    # -- leaving ----------------------------------------------------------------------

    def remove(self, uids: Iterable[int], read: Mapping[int, int] | None = None
               ) -> dict[int, SequenceState]:
        """Take sequences out, each with a cache holding exactly its `tokens`: its own,
        or, for a row of a batch, what `caches_of` gives (to copy from, not to extend).
        `read`: the rows whose cache the caller copies from, each from which token on
        (None: all, from the first); the others leave with no cache (a one-token answer
        leaves nothing to copy, and a view per row is host work on every sentence)."""
        wanted = set(uids)
        removed = {}
        for group in (self.prefilling, self.ready):
            for sequence in [s for s in group if s.uid in wanted]:
                group.remove(sequence)
                removed[sequence.uid] = sequence
        leaving = [i for i, row in enumerate(self.rows) if row.uid in wanted]
        if leaving:
            for i in leaving:
                self.rows[i].cache = []
                removed[self.rows[i].uid] = self.rows[i]
            viewed = [self.rows[i] for i in leaving if read is None or self.rows[i].uid in read]
            firsts = None if read is None else [read[row.uid] for row in viewed]
            for row, cache in zip(viewed, self.caches_of(viewed, firsts)):
                row.cache = cache
            self._keep([i for i in range(len(self.rows)) if self.rows[i].uid not in wanted])
        return removed

    def _keep(self, keep: list[int]) -> None:
        rows = [self.rows[i] for i in keep]
        if self._inputs_read is not None:
            self._inputs_read = [self._inputs_read[i] for i in keep]
        if not rows:
            self.cache, self.inputs = None, None
        elif len(rows) == 1:
            if len(self.rows) > 1:
                self._in_order(keep)
                self.cache = row_cache(self.cache, keep[0])
            self.inputs = self.inputs[keep[0]:keep[0] + 1]
        else:
            keep_rows(self.cache, keep)
            self.inputs = self.inputs[mx.array(keep)]
        self.rows = rows

    def caches_of(self, sequences: list[SequenceState], firsts: Sequence[int] | None = None
                  ) -> list[KVSource]:
        """What holds each of `sequences`' `tokens`, to copy from: its own cache, or for a
        batch row a view of the batch's (read it before the next step changes the batch),
        all made in one pass over the batch's layers. Given `firsts` (the earliest token
        each is copied from), rows of a plain KV batch come as `BatchRow`s, whose spans
        copy every layer at once."""
        if len(self.rows) == 1:
            return [self.cache if s is self.rows[0] else s.cache for s in sequences]
        positions = {id(row): i for i, row in enumerate(self.rows)}
        inside = [i for i, s in enumerate(sequences) if id(s) in positions]
        rows = [positions[id(sequences[i])] for i in inside]
        self._in_order(rows)
        views = None
        if rows and firsts is not None:
            views = batch_rows(self.cache, rows, [firsts[i] for i in inside])
        if rows and views is None:
            views = row_views(self.cache, rows)
        found = dict(zip(inside, views or []))
        return [found.get(i, s.cache) for i, s in enumerate(sequences)]


def _first_outputs(sequences: list[SequenceState], first: mx.array) -> list[Output]:
    """The first tokens `first` of sequences that just entered the batch, read now and
    marked reported, so that the next decode step does not output them again. A
    constrained row's grammar takes in its token when it is fed, and whether that ends
    the output shows only then: it is output then, as it always is, unless the grammar
    still waits for its marker (a lazy call grammar, a reasoning model's), which no token
    ends."""
    outputs = []
    for sequence, token in zip(sequences, first.tolist()):
        if sequence.grammar is None or sequence.grammar.waiting:
            outputs.append(Output(sequence.uid, token, sequence.logprobs))
            sequence.reported = True
    return outputs


def _targets(rows: list[SequenceState], drafts: list[list[int]], logits: mx.array,
             position_masks: list[np.ndarray | None]) -> dict[int, mx.array]:
    """For each drafting row (by index), the tokens its sampling gives at its verify
    positions, unevaluated: the argmax, one over the whole batch where no grammar masks
    a row; for a sampled row the draws at its output indices from position 1 on (position
    0 was drawn with every row's first token, at the output index before the sampler's
    `position`)."""
    targets: dict[int, mx.array] = {}
    plain = None
    for i, (row, draft) in enumerate(zip(rows, drafts)):
        if not draft:
            continue
        row_logits = logits[i, :len(draft) + 1]
        if position_masks[i] is not None:
            row_logits = apply_masks(row_logits, position_masks[i])
        if row.sampler is not None:
            allowed = row_logits[1:] - mx.logsumexp(row_logits[1:], axis=-1, keepdims=True)
            targets[i] = row.sampler.draws(allowed, row.sampler.position)
        elif position_masks[i] is not None:
            targets[i] = mx.argmax(row_logits, axis=-1)
        else:
            if plain is None:
                plain = mx.argmax(logits, axis=-1)
            targets[i] = plain[i, :len(draft) + 1]
    return targets


def _agreed(row: SequenceState, draft: list[int], first: int, targets: list[int]
            ) -> tuple[int, int]:
    """How many of `draft`'s tokens the row's sampling agrees with, given its `_targets`,
    and the token it gives after them. `first`: the token drawn at position 0 (the step's
    sampling of every row), where a sampled row's targets start at position 1."""
    if row.sampler is not None:
        targets = [first, *targets]
    accepted = 0
    while accepted < len(draft) and draft[accepted] == targets[accepted]:
        accepted += 1
    if row.sampler is not None:
        row.sampler.position += accepted
    return accepted, targets[accepted]


def _groupable(sequence: SequenceState) -> bool:
    """Whether a prompt can be fed in a padded forward with others: plain KV caches (a
    padded row of a rotating or recurrent cache would keep the padding's state), no
    snapshot positions and no images (their chunks are fed as embeddings)."""
    return not sequence.snapshot_at and sequence.images is None and (
        sequence.cache is None or supports_segments(sequence.cache))


def _own_from(group: list[SequenceState]) -> list[int]:
    """For each sequence, the depth from which its cached prefix is its own: the end of
    the last segment of it that another sequence of `group` holds too."""
    holders: dict[int, int] = {}
    for sequence in group:
        for segment in sequence.prefix or []:
            holders[id(segment)] = holders.get(id(segment), 0) + 1
    own_from = []
    for sequence in group:
        depth = shared_end = 0
        for segment in sequence.prefix or []:
            depth += segment.length
            if holders[id(segment)] > 1:
                shared_end = depth
        own_from.append(shared_end)
    return own_from


def _spans(sequence: SequenceState, depth: int) -> list[Span]:
    """The first `depth` tokens `sequence.cache` holds, as spans: of the cached segments
    it was built from, or of the cache itself."""
    if sequence.prefix is None:
        cache = sequence.cache
        return [([c.keys for c in cache], [c.values for c in cache], depth)] if depth else []
    return segment_spans(sequence.prefix, depth)


def _right_padded(feeds: Sequence[list[int]], width: int) -> tuple[mx.array, mx.array]:
    """`feeds` as one (rows, width) array, each right-padded, and each one's last
    position."""
    return (mx.array([feed + [0] * (width - len(feed)) for feed in feeds]),
            mx.array([len(feed) - 1 for feed in feeds]))


def segment_spans(segments: Sequence[Any], depth: int) -> list[Span]:
    """The first `depth` tokens of cached segments (a tree path's), as spans. Segments
    holding fewer are a ValueError: a path with a node evicted from memory has no segment
    for its tokens, and reading past the gap would attend to other positions' KV."""
    spans = []
    left = depth
    for segment in segments:
        n = min(left, segment.length)
        if n == 0:
            break
        spans.append((segment.keys, segment.values, n))
        left -= n
    if left:
        raise ValueError(f"the cached segments hold {depth - left} of {depth} tokens")
    return spans


def _scores(logprobs: mx.array, token: mx.array, top: int,
            asked: mx.array | None = None) -> Scores:
    picked = logprobs[asked] if asked is not None else None
    if top == 0:
        return Scores(logprobs[token], asked=picked)
    return Scores(logprobs[token], *_most_likely(logprobs, top), picked)


def _most_likely(logprobs: mx.array, top: int) -> tuple[mx.array, mx.array]:
    """The ids and logprobs of the `top` likeliest tokens along the last axis, likeliest
    first."""
    ids = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[..., :top]
    ids = mx.take_along_axis(ids, mx.argsort(-mx.take_along_axis(logprobs, ids, axis=-1),
                                             axis=-1), axis=-1)
    return ids, mx.take_along_axis(logprobs, ids, axis=-1)


def _rows_scores(rows: list[SequenceState], logprobs: mx.array | None, sampled: mx.array
                 ) -> list[Scores | None]:
    """`_scores` of the rows that want logprobs, computed for the batch at once: one
    gather of the sampled tokens' logprobs and, where any row wants alternatives, one
    partition and sort of every row (on a GPU each op is a kernel launch, and ops per row
    made a 64-row classify list launch hundreds); each row's scores are rows of those."""
    if logprobs is None or not any(row.wants_logprobs for row in rows):
        return [None] * len(rows)
    chosen = mx.take_along_axis(logprobs, sampled[:, None], axis=-1)[:, 0]
    top = max(row.top_logprobs for row in rows if row.wants_logprobs)
    if top:
        ids, values = _most_likely(logprobs, top)
    scores: list[Scores | None] = []
    for i, row in enumerate(rows):
        if not row.wants_logprobs:
            scores.append(None)
            continue
        asked = logprobs[i][row.asked] if row.asked is not None else None
        k = row.top_logprobs
        scores.append(Scores(chosen[i], ids[i, :k], values[i, :k], asked) if k
                      else Scores(chosen[i], asked=asked))
    return scores


def _arrays(scores: Iterable[Scores | None]) -> list[mx.array]:
    return [a for s in scores if s is not None for a in s.arrays()]
