"""Smoke test of the benchmark harness: the standard workloads at toy sizes against one
radix-mlx server on the tiny demo model, and the report's tables and targets. Checks the
shape of the results, never a timing. The speculation, several-models and prefill
endpoints' workloads are test_bench_feature_workloads.py; the bare baselines, parity
tools and GGUF export test_bench_baselines.py."""

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")

from bench import prefill_endpoints, several_models, speculation
from bench.__main__ import BenchModel, all_workloads, main, parse_args, server_env, server_specs
from bench.client import Connection, StreamError
from bench.medians import main as medians
from bench.report import kv_quant_section, median_summary, ratio_table, replica_rows, targets, write
from bench.servers import RADIX, replicas, tensor_parallel
from bench.workloads import QUICK, build_all, optimal_cached_tokens

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
    (test_prefill_endpoints_workloads), all in test_bench_feature_workloads.py."""
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
    # Before them, untimed lists of other text, as bare mlx-lm's classify runs its first.
    log = (tmp_path / "logs" / "radix-mlx.log").read_text()
    assert log.count("POST /v1/classify") == (QUICK.cl_sentences // QUICK.cl_batch
                                              + QUICK.cl_concurrency)
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
def test_bare_batch_baselines_run_in_each_round_and_every_other_round_mirrors(
        demo_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A host's speed drifts over minutes, so bare mlx-lm's classify lists run once in
    each round beside its servers, not all after the last: each round is compared with its
    own. The second round runs in mirror order (bare first), so that what one path leaves
    behind for the next falls on each alike."""
    main(["--model", str(demo_model_dir), "--servers", "radix-mlx", "--quick", "--no-plots",
          "--no-structured", "--out", str(tmp_path), "--workloads", "classify",
          "--rounds", "2", *TOY])
    lines = [line for line in capsys.readouterr().err.splitlines()
             if line.startswith(("bench: starting radix-mlx", "bench: bare mlx_lm"))]
    assert [line.split()[1] for line in lines] == ["starting", "bare", "bare", "starting"]
    raw = json.loads((tmp_path / "results.json").read_text())["raw_batch"]["classify"]
    assert len(raw["rounds"]) == 2
    assert raw["prompts_s"] == pytest.approx(sum(r["prompts_s"] for r in raw["rounds"]) / 2)


@pytest.mark.usefixtures("children_without_torch")
def test_warm_long_context_is_held_to_bare_mlx_lm_over_the_same_cached_document(
        demo_model_dir: Path, tmp_path: Path) -> None:
    """Rated at the cold prompt's mean rate, a few dozen tokens after a long document cost
    less than their forward does; the bound is also measured: bare mlx-lm's first token
    over the same document in its own prompt cache, and a decode step."""
    main(["--model", str(demo_model_dir), "--servers", "radix-mlx", "--quick", "--no-plots",
          "--no-structured", "--out", str(tmp_path), "--workloads", "long_context,single_stream",
          "--lc-questions", "3", *TOY])
    results = json.loads((tmp_path / "results.json").read_text())
    bare = results["raw_long_context"]
    assert bare["questions"] == 2 and len(bare["rounds"]) == 1
    assert bare["document_tokens"] >= 128 and bare["uncached_tokens"] >= 1
    assert bare["bound_s"] == pytest.approx(bare["first_token_s"] + bare["decode_step_s"])
    warm = results["servers"]["radix-mlx"]["workloads"]["long_context"]["ttft_warm_p50"]
    targets = {row["target"]: row["value"] for row in results["targets"]}
    measured = next(value for target, value in targets.items()
                    if target.startswith("long-context warm TTFT / bare mlx-lm's"))
    assert measured == pytest.approx(warm / bare["bound_s"])
    assert any(target.endswith("at the cold prompt's rate)") for target in targets)
    assert "## Warm long context: bare mlx-lm" in (tmp_path / "results.md").read_text()


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


def test_a_workload_with_a_failed_request_gets_no_ratio_and_no_verdict() -> None:
    """A peer whose generation thread died answers its other requests at once: its rate
    then counts less work than ours, and a ratio against it would flatter us."""
    def ran(output_tok_s: float, errors: int = 0) -> dict:
        return {"requests": 8 - errors, "errors": errors, "output_tok_s": output_tok_s,
                "ttft_p50": 1.0}

    ours = {"shared_prefix": [ran(30.0), ran(30.0)], "multi_turn": [ran(30.0), ran(30.0)]}
    theirs = {"shared_prefix": [ran(5.0, errors=8), ran(10.0)],
              "multi_turn": [ran(10.0), ran(10.0)]}
    results = {"rounds": 2, "servers": {"radix-mlx": {"rounds": ours},
                                        "mlx-lm": {"rounds": theirs}}}
    for entry in results["servers"].values():
        entry["workloads"] = {w: median_summary(r) for w, r in entry["rounds"].items()}
    assert set(ratio_table(results)) == {"multi_turn"}
    by_name = {t["target"]: t for t in targets(results)}
    shared = by_name["shared-prefix output tok/s vs mlx-lm"]
    assert shared["value"] is None and shared["met"] is None
    # Round by round, the clean round still has its ratio.
    assert shared["rounds"] == [None, pytest.approx(3.0)]
    assert by_name["multi-turn TTFT p50 vs mlx-lm"]["met"] is not None


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_a_server_is_terminated_when_its_benchmark_is_killed_outright() -> None:
    """A server runs in a session of its own; when the benchmark gets SIGKILL (a timeout,
    a lease's end) and no `finally` runs, the kernel still stops the server."""
    script = ("import subprocess, sys\n"
              "from bench.servers import terminated_with_parent\n"
              "server = subprocess.Popen(['sleep', '600'], start_new_session=True,\n"
              "                          preexec_fn=terminated_with_parent())\n"
              "print(server.pid, flush=True)\n"
              "sys.stdin.read()\n")
    bench = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[1])
    server = psutil.Process(int(bench.stdout.readline()))
    assert server.is_running() and server.status() != psutil.STATUS_ZOMBIE
    bench.kill()
    bench.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if server.status() == psutil.STATUS_ZOMBIE:  # dead, not yet reaped by init
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    else:
        server.kill()
        pytest.fail("the server outlived its benchmark")


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


