"""OpenAI's Predicted Outputs against the speculation the server has without them, on the
benchmark's agent edit (bench/speculation.py: a ~1.2k-token Python file asked back with
one function renamed), one request at a time, greedy.

    python bench/experiments/predicted-outputs/measure.py MODEL_DIR [--rounds 3]

One server at its defaults (speculation off); per round, for each of 3 edits, these
modes in turn, the tree emptied before every request (a hit on an earlier answer would
be its own draft source):
- `off`: no prediction;
- `prediction`: the file as the request's `prediction` (auto mode, the server's sources
  behind it: prompt lookup, the tree);
- `on`: `"speculation": "on"`, no prediction (prompt lookup finds the file in the prompt);
- `on+prediction`: both.
Prints each mode's median decode tok/s (first token to last), its ratio to off, and
the prediction's accepted and rejected tokens; every mode's text must be off's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
from pathlib import Path

import httpx

from bench.client import TIMEOUT, Connection, chat
from bench.servers import RADIX, running
from bench.speculation import code_file, edit
from bench.workloads import TextSource

MODES = {"off": {}, "prediction": {"prediction": True},
         "on": {"speculation": "on"}, "on+prediction": {"speculation": "on", "prediction": True}}


async def one(base_url: str, messages: list[dict], file: str, mode: dict,
              max_tokens: int) -> dict:
    extra = {key: value for key, value in mode.items() if key != "prediction"}
    if mode.get("prediction"):
        extra["prediction"] = {"type": "content", "content": file}
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        await client.delete(f"{base_url}/admin/cache")
    async with Connection(base_url) as connection:
        ttft, latency, usage, text = await chat(connection, messages, max_tokens, extra)
    tokens = usage["completion_tokens"]
    details = usage.get("completion_tokens_details") or {}
    return {"decode_tok_s": (tokens - 1) / (latency - ttft), "text": text,
            "accepted": details.get("accepted_prediction_tokens", 0),
            "rejected": details.get("rejected_prediction_tokens", 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--file-tokens", type=int, default=1200)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--logs", type=Path, default=None,
                        help="keep the server's log (its access lines: accept=, tok/step=) here")
    args = parser.parse_args()
    file, names = code_file(TextSource(args.model, 4000), args.file_tokens)
    edits = [edit(file, name, f"{name}_v2") for name in names[1:4]]
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as scratch, running(
            RADIX, args.model, dict(os.environ),
            (args.logs or Path(scratch)) / "server.log") as server:
        asyncio.run(one(server.base_url, edits[0], file, {}, 8))  # untimed
        for _ in range(args.rounds):
            for messages in edits:
                for mode, options in MODES.items():
                    runs[mode].append(asyncio.run(one(server.base_url, messages, file,
                                                      options, args.max_tokens)))
    off = statistics.median(r["decode_tok_s"] for r in runs["off"])
    result = {}
    for mode, done in runs.items():
        rate = statistics.median(r["decode_tok_s"] for r in done)
        result[mode] = {
            "decode_tok_s": round(rate, 2), "vs_off": round(rate / off, 2),
            "accepted_prediction_tokens": sum(r["accepted"] for r in done),
            "rejected_prediction_tokens": sum(r["rejected"] for r in done),
            "identical_to_off": sum(r["text"] == o["text"] for r, o in zip(done, runs["off"])),
            "requests": len(done)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
