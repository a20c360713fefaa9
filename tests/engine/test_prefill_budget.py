"""The prefill budget against a simulated device whose costs are known: prefill adds the
configured share of a decode step to the streams' steps, in chunks worth their fixed
cost, and takes whole chunks when nothing decodes."""

from __future__ import annotations

from engine.prefill_budget import GRANULE, PrefillBudget


def run(budget: PrefillBudget, steps: int, decode_seconds: float, chunk_seconds,
        decoding: bool = True, waiting: int = 10**6) -> list[int]:
    """Drive `steps` steps with `waiting` prompt tokens always left; the chunks taken."""
    chunks = []
    for _ in range(steps):
        tokens = budget.tokens(decoding, waiting)
        chunks.append(tokens)
        seconds = (decode_seconds if decoding else 0.0) + (chunk_seconds(tokens) if tokens else 0)
        budget.record(decoding, tokens, seconds)
    return chunks


def cpu_like(tokens: int) -> float:
    """A forward pass reads every weight (50 ms) and then costs 5 ms a token."""
    return 0.05 + 0.005 * tokens


def test_prefill_lengthens_decoding_steps_by_the_configured_share():
    budget = PrefillBudget(stall_ratio=0.25, stall_floor=0.0, chunk=512, idle_chunk=512)
    run(budget, 5, 0.0, cpu_like, decoding=False)  # what warm-up measures
    chunks = run(budget, 400, 0.1, cpu_like)
    stall = sum(cpu_like(n) for n in chunks if n)
    assert abs(stall / (400 * 0.1) - 0.25) < 0.02
    # Never a sliver that pays a forward pass's fixed cost for a few tokens.
    assert all(n % GRANULE == 0 and n <= 512 for n in chunks)
    assert 0 in chunks  # the allowance accrues over steps that prefill nothing


def test_what_is_left_of_short_prompts_goes_in_one_chunk_once_affordable():
    budget = PrefillBudget(stall_ratio=0.25, stall_floor=0.0, chunk=512, idle_chunk=512)
    run(budget, 5, 0.0, cpu_like, decoding=False)
    # Seven 35-token questions: one forward of 245 tokens (~1.3 s) after enough steps.
    chunks = run(budget, 60, 0.1, cpu_like, waiting=245)
    assert set(chunks) == {0, 245}
    assert chunks.index(245) > 40


def test_a_decode_step_is_measured_before_prefill_stalls_it():
    budget = PrefillBudget(stall_ratio=0.25, stall_floor=0.0, chunk=512, idle_chunk=512)
    assert budget.tokens(decoding=True, waiting=1000) == 0


def test_with_nothing_decoding_prompts_take_whole_idle_chunks():
    budget = PrefillBudget(stall_ratio=0.1, stall_floor=0.0, chunk=512, idle_chunk=2048)
    assert run(budget, 4, 0.0, cpu_like, decoding=False) == [2048] * 4


def test_the_floor_lets_a_fast_device_prefill_whole_chunks_every_step():
    # A GPU-like device: 3 ms decode steps, a 2048-token chunk in 12 ms.
    budget = PrefillBudget(stall_ratio=0.25, stall_floor=0.02, chunk=2048, idle_chunk=2048)
    run(budget, 3, 0.0, lambda n: 0.002 + n * 5e-6, decoding=False)
    chunks = run(budget, 20, 0.003, lambda n: 0.002 + n * 5e-6)
    assert chunks[1:] == [2048] * 19


def test_a_zero_share_and_floor_leaves_prompts_until_decoding_ends():
    budget = PrefillBudget(stall_ratio=0.0, stall_floor=0.0, chunk=512, idle_chunk=512)
    run(budget, 2, 0.0, cpu_like, decoding=False)
    assert run(budget, 50, 0.1, cpu_like) == [0] * 50


def gpu_like(tokens: int) -> float:
    """A fast device: a forward pass costs 2 ms, then 5 us a token."""
    return 0.002 + tokens * 5e-6


def test_a_slow_step_that_is_not_its_own_work_does_not_starve_prefill():
    budget = PrefillBudget(stall_ratio=0.1, stall_floor=0.02, chunk=2048, idle_chunk=2048)
    # The first prefill compiled its kernels: 60 times its real cost (as on an H100).
    budget.record(decoding=False, prefilled=752, seconds=752 * 3e-4)
    run(budget, 1, 0.003, gpu_like)  # a decode step is measured first
    chunks = run(budget, 60, 0.003, gpu_like)
    first = next(i for i, n in enumerate(chunks) if n)
    # The cold sample delays one chunk; the chunk's own cost then sizes the rest.
    assert chunks[first + 1:] == [2048] * (len(chunks) - first - 1)
    # A join that stalls one decode step tenfold does not shrink what prefill may take.
    budget.record(decoding=True, prefilled=0, seconds=0.03)
    assert run(budget, 5, 0.003, gpu_like) == [2048] * 5
