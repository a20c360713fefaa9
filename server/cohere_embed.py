"""Cohere's embed API, /v1/embed and /v2/embed, in its own request and response shapes:
for clients written for Cohere's (its SDK's `embed`, frameworks' Cohere embedders)
pointed at this server.

`texts` are embedded as /v1/embeddings' inputs are. `input_type` is taken and changes
nothing: Cohere's models read it as a token of their own that this server's models do
not have (an instruction-tuned embedding model is told by its text: put the instruction
in the texts). `truncate` END, Cohere's default, cuts an input over the context window,
or over v2's `max_tokens`, to its first tokens; NONE refuses it (a 400); START, which
keeps its last tokens, is a 400. `output_dimension` is /v1/embeddings' `dimensions`.

`embedding_types`: float; base64, the float32 values' little-endian bytes; and the packed
sign bits, ubinary (a byte for each eight values, the first the high bit, set where the
value is above 0) and binary (that byte less 128). int8 and uint8 are a 400: Cohere
quantizes to them by ranges calibrated for its own models, which no other model's values
share. Without embedding_types, v1 answers `embeddings_floats` (a list of vectors); v2,
whose default is float, always answers `embeddings_by_type`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ConfigDict, Field

from server.http.errors import APIError
from server.http.json_body import JSONRoute
from server.http.model_response import model_response
from server.http.openapi import error_responses
from server.http.streaming import CLIENT_CLOSED
from server.prefill.protocol import CohereErrorResponse
from server.prefill.routes import EmbedFields, embed_texts, encoded, request_inputs
from server.schema import RequestModel, ResponseModel

router = APIRouter(responses=error_responses(CohereErrorResponse), route_class=JSONRoute)

InputType = Literal["search_document", "search_query", "classification", "clustering", "image"]
EmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]
QUANTIZED = ("int8", "uint8")
# Cohere's names, in its 400s; max_tokens has no value that means the whole window.
FIELDS = EmbedFields(input="texts", dimensions="output_dimension", truncate="max_tokens",
                     whole_window=None)


class EmbedRequest(RequestModel):
    model: str | None = None
    texts: list[str] = Field(default_factory=list)
    # What is not text (a 400): images as data URIs, v2's inputs of mixed parts.
    images: list[str] | None = None
    inputs: list[dict[str, Any]] | None = None
    input_type: InputType | None = None
    embedding_types: Annotated[list[EmbeddingType], Field(min_length=1)] | None = None
    truncate: Literal["NONE", "START", "END"] = "END"
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    output_dimension: Annotated[int, Field(ge=1)] | None = None


class EmbeddingsByType(ResponseModel):
    model_config = ConfigDict(extra="forbid", serialize_by_alias=True)

    float_: list[list[float]] | None = Field(None, alias="float")
    binary: list[list[int]] | None = None
    ubinary: list[list[int]] | None = None
    base64: list[str] | None = None


class ApiVersion(ResponseModel):
    version: Literal["1", "2"]


class BilledUnits(ResponseModel):
    input_tokens: int


class Meta(ResponseModel):
    api_version: ApiVersion
    billed_units: BilledUnits


class EmbedFloatsResponse(ResponseModel):
    id: str
    response_type: Literal["embeddings_floats"] = "embeddings_floats"
    embeddings: list[list[float]]
    texts: list[str]
    meta: Meta


class EmbedByTypeResponse(ResponseModel):
    id: str
    response_type: Literal["embeddings_by_type"] = "embeddings_by_type"
    embeddings: EmbeddingsByType
    texts: list[str]
    meta: Meta


@router.post("/v1/embed", response_model=EmbedFloatsResponse | EmbedByTypeResponse)
async def embed_v1(body: EmbedRequest, request: Request) -> Response:
    return await _embed(body, request, "1")


@router.post("/v2/embed", response_model=EmbedByTypeResponse)
async def embed_v2(body: EmbedRequest, request: Request) -> Response:
    return await _embed(body, request, "2")


async def _embed(body: EmbedRequest, request: Request, version: Literal["1", "2"]) -> Response:
    for param in ("images", "inputs"):
        if getattr(body, param):
            raise APIError(400, f"{param} are not served: this server embeds texts only; "
                           "send them as texts", code="invalid_request", param=param)
    types = body.embedding_types or (None if version == "1" else ["float"])
    quantized = [kind for kind in types or () if kind in QUANTIZED]
    if quantized:
        raise APIError(400, f"embedding_types {quantized[0]} is not served: Cohere quantizes "
                       "to it by ranges calibrated for its own models; send float, base64, "
                       "binary or ubinary", code="invalid_request", param="embedding_types")
    if body.truncate == "START":
        raise APIError(400, "truncate START (an input's last tokens kept) is not served: "
                       "send END (its first tokens kept) or NONE", code="invalid_request",
                       param="truncate")
    inputs = request_inputs(body.texts, "texts")
    cut = None if body.truncate == "NONE" else body.max_tokens or -1
    embedded = await embed_texts(request, body.model, inputs, body.output_dimension, cut,
                                 FIELDS)
    if embedded is None:
        return Response(status_code=CLIENT_CLOSED)
    _, vectors, prompt_tokens, _ = embedded
    answer = {"id": request.state.request_id, "texts": body.texts,
              "meta": Meta(api_version=ApiVersion(version=version),
                           billed_units=BilledUnits(input_tokens=prompt_tokens))}
    if types is None:
        return model_response(EmbedFloatsResponse(embeddings=vectors.tolist(), **answer))
    return model_response(EmbedByTypeResponse(
        embeddings=EmbeddingsByType(**{kind: _typed(vectors, kind) for kind in types}),
        **answer), exclude_none=True)


def _typed(vectors: np.ndarray, kind: str) -> list:
    if kind == "base64":
        return [encoded(vector, "base64") for vector in vectors]
    if kind == "float":
        return vectors.tolist()
    packed = np.packbits(vectors > 0, axis=1).astype(np.int16)
    return (packed - 128 if kind == "binary" else packed).tolist()
