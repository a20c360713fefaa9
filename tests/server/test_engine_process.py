"""The engine in its own process (engine/process.py): what a service needs of the pair.

It is off by default (server/config.py says why); every other server test runs the engine
in the server's process. The split passed the whole suite while it was the default.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from engine.api import EngineConfig, Lifecycle
from engine.process import EngineProcess, Facts, _report_lifecycle, server_tokenizer
from server.launch.replicas import free_port
from tests.server.support import REPO_ROOT, ServerProcess, server_env, start_server

LONG = {"max_tokens": 4000, "ignore_eos": True, "stream": True}


def engine_process(server: ServerProcess) -> psutil.Process:
    """The server's engine: its one spawned child (the other is multiprocessing's
    resource tracker)."""
    children = psutil.Process(server.process.pid).children()
    return next(child for child in children if "spawn_main" in " ".join(child.cmdline()))


@pytest.fixture
def own_server(demo_model_dir: Path, tmp_path: Path) -> ServerProcess:
    server = start_server(demo_model_dir, tmp_path / "server.log", "--engine-process", "true")
    yield server
    server.stop()


def test_the_engine_serves_from_a_child_process(own_server: ServerProcess) -> None:
    engine = engine_process(own_server)
    assert engine.pid != own_server.process.pid
    before = own_server.metrics()
    response = httpx.post(f"{own_server.url}/v1/completions", timeout=30,
                          json={"prompt": "One", "max_tokens": 4, "ignore_eos": True})
    assert response.status_code == 200, response.text
    after = own_server.metrics()
    # The engine's own counters, read from the child at scrape time.
    assert after["radix_mlx_generated_tokens_total"] >= before["radix_mlx_generated_tokens_total"] + 4
    assert after["radix_mlx_engine_step_cpu_seconds_total"] > 0


def test_embeddings_read_the_models_facts_from_the_child(own_server: ServerProcess) -> None:
    """What the embeddings route reads of the model's own files (its Matryoshka sizes, in
    config.json) it finds where the child loaded the model from."""
    response = httpx.post(f"{own_server.url}/v1/embeddings", timeout=30,
                          json={"input": ["One two", "three"]})
    assert response.status_code == 200, response.text
    vectors = [item["embedding"] for item in response.json()["data"]]
    assert [round(sum(v * v for v in vector), 4) for vector in vectors] == [1.0, 1.0]
    response = httpx.post(f"{own_server.url}/v1/embeddings", timeout=30,
                          json={"input": "One", "dimensions": 8})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "dimensions"


def test_a_killed_engine_fails_its_requests_and_stops_the_server(
    own_server: ServerProcess,
) -> None:
    """An engine that dies (SIGKILL here; an MLX abort alike) ends the open stream with an
    error event instead of leaving it hanging, and the server exits 1 with the reason, as
    for any failed engine, so that its service manager restarts it."""
    with httpx.stream("POST", f"{own_server.url}/v1/completions", timeout=30,
                      json={"prompt": "Go on.", **LONG}) as response:
        lines = (line for line in response.iter_lines() if line.startswith("data:"))
        next(lines)
        engine_process(own_server).kill()
        payloads = [line.removeprefix("data:").strip() for line in lines]
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2])["error"]["code"] == "engine_error"
    assert own_server.process.wait(timeout=60) == 1
    assert own_server.log().rstrip().splitlines()[-1] == (
        "radix-mlx serve: the engine process died (killed by SIGKILL)")


def test_a_hung_engine_stalls_neither_the_other_routes_nor_the_scrape(
    own_server: ServerProcess,
) -> None:
    """An engine process that stops answering (SIGSTOP here) makes its stats round trip
    wait out its timeout: /metrics waits off the event loop, so /health answers in the
    meantime, and the scrape still answers, without that model's engine series."""
    engine = engine_process(own_server)
    done: list[str] = []

    def get(path: str) -> httpx.Response:
        response = httpx.get(f"{own_server.url}{path}", timeout=60)
        done.append(path)
        return response

    engine.suspend()
    try:
        with ThreadPoolExecutor(1) as pool:
            scrape = pool.submit(get, "/metrics")
            time.sleep(1)  # the scrape now waits for the engine (5 s, CALL_SECONDS)
            assert get("/health").status_code == 200
            metrics = scrape.result()
    finally:
        engine.resume()
    assert done == ["/health", "/metrics"]
    assert metrics.status_code == 200
    assert "radix_mlx_model_state" in metrics.text
    assert "radix_mlx_generated_tokens_total" not in metrics.text


