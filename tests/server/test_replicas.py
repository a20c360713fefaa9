"""`radix-mlx replicas`: two real workers behind the real sglang-router, and what the router
reads from a worker (/server_info, /model_info, /get_load).

One supervisor (module-scoped) serves every test here, in file order: the endpoints, the
router's view of its workers, a multi-turn workload routed cache-aware and round-robin,
a worker killed, and last the SIGTERM that drains and stops everything.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from engine.engine import device_memory_bytes
from server.config import Settings
from server.launch.cli import build_parser
from server.launch.replicas import (
    add_replicas_arguments,
    free_port,
    router_command,
    router_ready,
    worker_command,
    worker_memory_share,
)
from tests.server.support import (
    API_KEY,
    REPO_ROOT,
    START_TIMEOUT,
    ServerProcess,
    read_metrics,
    server_env,
)

pytest.importorskip("sglang_router")

CHATS, TURNS = 3, 4
AUTH = {"Authorization": f"Bearer {API_KEY}"}
WAIT_SECONDS = 30.0
# Long enough that the killed worker stays out while the next conversation runs.
RESTART_DELAY = 10


@dataclass
class Replicas:
    url: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def workers(self) -> dict[str, int]:
        """Worker URL -> pid, from the supervisor's log."""
        return {url: int(pid) for pid, url in
                re.findall(r"worker \d+: pid (\d+), (http://\S+)", self.log())}

    def router_view(self) -> dict[str, dict]:
        listed = httpx.get(f"{self.url}/workers", headers=AUTH, timeout=10).json()["workers"]
        return {worker["url"]: worker for worker in listed}


def _wait_for(condition, what: str, replicas: Replicas, seconds: float = WAIT_SECONDS) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}; log:\n{replicas.log()[-3000:]}"
        time.sleep(0.25)


# The supervisor and its workers run as from a checkout that is not pip-installed.
UNINSTALLED = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent / "uninstalled"),
                                              str(REPO_ROOT)])}


@pytest.fixture(scope="module")
def replicas(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    """Run as the GPU machines run it, from a source checkout with no installed
    distribution (tests/server/uninstalled): the router must still see its workers."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("replicas") / "replicas.log"
    command = [sys.executable, "-m", "server.launch.cli", "replicas", "--workers", "2",
               "--model", str(demo_model_dir), "--port", str(port), "--health-check-interval",
               "1", "--restart-delay", str(RESTART_DELAY), "--", "--config", "",
               "--disk-cache-bytes", "0", "--api-key", API_KEY]
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=server_env(UNINSTALLED),
                                   stdout=log, stderr=subprocess.STDOUT)
    running = Replicas(f"http://127.0.0.1:{port}", process, log_path)
    deadline = time.monotonic() + 2 * START_TIMEOUT
    while "routes to 2 workers" not in running.log():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"replicas did not start:\n{running.log()}")
        time.sleep(0.5)
    yield running
    if process.poll() is None:  # a test failed before the last one stopped it
        process.terminate()
        process.wait(timeout=60)


def converse(base_url: str, tag: str) -> tuple[int, int]:
    """CHATS conversations of TURNS turns, one after another, each reply fed back: the
    (prompt tokens, cached prompt tokens) over all of them. Every answer must succeed."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)
    prompt = cached = 0
    for chat in range(CHATS):
        messages = [{"role": "system",
                     "content": f"You are assistant {chat} of the {tag} run. " * 6}]
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"Turn {turn}: what about {tag}?"})
            reply = client.chat.completions.create(
                model="tiny-seed0", messages=messages, max_tokens=4, temperature=0)
            prompt += reply.usage.prompt_tokens
            cached += reply.usage.prompt_tokens_details.cached_tokens
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    return prompt, cached


# -- what a worker tells the router ---------------------------------------------------------


