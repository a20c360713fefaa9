"""Speculative decoding's workloads: the same radix-mlx server with `--speculation` off,
on and auto, and bare `mlx_lm.stream_generate`.

- `agent_edit`: what coding agents send. The model is asked to repeat a file of
  `ae_file_tokens` with one function renamed, and to re-emit a tool call's JSON with one
  argument changed; one request at a time (single-stream decode tok/s, against bare
  mlx-lm on the same prompt), then `ae_streams` edits of the file at once (output tok/s),
  after as many edits of another file (their rate is reported as the cold one). The
  modes' servers run together and take turns, `spec_rounds` rounds on a new file each:
  medians of the rounds, and each round's batch against off's of the same round.
  Targets: single stream >= 1.8x bare mlx-lm, 16 streams >= 1.3x speculation off, greedy
  output identical. A random-weight model does not copy its prompt, so its drafts are
  rejected and this measures only their cost: the workload means something on a real
  model (the default SmolLM2-135M-Instruct does copy the file). With `--draft-model DIR`
  it also runs `on` with that draft model as the only source.
- `spec_no_repeat`: the standard `single_stream` and `no_share` workloads (random words,
  nothing to copy) with speculation off and auto, each after a run of other prompts of
  the same shapes (reported as cold), the two servers taking turns over `spec_rounds`
  rounds of new prompts. Target: auto >= 0.95x off.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench import report
from bench.client import Connection, chat, run_workload
from bench.servers import RADIX, RunningServer, running
from bench.workloads import WORKLOADS as STANDARD
from bench.workloads import Shapes, TextSource

MODES = ("off", "on", "auto")
DRAFT_MODEL = "draft model"  # agent_edit's mode with a draft model as the only source
# Greedy and ending at EOS, as bare mlx-lm does (the other workloads ignore EOS).
EXTRA = {"temperature": 0.0}


def code_file(source: TextSource, tokens: int) -> tuple[str, list[str]]:
    """A Python file of about `tokens` tokens of small handlers, and their names."""
    names: list[str] = []
    text = ""
    while len(source.tokenizer.encode(text, add_special_tokens=False).ids) < tokens:
        name, field, note = (source.text(2).replace(" ", "_").lower(), source.text(1).lower(),
                             source.text(3))
        names.append(f"handle_{name}")
        text += (f"def handle_{name}(request):\n    value = request.get(\"{field}\")\n"
                 f"    if value is None:\n        return error(\"{note}\")\n"
                 f"    return ok(value, \"{field}\")\n\n\n")
    return text, names


def edit(text: str, old: str, new: str) -> list[dict]:
    return [{"role": "user", "content": (
        f"Here is a file:\n```python\n{text}```\nRepeat the whole file exactly, with one "
        f"change: rename the function {old} to {new}. Output only the code.")}]


def tool_call(text: str, path: str, new_path: str) -> list[dict]:
    call = json.dumps({"name": "write_file", "arguments": {"path": path, "content": text}})
    return [{"role": "user", "content": (
        f"You called this tool:\n{call}\nCall it again with exactly the same arguments, "
        f"but with path {new_path}. Output only the JSON of the call.")}]


def agent_requests(source: TextSource, shapes: Shapes) -> tuple[list[list[dict]],
                                                                 list[list[dict]]]:
    """The single-stream requests (file edits and tool calls, alternating) and the
    concurrent ones (edits of one file)."""
    text, names = code_file(source, shapes.ae_file_tokens)
    single = []
    for i in range(shapes.ae_repeats):
        single.append(edit(text, names[i + 1], f"{names[i + 1]}_v2"))
        single.append(tool_call(text[:len(text) // 4], f"src/{names[i]}.py",
                                f"src/{names[i]}_v2.py"))
    streams = [edit(text, names[i % len(names)], f"{names[i % len(names)]}_{i}")
               for i in range(shapes.ae_streams)]
    return single, streams


async def one(base_url: str, messages: list[dict], max_tokens: int) -> dict:
    async with Connection(base_url) as connection:
        ttft, latency, usage, text = await chat(connection, messages, max_tokens, EXTRA)
    tokens = usage.get("completion_tokens", 0)
    return {"decode_tok_s": (tokens - 1) / (latency - ttft) if tokens > 1 else None,
            "completion_tokens": tokens, "text": text}


async def together(base_url: str, requests: list[list[dict]], max_tokens: int) -> dict:
    loop = asyncio.get_running_loop()
    started = loop.time()
    answers = await asyncio.gather(*(one(base_url, m, max_tokens) for m in requests))
    wall = loop.time() - started
    return {"output_tok_s": sum(a["completion_tokens"] for a in answers) / wall,
            "wall_s": wall, "texts": [a["text"] for a in answers]}


def metrics(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("radix_mlx_speculative_")}


def acceptance(counters: dict[str, float]) -> dict:
    drafted = counters.get("radix_mlx_speculative_draft_tokens_total", 0)
    rows = counters.get("radix_mlx_speculative_verified_rows_total", 0)
    return {"acceptance": drafted and counters.get(
                "radix_mlx_speculative_accepted_tokens_total", 0) / drafted,
            "tokens_per_verify": rows and counters.get(
                "radix_mlx_speculative_verified_tokens_total", 0) / rows}


def bare_mlx_lm(model: Path, env: dict[str, str], requests: list[list[dict]],
                max_tokens: int) -> list[dict]:
    """Bare `mlx_lm.stream_generate` on each request's chat prompt, in a process of its own."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
        json.dump(requests, file)
    out = subprocess.run(
        [sys.executable, "-m", "bench.raw_decode", str(model), "--messages-file", file.name,
         "--max-tokens", str(max_tokens)], env=env, capture_output=True, text=True, check=True)
    Path(file.name).unlink()
    return json.loads(out.stdout.strip().splitlines()[-1])["runs"]


