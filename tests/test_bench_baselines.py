"""The benchmark's tools beside its workloads, on the tiny demo model: the bare mlx-lm
baselines, the decode and batch parity runs, and the GGUF files it benches and exports.
Checks the shape of the results, never a timing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("psutil")

from bench.__main__ import describe_model, model_dirs
from bench.workloads import QUICK
from tests.engine.gguf_files import write_demo_gguf


@pytest.mark.usefixtures("children_without_torch")
def test_a_gguf_model_is_benched_as_serve_converts_it(demo_model_dir: Path, tmp_path: Path):
    write_demo_gguf(demo_model_dir, tmp_path / "tiny.gguf")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    [model] = model_dirs([str(tmp_path / "tiny.gguf")], env)
    assert model.directory.name == "tiny" and model.directory.is_relative_to(tmp_path / "cache")
    assert model.gguf == tmp_path / "tiny.gguf"  # what llama.cpp's server loads
    description = describe_model(model.directory)["description"]
    assert "float32" in description and description.endswith("the weights of tiny.gguf")


@pytest.mark.usefixtures("children_without_torch")
def test_bare_batch_baseline_runs_the_classify_prompts(demo_model_dir: Path) -> None:
    shapes = json.dumps(QUICK.as_dict())
    result = subprocess.run(
        [sys.executable, "-m", "bench.raw_batch", str(demo_model_dir), "classify",
         "--shapes", shapes], check=True, capture_output=True, text=True, timeout=600)
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert (measured["prompts"], measured["batch"]) == (QUICK.cl_sentences, QUICK.cl_batch)
    # batch_generate may stop a prompt at EOS before its one token.
    assert 0 <= measured["output_tokens"] <= QUICK.cl_sentences
    assert measured["prompts_s"] > 0


@pytest.mark.usefixtures("children_without_torch")
def test_decode_parity_times_every_path_against_bare_mlx_lm(demo_model_dir: Path,
                                                             tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "bench.decode_parity", str(demo_model_dir), "--max-tokens", "8",
         "--repeats", "2", "--out", str(tmp_path),
         "--server-variant", "process=--engine-process true",
         "--server-variant", "thread=--engine-process false"],
        check=True, capture_output=True, text=True, timeout=600)
    results = json.loads((tmp_path / "results.json").read_text())
    paths = {"bare", "engine", "server:process", "server:thread"}
    assert set(results["runs"]) == paths
    assert all(len(rates) == 2 and min(rates) > 0 for rates in results["runs"].values())
    assert results["ratio_to_bare"]["bare"] == 1.0
    cpu = results["host_cpu_us_per_token"]
    assert set(cpu) == paths and set(cpu["engine"]) == {"engine", "caller"}
    assert set(cpu["server:process"]) == {"loop", "process tree"}
    assert cpu["engine"]["engine"] > 0
    # The engine's own steps, in this process or in a server's (its engine process's).
    steps = results["engine_step_us"]
    assert set(steps) == paths - {"bare"}
    assert all(step["wall"] >= step["cpu"] > 0 for step in steps.values())
    assert "| server:process |" in (tmp_path / "results.md").read_text()


@pytest.mark.usefixtures("children_without_torch")
def test_batch_parity_times_every_path_against_bare_batch_generator(demo_model_dir: Path,
                                                                    tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "bench.batch_parity", str(demo_model_dir), "--streams", "4",
         "--prompt-tokens", "16", "--max-tokens", "8", "--repeats", "1", "--out", str(tmp_path)],
        check=True, capture_output=True, text=True, timeout=600)
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["step_ms"]) == {"bare", "engine", "server"}
    assert all(len(runs) == 1 and min(runs) > 0 for runs in results["runs"]["output_tok_s"].values())
    cpu = results["host_cpu_ms_per_step"]
    assert set(cpu["engine"]) == {"engine", "caller", "process"}
    assert set(cpu["server"]) == {"loop", "process tree"}
    assert set(results["engine_step_ms"]) == {"engine", "server"}
    assert results["engine_step_ms"]["server"]["cpu"] > 0
    assert "| server |" in (tmp_path / "results.md").read_text()


def test_a_bench_model_exported_to_gguf_computes_what_it_did(demo_model_dir: Path,
                                                              tmp_path: Path) -> None:
    """bench.gguf_export writes what llama.cpp loads for the GPU peer; read back the way
    `radix-mlx serve` reads a GGUF, it gives the directory's logits and tokens."""
    import mlx.core as mx
    from mlx_lm import load

    from bench.gguf_export import export, pre_tokenizer_name
    from engine.gguf import GPT2_SPLIT, convert, read_gguf

    path = export(demo_model_dir, tmp_path / "tiny.gguf", dtype="float32")
    gguf = read_gguf(path)
    assert gguf.metadata["tokenizer.ggml.pre"] == "gpt-2"  # the demo's plain byte-level BPE
    assert pre_tokenizer_name({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\p{N}"}},
        {"type": "Split", "pattern": {"Regex": GPT2_SPLIT}}]}}) == "smollm"
    original, tokenizer = load(str(demo_model_dir))
    exported, their_tokenizer = load(str(convert(path, tmp_path / "back", "float32")))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Count: 1 2 3"}],
                                           add_generation_prompt=True)
    assert their_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Count: 1 2 3"}], add_generation_prompt=True) == prompt
    tokens = mx.array([prompt])
    assert mx.allclose(original(tokens), exported(tokens), atol=1e-4).item()