def test_worker_reports_model_limits_and_load(
    server: ServerProcess, headers: dict[str, str], model_id: str
) -> None:
    assert httpx.get(f"{server.url}/server_info").status_code == 401  # the key is needed
    info = httpx.get(f"{server.url}/server_info", headers=headers).json()
    assert info["served_model_name"] == model_id
    assert info["served_model_names"][0] == model_id
    assert info["dp_size"] == 1 and info["context_length"] > 0
    assert info["max_req_input_len"] == info["context_length"] - 1
    assert info["max_total_tokens"] > 0 and info["max_running_requests"] > 0
    assert httpx.get(f"{server.url}/get_server_info", headers=headers).json() == info
    model = httpx.get(f"{server.url}/model_info", headers=headers).json()
    assert model["is_generation"] and model["model_path"] == info["model_path"]
    assert model["context_length"] == info["context_length"] and model["vocab_size"] > 0

    # A stream in flight is one running request holding its prompt + max_tokens (more
    # tokens than it can decode before we look; closing the stream cancels it).
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    stream = client.completions.create(model=model_id, prompt="count with me:", max_tokens=4000,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    [load] = httpx.get(f"{server.url}/get_load", headers=headers).json()
    stream.close()
    assert load["dp_rank"] == 0 and load["num_reqs"] >= 1 and load["num_running_reqs"] >= 1
    assert load["num_reqs"] == load["num_running_reqs"] + load["num_waiting_reqs"]
    assert load["num_tokens"] >= 4000


def test_worker_flushes_its_cache_and_answers_a_generating_health_check(
    server: ServerProcess, headers: dict[str, str], model_id: str
) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    client.completions.create(model=model_id, prompt="keep this prefix " * 8, max_tokens=2)
    assert httpx.post(f"{server.url}/flush_cache").status_code == 401  # the key is needed
    flushed = httpx.post(f"{server.url}/flush_cache", headers=headers, timeout=30).json()
    assert flushed["cleared"] and flushed["memory_bytes_freed"] > 0
    [model] = flushed["models"]
    assert model["id"] == model_id and model["memory_bytes_freed"] == flushed["memory_bytes_freed"]
    assert model["memory"]["bytes"] == model["memory"]["pinned_bytes"] == 0
    steps = server.metrics()["radix_mlx_engine_steps_total"]
    health = httpx.get(f"{server.url}/health_generate", headers=headers, timeout=30)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert server.metrics()["radix_mlx_engine_steps_total"] > steps  # it ran the model


@pytest.mark.parametrize("labelled", [{"Content-Type": "text/plain"}, {}],
                         ids=["a form's post", "a no-cors fetch"])
def test_a_web_page_on_another_origin_cannot_flush_the_cache(
        server: ServerProcess, headers: dict[str, str], labelled: dict[str, str]) -> None:
    """Routers POST /flush_cache. A GET, which any page makes a browser send (an image's
    URL, with no Origin), is not served; a POST that a page sends without asking CORS
    first is refused, as Ollama's routes refuse it (server/http/json_body.py)."""
    assert httpx.get(f"{server.url}/flush_cache", headers=headers).status_code == 405
    sent = httpx.post(f"{server.url}/flush_cache", headers={
        **headers, **labelled, "Origin": "https://evil.example"}, content=b"x" if labelled else b"")
    assert sent.status_code == 403 and "evil.example" in sent.json()["error"]["message"]


# -- two replicas behind the router ---------------------------------------------------------


def test_router_sees_both_workers_healthy_under_the_model_name(replicas: Replicas) -> None:
    view = replicas.router_view()
    assert set(view) == set(replicas.workers()) and len(view) == 2
    assert all(w["is_healthy"] and w["model_id"] == "tiny-seed0" for w in view.values())
    models = httpx.get(f"{replicas.url}/v1/models", headers=AUTH, timeout=10).json()["data"]
    assert [m["id"] for m in models] == ["tiny-seed0"]
    # The workers' API key guards the router too, which passes it on to them.
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    url = f"{replicas.url}/v1/chat/completions"
    assert httpx.post(url, json=chat, timeout=60).status_code == 401
    # A request naming no model is served and answered as by one server (the router
    # names it "unknown" on the way).
    reply = httpx.post(url, json=chat, headers=AUTH, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "tiny-seed0"
    # The router's cache flush reaches every worker.
    flushed = httpx.post(f"{replicas.url}/flush_cache", headers=AUTH, timeout=60).json()
    assert flushed["workers_flushed"] == 2 and not flushed.get("failed"), flushed


def test_workers_run_from_an_uninstalled_checkout_report_the_checkouts_version(
        replicas: Replicas) -> None:
    """What the router reads first: a worker with no installed distribution answers
    /server_info with the version in pyproject.toml, never a 500."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    for url in replicas.workers():
        info = httpx.get(f"{url}/server_info", headers=AUTH, timeout=10)
        assert info.status_code == 200, info.text
        assert info.json()["version"] == project["version"]


def test_workers_on_one_machine_each_plan_for_half_its_memory(replicas: Replicas) -> None:
    """Neither worker was given a memory limit: each plans for half of what one server
    would, its prefix cache included (half its limit, less the weights)."""
    for url in replicas.workers():
        metrics = read_metrics(url, API_KEY)
        limit = metrics["radix_mlx_memory_limit_bytes"]
        assert limit == device_memory_bytes() // 2
        info = httpx.get(f"{url}/server_info", headers=AUTH, timeout=10).json()
        assert info["cache_bytes"] == int(limit * 0.5) - metrics["radix_mlx_weight_bytes"]


def test_cache_aware_routing_reuses_more_prefix_than_round_robin(replicas: Replicas) -> None:
    """The same kind of conversations, each run with its own text so neither run finds the
    other's turns cached: cache-aware keeps a conversation on the worker that has it."""
    port = free_port()
    parser = argparse.ArgumentParser()
    add_replicas_arguments(parser)
    args = parser.parse_args(["--port", str(port), "--policy", "round_robin",
                              "--metrics-port", str(free_port())])
    round_robin = subprocess.Popen(router_command(args, list(replicas.workers()), API_KEY),
                                   env=server_env(), stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
    try:
        rr_url = f"http://127.0.0.1:{port}"
        _wait_for(lambda: router_ready(rr_url, 2, API_KEY), "round-robin router not ready",
                  replicas)
        rr_prompt, rr_cached = converse(rr_url, "round-robin")
    finally:
        round_robin.terminate()
        round_robin.wait(timeout=30)
    ca_prompt, ca_cached = converse(replicas.url, "cache-aware")
    cache_aware, alternating = ca_cached / ca_prompt, rr_cached / rr_prompt
    print(f"cached share of prompt tokens: cache_aware {cache_aware:.0%}, "
          f"round_robin {alternating:.0%}")
    assert cache_aware > alternating + 0.15


def test_a_killed_worker_is_routed_around_then_restarted(replicas: Replicas) -> None:
    (dead, dead_pid), (alive, _) = replicas.workers().items()
    os.kill(dead_pid, signal.SIGKILL)
    _wait_for(lambda: not replicas.router_view()[dead]["is_healthy"],
              "the router still thinks the killed worker is healthy", replicas)
    assert replicas.router_view()[alive]["is_healthy"]
    assert f"({dead}) exited with status -9" in replicas.log()

    def chats_answered() -> float:
        text = httpx.get(f"{alive}/metrics", headers=AUTH, timeout=10).text
        found = re.search(r'^radix_mlx_http_requests_total\{endpoint="/v1/chat/completions",'
                          r'status="200"\} (\S+)', text, re.MULTILINE)
        return float(found[1]) if found else 0.0

    before = chats_answered()
    converse(replicas.url, "after-the-kill")
    assert chats_answered() - before == CHATS * TURNS  # every turn went to the survivor

    # Restarted on its port after the delay, it is back in the router's rotation.
    _wait_for(lambda: replicas.router_view()[dead]["is_healthy"],
              "the killed worker did not come back", replicas, seconds=RESTART_DELAY + 90)
    assert replicas.workers()[dead] != dead_pid
    assert httpx.get(f"{dead}/health", timeout=10).status_code == 200


def test_sigterm_drains_then_stops_router_and_workers(replicas: Replicas) -> None:
    client = openai.OpenAI(base_url=f"{replicas.url}/v1", api_key=API_KEY, max_retries=0)
    stream = client.chat.completions.create(
        model="tiny-seed0", messages=[{"role": "user", "content": "a long answer, please"}],
        max_tokens=48, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    replicas.process.send_signal(signal.SIGTERM)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text  # the stream in flight ran to its end
    assert replicas.process.wait(timeout=60) == 0
    for pid in replicas.workers().values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{replicas.url}/workers", headers=AUTH, timeout=5)


def test_a_bad_worker_flag_fails_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = build_parser().parse_args(["replicas", "--workers", "2", "--", "--max-queue", "0"])
    assert args.handler(args) == 2
    assert "max_queue" in capsys.readouterr().err


def test_each_worker_keeps_its_disk_tier_in_a_directory_of_its_own(tmp_path: Path) -> None:
    """Workers sharing one directory would evict each other's files; by index (not port),
    a restarted set finds its own again."""
    parser = argparse.ArgumentParser()
    add_replicas_arguments(parser)
    args = parser.parse_args(["--workers", "2"])
    settings = Settings(disk_cache_dir=tmp_path)
    dirs = []
    for index in range(2):
        command = worker_command(args, settings, index, free_port())
        dirs.append(command[command.index("--disk-cache-dir") + 1])
    assert dirs == [str(tmp_path / "worker-0"), str(tmp_path / "worker-1")]


def test_workers_split_the_memory_of_the_device_they_share() -> None:
    """Three workers on two GPUs: the two on GPU 0 get half of it each, the one on GPU 1
    all of it; without GPUs of their own all three share the machine; a limit or share
    the settings give is every worker's own."""
    parser = argparse.ArgumentParser()
    add_replicas_arguments(parser)
    on_gpus = parser.parse_args(["--workers", "3", "--cuda-devices", "0,1"])
    assert [worker_memory_share(on_gpus, Settings(), i) for i in range(3)] == [0.5, None, 0.5]
    shared = parser.parse_args(["--workers", "3"])
    assert [worker_memory_share(shared, Settings(), i) for i in range(3)] == [1 / 3] * 3
    command = worker_command(shared, Settings(), 0, free_port())
    assert command[command.index("--memory-share") + 1] == repr(1 / 3)
    for fixed in (Settings(memory_limit_bytes=2**30), Settings(memory_share=0.2)):
        assert "--memory-share" not in worker_command(shared, fixed, 0, free_port())
