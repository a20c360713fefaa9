"""The engine's public API, importable without MLX: what crosses the boundary between the
engine and its callers.

`EngineClient` is the contract: the server builds an `EngineConfig`, watches the engine's
`Lifecycle`, builds a `Prompt` and a `SamplingParams` per request, calls `submit` and reads
`TokenEvent`s followed by one `Finish` from the returned `EventStream` (first a
`PromptLogprobs` when asked; a prefill-only request's `Readout` gets a `LastPosition`
instead of tokens); `cancel` ends a request early, and `stats` gives an `EngineStats` for /metrics. Two classes keep it: the
engine itself (engine/engine.py, which imports MLX) and `EngineProcess` (engine/process.py,
the engine in a child process). Nothing here imports MLX, so the server's own modules import
only this one, engine/streams.py, engine/tokenizer.py and engine/constraints.py (the
grammars of `SamplingParams.constraint`).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from radix.accounting import TreeStats
from radix.stats import stat

if TYPE_CHECKING:
    from engine.tokenizer import ModelTokenizer

FinishReason = Literal["stop", "length", "cancelled"]
# Speculative decoding (engine/speculation.py): never, whenever a draft is found, or while
# drafts are mostly accepted.
SpeculationMode = Literal["off", "on", "auto"]
# Prompt lookup (n-grams), the radix tree, a draft model (`SpeculationConfig.draft_model`).
DraftSource = Literal["prompt", "tree", "model"]


class Lifecycle(str, enum.Enum):
    LOADING = "loading"
    WARMING_UP = "warming_up"
    READY = "ready"
    FAILED = "failed"


# What `EngineConfig.kv_bits` and `kv_group_size` may be: mlx-lm's quantized KV cache's.
KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class SpeculationConfig:
    """A server's speculative decoding: the mode of requests that name none, the most
    tokens one draft guesses, and where drafts come from, first found first."""

    mode: SpeculationMode = "off"
    max_draft: int = 8
    sources: tuple[DraftSource, ...] = ("prompt", "tree")
    # The draft model's directory or hub repo id, for the "model" source ("": none).
    draft_model: str = ""


@dataclass(frozen=True)
class EngineConfig:
    # A model directory or hub repo id; a .gguf file, or "" for the default model, is
    # converted first (as `gguf_dtype` says) by the engine that loads it.
    model: str
    gguf_dtype: str = "auto"
    # The most tokens of one request, below the model's own window (None: the model's).
    context_length: int | None = None
    cache_bytes: int | None = None
    cache_fraction: float = 0.5
    max_batch_size: int = 32
    # Admitted in the cache-aware order (admission.py) and computed in turn: a small
    # window keeps a request that arrives behind a long cold prompt, but whose prompt is
    # mostly cached, from waiting for that prompt. At 64 on an H100 (Llama-1B shape,
    # shared-prefix, 16 at once, stall ratio 0.1) followers whose prefix was cached after
    # 0.5 s waited 6 s behind the last group's cold 2000-token prompt: 10.9 s in all
    # against 5.8 s at 8 (TTFT p99 8.6 vs 4.6 s). Short prompts do not count against it
    # (admission.py): they are computed together in one forward.
    prefill_batch_size: int = 8
    prefill_chunk_tokens: int | None = None  # None: the device's default
    # While requests decode, prefill may add this share of a decode step to each step,
    # on average, and at least the floor (engine/prefill_budget.py). None: the device's
    # default (scheduler.py).
    prefill_stall_ratio: float | None = None
    prefill_stall_floor_seconds: float = 0.02
    max_tokens_in_flight: int = 131072
    max_queue: int = 256
    memory_limit_bytes: int | None = None  # None: the device's (engine/memory.py)
    # Without a memory limit: the share of the device's memory this process plans for
    # (N servers side by side on one device: 1/N each).
    memory_share: float = 1.0
    # The disk tier: off unless a directory and a budget are given (None: a share of the
    # free space there, see disk_store.default_disk_budget; 0: off).
    disk_cache_dir: str | None = None
    disk_cache_bytes: int | None = 0
    # The prefix cache's tokens quantized to this many bits (KV_BITS; None: the model's
    # dtype), in groups of `kv_group_size` (KV_GROUP_SIZES) along the head dimension
    # (engine/kv_quant.py).
    kv_bits: int | None = None
    kv_group_size: int = 64
    # Tensor parallelism: how long one scheduler step may take before the group counts
    # as lost (a rank that hangs must not hang the server).
    collective_timeout: float = 60.0
    # One rank: how long one scheduler step may take before the engine counts as stuck
    # and fails (0: never). A step that never ends would otherwise hold every request.
    step_timeout: float = 120.0
    # Jinja source rendering chats instead of the model's own template (None: its own).
    chat_template: str | None = None
    speculation: SpeculationConfig = SpeculationConfig()
    # Run each kind of step once before serving (engine.py `_warm_up`); None: where
    # kernels compile in every process, a GPU.
    warm_up: bool | None = None


@dataclass
class SchedulerCounters:
    """What the scheduler counts as it works; described for /metrics in one place."""

    prompt_tokens: int = stat("counter", "Prompt tokens of finished prefills.")
    cached_tokens: int = stat("counter", "Prompt tokens served from the radix cache.")
    prefill_tokens: int = stat("counter", "Prompt tokens computed by prefill.")
    generated_tokens: int = stat("counter", "Tokens generated.")
    images_encoded: int = stat("counter", "Images run through the vision tower (an image "
                               "the radix cache holds is not).", name="engine_images_encoded")
    requests_failed: int = stat("counter", "Requests the engine failed.",
                                name="engine_requests_failed")
    requests_preempted: int = stat("counter", "Times a running request left the batch, its "
                                   "KV cached, to wait for room: the batch's KV outgrew "
                                   "the limit, or a request holding no row needed one.",
                                   name="engine_requests_preempted")
    constrained_requests: int = stat("counter", "Requests decoded under a grammar "
                                     "(structured output, forced tool calls).",
                                     name="engine_constrained_requests")
    steps: int = stat("counter", "Engine scheduler steps.", name="engine_steps")
    step_seconds: float = stat("counter", "Seconds spent in engine steps.", default=0.0,
                               name="engine_step_seconds")
    # Near step_seconds, the engine is host-bound: its thread's Python (building graphs,
    # sampling, detokenizing) is the step, and anything else that takes the GIL slows it.
    step_cpu_seconds: float = stat("counter", "CPU seconds the engine's thread spent in "
                                   "engine steps.", default=0.0,
                                   name="engine_step_cpu_seconds")
    # Speculative decoding: acceptance rate = accepted / drafted; tokens per verified
    # row = verified_tokens / verified_rows.
    draft_tokens: int = stat("counter", "Draft tokens verified (speculative decoding).",
                             name="speculative_draft_tokens")
    accepted_draft_tokens: int = stat("counter", "Draft tokens the model agreed with.",
                                      name="speculative_accepted_tokens")
    verified_rows: int = stat("counter", "Rows of verify steps that held a draft.",
                              name="speculative_verified_rows")
    verified_tokens: int = stat("counter", "Tokens those rows output (accepted drafts and "
                                "the token each was fed).", name="speculative_verified_tokens")


@dataclass
class DiskStats:
    """What the disk tier's store counts (the tree counts the tier's bytes and hits)."""

    writes: int = stat("counter", "Copies written to the disk tier.", name="disk_writes")
    write_bytes: int = stat("counter", "Bytes written to the disk tier.",
                            name="disk_write_bytes")
    writes_dropped: int = stat("counter", "Copies not made: the disk writer's queue was full.",
                               name="disk_writes_dropped")
    write_errors: int = stat("counter", "Copies whose write failed.", name="disk_write_errors")
    queued_bytes: int = stat("gauge", "Bytes waiting in the disk writer's queue.",
                             name="disk_queued_bytes")
    loads: int = stat("counter", "Copies loaded back into memory.", name="disk_loads")
    load_bytes: int = stat("counter", "Bytes read back from disk files.",
                           name="disk_load_bytes")
    load_seconds: float = stat("counter", "Seconds spent reading disk files back.",
                               default=0.0, name="disk_load_seconds")
    bad_files: int = stat("counter", "Disk files skipped and deleted (torn, truncated, "
                          "foreign or corrupt).", name="disk_bad_files")
    restored_nodes: int = stat("counter", "Tree nodes rebuilt from disk files at start.",
                               name="disk_restored_nodes")
    brought_back_nodes: int = stat("counter", "Tree nodes loaded back into memory at start: "
                                   "what memory held at the last stop.",
                                   name="disk_brought_back_nodes")
    rebuilding: int = stat("gauge", "1 while the tree is being rebuilt from disk.",
                           name="disk_rebuilding")


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /metrics: the queue, the scheduler's counters and the tree's own
    stats, composed rather than copied, so a new counter is added in one place (its
    dataclass, with its `stat` description) and reaches /metrics by itself."""

    waiting: int = stat("gauge", "Requests submitted and not yet started.",
                        name="queue_depth")
    running: int = stat("gauge", "Client requests in the running batch.",
                        name="running_requests")
    background: int = stat(
        "gauge", "Next-turn guesses being computed: prompts prefilled only to be cached, "
        "no client waiting on them.", name="background_prefills")
    active_memory_bytes: int = stat("gauge", "MLX active memory.")
    memory_limit_bytes: int = stat(
        "gauge", "Memory planned for weights, prefix cache, activations and running KV.")
    weight_bytes: int = stat(
        "gauge", "Bytes of the model's weights in this process (its shard under tensor "
        "parallelism).")
    kv_token_capacity: int = stat(
        "gauge", "Tokens of running requests' KV that the memory plan holds.")
    tokens_in_flight: int = stat(
        "gauge", "KV tokens admission counts for the running requests and guesses: each "
        "one's prompt + max_tokens, at most 4,096 of max_tokens ahead of what it wrote.")
    counters: SchedulerCounters = field(default_factory=SchedulerCounters)
    tree: TreeStats = field(default_factory=TreeStats)
    disk: DiskStats = field(default_factory=DiskStats)


