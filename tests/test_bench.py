"""Smoke test of the benchmark harness: every workload at toy sizes against one radix-mlx
server on the tiny demo model. Checks the shape of the results, never a timing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("psutil")

from bench import prefill_endpoints, several_models, speculation
from bench.__main__ import (
    BenchModel,
    all_workloads,
    describe_model,
    main,
    model_dirs,
    parse_args,
    server_env,
    server_specs,
)
from bench.medians import main as medians
from bench.report import (
    kv_quant_section,
    median_summary,
    replica_rows,
    several_models_section,
    targets,
    write,
)
from bench.servers import RADIX, replicas, tensor_parallel
from bench.workloads import QUICK, build_all, optimal_cached_tokens
from tests.engine.gguf_files import write_demo_gguf
from tests.server.support import without_torch


@pytest.fixture
def children_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's servers and children (its environment is this process's) run without
    torch, as the tests' servers do: tests/server/without_torch says why. Not for the
    embeddings workload, whose reference is sentence-transformers, on torch."""
    monkeypatch.setenv("PYTHONPATH", without_torch(os.environ.get("PYTHONPATH")))


TOY = ["--sp-groups", "2", "--sp-prompts-per-group", "2", "--sp-system-tokens", "64",
       "--mt-turns", "2", "--lc-document-tokens", "128", "--decode-output-tokens", "8"]


def test_workloads_are_seeded_and_sized(demo_model_dir: Path) -> None:
    first, again = (build_all(demo_model_dir, QUICK, seed=3) for _ in range(2))
    assert first == again
    names = [w.name for w in first]
    assert names == ["shared_prefix", "multi_turn", "no_share", "long_context", "single_stream",
                     "batch_decode", "classify"]
    shared = first[0]
    assert len(shared.conversations) == QUICK.sp_groups * QUICK.sp_prompts_per_group
    assert len({c.system for c in shared.conversations}) == QUICK.sp_groups
    assert len(first[1].conversations[0].user_turns) == QUICK.mt_turns
    assert len({c.system for c in first[3].conversations}) == 1
    batch_decode, classify = first[5], first[6]
    assert len(batch_decode.conversations) == batch_decode.concurrency == QUICK.bd_streams
    assert (classify.batch, classify.max_tokens) == (QUICK.cl_batch, 1)
    assert len(classify.conversations) == QUICK.cl_sentences
    # One shared instruction line in front of every sentence: the radix cache's to keep.
    assert len({c.user_turns[0].split("\n")[0] for c in classify.conversations}) == 1


def test_optimal_cached_tokens_computes_each_shared_prefix_once() -> None:
    """Two groups behind their own system prompt, a duplicate and a prompt that is another's
    prefix: every token of the prompts' trie is computed once, and every prompt at least
    its last token."""
    a, b = [1, 2, 3, 4], [1, 2, 3, 5]  # a group of two: 3 tokens shared
    c = [7, 8, 9]  # alone
    duplicate = [7, 8, 9]  # all but its last token from c
    longer = [1, 2, 3, 4, 6]  # a's 4 tokens, then its own
    assert optimal_cached_tokens([a, b]) == 3
    assert optimal_cached_tokens([c, a, duplicate, b]) == 3 + 2
    assert optimal_cached_tokens([longer, b, a]) == 4 + 3


