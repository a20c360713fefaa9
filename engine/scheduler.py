"""The engine's worker: one thread that owns every MLX call.

A request's path through it (a `Generation`, generation.py):

1. `Submit` lands it in `waiting`. Each round, `admit` (admission.py) picks who starts.
   (A plain readout lands in `reading`: a list's are read together over their cached
   prefix, `_read`; where the tree lacks it, one of them goes on to `waiting` to compute
   it, and the rest wait for that. One that asks for its prompt's logprobs is first
   `scoring`: they are computed a chunk a round, `_score`, prompt_logprobs.py.)
2. `_start` matches its tokens against the radix tree (loading back from the disk tier
   any part of the match that was evicted there, see `_load_from_disk`). Either it waits for a prefix that
   another request is computing (it is *parked*, see below), or it waits in `preparing`
   while the images past its match are decoded off this thread, or its `TreeHold` pins the
   cached path and reserves the rest (tree_hold.py); its cache is assembled from the
   path's handles (kv.py) and it joins the `Generator` (generator.py), which prefills it
   in chunks and then decodes it in the batch.
3. When its prompt is computed, `TreeHold.publish` puts the prompt's KV in the tree at
   once, so others share it while this one decodes.
4. Each token goes through `Generation.accept`; when it ends (or is cancelled, or fails),
   `TreeHold.release` inserts the generated tokens' KV and unpins. One cancelled while
   its prompt is prefilled inserts the chunks computed so far.

Sharing a prefix being computed. Two requests that need the same new prefix compute it
once, by one of two paths:

- Through the tree: the first reserves the prefix (a PENDING node); the others' match
  runs into it (`MatchResult.in_flight`), and they park until it is finalized (or
  poisoned), then match again and find it cached.
- Through the scheduler: a request whose match runs into another's reservation that it
  shares only briefly computes its prompt alongside without a reservation of its own
  (reserving would mean waiting for the other). It is *publishing*: requests sharing its
  prompt become its `followers` and park until `publish` puts the prompt in the tree
  (SGLang's in-batch prefix sharing). If the other's reservation is still in the way
  then, the part past it is published once it is done (`Republish`).

Either way a parked request waits only when it would reuse at least `MIN_SHARED_TO_WAIT`
tokens, and is woken through the inbox (`Wake`) to be admitted again.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import mlx.core as mx

from engine.admission import (
    MAX_PASSED_OVER,
    SchedulerLimits,
    admit,
    rows_to_free,
    token_room,
    tokens_held,
)
from engine.api import (
    EngineNotReady,
    FinishReason,
    LastPosition,
    PromptImage,
    PromptLogprobs,
    Readout,
    SamplingParams,
    SchedulerCounters,
    SpeculationConfig,
)
from engine.disk_store import DiskStore
from engine.distributed import Announcement, RankGroup
from engine.draft_model import DraftModel
from engine.generation import Generation
from engine.generator import Generator, KVSource, Output, SequenceState, segment_spans
from engine.grammar import ConstraintFailed, Grammars
from engine.kv import KVStore
from engine.kv_quant import KVQuantization
from engine.loader import LoadedModel
from engine.mrope import MRoPE
from engine.prefill_budget import GRANULE, PrefillBudget
from engine.prompt_logprobs import PromptScoring
from engine.readout import last_positions
from engine.segment_file import BadSegmentFile
from engine.speculation import Drafts, PredictionLookup
from engine.tree_hold import HandleOf
from engine.vision import ImageFeed
from radix import MatchResult, Node, RadixTree, ReserveStatus
from radix.prefix import common_prefix_length

log = logging.getLogger("radix_mlx.engine")

# A request waits for a prefix being computed only when it would reuse at least this many
# of its tokens; for a shorter overlap computing alongside is cheaper than queueing behind.
MIN_SHARED_TO_WAIT = 32
# The most prompt tokens per step, unless configured (how many a step takes while others
# decode is set by time within it, see prefill_budget.py). On a GPU every chunk has a
# fixed cost (a 2000-token prompt took 11.5 ms in one chunk and 28 ms in 512s on an
# H100), so chunks are big (mlx-lm's default step) and decodes stall for a few ms. MLX's
# CPU attention materializes every query-key score, so smaller chunks cost less in all (a
# 1042-token prompt took 5.9 s in one chunk and 4.4 s in 512s on 2 cores) and stall
# decodes less.
GPU_PREFILL_CHUNK = 2048
CPU_PREFILL_CHUNK = 512
# A burst holds its computed prompts back until the rest are computed, unless one left
# still needs more than BURST_SPREAD times the tokens the cheapest computed one took and
# the prompts left would hold it back more than BURST_HOLD_SECONDS, at the measured cost
# of a prompt token (`Scheduler._burst_outgrown`). Without the time, on an H200 (1B
# shape, shared-prefix traffic: cached 64-token questions beside cold 2,064-token
# prompts) the bursts ended early and cost 13-27% of output for waits of ~0.1 s; on the
# 2-core CPU the same split saves a short chat 15-25 s behind a document.
BURST_SPREAD = 8
BURST_HOLD_SECONDS = 1.0
# A rebuild of the disk tier restores its files' copies on the engine's thread this long a
# turn (`Scheduler._restore_some`): 2,456 files took 0.4 s to rebuild in all on the 2-core
# CPU, headers read included, so a tier of 100k files would stall steps for seconds.
RESTORE_SLICE = 0.01
# How long a copy whose path runs through a node a request is computing waits for it
# (`RadixTree.restoring`) before it is deleted as having no place: longer than a long
# prompt takes to compute on 2 CPU cores.
RESTORE_PATIENCE = 300.0
# Readouts read together (`Scheduler._read`) hold their shared prefix once per row: a batch
# holds at most this many idle chunks of positions, prefix copies and padding included.
MAX_READ_CHUNKS = 16
# On a GPU, with nothing decoding, readouts may take this many idle chunks a step: nobody
# waits on the step, and a forward's fixed cost is what lists read one by one pay each (an
# H200 server whose chunk gave reads 8192 positions ran classify at ~4,900 sentences/s with
# four lists in flight; bench/results/nvidia-h200/classify-4-lists-1b-vocab49152). On the
# CPU a forward costs its tokens, not a fixed cost, and four chunks made a step four
# prefill steps long: 64 embeddings of SmolLM2 without OpenBLAS ran past the engine's
# step timeout, which stops the server.
GPU_IDLE_READ_CHUNKS = 4
# How much prefill may stall decoding streams (prefill_budget.py). On the 2-core CPU a
# 512-token chunk costs seconds, and a tenth of a step kept the shared-prefix workload's
# ITL p50 at mlx-lm's (187 vs 193 ms, from 257). On an H100 a 2048-token chunk costs
# tens of ms, and the same tenth starved prefill: the Llama-1B shape's shared-prefix run
# took 5.8 s instead of 2.9 s with prompts first (TTFT p99 4.6 s vs 1.0 s), classify
# 10.6 s instead of 4.5 s, at an ITL p50 of 9.6 vs 15.9 ms. So on a GPU prompts go first.
# On the CPU prompts first trades the other way (bench/results/cpu-amd-epyc-2c/
# multiturn-budget): multi-turn TTFT p50 0.35-0.48x mlx-lm's at 1.1-1.5x its ITL p50,
# no-share 1.0x throughput at 3.5-4x its ITL, where 0.1 keeps ITL below mlx-lm's and
# loses the TTFT lead.
CPU_PREFILL_STALL_RATIO = 0.1
GPU_PREFILL_STALL_RATIO = 100.0
# Message ends a prompt's prefill snapshots the whole cache state at, at most (each holds
# the state up to it: for a hybrid model its attention layers' KV, for a sliding-window
# one its global layers' KV).
MAX_MESSAGE_SNAPSHOTS = 4
# Tokens a message-end snapshot must spare (counted from the cached prefix or the snapshot
# before it) to be worth the extra forward it splits prefill into.
# On a GPU a forward's cost is mostly fixed: for a 4B-shaped Gemma 3 on an H200 each
# ~25-token chunk of a turn took 25-30 ms, and the two message ends of each image turn
# (after the reply it repeats, after the new question) made three forwards of what one
# computes (`bench/experiments/snapshot-join-4b`). Such a snapshot spares a later request
# at most that many tokens, less than a granule costs. On the CPU the cost is per token.
MIN_SNAPSHOT_SPAN = {"cpu": 0, "gpu": GRANULE}


def spaced_snapshots(message_ends: Sequence[int], depth: int, end: int,
                     min_span: int) -> list[int]:
    """The message ends in (`depth`, `end`) to snapshot at: each at least `min_span`
    tokens past the one before it (or `depth`), which is what it spares a request that
    shares the prompt up to it and no further; at most `MAX_MESSAGE_SNAPSHOTS` of them,
    each holding the whole state up to it: the first (a system prompt other conversations
    share) and the last ones (the turns the conversation's next request, or a retry of its
    last turn, shares)."""
    positions: list[int] = []
    for position in sorted(set(message_ends)):
        if depth < position < end and (
                position - (positions[-1] if positions else depth) >= max(min_span, 1)):
            positions.append(position)
    if len(positions) > MAX_MESSAGE_SNAPSHOTS:
        positions = positions[:1] + positions[1 - MAX_MESSAGE_SNAPSHOTS:]
    return positions

# -- the inbox: what other threads (and tree callbacks) ask of the worker ------------------

@dataclass(frozen=True)
class Submit:
    generation: Generation


@dataclass(frozen=True)
class SubmitAll:
    """Submits that arrive together (a classify list's prompts), so that a list of
    readouts is read in one forward rather than in whatever parts the worker took in
    first. Never under tensor parallelism, whose ranks share single `Submit`s."""

    generations: tuple[Generation, ...]


@dataclass(frozen=True)
class Wake:
    """The prefix a parked generation waits for is done (or failed): admit it again."""

    generation: Generation


@dataclass(frozen=True)
class Compiled:
    """The grammar a submitted generation needs was compiled off the loop (or failed
    to): it is taken in now, its admission costing no compile."""

    generation: Generation


@dataclass(frozen=True)
class Prepared:
    """A generation's images were decoded and run through the processor off the loop
    (`error`: or failed to): it waits for admission again, its prefill costing no such
    stall of every stream."""

    generation: Generation
    error: Exception | None


@dataclass(frozen=True)
class Republish:
    """The reservation that cut a publish short is done: publish the rest."""

    generation: Generation


@dataclass(frozen=True)
class Cancel:
    request_id: str


@dataclass(frozen=True)
class ClearCache:
    """Drop every unpinned node from both tiers; `done` (rank 0's) gets the memory bytes
    freed."""

    done: Future | None


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class BringBack:
    """Disk nodes to load back into memory on turns with nothing else to do, in order,
    while the tree has room for them without evicting anything (`RadixTree.memory_keys`
    at the last stop, most recently used first); `done` is set once that is over."""

    nodes: list[Node]
    done: threading.Event


@dataclass(frozen=True)
class Restore:
    """The disk tier's copies found at start, to become the tree's disk nodes
    (`RadixTree.restore_all`) on this thread: where requests served meanwhile cut a
    copy's path, restoring it splits their memory edges, whose KV only this thread may
    touch. `done` gets restore_all's result."""

    copies: list
    done: Future


@dataclass(frozen=True)
class SubmitRemote:
    """A `Submit` as rank 0 broadcasts it to the other ranks of a tensor-parallel group,
    which run the same generation with nobody to send its events to."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    message_ends: tuple[int, ...]
    owner: str  # admission's order depends on it, so every rank admits alike


class BroughtBack:
    """What the `BringBack`s under way have loaded: logged, and their waiters released,
    once they are over."""

    def __init__(self) -> None:
        self.waiters: list[threading.Event] = []
        self.nodes = self.nbytes = 0
        self.started = 0.0

    def begin(self, done: threading.Event) -> None:
        if not self.waiters:
            self.started = time.perf_counter()
        self.waiters.append(done)

    def add(self, nodes: int, nbytes: int) -> None:
        self.nodes += nodes
        self.nbytes += nbytes

    def finish(self) -> None:
        if self.nodes:
            log.info("disk cache: %d nodes (%.1f MiB) back in memory in %.2f s", self.nodes,
                     self.nbytes / 2**20, time.perf_counter() - self.started)
        for done in self.waiters:
            done.set()
        self.waiters, self.nodes, self.nbytes = [], 0, 0


@dataclass(frozen=True)
class HeldPrefix:
    """Readouts of one cacheable prefix the tree holds in memory (`Scheduler._read`): the
    node it ends in (pinned while they are read), and its length, each readout's tokens
    before its own part."""

    readouts: list[Generation]
    node: Node
    depth: int


Message = (Submit | SubmitAll | Wake | Compiled | Republish | Cancel | ClearCache | Stop
           | BringBack | Restore)
# What the scheduler's own tree callbacks post: every rank makes these itself.
LOCAL_MESSAGES = (Wake, Republish)


def to_remote(message: Message) -> object:
    """What the other ranks need of one of rank 0's messages (no futures, no callbacks)."""
    match message:
        case Submit(generation):
            return SubmitRemote(generation.id, generation.prompt, generation.params,
                                generation.message_ends, generation.owner)
        case ClearCache():
            return ClearCache(None)
    return message


class Scheduler:
    def __init__(self, loaded: LoadedModel, limits: SchedulerLimits,
                 group: RankGroup | None = None,
                 speculation: SpeculationConfig | None = None,
                 quantization: KVQuantization | None = None,
                 draft_model: DraftModel | None = None) -> None:
        self.loaded = loaded
        self.limits = limits
        self.speculation = speculation or SpeculationConfig()
        self.draft_model = draft_model  # the "model" draft source, where configured
        # Tensor parallelism (distributed.py): every rank runs this loop over rank 0's
        # inputs, and any failure is the whole group's, never recovered by one rank alone.
        self.group = group
        self.kv = KVStore(loaded.model, quantization)
        self.tree = RadixTree(limits.cache_bytes, free=self.kv.free)
        self.disk: DiskStore | None = None
        self.inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        # Set as the loop stops: nothing posted after it would ever be read (`post`).
        self._inbox_closed = False
        self._inbox_lock = threading.Lock()
        self.generations: dict[str, Generation] = {}  # every one not ended, by request id
        self.waiting: list[Generation] = []
        # Requests whose prompt logprobs are being computed, a chunk a turn, before they
        # wait for admission (`_score`), in arrival order.
        self.scoring: dict[Generation, PromptScoring] = {}
        self._score_after = 0.0  # perf_counter: decoding streams' share of time first
        # Readouts to read together with the others of their list (`_read`), in order.
        self.reading: list[Generation] = []
        # By prefix: the readout computing a list's prefix the general way, for the rest
        # of the list to read together over once it is published (`_wait_for_opener`).
        self.opening: dict[tuple[int, ...], Generation] = {}
        self.running: dict[int, Generation] = {}  # by the generator's uid
        self.parked: set[Generation] = set()  # waiting for a prefix being computed
        self.compiling: set[Generation] = set()  # waiting for their grammar (`Compiled`)
        self.preparing: set[Generation] = set()  # waiting for their images (`Prepared`)
        self.counters = SchedulerCounters()
        self._deliver: Callable[[], None] = lambda: None  # set by `run`
        gpu = mx.default_device() == mx.gpu
        chunk = limits.prefill_chunk_tokens or (GPU_PREFILL_CHUNK if gpu else CPU_PREFILL_CHUNK)
        stall_ratio = limits.prefill_stall_ratio
        if stall_ratio is None:
            stall_ratio = GPU_PREFILL_STALL_RATIO if gpu else CPU_PREFILL_STALL_RATIO
        self.idle_read_chunks = GPU_IDLE_READ_CHUNKS if gpu else 1
        # With nothing decoding there is no stream to keep smooth. A burst's short prompts
        # go in one forward of up to mlx-lm's prefill step, each within the chunk (on the
        # CPU the chunk bounds one prompt's attention, whose scores grow with its own
        # length, not with the rows beside it). With the CPU's 512 tokens in all, four
        # chats' next turns (~150 tokens each) took two forwards, and the rows of the
        # first waited out the second (0.4-0.6 s on 2 cores) after their first tokens:
        # multi-turn ITL p50 84 ms against mlx-lm's 76, in one forward 77, for first
        # tokens that all come at the end of it (docs/benchmarks.md).
        self.idle_together = max(GPU_PREFILL_CHUNK, chunk)
        self.prefill_budget = PrefillBudget(
            stall_ratio, limits.prefill_stall_floor, chunk,
            idle_chunk=self.idle_together if gpu else chunk)
        self.generator = Generator(loaded.model, self._take_snapshot, self.counters,
                                   quantization, self._mrope())
        # Prompts that find the engine with nothing decoding are all prefilled before any
        # of them decodes (see `_step`).
        self.burst = False
        self.grammars = Grammars(loaded.tokenizer, loaded.vocab_size)
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="radix-mlx-grammar")
        self._preparer = ThreadPoolExecutor(1, thread_name_prefix="radix-mlx-images")
        self._uids = itertools.count()
        self._stopping = False
        self._bringing_back: collections.deque[Node] = collections.deque()
        self._brought_back = BroughtBack()
        # The disk tier's rebuilds under way (`Restore`): `RadixTree.restoring` and its
        # waiter, run a slice of each turn.
        self._restoring: collections.deque[tuple[Iterator[bool], Future]] = collections.deque()
        self._restore_waits = False  # the oldest waits for a node a request computes

    def new_generation(self, request_id: str, prompt: list[int], params: SamplingParams,
                       emit: Callable[[object], None],
                       on_dequeue: Callable[[], None] | None = None,
                       message_ends: tuple[int, ...] = (),
                       images: tuple[PromptImage, ...] = (),
                       owner: str | None = None) -> Generation:
        """A generation for this model and tree; the caller submits it (`Submit`)."""
        return Generation(request_id, prompt, params, emit, self.loaded.tokenizer,
                          self.loaded.vocab_size, self.tree, on_dequeue, message_ends, images,
                          owner)

    def attach_disk(self, store: DiskStore) -> None:
        """Give the tree its disk tier (before `run`): from now on what it publishes is
        copied to disk, and memory eviction keeps copied nodes there."""
        self.disk = store
        self.tree.store = store
        store.evaluate = self.kv.after_settle

    def restore(self, copies: list) -> tuple[int, list]:
        """`RadixTree.restore_all(copies)` on this loop's thread, between steps. Called
        from another thread (the disk tier's rebuild)."""
        done: Future = Future()
        if not self.post(Restore(copies, done)):
            raise EngineNotReady("the engine stopped")  # the files stay for the next start
        return done.result()

    def bring_back(self, nodes: list[Node]) -> None:
        """Load `nodes` (disk nodes, most wanted first) back into memory as far as the
        tree has room, on turns with nothing else to do; returns when that is over or
        the scheduler stops. Called from another thread (the disk tier's rebuild)."""
        done = threading.Event()
        self.inbox.put(BringBack(nodes, done))
        while not done.wait(0.5) and not self._stopping:
            pass

    # -- the loop ---------------------------------------------------------------------

    def run(self, until_idle: bool = False,
            beat: Callable[[], None] = lambda: None,
            deliver: Callable[[], None] = lambda: None) -> None:
        """Serve until `Stop` (or, warming up, until nothing is left to do: then every
        rank feeds itself the same requests). `beat` is called at every turn, for a
        watchdog. `deliver` sends on the events put so far; a step calls it between its
        decode and its prompts' forward, so decoded tokens do not wait for that forward.
        Under tensor parallelism a failed step raises: the group is lost."""
        self._deliver = deliver
        shared = self.group is not None and not until_idle
        announced: tuple[Announcement, list[Message]] | None = None
        while not self._stopping:
            beat()
            if announced is not None:  # what rank 0 took in at the last turn
                self._handle_all(self._inputs(*announced))
                announced = None
                if self._stopping:
                    break
            idle = (not self.running and not self.waiting and not self.parked
                    and not self.reading and not self.scoring)
            if (idle and until_idle and self.inbox.empty() and not self.compiling
                    and not self.preparing):
                return
            if idle:  # at rest within budget: a chain loaded over it, its request gone
                self.tree.enforce_capacity()
            messages = self._take_inbox(block=idle and not until_idle and
                                        not self._bringing_back and
                                        (not self._restoring or self._restore_waits) and
                                        (not shared or self.group.leader))
            if shared:
                # A busy group receives this turn's inputs at the next turn, so that the
                # step between overlaps (RankGroup.announce); an idle one has no step,
                # and waits for them now.
                local = [m for m in messages if isinstance(m, LOCAL_MESSAGES)]
                inputs = [m for m in messages if not isinstance(m, LOCAL_MESSAGES)]
                announcement = self.group.announce([to_remote(m) for m in inputs] or None)
                if idle:
                    messages = local + self._inputs(announcement, inputs)
                else:
                    messages, announced = local, (announcement, inputs)
            self._handle_all(messages)
            if self._restoring:
                self._restore_some()
            if self.disk is not None and (failed := self.disk.take_failed()):
                self.tree.forget_copies(failed)
            try:
                self.kv.settle()  # what cancelled requests released, before the step
                self._make_room()
                self._share_rows()
                self._score()
                admit(self.waiting, self.running.values(), self.limits,
                      lambda g: self.tree.peek(g.cacheable), self._try_start)
                self._drop_stale_background()
                if self.running or self.reading:
                    self._step()
                elif self._bringing_back and not self.waiting and not self.parked:
                    self._bring_back_one()
            except Exception as error:  # the engine must outlive any step, alone
                if self.group is not None:
                    raise
                self._recover(error)
        with self._inbox_lock:
            self._inbox_closed = True
            unread = self._take_inbox(block=False)
        for message in unread:
            self._answer_unread(message)
        self._compiler.shutdown(wait=False, cancel_futures=True)
        self._preparer.shutdown(wait=False, cancel_futures=True)
        self.kv.settle()
        mx.synchronize()

    def post(self, message: Message) -> bool:
        """Put a message from another thread in the inbox; False once the loop has
        stopped, when nothing would ever read it: the caller answers it instead."""
        with self._inbox_lock:
            if self._inbox_closed:
                return False
            self.inbox.put(message)
            return True

    @staticmethod
    def _answer_unread(message: Message) -> None:
        """What reached the inbox as the loop stopped: a request ends as those it stopped
        did (cancelled); a clear is refused, as after the stop (the disk tier keeps
        what it did not clear)."""
        match message:
            case Submit(generation):
                generation.finish("cancelled")
            case SubmitAll(generations):
                for generation in generations:
                    generation.finish("cancelled")
            case ClearCache(done) if done is not None:
                done.set_exception(EngineNotReady("the engine stopped"))
            case Restore(_, done):  # the files stay for the next start
                done.set_exception(EngineNotReady("the engine stopped"))

    def _take_inbox(self, block: bool) -> list[Message]:
        """Everything in the inbox; if `block`, waiting up to half a second for a first."""
        messages = []
        while True:
            try:
                messages.append(self.inbox.get(timeout=0.5) if block
                                else self.inbox.get_nowait())
            except queue.Empty:
                return messages
            block = False

    def _inputs(self, announcement: Announcement, inputs: list[Message]) -> list[Message]:
        """Rank 0's inputs of one turn on every rank: rank 0 keeps its own (`inputs`,
        futures and callbacks included); the others get what it shared."""
        shared = self.group.receive(announcement) or []
        return inputs if self.group.leader else [self._from_leader(m) for m in shared]

    def _from_leader(self, message: object) -> Message:
        if isinstance(message, SubmitRemote):
            return Submit(self.new_generation(
                message.request_id, message.prompt, message.params, lambda event: None,
                message_ends=message.message_ends, owner=message.owner))
        return message

    def _handle_all(self, messages: list[Message]) -> None:
        for message in messages:
            self._handle(message)

    def _handle(self, message: Message) -> None:
        match message:
            case Submit(generation):
                log.debug("queued %s: %d prompt tokens", generation.id, len(generation.prompt))
                self.generations[generation.id] = generation
                if not self._compiling_first(generation):
                    self._line_up(generation)
            case SubmitAll(generations):
                for generation in generations:
                    self._handle(Submit(generation))
            case Compiled(generation) if generation in self.compiling:
                self.compiling.discard(generation)
                self._line_up(generation)
            case Prepared(generation, error) if generation in self.preparing:
                self.preparing.discard(generation)
                if error is None:
                    self.waiting.append(generation)
                else:
                    self._fail(generation, error)
            case Wake(generation) if generation in self.parked:
                self.parked.discard(generation)
                self.waiting.append(generation)
            case Republish(generation):
                self._republish(generation)
            case Cancel(request_id) if request_id in self.generations:
                self._cancel(self.generations[request_id])
            case Restore(copies, done):
                self._restoring.append((self.tree.restoring(copies, RESTORE_PATIENCE), done))
            case BringBack(nodes, done):
                self._bringing_back.extend(nodes)
                self._brought_back.begin(done)
                if not self._bringing_back:
                    self._brought_back.finish()
            case ClearCache(done):
                # Guesses in flight would put back what the clear lets go of.
                for generation in [g for g in self.generations.values() if g.background]:
                    self._cancel(generation)
                freed = self.tree.clear()
                if done is not None:
                    done.set_result(freed)
            case Stop():
                self._stop_all()

    def _line_up(self, generation: Generation) -> None:
        """Queue a submitted generation for what it asks: prompt logprobs, a readout of a
        list, or admission."""
        if generation.params.prompt_logprobs is not None:
            self.scoring[generation] = PromptScoring(
                self.loaded.model, self.loaded.tokenizer, generation.prompt,
                generation.params.prompt_logprobs)
        elif self._reads_together(generation):
            self.reading.append(generation)
        else:
            self.waiting.append(generation)

    def _compiling_first(self, generation: Generation) -> bool:
        """Whether `generation` waits for its grammar, compiled on a thread of its own: a
        schema of thousands of properties compiles for seconds, and on this thread every
        stream stood still meanwhile, past step_timeout for a few such requests, which
        then failed the engine. Tensor-parallel ranks compile here: they must take
        requests in alike."""
        constraint = generation.params.constraint
        if (constraint is None or self.group is not None
                or self.grammars.compiled(constraint.grammar)):
            return False
        self.compiling.add(generation)
        self._compiler.submit(self.grammars.compile, constraint.grammar).add_done_callback(
            lambda _: self.post(Compiled(generation)))
        return True

    # -- starting ---------------------------------------------------------------------

    def _score(self) -> None:
        """Compute the next chunk of the first scoring request's prompt logprobs (a chunk
        of the size a step prefills beside decoding streams, whatever decodes, so a
        prompt's logprobs do not depend on the traffic); once it has them all, it waits
        for admission. Beside decoding streams a chunk stalls them no more than prefill
        may (its stall ratio): the next waits until they have decoded for its time over
        that ratio. A chunk a turn held streams 4-17 s apart on the CPU (7,000 prompt
        tokens at 20 alternatives each)."""
        if not self.scoring:
            return
        paced = self.generator.decoding and self.group is None  # ranks decide alike
        if paced and time.perf_counter() < self._score_after:
            return
        generation, scoring = next(iter(self.scoring.items()))
        started = time.perf_counter()
        try:
            if not scoring.done:  # a one-token prompt has nothing to score
                scoring.advance(self.prefill_budget.chunk)
            if paced:
                spent = time.perf_counter() - started
                self._score_after = started + spent * (1 + 1 / self.prefill_budget.stall_ratio)
        except Exception as error:  # reported to the request
            if self.group is not None:
                raise
            del self.scoring[generation]
            self._fail(generation, error)
            return
        if scoring.done:
            del self.scoring[generation]
            generation.emit(PromptLogprobs(tuple(scoring.events)))
            self.waiting.append(generation)

    def _try_start(self, generation: Generation) -> bool:
        """`_start`, except that a failure (say, no memory to rebuild the cache) fails
        this generation alone and releases what it held."""
        try:
            return self._start(generation)
        except Exception as error:  # reported to the request
            if self.group is not None:
                raise  # the ranks may no longer agree on what they hold
            log.exception("admitting %s failed", generation.id)
            if generation.sequence is not None:
                self.running.pop(generation.sequence.uid, None)
                generation.sequence = None
            generation.hold.abandon(error)
            self._fail(generation, error)
            return False

    def _start(self, generation: Generation) -> bool:
        """Hold the generation's cached prefix and put it in the batch; False if it now
        waits for a prefix being computed by another request."""
        cacheable = generation.cacheable
        # Built anew at every admission, over what was generated before a failed step.
        constraint = generation.params.constraint
        grammar = self.grammars.state(constraint, generation.generated) if constraint else None
        while True:
            match = self.tree.match(cacheable)
            if match.disk:
                self._load_from_disk(match.disk)
                continue  # match again: what was loaded is in memory now
            if (node := self._shared_in_flight(cacheable, match)) is not None:
                if not generation.background:
                    self._hurry(next((g for g in self.running.values()
                                      if g.hold.reservation is node), None))
                self._wait_for(generation, node)
                return False
            if (leader := self._leader_for(cacheable, match)) is not None:
                if not generation.background:
                    self._hurry(leader)
                self.parked.add(generation)
                leader.followers.append(generation)
                return False
            if self._preparing_images(generation, match.length):
                return False
            if generation.cached_tokens is None:  # before a reservation of its own
                generation.cache_miss = self.tree.explain_miss(cacheable, match.length)
            outcome = generation.hold.start(match, cacheable)
            if outcome is None:
                break
            if outcome.status is ReserveStatus.WAIT:
                self._wait_for(generation, outcome.node)
                return False  # RETRY: the match is stale; match again
        hold = generation.hold
        generation.publishing = hold.reservation is None and hold.depth < len(cacheable)
        if generation.cached_tokens is None:
            generation.cached_tokens = hold.depth
            self.counters.prompt_tokens += len(generation.prompt)
            self.counters.cached_tokens += hold.depth
            self.counters.constrained_requests += constraint is not None
        tokens = generation.tokens
        self.counters.prefill_tokens += len(tokens) - hold.depth
        generation.snapshots = []
        # A model with segments gets its cache built by the generator when it needs one.
        prefix = self.kv.segments_of(hold.node)
        readout = generation.params.readout
        sequence = SequenceState(
            next(self._uids), self.kv.assemble(hold.node) if prefix is None else None,
            tokens=tokens[:hold.depth], unfed=tokens[hold.depth:],
            snapshot_at=self._snapshot_positions(generation), prefix=prefix,
            sampler=generation.sampler,
            penalties=generation.penalties,
            wants_logprobs=generation.params.logprobs is not None or readout is not None,
            top_logprobs=(readout.top_logprobs if readout is not None
                          else generation.params.logprobs or 0), grammar=grammar,
            asked=mx.array(readout.token_ids) if readout and readout.token_ids else None,
            wants_hidden=readout is not None and readout.hidden,
            background=generation.background,
            images=ImageFeed(self.loaded.vision, generation.images, self.counters,
                             generation.pixels) if generation.images else None,
            drafts=self._drafts(generation))
        generation.sequence = sequence
        self.generator.add(sequence)
        generation.prompt_done = False
        self.running[sequence.uid] = generation
        generation.dequeue()
        return True

    def _preparing_images(self, generation: Generation, cached: int) -> bool:
        """Whether `generation` waits for its images past the `cached` tokens the tree
        holds of its prompt, decoded and run through the processor on a thread of their
        own: on this thread every stream stood still meanwhile, ~60 ms of CPU for each
        new photo. Tensor parallelism has no vision models."""
        missing = [index for index, image in enumerate(generation.images)
                   if image.start + image.length > cached and index not in generation.pixels]
        if not missing or self.group is not None:
            return False
        vision = self.loaded.vision

        def prepare() -> None:
            for index in missing:
                generation.pixels[index] = vision.pixels(generation.images[index].file.data)

        def prepared(done: Future) -> None:
            if not done.cancelled():  # cancelled: the loop stopped
                self.post(Prepared(generation, done.exception()))

        self.preparing.add(generation)
        self._preparer.submit(prepare).add_done_callback(prepared)
        return True

    # -- readouts read together -------------------------------------------------------

    def _reads_together(self, generation: Generation) -> bool:
        """Whether a submitted generation is a readout to read in a batch with the others
        of its list (`_read`): greedy and plain (no penalties or logit bias, constraint, prompt
        logprobs or images), on one rank (tensor-parallel ranks would all need the same
        batches), on a model with plain KV caches, its own part (past what it may cache)
        no longer than a forward takes."""
        params = generation.params
        return (params.readout is not None and self.group is None and self.kv.segments
                and generation.sampler is None and generation.penalties is None
                and params.constraint is None and params.prompt_logprobs is None
                and not generation.images
                and len(generation.tokens) - len(generation.cacheable)
                <= self.prefill_budget.idle_chunk)

    def _read(self, budget: int) -> int:
        """Read the readouts in `reading`, up to `budget` positions (padding included):
        those of the same params whose cacheable prefixes the tree holds, in batches, each
        one forward with every row over its own prefix as the tree holds it (a list's rows
        share theirs), nothing cached, their events out at once
        (`Generator.read_together`). Readouts whose prefix the tree lacks wait, a list
        together, for one of them to compute it (`_wait_for_opener`). Returns the
        positions fed."""
        fed = 0
        passed: set[int] = set()  # readouts waiting for their prefix
        while fed < budget:
            first = next((g for g in self.reading if id(g) not in passed), None)
            if first is None:
                break
            with self._held_prefixes(first.params, passed) as held:
                fed += self._read_held(first.params.readout, held, budget - fed)
        return fed

    def _read_held(self, readout: Readout, held: list[HeldPrefix], budget: int) -> int:
        """Read one batch of the readouts of `held` (`_read`); the positions fed."""
        if readout.cache_only:  # held whole: nothing to compute
            for prefix in held:
                self._leave_reading(prefix.readouts)
                for generation in prefix.readouts:
                    self._finish_read(generation, prefix.depth, None)
            return 0
        if not held:
            return 0
        batch, width = self._read_batch(held, budget)
        self._leave_reading([generation for generation, _ in batch])
        segments = {id(prefix.node): self.kv.segments_of(prefix.node) for _, prefix in batch}
        try:
            readings = self.generator.read_together(
                [segment_spans(segments[id(prefix.node)], prefix.depth)
                 for _, prefix in batch],
                [g.tokens[prefix.depth:] for g, prefix in batch], readout.top_logprobs,
                readout.token_ids, readout.hidden)
        except Exception:  # one by one, the general way fails the culprit alone
            log.exception("reading %d prompts together failed", len(batch))
            self.waiting.extend(generation for generation, _ in batch)
            return 0
        lasts = last_positions(readings, self.loaded.tokenizer)
        for (generation, prefix), last in zip(batch, lasts):
            self._finish_read(generation, prefix.depth, last)
        return width * len(batch)

    @contextlib.contextmanager
    def _held_prefixes(self, params: SamplingParams, passed: set[int]
                       ) -> Iterator[list[HeldPrefix]]:
        """The readouts in `reading` of `params` (not in `passed`) whose cacheable prefix
        the tree holds in memory, by prefix, each prefix's node pinned from when it is
        found until the block ends: loading the next prefix from disk makes room in
        memory, and would otherwise evict one already found, whose readouts would then
        read over what is left of it. Prefixes on disk are loaded back first; a prefix
        the tree lacks has its readouts wait for an opener (added to `passed`), or sent
        the general way."""
        groups: dict[tuple[int, ...], list[Generation]] = {}
        for generation in self.reading:
            if id(generation) not in passed and (generation.params is params
                                                 or generation.params == params):
                groups.setdefault(tuple(generation.cacheable), []).append(generation)
        held: list[HeldPrefix] = []
        try:
            for key, group in groups.items():
                prefix = group[0].cacheable
                match = self.tree.match(prefix)
                if match.disk:
                    self._load_from_disk(match.disk)
                    match = self.tree.match(prefix)  # what was loaded is in memory now
                if match.disk or match.length < len(prefix):
                    if self._wait_for_opener(prefix, group):
                        passed.update(map(id, group))
                    continue
                self.opening.pop(key, None)
                self.tree.pin(match.node)
                held.append(HeldPrefix(group, match.node, len(prefix)))
            yield held
        finally:
            for prefix in held:
                self.tree.unpin(prefix.node)

    def _finish_read(self, generation: Generation, cached: int, last: LastPosition | None
                     ) -> None:
        """End a readout read over `cached` tokens the tree held: `last` is what its
        forward read (None: a cache-only readout the tree held whole, read by none)."""
        generation.cached_tokens = cached
        self.counters.prompt_tokens += len(generation.prompt)
        self.counters.cached_tokens += cached
        if last is not None:
            self.counters.prefill_tokens += len(generation.tokens) - cached
            self.counters.generated_tokens += 1
            generation.emit(last)
        self._forget(generation)
        generation.finish("length")

    def _wait_for_opener(self, prefix: list[int], group: list[Generation]) -> bool:
        """A list whose prefix the tree lacks: one of its prompts, the opener, takes the
        general way (`waiting`), which computes and publishes the prefix, while the rest
        wait here to be read together over it, as the lists after them will be. Sending
        them all the general way would admit, hold and decode each (a round's first lists
        of 64, four in flight on an H200, are 256 such requests). True while they wait; a
        new opener replaces one that ended first (cancelled or failed). An opener whose
        prompt was computed while the tree still lacks the prefix (no room to keep it, or
        evicted) sends them all the general way: False."""
        key = tuple(prefix)
        opener = self.opening.get(key)
        if opener is not None and opener.prompt_done:
            del self.opening[key]
            self._leave_reading(group)
            self.waiting.extend(group)
            return False
        if opener is None or self.generations.get(opener.id) is not opener:
            self._leave_reading(group[:1])  # first: a reading left empty forgets openers
            self.waiting.append(group[0])
            self.opening[key] = group[0]
        return True

    def _read_batch(self, held: list[HeldPrefix], budget: int
                    ) -> tuple[list[tuple[Generation, HeldPrefix]], int]:
        """The readouts of `held` (with the prefix each reads over) to read in one
        forward, and its width: shortest own part first, as many as `budget` positions
        take, padding included, and, with their prefixes' copies (each row holds the
        deepest prefix's columns), `MAX_READ_CHUNKS` idle chunks or the KV the memory plan
        has room for beside the running requests (an idle chunk at least); at least one.
        A prefix's rows side by side: the batch copies a prefix once for all of them."""
        chunk = self.prefill_budget.idle_chunk
        room = token_room(self.limits, self.running.values())
        most = min(MAX_READ_CHUNKS * chunk, max(chunk, room))
        rows = sorted(((generation, prefix, index) for index, prefix in enumerate(held)
                       for generation in prefix.readouts),
                      key=lambda row: len(row[0].tokens) - row[1].depth)
        batch: list[tuple[Generation, HeldPrefix, int]] = []
        width = depth = 0
        for generation, prefix, index in rows:
            own = len(generation.tokens) - prefix.depth
            deepest = max(depth, prefix.depth)
            count = len(batch) + 1
            if batch and (own * count > budget or (deepest + own) * count > most):
                break
            batch.append((generation, prefix, index))
            width, depth = own, deepest
        batch.sort(key=lambda row: row[2])  # stable: shortest first within a prefix
        return [(generation, prefix) for generation, prefix, _ in batch], width

    def _leave_reading(self, generations: list[Generation]) -> None:
        leaving = set(map(id, generations))
        self.reading = [g for g in self.reading if id(g) not in leaving]
        if not self.reading:
            self.opening.clear()  # the lists their openers opened are all read

    def _mrope(self) -> MRoPE | None:
        """A Qwen-VL model's M-RoPE positions (engine/mrope.py), which the generator sets
        for the rows with images."""
        return None if self.loaded.vision is None else self.loaded.vision.mrope

    def _drafts(self, generation: Generation) -> Drafts | None:
        """The generation's speculative decoding, unless its mode is off or it cannot
        have any: a model whose cache cannot be rolled back (sliding windows, recurrent
        state), penalties or a logit bias (each position's logits would need its own
        context), or a prefill-only request. Drafting goes on across a failed step's
        re-admission."""
        params = generation.params
        mode = params.speculation or self.speculation.mode
        if params.prediction and params.speculation is None and mode == "off":
            mode = "auto"  # a prediction asks for drafts; auto, should it be wrong
        if (mode == "off" or not self.kv.segments or generation.penalties is not None
                or params.readout is not None or params.max_tokens == 0):
            return None
        if generation.drafts is None:
            session = None
            if self.draft_model is not None and "model" in self.speculation.sources:
                session = self.draft_model.session()
            prediction = (PredictionLookup(params.prediction, len(generation.prompt))
                          if params.prediction else None)
            generation.drafts = Drafts(mode, self.speculation.max_draft,
                                       self.speculation.sources, self.tree.continuation,
                                       end=len(generation.prompt) + params.max_tokens,
                                       vocab_size=self.loaded.vocab_size, model=session,
                                       prediction=prediction,
                                       padded=self.generator.pads_verifies)
        return generation.drafts

    def _snapshot_positions(self, generation: Generation) -> list[int]:
        """Where prefill pauses to snapshot the cache: for a model whose cache is reused
        only as whole-state snapshots, the prompt's message ends past its cached prefix
        and short of the prompt's own end (published anyway), as `spaced_snapshots`
        picks them; and the end of what the tree may keep where that is short of the
        prompt's end (a readout's shared prefix), since the cache holds that state only
        as prefill passes it (`_publish`)."""
        if self.kv.segments:
            return []
        span = MIN_SNAPSHOT_SPAN["gpu" if self.generator.pipelined else "cpu"]
        depth, end = generation.hold.depth, len(generation.cacheable)
        positions = spaced_snapshots(generation.message_ends, depth, end, span)
        if depth < end < len(generation.tokens) - 1:
            positions.append(end)
        return positions

    def _take_snapshot(self, sequence: SequenceState) -> None:
        """Prefill reached one of `sequence.snapshot_at`: snapshot the state there, to publish
        with the prompt, unless this prompt's snapshots would not fit the tree's budget."""
        generation = self.running[sequence.uid]
        held = sum(snapshot.nbytes for _, snapshot in generation.snapshots)
        if held + sum(layer.nbytes for layer in sequence.cache) <= self.tree.capacity_bytes:
            position = len(sequence.tokens)
            generation.snapshots.append((position, self.kv.handle(sequence.cache, 0, position)))
            self.kv.settle()  # prefill goes on writing into this cache

    def _load_from_disk(self, nodes: list[Node]) -> None:
        """Load disk nodes (a match's `disk`, top first) and put them back in memory
        (pinned while loading, so making room on disk cannot delete them). A copy that
        cannot be read is dropped with its subtree, and all of them where the disk
        itself fails (an OSError): the tokens they held are computed instead, a cache
        being no reason to fail a request."""
        deepest = nodes[-1]
        self.tree.pin(deepest)
        try:  # whatever the load raises, the pin goes
            try:
                handles = self.disk.load(node.stored for node in nodes)
                unreadable = None
            except BadSegmentFile as error:
                handles = error.loaded
                unreadable = nodes[len(handles)]
            except OSError:
                log.exception("disk cache: loading %d nodes failed; computing them instead",
                              len(nodes))
                handles, unreadable = [], nodes[0]
            for node, handle in zip(nodes, handles):
                self.tree.promote(node, handle)
        finally:
            self.tree.unpin(deepest)
        if unreadable is not None:
            self.tree.drop(unreadable)

    def _bring_back_one(self) -> None:
        """Load the next node `BringBack` asked for, if the tree has room for it without
        evicting; once one does not fit, the rest (less recently used) stay on disk."""
        chain = self.tree.disk_chain(self._bringing_back.popleft())
        if chain:
            need = sum(node.stored.nbytes for node in chain)
            stats = self.tree.stats()
            if stats.total_bytes + need > stats.capacity_bytes:
                self._bringing_back.clear()
            else:
                try:
                    self._load_from_disk(chain)
                except Exception:  # requests load what they match anyway
                    log.exception("disk cache: bringing back into memory stopped")
                    self._bringing_back.clear()
                else:
                    self._brought_back.add(len(chain), need)
                    self.disk.stats.brought_back_nodes += len(chain)
        if not self._bringing_back:
            self._brought_back.finish()

    @staticmethod
    def _shared_in_flight(cacheable: list[int], match: MatchResult) -> Node | None:
        """Another request's reservation worth waiting for (it covers enough of ours)."""
        remaining = len(cacheable) - match.length
        if match.in_flight is not None and match.in_flight_shared >= min(
                MIN_SHARED_TO_WAIT, remaining):
            return match.in_flight
        return None

    def _leader_for(self, cacheable: list[int], match: MatchResult) -> Generation | None:
        """A running generation, computing its prompt without a reservation, that would
        give this one at least as much as a reservation is worth waiting for."""
        remaining = len(cacheable) - match.length
        for leader in self.running.values():
            if leader.publishing:
                shared = common_prefix_length(cacheable, leader.cacheable) - match.length
                if shared >= min(MIN_SHARED_TO_WAIT, remaining):
                    return leader
        return None

    @staticmethod
    def _hurry(computing: Generation | None) -> None:
        """A client now waits for the prefix `computing` computes: if that is background
        work, it is fed as a client's from now on (in turn, not with what is left)."""
        if computing is not None and computing.sequence is not None:
            computing.sequence.background = False

    def _wait_for(self, generation: Generation, node: Node) -> None:
        self.parked.add(generation)
        node.add_done_callback(lambda _: self.inbox.put(Wake(generation)))

    def _wake_followers(self, generation: Generation) -> None:
        generation.publishing = False
        for follower in generation.followers:
            self.inbox.put(Wake(follower))
        generation.followers.clear()

    # -- one step ---------------------------------------------------------------------

    def _step(self) -> None:
        """Decode the batch one token, then prefill what the budget allows.

        A burst: prompts that arrive while nothing decodes (an idle engine, or the turns of
        chats that ended together) are all prefilled, as many per forward as fit, before
        any of them decodes, as mlx-lm's `BatchGenerator` does. Decoding the first while
        the rest are prefilled would stall each started stream by the others' prompts,
        and one forward a prompt costs a GPU its fixed per-forward time for each. A burst
        takes what the admission limits let in (at most `max_batch_size` rows); requests
        arriving once its rows decode wait for the prefill budget as usual. A burst whose
        prompts differ by far in size ends once the short ones are computed
        (`_burst_outgrown`)."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        verified = self.counters.verified_rows
        if not self.generator.decoding:
            self.burst = True
        if self.burst and (not self.generator.prefilling or self._burst_outgrown()):
            self.burst = False
        if not self.burst:
            if firsts := self.generator.join():
                self._take(firsts)
                self._deliver()  # now, not after the decode forward
            self._take(self.generator.decode())
        decoding = self.generator.decoding and not self.burst
        prefilled = 0
        budget = (self._prefill_tokens(decoding)
                  if self.reading or self.generator.prefilling else 0)
        if budget:
            self._deliver()
            # Readouts take half the budget while prompts are being prefilled: a flood of
            # classify lists starves no chat, nor a long prompt the lists.
            halved = bool(self.reading) and bool(self.generator.prefilling)
            if self.reading:
                reads = budget // 2 if halved else budget
                prefilled = self._read(reads if decoding else self.idle_read_chunks * reads)
            if self.generator.prefilling:
                result = self.generator.prefill(
                    budget - budget // 2 if halved else budget,
                    None if decoding or halved else self.idle_together)
                prefilled += result.tokens
                if result.failed and self.group is not None:
                    raise result.failed[0][1]
                for sequence, error in result.failed:
                    generation = self.running.pop(sequence.uid)
                    log.error("prefill of %s failed: %r", generation.id, error)
                    self._release(generation, None)
                    self._fail(generation, error)
                self._prompts_computed(result.done)
                self._take(result.outputs)
                if result.outputs:
                    # Before `settle`: copying a row's KV out of the batch computes the
                    # batch's decode forward (on the CPU, still lazy until then).
                    self._deliver()
                # Background work's prompt is all it wanted: it ends before joining.
                if background := [(self.running[s.uid], "length", None)
                                  for s in result.done if s.background]:
                    self._end(background)
        self.kv.settle()  # the KV this step published and released, copied at once
        seconds = time.perf_counter() - started
        cpu_seconds = time.thread_time() - cpu_started
        self.prefill_budget.record(decoding, prefilled, seconds)
        if log.isEnabledFor(logging.DEBUG):  # a step trace, for `--log-level debug`
            # The thread's CPU time: its host work (building and launching graphs), plus
            # whatever of an evaluation MLX runs on it (CPU kernels; on CUDA, its waits
            # spin, so there CPU time is about wall time and tells little).
            log.debug("step: %d rows (%d verified), %d prompt tokens fed, %d prompts left, "
                      "%.1f ms, %.1f ms CPU", len(self.generator.rows),
                      self.counters.verified_rows - verified, prefilled,
                      len(self.generator.prefilling), seconds * 1e3, cpu_seconds * 1e3)
        self.counters.steps += 1
        self.counters.step_seconds += seconds
        self.counters.step_cpu_seconds += cpu_seconds

    def _burst_outgrown(self) -> bool:
        """Whether a prompt still being computed needs more than BURST_SPREAD times the
        tokens the cheapest computed one took, and the prompts left more than
        BURST_HOLD_SECONDS: then holding that one back would multiply its wait for its
        first token (a short chat behind a long document, which it went ahead of:
        `Generator._queue`), and it starts decoding while the rest are computed with the
        prefill budget. Prompts of like sizes arriving together, the burst's reason, stay
        together, and so does a burst a fast device computes in a moment."""
        computed = [len(generation.tokens) - (generation.cached_tokens or 0)
                    for generation in (self.running[s.uid] for s in self.generator.ready
                                       if not s.background)]
        left = [len(s.unfed) for s in self.generator.prefilling if not s.background]
        if not (computed and left) or max(left) <= BURST_SPREAD * min(computed):
            return False
        token_seconds = self.prefill_budget.token_seconds
        return token_seconds is not None and sum(left) * token_seconds > BURST_HOLD_SECONDS

    def _take(self, outputs: list[Output]) -> None:
        """Give sampled tokens to their generations; those that end leave together. A
        speculative step gives a generation several tokens: those after one that ended
        it are dropped, so it ends where it would have without speculation."""
        endings = []
        ended: set[int] = set()
        for output in outputs:
            generation = self.running.get(output.uid)
            if generation is None:
                continue
            if output.uid in ended:  # an accepted draft token past the end
                generation.drafts.unused(1)
                self.counters.accepted_draft_tokens -= 1
            elif ending := self._on_token(generation, output):
                endings.append((generation, *ending))
                ended.add(output.uid)
        if endings:
            self._end(endings)

    def _prefill_tokens(self, decoding: bool) -> int:
        """This step's prefill: the budget keeps what it adds to running streams' steps
        within a share of a decode step; with no stream to keep flowing, big chunks
        finish a prompt sooner. Tensor-parallel ranks must all take the same chunk, which
        a budget from each rank's own clock would not give: they take fixed ones."""
        budget = self.prefill_budget
        if self.group is not None:
            return budget.chunk if decoding else budget.idle_chunk
        reading = sum(len(g.tokens) - len(g.cacheable) for g in self.reading)
        return budget.tokens(decoding, self.generator.prompt_tokens_left + reading)

    def _prompts_computed(self, sequences: list[SequenceState]) -> None:
        """These prompts' KV (of the tokens their cache holds) is computed: share it now,
        while their generations go on to decode. Only the KV of those with something to
        publish is read from the batch."""
        generations = [self.running[sequence.uid] for sequence in sequences]
        publishing = [i for i, g in enumerate(generations)
                      if g.hold.publishes(len(g.cacheable))]
        caches = dict(zip(publishing, self.generator.caches_of(
            [sequences[i] for i in publishing],
            [generations[i].hold.depth for i in publishing])))
        for i, generation in enumerate(generations):
            generation.prompt_done = True
            self._publish(generation, caches.get(i))

    def _publish(self, generation: Generation, cache: KVSource | None) -> None:
        """`cache`: what holds the generation's tokens; None where its hold publishes
        nothing (`TreeHold.publishes`), so nothing reads it.

        A whole-state snapshot holds every token the cache does: where that is more than
        the tree may keep (a readout's shared prefix), the tree gets the state prefill
        snapshotted at the end of that prefix (`_snapshot_positions`), or nothing."""
        end = len(generation.cacheable)
        handle_of, snapshots = self._handle_of(cache), generation.snapshots
        generation.snapshots = []
        if cache is not None and not self.kv.segments and len(generation.sequence.tokens) > end:
            if not snapshots or snapshots[-1][0] != end:
                generation.hold.withdraw()
                self._wake_followers(generation)
                return
            state = snapshots.pop()[1]
            handle_of = lambda start, stop: state  # the state at `end`
        blocker = generation.hold.publish(generation.tokens, end, handle_of, snapshots)
        if blocker is None:
            self._wake_followers(generation)
        else:
            # Another's reservation cut the insert short; this generation still holds its
            # whole cache while it decodes, so the rest follows once that one is done.
            blocker.add_done_callback(lambda _: self.inbox.put(Republish(generation)))

    def _handle_of(self, cache: KVSource) -> HandleOf:
        return lambda start, end: self.kv.handle(cache, start, end)

    def _republish(self, generation: Generation) -> None:
        sequence = generation.sequence
        if sequence is None or self.running.get(sequence.uid) is not generation:
            return  # it ended meanwhile; its release published what it could
        if not self.kv.segments:
            # A snapshot is of the whole state, which is past the prompt by now.
            self._wake_followers(generation)
            return
        self._publish(generation,
                      self.generator.caches_of([sequence], [generation.hold.depth])[0])

    def _on_token(self, generation: Generation, output: Output
                  ) -> tuple[FinishReason, str | int | None] | None:
        """Take in a generated token; (reason, matched stop) when it ends the generation,
        which the step then ends with the others that ended in it."""
        self.counters.generated_tokens += 1
        try:
            return generation.accept(output.token, output.logprobs)
        except ConstraintFailed as error:
            sequence = generation.sequence
            del self.running[sequence.uid]
            self._release(generation, self.generator.remove([sequence.uid])[sequence.uid])
            self._fail(generation, error)
            return None

    # -- ending -----------------------------------------------------------------------

    def _end(self, endings: list[tuple[Generation, FinishReason, str | int | None]]) -> None:
        """Running generations are done: their last events out, then their KV to the
        tree. The events go first: copying the rows' KV out waits for the step already
        queued behind the one that ended them (pipelining), a decode step a client would
        wait for its stream's end (a CPU's 4-row step ended replies 75-150 ms late, and
        an agent's next turn waits for that end); its next request is taken in only after
        this step. The rows leave the batch together: each departure compacts the batch's
        cache, so 64 streams ending at one step would otherwise copy it 64 times."""
        for generation, reason, matched_stop in endings:
            generation.finish(reason, matched_stop)
        self._deliver()
        sequences = self.generator.remove(
            (g.sequence.uid for g, _, _ in endings),
            read={g.sequence.uid: g.hold.depth for g, _, _ in endings
                  if self._shares_on_release(g)})
        for generation, _, _ in endings:
            uid = generation.sequence.uid
            self._release(generation, sequences[uid])
            self._forget(generation)
            # Last: a client that saw its stream end and waits for nothing to run (its
            # tests, an operator's script) then finds the KV shared and the hold let go.
            del self.running[uid]

    def _release(self, generation: Generation, sequence: SequenceState | None) -> None:
        """Share what `sequence`'s cache holds beyond the tree, then let go. A request that
        ended at its first token (a classifier's answer) holds its prompt, all of it
        published but the last token, which no later prompt's match can use unless it
        extends this one: that token is not worth a copy for every such request."""
        computed = sequence is not None and self._shares_on_release(generation)
        generation.hold.release(self._shareable(generation, sequence),
                                self._handle_of(sequence.cache) if computed else None)
        if sequence is not None:
            # A batch row's cache is a view of the batch's buffers: it goes now, not when
            # the last reference to the sequence does (a failure's traceback can hold it
            # in a reference cycle: in a storm of failing requests that kept MLX memory
            # up until Python next collected cycles).
            sequence.cache = []
            sequence.prefix = None
        generation.sequence = None
        self._wake_followers(generation)

    @staticmethod
    def _shareable(generation: Generation, sequence: SequenceState | None) -> list[int]:
        """The tokens of `sequence` the tree may have: all it holds, but for a readout
        only its `cacheable` part (its prompt alone was computed, and not all of it is
        worth keeping)."""
        if sequence is None:
            return []
        if generation.params.readout is not None:
            return sequence.tokens[:len(generation.cacheable)]
        return sequence.tokens

    def _shares_on_release(self, generation: Generation) -> bool:
        """Whether the running `generation`'s KV goes to the tree when it ends: its
        prompt was computed, and it holds more than that prompt's last token; or it was
        cancelled while prefilling, and chunks of its prompt were computed. Those are the
        exact KV of the tokens the sequence holds (each chunk is evaluated whole within
        its step, and a cancel is taken between steps), and a client that gave up on a
        long prompt (timed out) and sends it again should not pay for them twice. A
        readout shares no more than its `cacheable` part, and where the model's handles
        are whole-state snapshots, nothing unless that is all the cache holds."""
        sequence = generation.sequence
        shareable = len(self._shareable(generation, sequence))
        if not self.kv.segments and shareable != len(sequence.tokens):
            return False
        if not generation.prompt_done or generation.params.readout is not None:
            return sequence.cache is not None and shareable > generation.hold.depth
        return not (shareable == generation.hold.depth + 1 == len(generation.tokens))

    def _drop_stale_background(self) -> None:
        """Background work (a chat's next turn, prefilled to be cached) waits behind
        every client request (admission.py); one passed over `MAX_PASSED_OVER` times is
        dropped: the client it guessed for has likely sent that turn already, which then
        computes those tokens itself, and waiting longer would hold queue places clients
        need."""
        for generation in [g for g in self.waiting
                           if g.background and g.passed_over >= MAX_PASSED_OVER]:
            self._cancel(generation)

    def _cancel(self, generation: Generation) -> None:
        if (generation in self.waiting or generation in self.reading
                or generation in self.parked or generation in self.scoring
                or generation in self.compiling or generation in self.preparing):
            if generation in self.waiting:
                self.waiting.remove(generation)
            self.scoring.pop(generation, None)
            self._leave_reading([generation])
            self.parked.discard(generation)
            self.compiling.discard(generation)
            self.preparing.discard(generation)
            self._forget(generation)
            generation.finish("cancelled")
        elif generation.sequence is not None:
            self._end([(generation, "cancelled", None)])

    def _make_room(self) -> None:
        """Preempt running generations, the newest first (guesses before any client's),
        while the KV the batch holds after its next step would pass `max_tokens_in_flight`:
        admission counted each at most `output_reserve` tokens ahead (admission.py), and
        some wrote further. The oldest always stays, so a request bigger than the limit
        still runs, alone, as admission lets it."""
        over = sum(map(tokens_held, self.running.values())) - self.limits.max_tokens_in_flight
        if over <= 0:
            return
        newest_first = [generation for _, generation in sorted(
            self.running.items(), key=lambda item: (not item[1].background, -item[0]))]
        for generation in newest_first[:-1]:
            over -= tokens_held(generation)
            self._preempt(generation, f"the batch's KV outgrew "
                                      f"{self.limits.max_tokens_in_flight} tokens")
            if over <= 0:
                break

    def _share_rows(self) -> None:
        """Preempt what a client request holding no row needs of a request holding
        several (admission.py, `rows_to_free`)."""
        for generation in rows_to_free(self.waiting, self.running.values(), self.limits,
                                       lambda g: self.tree.peek(g.cacheable)):
            self._preempt(generation, "a request holding no row needed one")

    def _preempt(self, generation: Generation, reason: str) -> None:
        """Take a running generation out of the batch and queue it again: its KV goes to
        the tree as an ending one's does, and admitted again it reads it back from there
        as a prompt of its tokens so far (a failed step's path, `_recover`), then goes on
        where it was. It takes its request's turn as any waiting generation does
        (admission.py), with the longest of cached prefixes; sent to the front of the
        queue instead, 15 choices of one request preempted in turn kept another client's
        chat waiting 215 s, where counted at their whole max_tokens they had kept it 91 s.
        A guess, which no client waits on, is dropped instead."""
        if generation.background:
            self._end([(generation, "cancelled", None)])
            return
        uid = generation.sequence.uid
        read = {uid: generation.hold.depth} if self._shares_on_release(generation) else {}
        self._release(generation, self.generator.remove([uid], read=read)[uid])
        del self.running[uid]
        log.info("preempted %s at %d tokens: %s", generation.id,
                 len(generation.prompt) + len(generation.generated), reason)
        self.counters.requests_preempted += 1
        generation.tokens = generation.prompt + generation.generated
        self.waiting.insert(0, generation)

    def _recover(self, error: Exception) -> None:
        """A step failed. Its batch state is unusable, so every member restarts from its
        tokens (the tree still has their prompts); members run alone until each passes a
        step, and one that fails alone gets the error."""
        log.error("step failed: %r; %d request(s) affected", error, len(self.running))
        victims = list(self.running.values())
        self.running.clear()
        self.generator = Generator(self.loaded.model, self._take_snapshot, self.counters,
                                   self.kv.quantization, self._mrope())
        for generation in victims:
            generation.hold.abandon(error)
            generation.sequence = None
            self._wake_followers(generation)
            if generation.suspect:
                self._fail(generation, error)
                continue
            generation.suspect = True
            generation.tokens = generation.prompt + generation.generated
            if len(generation.generated) >= generation.params.max_tokens:
                self._forget(generation)
                generation.finish("length")
            else:
                self.waiting.insert(0, generation)

    def _fail(self, generation: Generation, error: Exception) -> None:
        self.counters.requests_failed += 1
        self._forget(generation)
        generation.fail(error)

    def _forget(self, generation: Generation) -> None:
        self.generations.pop(generation.id, None)

    def _stop_all(self) -> None:
        for generation in list(self.generations.values()):
            self._cancel(generation)
        self._stopping = True
        self._bringing_back.clear()
        self._brought_back.finish()
        while self._restoring:  # the files stay for the next start
            self._restoring.popleft()[1].set_exception(EngineNotReady("the engine stopped"))

    def _restore_some(self) -> None:
        """Run the oldest rebuild under way for a slice of this turn (`RESTORE_SLICE`): a
        tier of many files is restored between steps, not in one long stall of them. A
        rebuild whose copies left all wait for nodes requests compute ends the slice."""
        steps, done = self._restoring[0]
        deadline = time.perf_counter() + RESTORE_SLICE
        try:
            while time.perf_counter() < deadline:
                self._restore_waits = next(steps)
                if self._restore_waits:
                    break  # for a node a request computes: the engine steps first
        except StopIteration as finished:
            self._restoring.popleft()
            done.set_result(finished.value)
        except Exception as error:  # noqa: BLE001 - the rebuild logs it
            self._restoring.popleft()
            done.set_exception(error)
