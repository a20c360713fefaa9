"""chat_prompt on the default model's tokenizer (SmolLM2-135M-Instruct, from its GGUF) for a
6,000-token system prompt and a 64-token question: the template's own tokenize=True path
against the segment-cached one, medians of N runs. usage: measure.py [N]"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mlx_lm.tokenizer_utils import load

from bench.workloads import TextSource
from engine.model_source import default_model_file
from engine.tokenizer import ModelTokenizer
from tests.engine.gguf_files import write_gguf_tokenizer

N = int(sys.argv[1]) if len(sys.argv) > 1 else 50


def median_ms(work, prepare=lambda: None) -> float:
    times = []
    for _ in range(N):
        argument = prepare()
        started = time.perf_counter()
        work(argument)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


directory = write_gguf_tokenizer(default_model_file(), Path(tempfile.mkdtemp()) / "smollm2")
wrapper = load(directory)
tokenizer = ModelTokenizer(wrapper)
source = TextSource(directory, 1)
system = {"role": "system", "content": source.text(6000)}
questions = [source.text(64) for _ in range(N + 1)]


def chat(question: str) -> list[dict[str, str]]:
    return [system, {"role": "user", "content": question}]


def plain(messages):
    return wrapper.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


assert tokenizer.chat_prompt(chat(questions[0])) == plain(chat(questions[0]))
print("prompt tokens", len(plain(chat(questions[0]))))
fresh = iter(questions)


def render(messages):
    return wrapper.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


print(f"render only ms {median_ms(render, lambda: chat(next(fresh))):.2f}")
fresh = iter(questions)
print(f"plain (tokenize=True) ms {median_ms(plain, lambda: chat(next(fresh))):.2f}")
fresh = iter(questions)
print(f"cached, warm, a new question each time ms "
      f"{median_ms(tokenizer.chat_prompt, lambda: chat(next(fresh))):.2f}")
print(f"cached, warm, the same request ms "
      f"{median_ms(tokenizer.chat_prompt, lambda: chat(questions[0])):.2f}")


def new_system():
    return [{"role": "system", "content": source.text(6000)},
            {"role": "user", "content": questions[0]}]


# Alternated, which goes first swapped each round, each on a system prompt never seen.
cold = {"plain": [], "cached": []}
for round_ in range(N):
    ways = [("plain", plain), ("cached", tokenizer.chat_prompt)]
    for name, work in ways[::-1] if round_ % 2 else ways:
        messages = new_system()
        started = time.perf_counter()
        work(messages)
        cold[name].append(time.perf_counter() - started)
print(f"a new system prompt each time: plain ms {statistics.median(cold['plain']) * 1e3:.2f}, "
      f"cached (cold) ms {statistics.median(cold['cached']) * 1e3:.2f}")