@pytest.mark.usefixtures("children_without_torch")
def test_bench_against_radix_only(demo_model_dir: Path, tmp_path: Path) -> None:
    """Every workload but several models' (test_several_models_reload_and_report),
    speculative decoding's (test_speculation_workloads) and the prefill endpoints'
    (test_prefill_endpoints_workloads)."""
    workloads = [name for name in all_workloads()
                 if name not in (*several_models.WORKLOADS, *speculation.WORKLOADS,
                                 *prefill_endpoints.WORKLOADS)]
    # One server start for all of them (a start per workload is the bench's default,
    # which test_workloads_flag_runs_only_those_and_rounds_repeat_them runs).
    main(["--model", str(demo_model_dir), "--servers", "radix-mlx", "--quick", "--no-raw",
          "--no-plots", "--no-restart-per-workload", "--out", str(tmp_path),
          "--workloads", ",".join(workloads), *TOY])
    results = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "results.md").read_text().startswith("# radix-mlx vs mlx-lm")
    server = results["servers"]["radix-mlx"]
    assert set(server["workloads"]) == set(results["workloads"])
    for name, summary in server["workloads"].items():
        requests = server["requests"][name]
        assert summary["requests"] == len(requests) > 0
        assert summary["output_tokens"] == sum(r["completion_tokens"] for r in requests)
        assert all(r["ttft"] <= r["latency"] for r in requests)
        assert summary["peak_rss_mib"] > 0 and summary["peak_active_mib"] > 0
        assert 0 <= summary["cache_fraction"] <= 1
    # ignore_eos: every request generates exactly max_tokens.
    assert {r["completion_tokens"] for r in server["requests"]["no_share"]} == {
        QUICK.ns_output_tokens}
    shared = server["workloads"]["shared_prefix"]
    assert shared["cached_tokens"] >= 64  # the second prompt of a group reuses the first's
    # Single-turn chats have an optimal share, which the shared-prefix target reads.
    optimal = results["optimal_cache_fraction"]
    assert "multi_turn" not in optimal and 0 < optimal["no_share"] < optimal["shared_prefix"]
    of_optimal = next(t for t in results["targets"]
                      if t["target"] == "shared-prefix prompt tokens from cache, of the optimal")
    assert of_optimal["value"] == shared["cache_fraction"] / optimal["shared_prefix"]
    multi = server["requests"]["multi_turn"]
    assert all(r["cached_tokens"] > 0 for r in multi if r["turn"] > 0)
    long = server["workloads"]["long_context"]
    assert long["ttft_cold"] > 0 and long["ttft_warm_p50"] > 0
    assert server["workloads"]["single_stream"]["decode_tok_s"] > 0
    # A list prompt of cl_batch sentences per request, one token for each sentence.
    classify = server["workloads"]["classify"]
    assert classify["requests"] == classify["output_tokens"] == QUICK.cl_sentences
    assert classify["cached_tokens"] > 0  # the shared instruction
    bandwidth = results["batch_decode_bandwidth"]
    assert bandwidth["streams"] == QUICK.bd_streams
    assert bandwidth["step_bytes"] > results["model"]["weights_bytes"] > 0
    assert results["ratios"] == {}
    assert [t["met"] for t in results["targets"]][:3] == [None, None, None]
    # Constrained vs free decoding on one engine, at batch 1 and 16, and compile times.
    structured = results["structured"]
    assert set(structured["decode"]) == {"1", "16"}
    for rates in structured["decode"].values():
        assert rates["free_tok_s"] > 0 and rates["constrained_tok_s"] > 0
        assert rates["ratio"] == rates["constrained_tok_s"] / rates["free_tok_s"]
    assert set(structured["compile"]["grammars"]) == {
        "json_object", "records_schema", "tool_call_3_tools", "tool_calls_or_records"}
    assert "constrained vs free decode tok/s, batch 16" in {
        t["target"] for t in results["targets"]}
    assert "## Structured output" in (tmp_path / "results.md").read_text()
    # Tiny sliding-window and hybrid models: each group's second conversation reuses the
    # first's system prompt (a snapshot at its end).
    # The tiny model's head dimension (16) takes no KV quantization group.
    assert "does not divide it" in results["kv_quant"]["skipped"]
    snapshots = json.loads((tmp_path / "snapshot-models" / "results.json").read_text())
    for family in ("gemma3_text", "qwen3_next"):
        shared = snapshots["families"][family]["radix-mlx"]["shared_prefix"]
        assert shared["errors"] == 0 and shared["cached_tokens"] >= 2 * 64


