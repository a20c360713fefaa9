"""Pydantic models of the prefill-only endpoints: OpenAI's /v1/embeddings, the Cohere/Jina
/v1/rerank that vLLM, llama.cpp and SGLang serve (and TEI's, as llama.cpp does), vLLM's
/v1/score (rerank's scores of given pairs, in their order), and /v1/classify (a batch of
prompts, the token at each one's last position and its logprobs)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    AliasChoices,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    RootModel,
    model_validator,
)

from server.openai.protocol import PROMPT_SHAPES, ChatRequestMessage, TokenId, prompt_kind
from server.schema import (
    MAX_TOP_LOGPROBS,
    IdleTtl,
    RequestModel,
    ResponseModel,
    now,
    shaped_union,
)

# Inputs one request may carry; more is a 400 rather than a queue of thousands.
MAX_INPUTS = 2048
TOKEN_IDS_INPUT = list[TokenId]
# Classify's labels: how many a request scores, and a label's tokens. A label of n tokens
# costs each input n - 1 more prompts (routes.py), so their total is bounded too.
MAX_LABELS = 256
MAX_LABEL_TOKENS = 64
MAX_LABEL_READS = 4 * MAX_INPUTS
# Validated by their shape (server.schema.shaped_union), so a bad input gets one error that
# says what it should be. Empty ones pass here: routes.py names the empty item.
EmbeddingInput = shaped_union(prompt_kind, PROMPT_SHAPES, text=str, texts=list[str],
                              tokens=TOKEN_IDS_INPUT, batch=list[TOKEN_IDS_INPUT])
ClassifyInput = shaped_union(
    lambda value: "text" if isinstance(value, str) else "tokens" if isinstance(value, list)
    else None, "a string or a list of token ids", text=str, tokens=TOKEN_IDS_INPUT)


def _tokens_kept(count: int) -> int:
    if count < 1 and count != -1:
        raise ValueError(f"must be a number of tokens, at least 1, or -1 for the model's "
                         f"maximum (got {count})")
    return count


# vLLM's truncate_prompt_tokens: each input cut to its first k tokens (-1: the model's
# context window) rather than refused when longer (routes.py says which tokens stay).
TruncatePromptTokens = Annotated[int, AfterValidator(_tokens_kept)]


class EmbeddingRequest(RequestModel):
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    ttl: IdleTtl | None = None


class Embedding(ResponseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the float32 values' little-endian bytes


class PromptTokensOnly(ResponseModel):
    cached_tokens: int = 0


class PrefillUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensOnly


class EmbeddingResponse(ResponseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: PrefillUsage


class RerankDocument(RequestModel):
    """A document as an object: Jina's {text}, or Cohere v1's of any fields, which its
    rank_fields may name to rank it by instead of its text; it comes back whole."""

    model_config = ConfigDict(extra="allow")
    text: str | None = None


RerankDocumentInput = shaped_union(
    lambda value: "text" if isinstance(value, str) else "document" if isinstance(value, dict)
    else None, "a string or an object (its text, or the fields rank_fields names)",
    text=str, document=RerankDocument)


class RerankRequest(RequestModel):
    """Jina's and Cohere's request, or Hugging Face TEI's: a body with TEI's `texts` for
    `documents` is TEI's and gets TEI's answer (`is_tei`), as llama.cpp tells them apart."""

    model: str | None = None
    query: Annotated[str, Field(min_length=1)]
    documents: Annotated[list[RerankDocumentInput],
                         Field(min_length=1, max_length=MAX_INPUTS,
                               validation_alias=AliasChoices("documents", "texts"))]
    # 0 is every document, as vLLM takes it (its default, so its clients send it).
    top_n: Annotated[int, Field(ge=0)] | None = None
    return_documents: bool = True
    # What the causal judge is told relevance means (Qwen3-Reranker's "Instruct").
    instruction: str | None = None
    # Cohere v1's: the fields of object documents that rank them, in this order.
    rank_fields: Annotated[list[str], Field(min_length=1)] | None = None
    # Cohere v2's: each document ranked by its first tokens only. Unsaid, it is read whole
    # (Cohere's default, 4096, is past most windows served here: those 400 a longer one).
    max_tokens_per_doc: Annotated[int, Field(ge=1)] | None = None
    # TEI's: each result's text; a cross-encoder's logit before its activation (a 400,
    # routes.py). Its truncate needs nothing here: unsaid, it is the server's
    # --truncate-embedding-inputs (TEI's --auto-truncate), which the scorers follow.
    return_text: bool = False
    raw_scores: bool = False
    _tei: bool = PrivateAttr(default=False)

    @model_validator(mode="wrap")
    @classmethod
    def _note_tei(cls, data: object, handler: ModelWrapValidatorHandler[RerankRequest]
                  ) -> RerankRequest:
        request = handler(data)
        request._tei = isinstance(data, dict) and "texts" in data
        return request

    @property
    def is_tei(self) -> bool:
        return self._tei

    @property
    def documents_field(self) -> str:
        """The documents' name in the request, as its 400s name them."""
        return "texts" if self._tei else "documents"


