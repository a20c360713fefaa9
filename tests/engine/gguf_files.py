"""GGUF files written the way llama.cpp's converter writes them, from the tiny demo model,
so the converter can be checked against the model the file was made from."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from bench.gguf_export import add_hyperparameters, add_tokenizer, gguf_name, interleave_rope_rows
from engine.gguf import build_tokenizer, read_gguf, tokenizer_config


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
    writer = GGUFWriter(str(path), architecture)
    add_hyperparameters(writer, config)
    add_tokenizer(writer, model_dir, config, chat_template=chat_template)

    stored = {}
    for name, value in sorted(mx.load(str(model_dir / "model.safetensors")).items()):
        weight = np.array(value, dtype=np.float32)
        if architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name
                           else "num_key_value_heads"]
            weight = interleave_rope_rows(weight, heads)
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


def write_gguf_tokenizer(gguf_path: Path, directory: Path) -> Path:
    """The tokenizer files of a GGUF's converted model directory, without its weights:
    what mlx-lm's tokenizer loader reads, in seconds rather than a whole conversion."""
    gguf = read_gguf(gguf_path)
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(gguf).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(gguf)))
    return directory
