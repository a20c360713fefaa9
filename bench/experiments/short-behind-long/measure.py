"""A short chat sent 0.5 s after a long document's chat: each one's time to its first
token and to its end, as JSON. With `busy`, a completion decodes 200 tokens meanwhile
(the document 1 s after it, the chat 1.5 s); without, both reach an idle server.

    python bench/experiments/short-behind-long/measure.py http://127.0.0.1:8000 [busy]
"""

import json
import sys
import threading
import time

import httpx

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota",
         "kappa", "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau",
         "upsilon", "phi", "chi", "psi", "omega", "river", "stone", "cloud", "lantern",
         "meadow", "copper", "violin"]
# ~2,500 tokens on SmolLM2's tokenizer; the time in front makes each run's document new.
DOCUMENT = " ".join(WORDS[(i * 7) % len(WORDS)] + str(i % 97) for i in range(700))


def main() -> None:
    url, busy = sys.argv[1], sys.argv[2:] == ["busy"]
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    times: dict[str, float] = {}

    def send(name: str, path: str, body: dict, after: float) -> None:
        time.sleep(after)
        started = time.monotonic()
        body = {"model": model, "stream": True, "temperature": 0, **body}
        with httpx.stream("POST", url + path, timeout=600, json=body) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {") or name in times:
                    continue
                choices = json.loads(line[6:])["choices"]
                if choices and (choices[0].get("delta", {}).get("content")
                                or choices[0].get("text")):
                    times[name] = round(time.monotonic() - started, 2)
        times[name + "_total"] = round(time.monotonic() - started, 2)

    def chat(text: str) -> dict:
        return {"messages": [{"role": "user", "content": text}], "max_tokens": 8}

    sends = [("document", "/v1/chat/completions",
              chat(f"{time.time()} Summarize this text: {DOCUMENT}"), 1.0 if busy else 0.0),
             ("short", "/v1/chat/completions", chat(f"Say hello. {time.time()}"),
              1.5 if busy else 0.5)]
    if busy:
        sends.append(("busy", "/v1/completions", {"prompt": "Count:", "max_tokens": 200,
                                                  "ignore_eos": True}, 0.0))
    threads = [threading.Thread(target=send, args=args) for args in sends]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps(times))


if __name__ == "__main__":
    main()
