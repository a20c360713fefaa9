"""Random-weight Llama models shaped like Llama 3.2 1B, Llama 3.1 8B or SmolLM2-135M, for
GPU runs, or a tiny one for measuring the host's Python on the CPU.

    python -m bench.models DIR --shape llama-1b [--dtype bfloat16] [--seed 0] \
        [--tokenizer-from MODEL_DIR]

The demo tokenizer (a ~4k-token BPE), so the vocabulary is far smaller than the real
models' 128k, unless --tokenizer-from takes another model's tokenizer (and vocabulary
size): the default model's, for a 49k vocabulary as grammar masks meet it, or
`python -m bench.tekken`'s, for a 131k one. Everything
else (hidden size, layers, heads, KV heads, MLP) is the shape's.
Weights are drawn with MLX on the device in the target dtype: an 8B model drawn in numpy
float32 (as `engine.demo_model` does for its small models) would take minutes and 32 GB.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from engine.demo_model import (
    BOS,
    EOS,
    PAD,
    SIZES,
    drawn_parameters,
    model_config,
    tokenizer_config,
    train_tokenizer,
)

SHAPES: dict[str, dict[str, int]] = {
    "llama-1b": {
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 8192,
    },
    "llama-8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
    },
    "smollm2-135m": {
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
    },
    # The demo models' tiny shape: a forward of a few ms on the CPU even at 64 rows, so
    # what a server run costs is its host's Python (the HTTP path, detokenizing, sampling
    # over a real vocabulary), which a GPU pays in full while its step is ~7 ms
    # (bench/server_cpu.py).
    "tiny": {key: value for key, value in SIZES["tiny"].items() if key != "vocab_size"},
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
VOCAB_SIZE = 4096


def build(directory: Path, shape: str, dtype: str = "bfloat16", seed: int = 0,
          tokenizer_from: Path | None = None) -> Path:
    """Write an mlx-lm model directory (replacing `directory`) and return it."""
    import mlx.core as mx
    from mlx_lm.models import llama

    tokenizer = train_tokenizer(VOCAB_SIZE)
    config = {**model_config("llama", "bench", tokenizer), **SHAPES[shape],
              "torch_dtype": dtype}
    if tokenizer_from is not None:
        theirs = json.loads((tokenizer_from / "config.json").read_text())
        config.update({key: theirs[key] for key in ("vocab_size", "bos_token_id",
                                                    "eos_token_id", "pad_token_id")
                       if key in theirs})
    weights = drawn_parameters(llama.Model(llama.ModelArgs.from_dict(config)), seed, dtype)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    mx.save_safetensors(str(directory / "model.safetensors"), weights,
                        metadata={"format": "mlx"})
    files = {
        "config.json": config,
        "tokenizer_config.json": tokenizer_config(tokenizer),
        "special_tokens_map.json": {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD},
    }
    for filename, value in files.items():
        (directory / filename).write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
    (directory / "tokenizer.json").write_text(tokenizer.to_str(pretty=True))
    if tokenizer_from is not None:
        # All of theirs and none of ours: a demo special_tokens_map left beside their
        # tokenizer adds the demo's special tokens to their vocabulary (49155 ids against
        # a 49152-row LM head, which llguidance rightly refuses).
        for filename in TOKENIZER_FILES:
            (directory / filename).unlink(missing_ok=True)
            if (tokenizer_from / filename).exists():
                shutil.copy(tokenizer_from / filename, directory / filename)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16",
                                                                 "float32"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-from", type=Path,
                        help="a model directory whose tokenizer and vocabulary size to use")
    args = parser.parse_args()
    print(build(args.directory, args.shape, args.dtype, args.seed, args.tokenizer_from))


if __name__ == "__main__":
    main()
