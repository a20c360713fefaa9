"""Before a benchmark of llama.cpp's CUDA server: does it load the GGUF export of a bench
model, put it on the GPU, and count a chat prompt's tokens as the MLX servers' tokenizer
does (same template, same ids)?

    python bench/experiments/llama-cpp-1b-vocab49152/smoke.py LLAMA_SERVER MODEL_DIR MODEL.gguf LOG
"""

import os
import sys
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from bench.servers import llama_cpp, running

binary, model_dir, gguf, log = sys.argv[1:5]
messages = [{"role": "system", "content": "You answer in one line. 1234 apples."},
            {"role": "user", "content": "Count to 12345, then stop."}]
tokenizer = AutoTokenizer.from_pretrained(model_dir)
ours = tokenizer.encode(tokenizer.apply_chat_template(
    messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
with running(llama_cpp(binary, gpu=True), Path(gguf), dict(os.environ), Path(log)) as server:
    body = {"messages": messages, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120).json()
    rendered = httpx.post(f"{server.base_url}/apply-template", json={"messages": messages},
                          timeout=30).json()["prompt"]
    theirs = httpx.post(f"{server.base_url}/tokenize", timeout=30, json={
        "content": rendered, "add_special": False, "parse_special": True}).json()["tokens"]
print("usage", reply["usage"], "| ours", len(ours), "prompt tokens")
print("llama.cpp completion_tokens == 16:", reply["usage"]["completion_tokens"] == 16)
print("same prompt length:", reply["usage"]["prompt_tokens"] == len(ours))
print("same prompt ids:", theirs == list(ours))
