"""The prefill-only endpoints: /v1/embeddings, /v1/rerank (and vLLM's /v1/score, its
scores of given pairs) and /v1/classify.

On a causal model all three are prompts read at their last position (jobs.py):
an embedding is the last hidden state (last-token pooling, L2-normalised, as
Qwen3-Embedding and its peers pool), a rerank score the judge's P("yes") against P("no")
after a prompt that puts the query before the document (Qwen3-Reranker's format, so the
query's prefix is computed once for all documents), a classification the next token's
distribution. On an encoder model (engine/encoder.py) an embedding is a forward of its
own with the model's own pooling, and rerank scores are the cosine of query and document
embeddings; on a cross-encoder, each (query, document) pair's score from one forward.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
from collections.abc import Sequence, Sized
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.api import Prompt, Readout
from engine.embedding_config import hidden_size, matryoshka_dimensions
from engine.tokenizer import ModelTokenizer
from server.http.access_log import RequestStats
from server.http.errors import APIError, shown
from server.http.json_body import JSONRoute
from server.http.model_response import model_response
from server.http.openapi import error_responses
from server.http.streaming import CLIENT_CLOSED, unless_disconnected
from server.model_registry import ServedModel
from server.openai.adapter import content_images, template_message
from server.openai.protocol import ErrorResponse
from server.prefill.jobs import Reading, read_prompts
from server.prefill.protocol import (
    MAX_INPUTS,
    MAX_LABEL_READS,
    MAX_LABEL_TOKENS,
    Classification,
    ClassifyRequest,
    ClassifyResponse,
    ClassifyTopLogprob,
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    PrefillUsage,
    RerankDocument,
    RerankDocumentOut,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    TeiRank,
    TeiRerankResponse,
    document_fields,
    usage,
)
from server.prompts import chat_prompt, check_token_ids
from server.request import GenerationRequest
from server.state import ServerState, server_state

router = APIRouter(prefix="/v1", responses=error_responses(ErrorResponse),
                   route_class=JSONRoute)

# The most later label tokens one group's continuations read (LabelGroup).
GROUP_TOKENS = 64

JUDGE_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and '
                'the Instruct provided. Note that the answer can only be "yes" or "no".')
JUDGE_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@router.post("/embeddings", response_model=EmbeddingResponse)
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
    inputs = request_inputs(body.input, "input")
    embedded = await embed_texts(request, body.model, inputs, body.dimensions,
                                 body.truncate_prompt_tokens)
    if embedded is None:
        return Response(status_code=CLIENT_CLOSED)
    server_state(request).models.lookup(body.model).keep(body.ttl)
    model, vectors, prompt_tokens, cached = embedded
    data = [Embedding(index=i, embedding=encoded(vector, body.encoding_format))
            for i, vector in enumerate(vectors)]
    return model_response(EmbeddingResponse(data=data, model=model,
                                            usage=usage(prompt_tokens, cached)))


@dataclass(frozen=True)
class EmbedFields:
    """What an API's embeddings request calls embed_texts' arguments, as its 400s name
    them: OpenAI's and vLLM's unless it says."""

    input: str = "input"
    dimensions: str = "dimensions"
    truncate: str = "truncate_prompt_tokens"
    # The value of `truncate` that asks for the whole context window, where one does.
    whole_window: str | None = "-1"


async def embed_texts(request: Request, name: str | None, inputs: list[str] | list[list[int]],
                      dimensions: int | None, truncate: int | None,
                      fields: EmbedFields = EmbedFields(), window: int | None = None
                      ) -> tuple[str, np.ndarray, int, int] | None:
    """Each input's embedding by the model `name` names (every API's embeddings): the
    name it answers with, the vectors (cut to `dimensions`), the prompt tokens embedded and
    how many of them were cached, as the request's access-log line reports them; None if
    the client left. `truncate`: as truncate_prompt_tokens (-1: the context window).
    `window`: the request's own context window, within the model's (Ollama's num_ctx).
    An empty input is a 400 naming it."""
    _check_not_empty(inputs, fields.input)
    state = server_state(request)
    async with state.models.use(name) as lease:
        served = lease.model
        width, sizes = _embedding_sizes(served)
        if width is not None:  # before minutes of work rather than after
            _check_dimensions(dimensions, width, sizes, fields.dimensions)
        embedded = await _embed(request, state, served, inputs,
                                _indexed(fields.input, len(inputs)),
                                _kept_tokens(served, truncate, fields, window), window)
        if embedded is None:
            return None
        vectors, prompt_tokens, cached = embedded
        _log_tokens(request, prompt_tokens, cached)
        if width is None:  # the model's config did not say: the vectors do
            _check_dimensions(dimensions, *_embedding_sizes(served, vectors.shape[1]),
                              fields.dimensions)
    return (state.models.name_for(served, name), _cut(vectors, dimensions), prompt_tokens,
            cached)


# Also where other servers' rerank clients look: llama.cpp, vLLM, Jina's and TEI's at
# /rerank (llama.cpp's at /reranking and /v1/reranking too), Cohere's v2 SDK at /v2/rerank
# (its request is a subset of ours); vLLM's score clients at /score.
rerank_aliases = APIRouter(responses=error_responses(ErrorResponse), route_class=JSONRoute)
RerankAnswer = RerankResponse | TeiRerankResponse


@rerank_aliases.post("/rerank", response_model=RerankAnswer, include_in_schema=False)
@rerank_aliases.post("/reranking", response_model=RerankAnswer, include_in_schema=False)
@rerank_aliases.post("/v1/reranking", response_model=RerankAnswer, include_in_schema=False)
@rerank_aliases.post("/v2/rerank", response_model=RerankResponse, include_in_schema=False)
@router.post("/rerank", response_model=RerankAnswer)
async def rerank(body: RerankRequest, request: Request) -> Response:
    if body.raw_scores:
        raise APIError(400, "raw_scores (a cross-encoder's logit before its activation) is "
                       "not served: the scores are the model's relevance, as "
                       "sentence-transformers gives them; send false", code="invalid_request",
                       param="raw_scores")
    state = server_state(request)
    field = body.documents_field
    texts = _ranked_texts(body.documents, body.rank_fields, field)
    _check_not_empty(texts, field)
    async with state.models.use(body.model) as lease:
        served = lease.model
        if body.max_tokens_per_doc is not None:
            texts = await asyncio.to_thread(_documents_cut, served, texts,
                                            body.max_tokens_per_doc)
        scored = await _scores(request, state, served, body.query, texts, body.instruction,
                               _rerank_params(texts, field))
    model = state.models.name_for(served, body.model)
    if scored is None:
        return Response(status_code=CLIENT_CLOSED)
    scores, prompt_tokens, cached = scored
    order = sorted(range(len(texts)), key=lambda i: -scores[i])[:body.top_n or None]
    if body.is_tei:
        _log_tokens(request, prompt_tokens, cached)
        return model_response(TeiRerankResponse([
            TeiRank(index=i, text=texts[i] if body.return_text else None, score=scores[i])
            for i in order]), exclude_none=True)
    results = [RerankResult(index=i, relevance_score=scores[i],
                            document=RerankDocumentOut(**document_fields(body.documents[i]))
                            if body.return_documents else None) for i in order]
    response = RerankResponse(id=f"rerank-{request.state.request_id}", model=model,
                              results=results, usage=_usage(request, prompt_tokens, cached))
    return model_response(response, exclude_none=True)


@rerank_aliases.post("/score", response_model=ScoreResponse, include_in_schema=False)
@router.post("/score", response_model=ScoreResponse)
async def score(body: ScoreRequest, request: Request) -> Response:
    """Each (query, document) pair's score, as /rerank scores it, in the request's order.
    The documents of one query are scored together, as a rerank's are: a causal judge
    reads that query's prompt prefix once for all of them."""
    queries, documents = (request_inputs(texts, param) for texts, param
                          in ((body.queries, "queries"), (body.documents, "documents")))
    if len(queries) not in (1, len(documents)):
        raise APIError(400, f"{len(queries)} queries for {len(documents)} documents: send "
                       "one query for all the documents, or one for each (1:1, 1:N or N:N)",
                       code="invalid_request", param="documents")
    # Each document's index under the first index of its query's text.
    firsts: dict[str, int] = {}
    by_query: dict[int, list[int]] = {}
    for index, query in enumerate(queries if len(queries) > 1 else queries * len(documents)):
        by_query.setdefault(firsts.setdefault(query, index), []).append(index)
    state = server_state(request)
    scores = [0.0] * len(documents)
    prompt_tokens = cached = 0
    async with state.models.use(body.model) as lease:
        served = lease.model
        for query, indices in by_query.items():
            scored = await _scores(
                request, state, served, queries[query], [documents[i] for i in indices],
                body.instruction, [f"queries[{query}]", *(f"documents[{i}]" for i in indices)])
            if scored is None:
                return Response(status_code=CLIENT_CLOSED)
            for index, value in zip(indices, scored[0], strict=True):
                scores[index] = value
            prompt_tokens, cached = prompt_tokens + scored[1], cached + scored[2]
    return model_response(ScoreResponse(
        id=f"score-{request.state.request_id}", model=state.models.name_for(served, body.model),
        data=[ScoreData(index=i, score=value) for i, value in enumerate(scores)],
        usage=_usage(request, prompt_tokens, cached)))


@router.post("/classify", response_model=ClassifyResponse)
async def classify(body: ClassifyRequest, request: Request) -> Response:
    state = server_state(request)
    async with state.models.use(body.model) as lease:
        return await _classify(request, state, lease.model, body)


async def _classify(request: Request, state: ServerState, served: ServedModel,
                    body: ClassifyRequest) -> Response:
    model = state.models.name_for(served, body.model)
    tokenizer = served.tokenizer()
    if body.input is not None:
        param = "input"
        inputs = request_inputs(body.input, param)
        params = _indexed(param, len(inputs))
        prompts = await asyncio.to_thread(_prompts, tokenizer, inputs, params)
    else:
        param = "messages"
        _count(body.messages, param)
        params = _indexed(param, len(body.messages))
        prompts = await asyncio.to_thread(_chat_prompts, tokenizer, body.messages)
    _check_lengths(served, [prompt.tokens for prompt in prompts], params)
    labels = {label: _label_tokens(tokenizer, label) for label in body.labels or ()}
    _check_label_reads(served, prompts, labels, params)
    firsts = _distinct([tokens[0] for tokens in labels.values()])
    groups = _label_groups(labels)
    work = [(prompts, Readout(top_logprobs=body.top_logprobs, token_ids=firsts))]
    work += [([Prompt(prompt.tokens + labels[label][:i]) for prompt in prompts
               for label in group.labels for i in range(1, len(labels[label]))],
              Readout(token_ids=group.tokens)) for group in groups]
    readings = await read_prompts(request, state, served, work)
    if readings is None:
        return Response(status_code=CLIENT_CLOSED)
    first_at = _columns(firsts)
    data = []
    for index, reading in enumerate(readings[0]):
        last = reading.last
        scores = {label: last.token_logprobs[first_at[tokens[0]]] for label, tokens
                  in labels.items()}
        for group, part in zip(groups, readings[1:]):
            group.add_later_logprobs(scores, labels, part, index)
        top = [ClassifyTopLogprob(token=t.text, token_id=t.token, logprob=t.logprob)
               for t in last.top] if body.top_logprobs else None
        data.append(Classification(index=index, token=last.token.text,
                                   token_id=last.token.token, logprob=last.token.logprob,
                                   top_logprobs=top, labels=scores if labels else None))
    response = ClassifyResponse(
        id=f"classify-{request.state.request_id}", model=model, data=data,
        usage=_usage(request, sum(r.prompt_tokens for r in readings[0]),
                     sum(r.cached_tokens for r in readings[0])))
    return model_response(response, exclude_none=True)


def _usage(request: Request, prompt_tokens: int, cached_tokens: int) -> PrefillUsage:
    """The response's usage, also what the request's access-log line reports."""
    _log_tokens(request, prompt_tokens, cached_tokens)
    return usage(prompt_tokens, cached_tokens)


def _log_tokens(request: Request, prompt_tokens: int, cached_tokens: int) -> None:
    request.state.stats = RequestStats(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens)


# -- inputs ------------------------------------------------------------------------------

def request_inputs(value: str | list, param: str) -> list[str] | list[list[int]]:
    """A request's inputs as a list of texts or of token-id lists; none, an empty one, or
    more than MAX_INPUTS is a 400 that names the input."""
    if isinstance(value, str) or value and all(isinstance(item, int) for item in value):
        value = [value]
    _count(value, param)
    _check_not_empty(value, param)
    return value


def _check_not_empty(items: Sequence[Sized], param: str) -> None:
    """An empty text or token-id list is a 400 naming it: it has nothing to read."""
    for index, item in enumerate(items):
        if len(item) == 0:
            raise APIError(400, f"{param}[{index}] is empty", code="invalid_request",
                           param=f"{param}[{index}]")


def _count(items: Sequence[object], param: str) -> None:
    if not items:
        raise APIError(400, f"{param} is empty", code="invalid_request", param=param)
    if len(items) > MAX_INPUTS:
        raise APIError(400, f"{len(items)} inputs in one request; at most {MAX_INPUTS}",
                       code="invalid_request", param=param)


def _prompts(tokenizer: ModelTokenizer, inputs: Sequence[str | list[int]],
             params: Sequence[str]) -> list[Prompt]:
    """Texts are encoded as legacy completions' prompts are (together); token ids taken
    as given, a 400 naming the input (`params`, one an input) where one is out of the
    vocabulary, or where a text encodes to no tokens (control characters the tokenizer
    drops): the engine has nothing to read. Classify's inputs may mix the two."""
    _check_token_id_inputs(inputs, tokenizer.vocab_size, params)
    texts = [item for item in inputs if isinstance(item, str)]
    encoded = iter(tokenizer.encode_batch(texts) if texts else ())
    prompts = [Prompt(next(encoded) if isinstance(item, str) else list(item))
               for item in inputs]
    for prompt, param in zip(prompts, params, strict=True):
        if not prompt.tokens:
            raise APIError(400, f"{param} encodes to no tokens", code="invalid_request",
                           param=param)
    return prompts


def _check_token_id_inputs(inputs: Sequence[str | list[int]], vocab_size: int,
                           params: Sequence[str]) -> None:
    for item, param in zip(inputs, params, strict=True):
        if not isinstance(item, str):
            check_token_ids(item, vocab_size, param)


def _chat_prompts(tokenizer: ModelTokenizer, chats: list[list]) -> list[Prompt]:
    if not tokenizer.has_chat_template:
        raise APIError(400, "this model has no chat template to render messages with: "
                       "send input (texts or token ids) instead", code="invalid_request",
                       param="messages")
    if any(content_images(message.content) for chat in chats for message in chat):
        raise APIError(400, "these endpoints read text: send the chats without image parts",
                       code="invalid_image", param="messages")
    return [chat_prompt(tokenizer, GenerationRequest(
        messages=tuple(template_message(message) for message in chat))) for chat in chats]


def _check_lengths(model: ServedModel, prompts: Sequence[Sequence[int]],
                   params: Sequence[str], window: int | None = None) -> None:
    """A prompt over the model's context window (or the request's own `window`, where
    narrower) is a 400 naming the field it came from (`params`, one a prompt)."""
    limit = _window(model, window)
    whose = "this model's maximum" if limit == model.engine.context_length else "the request's"
    for tokens, param in zip(prompts, params, strict=True):
        if len(tokens) > limit:
            raise APIError(
                400, f"{param} has {len(tokens)} tokens; {whose} context length is {limit}",
                code="context_length_exceeded", param=param)


def _window(model: ServedModel, window: int | None) -> int:
    """The most tokens an input may have: the model's context window, or the request's
    own where it is narrower."""
    limit = model.engine.context_length
    return limit if window is None else min(limit, window)


def _indexed(param: str, count: int) -> list[str]:
    """The names of a list field's items, as a 400 gives them: input[0], input[1], ..."""
    return [f"{param}[{index}]" for index in range(count)]


def _label_tokens(tokenizer: ModelTokenizer, label: str) -> list[int]:
    tokens = tokenizer.encode(label, special_tokens=False)
    if not tokens:
        raise APIError(400, f"the label {label!r} encodes to no tokens",
                       code="invalid_request", param="labels")
    if len(tokens) > MAX_LABEL_TOKENS:
        raise APIError(400, f"the label {shown(label)} has {len(tokens)} tokens; at most "
                       f"{MAX_LABEL_TOKENS}", code="invalid_request", param="labels")
    return tokens


def _check_label_reads(model: ServedModel, prompts: Sequence[Prompt],
                       labels: dict[str, list[int]], params: Sequence[str]) -> None:
    """Scoring multi-token labels reads each input again once per label token after the
    first: a 400 where that is more than MAX_LABEL_READS prompts, or where an input and
    its longest label go past the model's context window (naming its field: `params`,
    one a prompt)."""
    reads = len(prompts) * sum(len(tokens) - 1 for tokens in labels.values())
    if reads > MAX_LABEL_READS:
        raise APIError(400, f"scoring these labels reads {reads} continuations of the "
                       f"inputs; at most {MAX_LABEL_READS}: send fewer inputs or labels",
                       code="invalid_request", param="labels")
    longest = max((len(tokens) - 1 for tokens in labels.values()), default=0)
    limit = model.engine.context_length
    for prompt, param in zip(prompts, params, strict=True):
        if longest and len(prompt.tokens) + longest > limit:
            raise APIError(
                400, f"{param} has {len(prompt.tokens)} tokens and the longest label "
                f"{longest + 1}; this model's maximum context length is {limit}",
                code="context_length_exceeded", param=param)


@dataclass(frozen=True)
class LabelGroup:
    """Labels of more than one token whose later tokens are read together. A label of n
    tokens is scored exactly: its first token at each input's end, each next one at the
    end of the input followed by the label's tokens before it. Those continuations go
    input by input, so the ones in a job share an input (cached once for all of them);
    each reads only its group's later label tokens, at most GROUP_TOKENS of them, rather
    than every label's."""

    labels: tuple[str, ...]
    tokens: tuple[int, ...]  # the later tokens the continuations read, distinct

    def add_later_logprobs(self, scores: dict[str, float], labels: dict[str, list[int]],
                           readings: Sequence[Reading], index: int) -> None:
        """Add to input `index`'s label scores the logprobs of their later tokens, from
        the group's `readings` (each input's continuations, label by label)."""
        position = index * sum(len(labels[label]) - 1 for label in self.labels)
        for label in self.labels:
            for token in labels[label][1:]:
                scores[label] += readings[position].last.token_logprobs[self.columns[token]]
                position += 1

    @cached_property
    def columns(self) -> dict[int, int]:
        """Where each token's logprob is in a reading."""
        return _columns(self.tokens)


def _label_groups(labels: dict[str, list[int]]) -> list[LabelGroup]:
    """The labels of more than one token, in order, in groups of at most GROUP_TOKENS
    distinct later tokens."""
    groups: list[LabelGroup] = []
    members: list[str] = []
    tokens: dict[int, None] = {}
    for label, ids in labels.items():
        later = dict.fromkeys(ids[1:])
        if members and len(tokens | later) > GROUP_TOKENS:
            groups.append(LabelGroup(tuple(members), tuple(tokens)))
            members, tokens = [], {}
        if later:
            members.append(label)
            tokens |= later
    if members:
        groups.append(LabelGroup(tuple(members), tuple(tokens)))
    return groups


def _distinct(tokens: Sequence[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(tokens))


def _columns(token_ids: Sequence[int]) -> dict[int, int]:
    """Where each of a readout's `token_ids` is in its `token_logprobs`."""
    return {token: column for column, token in enumerate(token_ids)}


# -- embeddings --------------------------------------------------------------------------

def _is_encoder(model: ServedModel) -> bool:
    """Whether the model's engine is an encoder's (engine/encoder.py), which embeds
    by itself rather than through readouts of prompts."""
    return hasattr(model.engine, "embed")


def _is_cross_encoder(model: ServedModel) -> bool:
    return _is_encoder(model) and model.engine.is_cross_encoder


async def _embed(request: Request, state: ServerState, model: ServedModel,
                 inputs: list[str] | list[list[int]], params: Sequence[str],
                 most: int | None, window: int | None = None
                 ) -> tuple[np.ndarray, int, int] | None:
    """Each input's embedding (rows L2-normalised where the model's pipeline normalises),
    the prompt tokens embedded and how many of them were cached; None if the client left.
    Inputs are cut to their first `most` tokens (`_truncated`); with None, an input too long
    (for the request's `window` too) is a 400 naming its field (`params`, one an input)."""
    engine = model.engine
    if _is_cross_encoder(model):
        raise APIError(400, f"the model {model.id} is {engine.description}",
                       code="model_not_supported", param="model")
    texts = isinstance(inputs[0], str)
    if _is_encoder(model):
        if texts:
            tokens = await asyncio.to_thread(engine.encode, inputs)
        else:
            _check_token_id_inputs(inputs, engine.vocab_size, params)
            tokens = inputs
        ending = engine.trailing_specials
    else:
        tokenizer = model.tokenizer()
        prompts = await asyncio.to_thread(_prompts, tokenizer, inputs, params)
        tokens, ending = [prompt.tokens for prompt in prompts], tokenizer.trailing_specials
    tokens = [_truncated(ids, most, ending if texts else 0) for ids in tokens]
    _check_lengths(model, tokens, params, window)
    if _is_encoder(model):
        vectors = await unless_disconnected(request, asyncio.wrap_future(engine.embed(tokens)))
        return None if vectors is None else (vectors, sum(map(len, tokens)), 0)
    readings = await read_prompts(request, state, model,
                                  [([Prompt(ids) for ids in tokens], Readout(hidden=True))])
    if readings is None:
        return None
    vectors = np.array([reading.last.hidden for reading in readings[0]], np.float32)
    return (normalised(vectors), sum(r.prompt_tokens for r in readings[0]),
            sum(r.cached_tokens for r in readings[0]))


def _kept_tokens(model: ServedModel, requested: int | None,
                 fields: EmbedFields = EmbedFields(), window: int | None = None) -> int | None:
    """The most tokens an embedding input keeps: the request's truncate_prompt_tokens (-1:
    the context window, the request's own `window` where narrower; more than that is a
    400, as vLLM answers), else the window where the model's settings say
    truncate_embedding_inputs (TEI's --auto-truncate); None: an input over the window is a
    400, as OpenAI answers."""
    limit = _window(model, window)
    if requested is None:
        return limit if model.settings.truncate_embedding_inputs else None
    if requested > limit:
        whole = f", or {fields.whole_window} for the maximum" if fields.whole_window else ""
        raise APIError(400, f"{fields.truncate} is {requested}, more than this model's "
                       f"maximum context length {limit}: send at most {limit}{whole}",
                       code="invalid_request", param=fields.truncate)
    return limit if requested == -1 else requested


def _truncated(tokens: list[int], most: int | None, ending: int) -> list[int]:
    """`tokens` cut to their first `most` (None: all), their last `ending` kept at the end:
    a text keeps the special tokens its tokenizer ends it with ([SEP]), token ids none. On
    an encoder that is sentence-transformers' cut, so the embedding is its reference's. On
    a causal model it is vLLM's for a pooling model (its tokenizer truncates on the right,
    token ids keep their first k): last-token pooling still reads the token it was trained
    to pool (the EOS an embedding model's tokenizer appends), after the text's start, where
    an instruction goes, which cutting the start instead would drop."""
    if most is None or len(tokens) <= most:
        return tokens
    ending = min(ending, most - 1)
    return tokens[:most - ending] + tokens[len(tokens) - ending:]


def _embedding_sizes(model: ServedModel, width: int | None = None
                     ) -> tuple[int | None, Sequence[int] | None]:
    """The values in one of the model's embeddings, an encoder's sentence embedding or a
    causal model's last hidden state (`width` where known; None where its config does
    not say), and the sizes it may be cut to (Matryoshka; None: only its own)."""
    if _is_encoder(model):
        return model.engine.dimensions, model.engine.matryoshka
    config = json.loads((model.engine.model_path / "config.json").read_text())
    width = width or hidden_size(config)
    return width, None if width is None else matryoshka_dimensions(config, width)


def _check_dimensions(dimensions: int | None, width: int, sizes: Sequence[int] | None,
                      param: str) -> None:
    """A `dimensions` (the request's `param`) other than `width` is a 400 unless the model
    was trained to be cut there (Matryoshka, `sizes`)."""
    if dimensions is None or dimensions == width:
        return
    if sizes is None:
        raise APIError(400, f"this model's embeddings have {width} dimensions, not "
                       f"{dimensions}, and it does not support Matryoshka truncation: send "
                       f"{param} {width} or none", code="invalid_request", param=param)
    if dimensions not in sizes:
        allowed = (f"between {sizes[0]} and {sizes[-1]}" if isinstance(sizes, range)
                   else f"one of {list(sizes)}")
        raise APIError(400, f"{param} must be {allowed} for this model",
                       code="invalid_request", param=param)


def _cut(vectors: np.ndarray, dimensions: int | None) -> np.ndarray:
    """The first `dimensions` values of each vector (checked: `_check_dimensions`),
    renormalised; the full vectors when not asked."""
    if dimensions is None or dimensions == vectors.shape[1]:
        return vectors
    return normalised(vectors[:, :dimensions])


def normalised(vectors: np.ndarray) -> np.ndarray:
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


def encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


# -- rerank ------------------------------------------------------------------------------

async def _scores(request: Request, state: ServerState, model: ServedModel, query: str,
                  documents: list[str], instruction: str | None, params: list[str]
                  ) -> tuple[list[float], int, int] | None:
    """Each document's relevance to `query` by the model's kind of scorer, the prompt
    tokens read and how many were cached; None if the client left. `params`: the fields of
    the query and of each document, as a 400 names them."""
    if _is_cross_encoder(model):
        return await _pair_scores(request, model, query, documents)
    if _is_encoder(model):
        return await _cosine_scores(request, state, model, query, documents, params)
    return await _judge_scores(request, state, model, query, documents, instruction, params)


async def _cosine_scores(request: Request, state: ServerState, model: ServedModel, query: str,
                         documents: list[str], params: list[str]
                         ) -> tuple[list[float], int, int] | None:
    embedded = await _embed(request, state, model, [query, *documents], params,
                            _kept_tokens(model, None))
    if embedded is None:
        return None
    vectors, prompt_tokens, cached = embedded
    vectors = normalised(vectors)
    return (vectors[1:] @ vectors[0]).tolist(), prompt_tokens, cached


async def _pair_scores(request: Request, model: ServedModel, query: str, documents: list[str]
                       ) -> tuple[list[float], int, int] | None:
    """A cross-encoder's score of each (query, document), each pair cut to its length;
    None if the client left (its pairs not yet scored are dropped)."""
    engine = model.engine
    pairs = await asyncio.to_thread(engine.encode_pairs, query, documents)
    scores = await unless_disconnected(request, asyncio.wrap_future(engine.score(pairs)))
    return None if scores is None else (scores.tolist(), sum(len(ids) for ids, _ in pairs), 0)


async def _judge_scores(request: Request, state: ServerState, model: ServedModel,
                        query: str, documents: list[str], instruction: str | None,
                        params: list[str]) -> tuple[list[float], int, int] | None:
    """P("yes") / (P("yes") + P("no")) after each judge prompt."""
    tokenizer = model.tokenizer()
    if not tokenizer.has_chat_template:
        raise APIError(400, f"the model {model.id} has no chat template, which a causal "
                       "model judges documents through: rerank with a model that has one, "
                       "a cross-encoder or an embedding model", code="model_not_supported",
                       param="model")
    told = instruction or JUDGE_INSTRUCTION
    # The first prompt has no document: where it is over the context window, the query
    # (with the instruction) is to blame rather than every document.
    prompts = await asyncio.to_thread(_judge_prompts, tokenizer, told, query, ["", *documents])
    if instruction and len(prompts[0].tokens) > model.engine.context_length:
        # Over with an empty query too: the instruction is to blame.
        alone = await asyncio.to_thread(_judge_prompts, tokenizer, told, "", [""])
        if len(alone[0].tokens) > model.engine.context_length:
            params = ["instruction", *params[1:]]
    _check_lengths(model, [prompt.tokens for prompt in prompts], params)
    yes, no = (tokenizer.encode(word, special_tokens=False)[0] for word in ("yes", "no"))
    readings = await read_prompts(request, state, model,
                                  [(prompts[1:], Readout(token_ids=(yes, no)))])
    if readings is None:
        return None
    scores = [judge_score(*r.last.token_logprobs) for r in readings[0]]
    return (scores, sum(r.prompt_tokens for r in readings[0]),
            sum(r.cached_tokens for r in readings[0]))


def judge_score(yes: float, no: float) -> float:
    """The judge's P(yes) / (P(yes) + P(no)) from the two log-probabilities: the sigmoid of
    their gap, in a form finite at any gap (1 / (1 + exp(no - yes)) overflows past ~709)."""
    return 0.5 * (1.0 + math.tanh((yes - no) / 2))


def _ranked_texts(documents: Sequence[str | RerankDocument], fields: Sequence[str] | None,
                  name: str) -> list[str]:
    """What each document is ranked by: a string itself; an object its text, or with
    Cohere v1's rank_fields those of its fields it has, in that order, as YAML's `key:
    value` lines (how Cohere asks structured documents to be sent). One with none of them
    is a 400 naming it (by the documents' `name`), as is a ranked field that is not a
    string."""
    texts = []
    for index, document in enumerate(documents):
        param = f"{name}[{index}]"
        if isinstance(document, str):
            texts.append(document)
            continue
        if fields is None:
            if document.text is None:
                raise APIError(400, f"{param} has no text: send one, or rank_fields naming "
                               "the fields to rank it by", code="invalid_request", param=param)
            texts.append(document.text)
            continue
        values = document_fields(document)
        named = [(field, values[field]) for field in fields if field in values]
        if not named:
            raise APIError(400, f"{param} has none of the rank_fields {list(fields)}",
                           code="invalid_request", param=param)
        for field, value in named:
            if not isinstance(value, str):
                raise APIError(400, f"{param}.{field} is ranked (rank_fields): it must be a "
                               "string", code="invalid_request", param=f"{param}.{field}")
        texts.append("\n".join(f"{field}: {value}" for field, value in named))
    return texts


def _documents_cut(model: ServedModel, documents: list[str], most: int) -> list[str]:
    """Each document cut to its first `most` tokens (Cohere v2's max_tokens_per_doc), as
    the text they decode to: every scorer reads a document as text (a judge's inside its
    prompt, a cross-encoder's paired with the query)."""
    tokenizer = model.text_tokenizer()
    cut = []
    for document in documents:
        tokens = tokenizer.encode(document, special_tokens=False)
        cut.append(document if len(tokens) <= most else tokenizer.decode(tokens[:most]))
    return cut


def _rerank_params(documents: Sequence[str], name: str) -> list[str]:
    """The fields of a rerank's query and documents (named `name`), in that order."""
    return ["query", *_indexed(name, len(documents))]


def _judge_prompts(tokenizer: ModelTokenizer, instruction: str, query: str,
                   documents: list[str]) -> list[Prompt]:
    """Qwen3-Reranker's prompt through the model's template: the instruction and query
    come first, so every document's prompt shares them."""
    return [chat_prompt(tokenizer, GenerationRequest(
        messages=({"role": "system", "content": JUDGE_SYSTEM},
                  {"role": "user", "content": f"<Instruct>: {instruction}\n"
                   f"<Query>: {query}\n<Document>: {document}"}),
        chat_template_kwargs={"enable_thinking": False})) for document in documents]