@pytest.mark.usefixtures("children_without_torch")
def test_speculation_workloads(demo_model_dir: Path, tmp_path: Path) -> None:
    """The agent edit workload with speculation off, on, auto and on with a draft model
    (the demo model itself), and bare mlx-lm on the same chats; the standard workloads
    without repetition, off and auto. The demo model's output does not copy its prompt:
    what matters here is that it is the same text."""
    main(["--model", str(demo_model_dir), "--servers", "radix-mlx", "--quick", "--no-plots",
          "--no-structured", "--out", str(tmp_path), "--workloads",
          "agent_edit,spec_no_repeat", "--draft-model", str(demo_model_dir)])
    results = json.loads((tmp_path / "results.json").read_text())
    edit = results["speculation"]["agent_edit"]
    assert edit["streams"] == QUICK.ae_streams
    assert edit["draft model"]["acceptance"] > 0.5  # the model guesses its own argmax
    for mode in ("on", "auto", "draft model"):
        assert edit[mode]["same_output"] and edit[mode]["same_streams_output"]
        assert edit[mode]["vs_mlx_lm"] > 0 and edit[mode]["streams_vs_off"] > 0
    assert edit["on"]["acceptance"] is not None
    plain = results["speculation"]["spec_no_repeat"]
    assert set(plain) == {"single_stream", "no_share"}
    assert all(modes["ratio"] > 0 for modes in plain.values())
    assert "--speculation on, a draft model" in (tmp_path / "results.md").read_text()