async def request_body(reader: asyncio.StreamReader) -> bytes:
    """The body of the next request a fake server reads (sized by Content-Length)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(next(line.split(b": ")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    return await reader.readexactly(length)


async def test_connection_reads_chunked_answers_and_reconnects_after_close() -> None:
    """The client reads both ways a server sizes a body, keeps its socket between
    requests, and opens another where the server said it closes this one."""
    connections = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        while True:
            body = await request_body(reader)
            if len(connections) == 1 and b'"chunked"' in body:
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                             b"5\r\n{\"a\":\r\n3;x=y\r\n 1}\r\n0\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 2\r\n"
                             b"Connection: close\r\n\r\n{}")
                await writer.drain()
                writer.close()
                return
            await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    connection = Connection(f"http://127.0.0.1:{port}")
    try:
        assert await connection.post("/v1/classify", {"input": "chunked"}) == (200, b'{"a": 1}')
        assert await connection.post("/v1/classify", {"input": "chunked"}) == (200, b'{"a": 1}')
        assert len(connections) == 1
        assert await connection.post("/v1/classify", {"input": "x"}) == (400, b"{}")
        assert await connection.post("/v1/classify", {"input": "x"}) == (400, b"{}")
        assert len(connections) == 2
    finally:
        connection.close()
        server.close()


async def test_connection_retries_a_kept_socket_the_server_closed_but_not_a_new_one() -> None:
    """A server may close a kept socket between answers without saying so (llama.cpp's
    does after a stream): the request goes again once on a new socket. A new socket that
    closes without an answer is the server's failure, and raises."""
    connections = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        answers = {1: 1, 2: 1, 3: 0}[len(connections)]
        for _ in range(answers):
            await request_body(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
        if len(connections) != 2:  # the second closes at once, idle
            await request_body(reader)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with Connection(f"http://127.0.0.1:{port}") as connection:
            assert await connection.post("/v1/completions", {}) == (200, b"{}")
            assert await connection.post("/v1/completions", {}) == (200, b"{}")
            assert len(connections) == 2
            with pytest.raises(asyncio.IncompleteReadError):
                await connection.post("/v1/completions", {})
            assert len(connections) == 3
    finally:
        server.close()


async def test_connection_streams_events_however_the_server_frames_them() -> None:
    """A stream's `data:` lines come out whole and in order whether a chunk ends inside a
    line or the server (mlx-lm's, HTTP/1.0) sends no framing and closes; an error status
    raises with the server's body; the socket is kept only after a framed stream read to
    its end."""
    connections = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        while True:
            try:
                body = await request_body(reader)
            except asyncio.IncompleteReadError:  # the client closed it
                return
            if b'"chunked"' in body:
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                             b"9\r\ndata: {\"a\r\nc\r\n\": 1}\n\ndata:\r\n"
                             b"9\r\n [DONE]\n\n\r\n0\r\n\r\n")
                await writer.drain()
                continue
            if b'"unframed"' in body:
                writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
                             b": ping\ndata: x\n\ndata: [DONE]\n\n")
            else:
                writer.write(b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 11\r\n"
                             b"Connection: close\r\n\r\n{\"busy\": 1}")
            await writer.drain()
            writer.close()
            return

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with Connection(f"http://127.0.0.1:{port}") as connection:
            for _ in range(2):
                events = [e async for e in connection.events("/v1/chat/completions",
                                                             {"mode": "chunked"})]
                assert events == ['{"a": 1}', "[DONE]"]
            assert len(connections) == 1
            async for _ in connection.events("/v1/chat/completions", {"mode": "chunked"}):
                break  # the rest of this answer stays on that socket
            events = [e async for e in connection.events("/v1/chat/completions",
                                                         {"mode": "unframed"})]
            assert events == ["x", "[DONE]"]
            assert [e async for e in connection.events("/v1/chat/completions",
                                                       {"mode": "chunked"})][-1] == "[DONE]"
            assert len(connections) == 3
            with pytest.raises(StreamError, match="HTTP 429.*busy"):
                async for _ in connection.events("/v1/chat/completions", {"mode": "no"}):
                    pass
    finally:
        server.close()
