"""One line for a multi-turn run of radix-mlx: its TTFT p50, output tok/s and TTFT p50 by
turn (ms).

    python3 by_turn.py RESULTS_JSON NAME
"""

import json
import statistics
import sys
from pathlib import Path

server = json.loads(Path(sys.argv[1]).read_text())["servers"]["radix-mlx"]
mt = server["workloads"]["multi_turn"]
turns: dict[int, list[float]] = {}
for request in server["requests"]["multi_turn"]:
    turns.setdefault(request["turn"], []).append(request["ttft"])
by_turn = " ".join(f"{1000 * statistics.median(turns[t]):.0f}" for t in sorted(turns))
print(sys.argv[2], f"ttft p50 {1000 * mt['ttft_p50']:.0f} ms",
      f"tok/s {mt['output_tok_s']:.0f}", "by turn (ms):", by_turn, flush=True)
