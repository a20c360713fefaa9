"""The agent edit's concurrent edits through HTTP with speculation off and on, the engine
in the server's process (the default) and in its own (`--engine-process true`): the four
servers side by side, taking turns over rounds of new files. Whether the server's
per-token work, which shares the GIL with the engine's thread, keeps a batch's verifies
from paying. On an H200 it did not: `on` / off 0.995x in process and 0.95x in an engine
process, and off through HTTP within 10% of the engine in process
(bench/results/nvidia-h200/speculation-smollm2/probes-2026-12-02).

    python bench/experiments/speculation-engine/http_paths.py MODEL_DIR [--rounds 3]

Prints one JSON object: per server, output tok/s of each round's batch and the median,
and per path the median of the rounds' on/off ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
from pathlib import Path

from bench.speculation import agent_requests, side_by_side, together, turned
from bench.workloads import Shapes, TextSource
from engine.platform_info import cpu_reexec_env

PROCESS = ["--engine-process", "true"]
FLAGS = {"off": ["--speculation", "off"], "on": ["--speculation", "on"],
         "off, engine process": ["--speculation", "off", *PROCESS],
         "on, engine process": ["--speculation", "on", *PROCESS]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shapes = Shapes()
    _, warm = agent_requests(TextSource(args.model, args.seed + 4001), shapes)
    rounds = [agent_requests(TextSource(args.model, args.seed + 4000 + 2 * r), shapes)[1]
              for r in range(args.rounds)]
    rates: dict[str, list[float]] = {name: [] for name in FLAGS}
    env = cpu_reexec_env() or dict(os.environ)
    with tempfile.TemporaryDirectory() as logs, side_by_side(
            args.model, env, Path(logs), "http_paths", FLAGS) as servers:
        for server in servers.values():  # kernels, and the shapes a batch meets
            asyncio.run(together(server.base_url, warm, shapes.ae_stream_output_tokens))
        for number, streams in enumerate(rounds):
            for name in turned(list(servers), number):
                batch = asyncio.run(together(servers[name].base_url, streams,
                                             shapes.ae_stream_output_tokens))
                rates[name].append(batch["output_tok_s"])
    ratios = {path: statistics.median(on / off for on, off in zip(
                  rates[f"on{suffix}"], rates[f"off{suffix}"]))
              for path, suffix in (("in process", ""),
                                   ("engine process", ", engine process"))}
    print(json.dumps({"streams": shapes.ae_streams, "rounds": rates,
                      "medians": {n: statistics.median(r) for n, r in rates.items()},
                      "on / off": ratios}, indent=1))


if __name__ == "__main__":
    main()
