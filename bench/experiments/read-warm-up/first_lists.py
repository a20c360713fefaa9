"""A fresh server's first classify lists: does the engine's warm-up take their compiles?

    python bench/experiments/read-warm-up/first_lists.py MODEL_DIR [--warm-up on|off] [--out F]

Starts `radix-mlx serve` on MODEL_DIR, times it to ready, then sends lists of 64
sentences behind one instruction to /v1/classify one at a time, `--repeats` lists of each
sentence length (a read shape is traced the second time it comes, engine/compiled_read.py,
and its fused kernels compile then on a machine that has not met them), and prints each
list's latency. Run it first on a GPU machine that has never run MLX's kernels.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
         "lambda", "mu", "nu", "xi"]
INSTRUCTION = ("Classify the sentiment of the sentence that follows as positive, negative "
               "or neutral, and answer with one word. Sentence: ")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--warm-up", default="on")
    parser.add_argument("--port", type=int, default=8411)
    parser.add_argument("--lengths", type=int, default=3, help="sentence lengths")
    parser.add_argument("--repeats", type=int, default=3, help="lists of each length")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    started = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "server.launch.cli", "serve", "--model",
                               args.model, "--port", str(args.port), "--warm-up", args.warm_up,
                               "--disk-cache-bytes", "0"], env=os.environ)
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None, "the server exited"
            time.sleep(0.05)
        ready = time.perf_counter() - started
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        latencies = []
        for n in range(args.lengths * args.repeats):
            words = 6 + 3 * (n // args.repeats)  # a read width, `repeats` lists in a row
            inputs = [INSTRUCTION + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words))
                      for i in range(64)]
            t = time.perf_counter()
            response = httpx.post(f"{url}/v1/classify", timeout=600, json={
                "model": model, "input": inputs, "top_logprobs": 2})
            assert response.status_code == 200, response.text
            latencies.append(time.perf_counter() - t)
        figures = {"warm_up": args.warm_up, "ready_s": round(ready, 2),
                   "list_latency_ms": [round(1e3 * x, 1) for x in latencies]}
        print(json.dumps(figures))
        if args.out:
            args.out.write_text(json.dumps(figures) + "\n")
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
