"""The server process's CPU per sentence for the H100 classify shape over HTTP (512
sentences in /v1/completions lists of 64, 48-token preamble, 16-token sentences, the
server at --max-batch-size 64), optionally with py-spy recording it (a measurement script
for this folder's README).

    cd CHECKOUT && LD_PRELOAD=.../libblas.so.3 python server_cpu_h100_shape.py MODEL PORT OUT
    (OUT: py-spy's raw output file, or - for none)

Starts `python -m server` from the current directory (the code to measure), sends two
untimed lists, empties the cache, sends the workload twice and prints sentences/s and
the server's user+system CPU per sentence (engine, MLX threads, HTTP, tokenizer threads).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.workloads import Shapes, build_all

SHAPES = Shapes(cl_sentences=512, cl_batch=64, cl_preamble_tokens=48, cl_sentence_tokens=16)


def main() -> None:
    model, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    workload = next(w for w in build_all(Path(model), SHAPES, 0) if w.name == "classify")
    texts = [c.user_turns[0] for c in workload.conversations]
    server = subprocess.Popen(
        [sys.executable, "-m", "server", "--model", model, "--host", "127.0.0.1",
         "--port", str(port), "--disk-cache-bytes", "0", "--max-batch-size", "64"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def cpu_seconds() -> float:
        fields = Path(f"/proc/{server.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    spy = None
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
        if out != "-":
            spy = subprocess.Popen(
                [str(Path(sys.executable).parent / "py-spy"), "record", "-r", "250",
                 "--threads", "-f", "raw", "-o", out, "-p", str(server.pid)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1)
        cpu, wall = cpu_seconds(), time.perf_counter()
        send(texts)
        send(texts)
        wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
        n = 2 * len(texts)
        print(json.dumps({"sentences": n, "sentences_s": round(n / wall, 1),
                          "server_cpu_ms_per_sentence": round(1000 * cpu / n, 2)}))
    finally:
        if spy is not None:
            spy.send_signal(2)
            spy.wait(30)
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