@dataclass(frozen=True)
class Prompt:
    """A prompt's token ids, and where the messages of the chat it renders end in them.

    `message_ends`: token counts at which a message is complete (the system prompt, each
    turn), ascending. Models whose cache is reused only as whole-state snapshots
    (sliding-window or recurrent layers; see `Engine.wants_message_ends`) snapshot it
    there during prefill, so a later prompt sharing those messages (another conversation
    with the same system prompt, the next turn, the same few-shot turns) reuses them.
    Models with plain KV caches reuse any prefix and need none. Raw completions have none.
    """

    tokens: list[int]
    message_ends: tuple[int, ...] = ()
    # A vision model's images, in order; each one's span of `tokens` holds its radix key
    # (engine/image_tokens.py), not the model's image token.
    images: tuple[PromptImage, ...] = ()


@dataclass(frozen=True)
class ImageFile:
    """An image a request sends, checked to decode whole (server/images.py), with what
    its decoding gave: its digest and its size, which sizes its tokens (Qwen-VL)."""

    digest: str  # hex digest of its decoded pixels and the processor's settings
    size: tuple[int, int]  # (width, height) of its decoded pixels, EXIF rotation applied
    data: bytes  # the file as the client sent it


@dataclass(frozen=True)
class PromptImage:
    """An image in a prompt: where its tokens are, and its file."""

    start: int  # its first token's position in the prompt
    length: int  # its tokens
    file: ImageFile


