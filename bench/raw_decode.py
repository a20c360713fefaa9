"""Single-stream decode speed of bare `mlx_lm.stream_generate`, the engine-overhead baseline.

    python -m bench.raw_decode MODEL_DIR --prompt-tokens 64 --max-tokens 128 --repeats 3
    python -m bench.raw_decode MODEL_DIR --messages-file CHATS.json --max-tokens 256

The second form decodes each chat of the file (a JSON list of message lists) once,
through the model's chat template, greedy, ending at EOS, and reports each one's text too
(the speculation workloads compare it with the server's).

Runs in its own process (started by the benchmark after the servers have stopped) and
prints one JSON object. Timed like the servers' streams: from the first token to the last,
so prefill is excluded and the rate is (tokens - 1) / seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load, stream_generate


def decode_rate(model, tokenizer, prompt: list[int], max_tokens: int
                ) -> tuple[float, int, str]:
    first = last = None
    count = 0
    text = ""
    for response in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        last = time.perf_counter()
        first = first or last
        count += 1
        text += response.text
    return (count - 1) / (last - first), count, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--messages-file", type=Path)
    args = parser.parse_args()
    model, tokenizer = load(args.model)
    vocab = tokenizer.vocab_size
    prompt = [(7 * i + 11) % vocab for i in range(args.prompt_tokens)]
    decode_rate(model, tokenizer, prompt, 8)  # compile kernels before timing
    if args.messages_file:
        prompts = [tokenizer.apply_chat_template(messages, add_generation_prompt=True)
                   for messages in json.loads(args.messages_file.read_text())]
    else:
        prompts = [prompt] * args.repeats
    runs = [decode_rate(model, tokenizer, p, args.max_tokens) for p in prompts]
    print(json.dumps({
        "decode_tok_s": statistics.median(rate for rate, _, _ in runs),
        "runs": [{"decode_tok_s": rate, "tokens": count,
                  **({"text": text} if args.messages_file else {})}
                 for rate, count, text in runs],
        "device": str(mx.default_device()),
        "peak_memory_bytes": mx.get_peak_memory(),
    }))


if __name__ == "__main__":
    main()
