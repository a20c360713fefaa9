"""GGUF files written the way llama.cpp's converter writes them, from the tiny demo model,
so the converter can be checked against the model the file was made from."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import dequantize, quantize

from engine.demo_model import SPECIAL_TOKENS

# mlx-lm name stem -> GGUF name stem (per layer, then global).
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}
GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                "lm_head": "output"}


def gguf_name(name: str) -> str:
    stem, _, suffix = name.rpartition(".")
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[rest]}.{suffix}"


def demo_variant(model_dir: Path, out: Path, family: str) -> Path:
    """The llama demo model as a qwen2 (q/k/v biases) or qwen3 (q/k norms) model: the same
    weights plus that family's extra tensors, drawn from a fixed seed."""
    config = json.loads((model_dir / "config.json").read_text())
    weights = dict(mx.load(str(model_dir / "model.safetensors")))
    rng = np.random.default_rng(0)
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.self_attn"
        if family == "qwen2":
            for proj in ("q_proj", "k_proj", "v_proj"):
                rows = weights[f"{prefix}.{proj}.weight"].shape[0]
                weights[f"{prefix}.{proj}.bias"] = mx.array(
                    rng.normal(0, 0.5, rows).astype(np.float32))
        else:
            for norm in ("q_norm", "k_norm"):
                weights[f"{prefix}.{norm}.weight"] = mx.array(
                    rng.uniform(0.5, 1.5, config["head_dim"]).astype(np.float32))
    out.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / name).write_bytes((model_dir / name).read_bytes())
    (out / "config.json").write_text(json.dumps(dict(config, model_type=family)))
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


def permute_for_interleaved_rope(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama's Q/K rows."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def write_demo_gguf(
    model_dir: Path,
    path: Path,
    matrix_type: GGMLQuantizationType = GGMLQuantizationType.F32,
    embedding_type: GGMLQuantizationType | None = None,
    architecture: str = "llama",
    chat_template: bool = True,
) -> dict[str, np.ndarray]:
    """Write the demo model in `model_dir` as a GGUF: 2-D weights as `matrix_type` (the
    embedding as `embedding_type`, default the same), norms as F32, its chat template
    unless told not to. Returns what each mlx-lm-named weight holds once read back (after
    quantization and permutation)."""
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in SPECIAL_TOKENS else TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m
                             for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"][0])
    writer.add_eot_token_id(config["eos_token_id"][1])
    writer.add_add_bos_token(False)
    if chat_template:
        writer.add_chat_template(template)

    stored = {}
    for name, value in sorted(mx.load(str(model_dir / "model.safetensors")).items()):
        weight = np.array(value, dtype=np.float32)
        if architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name
                           else "num_key_value_heads"]
            weight = permute_for_interleaved_rope(weight, heads)
        kind = GGMLQuantizationType.F32
        if weight.ndim == 2:
            embedding = name.startswith("model.embed_tokens")
            kind = embedding_type if embedding and embedding_type else matrix_type
        data = quantize(weight, kind)
        writer.add_tensor(gguf_name(name), data, raw_dtype=kind)
        stored[name] = dequantize(data, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


UNSERVABLE = ("not gguf", "truncated", "architecture")


def unservable_gguf(case: str, model_dir: Path, directory: Path) -> tuple[Path, str]:
    """A .gguf file the server must refuse, and the cause its error names."""
    path = directory / "model.gguf"
    if case == "not gguf":
        path.write_text("just text\n")
        return path, "is not a GGUF file"
    if case == "truncated":
        write_demo_gguf(model_dir, directory / "whole.gguf")
        data = (directory / "whole.gguf").read_bytes()
        path.write_bytes(data[: len(data) // 2])
        return path, "is truncated"
    if case == "architecture":
        write_demo_gguf(model_dir, path, architecture="mamba")
        return path, "architecture 'mamba' is not supported"
    raise ValueError(case)
