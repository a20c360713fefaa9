"""The benchmark's workloads, generated from a seed so every server gets identical work.

Text is random words from the demo tokenizer's training corpus, cut to a token count with
the model's own tokenizer, so lengths are what the shapes say whatever the model. Each
workload is a list of conversations: a conversation's turns run one after another (each
reply is fed back into the next turn), conversations run side by side up to the
workload's concurrency, in list order.
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tokenizers import Tokenizer

from engine.demo_model import corpus_texts
from radix.prefix import common_prefix_length


@dataclass(frozen=True)
class Conversation:
    system: str | None
    user_turns: tuple[str, ...]


@dataclass(frozen=True)
class Workload:
    name: str
    conversations: tuple[Conversation, ...]
    concurrency: int
    max_tokens: int
    # Prompts per request (a list, one conversation turn each, not streamed) to
    # `batch_endpoint`; 0: each turn is its own streamed chat completion.
    batch: int = 0
    batch_endpoint: str = "/v1/completions"


@dataclass(frozen=True)
class Shapes:
    """Every size the workloads take; the CLI exposes each one as a flag."""

    sp_groups: int = 4
    sp_prompts_per_group: int = 4
    sp_system_tokens: int = 1000
    sp_question_tokens: int = 30
    sp_output_tokens: int = 32
    sp_concurrency: int = 8
    mt_conversations: int = 4
    mt_turns: int = 4
    mt_system_tokens: int = 200
    mt_user_tokens: int = 100
    mt_output_tokens: int = 32
    ns_prompts: int = 8
    ns_prompt_tokens: int = 512
    ns_output_tokens: int = 32
    ns_concurrency: int = 8
    lc_document_tokens: int = 2000
    lc_questions: int = 4
    lc_question_tokens: int = 30
    lc_output_tokens: int = 16
    decode_prompt_tokens: int = 64
    decode_output_tokens: int = 128
    decode_repeats: int = 3
    so_prompt_tokens: int = 64
    so_output_tokens: int = 128
    so_repeats: int = 2
    wr_document_tokens: int = 3000
    wr_output_tokens: int = 16
    ws_agents: int = 6
    ws_system_tokens: int = 1000
    ws_turns: int = 6
    ws_user_tokens: int = 64
    ws_output_tokens: int = 16
    ms_requests: int = 16
    ms_prompt_tokens: int = 256
    ms_output_tokens: int = 8
    mf_requests: int = 48
    mf_concurrency: int = 8
    mf_prompt_tokens: int = 128
    mf_output_tokens: int = 16
    bd_streams: int = 16  # bench/gpu.sh: 64
    bd_prompt_tokens: int = 64
    bd_output_tokens: int = 32  # bench/gpu.sh: 128
    cl_sentences: int = 128
    cl_batch: int = 32
    cl_concurrency: int = 1  # lists in flight at once (bare batch_generate: one at a time)
    cl_preamble_tokens: int = 32
    cl_sentence_tokens: int = 16
    ae_file_tokens: int = 1200  # the agent edit workload (bench/speculation.py)
    ae_output_tokens: int = 192
    ae_repeats: int = 1  # single-stream: this many file edits and as many tool calls
    ae_streams: int = 16
    ae_stream_output_tokens: int = 192
    spec_rounds: int = 3  # speculation's modes take turns this often, new prompts each time
    em_sentences: int = 1024  # embeddings (bench/prefill_endpoints.py), all-MiniLM-L6-v2
    em_batch: int = 64
    em_sentence_tokens: int = 24
    rr_documents: int = 100  # rerank: one query against this many documents
    rr_document_tokens: int = 200
    rr_query_tokens: int = 16
    rr_rounds: int = 3

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


QUICK = Shapes(
    sp_groups=2, sp_prompts_per_group=2, sp_system_tokens=200, sp_question_tokens=16,
    sp_output_tokens=8, sp_concurrency=4, mt_conversations=2, mt_turns=2,
    mt_system_tokens=64, mt_user_tokens=32, mt_output_tokens=8, ns_prompts=4,
    ns_prompt_tokens=96, ns_output_tokens=8, ns_concurrency=4, lc_document_tokens=400,
    lc_questions=2, lc_question_tokens=16, lc_output_tokens=8, decode_prompt_tokens=32,
    decode_output_tokens=16, decode_repeats=1, so_prompt_tokens=32, so_output_tokens=32,
    so_repeats=1, wr_document_tokens=300,
    wr_output_tokens=8, ws_agents=3, ws_system_tokens=150, ws_turns=2, ws_user_tokens=24,
    ws_output_tokens=8, ms_requests=6, ms_prompt_tokens=64, ms_output_tokens=4,
    mf_requests=12, mf_concurrency=4, mf_prompt_tokens=32, mf_output_tokens=4,
    bd_streams=4,
    bd_prompt_tokens=16, bd_output_tokens=8, cl_sentences=8, cl_batch=4, cl_preamble_tokens=16,
    cl_sentence_tokens=8, ae_file_tokens=200, ae_output_tokens=16, ae_streams=4,
    ae_stream_output_tokens=8, spec_rounds=1, em_sentences=8, em_batch=4, em_sentence_tokens=8,
    rr_documents=6, rr_document_tokens=24, rr_query_tokens=8, rr_rounds=2,
)


class TextSource:
    """Random corpus words cut to an exact token count of the served model's tokenizer."""

    def __init__(self, model_dir: Path, seed: int) -> None:
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.words = sorted({w for text in corpus_texts() for w in re.findall(r"[A-Za-z]+", text)})
        self.rng = random.Random(seed)

    def text(self, tokens: int) -> str:
        # Words average over one token each, so `tokens` words always suffice.
        words = " ".join(self.rng.choice(self.words) for _ in range(tokens + 8))
        ids = self.tokenizer.encode(words, add_special_tokens=False).ids[:tokens]
        return self.tokenizer.decode(ids).strip()