def agent_edit(model: Path, shapes: Shapes, env: dict[str, str], logs: Path,
               seed: int, draft_model: str | None = None) -> dict:
    """Every mode's server at once (`side_by_side`): each single-stream request on every
    mode in turn, then each mode's batch, for `spec_rounds` rounds on a new file each."""
    rounds = [agent_requests(TextSource(model, seed + 4000 + 2 * r), shapes)
              for r in range(shapes.spec_rounds)]
    _, warm_streams = agent_requests(TextSource(model, seed + 4001), shapes)  # another file
    flags = {mode: ["--speculation", mode] for mode in MODES}
    if draft_model:
        flags[DRAFT_MODEL] = ["--speculation", "on", "--speculation-sources", "model",
                              "--speculation-draft-model", draft_model]
    runs: dict[str, list[dict]] = {mode: [] for mode in flags}
    batches: dict[str, list[dict]] = {mode: [] for mode in flags}
    single_counters: dict[str, dict[str, float]] = {mode: {} for mode in flags}
    batch_counters: dict[str, dict[str, float]] = {mode: {} for mode in flags}
    cold: dict[str, dict] = {}
    with side_by_side(model, env, logs, "agent_edit", flags) as servers:
        for mode, server in servers.items():
            print(f"  speculation: agent_edit, {mode}: warming up ...", file=sys.stderr,
                  flush=True)
            asyncio.run(one(server.base_url, rounds[0][0][0], 8))  # untimed: kernels, caches
            # A batch meets shapes one stream never does, and MLX's CUDA backend pays
            # 10-70 ms the first time it meets each (bench/experiments/speculation-engine):
            # a batch editing another file first, its rate kept as the cold one.
            cold[mode] = asyncio.run(together(server.base_url, warm_streams,
                                              shapes.ae_stream_output_tokens))
        for number, (single, streams) in enumerate(rounds):
            print(f"  speculation: agent_edit, round {number + 1} of {len(rounds)} ...",
                  file=sys.stderr, flush=True)
            order = turned(list(servers), number)
            before = {mode: metrics(servers[mode].base_url) for mode in order}
            for messages in single:
                for mode in order:
                    runs[mode].append(asyncio.run(one(servers[mode].base_url, messages,
                                                      shapes.ae_output_tokens)))
            for mode in order:
                after = metrics(servers[mode].base_url)
                add_counts(single_counters[mode], before[mode], after)
                batches[mode].append(asyncio.run(together(
                    servers[mode].base_url, streams, shapes.ae_stream_output_tokens)))
                add_counts(batch_counters[mode], after, metrics(servers[mode].base_url))
    result: dict = {"streams": shapes.ae_streams, "rounds": len(rounds)}
    for mode in flags:
        result[mode] = {
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs[mode]),
            "runs": [r["decode_tok_s"] for r in runs[mode]],
            "texts": [r["text"] for r in runs[mode]],
            **acceptance(single_counters[mode]),
            "streams_output_tok_s": statistics.median(b["output_tok_s"] for b in batches[mode]),
            "streams_rounds": [b["output_tok_s"] for b in batches[mode]],
            "streams_wall_s": [b["wall_s"] for b in batches[mode]],
            "cold_streams_output_tok_s": cold[mode]["output_tok_s"],
            "streams_texts": [text for b in batches[mode] for text in b["texts"]],
            "streams": acceptance(batch_counters[mode]),
        }
        figures = {k: v for k, v in result[mode].items() if "texts" not in k}
        print(f"    {mode}: {json.dumps(figures)}", file=sys.stderr, flush=True)
    print("  speculation: agent_edit, bare mlx_lm.stream_generate ...", file=sys.stderr,
          flush=True)
    bare = bare_mlx_lm(model, env, [m for single, _ in rounds for m in single],
                       shapes.ae_output_tokens)
    result["mlx_lm"] = {"decode_tok_s": statistics.median(r["decode_tok_s"] for r in bare),
                        "runs": [r["decode_tok_s"] for r in bare],
                        "texts": [r["text"] for r in bare]}
    off = result["off"]
    for mode in flags.keys() - {"off"}:
        row = result[mode]
        row["vs_mlx_lm"] = report.ratio(row["decode_tok_s"], result["mlx_lm"]["decode_tok_s"])
        row["vs_off"] = report.ratio(row["decode_tok_s"], off["decode_tok_s"])
        # Each round's batch against off's in the same round, seconds apart.
        row["streams_vs_off_rounds"] = [report.ratio(ours, theirs) for ours, theirs in
                                        zip(row["streams_rounds"], off["streams_rounds"])]
        row["streams_vs_off"] = statistics.median(row["streams_vs_off_rounds"])
        row["cold_streams_vs_off"] = report.ratio(row["cold_streams_output_tok_s"],
                                                  off["cold_streams_output_tok_s"])
        row["same_output"] = row["texts"] == off["texts"] == result["mlx_lm"]["texts"]
        row["same_streams_output"] = row["streams_texts"] == off["streams_texts"]
    off["vs_mlx_lm"] = report.ratio(off["decode_tok_s"], result["mlx_lm"]["decode_tok_s"])
    return result


