"""Typing at the cursor, one completion a keystroke: the fill-in-the-middle order against
the prefix cache. The `bench` demo model (143M, float32) is written twice, once with
Qwen2.5-Coder's fill-in-the-middle tokens (prefix, suffix, middle) and once with
Codestral's (suffix first); a server on each gets the same editing session: a file of
~PREFIX_CHARS characters before the cursor and ~SUFFIX_CHARS after it, then KEYSTROKES
characters typed one by one, each a streamed Completions request with `suffix` (16 tokens
out, greedy), as an editor's autocomplete sends them. Prints, per order, the median TTFT
and prompt tokens computed (prompt - cached) over the keystrokes, as one JSON line each.

    python keystrokes.py OUT_DIR [--keystrokes 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from engine.demo_model import FILL_IN_MIDDLE_TOKENS, build_demo_model
from engine.fill_in_middle import SUFFIX_FIRST

PREFIX_CHARS, SUFFIX_CHARS = 3000, 1500
TYPED = "result = compute(values, limit=10)\n"


def code(chars: int, seed: int) -> str:
    lines, n = [], seed
    while sum(map(len, lines)) < chars:
        n = (n * 1103515245 + 12345) % 2**31
        lines.append(f"    value_{n % 97} = helper_{n % 13}(items[{n % 31}], {n % 7})\n")
    return "".join(lines)


def serve(model: Path, port: int, log: Path) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-m", "server", "--model", str(model), "--port", str(port),
         "--disk-cache-bytes", "0"], stdout=log.open("w"), stderr=subprocess.STDOUT)
    for _ in range(300):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server on {model} did not start")


def keystroke(url: str, model: str, prefix: str, suffix: str) -> tuple[float, int]:
    """TTFT (s) and prompt tokens computed of one completion at the cursor."""
    started, first = time.perf_counter(), None
    body = {"model": model, "prompt": prefix, "suffix": suffix, "max_tokens": 16,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and first is None:
                first = time.perf_counter() - started
            usage = chunk.get("usage") or usage
    return first, usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--keystrokes", type=int, default=20)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    before, after = "def main(values):\n" + code(PREFIX_CHARS, 1), code(SUFFIX_CHARS, 2)
    for order, tokens in (("prefix-suffix-middle", FILL_IN_MIDDLE_TOKENS),
                          ("suffix-first", SUFFIX_FIRST)):
        name = f"bench-{order}"
        model = build_demo_model(args.out / name, size="bench", fill_in_middle=tokens)
        process = serve(model, 8620, args.out / f"{name}.log")
        try:
            url = "http://127.0.0.1:8620"
            keystroke(url, name, before, after)  # the file opened: everything computed
            runs = [keystroke(url, name, before + TYPED[:i], after)
                    for i in range(1, args.keystrokes + 1)]
        finally:
            process.terminate()
            process.wait()
        print(json.dumps({
            "order": order, "keystrokes": len(runs),
            "ttft_p50_s": round(statistics.median(t for t, _ in runs), 4),
            "computed_p50": statistics.median(c for _, c in runs),
            "computed": [c for _, c in runs]}), flush=True)


if __name__ == "__main__":
    main()
