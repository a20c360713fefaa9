"""Speculative decoding's pieces on their own: prompt lookup, a request's prediction, the
`auto` back-off, and the rejection step of a sampled row, whose output keeps the target distribution (a chi-square
test)."""

from __future__ import annotations

import mlx.core as mx

from engine.api import SamplingParams
from engine.sampling import Sampler, draw
from engine.speculation import STEP_COST, Drafts, PredictionLookup, PromptLookup, best_width


def test_prompt_lookup_drafts_what_followed_the_longest_earlier_ngram():
    lookup = PromptLookup()
    assert lookup.draft([1, 2, 3, 4, 5, 6, 7, 1, 2, 3], 4) == [4, 5, 6, 7]
    assert lookup.draft([1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5], 9) == [6, 7, 1, 2, 3, 4, 5]
    assert lookup.draft([1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 9], 4) == []


def test_a_prediction_drafts_where_the_output_is_in_it_and_finds_it_again_after_an_edit():
    """The output (after a 3-token prompt) copies the prediction, leaves it for an edit,
    and comes back: drafts follow it, then stop, then follow it from where the output's
    latest n-gram occurs after the edit."""
    prediction = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    lookup = PredictionLookup(prediction, start=3)
    prompt = [7, 8, 9]
    assert lookup.draft(prompt + [10], 4) == [11, 12, 13, 14]
    assert lookup.draft(prompt + [10, 11, 12], 3) == [13, 14, 15]
    # An edit: 99 for 13. Nothing in the prediction follows 99.
    assert lookup.draft(prompt + [10, 11, 12, 99], 4) == []
    # Back at 14, 15: found again by that 2-gram (one token is too common to go by),
    # and followed as before.
    assert lookup.draft(prompt + [10, 11, 12, 99, 14], 4) == []
    assert lookup.draft(prompt + [10, 11, 12, 99, 14, 15], 4) == [16, 17, 18, 19]
    assert lookup.draft(prompt + [10, 11, 12, 99, 14, 15, 16, 17], 8) == [18, 19, 20, 21]
    # The output's start need not be the prediction's (a code fence before the file):
    # its first token found, the prediction is followed from its start, not from a later
    # copy of its first line that a 2-gram through the fence would find.
    fenced = PredictionLookup([10, 11, 5, 10, 11, 6], start=3)
    assert fenced.draft(prompt + [5, 10], 2) == [11, 5]


def test_a_repeated_ngram_is_found_again_after_where_the_output_left():
    prediction = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5]
    lookup = PredictionLookup(prediction, start=0)
    assert lookup.draft([1, 2, 3, 9, 9, 1], 3) == [2, 3, 4]
    assert lookup.draft([1, 2, 3, 9, 9, 1, 7], 3) == []  # left at position 6
    assert lookup.draft([1, 2, 3, 9, 9, 1, 7, 2, 3], 2) == [4, 5]  # not [9, 9] at 3


def test_drafts_count_what_the_prediction_drafted_and_what_was_kept():
    lookup = PredictionLookup([4, 5, 6, 7, 8, 9], start=1)
    drafts = Drafts("on", 8, ("prompt",), lambda context, limit: [], end=1 << 20,
                    vocab_size=1000, prediction=lookup)
    assert drafts.draft([0, 4]) == [5, 6, 7, 8]
    drafts.record(4, 2)
    # The output left the prediction, which has nothing after it: prompt lookup's draft.
    assert drafts.draft([0, 4, 5, 6, 1, 2, 3, 1, 2]) == [3, 1, 2]
    drafts.record(3, 1)
    assert (drafts.drafted, drafts.accepted) == (7, 3)
    assert (drafts.predicted, drafts.accepted_predicted) == (4, 2)


def test_auto_pauses_drafting_while_drafts_are_rejected_and_probes_again():
    """A pause lasts until the batch's next step that is a multiple of its length (4,
    doubling while probes fail), so rows paused alike probe at one step."""
    drafts = Drafts("auto", 8, ("prompt",), lambda context, limit: [], end=1 << 20, vocab_size=1000)
    for step in (0, 1):
        assert drafts.wants_draft(step)
        drafts.record(4, 0)
    assert [drafts.wants_draft(step) for step in range(2, 6)] == [False] * 2 + [True] * 2
    drafts.record(4, 0)  # the probe at step 4 still rejected: a longer pause
    assert [drafts.wants_draft(step) for step in range(5, 9)] == [False] * 3 + [True]
    late = Drafts("auto", 8, ("prompt",), lambda context, limit: [], end=1 << 20, vocab_size=1000)
    late.record(4, 0)
    late.record(4, 0)
    assert not late.wants_draft(6) and late.wants_draft(8)  # with `drafts`, paused at 4
    nothing = Drafts("auto", 8, ("tree",), lambda context, limit: [], end=1 << 20, vocab_size=1000)
    assert nothing.draft([1, 2, 3]) == nothing.draft([1, 2, 3, 4]) == []
    assert not nothing.wants_draft(2)  # finding no draft counts as a draft rejected
    on = Drafts("on", 8, ("prompt",), lambda context, limit: [], end=1 << 20, vocab_size=1000)
    on.record(4, 0)
    on.record(4, 0)
    assert on.wants_draft(2)


