"""Hugging Face TEI's native /embed, in its own request and response shapes: for clients
written for text-embeddings-inference (LlamaIndex's and LangChain's TEI embedders) pointed
at this server.

`inputs` is what /v1/embeddings' `input` is (a text, texts, token ids or lists of them);
the answer is a bare list of vectors. `normalize` (TEI's default true) L2-normalises
them; false leaves them as the model's pipeline gives them (a sentence-transformers
folder with a Normalize module, and any causal model's last-token pooling, normalise
already). `truncate` true cuts an input over the context window to its first tokens
(TEI's truncation_direction right; left is a 400); false or unsaid, the server's
--truncate-embedding-inputs decides (TEI's --auto-truncate, its default for an unsaid
one), and a server that does not cut refuses it (a 400). `prompt_name`, a
sentence-transformers prompt prepended, is a 400: put the prompt in the inputs. Errors
are TEI's `{"error", "error_type"}` (server/http/errors.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field, TypeAdapter

from server.http.errors import APIError
from server.http.json_body import JSONRoute
from server.http.openapi import error_responses
from server.http.streaming import CLIENT_CLOSED
from server.prefill.protocol import EmbeddingInput, TeiErrorResponse
from server.prefill.routes import EmbedFields, embed_texts, normalised, request_inputs
from server.schema import RequestModel

router = APIRouter(responses=error_responses(TeiErrorResponse), route_class=JSONRoute)

# TEI's names, in its 400s; its truncate is a bool, with no value for a number of tokens.
FIELDS = EmbedFields(input="inputs", truncate="truncate", whole_window=None)
VECTORS = TypeAdapter(list[list[float]])


class TeiEmbedRequest(RequestModel):
    model: str | None = None
    inputs: EmbeddingInput
    normalize: bool = True
    truncate: bool | None = None
    truncation_direction: Literal["left", "Left", "right", "Right"] = "right"
    prompt_name: str | None = None
    dimensions: Annotated[int, Field(ge=1)] | None = None


# TEI also answers its base URL with its model's task: huggingface_hub's InferenceClient,
# given the server's URL as its model, posts feature_extraction there.
@router.post("/", response_model=list[list[float]])
@router.post("/embed", response_model=list[list[float]])
async def embed(body: TeiEmbedRequest, request: Request) -> Response:
    if body.prompt_name is not None:
        raise APIError(400, "prompt_name is not served: put the prompt at the start of "
                       "each of the inputs", code="invalid_request", param="prompt_name")
    if body.truncate and body.truncation_direction.lower() == "left":
        raise APIError(400, "truncation_direction left (an input's last tokens kept) is not "
                       "served: send right (its first tokens kept)", code="invalid_request",
                       param="truncation_direction")
    inputs = request_inputs(body.inputs, "inputs")
    embedded = await embed_texts(request, body.model, inputs, body.dimensions,
                                 -1 if body.truncate else None, FIELDS)
    if embedded is None:
        return Response(status_code=CLIENT_CLOSED)
    vectors = normalised(embedded[1]) if body.normalize else embedded[1]
    return Response(VECTORS.dump_json(vectors.tolist()), media_type="application/json")
