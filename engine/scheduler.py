"""The engine's worker: one thread that owns every MLX call.

Requests wait in `waiting` until admitted. Admission matches the prompt against the radix
tree, pins the matched path, registers a pending node for the part it will compute (so
identical new prefixes are computed once), rebuilds the request's cache from the path's
handles and hands it to the `Generator` (generator.py), which prefills it in chunks and
then decodes it in the batch. When a prompt's prefill is done its KV goes into the tree at
once; when the request ends, the generated tokens' KV follows and the path is unpinned.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engine.generator import Generator, Output, Sequence
from engine.kv import CacheSnapshot, KVSegment, assemble, supports_segments
from engine.loader import LoadedModel
from engine.request import Finish, RequestFailed, SamplingParams, TokenEvent
from engine.sampling import make_processors, make_sampler, token_logprobs
from engine.text import TextStream
from radix.tree import Node, RadixTree, ReserveStatus

log = logging.getLogger("radix_mlx.engine")

# A request waits for an in-flight prefix only when it would reuse at least this many of
# its tokens; for a shorter overlap computing alongside is cheaper than queueing behind.
MIN_SHARED_TO_WAIT = 32
# Prompt tokens per step, unless configured. On a GPU every chunk has a fixed cost (a
# 2000-token prompt took 11.5 ms in one chunk and 28 ms in 512s on an H100), so chunks are
# big (mlx-lm's default step) and decodes stall for a few ms. MLX's CPU attention
# materializes every query-key score, so smaller chunks cost less in all (a 1042-token
# prompt took 5.9 s in one chunk and 4.4 s in 512s on 2 cores) and stall decodes less.
GPU_PREFILL_CHUNK = 2048
CPU_PREFILL_CHUNK = 512
# After being passed over this many admission rounds a request goes first (no starvation).
MAX_PASSED_OVER = 8


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """Length of the common prefix, by bisection on C-speed list comparisons."""
    low, high = 0, min(len(a), len(b))
    if a[:high] == b[:high]:
        return high
    while high - low > 1:  # a[:low] == b[:low] and a[:high] != b[:high]
        mid = (low + high) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid
    return low


def path_handles(node: Node) -> list[Any]:
    """The handles from the root down to `node` (junctions without state skipped)."""
    handles = []
    while node.parent is not None:
        if node.handle is not None:
            handles.append(node.handle)
        node = node.parent
    return handles[::-1]


class Cancelled(Exception):
    """Poisons the pending prefix of a request that went away; its waiters retry."""


@dataclass
class SchedulerLimits:
    max_batch_size: int
    prefill_batch_size: int
    prefill_chunk_tokens: int | None  # None: the device's default
    max_tokens_in_flight: int
    cache_bytes: int


@dataclass
class Counters:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens: int = 0
    requests_failed: int = 0
    steps: int = 0
    step_seconds: float = 0.0


class Request:
    """Engine-side state of one generation."""

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams,
                 emit: Callable[[object], None], loaded: LoadedModel,
                 on_dequeue: Callable[[], None] | None = None) -> None:
        self.id = request_id
        self.prompt = prompt
        self.params = params
        self._emit = emit
        self._on_dequeue = on_dequeue
        tokenizer = loaded.tokenizer
        self.text = TextStream(tokenizer, prompt, params.stop)
        self.sampler = make_sampler(params, loaded.vocab_size)
        self.processors = make_processors(params)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(tokenizer.eos_token_ids)
        self.stop_ids = frozenset(stop_ids)
        # The tokens fed as this request's prompt: the prompt, or after a failed step the
        # prompt plus what was generated before it.
        self.tokens = prompt
        self.generated: list[int] = []
        self.cached_tokens: int | None = None  # radix hit at first admission
        self.node: Node | None = None  # pinned: deepest tree node on this request's path
        self.depth = 0  # tokens covered by `node`
        self.pending: Node | None = None  # the prefix this request is computing for others
        self.uid: int | None = None
        self.sequence: Sequence | None = None  # the generator's side, while admitted
        self.prompt_done = False
        self.passed_over = 0
        self.suspect = False  # was in a failed step; runs alone until it succeeds
        # Computing its prompt without a reservation (another request's pending prefix
        # blocked one): requests sharing that prompt wait in `followers` until it is in
        # the tree, instead of computing it again (SGLang's in-batch prefix sharing).
        self.publishing = False
        self.followers: list[Request] = []
        self.cancelled = False

    def dequeue(self) -> None:
        """Report, once, that this request no longer counts against the queue limit."""
        if self._on_dequeue is not None:
            on_dequeue, self._on_dequeue = self._on_dequeue, None
            on_dequeue()

    def emit(self, event: object) -> None:
        self.dequeue()  # a request that ends before admission leaves the queue too
        self._emit(event)

    @property
    def tokens_reserved(self) -> int:
        """The most KV this request can hold: its prompt plus every token it may add."""
        return len(self.prompt) + self.params.max_tokens


class Scheduler:
    def __init__(self, loaded: LoadedModel, limits: SchedulerLimits) -> None:
        self.loaded = loaded
        self.limits = limits
        self.tree = RadixTree(limits.cache_bytes, free=lambda handle: None)
        self.segments = supports_segments(make_prompt_cache(loaded.model))
        self.inbox: queue.SimpleQueue[tuple[str, Request | None]] = queue.SimpleQueue()
        self.waiting: list[Request] = []
        self.active: dict[int, Request] = {}
        self.parked: set[Request] = set()  # waiting for another request's prefix
        self.counters = Counters()
        gpu = mx.default_device() == mx.gpu
        self._chunk = limits.prefill_chunk_tokens or (GPU_PREFILL_CHUNK if gpu else
                                                      CPU_PREFILL_CHUNK)
        # With nothing decoding there is no stream to keep smooth.
        self._idle_chunk = max(GPU_PREFILL_CHUNK, self._chunk) if gpu else self._chunk
        self.generator = Generator(loaded.model)
        self._uids = itertools.count()
        self._stopping = False

    # -- the loop ---------------------------------------------------------------------

    def run(self, until_idle: bool = False) -> None:
        while not self._stopping:
            idle = not self.active and not self.waiting and not self.parked
            if idle and until_idle and self.inbox.empty():
                return
            self._drain_inbox(block=idle and not until_idle)
            try:
                self._admit()
                if self.active:
                    self._step()
            except Exception as error:  # noqa: BLE001 - the engine must outlive any step
                self._recover(error)
        mx.synchronize()

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                kind, request = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if kind == "submit" or (kind == "wake" and request in self.parked):
                self.parked.discard(request)
                self.waiting.append(request)
            elif kind == "publish":
                self._republish(request)
            elif kind == "cancel":
                self._cancel(request)
            elif kind == "stop":
                self._stop_all()

    # -- admission --------------------------------------------------------------------

    def _admit(self) -> None:
        if not self.waiting:
            return
        suspects = [r for r in self.waiting if r.suspect]
        if suspects or any(r.suspect for r in self.active.values()):
            # Quarantine after a failed step: each member runs alone until it succeeds,
            # so the request that breaks a forward pass is found and fails by itself.
            # That holds for the last one too: a newcomer beside it could fail it.
            if suspects and not self.active:
                self.waiting.remove(suspects[0])
                self._try_start(suspects[0])
            return
        room = self.limits.max_batch_size - len(self.active)
        prefill_room = self.limits.prefill_batch_size - sum(
            not r.prompt_done for r in self.active.values())
        if room <= 0 or prefill_room <= 0:
            return
        token_room = self.limits.max_tokens_in_flight - sum(
            r.tokens_reserved for r in self.active.values())
        admitted = 0
        for request in self._admission_order():
            if room <= 0 or prefill_room <= 0:
                break
            # A request bigger than the whole limit still runs, alone.
            if request.tokens_reserved > token_room and self.active:
                if request.passed_over >= MAX_PASSED_OVER:
                    break  # admit nobody past it, so the batch drains until it fits
                continue
            self.waiting.remove(request)
            if self._try_start(request):
                admitted += 1
                room -= 1
                prefill_room -= 1
                token_room -= request.tokens_reserved
        if admitted:
            for request in self.waiting:
                request.passed_over += 1

    def _admission_order(self) -> list[Request]:
        """SGLang's cache-aware order: longest cached prefix first, except that requests
        passed over in too many rounds go first, oldest first."""
        starving = [r for r in self.waiting if r.passed_over >= MAX_PASSED_OVER]
        rest = [r for r in self.waiting if r.passed_over < MAX_PASSED_OVER]
        rest.sort(key=lambda r: -self.tree.peek(r.tokens[:-1]))
        return starving + rest

    def _try_start(self, request: Request) -> bool:
        """`_start`, except that a failure (say, no memory to rebuild the cache) fails
        this request alone and releases what it held."""
        try:
            return self._start(request)
        except Exception as error:  # reported to the request
            log.exception("admitting %s failed", request.id)
            if request.uid is not None:
                self.active.pop(request.uid, None)
            if request.pending is not None:
                self.tree.poison(request.pending, error)
                request.pending = None
            if request.node is not None:
                self.tree.unpin(request.node)
                request.node = None
            self._fail(request, error)
            return False

    def _start(self, request: Request) -> bool:
        """Pin the request's cached prefix and put it in the batch; False if it now waits
        for another request that is computing the same prefix."""
        tokens = request.tokens
        cacheable = tokens[:-1]
        while True:
            match = self.tree.match(cacheable)
            remaining = len(cacheable) - match.length
            if match.in_flight is not None and match.in_flight_shared >= min(
                    MIN_SHARED_TO_WAIT, remaining):
                self._wait_for(request, match.in_flight)
                return False
            if (leader := self._leader_for(cacheable, match)) is not None:
                self.parked.add(request)
                leader.followers.append(request)
                return False
            self.tree.pin(match.node)
            pending = None
            if remaining and match.in_flight is None:
                outcome = self.tree.reserve(match.node, cacheable[match.length:])
                if outcome.status is ReserveStatus.RETRY:
                    self.tree.unpin(match.node)
                    continue
                if outcome.status is ReserveStatus.WAIT:
                    self.tree.unpin(match.node)
                    self._wait_for(request, outcome.node)
                    return False
                if outcome.status is ReserveStatus.CREATED:
                    pending = outcome.node
            break
        request.node, request.depth, request.pending = match.node, match.length, pending
        request.publishing = pending is None and remaining > 0
        if request.cached_tokens is None:
            request.cached_tokens = match.length
            self.counters.prompt_tokens += len(request.prompt)
            self.counters.cached_tokens += match.length
        self.counters.prefill_tokens += len(tokens) - match.length
        cache = assemble(path_handles(match.node)) or make_prompt_cache(self.loaded.model)
        request.uid = next(self._uids)
        request.sequence = Sequence(
            request.uid, cache, tokens=tokens[:match.length], pending=tokens[match.length:],
            sampler=request.sampler, processors=request.processors,
            wants_logprobs=request.params.logprobs is not None)
        self.generator.add(request.sequence)
        request.prompt_done = False
        self.active[request.uid] = request
        request.dequeue()
        return True

    def _leader_for(self, cacheable: list[int], match: Any) -> Request | None:
        """A running request, computing its prompt without a reservation, that would give
        this one at least as much as a pending prefix is worth waiting for."""
        remaining = len(cacheable) - match.length
        for leader in self.active.values():
            if leader.publishing:
                shared = common_prefix_length(cacheable, leader.tokens[:-1]) - match.length
                if shared >= min(MIN_SHARED_TO_WAIT, remaining):
                    return leader
        return None

    def _wake_followers(self, request: Request) -> None:
        request.publishing = False
        for follower in request.followers:
            self.inbox.put(("wake", follower))
        request.followers.clear()

    def _wait_for(self, request: Request, node: Node) -> None:
        self.parked.add(request)
        node.add_done_callback(lambda _: self.inbox.put(("wake", request)))

    # -- one step ---------------------------------------------------------------------

    def _step(self) -> None:
        started = time.perf_counter()
        for output in self.generator.decode():
            request = self.active.get(output.uid)
            if request is not None:
                self._on_token(request, output)
        if self.generator.prefilling:
            # Small prefill chunks keep running streams flowing; with no stream to keep
            # flowing, big chunks finish a prompt sooner (fewer, better-shaped steps).
            result = self.generator.prefill(self._chunk if self.generator.decoding
                                            else self._idle_chunk)
            for sequence, error in result.failed:
                request = self.active.pop(sequence.uid)
                log.error("prefill of %s failed: %r", request.id, error)
                self._release(request, None)
                self._fail(request, error)
            for sequence in result.done:
                self._prompt_cached(self.active[sequence.uid])
        self.counters.steps += 1
        self.counters.step_seconds += time.perf_counter() - started

    def _prompt_cached(self, request: Request) -> None:
        """The prompt's KV (all but its last token) is computed: share it now, while this
        request goes on to decode."""
        request.prompt_done = True
        end = len(request.tokens) - 1
        cache = request.sequence.cache
        if request.pending is not None:
            # The pending node was created pinned for this request: that pin replaces
            # the one on the node it hangs from.
            self.tree.finalize(request.pending, self._handle(cache, request.depth, end))
            self.tree.unpin(request.node)
            request.node, request.depth = request.pending, end
            request.pending = None
        elif end > request.depth:
            self._publish(request, self._handle(cache, request.depth, end), end)
        else:
            self._wake_followers(request)
        self.tree.enforce_capacity()

    def _publish(self, request: Request, handle: KVSegment | CacheSnapshot, end: int) -> None:
        """Insert the prompt computed without a reservation. If another request's pending
        prefix is in the way, the part past it is dropped; retry once that prefix is done
        (the request still holds its whole cache while it decodes)."""
        node = self.tree.insert(request.node, request.tokens[request.depth:end], handle)
        self.tree.pin(node)
        self.tree.unpin(request.node)
        request.node, request.depth = node, len(node.path_tokens())
        blocker = self.tree.match(request.tokens[:end]).in_flight if request.depth < end else None
        if blocker is None:
            self._wake_followers(request)
        else:
            blocker.add_done_callback(lambda _: self.inbox.put(("publish", request)))

    def _republish(self, request: Request) -> None:
        if request.uid not in self.active or self.active[request.uid] is not request:
            return  # it ended meanwhile; _release published what it could
        if not self.segments:
            # A snapshot is of the whole state, which is past the prompt by now.
            self._wake_followers(request)
            return
        end = len(request.tokens) - 1
        cache = self.generator.cache_of(request.sequence)
        self._publish(request, self._handle(cache, request.depth, end), end)
        self.tree.enforce_capacity()

    def _on_token(self, request: Request, output: Output) -> None:
        token = output.token
        request.generated.append(token)
        self.counters.generated_tokens += 1
        request.suspect = False
        if token in request.stop_ids:  # a stop token: never shown as text
            self._finish(request, "stop", token)
            return
        text = request.text.add(token)
        logprob, top = None, ()
        if request.params.logprobs is not None:
            logprob, top = token_logprobs(output.logprobs, token, request.params.logprobs,
                                          self._decode_token)
        request.emit(TokenEvent(token, text, logprob, top))
        if request.text.matched_stop is not None:
            self._finish(request, "stop", request.text.matched_stop)
        elif len(request.generated) >= request.params.max_tokens:
            self._finish(request, "length")

    # -- ending -----------------------------------------------------------------------

    def _finish(self, request: Request, reason: str,
                matched_stop: str | int | None = None) -> None:
        del self.active[request.uid]
        self._release(request, self.generator.remove([request.uid])[request.uid])
        tail = "" if matched_stop is not None else request.text.finish()
        self._emit_finish(request, reason, tail, matched_stop)

    def _release(self, request: Request, sequence: Sequence | None) -> None:
        """Bulk-insert what the cache holds beyond the pinned node, then unpin."""
        if request.pending is not None:
            self.tree.poison(request.pending, Cancelled(request.id))
            request.pending = None
        if sequence is not None and request.prompt_done and len(sequence.tokens) > request.depth:
            handle = self._handle(sequence.cache, request.depth, len(sequence.tokens))
            self.tree.insert(request.node, sequence.tokens[request.depth:], handle)
        self.tree.unpin(request.node)
        request.node, request.sequence = None, None
        self.tree.enforce_capacity()
        self._wake_followers(request)

    def _cancel(self, request: Request) -> None:
        request.cancelled = True
        if request in self.waiting or request in self.parked:
            if request in self.waiting:
                self.waiting.remove(request)
            self.parked.discard(request)
            self._finish_cancelled(request)
        elif request.uid in self.active and self.active[request.uid] is request:
            del self.active[request.uid]
            self._release(request, self.generator.remove([request.uid])[request.uid])
            self._finish_cancelled(request)

    def _finish_cancelled(self, request: Request) -> None:
        self._emit_finish(request, "cancelled", "")

    @staticmethod
    def _emit_finish(request: Request, reason: str, tail: str,
                     matched_stop: str | int | None = None) -> None:
        request.emit(Finish(reason, tail, len(request.prompt), len(request.generated),
                            request.cached_tokens or 0, matched_stop))

    def _recover(self, error: Exception) -> None:
        """A step failed. Its batch state is unusable, so every member restarts from its
        tokens (the tree still has their prompts); members run alone until each passes a
        step, and one that fails alone gets the error."""
        log.error("step failed: %r; %d request(s) affected", error, len(self.active))
        victims = list(self.active.values())
        self.active.clear()
        self.generator = Generator(self.loaded.model)
        for request in victims:
            if request.pending is not None:
                self.tree.poison(request.pending, error)
                request.pending = None
            self.tree.unpin(request.node)
            request.node, request.uid, request.sequence = None, None, None
            self._wake_followers(request)
            if request.suspect:
                self._fail(request, error)
                continue
            request.suspect = True
            request.tokens = request.prompt + request.generated
            if len(request.generated) >= request.params.max_tokens:
                self._emit_finish(request, "length", request.text.finish())
            else:
                self.waiting.insert(0, request)

    def _fail(self, request: Request, error: Exception) -> None:
        self.counters.requests_failed += 1
        request.emit(RequestFailed(f"the engine failed this request: {error}"))

    def _stop_all(self) -> None:
        for request in [*self.active.values(), *self.waiting, *self.parked]:
            self._cancel(request)
        self._stopping = True

    def _decode_token(self, token: int) -> str:
        return self.loaded.tokenizer.decode([token])

    def _handle(self, cache: list[Any], start: int, end: int) -> KVSegment | CacheSnapshot:
        if self.segments:
            return KVSegment.from_cache(cache, start, end)
        return CacheSnapshot.from_cache(cache)