@dataclass(frozen=True)
class Constraint:
    """A grammar the generated text must follow (structured output, forced tool calls).

    Build one with `engine.constraints` (json_object, json_schema, tool_calls; regex,
    choice, grammar) rather than by hand. The engine masks every token the grammar does
    not allow, from the first generated token on, allows EOS only where the grammar
    accepts, and ends the request with finish reason "stop" once the grammar is complete.
    Logprobs, when asked for, stay the model's own (before the mask), as OpenAI reports
    them. A grammar that does not compile fails the request (RequestFailed) at its start.
    """

    # llguidance's serialized grammar (what `LLMatcher.grammar_from_*` return); equal
    # grammars share one compiled copy in the engine.
    grammar: str
    # Text the model writes freely before the grammar applies: the grammar starts right
    # after the first time the generated tokens contain this marker's tokens, or their
    # text ends with it (e.g. the end-of-thinking "</think>" of a reasoning model, or a
    # tool call's start marker: `constraints.tool_calls(text=True, lazy=True)`). None: from the
    # first token. Leave it None when the prompt already closed the reasoning (a template
    # that renders "<think></think>" when thinking is off), or the grammar would never
    # start.
    after: str | None = None
    # Some object of the grammar takes keys by pattern (`patternProperties`) and no others,
    # so its keys can run out: the output is looked ahead for a way to a key it has not
    # written (engine/json_keys.py). Open objects always have one, listed properties are
    # written once by the grammar itself.
    bounded_keys: bool = False
    # The text is JSON (or JSON between a tool format's markers), read as it is written so
    # that no object repeats a key (engine/json_keys.py). False: a grammar of plain text (a
    # regular expression, a list of choices, a Lark or GBNF grammar), whose braces and
    # quotes mean what the grammar says and nothing more.
    json_text: bool = True


