"""The prefix cache's disk tier, through real server processes: warm restarts (SIGTERM and
kill -9), bad files, another model's files, budgets, the admin endpoint, warm prompts,
and whole-state snapshots.

Every server here shares nothing with the session's servers: each gets its own cache
directory (a copy where a test damages files)."""

from __future__ import annotations

import json
import shutil
import signal
import struct
import time
from pathlib import Path

import httpx
import pytest

from engine.demo_model import build_demo_model
from engine.platform_info import openblas_core_type, openblas_library
from tests.server.support import API_KEY, ServerProcess, start_server

# A prompt long enough that its prefill matters; the demo model's context is 2048+.
LONG_PROMPT = " ".join(f"step {i}: read the file, then patch line {i * 7}." for i in range(90))
OTHER_PROMPT = " ".join(f"turn {i}: the agent calls tool_{i % 5} with {i}." for i in range(90))
AUTH = {"Authorization": f"Bearer {API_KEY}"}
WAIT_SECONDS = 60.0


def disk_flags(directory: Path, disk_bytes: int = 2**30, *more: str) -> tuple[str, ...]:
    return ("--api-key", API_KEY, "--disk-cache-dir", str(directory),
            "--disk-cache-bytes", str(disk_bytes), *more)


def complete(server: ServerProcess, prompt: str, max_tokens: int = 8) -> tuple[str, int, int]:
    """Greedy completion: (text, prompt tokens, cached prompt tokens)."""
    response = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=120, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    body = response.json()
    usage = body["usage"]
    return (body["choices"][0]["text"], usage["prompt_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"])


