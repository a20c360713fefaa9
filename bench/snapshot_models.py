"""Models whose cache is reused only as whole-state snapshots, on shared-prefix work.

A sliding-window model (gemma3_text: rotating layers beside global attention layers) and
a hybrid one (qwen3_next: gated-delta recurrent layers beside attention), the tiny demo
models of each family, run `shared_prefix` (groups of conversations behind one system
prompt: another conversation hits only where a snapshot was taken at the system
prompt's end) and `multi_turn` (every turn resends the history) on each server, a fresh
start per workload, servers alternating. The point is the share of prompt tokens served
from the cache, which carries over to real models of these families; on models this
small prefill is cheap, so the speed columns say little.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import report
from bench.client import run_workload
from bench.servers import ServerSpec, running
from bench.workloads import Shapes, build_all, build_warm_up

WORKLOADS = ("snapshot_models",)
FAMILIES = ("gemma3_text", "qwen3_next")
MEASURED = ("shared_prefix", "multi_turn")
COLUMNS = (("cache_fraction", "prompt tokens from cache", "{:.0%}"),
           ("output_tok_s", "output tok/s", "{:.1f}"),
           ("ttft_p50", "TTFT p50 (s)", "{:.3f}"),
           ("errors", "failed requests", "{:d}"))


def build_model(family: str, directory: Path, env: dict[str, str]) -> Path:
    """The tiny demo model of `family`, built in a child so this process stays MLX-free."""
    path = directory / f"tiny-{family}-seed0"
    code = ("import sys\nfrom engine.demo_model import build_demo_model\n"
            "build_demo_model(sys.argv[1], family=sys.argv[2])\n")
    subprocess.run([sys.executable, "-c", code, str(path), family], env=env, check=True)
    return path


def run(specs: list[ServerSpec], shapes: Shapes, env: dict[str, str], out: Path,
        seed: int) -> dict:
    """{family: {server: {workload: summary}}}."""
    results: dict = {}
    with tempfile.TemporaryDirectory() as directory:
        for family in FAMILIES:
            model = build_model(family, Path(directory), env)
            warm_up = build_warm_up(model, shapes, seed)
            for workload in (w for w in build_all(model, shapes, seed) if w.name in MEASURED):
                for spec in specs:
                    print(f"bench: {spec.name} on {family}: {workload.name}", file=sys.stderr,
                          flush=True)
                    log = out / "logs" / f"{family}-{spec.name}-{workload.name}.log"
                    with running(spec, model, env, log) as server:
                        asyncio.run(run_workload(server.base_url, warm_up, spec.extra))
                        measured = asyncio.run(
                            run_workload(server.base_url, workload, spec.extra))
                        summary = report.summarize(measured, server.sampler.take_peak(), None)
                    results.setdefault(family, {}).setdefault(spec.name, {})[
                        workload.name] = summary
    return results


def markdown(results: dict) -> str:
    lines = ["# Snapshot-only models: cached share on shared prefixes", "",
             f"- command: `{results['command']}`", f"- git: `{results['git']}`",
             f"- hardware: {hardware(results['hardware'])}", "",
             __doc__.split("\n\n", 1)[1].strip().replace("\n", " "), "",
             "| model | workload | server | " + " | ".join(c[1] for c in COLUMNS) + " |",
             "| --- | --- | --- |" + " ---: |" * len(COLUMNS)]
    for family, servers in results["families"].items():
        for workload in MEASURED:
            for server, summaries in servers.items():
                summary = summaries.get(workload)
                if summary is not None:
                    cells = [report.fmt(summary.get(key), pattern) for key, _, pattern in COLUMNS]
                    lines.append(f"| {family} | {workload} | {server} | " + " | ".join(cells)
                                 + " |")
    return "\n".join(lines) + "\n"


def hardware(described: dict) -> str:
    gpus = ", ".join(described["gpus"])
    return (f"{described['cpu']} ({described['cpu_count']} CPUs)" + (f", {gpus}" if gpus else "")
            + f", {described['platform']}")


def write(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(markdown(results))