@dataclass(frozen=True)
class Readout:
    """What a prefill-only request (embeddings, rerank, classify) reads at its prompt's
    last position, in one `LastPosition` event before its `Finish`. Submit it greedy, with
    max_tokens 0: the prompt is computed, and cached, as any prompt is."""

    top_logprobs: int = 0  # the likeliest next tokens, with their logprobs
    token_ids: tuple[int, ...] = ()  # the logprobs of these next tokens
    hidden: bool = False  # the last hidden state (after the final norm): an embedding
    # How many of the prompt's first tokens the prefix cache may keep (None: all but the
    # last, as for any prompt). A list of prompts sharing an instruction keeps only what
    # they share: each one's own text is read once, and caching it would cost a copy per
    # prompt and push out prefixes that other traffic reuses.
    cached_prefix: int | None = None
    # Nothing to read: the prompt is computed only so that the tree holds it (a chat's
    # next turn, server/next_turn.py). No `LastPosition`; where the tree already holds
    # what it may keep, it finishes with no forward (a repeated chat, whose next turn
    # the first one cached, would otherwise cost a forward of its own).
    cache_only: bool = False


# Below this temperature a draw is the likeliest token (vLLM's threshold too); and 1 / T of
# the smallest overflowed float32, which drew token 0 every time.
GREEDY_TEMPERATURE = 1e-5
# A nucleus (top_p) at most the likeliest token's probability holds that token alone, and
# that token holds at least 1 / vocabulary: this is below it for any vocabulary under 10^8.
# (Below float32's smallest normal, mlx-lm's top-p kept no token at all.)
GREEDY_TOP_P = 1e-8


@dataclass(frozen=True)
class SamplingKnobs:
    """How a request asks its tokens to be drawn and its text to stop: what every API
    states in its own words (the server's `GenerationRequest.sampling`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float | None = None
    # How many of the context's last tokens a repetition penalty looks at (mlx-lm's
    # repetition_context_size; -1: the whole context, 0: none, as Ollama's repeat_last_n).
    repetition_context: int = 20
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # The first this many tokens are never a stop token nor end on a stop string (vLLM's
    # `min_tokens`): stop tokens are barred from their draws.
    min_tokens: int = 0
    speculation: SpeculationMode | None = None  # None: the server's mode

    @property
    def greedy(self) -> bool:
        """Whether every draw is the likeliest token: at temperature 0, or one or a nucleus
        too small for any other token to be drawn."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_p < GREEDY_TOP_P