def cache_report(server: ServerProcess) -> dict:
    response = httpx.get(f"{server.url}/admin/cache", headers=AUTH, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def wait_for(server: ServerProcess, ready, what: str) -> dict:
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        report = cache_report(server)
        if ready(report):
            return report
        time.sleep(0.1)
    raise AssertionError(f"{what}: not after {WAIT_SECONDS} s: {report}\n{server.log()}")


def written(server: ServerProcess) -> dict:
    """The report once the writer has nothing queued and has written something."""
    return wait_for(server, lambda r: r["disk"]["writes"] and not r["disk"]["queued_bytes"],
                    "disk writes done")


def rebuilt(server: ServerProcess) -> dict:
    return wait_for(server, lambda r: not r["disk"]["rebuilding"], "rebuilt from disk")


def files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*/*.safetensors"))


def kill(server: ServerProcess) -> None:
    server.process.send_signal(signal.SIGKILL)
    server.process.wait(timeout=30)


@pytest.fixture(scope="module")
def warm_cache(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A cache directory a server filled with two long prompts' KV and left with SIGTERM,
    and what those prompts gave."""
    directory = tmp_path_factory.mktemp("disk-cache") / "kv"
    log = directory.parent / "first.log"
    server = start_server(demo_model_dir, log, *disk_flags(directory))
    try:
        outputs = {prompt: complete(server, prompt) for prompt in (LONG_PROMPT, OTHER_PROMPT)}
        written(server)
    finally:
        assert server.stop() == 0
    assert all(cached == 0 for _, _, cached in outputs.values())
    return directory, outputs


def copy_of(warm_cache, tmp_path: Path) -> Path:
    directory = tmp_path / "kv"
    shutil.copytree(warm_cache[0], directory)
    return directory


def test_after_a_sigterm_restart_a_long_prompt_is_cached_and_answers_the_same(
        demo_model_dir: Path, warm_cache, tmp_path: Path) -> None:
    directory = copy_of(warm_cache, tmp_path)
    server = start_server(demo_model_dir, tmp_path / "log", *disk_flags(directory))
    try:
        assert rebuilt(server)["disk"]["restored_nodes"] >= 2
        text, prompt_tokens, cached = complete(server, LONG_PROMPT)
        assert text == warm_cache[1][LONG_PROMPT][0]
        assert cached >= 0.9 * prompt_tokens
        report = cache_report(server)
        assert report["disk"]["hits"] >= 1 and report["disk"]["hit_tokens"] >= cached
        metrics = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=10).text
        assert "radix_mlx_disk_hit_tokens_total" in metrics
    finally:
        server.stop()


def test_a_restart_brings_back_into_memory_what_memory_held_and_no_more(
        demo_model_dir: Path, tmp_path: Path) -> None:
    """What memory held at a stop is back in memory before the first request after the
    restart (or a model's reload after an idle unload), so no request waits for its
    disk read; what had gone to disk only stays there, and nothing is evicted for it."""
    directory = tmp_path / "kv"
    flags = disk_flags(directory, 2**30, "--cache-bytes", str(2**20))
    server = start_server(demo_model_dir, tmp_path / "first.log", *flags)
    try:
        on_disk = complete(server, LONG_PROMPT)
        latest = [complete(server, f"Filler {i}: " + OTHER_PROMPT) for i in range(2)][-1]
        at_stop = written(server)
        assert at_stop["disk"]["demotions"] >= 1  # LONG_PROMPT went to disk only
    finally:
        assert server.stop() == 0
    server = start_server(demo_model_dir, tmp_path / "second.log", *flags)
    try:
        report = rebuilt(server)
        assert 0 < report["memory"]["tokens"] <= at_stop["memory"]["tokens"]
        assert report["memory"]["bytes"] <= 2**20 and report["disk"]["loads"] >= 1
        text, prompt_tokens, cached = complete(server, "Filler 1: " + OTHER_PROMPT)
        assert (text, cached) == (latest[0], prompt_tokens - 1)
        assert cache_report(server)["disk"]["loads"] == report["disk"]["loads"]
        text, prompt_tokens, cached = complete(server, LONG_PROMPT)
        assert text == on_disk[0] and cached >= 0.9 * prompt_tokens
        assert cache_report(server)["disk"]["loads"] > report["disk"]["loads"]
    finally:
        server.stop()
    assert "back in memory" in server.log()


def test_after_kill_9_a_prompt_written_before_it_is_cached_and_answers_the_same(
        demo_model_dir: Path, warm_cache, tmp_path: Path) -> None:
    directory = copy_of(warm_cache, tmp_path)
    prompt = "Unrelated: " + OTHER_PROMPT[::-1]
    server = start_server(demo_model_dir, tmp_path / "first.log", *disk_flags(directory))
    try:
        before = complete(server, prompt)
        written(server)
    finally:
        kill(server)
    server = start_server(demo_model_dir, tmp_path / "second.log", *disk_flags(directory))
    try:
        rebuilt(server)
        text, prompt_tokens, cached = complete(server, prompt)
        assert text == before[0]
        assert cached >= 0.9 * prompt_tokens
    finally:
        server.stop()


def test_a_files_header_alone_leads_through_its_parents_to_the_model(warm_cache) -> None:
    """What a tool outside the server reads (shared/evidence's verify.py): each file's
    JSON names its parent's key, and the chain of parents ends at the model's
    fingerprint, having held the `start` tokens the file's span follows."""
    headers = {}
    for path in files(warm_cache[0]):
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(json.loads(f.read(length))["__metadata__"]["radix_mlx"])
        headers[header["key"]] = header
    assert len(headers) >= 2
    for header in headers.values():
        before, link = 0, header
        while link["parent"] != header["fingerprint"]:
            link = headers[link["parent"]]
            before += len(link["tokens"])
        assert before == header["start"]


def test_torn_truncated_corrupt_and_foreign_files_are_skipped_deleted_and_logged(
        demo_model_dir: Path, warm_cache, tmp_path: Path) -> None:
    directory = copy_of(warm_cache, tmp_path)
    # The two prompts' files are the biggest (the others hold 8 generated tokens each).
    first, second = sorted(files(directory), key=lambda p: p.stat().st_size)[-2:]
    model_dir = first.parent
    data = bytearray(second.read_bytes())
    data[-100] ^= 0xFF  # a flipped bit in the data: only the checksum can tell
    second.write_bytes(bytes(data))
    first.write_bytes(first.read_bytes()[:-10])  # truncated
    torn = model_dir / f"{'0' * 32}.safetensors.123.tmp"  # a write a crash cut short
    torn.write_bytes(b"partial")
    foreign = model_dir / f"{'f' * 32}.safetensors"
    foreign.write_bytes(b"not a safetensors file at all")
    server = start_server(demo_model_dir, tmp_path / "log", *disk_flags(directory))
    try:
        rebuilt(server)
        for prompt in (LONG_PROMPT, OTHER_PROMPT):  # the same answers, whatever was lost
            assert complete(server, prompt)[0] == warm_cache[1][prompt][0]
        report = cache_report(server)
    finally:
        server.stop()
    assert report["disk"]["bad_files"] >= 3
    assert not torn.exists() and not foreign.exists()  # (`first` is written anew)
    log = server.log()
    assert f"skipping and deleting {first.name}" in log
    assert f"skipping and deleting {second.name}: checksum mismatch" in log


def test_another_models_files_are_never_read(
        demo_model_dir: Path, warm_cache, tmp_path: Path) -> None:
    directory = copy_of(warm_cache, tmp_path)
    theirs = {path: path.read_bytes() for path in files(directory)}
    other_model = build_demo_model(tmp_path / "tiny-seed1", seed=1)
    server = start_server(other_model, tmp_path / "log", *disk_flags(directory))
    try:
        report = rebuilt(server)
        assert report["disk"]["restored_nodes"] == 0
        _, _, cached = complete(server, LONG_PROMPT)
        assert cached == 0
        written(server)
        # One of the first model's files in this model's directory: foreign, skipped.
        stray = next(iter(theirs))
        shutil.copy(stray, Path(report["disk"]["directory"]) / stray.name)
    finally:
        server.stop()
    assert {p: p.read_bytes() for p in theirs} == theirs  # untouched
    server = start_server(other_model, tmp_path / "log2", *disk_flags(directory))
    try:
        rebuilt(server)
    finally:
        server.stop()
    assert "written for another model" in server.log()


def test_kv_that_other_blas_kernels_computed_is_not_read(
        demo_model_dir: Path, warm_cache, tmp_path: Path) -> None:
    """OpenBLAS's SSE3 kernels sum a float32 product in another order than the AVX ones
    the folder's KV was computed with: a prompt sent again read that KV, and its logprobs
    differed in the last bits from the server's own cold run (a sweep's repro). A folder
    moved to another machine, or another BLAS, starts over."""
    if openblas_library() is None or openblas_core_type() is None:
        pytest.skip("the CPU's OpenBLAS runs one set of kernels here")
    directory = copy_of(warm_cache, tmp_path)
    server = start_server(demo_model_dir, tmp_path / "log", *disk_flags(directory),
                          env={"OPENBLAS_CORETYPE": "Prescott"})
    try:
        assert rebuilt(server)["disk"]["restored_nodes"] == 0
        assert complete(server, LONG_PROMPT)[2] == 0
    finally:
        server.stop()


def test_budgets_hold_and_an_evicted_prefix_comes_back_from_disk(
        demo_model_dir: Path, tmp_path: Path) -> None:
    directory = tmp_path / "kv"
    server = start_server(demo_model_dir, tmp_path / "log", *disk_flags(directory, 3 * 2**20),
                          "--cache-bytes", str(2**20))
    try:
        first = complete(server, LONG_PROMPT)
        for i in range(2):  # others push it out of the 1 MiB memory tier, onto disk
            complete(server, f"Filler {i}: " + OTHER_PROMPT)
        report = written(server)
        assert report["memory"]["bytes"] <= 2**20
        assert report["disk"]["demotions"] >= 1
        text, prompt_tokens, cached = complete(server, LONG_PROMPT)
        assert text == first[0] and cached >= 0.9 * prompt_tokens
        assert cache_report(server)["disk"]["hits"] >= 1
        for i in range(2, 6):  # 7 long prompts do not fit in 3 MiB of disk either
            complete(server, f"Filler {i}: " + OTHER_PROMPT)
        report = written(server)
        assert report["disk"]["evictions"] >= 1
        assert report["disk"]["bytes"] <= 3 * 2**20
        assert sum(p.stat().st_size for p in files(directory)) <= 3 * 2**20
    finally:
        server.stop()


def test_admin_cache_reports_and_clears_both_tiers_behind_the_api_key(
        demo_model_dir: Path, tmp_path: Path) -> None:
    directory = tmp_path / "kv"
    warm = tmp_path / "warm.jsonl"
    system = "You are a careful coding agent. " * 40
    body = {"messages": [{"role": "system", "content": system}]}
    warm.write_text(json.dumps(body) + "\n" + "not json\n")
    server = start_server(demo_model_dir, tmp_path / "log",
                          *disk_flags(directory, 2**30, "--warm-prompts", str(warm)))
    try:
        assert httpx.get(f"{server.url}/admin/cache", timeout=10).status_code == 401
        assert httpx.delete(f"{server.url}/admin/cache", timeout=10).status_code == 401
        report = wait_for(server, lambda r: r["memory"]["tokens"] > 0, "warm prompt cached")
        chat = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, timeout=120, json={
            "messages": [*body["messages"], {"role": "user", "content": "hi"}],
            "max_tokens": 2, "temperature": 0})
        assert chat.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 300
        written(server)
        assert files(directory)
        cleared = httpx.delete(f"{server.url}/admin/cache", headers=AUTH, timeout=30).json()
        assert cleared["cleared"] and cleared["memory"]["bytes"] == 0
        assert cleared["disk"]["bytes"] == 0
        wait_for(server, lambda r: not r["disk"]["queued_bytes"], "deletes done")
        report = cache_report(server)
    finally:
        server.stop()
    assert report["disk"]["capacity_bytes"] == 2**30
    assert not files(directory)
    assert "warm prompts: 1 prefilled" in server.log() and "line 2 skipped" in server.log()


def test_a_clear_while_the_tree_is_rebuilt_from_disk_leaves_nothing(
        warm_cache, demo_model_dir: Path, tmp_path: Path) -> None:
    """The server serves while its tree is rebuilt from the files at start (slowed down
    here, as a tier of many files is): a clear then waits for the rebuild, since cleared
    before it, the tree would take back what the rebuild read afterwards."""
    directory = copy_of(warm_cache, tmp_path)
    server = start_server(demo_model_dir, tmp_path / "log", *disk_flags(directory),
                          entry=("tests.slow_rebuild", "5"))
    try:
        assert cache_report(server)["disk"]["rebuilding"]
        cleared = httpx.delete(f"{server.url}/admin/cache", headers=AUTH, timeout=60).json()
        assert cleared["memory"]["bytes"] == cleared["disk"]["bytes"] == 0
        assert not cleared["disk"]["rebuilding"]
        wait_for(server, lambda r: not r["disk"]["queued_bytes"], "deletes done")
        text, _, cached = complete(server, LONG_PROMPT)
    finally:
        server.stop()
    assert cached == 0
    assert text == warm_cache[1][LONG_PROMPT][0]


def chat_cached_tokens(server: ServerProcess, system: str, question: str) -> int:
    response = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, timeout=120, json={
        "messages": [{"role": "system", "content": system},
                     {"role": "user", "content": question}],
        "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_next"])
def test_whole_state_snapshots_survive_a_restart(
        demo_model_family, family: str, tmp_path: Path) -> None:
    model = demo_model_family(family)
    directory = tmp_path / "kv"
    server = start_server(model, tmp_path / "first.log", *disk_flags(directory))
    try:
        before = complete(server, LONG_PROMPT)
        chat_cached_tokens(server, OTHER_PROMPT, "What did turn 3 call?")
        # The system prompt's end, snapshotted by the first chat's prefill.
        system_end = chat_cached_tokens(server, OTHER_PROMPT, "And turn 4?")
        written(server)
    finally:
        server.stop()
    server = start_server(model, tmp_path / "second.log", *disk_flags(directory))
    try:
        rebuilt(server)
        text, prompt_tokens, cached = complete(server, LONG_PROMPT)
        after_restart = chat_cached_tokens(server, OTHER_PROMPT, "And turn 5?")
    finally:
        server.stop()
    assert text == before[0] and cached >= 0.9 * prompt_tokens
    assert after_restart >= system_end > 0


def test_a_second_server_on_the_same_disk_folder_is_refused_at_start(
        demo_model_dir: Path, tmp_path: Path):
    """One writer per folder (engine/disk_store.py's `lock_folder`): the second server
    exits at start naming the folder and the fix, and the first goes on serving with its
    cache; once the first has stopped, the folder is free again."""
    directory = tmp_path / "kv"
    first = start_server(demo_model_dir, tmp_path / "first.log", *disk_flags(directory))
    try:
        text, _, _ = complete(first, LONG_PROMPT)
        with pytest.raises(RuntimeError) as refused:
            start_server(demo_model_dir, tmp_path / "second.log", *disk_flags(directory))
        message = str(refused.value)
        assert "exited with 1" in message and "is in use by radix-mlx (pid" in message
        assert str(directory) in message and "--disk-cache-dir" in message
        assert complete(first, LONG_PROMPT)[0] == text
    finally:
        assert first.stop() == 0
    again = start_server(demo_model_dir, tmp_path / "again.log", *disk_flags(directory))
    try:
        rebuilt(again)
        assert complete(again, LONG_PROMPT)[2] > 0
    finally:
        assert again.stop() == 0
