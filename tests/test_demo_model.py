"""The demo model is what every other test and a first `radix-mlx serve` run on."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx_lm
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache
from mlx_lm.utils import load_tokenizer

from engine import demo_model
from engine.demo_model import IM_END, IM_START, SLIDING_WINDOW, build_demo_model
from engine.platform_info import (
    CUDA_GRAPHS_ENV,
    CUDNN_ATTENTION_ENV,
    OPENBLAS_CORE_ENV,
    OPT_OUT_ENV,
    TF32_ENV,
    apply_mlx_env_defaults,
    openblas_core_type,
    openblas_library,
)
from server.launch.replicas import free_port

ROUND_TRIP_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "café naïve Straße — 你好，世界 🙂🚀 مرحبا",
    'def f(x):\n\treturn {"a": [1, 2.5e-3]}  # comment\n',
    "   leading and trailing spaces   ",
    "\n\n\t \r\n  \t",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path):
    return load_tokenizer(demo_model_dir)


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids(tokenizer) -> None:
    for token in demo_model.SPECIAL_TOKENS:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1


def test_vocabulary_is_learned_not_just_bytes(tokenizer) -> None:
    text = "The lighthouse keeper kept a notebook on the windowsill."
    assert len(tokenizer.encode(text, add_special_tokens=False)) < len(text) / 2


def test_chat_template_chatml(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "Bye"}]},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == rendered + "<|im_start|>assistant\n"


def test_chat_template_lists_tools_in_system_part(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "content": '{"celsius": 3}'},
    ]
    rendered = tokenizer.apply_chat_template(
        messages, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True
    )
    system, rest = rendered.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER_TOOL) in system
    assert rest == (
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>tool\n{"celsius": 3}<|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    without_system = tokenizer.apply_chat_template(
        messages[1:2], tools=[WEATHER_TOOL], tokenize=False
    )
    assert without_system.startswith("<|im_start|>system\n# Tools")


def test_chat_prompt_tokenizes_special_tokens(tokenizer) -> None:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert ids[0] == tokenizer.convert_tokens_to_ids(IM_START)
    assert tokenizer.convert_tokens_to_ids(IM_END) in ids


def test_same_seed_gives_identical_bytes(demo_model_dir: Path, tmp_path: Path) -> None:
    again = build_demo_model(tmp_path / "again", seed=0)
    assert _file_bytes(again) == _file_bytes(demo_model_dir)


def test_different_seed_gives_different_weights(demo_model_dir: Path, tmp_path: Path) -> None:
    other = _file_bytes(build_demo_model(tmp_path / "other", seed=1))
    same = _file_bytes(demo_model_dir)
    assert other.keys() == same.keys()
    assert other["model.safetensors"] != same["model.safetensors"]
    assert other["tokenizer.json"] == same["tokenizer.json"]


def test_cli_build_in_a_fresh_process_is_identical(demo_model_dir: Path, tmp_path: Path) -> None:
    # A new process gets new hash seeds (Python's and the Rust tokenizer trainer's).
    target = tmp_path / "cli-model"
    _cli("make-demo-model", str(target), "--size", "tiny", "--seed", "0")
    assert _file_bytes(target) == _file_bytes(demo_model_dir)


@pytest.mark.skipif(
    sys.platform != "linux" or openblas_library() is None, reason="needs Debian's OpenBLAS"
)
def test_cli_preloads_openblas_on_linux_cpu() -> None:
    env = {
        key: value for key, value in os.environ.items() if key not in ("LD_PRELOAD", OPT_OUT_ENV)
    }
    assert "BLAS: OpenBLAS" in _cli("info", env=env)
    assert "reference BLAS" in _cli("info", env={**env, OPT_OUT_ENV: "1"})


@pytest.mark.skipif(
    sys.platform != "linux" or openblas_library() is None or openblas_core_type() is None,
    reason="needs Debian's OpenBLAS on an x86-64 CPU with AVX2",
)
def test_cli_runs_openblas_at_the_kernels_the_cpu_flags_allow() -> None:
    env = {key: value for key, value in os.environ.items()
           if key not in ("LD_PRELOAD", OPENBLAS_CORE_ENV, OPT_OUT_ENV)}
    assert f"{openblas_core_type()} kernels" in _cli("info", env=env)
    # The operator's choice stands.
    assert "Haswell kernels" in _cli("info", env={**env, OPENBLAS_CORE_ENV: "Haswell"})


@pytest.mark.parametrize(("flags", "core"), [
    ("fpu sse2 avx2 fma avx512f avx512cd avx512bw avx512dq avx512vl", "SkylakeX"),
    ("fpu sse2 avx2 fma avx512f", "Haswell"),  # AVX-512 without the subsets SkylakeX needs
    ("fpu sse2 avx2 fma", "Haswell"),
    ("fpu sse2 sse4_2", None),
])
def test_openblas_core_type_is_the_best_the_flags_allow(flags: str, core: str | None) -> None:
    cpuinfo = f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {flags}\n"
    assert openblas_core_type(cpuinfo) == core
    assert openblas_core_type("Features\t: fp asimd sve\n") is None  # aarch64 reports these


@pytest.mark.skipif(
    sys.platform != "linux" or openblas_library() is None, reason="needs Debian's OpenBLAS"
)
def test_python_m_server_preloads_openblas_like_radix_mlx_serve(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """`python -m server` starts through the same code path as `radix-mlx serve`."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("LD_PRELOAD", OPT_OUT_ENV) and not key.startswith("RADIX_MLX_")}
    log_path = tmp_path / "server.log"
    command = [sys.executable, "-m", "server", "--model", str(demo_model_dir), "--port",
               str(free_port()), "--config", "", "--disk-cache-bytes", "0"]
    with log_path.open("w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "BLAS:" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        process.terminate()
        process.wait(timeout=60)
    assert "BLAS: OpenBLAS" in log_path.read_text()


@pytest.mark.parametrize("name", [CUDNN_ATTENTION_ENV, CUDA_GRAPHS_ENV, TF32_ENV])
def test_mlx_env_defaults_keep_what_the_operator_set(monkeypatch, name: str) -> None:
    monkeypatch.delenv(name, raising=False)
    apply_mlx_env_defaults()
    assert os.environ[name] == "0"
    monkeypatch.setenv(name, "1")
    apply_mlx_env_defaults()
    assert os.environ[name] == "1"


def test_rebuild_replaces_existing_directory(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    build_demo_model(target, seed=3)
    assert not (target / "stale.txt").exists()
    assert (target / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_demo_model_path_builds_once_into_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, demo_model_dir: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    results: list[Path] = []
    builders = [
        threading.Thread(target=lambda: results.append(demo_model.demo_model_path()))
        for _ in range(2)
    ]
    for builder in builders:
        builder.start()
    for builder in builders:
        builder.join()
    path = tmp_path / "radix-mlx" / "demo-models" / "tiny-seed0"
    assert results == [path, path]
    assert _file_bytes(path) == _file_bytes(demo_model_dir)
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny-seed0"]
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert demo_model.demo_model_path() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_tiny_llama_generates_varied_text(demo_model_dir: Path) -> None:
    model, tokenizer = mlx_lm.load(str(demo_model_dir))
    # Raw completions end at end-of-text, chat turns at im_end.
    assert tokenizer.eos_token_ids == {
        tokenizer.convert_tokens_to_ids(demo_model.EOS),
        tokenizer.convert_tokens_to_ids(IM_END),
    }
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about the lighthouse."}], add_generation_prompt=True
    )
    tokens = [
        response.token
        for response in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=32)
    ]
    assert len(tokens) >= 8
    # Random weights must not collapse onto one token, or tests of sampling,
    # stop strings and cache reuse would be checking nothing.
    assert len(set(tokens)) >= len(tokens) // 3
    assert mlx_lm.generate(model, tokenizer, "The sea", max_tokens=8)


@pytest.mark.parametrize(
    ("family", "cache_types"),
    [
        ("llama", {KVCache}),
        ("gemma3_text", {RotatingKVCache, KVCache}),
        ("qwen3_next", {ArraysCache, KVCache}),
    ],
)
def test_family_loads_and_generates(demo_model_family, family: str, cache_types: set) -> None:
    model, tokenizer = mlx_lm.load(str(demo_model_family(family)))
    assert {type(cache) for cache in model.make_cache()} == cache_types
    # Longer than the sliding window, so gemma3_text's rotating cache wraps.
    prompt = tokenizer.encode(" ".join(["tide"] * (2 * SLIDING_WINDOW)), add_special_tokens=False)
    assert len(prompt) > SLIDING_WINDOW
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=12)
    assert text


def _file_bytes(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def _cli(*args: str, env: dict[str, str] | None = None) -> str:
    command = [sys.executable, "-m", "server.launch.cli", *args]
    return subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
