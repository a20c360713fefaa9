"""How often a partial cache hit changes a greedy answer, by dtype (docs/ARCHITECTURE.md,
"Exact to which bit").

    python bench/experiments/partial-hit-bits/greedy.py [--dtype float32 bfloat16] [--cases 40]

The default model (SmolLM2-135M-Instruct's GGUF, converted to each dtype). Each case
takes a stretch of real text (the repository's docs) as a prompt of n tokens, and a
prefix of it of h tokens. Cold: the prompt fed as the engine feeds a cold one (all but
its last token in one forward, then the last alone), then 32 greedy tokens. Partial hit:
the cache of the prefix as another prompt left it (the prefix and m other tokens in one
forward, trimmed back to h), then the rest of the prompt, its last token alone, and 32
greedy tokens. Prints how many answers part, and the first token where they do.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from engine.gguf import cached_model_dir
from engine.model_source import default_model_file

ANSWER_TOKENS = 32


def greedy(model, cache, rest: list[int]) -> list[int]:
    """Feed `rest` (all but its last token at once, then the last alone) onto `cache`,
    then decode ANSWER_TOKENS greedily."""
    if len(rest) > 1:
        model(mx.array([rest[:-1]]), cache=cache)
    token, out = rest[-1], []
    for _ in range(ANSWER_TOKENS):
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
        token = int(mx.argmax(logits.astype(mx.float32)).item())
        out.append(token)
    return out


def run(dtype: str, cases: int) -> None:
    model, tokenizer = load(str(cached_model_dir(default_model_file(), dtype)))
    root = Path(__file__).resolve().parents[3]
    text = "\n".join(path.read_text() for path in sorted((root / "docs").glob("*.md")))
    tokens = tokenizer.encode(text)
    rng = np.random.default_rng(0)
    parted = []
    for case in range(cases):
        n = int(rng.integers(40, 400))
        start = int(rng.integers(0, len(tokens) - 2 * n - 1000))
        prompt = tokens[start:start + n]
        h = int(rng.integers(8, n - 1))
        other = tokens[start + n + 500:start + n + 500 + int(rng.integers(1, 600))]
        cold = greedy(model, make_prompt_cache(model), prompt)
        cache = make_prompt_cache(model)
        model(mx.array([prompt[:h] + other]), cache=cache)
        for layer in cache:
            layer.trim(len(other))
        hit = greedy(model, cache, prompt[h:])
        if hit != cold:
            where = next(i for i, (a, b) in enumerate(zip(cold, hit)) if a != b)
            parted.append((case, n, h, len(other), where))
    print(f"{dtype}: {len(parted)} of {cases} answers parted "
          f"(case, prompt, prefix, other tokens, first token that differs): {parted}",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--cases", type=int, default=40)
    args = parser.parse_args()
    for dtype in args.dtype:
        run(dtype, args.cases)


if __name__ == "__main__":
    main()
