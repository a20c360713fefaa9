"""Other rounding formats for `--kv-bits 8`'s greedy identity: the 32 identity chats of
bench/kv_quant.py (SmolLM2-135M, float32, CPU), every KV write rounded two round trips as
the server rounds it, in mlx's affine format at group 64 (float32 or bfloat16 scales) and
32, and in mxfp8 (e4m3 values, a power-of-two scale per 32: 8.25 bits a value); how many
answers of 32 tokens equal the unquantized ones.

    python bench/experiments/kv-quant-formats/formats.py ["VARIANT;..."]
"""

import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm import load

from bench.kv_quant import identity_chats
from engine.model_source import resolve_model

sys.path.insert(0, str(Path(__file__).parents[1] / "kv-quant-rotation"))
from greedy import Rounded, diverged_at, greedy


def trip(mode, bits, g, dtype, cast=mx.float32):
    def once(x):
        if mode == "affine":
            q = mx.quantize(x.astype(cast), group_size=g, bits=bits)
            return mx.dequantize(*q, group_size=g, bits=bits).astype(dtype)
        q, s = mx.quantize(x.astype(cast), mode=mode)
        return mx.dequantize(q, s, mode=mode).astype(dtype)

    return lambda x: once(once(x))


def main():
    model_dir = resolve_model(None)
    model, tok = load(model_dir)
    dtype = mx.float32
    model.set_dtype(dtype)
    prompts = [
        tok.apply_chat_template(c, add_generation_prompt=True)
        for c in identity_chats(Path(model_dir), 0)
    ]
    base = [greedy(model, p, lambda l: l) for p in prompts]
    variants = {
        "affine8 g64 f32": trip("affine", 8, 64, dtype),
        "affine8 g64 bf16": trip("affine", 8, 64, dtype, mx.bfloat16),
        "affine8 g32 f32": trip("affine", 8, 32, dtype),
        "mxfp8": trip("mxfp8", 8, 32, dtype),
        "mxfp8 bf16in": trip("mxfp8", 8, 32, dtype, mx.bfloat16),
        "mxfp4": trip("mxfp4", 4, 32, dtype),
        "nvfp4": trip("nvfp4", 4, 16, dtype),
        "affine4 g64 f32": trip("affine", 4, 64, dtype),
    }
    for name in sys.argv[1].split(";") if len(sys.argv) > 1 else variants:
        r = variants[name]
        found = [greedy(model, p, lambda layer, r=r: Rounded(layer, r, r)) for p in prompts]
        eq = sum(a == b for a, b in zip(found, base))
        parted = sorted(diverged_at(a, b) for a, b in zip(found, base) if a != b)
        print(f"{name}: {eq}/32 equal; parted at {parted}", flush=True)


main()
