"""Warm long-context questions sent back to back, each as soon as the last one ends, for
a server's step log to show what each one waits for.

    python -m server.launch.cli serve --model M --port 8391 --log-level debug &
    python bench/experiments/long-context-warm/back_to_back.py http://127.0.0.1:8391 30

One ~7,300-token system document (random words and numbers) and a new 40-word question
each time, 4 tokens out, streamed; the server's access log gives each TTFT and its debug
log each engine step (rows, prompt tokens fed, milliseconds).
"""

from __future__ import annotations

import random
import sys

import httpx

WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "paper", "engine",
         "window", "garden", "silver", "market", "number", "yellow", "winter"]


def main() -> None:
    url, count = sys.argv[1], int(sys.argv[2])
    rng = random.Random(0)
    document = " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(2500))
    with httpx.Client(timeout=60) as client:
        model = client.get(url + "/v1/models").json()["data"][0]["id"]
        for _ in range(count):
            question = " ".join(rng.choice(WORDS) for _ in range(40)) + "?"
            body = {"model": model, "max_tokens": 4, "temperature": 0, "stream": True,
                    "messages": [{"role": "system", "content": document},
                                 {"role": "user", "content": question}]}
            with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
                for _ in response.iter_lines():
                    pass


if __name__ == "__main__":
    main()
