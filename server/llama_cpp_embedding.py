"""llama.cpp's native /embedding, in its own request and response shapes: for clients
written for llama.cpp's server that embed through it rather than /v1/embeddings. It
answers at /embeddings too, as llama.cpp's does (the same handler there: its
"non-OpenAI-compatible embeddings API"; only /v1/embeddings answers OpenAI's shape).

The body's `content` (or `input`, as llama.cpp also takes it) is what /v1/embeddings'
`input` is (a text, texts, token ids or lists of them); the answer is a bare list of
`{index, embedding}`, each vector nested in a list as llama.cpp nests a pooled one (its
unpooled answer is a vector per token, which this server does not compute).
`embd_normalize` is llama.cpp's norm over each vector.
"""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import AliasChoices, Field, TypeAdapter

from server.http.errors import APIError
from server.http.json_body import AnyTypeJSONRoute
from server.http.openapi import error_responses
from server.http.streaming import CLIENT_CLOSED
from server.openai.protocol import ErrorResponse
from server.prefill.protocol import EmbeddingInput
from server.prefill.routes import EmbedFields, embed_texts, request_inputs
from server.schema import RequestModel, ResponseModel

router = APIRouter(responses=error_responses(ErrorResponse), route_class=AnyTypeJSONRoute)


class LlamaEmbeddingRequest(RequestModel):
    model: str | None = None
    # llama.cpp takes OpenAI's name for it too.
    content: EmbeddingInput = Field(validation_alias=AliasChoices("content", "input"))
    # llama.cpp's: 2 euclidean (its default), 1 taxicab, 0 the largest value scaled to
    # int16's range, above 2 that p-norm; -1 (none) is a 400, as this server's vectors
    # come normalised already (the model's own pooling, or L2 after the last token).
    # At most llama.cpp's int: a larger integer reached numpy as an object and was a 500.
    embd_normalize: int = Field(2, le=2**31 - 1)


class LlamaEmbedding(ResponseModel):
    index: int
    embedding: list[list[float]]


ITEMS = TypeAdapter(list[LlamaEmbedding])


@router.post("/embeddings", response_model=list[LlamaEmbedding], include_in_schema=False)
@router.post("/embedding", response_model=list[LlamaEmbedding])
async def embedding(body: LlamaEmbeddingRequest, request: Request) -> Response:
    if body.embd_normalize < 0:
        raise APIError(400, "this server's embeddings come normalised: embd_normalize -1 "
                       "(none) is not served; send 2 (euclidean, the default), 1 or 0",
                       code="invalid_request", param="embd_normalize")
    inputs = request_inputs(body.content, "content")
    embedded = await embed_texts(request, body.model, inputs, None, None,
                                 EmbedFields(input="content"))
    if embedded is None:
        return Response(status_code=CLIENT_CLOSED)
    vectors = _normalised(embedded[1], body.embd_normalize)
    items = [LlamaEmbedding(index=index, embedding=[vector.tolist()])
             for index, vector in enumerate(vectors)]
    return Response(ITEMS.dump_json(items), media_type="application/json")


def _normalised(vectors: np.ndarray, norm: int) -> np.ndarray:
    """Each vector as llama.cpp's common_embd_normalize scales it."""
    largest = np.abs(vectors).max(axis=1, keepdims=True)
    if norm == 0:
        return vectors / np.maximum(largest / 32760, 1e-12)
    # Each value over the row's largest before the power, in float64: |x|^p of a large p
    # underflows to 0 otherwise (the vector came back huge); this way it nears its limit,
    # the largest value.
    ratios = np.abs(vectors.astype(np.float64)) / np.maximum(largest, 1e-12)
    scale = largest * np.sum(ratios ** norm, axis=1, keepdims=True) ** (1 / norm)
    return (vectors / np.maximum(scale, 1e-12)).astype(vectors.dtype)