@pytest.mark.usefixtures("children_without_torch")
def test_workloads_flag_runs_only_those_and_rounds_repeat_them(demo_model_dir: Path,
                                                               tmp_path: Path) -> None:
    main(["--model", str(demo_model_dir), "--servers", "radix-mlx", "--quick", "--no-raw",
          "--no-plots", "--no-structured", "--out", str(tmp_path), "--workloads",
          "single_stream", "--rounds", "2", *TOY])
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["workloads"] == ["single_stream"] and results["rounds"] == 2
    server = results["servers"]["radix-mlx"]
    assert set(server["workloads"]) == {"single_stream"}
    # Each round measured on its own server start; the table's number is their median.
    rounds = server["rounds"]["single_stream"]
    assert len(rounds) == 2
    assert server["workloads"]["single_stream"]["output_tok_s"] == pytest.approx(
        sum(r["output_tok_s"] for r in rounds) / 2)
    assert {r["round"] for r in server["requests"]["single_stream"]} == {0, 1}
    assert {log.name for log in (tmp_path / "logs").iterdir()} == {
        "radix-mlx-single_stream-round1.log", "radix-mlx-single_stream-round2.log"}
    assert "median of 2 rounds" in (tmp_path / "results.md").read_text()
    for argv in (["--workloads", "single_stream,nope"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            main(argv)


def test_targets_are_medians_over_rounds_with_each_rounds_value() -> None:
    def ran(output_tok_s: float) -> dict:
        return {"output_tok_s": output_tok_s, "requests_s": output_tok_s / 10}

    ours = [ran(30.0), ran(20.0), ran(36.0)]
    theirs = [ran(10.0), ran(10.0), ran(9.0)]
    results = {"rounds": 3, "servers": {
        "radix-mlx": {"rounds": {"no_share": ours, "classify": ours}},
        "mlx-lm": {"rounds": {"no_share": theirs}},
    }, "raw_batch": {"classify": {"rounds": [{"prompts_s": 1.0}, {"prompts_s": 4.0},
                                            {"prompts_s": 2.0}]}}}
    for entry in results["servers"].values():
        entry["workloads"] = {w: median_summary(r) for w, r in entry["rounds"].items()}
    results["raw_batch"]["classify"].update(
        median_summary(results["raw_batch"]["classify"]["rounds"]))
    by_name = {t["target"]: t for t in targets(results)}
    no_share = by_name["no-share output tok/s vs mlx-lm"]
    # The ratio of the medians (30 / 10), and round by round (not the median of ratios).
    assert no_share["value"] == pytest.approx(3.0)
    assert no_share["rounds"] == pytest.approx([3.0, 2.0, 4.0])
    classify = by_name["classify sentences/s vs bare mlx_lm.batch_generate(max_tokens=1)"]
    assert classify["value"] == pytest.approx(1.5)  # 3.0 sentences/s against 2.0
    assert classify["rounds"] == pytest.approx([3.0, 0.5, 1.8])


@pytest.mark.usefixtures("children_without_torch")
def test_a_gguf_model_is_benched_as_serve_converts_it(demo_model_dir: Path, tmp_path: Path):
    write_demo_gguf(demo_model_dir, tmp_path / "tiny.gguf")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    [model] = model_dirs([str(tmp_path / "tiny.gguf")], env)
    assert model.directory.name == "tiny" and model.directory.is_relative_to(tmp_path / "cache")
    assert model.gguf == tmp_path / "tiny.gguf"  # what llama.cpp's server loads
    description = describe_model(model.directory)["description"]
    assert "float32" in description and description.endswith("the weights of tiny.gguf")


def test_kv_quant_is_reported_with_its_targets() -> None:
    def ran(tok_s: float, bytes_per_token: float, identical: int, hit_equals_cold: int
            ) -> dict:
        return {"output_tok_s": tok_s, "bytes_per_token": bytes_per_token,
                "cached_tokens_per_gib": 2**30 / bytes_per_token,
                "hit_equals_cold": hit_equals_cold, "throughput_ratio": tok_s / 10.0,
                "tokens_per_gib_ratio": 46080 / bytes_per_token,
                "tokens_per_gib_vs_bf16": 23040 / bytes_per_token,
                "identical_to_unquantized": identical}

    kv = {"bf16_bytes_per_token": 23040, "prompts": 32,
          "model dtype": {"output_tok_s": 10.0, "bytes_per_token": 46080,
                          "cached_tokens_per_gib": 2**30 / 46080, "hit_equals_cold": 32},
          "kv_bits 8": ran(9.6, 12960, 31, 30), "kv_bits 4": ran(9.0, 7200, 20, 12)}
    met = {t["target"]: t["met"] for t in targets({"servers": {}, "kv_quant": kv})
           if t["target"].startswith("--kv-bits")}
    assert met == {"--kv-bits 8: cached tokens per GiB / bfloat16's": False,
                   "--kv-bits 8: greedy answers equal to unquantized, of 32": True,
                   "--kv-bits 8: shared-prefix output tok/s / unquantized": True}
    table = "\n".join(kv_quant_section(kv))
    assert "| kv_bits 8 | 9.60 | 0.96x | 12960 |" in table and "| 31/32 | 30/32 |" in table
    assert kv_quant_section({"skipped": "why"}) == [
        "", "KV cache quantization not measured: why."]


def test_replicas_are_reported_against_one_server() -> None:
    def ran(output_tok_s: float, cache_fraction: float) -> dict:
        return {"output_tok_s": output_tok_s, "cache_fraction": cache_fraction}

    results = {"servers": {
        "radix-mlx": {"workloads": {"shared_prefix": ran(10.0, 0.70),
                                    "multi_turn": ran(8.0, 0.60)}},
        "radix-mlx-x2-cache-aware": {"router_workers": 2, "workloads": {
            "shared_prefix": ran(19.0, 0.68), "multi_turn": ran(12.0, 0.50)}},
        "radix-mlx-x2-round-robin": {"router_workers": 2, "workloads": {
            "multi_turn": ran(16.0, 0.30)}},
    }}
    rows = {(r["server"], r["workload"]): r for r in replica_rows(results)}
    assert set(rows) == {("radix-mlx-x2-cache-aware", "shared_prefix"),
                         ("radix-mlx-x2-cache-aware", "multi_turn"),
                         ("radix-mlx-x2-round-robin", "multi_turn")}
    shared = rows[("radix-mlx-x2-cache-aware", "shared_prefix")]
    assert shared["speedup"] == pytest.approx(1.9) and shared["points"] == pytest.approx(-2)
    assert rows[("radix-mlx-x2-round-robin", "multi_turn")]["points"] == pytest.approx(-30)
    # Only the cache-aware run has targets: >= 1.8x throughput, cached share within 5 points.
    met = {t["target"]: t["met"] for t in targets(results) if "radix-mlx-x2" in t["target"]}
    assert met == {
        "radix-mlx-x2-cache-aware shared-prefix output tok/s vs one server": True,
        "radix-mlx-x2-cache-aware shared-prefix cached share minus one server's, points": True,
        "radix-mlx-x2-cache-aware multi-turn output tok/s vs one server": False,
        "radix-mlx-x2-cache-aware multi-turn cached share minus one server's, points": False,
    }


def test_with_replicas_pinned_to_gpus_the_one_server_baseline_gets_one_gpu() -> None:
    """Each replica sees one GPU, so the server they are compared with does too; tensor
    parallelism and the replicas themselves keep every device the bench was given."""
    args = parse_args(["--replicas", "2", "--replicas-cuda-devices", "2,3",
                       "--tensor-parallel", "2"])
    env = {"PATH": "/bin"}
    assert server_env(RADIX, env, args) == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "2"}
    assert server_env(replicas("cache_aware", 2, "2,3"), env, args) == env
    assert server_env(tensor_parallel(2), env, args) == env
    unpinned = parse_args(["--replicas", "2"])
    assert server_env(RADIX, env, unpinned) == env


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


def test_medians_of_alternating_runs_per_code_and_server(tmp_path: Path) -> None:
    runs = []
    for i, (label, itl) in enumerate([("before", 200.0), ("after", 100.0), ("before", 240.0),
                                      ("after", 120.0), ("before", 220.0)]):
        folder = tmp_path / f"run{i}"
        folder.mkdir()
        summary = {"ttft_p50": 1.0 + i, "itl_p50": itl, "output_tok_s": 10.0}
        (folder / "results.json").write_text(json.dumps({
            "git": f"commit{i}", "command": "python -m bench",
            "servers": {"radix-mlx": {"workloads": {"shared_prefix": summary}}}}))
        runs.append(f"{label}={folder}")
    medians([str(tmp_path / "out"), *runs])
    table = json.loads((tmp_path / "out" / "medians.json").read_text())["shared_prefix"]
    assert table["before / radix-mlx"]["itl_p50"] == [200.0, 240.0, 220.0]
    assert table["after / radix-mlx"]["ttft_p50"] == [2.0, 4.0]
    text = (tmp_path / "out" / "medians.md").read_text()
    assert "| before / radix-mlx | 3 | 3.00 (1.00, 3.00, 5.00) | 220 (200, 240, 220) |" in text
    assert "| after / radix-mlx | 2 | 3.00 (2.00, 4.00) | 110 (100, 120) |" in text


def test_llama_cpp_runs_only_on_a_gguf_with_a_binary(demo_model_dir: Path) -> None:
    args = parse_args(["--servers", "radix-mlx,llama-cpp", "--llama-server", ""])
    specs, skipped = server_specs(args, BenchModel(demo_model_dir, None))
    assert [s.name for s in specs] == ["radix-mlx"]
    assert "not one" in skipped["llama-cpp"]
    specs, skipped = server_specs(args, BenchModel(demo_model_dir, demo_model_dir / "x.gguf"))
    assert [s.name for s in specs] == ["radix-mlx"]
    assert "--llama-server" in skipped["llama-cpp"]
    with pytest.raises(SystemExit):
        parse_args(["--servers", "radix-mlx,llama.cpp"])


def test_llama_cpp_gets_its_own_ratio_table(tmp_path: Path) -> None:
    def ran(output_tok_s: float, ttft_p50: float) -> dict:
        return {"requests": 4, "errors": 0, "output_tok_s": output_tok_s,
                "ttft_p50": ttft_p50, "peak_rss_mib": 100.0}

    def server(name: str, workloads: dict) -> dict:
        return {"argv": [f"/usr/bin/{name}", "--model", "m"], "notes": "", "workloads": workloads}

    results = {
        "command": "python -m bench", "shapes": {}, "workloads": ["shared_prefix", "no_share"],
        "model": {"name": "m", "description": "a model"},
        "hardware": {"tag": "cpu", "cpu": "a CPU", "cpu_count": 2, "gpus": [], "device": "cpu"},
        "servers": {
            "radix-mlx": server("python", {"shared_prefix": ran(30.0, 0.1),
                                           "no_share": ran(20.0, 0.5)}),
            "mlx-lm": server("python", {"shared_prefix": ran(10.0, 1.0)}),
            "llama-cpp": server("llama-server", {"shared_prefix": ran(60.0, 0.2),
                                                 "no_share": ran(40.0, 0.25)}),
        },
        "skipped_servers": {},
    }
    write(results, tmp_path, plots=False)
    # The targets' ratios stay radix-mlx / mlx-lm; llama.cpp's are a table of their own.
    assert set(results["ratios"]) == {"shared_prefix"}
    assert results["ratios"]["shared_prefix"]["output_tok_s"] == 3.0
    peer = results["peer_ratios"]["llama-cpp"]
    assert peer["shared_prefix"]["output_tok_s"] == 0.5 and peer["no_share"]["ttft_p50"] == 2.0
    text = (tmp_path / "results.md").read_text()
    assert "| shared_prefix | llama-cpp | 0 | 60.0 |" in text
    assert "## Ratios (radix-mlx / mlx-lm)" in text
    llama_table = text.split("## Ratios (radix-mlx / llama-cpp)")[1]
    assert "| no_share | 0.50x | n/a | 2.00x |" in llama_table
    assert "- llama-cpp: `llama-server --model m`" in text


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


@pytest.mark.usefixtures("children_without_torch")
def test_several_models_reload_and_report(demo_model_dir: Path, tmp_path: Path) -> None:
    """idle_reload on real servers (one start: its other workloads start six, and the
    server tests cover what they measure); the report of all three from their figures."""
    main(["--model", str(demo_model_dir), "--quick", "--no-raw", "--no-plots",
          "--no-structured", "--out", str(tmp_path), "--workloads", "idle_reload"])
    results = json.loads((tmp_path / "results.json").read_text())
    reload = results["several_models"]["idle_reload"]
    assert reload["cached_fraction"] >= 0.9 and reload["same_output"]
    assert reload["reload_seconds"] > 0 and reload["ttft_after_reload"] > 0
    several = {
        **results["several_models"],
        "model_switching": {"one model": {"requests": 4, "ttft_p50": 1.0},
                            "one model, own process": {"requests": 4, "ttft_p50": 1.0},
                            "two models": {"requests": 4, "ttft_p50": 1.05},
                            "ttft_ratio": 1.05, "ttft_ratio_in_process": 1.05},
        "model_flood": {"models": 3, "budget_fits": 2, "concurrency": 2,
                        "one model": {"requests": 6, "wall_s": 1.0, "errors": 0, "errors_5xx": 0},
                        "one model again": {"requests": 6, "wall_s": 1.0, "errors": 0,
                                            "errors_5xx": 0},
                        "three models": {"requests": 6, "wall_s": 2.0, "errors": 1,
                                         "errors_5xx": 1, "unloads": 2},
                        "identical_answers": 5, "identical_answers_control": 6},
    }
    rows = {row["target"]: row["met"]
            for row in targets({**results, "several_models": several})}
    assert rows["two loaded models asked in turn: TTFT p50 / one model's"] is True
    assert rows["flood over 3 models, budget for 2: failed requests"] is False
    assert rows["flood over 3 models: greedy answers equal to one model's"] is False
    assert rows["after an idle unload and reload: cached share of the prompt"] is True
    text = "\n".join(several_models_section(several))
    assert "1.05x" in text and "5 of 6" in text and "control) matched 6 of 6" in text


def test_prefill_endpoints_workloads(demo_model_dir: Path, tmp_path: Path) -> None:
    """all-MiniLM-L6-v2's embeddings against sentence-transformers, and a rerank on the
    demo model: the query is computed once for all its documents."""
    main(["--model", str(demo_model_dir), "--quick", "--no-raw", "--no-plots",
          "--no-structured", "--out", str(tmp_path), "--workloads", "embeddings,rerank"])
    results = json.loads((tmp_path / "results.json").read_text())
    embeddings = results["prefill_endpoints"]["embeddings"]
    assert embeddings["sentences"] == QUICK.em_sentences and embeddings["min_cosine"] > 0.9999
    assert embeddings["sentences_s"] > 0 and embeddings["reference_sentences_s"] > 0
    rerank = results["prefill_endpoints"]["rerank"]
    assert len(rerank["rounds"]) == QUICK.rr_rounds
    for one in rerank["rounds"]:
        # Every document's prompt holds the judge's instructions and the query: computed
        # once, the rest is each document's own tokens and the few around them.
        assert one["computed_tokens"] < one["prompt_tokens"] / 2
        assert one["computed_tokens"] >= one["document_tokens"]
    rows = {row["target"]: row for row in results["targets"]}
    assert rows["rerank, causal judge: prompt tokens computed / the documents' own"][
        "value"] == rerank["computed_per_document_token"]
    assert "embeddings sentences/s vs sentence-transformers (all-MiniLM-L6-v2)" in rows
    text = (tmp_path / "results.md").read_text()
    assert "## Prefill-only endpoints" in text and "sentence-transformers" in text