def test_rejection_sampling_keeps_the_target_distribution():
    """A sampled row keeps draft token x where x is the token its sampler draws at that
    output index: x is accepted with probability p(x), and the token out is distributed as
    p whether x is likely, unlikely or impossible under p (the first token out of a verify
    step, over 4000 seeds; Pearson's chi-square, 3 degrees of freedom:
    P(X > 16.27) = 0.001)."""
    p = [0.5, 0.3, 0.15, 0.05]
    logprobs = mx.log(mx.array([p, p]))
    samples = 4000
    for drafted in (0, 3):
        counts, accepted = [0] * 4, 0
        for seed in range(samples):
            sampler = Sampler(SamplingParams(max_tokens=2, temperature=1.0, seed=seed), 4)
            token = sampler.draws(logprobs, 0).tolist()[0]
            counts[token] += 1
            accepted += token == drafted
        expected = [samples * x for x in p]
        assert sum((c - e) ** 2 / e for c, e in zip(counts, expected)) < 16.27, counts
        assert abs(accepted / samples - p[drafted]) < 0.03
    impossible = mx.log(mx.array([[0.5, 0.5, 0.0, 0.0]]))
    sampler = Sampler(SamplingParams(max_tokens=2, temperature=1.0, seed=1), 4)
    assert all(sampler.draws(impossible, i).item() != 3 for i in range(50))


def test_a_sampled_token_depends_on_its_seed_and_output_index_alone():
    """So a verify step draws each position's token exactly as one decode step per
    position does: a seeded request's output does not depend on its drafts."""
    logprobs = mx.log(mx.array([[0.25] * 8] * 3))
    stepwise = Sampler(SamplingParams(max_tokens=3, temperature=0.7, top_k=6, seed=5), 8)
    one_by_one = [draw([stepwise], logprobs[i:i + 1]).item() for i in range(3)]
    at_once = Sampler(SamplingParams(max_tokens=3, temperature=0.7, top_k=6, seed=5), 8)
    assert at_once.draws(logprobs, 0).tolist() == one_by_one
    assert stepwise.position == 3


def test_auto_verifies_only_the_drafts_that_pay_for_their_forward():
    """On the CPU a verify's positions cost compute: one stream verifies as much as its
    drafts' rate earns, and 16 streams of mediocre drafts decode instead. On a GPU
    positions cost little but a verify step costs its lost overlap with the next: 16
    streams verify drafts that copy, not mediocre ones (a GPU's verifies are all as wide as
    the longest draft allowed)."""
    cpu, gpu = STEP_COST["cpu"], STEP_COST["gpu"]
    assert best_width([[1] * 8], [0.9], cpu) > best_width([[1] * 8], [0.5], cpu) >= 1
    assert best_width([[1] * 8] * 16, [0.5] * 16, cpu) == 0
    assert best_width([[1] * 8] * 16, [0.5] * 16, gpu, fed_width=8) == 0
    assert best_width([[1] * 8] * 16, [0.9] * 16, gpu, fed_width=8) == 8
    assert best_width([[1] * 8], [0.3], gpu, fed_width=8) == 0
    assert best_width([[1] * 2], [0.99], cpu) == 2  # never past the longest draft


def test_auto_probes_again_after_its_rate_vetoed_every_verify():
    """A rate left low by failed drafts makes every later draft not worth a verify on a
    GPU; declined drafts count as chances that kept nothing, so auto pauses, and the
    probe after the pause is verified on the prior rate (else auto never verified again,
    also once the stream turned to copying)."""
    gpu = STEP_COST["gpu"]
    drafts = Drafts("auto", 8, ("prompt",), lambda context, limit: [], end=1 << 20, vocab_size=1000)
    drafts.record(8, 0)
    assert best_width([[1] * 8], [drafts.rate], gpu, fed_width=8) == 0
    assert drafts.wants_draft(0)
    drafts.declined()
    assert [drafts.wants_draft(step) for step in range(1, 5)] == [False] * 3 + [True]
    assert best_width([[1] * 8], [drafts.rate], gpu, fed_width=8) == 8  # the probe


def test_the_rate_counts_runs_kept_against_drafts_cut_short():
    """Copying keeps whole drafts and now and then breaks off at once: the chance of the
    next token being kept is high though many draft tokens were not."""
    drafts = Drafts("auto", 8, ("prompt",), lambda context, limit: [], end=1 << 20, vocab_size=1000)
    for accepted in (8, 8, 0, 8, 8, 0, 8):
        drafts.record(8, accepted)
    assert drafts.rate > 0.85 > drafts.accepted / drafts.drafted


def test_a_draft_stops_before_an_image_key():
    """Ids past the vocabulary are the radix keys of image positions: never fed."""
    drafts = Drafts("on", 8, ("tree",), lambda context, limit: [5, 6, 4000, 7], end=1 << 20,
                    vocab_size=1000)
    assert drafts.draft([1, 2, 3]) == [5, 6]

