"""Schema fuzzing: schemathesis sends valid and invalid inputs to every operation of the
app's own OpenAPI schema, on a real server process: no 500s, every response matches its
declared schema, every error is OpenAI's error object."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from server.http.errors import COHERE_EMBED_PATHS, LMSTUDIO_PATHS
from tests.reliability.support import AUTH, app_schema, launch, stop
from tests.server.support import ServerProcess

# Per operation and generation mode. Fixed by `derandomize`, so failures reproduce.
MAX_EXAMPLES = 30
# Fuzzed bodies keep their shape but not their cost: a few tokens, a few choices.
CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 16, "n": 2}


schema = schemathesis.openapi.from_dict(app_schema())


@schema.hook
def map_body(context: schemathesis.HookContext, body: Any) -> Any:
    if isinstance(body, dict):
        for key, cap in CAPS.items():
            value = body.get(key)
            if type(value) is int and value > cap:
                body[key] = cap
    return body


@schemathesis.check
def api_error_object(ctx: schemathesis.CheckContext, response: schemathesis.Response,
                     case: schemathesis.Case) -> None:
    """Any /v1 status other than 200 carries OpenAI's {"error": {"message", "type", ...}},
    as LM Studio's /api/v0 does, any other /api one Ollama's {"error": "..."}, Cohere's
    embed its {"id", "message"}."""
    if response.status_code == 200:
        return
    if case.path.startswith("/api/") and not case.path.startswith(LMSTUDIO_PATHS):
        assert list(response.json()) == ["error"] and response.json()["error"]
    elif case.path in COHERE_EMBED_PATHS:
        error = response.json()
        assert set(error) == {"id", "message"} and error["message"]
    elif case.path.startswith(("/v1", *LMSTUDIO_PATHS)):
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str) and error["type"]


@pytest.fixture(scope="module")
def fuzzed(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    # A chat request that names no limit gets the server's default, here as small, and
    # one whose limit is a cap (Responses, Messages, Ollama's num_predict) the server's.
    server = launch(demo_model_dir, tmp_path_factory.mktemp("fuzzed") / "server.log",
                    "--default-max-tokens", str(CAPS["max_tokens"]),
                    "--max-output-tokens", str(CAPS["max_tokens"]))
    yield server
    stop(server)


def fuzzing_test() -> Callable[[schemathesis.Case, ServerProcess], None]:
    def test(case: schemathesis.Case, fuzzed: ServerProcess) -> None:
        # Schema-valid bodies may still be refused with a 400 (a chat template rejecting
        # the message order, prompt + max_tokens over the context): positive data need not
        # pass.
        case.call_and_validate(
            base_url=fuzzed.url, headers=AUTH, timeout=60,
            additional_checks=[api_error_object],
            excluded_checks=[positive_data_acceptance],
        )
    return settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=None,
                    database=None, suppress_health_check=list(HealthCheck))(test)


# Every operation survives fuzzing, each a test of its own name: schemathesis names an
# operation's test after its function, and pytest-xdist (make test) runs the tests of
# one name as one.
for result in schema.get_all_operations():
    operation = result.ok()
    name = "test_fuzzing_" + re.sub(r"\W+", "_", operation.label).strip("_").lower()
    globals()[name] = schema.include(method=operation.method.upper(),
                                     path=operation.path).parametrize()(fuzzing_test())


# Found by this fuzzing, kept as plain examples.
FOUND = {
    "repetition_penalty that is zero in float32, with logprobs": (
        {"prompt": "0", "logprobs": 0, "repetition_penalty": 5e-324}, 400),
    "max_tokens null on a legacy completion": ({"prompt": "0", "max_tokens": None}, 200),
}


@pytest.mark.parametrize(("body", "status"), FOUND.values(), ids=FOUND.keys())
def test_what_fuzzing_found(fuzzed: ServerProcess, body: dict[str, Any], status: int) -> None:
    response = httpx.post(f"{fuzzed.url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert response.status_code == status, response.text