@dataclass(frozen=True)
class SamplingParams(SamplingKnobs):
    """Per-request decoding options, already validated by the caller: the knobs, and what
    the server decides for each choice."""

    max_tokens: int = field(kw_only=True)
    # None: no logprobs. 0..20: the sampled token's logprob plus that many alternatives.
    logprobs: int | None = None
    # None: none. 0..20: before any token, a `PromptLogprobs` event with each prompt
    # token's logprob plus that many alternatives (engine/prompt_logprobs.py).
    prompt_logprobs: int | None = None
    constraint: Constraint | None = None
    # Prefill only: read the prompt's last position (`LastPosition`) and generate nothing.
    readout: Readout | None = None
    # The tokens the client expects the output to be (OpenAI's Predicted Outputs): drafts
    # for speculative decoding, tried first; in `auto` mode where the request and the
    # server name none (engine/speculation.py, `PredictionLookup`).
    prediction: tuple[int, ...] = ()


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    text: str
    logprob: float
    bytes: bytes  # the token's own bytes: part of a character where it holds only part


@dataclass(frozen=True)
class TokenEvent:
    """One generated token and the text it made visible (may be empty while a
    multi-byte character or a possible stop string is held back)."""

    token: int
    text: str
    logprob: TokenLogprob | None = None
    top_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class CacheMiss:
    """The first prompt token a request did not reuse from the cache, and why (a
    radix.MissReason value), with the prompt's text on each side of it and, where a cached
    branch goes on otherwise, that branch's text."""

    position: int
    reason: str
    before: str
    after: str
    cached: str = ""


@dataclass(frozen=True)
class PromptLogprobs:
    """Every prompt token (`text`: its own text), its logprob given the tokens before it
    and the likeliest alternatives there; the first token has no logprob. The first event
    of a request that asked for them (`SamplingParams.prompt_logprobs`)."""

    tokens: tuple[TokenEvent, ...]


@dataclass(frozen=True)
class LastPosition:
    """What a `Readout` asked for: the likeliest next token (`token`, its logprob), the
    `top` likeliest with theirs, the logprobs of the asked `token_ids` in their order, and
    the last hidden state (empty unless asked)."""

    token: TokenLogprob
    top: tuple[TokenLogprob, ...]
    token_logprobs: tuple[float, ...]
    hidden: tuple[float, ...]


@dataclass(frozen=True)
class Finish:
    """The last event of every successful stream."""

    reason: FinishReason
    text: str  # any held-back text released at the end
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Stop string or stop token id that ended the stream, if any.
    matched_stop: str | int | None = None
    cache_miss: CacheMiss | None = None  # None: all of the prompt that can be was reused
    draft_tokens: int = 0  # speculative decoding: tokens drafted, and those accepted
    accepted_draft_tokens: int = 0
    # Of those, drafted from the request's prediction, and those accepted.
    prediction_tokens: int = 0
    accepted_prediction_tokens: int = 0


class EngineError(Exception):
    """Base class of the errors the engine reports to callers."""


class EngineNotReady(EngineError):
    """The model is still loading or failed to load."""


class QueueFull(EngineError):
    """Too many requests are waiting; the caller should retry later."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ContextLengthExceeded(EngineError):
    """prompt + max_tokens does not fit in the model's context window."""


class Unsupported(EngineError):
    """The model cannot do what the request asks (say, embed: a model whose hidden
    states cannot be read)."""


class RequestFailed(EngineError):
    """The engine failed this one request (for example its forward pass raised)."""


class ConstraintUnmet(EngineError):
    """The request's output constraint let no token through where its output stood (a
    schema no value satisfies, found as the model wrote it), or this model cannot be
    constrained: the request's doing, not the engine's."""


def check_request(tokens: list[int], params: SamplingParams, context_length: int,
                  kv_tokens: int) -> None:
    """Raise if a prompt cannot be generated from at all: empty, or prompt + max_tokens past
    the model's context window or the KV that the server's memory plan holds."""
    if not tokens:
        raise ValueError("the prompt is empty")
    requested = len(tokens) + params.max_tokens
    if requested > context_length:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {context_length} tokens. "
            f"However, you requested {requested} tokens "
            f"({len(tokens)} in the prompt, {params.max_tokens} for the completion).")
    if requested > kv_tokens:
        raise ContextLengthExceeded(
            f"This server's memory holds the KV of {kv_tokens} tokens at "
            f"most (memory_limit_bytes). However, you requested {requested} tokens "
            f"({len(tokens)} in the prompt, {params.max_tokens} for the completion).")


