"""The server's own failures: a forward pass that raises fails only the request that
caused it (also while the engine is still finding out which one did), one that never ends
fails the engine after `step_timeout`, a model that cannot load ends the process with the
reason, and a full queue answers 429 instead of dropping anyone."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from engine.api import EngineConfig, Finish, Lifecycle, RequestFailed, SamplingParams, TokenEvent
from engine.engine import Engine
from server.launch.replicas import free_port
from tests.engine.gguf_files import UNSERVABLE, unservable_gguf
from tests.faults import faulty_loader
from tests.reliability.support import (
    AUTH,
    Outcome,
    call,
    fault_token,
    launch,
    read_event,
    server_command,
    stop,
)
from tests.server.support import (
    REPO_ROOT,
    START_TIMEOUT,
    ServerProcess,
    server_env,
    start_server,
    wait_idle,
)

FAILED_LOAD = "radix-mlx serve: the model failed to load: "


def _no_fault(model_dir: Path) -> dict[str, dict[str, int]]:
    return {"logit_bias": {str(fault_token(model_dir)): -100}}


@pytest.mark.parametrize("case", ["missing directory", "corrupt weights"])
def test_a_model_that_cannot_load_exits_non_zero_with_the_reason(
    case: str, demo_model_dir: Path, tmp_path: Path
) -> None:
    """A service manager must see the failure (and restart or report it), not a process
    that answers 503 forever; the reason is stderr's last line."""
    model = tmp_path / "broken-model"
    if case == "corrupt weights":
        shutil.copytree(demo_model_dir, model)
        (model / "model.safetensors").write_bytes(b"\0not safetensors")
    result = subprocess.run(
        server_command(model, free_port()), cwd=REPO_ROOT, env=server_env(),
        capture_output=True, text=True, timeout=START_TIMEOUT, check=False,
    )
    assert result.returncode == 1
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith(FAILED_LOAD), result.stderr
    if case == "missing directory":
        assert last_line == f"{FAILED_LOAD}FileNotFoundError: no model directory at {model}"


@pytest.mark.parametrize("case", UNSERVABLE)
def test_a_gguf_that_cannot_be_served_stops_the_start_before_any_port_opens(
    case: str, demo_model_dir: Path, tmp_path: Path
) -> None:
    """Checked (and converted) before uvicorn starts: one line naming the cause, exit 1."""
    path, cause = unservable_gguf(case, demo_model_dir, tmp_path)
    result = subprocess.run(
        server_command(path, free_port()), cwd=REPO_ROOT,
        env=server_env({"XDG_CACHE_HOME": str(tmp_path / "cache")}),
        capture_output=True, text=True, timeout=START_TIMEOUT, check=False,
    )
    assert result.returncode == 1
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"radix-mlx serve: {path}") and cause in last_line
    assert "Uvicorn running" not in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "cache").exists()


def test_convert_refuses_a_truncated_gguf_with_one_line(demo_model_dir: Path, tmp_path: Path):
    path, cause = unservable_gguf("truncated", demo_model_dir, tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "server.launch.cli", "convert", str(path), str(tmp_path / "out")],
        cwd=REPO_ROOT, env=server_env(), capture_output=True, text=True,
        timeout=START_TIMEOUT, check=False,
    )
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line.startswith(f"radix-mlx convert: {path} {cause}")
    assert not (tmp_path / "out").exists()


