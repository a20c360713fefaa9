"""How far a prompt's first logits move with how its last token is fed (issue 36).

    python last_bits.py MODEL_DIR

For 30 random prompts of 20-300 tokens: the largest logit difference between the last
token fed with the whole prompt and fed alone after it (a repeat's way), and between two
chunkings that both feed it alone (a partial hit against its cold prompt); and how often
the argmax differs.
"""

import sys

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache


def last_logits(model, prompt: list[int], cuts: list[int]) -> mx.array:
    """The prompt's last position's logits, fed in chunks ending at `cuts`."""
    cache, logits, start = make_prompt_cache(model), None, 0
    for end in cuts:
        logits = model(mx.array([prompt[start:end]]), cache=cache)[0, -1]
        start = end
    return logits.astype(mx.float32)


def main(path: str) -> None:
    model, tokenizer = load(path)
    rng = np.random.default_rng(0)
    worst = {"with the chunk": 0.0, "two chunkings, alone": 0.0}
    flips = dict.fromkeys(worst, 0)
    for _ in range(30):
        n = int(rng.integers(20, 300))
        prompt = rng.integers(100, min(tokenizer.vocab_size, 20000), n).tolist()
        whole = last_logits(model, prompt, [n])
        alone = last_logits(model, prompt, [n - 1, n])
        partial = last_logits(model, prompt, [n // 2, n - 1, n])
        for name, a, b in (("with the chunk", whole, alone),
                           ("two chunkings, alone", alone, partial)):
            worst[name] = max(worst[name], mx.abs(a - b).max().item())
            flips[name] += int(mx.argmax(a).item() != mx.argmax(b).item())
    for name, difference in worst.items():
        print(f"{name}: max |logit difference| {difference:.1e}, argmax differs {flips[name]}/30")


if __name__ == "__main__":
    main(sys.argv[1])