def shared_prefix(source: TextSource, s: Shapes) -> Workload:
    """SGLang's generated-shared-prefix: groups of prompts behind one long system prompt,
    all sent at once in a shuffled order (so groups interleave, as real traffic does)."""
    conversations = []
    for _ in range(s.sp_groups):
        system = source.text(s.sp_system_tokens)
        conversations += [
            Conversation(system, (source.text(s.sp_question_tokens),))
            for _ in range(s.sp_prompts_per_group)
        ]
    source.rng.shuffle(conversations)
    return Workload("shared_prefix", tuple(conversations), s.sp_concurrency, s.sp_output_tokens)


def multi_turn(source: TextSource, s: Shapes) -> Workload:
    """Chats whose every turn resends the whole history: all conversations at once."""
    conversations = tuple(
        Conversation(source.text(s.mt_system_tokens),
                     tuple(source.text(s.mt_user_tokens) for _ in range(s.mt_turns)))
        for _ in range(s.mt_conversations)
    )
    return Workload("multi_turn", conversations, s.mt_conversations, s.mt_output_tokens)


def no_share(source: TextSource, s: Shapes) -> Workload:
    """Distinct prompts: what caching costs when it cannot help."""
    conversations = tuple(
        Conversation(None, (source.text(s.ns_prompt_tokens),)) for _ in range(s.ns_prompts)
    )
    return Workload("no_share", conversations, s.ns_concurrency, s.ns_output_tokens)


def long_context(source: TextSource, s: Shapes) -> Workload:
    """One long document, questions one at a time: the first is cold, the rest warm."""
    document = source.text(s.lc_document_tokens)
    conversations = tuple(
        Conversation(document, (source.text(s.lc_question_tokens),))
        for _ in range(s.lc_questions)
    )
    return Workload("long_context", conversations, 1, s.lc_output_tokens)


def single_stream(source: TextSource, s: Shapes) -> Workload:
    """One short prompt, a long reply, alone: decode speed with nothing else running."""
    conversations = tuple(
        Conversation(None, (source.text(s.decode_prompt_tokens),))
        for _ in range(s.decode_repeats)
    )
    return Workload("single_stream", conversations, 1, s.decode_output_tokens)


def batch_decode(source: TextSource, s: Shapes) -> Workload:
    """Many streams decoding at once: the decode batch's throughput (and the memory
    bandwidth its step reaches)."""
    conversations = tuple(
        Conversation(None, (source.text(s.bd_prompt_tokens),)) for _ in range(s.bd_streams)
    )
    return Workload("batch_decode", conversations, s.bd_streams, s.bd_output_tokens)