def test_a_step_that_never_ends_fails_the_engine_and_stops_the_server(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """A forward pass that never returns (a device that hangs) would hold every request
    and answer /health ready forever: after `step_timeout` the engine fails, its request
    gets a 500, and the server exits 1 with the reason, for its service manager to start
    it again."""
    hang = fault_token(demo_model_dir)
    server = start_server(demo_model_dir, tmp_path / "server.log", "--step-timeout", "2",
                          hang_token=hang)
    try:
        stuck = httpx.post(f"{server.url}/v1/completions", timeout=60,
                           json={"prompt": [5, 6, hang, 7], "max_tokens": 4})
        returncode = server.process.wait(timeout=60)
    finally:
        server.stop()
    assert stuck.status_code == 500, stuck.text
    assert stuck.json()["error"]["code"] == "engine_error"
    assert returncode == 1
    assert server.log().rstrip().splitlines()[-1] == (
        "radix-mlx serve: the engine is stuck: no scheduler step finished in 2 s "
        "(step_timeout)")


def test_a_drain_ends_a_stream_whose_engine_is_stuck_with_its_error_event(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """At the drain's deadline a stream's engine work is cancelled, and the stream ends
    when the engine says so; an engine whose step does not end (a hung device, or steps
    of seconds on an overloaded machine) said nothing, and the service manager's stop
    cut the stream off without its error event. It now ends with it regardless, and the
    server exits before the manager's kill (drain timeout + 5 s)."""
    hang = fault_token(demo_model_dir)
    server = start_server(demo_model_dir, tmp_path / "server.log", "--drain-timeout", "0.5",
                          hang_token=hang)
    events: list[str] = []
    try:
        # The first token is the hang token (the prompt's forward ends); the step that
        # feeds it never does.
        body = {"prompt": [5, 6, 7], "max_tokens": 8, "stream": True, "temperature": 0,
                "logit_bias": {str(hang): 100}}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                          timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    events.append(line.removeprefix("data:").strip())
                    if len(events) == 1:
                        signalled = time.monotonic()
                        server.process.send_signal(signal.SIGTERM)
        cut_after = time.monotonic() - signalled
    finally:
        server.stop()
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "shutting_down"
    assert cut_after < 0.5 + 5


async def test_a_failing_forward_fails_only_its_own_request(
    hardened: ServerProcess, demo_model_dir: Path
) -> None:
    """Requests decoding beside the faulty one restart from their tokens and end with
    exactly the text they get alone; the faulty one gets a 500 naming its request id."""
    normal = [
        {"prompt": f"Request {i} shares the batch.", "max_tokens": 48, "temperature": 0,
         "ignore_eos": True, "stream": True, **_no_fault(demo_model_dir)}
        for i in range(4)
    ]
    faulty = {"prompt": [5, 6, fault_token(demo_model_dir), 7], "max_tokens": 4}
    async with httpx.AsyncClient(base_url=hardened.url, timeout=60) as client:
        alone = [await call(client, "/v1/completions", body) for body in normal]
        failed_before = hardened.metrics()["radix_mlx_engine_requests_failed_total"]

        async def normal_request(body: dict, started: asyncio.Event) -> Outcome:
            async with client.stream("POST", "/v1/completions", json=body,
                                     headers=AUTH) as response:
                outcome = Outcome(response.status_code)
                lines = response.aiter_lines()
                read_event(outcome, await anext(lines))
                started.set()
                async for line in lines:
                    read_event(outcome, line)
            return outcome

        events = [asyncio.Event() for _ in normal]
        running = [asyncio.create_task(normal_request(body, event))
                   for body, event in zip(normal, events)]
        await asyncio.gather(*(event.wait() for event in events))
        # Every normal request is decoding now: the fault hits their batch.
        fault = await client.post("/v1/completions", json=faulty, headers=AUTH)
        together = await asyncio.gather(*running)
        stream_fault = await call(client, "/v1/completions", {**faulty, "stream": True})

    assert fault.status_code == 500
    error = fault.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "engine_error"
    assert fault.headers["x-request-id"] in error["message"]
    assert stream_fault.status == 200 and stream_fault.error["code"] == "engine_error"
    assert [(o.status, o.text) for o in together] == [(o.status, o.text) for o in alone]
    metrics = wait_idle(hardened)
    assert metrics["radix_mlx_engine_requests_failed_total"] == failed_before + 2
    assert metrics["radix_mlx_running_requests"] == metrics["radix_mlx_tree_pinned_bytes"] == 0


async def _tokens(engine: Engine, prompt: list[int], params: SamplingParams,
                  then: Callable[[int], None] = lambda count: None) -> list[int]:
    """The generated tokens, calling `then` with the count after each; raises
    RequestFailed if the engine fails the request."""
    tokens = []
    async for event in engine.submit(prompt, params):
        if isinstance(event, TokenEvent):
            tokens.append(event.token)
            then(len(tokens))
        assert not isinstance(event, Finish) or event.reason != "cancelled"
    return tokens


async def test_a_request_in_quarantine_runs_alone_until_it_passes_a_step(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a failed step each of its requests reruns alone, to find the culprit. The
    last one to rerun must stay alone until it has passed a step too: a faulty newcomer
    admitted beside it would fail the step again and get the innocent one failed."""
    fault = fault_token(demo_model_dir)
    monkeypatch.setattr("engine.engine.load_model", faulty_loader(fault))
    # Tiny prefill chunks: rerunning the innocent request's 400 generated tokens (only its
    # prompt is in the tree) takes 200 steps, a wide window for the newcomer.
    engine = Engine(EngineConfig(model=str(demo_model_dir), prefill_chunk_tokens=2))
    engine.start()
    try:
        assert engine.wait_ready(120) is Lifecycle.READY, engine.error
        innocent = [50 + i * 7 % 1900 for i in range(32)]
        long = SamplingParams(max_tokens=450, temperature=0.0, ignore_eos=True,
                              logit_bias={fault: -100})
        faulty, short = [51, fault, 52], SamplingParams(max_tokens=2, temperature=0.0)
        decoding = asyncio.Event()
        running = asyncio.create_task(_tokens(
            engine, innocent, long, lambda count: count == 400 and decoding.set()))
        await decoding.wait()
        # Joins the innocent one's batch: the step fails, both rerun alone, this first.
        with pytest.raises(RequestFailed):
            await _tokens(engine, faulty, short)
        # Arrives while the innocent one reruns alone.
        with pytest.raises(RequestFailed):
            await _tokens(engine, faulty, short)
        assert await running == await _tokens(engine, innocent, long)
        assert engine.stats().counters.requests_failed == 2
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def one_slot(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """One running request at a time and two waiting: easy to fill."""
    server = launch(
        demo_model_dir, tmp_path_factory.mktemp("one-slot") / "server.log",
        "--max-batch-size", "1", "--max-queue", "2",
    )
    yield server
    stop(server)


async def test_a_full_queue_answers_429_and_drops_nothing(one_slot: ServerProcess) -> None:
    """While one long request holds the only slot, a burst finds the queue full: each
    request gets either its whole answer or a 429 with Retry-After."""
    hog = {"prompt": "Hold the slot.", "max_tokens": 300, "ignore_eos": True, "stream": True}
    burst = {"prompt": "Wait in line.", "max_tokens": 8, "ignore_eos": True}
    async with (
        httpx.AsyncClient(base_url=one_slot.url, timeout=120) as client,
        client.stream("POST", "/v1/completions", json=hog, headers=AUTH) as holding,
    ):
        hog_outcome = Outcome(holding.status_code)
        lines = holding.aiter_lines()
        read_event(hog_outcome, await anext(lines))  # the hog decodes: the slot is taken

        async def read_hog() -> None:
            async for line in lines:
                read_event(hog_outcome, line)

        _, *answers = await asyncio.gather(read_hog(), *(
            client.post("/v1/completions", json=burst, headers=AUTH) for _ in range(12)))
    statuses = sorted(response.status_code for response in answers)
    assert set(statuses) == {200, 429}, statuses
    for response in answers:
        if response.status_code == 429:
            assert int(response.headers["retry-after"]) >= 1
            assert response.json()["error"]["code"] == "rate_limit_exceeded"
        else:
            assert response.json()["usage"]["completion_tokens"] == burst["max_tokens"]
    assert hog_outcome.finish_reason == "length"
    assert wait_idle(one_slot)["radix_mlx_running_requests"] == 0
