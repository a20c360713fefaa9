"""An mlx-lm llama directory (what `python -m bench.models` writes) as a GGUF file, so
llama.cpp's server runs the same weights, shape and tokenizer as the MLX servers.

    python -m bench.gguf_export MODEL_DIR OUT.gguf [--dtype bfloat16|float16|float32]

The GPU benchmark's models are drawn on the device as mlx-lm directories; llama.cpp loads
only GGUF. This writes what llama.cpp's own converter (convert_hf_to_gguf.py) writes for
a llama: the `llama.*` hyperparameters, Q/K rows permuted for its interleaved RoPE, the
byte-level BPE vocabulary with its merges, control tokens and chat template. 2-D weights
in `dtype` (bfloat16 keeps the model's own bits), norms in float32.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType

from engine.gguf import GLOBAL_TENSORS, LAYER_TENSORS, PRE_TOKENIZER_SPLITS

MATRIX_TYPES = {"bfloat16": GGMLQuantizationType.BF16,
                "float16": GGMLQuantizationType.F16,
                "float32": GGMLQuantizationType.F32}
GGUF_NAMES = {mlx: gguf for gguf, mlx in (*LAYER_TENSORS.items(), *GLOBAL_TENSORS.items())}


def gguf_name(name: str) -> str:
    """model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight."""
    stem, _, suffix = name.rpartition(".")
    if stem in GGUF_NAMES:
        return f"{GGUF_NAMES[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest]}.{suffix}"


def interleave_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Q/K rows reordered as llama.cpp's converter does: its llama RoPE rotates adjacent
    pairs, Hugging Face's (and mlx-lm's) the two halves of each head."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def as_stored(value: mx.array, kind: GGMLQuantizationType) -> np.ndarray:
    """A weight as the bytes GGUF stores: bfloat16 as its raw 16 bits (numpy has no
    bfloat16; the float32 of a bfloat16 holds it in its upper half, exactly)."""
    if kind == GGMLQuantizationType.BF16:
        bits = np.array(value.astype(mx.bfloat16).astype(mx.float32)).view(np.uint32)
        return (bits >> 16).astype(np.uint16)
    return np.array(value.astype(mx.float16 if kind == GGMLQuantizationType.F16
                                 else mx.float32))


def pre_tokenizer_name(tokenizer: dict) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for the tokenizer's split regexes (SmolLM2's digits
    then GPT-2's is "smollm"); a tokenizer without splits pre-tokenizes as GPT-2."""
    steps = tokenizer.get("pre_tokenizer") or {}
    steps = steps.get("pretokenizers", [steps])
    splits = tuple(step["pattern"]["Regex"] for step in steps
                   if step.get("type") == "Split" and "Regex" in step.get("pattern", {}))
    return next((name for name, known in PRE_TOKENIZER_SPLITS.items() if known == splits),
                "gpt-2")


def add_hyperparameters(writer: GGUFWriter, config: dict) -> None:
    """The `<arch>.*` keys of an mlx-lm config, as llama.cpp's converter writes them."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_vocab_size(config["vocab_size"])


def add_tokenizer(writer: GGUFWriter, model_dir: Path, config: dict,
                  chat_template: bool = True) -> None:
    """The byte-level BPE of `model_dir`'s tokenizer.json: tokens by id, merges, its
    special added tokens as control tokens, BOS/EOS (a second EOS id as end of turn) and,
    unless told not to, the chat template."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    settings = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = dict(tokenizer["model"]["vocab"])
    special = set()
    for added in tokenizer.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        if added.get("special"):
            special.add(added["content"])
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m
                             for m in tokenizer["model"]["merges"]])
    eos = config["eos_token_id"]
    eos = eos if isinstance(eos, list) else [eos]
    if "bos_token_id" in config:
        writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(eos[0])
    if len(eos) > 1:
        writer.add_eot_token_id(eos[1])
    writer.add_add_bos_token(bool(settings.get("add_bos_token", False)))
    if chat_template and settings.get("chat_template"):
        writer.add_chat_template(settings["chat_template"])


def export(model_dir: Path, out: Path, dtype: str = "bfloat16") -> Path:
    """Write `model_dir` (an mlx-lm llama) to `out` as a GGUF file; returns `out`."""
    config = json.loads((model_dir / "config.json").read_text())
    if config["model_type"] != "llama" or config.get("rope_traditional"):
        raise ValueError(f"{model_dir}: only mlx-lm llama models with split-half RoPE")
    matrix_type = MATRIX_TYPES[dtype]
    writer = GGUFWriter(str(out), "llama")
    add_hyperparameters(writer, config)
    writer.add_file_type({"bfloat16": 32, "float16": 1, "float32": 0}[dtype])  # llama_ftype
    add_tokenizer(writer, model_dir, config)
    weights = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        weights.update(mx.load(str(path)))
    for name in sorted(weights):
        value = weights.pop(name)
        kind = matrix_type if value.ndim == 2 else GGMLQuantizationType.F32
        stored = as_stored(value, kind)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name
                           else "num_key_value_heads"]
            stored = interleave_rope_rows(stored, heads)
        writer.add_tensor(gguf_name(name), stored, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(MATRIX_TYPES))
    args = parser.parse_args()
    print(export(args.model_dir, args.out, args.dtype))


if __name__ == "__main__":
    main()
