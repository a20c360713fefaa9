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

The `4b` size is Gemma 3 4B's real shape (4.3B parameters), random in bfloat16 and drawn by
MLX on its device, for GPU benchmarks at a real model's cost; the demo tokenizer knows the
first 4096 of its 262208 ids.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from engine.demo_model import (
    SIZES,
    drawn_parameters,
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

# The vision side of each size (the language model's is demo_model.SIZES' or REAL's): the
# image's side in pixels after the processor's resize, its patches' side, and the soft
# tokens the patch grid is pooled into (a square number; the grid's side a multiple of its
# root).
VISION: dict[str, dict[str, int]] = {
    "tiny": {"image_size": 32, "patch_size": 4, "image_tokens": 16, "hidden_size": 32,
             "num_hidden_layers": 2, "intermediate_size": 64, "num_attention_heads": 2},
    # Gemma 3's 896-pixel SigLIP at a quarter of the side: 16x16 patches pooled into 64
    # tokens, a tower of 6 layers.
    "bench": {"image_size": 224, "patch_size": 14, "image_tokens": 64, "hidden_size": 384,
              "num_hidden_layers": 6, "intermediate_size": 1536, "num_attention_heads": 6},
    # SigLIP So400m at 896 pixels: 64x64 patches pooled into 256 tokens, as Gemma 3's.
    "4b": {"image_size": 896, "patch_size": 14, "image_tokens": 256, "hidden_size": 1152,
           "num_hidden_layers": 27, "intermediate_size": 4304, "num_attention_heads": 16},
}
# The language side of the real shapes, as google/gemma-3-4b-it's config.json has it:
# the whole vocabulary's rows (the output head's cost), five of every six layers sliding
# over 1024 tokens, linear RoPE scaling on the global ones.
REAL: dict[str, dict] = {
    "4b": {"hidden_size": 2560, "num_hidden_layers": 34, "num_attention_heads": 8,
           "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 10240,
           "vocab_size": 262208, "sliding_window": 1024, "sliding_window_pattern": 6,
           "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
           "max_position_embeddings": 131072},
}
REAL_DTYPE = "bfloat16"
REAL_TOKENIZER_VOCAB = 4096  # the demo tokenizer's ids, the first of a real shape's rows
MAX_POSITION_EMBEDDINGS = 8192
VISION_FAMILIES = ("gemma3", "qwen2_5_vl", "qwen2_vl")
EMBEDDINGS = "language_model.model.embed_tokens.weight"
LM_HEAD = "language_model.lm_head.weight"

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
    snapshots. A real shape (`REAL`, Gemma 3 only) slides as its model does."""
    if size not in VISION:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(VISION)}")
    if family not in VISION_FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {VISION_FAMILIES}")
    if size in REAL and family != "gemma3":
        raise ValueError(f"size {size!r} is Gemma 3's shape: family gemma3 only")
    if sliding_window is not None and (family != "gemma3" or size in REAL):
        raise ValueError("only the Gemma 3 demo sizes take a sliding window")
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
    """An HF-style Gemma 3 config.json of `size`: `vocab_size` rows (the tokenizer's) at
    a demo size, the real model's at a real one."""
    vision = VISION[size]
    if size in REAL:
        shape, dtype = REAL[size], REAL_DTYPE
    else:
        shape, dtype = {
            **SIZES[size], "vocab_size": vocab_size,
            "sliding_window": sliding_window or MAX_POSITION_EMBEDDINGS,
            "sliding_window_pattern": 2 if sliding_window else 1,
            "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        }, "float32"
    text = {
        **shape, "model_type": "gemma3_text", "query_pre_attn_scalar": shape["head_dim"],
        "rms_norm_eps": 1e-6, "mm_tokens_per_image": vision["image_tokens"],
    }
    vision_config = {
        **{key: value for key, value in vision.items() if key != "image_tokens"},
        "model_type": "siglip_vision_model", "layer_norm_eps": 1e-6,
    }
    return {
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text, "vision_config": vision_config,
        "hidden_size": shape["hidden_size"], "vocab_size": shape["vocab_size"],
        "image_token_index": ids[IMAGE], "boi_token_index": ids[BOI],
        "eoi_token_index": ids[EOI], "mm_tokens_per_image": vision["image_tokens"],
        "pad_token_id": ids[PAD], "bos_token_id": ids[BOS],
        "eos_token_id": [ids[EOS], ids[END_OF_TURN]], "torch_dtype": dtype,
    }


def gemma3_model(config: dict):
    """mlx-vlm's Gemma 3 of the config.json `config`, with MLX's initial parameters, not
    yet computed (MLX is lazy): their names and shapes cost nothing."""
    from mlx_vlm.models import gemma3

    fields = gemma3.ModelConfig.__dataclass_fields__
    return gemma3.Model(gemma3.ModelConfig(
        text_config=gemma3.TextConfig.from_dict(config["text_config"]),
        vision_config=gemma3.VisionConfig.from_dict(config["vision_config"]),
        **{key: value for key, value in config.items()
           if key in fields and not key.endswith("_config")}))


def _write_model(directory: Path, size: str, seed: int, sliding_window: int | None) -> None:
    import mlx.core as mx

    tokenizer = train_tokenizer(
        REAL_TOKENIZER_VOCAB if size in REAL else SIZES[size]["vocab_size"], SPECIAL_TOKENS)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    config = model_config(size, tokenizer.get_vocab_size(), ids, sliding_window)
    model = gemma3_model(config)
    # Gemma ties its output head to the embeddings and scales them by sqrt(hidden): at
    # the demo models' gain the residual stream is the input token's embedding and greedy
    # output repeats it. Scaled down by as much, the layers (and the image) decide.
    gain = math.sqrt(config["text_config"]["hidden_size"])
    if size in REAL:
        weights = drawn_parameters(model, seed, REAL_DTYPE)
        del weights[LM_HEAD]
        # The rows past the tokenizer's ids are zero: their logits are 0 where the
        # tokenizer's thousands spread around 0, so greedy decoding (the benchmarks')
        # picks ids the tokenizer can decode. So are the image markers' rows: a reply
        # that wrote one would come back in the next turn as an image without a file.
        known, embeddings = tokenizer.get_vocab_size(), weights[EMBEDDINGS]
        kept = mx.ones((embeddings.shape[0], 1), dtype=embeddings.dtype)
        kept[mx.array([ids[BOI], ids[IMAGE], ids[EOI]])] = 0
        weights[EMBEDDINGS] = mx.concatenate(
            [embeddings[:known] / gain, mx.zeros_like(embeddings[known:])]) * kept
    else:
        drawn = random_parameters(model, seed)
        del drawn[LM_HEAD]
        drawn[EMBEDDINGS] /= np.float32(gain)
        weights = {name: mx.array(value) for name, value in drawn.items()}
    mx.save_safetensors(str(directory / "model.safetensors"), dict(sorted(weights.items())),
                        metadata={"format": "mlx"})
    write_json(directory / "config.json", config)
    write_json(directory / "tokenizer_config.json",
               _tokenizer_config(tokenizer, config["text_config"]["max_position_embeddings"]))
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


def _tokenizer_config(tokenizer, max_length: int) -> dict:
    return {
        "add_bos_token": False, "add_eos_token": False,
        "added_tokens_decoder": special_tokens_decoder(tokenizer, SPECIAL_TOKENS),
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "extra_special_tokens": {"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE},
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "processor_class": "Gemma3Processor", "tokenizer_class": "PreTrainedTokenizerFast",
    }

