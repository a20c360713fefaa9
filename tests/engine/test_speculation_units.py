"""Speculative decoding's pieces on their own: prompt lookup, the `auto` back-off, and the
rejection step, whose output keeps the target distribution (a chi-square test)."""

from __future__ import annotations

import mlx.core as mx

from engine.speculation import Drafts, PromptLookup, verify_draft


def test_prompt_lookup_drafts_what_followed_the_longest_earlier_ngram():
    lookup = PromptLookup()
    assert lookup.draft([1, 2, 3, 4, 5, 6, 7, 1, 2, 3], 4) == [4, 5, 6, 7]
    assert lookup.draft([1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5], 9) == [6, 7, 1, 2, 3, 4, 5]
    assert lookup.draft([1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 9], 4) == []


def test_auto_pauses_drafting_while_drafts_are_rejected_and_probes_again():
    drafts = Drafts("auto", 8, ("prompt",), lambda context, limit: [], end=1 << 20)
    for _ in range(2):
        assert drafts.wants_draft()
        drafts.record(4, 0)
    assert [drafts.wants_draft() for _ in range(5)] == [False] * 4 + [True]
    drafts.record(4, 0)  # still rejected: a longer pause
    assert [drafts.wants_draft() for _ in range(9)] == [False] * 8 + [True]
    nothing = Drafts("auto", 8, ("tree",), lambda context, limit: [], end=1 << 20)
    assert nothing.draft([1, 2, 3]) == nothing.draft([1, 2, 3, 4]) == []
    assert not nothing.wants_draft()  # finding no draft counts as a draft rejected
    on = Drafts("on", 8, ("prompt",), lambda context, limit: [], end=1 << 20)
    on.record(4, 0)
    on.record(4, 0)
    assert on.wants_draft()


def test_rejection_sampling_keeps_the_target_distribution():
    """Chen et al.'s speculative sampling with a point-mass draft: the first token out is
    distributed as p whether the draft is likely, unlikely or impossible under p."""
    p = mx.array([0.5, 0.3, 0.15, 0.05])
    logits = mx.log(mx.stack([p, p]))
    samples = 4000
    keys = mx.random.split(mx.random.key(7), samples)
    # Pearson's chi-square, 3 degrees of freedom: P(X > 16.27) = 0.001.
    for drafted in (0, 3):
        counts = [0] * 4
        for key in keys:
            accepted, token = verify_draft(logits, [drafted], key)
            counts[drafted if accepted else token] += 1
        expected = [samples * x for x in p.tolist()]
        chi2 = sum((c - e) ** 2 / e for c, e in zip(counts, expected))
        assert chi2 < 16.27, (drafted, counts)
    impossible = mx.log(mx.array([[0.5, 0.5, 0.0, 0.0]] * 2))
    assert all(verify_draft(impossible, [3], key)[0] == 0 for key in keys[:50])
