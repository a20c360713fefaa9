"""Deterministic demo vision-language models: Gemma 3's, Qwen2.5-VL's or Qwen2-VL's shape
from mlx-vlm's own classes, small and random (the demo text models' sizes), with a real
BPE tokenizer and the family's processor files.

No VLM ships on PyPI and the tests cannot reach a model hub, so the image path (mlx-vlm's
processor and vision tower, our radix keys, the language model on our batched cache) is
tested on these. Every Gemma layer is global (`sliding_window_pattern` 1) unless a sliding
window is asked for, so its language model keeps plain KV caches, as the demo llama does;
with one, half its layers slide and its cache is reused as snapshots at message ends, as
the real Gemma 3's is. Qwen-VL places image tokens with 3-D M-RoPE positions and sizes
each image's token run by its pixels (engine/demo_qwen_vl.py, engine/mrope.py).
`mlx_vlm.load` and `mlx_lm.load` both accept each folder.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from engine.demo_model import (
    SIZES,
    random_parameters,
    special_tokens_decoder,
    train_tokenizer,
    write_json,
)
from engine.demo_qwen_vl import write_qwen_vl
from engine.files import publish_directory

BOS, EOS, PAD = "<bos>", "<eos>", "<pad>"
START_OF_TURN, END_OF_TURN = "<start_of_turn>", "<end_of_turn>"
BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
SPECIAL_TOKENS = [PAD, EOS, BOS, START_OF_TURN, END_OF_TURN, BOI, IMAGE, EOI]

# The vision side of each size (the language model's is demo_model.SIZES'): the image's
# side in pixels after the processor's resize, its patches' side, and the soft tokens the
# patch grid is pooled into (a square number; the grid's side a multiple of its root).
VISION: dict[str, dict[str, int]] = {
    "tiny": {"image_size": 32, "patch_size": 4, "image_tokens": 16, "hidden_size": 32,
             "num_hidden_layers": 2, "intermediate_size": 64, "num_attention_heads": 2},
    # Gemma 3's 896-pixel SigLIP at a quarter of the side: 16x16 patches pooled into 64
    # tokens, a tower of 6 layers.
    "bench": {"image_size": 224, "patch_size": 14, "image_tokens": 64, "hidden_size": 384,
              "num_hidden_layers": 6, "intermediate_size": 1536, "num_attention_heads": 6},
}
MAX_POSITION_EMBEDDINGS = 8192
VISION_FAMILIES = ("gemma3", "qwen2_5_vl", "qwen2_vl")
EMBEDDINGS = "language_model.model.embed_tokens.weight"

# Gemma 3's template, cut to what the demo needs: the system prompt folded into the first
# user turn, image parts as the start-of-image placeholder the processor expands.
CHAT_TEMPLATE = r"""
{{- bos_token }}
{%- macro render(content) %}
    {%- if content is string %}
        {{- content | trim }}
    {%- else %}
        {%- for part in content %}
            {%- if part.type == 'image' %}
                {{- '<start_of_image>' }}
            {%- elif part.type == 'text' %}
                {{- part.text | trim }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- if messages and messages[0].role == 'system' %}
    {%- set prefix = render(messages[0].content) + '\n\n' %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set prefix = '' %}
{%- endif %}
{%- for message in messages %}
    {%- set role = 'model' if message.role == 'assistant' else message.role %}
    {{- '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') }}
    {{- render(message.content) + '<end_of_turn>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\n' }}
{%- endif %}
"""


def build_demo_vlm(path: str | Path, size: str = "tiny", seed: int = 0,
                   sliding_window: int | None = None, family: str = "gemma3") -> Path:
    """Write the demo VLM of `family` (one of `VISION_FAMILIES`) and `size` to `path`,
    replacing whatever was there. With a `sliding_window` (Gemma 3 only), every second
    layer slides, as Gemma 3's five in six do: its cache is reused as whole-state
    snapshots."""
    if size not in VISION:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(VISION)}")
    if family not in VISION_FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {VISION_FAMILIES}")
    if sliding_window is not None and family != "gemma3":
        raise ValueError("only the Gemma 3 demo has sliding layers")
    path = Path(path)
    if family == "gemma3":
        def write(staging: Path) -> None:
            _write_model(staging, size, seed, sliding_window)
    else:
        def write(staging: Path) -> None:
            write_qwen_vl(staging, family, size, seed)
    publish_directory(path, write, replace=True)
    return path


def model_config(size: str, vocab_size: int, ids: dict[str, int],
                 sliding_window: int | None = None) -> dict:
    """An HF-style Gemma 3 config.json of `size`."""
    shape, vision = SIZES[size], VISION[size]
    text = {
        **shape, "model_type": "gemma3_text", "vocab_size": vocab_size,
        "query_pre_attn_scalar": shape["head_dim"], "rms_norm_eps": 1e-6,
        "sliding_window": sliding_window or MAX_POSITION_EMBEDDINGS,
        "sliding_window_pattern": 2 if sliding_window else 1,
        "mm_tokens_per_image": vision["image_tokens"],
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
    }
    vision_config = {
        **{key: value for key, value in vision.items() if key != "image_tokens"},
        "model_type": "siglip_vision_model", "layer_norm_eps": 1e-6,
    }
    return {
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text, "vision_config": vision_config,
        "hidden_size": shape["hidden_size"], "vocab_size": vocab_size,
        "image_token_index": ids[IMAGE], "boi_token_index": ids[BOI],
        "eoi_token_index": ids[EOI], "mm_tokens_per_image": vision["image_tokens"],
        "pad_token_id": ids[PAD], "bos_token_id": ids[BOS],
        "eos_token_id": [ids[EOS], ids[END_OF_TURN]], "torch_dtype": "float32",
    }


def _write_model(directory: Path, size: str, seed: int, sliding_window: int | None) -> None:
    import mlx.core as mx
    from mlx_vlm.models import gemma3

    tokenizer = train_tokenizer(SIZES[size]["vocab_size"], SPECIAL_TOKENS)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    config = model_config(size, tokenizer.get_vocab_size(), ids, sliding_window)
    fields = gemma3.ModelConfig.__dataclass_fields__
    model = gemma3.Model(gemma3.ModelConfig(
        text_config=gemma3.TextConfig.from_dict(config["text_config"]),
        vision_config=gemma3.VisionConfig.from_dict(config["vision_config"]),
        **{key: value for key, value in config.items()
           if key in fields and not key.endswith("_config")}))
    weights = random_parameters(model, seed)
    # Gemma ties its output head to the embeddings and scales them by sqrt(hidden): at
    # the demo models' gain the residual stream is the input token's embedding and greedy
    # output repeats it. Scaled down by as much, the layers (and the image) decide.
    del weights["language_model.lm_head.weight"]
    weights[EMBEDDINGS] /= np.float32(math.sqrt(SIZES[size]["hidden_size"]))
    mx.save_safetensors(str(directory / "model.safetensors"),
                        {name: mx.array(value) for name, value in sorted(weights.items())},
                        metadata={"format": "mlx"})
    write_json(directory / "config.json", config)
    write_json(directory / "tokenizer_config.json", _tokenizer_config(tokenizer))
    (directory / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    write_json(directory / "preprocessor_config.json", {
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "size": {"height": VISION[size]["image_size"], "width": VISION[size]["image_size"]},
        "resample": 2,
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True, "do_pan_and_scan": False,
    })
    write_json(directory / "processor_config.json", {
        "processor_class": "Gemma3Processor",
        "image_seq_length": VISION[size]["image_tokens"]})


def _tokenizer_config(tokenizer) -> dict:
    return {
        "add_bos_token": False, "add_eos_token": False,
        "added_tokens_decoder": special_tokens_decoder(tokenizer, SPECIAL_TOKENS),
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "extra_special_tokens": {"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE},
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "processor_class": "Gemma3Processor", "tokenizer_class": "PreTrainedTokenizerFast",
    }