def classify(source: TextSource, s: Shapes) -> Workload:
    """Classification: many one-line sentences behind one instruction, the token at each
    one's end, sent to `/v1/classify` in lists of `cl_batch`, `cl_concurrency` lists at
    a time."""
    preamble = source.text(s.cl_preamble_tokens)
    conversations = tuple(
        Conversation(None, (f"{preamble}\n{source.text(s.cl_sentence_tokens)}\n",))
        for _ in range(s.cl_sentences)
    )
    return Workload("classify", conversations, s.cl_concurrency, 1, batch=s.cl_batch,
                    batch_endpoint="/v1/classify")


def warm_up(source: TextSource, s: Shapes) -> Workload:
    """Untimed: one long prompt and a batch as wide as batch_decode's, so kernels compile
    before timing, for the shapes the widest batch meets too, as bare mlx-lm's batch run
    warms up on its own batch (`bench.raw_batch`). With four short prompts, a fresh H200
    server's first 64-stream run (1B shape) gave 7,328 tok/s and the next three, on other
    prompts, 7,950-8,152 (bench/results/nvidia-h200/batch-decode-64-1b)."""
    long = Conversation(None, (source.text(max(s.sp_system_tokens, 64)),))
    streams = max(4, s.bd_streams)
    short = tuple(Conversation(None, (source.text(max(32, s.bd_prompt_tokens)),))
                  for _ in range(streams))
    return Workload("warm_up", (long, *short), streams, 8)


def warm_up_lists(source: TextSource, s: Shapes) -> Workload:
    """Untimed, before a list workload: as many lists as it sends at once, of other text,
    so a server has met the read forward's shapes before timing, as bare mlx-lm's
    classify runs its first list before timing (`bench.raw_batch`). A fresh H200 server's
    first pass of four lists ran at 0.86-0.97 of its next passes' median in 11 of 14
    servers, 1.03-1.05 in the others (bench/results/nvidia-h200/classify-client-1b-vocab49152)."""
    lists = classify(source, s)
    return replace(lists, name="warm_up_lists",
                   conversations=lists.conversations[:s.cl_batch * s.cl_concurrency])


WORKLOADS = {make.__name__: make for make in (
    shared_prefix, multi_turn, no_share, long_context, single_stream, batch_decode, classify)}
# Served through bare mlx-lm batching as well (bench.raw_batch): mlx-lm's server crashes its
# generation thread on list prompts, and caps its decode batch at 32 by default.
RAW_BATCH_WORKLOADS = ("batch_decode", "classify")
# The bare mlx-lm baseline of each workload measured once a round, between the servers'.
RAW_ROUND_MODULES = {**dict.fromkeys(RAW_BATCH_WORKLOADS, "bench.raw_batch"),
                     "long_context": "bench.raw_long_context"}


def first_turns(tokenizer, workload: Workload, chat: bool) -> list[list[int]]:
    """Each conversation's first turn, as its server would see it: the chat template for
    chat workloads, the bare text for /v1/completions ones (`tokenizer`: Hugging Face's
    or mlx-lm's)."""
    prompts = []
    for conversation in workload.conversations:
        if not chat:
            prompts.append(tokenizer.encode(conversation.user_turns[0]))
            continue
        messages = ([{"role": "system", "content": conversation.system}]
                    if conversation.system else [])
        messages.append({"role": "user", "content": conversation.user_turns[0]})
        prompts.append(list(tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=False)))
    return prompts


def optimal_cached_tokens(prompts: list[list[int]]) -> int:
    """The most of `prompts`' tokens any prefix cache could serve, were it unbounded and
    the prompts in the best order: each token of the prompts' trie is computed once (sorted,
    a prompt shares the most with its neighbour), and every prompt computes at least its
    last token, whose logits it needs. SGLang's paper measures its cache hit rate against
    this bound (96% of it)."""
    ordered = sorted(prompts)
    return sum(min(common_prefix_length(previous, prompt), len(prompt) - 1)
               for previous, prompt in itertools.pairwise(ordered))


def build_all(model_dir: Path, shapes: Shapes, seed: int) -> list[Workload]:
    """The timed workloads, each from its own seed so no two share text by accident."""
    return [make(TextSource(model_dir, seed + i), shapes)
            for i, make in enumerate(WORKLOADS.values())]


def build_warm_up(model_dir: Path, shapes: Shapes, seed: int) -> Workload:
    return warm_up(TextSource(model_dir, seed + 1000), shapes)


def build_list_warm_up(model_dir: Path, shapes: Shapes, seed: int) -> Workload:
    return warm_up_lists(TextSource(model_dir, seed + 2000), shapes)
