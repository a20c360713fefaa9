"""The server process's CPU time per sentence of the classify lists, over HTTP (a
measurement script for this folder's README).

    cd CHECKOUT && LD_PRELOAD=.../libblas.so.3 python server_cpu.py MODEL_DIR PORT [--h100]

Starts `python -m server` from the current directory (the code to measure), sends two
untimed lists, empties the cache, then sends the workload's lists one after another (the
default shapes: 128 sentences in lists of 32) and prints one JSON object: sentences/s
and the server's user+system CPU per sentence (its engine, its MLX threads, HTTP).
`--h100` (for ../classify-host2): the H100's shape instead (512 sentences in lists of
64, 48-token preamble, 16-token sentences, the server at --max-batch-size 64), sent twice.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.workloads import Shapes, build_all


def main() -> None:
    model, port = sys.argv[1], int(sys.argv[2])
    h100 = sys.argv[3:] == ["--h100"]
    shapes = Shapes(cl_sentences=512, cl_batch=64, cl_preamble_tokens=48,
                    cl_sentence_tokens=16) if h100 else Shapes()
    workload = next(w for w in build_all(Path(model), shapes, 0) if w.name == "classify")
    texts = [c.user_turns[0] for c in workload.conversations] * (2 if h100 else 1)
    server = subprocess.Popen(
        [sys.executable, "-m", "server", "--model", model, "--host", "127.0.0.1",
         "--port", str(port), "--disk-cache-bytes", "0",
         *(["--max-batch-size", "64"] if h100 else [])],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def cpu_seconds() -> float:
        fields = Path(f"/proc/{server.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    try:
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
        for _ in range(600):
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

        def send(items: list[str]) -> None:
            for start in range(0, len(items), workload.batch):
                response = client.post("/v1/completions", json={
                    "prompt": items[start:start + workload.batch], "max_tokens": 1,
                    "temperature": 0, "ignore_eos": True})
                response.raise_for_status()

        send(texts[:2 * workload.batch])
        client.delete("/admin/cache").raise_for_status()
        cpu, wall = cpu_seconds(), time.perf_counter()
        send(texts)
        wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
        print(json.dumps({"sentences": len(texts), "sentences_s": round(len(texts) / wall, 2),
                          "server_cpu_ms_per_sentence": round(1000 * cpu / len(texts), 1)}))
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
