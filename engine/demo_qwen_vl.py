"""The demo Qwen2.5-VL and Qwen2-VL (engine/demo_vlm.py builds them): mlx-vlm's own classes
at the demo sizes, random weights, a ChatML template whose image part is Qwen's
`<|vision_start|><|image_pad|><|vision_end|>`, and the processor settings mlx-vlm's numpy
Qwen processor reads. mlx-lm loads either folder as its `qwen2_vl` language model (a plain
Qwen2 with 1-D RoPE), mlx-vlm as the whole model. The two differ in their vision tower
only (Qwen2.5-VL's windowed attention and RMSNorm); their language side and positions
are the same.
"""

from __future__ import annotations

from pathlib import Path

from engine.demo_model import (
    SIZES,
    random_parameters,
    special_tokens_decoder,
    train_tokenizer,
    write_json,
)

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
VISION_PAD, IMAGE_PAD, VIDEO_PAD = "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END, VISION_START, VISION_END, VISION_PAD, IMAGE_PAD,
                  VIDEO_PAD]
MAX_POSITION_EMBEDDINGS = 8192

# The vision tower of each size: patches of `patch_size` pixels, merged 2x2 into one token,
# and the most pixels an image is resized to (so a 40x48 test image gives 12 tokens at
# tiny, and images of other shapes other counts, as the real processor's do).
VISION: dict[str, dict[str, int]] = {
    "tiny": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
             "patch_size": 4, "window_size": 16, "max_pixels": 32 * 32},
    "bench": {"depth": 6, "hidden_size": 384, "intermediate_size": 1536, "num_heads": 6,
              "patch_size": 14, "window_size": 112, "max_pixels": 224 * 224},
}
MERGE_SIZE = 2

CHAT_TEMPLATE = r"""
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\n' }}
    {%- if message.content is string %}
        {{- message.content }}
    {%- else %}
        {%- for part in message.content %}
            {%- if part.type == 'image' %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif part.type == 'text' %}
                {{- part.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""


def hf_config(model_type: str, size: str, vocab_size: int, ids: dict[str, int]) -> dict:
    """An HF-style config.json of `model_type` ("qwen2_5_vl" or "qwen2_vl") and `size`:
    the text settings at the top level, as Qwen's checkpoints have them."""
    shape = SIZES[size]
    quarter = shape["head_dim"] // 8  # M-RoPE's (t, h, w) sections: 2:3:3 of head_dim / 2
    architecture = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                    "qwen2_vl": "Qwen2VLForConditionalGeneration"}[model_type]
    return {
        "model_type": model_type, "architectures": [architecture],
        **{key: shape[key] for key in ("hidden_size", "num_hidden_layers",
                                       "intermediate_size", "num_attention_heads",
                                       "num_key_value_heads")},
        "vocab_size": vocab_size, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS, "tie_word_embeddings": True,
        "rope_scaling": {"type": "mrope", "mrope_section": [2 * quarter, 3 * quarter,
                                                            3 * quarter]},
        "vision_config": _vision_config(model_type, size),
        "image_token_id": ids[IMAGE_PAD], "video_token_id": ids[VIDEO_PAD],
        "vision_start_token_id": ids[VISION_START], "vision_end_token_id": ids[VISION_END],
        "vision_token_id": ids[VISION_PAD], "pad_token_id": ids[PAD],
        "bos_token_id": ids[PAD], "eos_token_id": [ids[IM_END], ids[PAD]],
        "torch_dtype": "float32",
    }


def _vision_config(model_type: str, size: str) -> dict:
    """The vision tower's config: Qwen2.5-VL's names its width `hidden_size` and its output
    `out_hidden_size`, Qwen2-VL's `embed_dim` and `hidden_size`."""
    vision, text_width = VISION[size], SIZES[size]["hidden_size"]
    common = {"model_type": model_type, "depth": vision["depth"],
              "num_heads": vision["num_heads"], "patch_size": vision["patch_size"],
              "spatial_merge_size": MERGE_SIZE, "temporal_patch_size": 2, "in_channels": 3}
    if model_type == "qwen2_vl":
        return {**common, "embed_dim": vision["hidden_size"], "hidden_size": text_width,
                "mlp_ratio": vision["intermediate_size"] // vision["hidden_size"]}
    return {**common, "hidden_size": vision["hidden_size"], "out_hidden_size": text_width,
            "intermediate_size": vision["intermediate_size"],
            "window_size": vision["window_size"],
            "fullatt_block_indexes": [vision["depth"] - 1]}


def write_qwen_vl(directory: Path, model_type: str, size: str, seed: int) -> None:
    import importlib

    import mlx.core as mx

    family = importlib.import_module(f"mlx_vlm.models.{model_type}")
    tokenizer = train_tokenizer(SIZES[size]["vocab_size"], SPECIAL_TOKENS)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    config = hf_config(model_type, size, tokenizer.get_vocab_size(), ids)
    model_config = family.ModelConfig.from_dict(dict(config))  # copies the text settings
    model_config.text_config = family.TextConfig.from_dict(model_config.text_config)
    model_config.vision_config = family.VisionConfig.from_dict(config["vision_config"])
    model = family.Model(model_config)
    weights = random_parameters(model, seed)
    mx.save_safetensors(str(directory / "model.safetensors"),
                        {name: mx.array(value) for name, value in sorted(weights.items())},
                        metadata={"format": "mlx"})
    write_json(directory / "config.json", config)
    write_json(directory / "tokenizer_config.json", _tokenizer_config(tokenizer))
    (directory / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    patch = VISION[size]["patch_size"]
    write_json(directory / "preprocessor_config.json", {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "patch_size": patch, "merge_size": MERGE_SIZE, "temporal_patch_size": 2,
        "min_pixels": (patch * MERGE_SIZE) ** 2, "max_pixels": VISION[size]["max_pixels"],
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "do_convert_rgb": True,
    })


def _tokenizer_config(tokenizer) -> dict:
    return {
        "add_bos_token": False, "add_eos_token": False,
        "added_tokens_decoder": special_tokens_decoder(tokenizer, SPECIAL_TOKENS),
        "bos_token": None, "eos_token": IM_END, "pad_token": PAD,
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "processor_class": "Qwen2_5_VLProcessor", "tokenizer_class": "PreTrainedTokenizerFast",
    }
