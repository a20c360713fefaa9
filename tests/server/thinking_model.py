"""A reasoning model for the tests: the tiny demo model with Qwen3's thinking markers.

`<think>` and `</think>` become two new tokens (two new embedding and output rows), so
mlx-lm recognises the model as a thinking one, and the chat template is shaped like
Qwen3-Thinking's: the generation prompt opens the thinking block (closes it at once when
`enable_thinking` is false), and assistant turns before the last user message lose their
thinking, which is what makes a naive prefix cache miss on the next turn.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx

THINK_START, THINK_END = "<think>", "</think>"

TEMPLATE = r"""
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {%- set content = message.content or '' %}
        {%- set reasoning = message.reasoning_content or '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 > ns.last_query and reasoning %}
            {{- '<think>\n' + reasoning + '\n</think>\n\n' }}
        {%- endif %}
        {{- content + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
"""


def build_thinking_model(demo_model_dir: Path, target: Path) -> Path:
    """A copy of the demo model at `target` with the markers and the template."""
    shutil.copytree(demo_model_dir, target)
    config = json.loads((target / "config.json").read_text())
    first = config["vocab_size"]
    markers = {THINK_START: first, THINK_END: first + 1}
    config["vocab_size"] = first + len(markers)
    (target / "config.json").write_text(json.dumps(config))

    tokenizer = json.loads((target / "tokenizer.json").read_text())
    tokenizer["added_tokens"] += [
        {"id": token_id, "content": text, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": False}
        for text, token_id in markers.items()
    ]
    (target / "tokenizer.json").write_text(json.dumps(tokenizer))
    tokenizer_config = json.loads((target / "tokenizer_config.json").read_text())
    for text, token_id in markers.items():
        tokenizer_config["added_tokens_decoder"][str(token_id)] = {
            "content": text, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": False,
        }
    tokenizer_config["chat_template"] = TEMPLATE
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))

    weights = mx.load(str(target / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = weights[name]
        weights[name] = mx.concatenate([rows, rows[: len(markers)]])
    mx.save_safetensors(str(target / "model.safetensors"), weights)
    return target