class RerankResult(ResponseModel):
    index: int
    relevance_score: float
    document: RerankDocumentOut | None = None


class RerankDocumentOut(ResponseModel):
    """The document as sent: a string's text, or an object's every field."""

    model_config = ConfigDict(extra="allow")
    text: str | None = None


class RerankResponse(ResponseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: PrefillUsage


class TeiRank(ResponseModel):
    index: int
    text: str | None = None
    score: float


class TeiRerankResponse(RootModel[list[TeiRank]]):
    """TEI's answer: the ranks alone, by score."""


class CohereErrorResponse(ResponseModel):
    """Cohere's error object: the request's id and the message, which Cohere's SDKs hand
    their caller as the error's body."""
    id: str | None = None
    message: str


class TeiErrorResponse(ResponseModel):
    """TEI's error object: the message and its kind, which TEI's clients
    (huggingface_hub's InferenceClient) read where OpenAI's clients read error.message."""
    error: str
    error_type: Literal["Validation", "Overloaded", "Unhealthy", "Backend"]


# vLLM's score inputs, a text or a list of texts (its multimodal content is not served).
ScoreTexts = shaped_union(
    lambda value: "text" if isinstance(value, str) else "texts" if isinstance(value, list)
    else None, "a string or a list of strings", text=str, texts=list[str])


class ScoreRequest(RequestModel):
    """vLLM's: one query scored against each document, or each query against the document
    at its index. The lists go by any of vLLM's names for them (text_1 and text_2, its
    first; data_1 and data_2; queries with documents or items); a list of the wrong shape is
    named as sent, the 400s about its items (empty, too long) as queries and documents."""

    model: str | None = None
    queries: ScoreTexts = Field(validation_alias=AliasChoices("queries", "text_1", "data_1"))
    documents: ScoreTexts = Field(
        validation_alias=AliasChoices("documents", "text_2", "items", "data_2"))
    # Rerank's: what the causal judge is told relevance means.
    instruction: str | None = None


class ScoreData(ResponseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now)
    model: str
    data: list[ScoreData]
    usage: PrefillUsage


class ClassifyRequest(RequestModel):
    """Either `input` (prompts as text or token ids) or `messages` (chats, rendered with
    the model's template), not both."""

    model: str | None = None
    input: list[ClassifyInput] | None = None
    messages: list[list[ChatRequestMessage]] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    labels: Annotated[list[Annotated[str, Field(min_length=1)]],
                      Field(max_length=MAX_LABELS)] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ClassifyRequest:
        if (self.input is None) == (self.messages is None):
            raise ValueError("give either input or messages")
        return self


class ClassifyTopLogprob(ResponseModel):
    token: str
    token_id: int
    logprob: float


class Classification(ResponseModel):
    index: int
    token: str
    token_id: int
    logprob: float
    top_logprobs: list[ClassifyTopLogprob] | None = None
    labels: dict[str, float] | None = None


class ClassifyResponse(ResponseModel):
    object: Literal["list"] = "list"
    id: str
    model: str
    data: list[Classification]
    usage: PrefillUsage


def usage(prompt_tokens: int, cached_tokens: int) -> PrefillUsage:
    return PrefillUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens,
                        prompt_tokens_details=PromptTokensOnly(cached_tokens=cached_tokens))


def document_fields(document: str | RerankDocument) -> dict[str, object]:
    """A document's fields as sent: a string's as an object's text."""
    return {"text": document} if isinstance(document, str) else document.model_dump(
        exclude_unset=True)