def check_images(prompt: Prompt, vision: bool, model_id: str) -> None:
    """Raise if the model cannot read the prompt's images, or an image is not a span of
    the prompt's tokens short of its last (which is fed alone, as an id, for the first
    logits)."""
    if not prompt.images:
        return
    if not vision:
        raise Unsupported(f"the model {model_id} does not read images")
    for image in prompt.images:
        if image.start < 0 or image.length < 1 \
                or image.start + image.length >= len(prompt.tokens):
            raise ValueError(f"an image's tokens [{image.start}, +{image.length}) are not "
                             f"inside the prompt short of its last token")


class EventStream(Protocol):
    """One request's events, as `EngineClient.submit` returns them (engine/streams.py's
    `RequestStream`): `TokenEvent`s, then one `Finish`; when the engine fails the request,
    its error (e.g. `RequestFailed`) is raised instead of the `Finish`."""

    request_id: str

    def cancel(self) -> None:
        """Ask the engine to end this request (a no-op once it has ended)."""
        ...

    def __aiter__(self) -> EventStream: ...

    async def __anext__(self) -> TokenEvent | Finish: ...


class DiskTier(Protocol):
    """The disk tier as the server sees it: its folder, and whether the tree has been
    rebuilt from the files there yet."""

    directory: Path
    rebuilt: threading.Event


class EngineClient(Protocol):
    """What the server uses of an engine, kept by `engine.engine.Engine` and by
    `engine.process.EngineProcess`, so the server never depends on which one it drives.

    `start` returns at once; `state` then moves from LOADING through WARMING_UP to READY,
    or to FAILED with `error` set, and `wait_ready` blocks until one of those two. The
    model's facts (`model_id`, `context_length`, `wants_message_ends`, `tokenizer`,
    `disk`, `model_path`) hold once it is READY. `served` says it was READY once, so a failure after it
    is not a failed load. `shutdown` cancels what runs and stops the engine.
    """

    config: EngineConfig
    state: Lifecycle
    error: str | None
    served: bool
    model_id: str
    context_length: int
    # The most prompt + max_tokens one request may have: the context window, or less
    # where that is all the memory plan holds.
    token_limit: int
    wants_message_ends: bool
    tokenizer: ModelTokenizer | None
    disk: DiskTier | None
    model_path: Path | None  # the local directory the model was loaded from

    def start(self) -> None: ...

    def wait_ready(self, timeout: float | None = None) -> Lifecycle: ...

    def shutdown(self) -> None: ...

    def submit(self, prompt: Prompt | Sequence[int], params: SamplingParams) -> EventStream:
        """Queue a request; raises `EngineNotReady`, `QueueFull`, `ContextLengthExceeded`
        or ValueError at once rather than through the stream."""
        ...

    def submit_all(self, prompts: Sequence[Prompt | Sequence[int]], params: SamplingParams,
                   owner: str | None = None) -> list[EventStream]:
        """`submit` for each prompt, all with `params`, queued together or not at all.
        `owner`: the client request they are part of, shared by the calls that queue its
        other choices, so they take their share of the batch as one (admission.py); by
        default the prompts of this call are one request."""
        ...

    def cancel(self, request_id: str) -> None: ...

    def clear_cache(self) -> Future[int]:
        """Drop every cached prefix no request pins, from both tiers; the memory bytes
        freed, once done."""
        ...

    def stats(self) -> EngineStats: ...

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        """How many of a prompt's `tokens` the cache holds now, as a request of them
        started at once would reuse them (its last token is always computed): a peek that
        changes nothing, so the request's own count may differ (an eviction, another
        request's prefill, before it starts). 0 unless the engine is ready."""
        ...

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet started (`stats().waiting` without a round trip
        to an engine process)."""
        ...
