"""A 131k-token vocabulary without a model hub: Mistral's Tekken tokenizer, which the
mistral-common package ships, written as a tokenizer directory for `bench.models
--tokenizer-from`, so the benchmark's shapes can pay a 128k+ LM head, sampling and
detokenizer as Llama 3 or Mistral models do.

    python -m bench.tekken DIR
    python -m bench.models MODEL_DIR --shape llama-1b --tokenizer-from DIR
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import shutil
from pathlib import Path

# mistral-common's newest Tekken file (Mistral NeMo's and later models' 131072 ids).
TEKKEN_FILE = "tekken_240911.json"
# Mistral's own layout (its v7 template): the system prompt first, so conversations that
# share it share a token prefix, as the cache workloads need.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}"
    "{% elif message['role'] == 'user' %}"
    "{{ '[INST]' + message['content'] + '[/INST]' }}"
    "{% else %}"
    "{{ message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
)


def write(directory: Path) -> Path:
    """Write tokenizer.json, tokenizer_config.json and a config.json holding the vocabulary
    size and special ids (what `bench.models` reads) into `directory`, replacing it."""
    from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

    source = importlib.resources.files("mistral_common") / "data" / TEKKEN_FILE
    tokenizer = convert_tekken_tokenizer(str(source), chat_template=CHAT_TEMPLATE)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    tokenizer.backend_tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "unk_token": tokenizer.unk_token,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    config = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    for name, value in (("tokenizer_config.json", tokenizer_config), ("config.json", config)):
        (directory / name).write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    print(write(parser.parse_args().directory))


if __name__ == "__main__":
    main()