def test_only_the_server_drives_the_engines_stop(own_server: ServerProcess) -> None:
    """SIGTERM reaches a service's whole process group: the engine ignores its own, and
    stops when its server, having drained, tells it to."""
    engine = engine_process(own_server)
    engine.send_signal(signal.SIGTERM)
    engine.send_signal(signal.SIGINT)
    response = httpx.post(f"{own_server.url}/v1/completions", timeout=30,
                          json={"prompt": "Still here?", "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert own_server.stop() == 0
    _, alive = psutil.wait_procs([engine], timeout=30)
    assert not alive


def test_the_engine_exits_with_its_server(own_server: ServerProcess) -> None:
    """A server killed outright leaves no engine behind holding the device's memory."""
    engine = engine_process(own_server)
    os.kill(own_server.process.pid, signal.SIGKILL)
    own_server.process.wait(timeout=10)
    _, alive = psutil.wait_procs([engine], timeout=30)
    assert not alive


def test_a_server_that_fails_to_start_does_not_wait_for_its_engine(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """The engine has been started when the response store fails to open: the server
    exits with the error, its engine with it, instead of waiting for it forever."""
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    command = [sys.executable, "-m", "server", "--model", str(demo_model_dir),
               "--port", str(free_port()), "--config", "", "--disk-cache-bytes", "0", "--engine-process", "true",
               "--response-store-path", str(not_a_directory / "responses.db")]
    result = subprocess.run(command, check=False, cwd=REPO_ROOT, env=server_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert str(not_a_directory) in result.stderr


def test_a_models_tokenizer_outlives_its_engine_process(demo_model_dir: Path) -> None:
    """An idle unload ends the model's engine process, not the server's tokenizer of it:
    the prompt text it tokenized before (engine/token_cache.py) is still known to the
    reload's first request. Another chat template is another tokenizer."""
    first = server_tokenizer(str(demo_model_dir), None)
    assert server_tokenizer(str(demo_model_dir), None) is first
    assert server_tokenizer(str(demo_model_dir), "{{ messages[0].content }}") is not first


def test_a_model_folder_updated_in_place_is_read_again(demo_model_dir: Path,
                                                       tmp_path: Path) -> None:
    """A folder whose tokenizer or chat template changed in place (a new snapshot), then
    reloaded by an idle unload, eviction or crash, ran its new weights under the server's
    old tokenizer: the old template's prompts, or a vocabulary's old ids."""
    folder = tmp_path / "model"
    shutil.copytree(demo_model_dir, folder)
    first = server_tokenizer(str(folder), None)
    assert server_tokenizer(str(folder), None) is first
    config = folder / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    settings["chat_template"] = "{% for m in messages %}<{{ m.content }}>{% endfor %}"
    config.write_text(json.dumps(settings))
    updated = server_tokenizer(str(folder), None)
    assert updated is not first
    assert updated.decode(updated.chat_prompt([{"role": "user", "content": "Hi"}])) == "<Hi>"


class LoadingEngine:
    """What `_report_lifecycle` reads of an engine, moved by the test."""

    def __init__(self) -> None:
        self.state, self.model_path, self.error = Lifecycle.LOADING, None, None
        self.model_id, self.context_length, self.wants_message_ends = "", 0, False
        self.memory = self.disk = None

    def wait_ready(self, timeout: float) -> Lifecycle:
        time.sleep(timeout)
        return self.state


def test_a_converted_models_tokenizer_loads_beside_its_weights(demo_model_dir: Path,
                                                               tmp_path: Path) -> None:
    """A GGUF file's folder is known once it is converted, before its weights load: the
    engine names it then, and the server loads its own tokenizer from it meanwhile (~7 s
    for Gemma 3's) instead of after the engine is ready."""
    engine, told = LoadingEngine(), []
    outbox = type("Recorder", (), {"send": lambda self, batch: told.extend(batch)})()
    reporter = threading.Thread(target=_report_lifecycle, args=(engine, outbox))
    reporter.start()

    def wait_for_facts(count: int) -> None:
        deadline = time.monotonic() + 10
        while sum(isinstance(f, Facts) for f in told) < count:
            assert time.monotonic() < deadline, f"fewer than {count} facts told"
            time.sleep(0.05)

    wait_for_facts(1)
    engine.model_path = demo_model_dir
    wait_for_facts(2)
    engine.state = Lifecycle.READY
    reporter.join(10)
    facts = [(f.state, f.model_path) for f in told if isinstance(f, Facts)]
    assert facts == [(Lifecycle.LOADING, None), (Lifecycle.LOADING, str(demo_model_dir)),
                     (Lifecycle.READY, str(demo_model_dir))]
    server_side = EngineProcess(EngineConfig(model=str(tmp_path / "model.gguf")))
    server_side._learn(Facts(Lifecycle.LOADING, model_path=str(demo_model_dir)))
    assert server_side.state is Lifecycle.LOADING
    assert server_side.tokenizer is server_tokenizer(str(demo_model_dir), None)


def test_an_engine_process_that_ended_holds_no_descriptors(demo_model_dir: Path) -> None:
    """Models of several load and unload for as long as the server runs: an engine
    process that has ended leaves nothing open in the server's (its exit hook used to keep
    its pipe and process handles, three descriptors a load, until the server exited)."""
    def cycle() -> None:
        engine = EngineProcess(EngineConfig(model=str(demo_model_dir), disk_cache_bytes=0))
        engine.start()
        assert engine.wait_ready(120) is Lifecycle.READY
        engine.shutdown()

    cycle()  # what a first load opens for good (the tokenizer's files)
    gc.collect()
    before = psutil.Process().num_fds()
    for _ in range(2):
        cycle()
    gc.collect()
    assert psutil.Process().num_fds() == before


def test_a_load_that_hangs_is_killed_and_fails(demo_model_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A process stopped before it says a word (SIGSTOP here; a machine that froze it)
    is killed once its start has taken SPAWN_SECONDS (not step_timeout: importing MLX on
    busy cores takes seconds) and the load fails, where the model stayed `loading` for
    good, every request waiting out load_timeout for it."""
    monkeypatch.setattr("engine.process.SPAWN_SECONDS", 4.0)
    engine = EngineProcess(EngineConfig(model=str(demo_model_dir), step_timeout=1.0))
    engine.start()
    try:
        os.kill(engine.process.pid, signal.SIGSTOP)
        assert engine.wait_ready(60) is Lifecycle.FAILED
        assert engine.error == "the engine's process did not start in 4 s and was killed"
        engine.process.join(10)
        assert not engine.process.is_alive()
    finally:
        engine.shutdown()