@contextlib.contextmanager
def side_by_side(model: Path, env: dict[str, str], logs: Path, workload: str,
                 flags: dict[str, list[str]]) -> Iterator[dict[str, RunningServer]]:
    """A server for each mode, all running at once, each planning its share of memory, so
    that the measured requests can take turns between them. A GPU host's decode step is
    host-bound and its speed drifts within seconds (an H200 server's 16-row step moved
    from 10 to 15 ms between two batches a second apart), so modes measured one server
    after another compared the host's moments as much as the modes."""
    share = ["--memory-share", str(1 / len(flags))]
    with contextlib.ExitStack() as stack:
        yield {mode: stack.enter_context(running(
                   RADIX, model, env, logs / f"{workload}-{mode}.log", [*mode_flags, *share]))
               for mode, mode_flags in flags.items()}


def turned(modes: list[str], number: int) -> list[str]:
    """The order the modes take their turns in round `number`: each goes first in turn."""
    start = number % len(modes)
    return modes[start:] + modes[:start]


def add_counts(total: dict[str, float], before: dict[str, float],
               after: dict[str, float]) -> None:
    """Add to `total` what each counter grew by from `before` to `after`."""
    for name, value in after.items():
        total[name] = total.get(name, 0.0) + value - before.get(name, 0.0)


def spec_no_repeat(model: Path, shapes: Shapes, env: dict[str, str], logs: Path,
                   seed: int) -> dict:
    """Each workload on off's and auto's servers at once (`side_by_side`), after a run of
    other prompts on each, then `spec_rounds` rounds of new prompts taking turns; the
    ratio is the median of each round's auto against off's."""
    result: dict = {}
    flags = {mode: ["--speculation", mode] for mode in ("off", "auto")}
    for name in ("single_stream", "no_share"):
        workloads = [STANDARD[name](TextSource(model, seed + 5000 + 2 * r), shapes)
                     for r in range(shapes.spec_rounds)]
        warm = STANDARD[name](TextSource(model, seed + 5001), shapes)  # as agent_edit's
        summaries: dict[str, list[dict]] = {mode: [] for mode in flags}
        counters: dict[str, dict[str, float]] = {mode: {} for mode in flags}
        with side_by_side(model, env, logs, name, flags) as servers:
            print(f"  speculation: {name}, off and auto ...", file=sys.stderr, flush=True)
            cold = {mode: report.summarize(asyncio.run(run_workload(
                        server.base_url, warm, RADIX.extra)), 0, None)["output_tok_s"]
                    for mode, server in servers.items()}
            for number, workload in enumerate(workloads):
                for mode in turned(list(servers), number):
                    before = metrics(servers[mode].base_url)
                    run = asyncio.run(run_workload(servers[mode].base_url, workload,
                                                   RADIX.extra))
                    add_counts(counters[mode], before, metrics(servers[mode].base_url))
                    summaries[mode].append(report.summarize(run, 0, None))
        merged = {mode: report.median_summary(summaries[mode]) for mode in flags}
        modes: dict = {mode: {
            "output_tok_s": merged[mode]["output_tok_s"],
            "rounds": [s["output_tok_s"] for s in summaries[mode]],
            "cold_output_tok_s": cold[mode],
            "decode_tok_s": merged[mode].get("decode_tok_s"),
            **acceptance(counters[mode])} for mode in flags}
        modes["ratio"] = statistics.median(
            report.ratio(auto, off) for auto, off in zip(modes["auto"]["rounds"],
                                                         modes["off"]["rounds"]))
        result[name] = modes
        print(f"    {json.dumps(modes)}", file=sys.stderr, flush=True)
    return result


# Each workload's measure, called as (model, shapes, env, logs, seed), in the order they run.
MEASURES = {"agent_edit": agent_edit, "spec_no_repeat": spec_no_repeat}
WORKLOADS = tuple(MEASURES)


def measures(draft_model: str | None) -> dict:
    """MEASURES, agent_edit with `draft_model` (`python -m bench --draft-model`) too."""
    return {**MEASURES, "agent_edit": functools.partial(agent_edit, draft_model=draft_model)}
