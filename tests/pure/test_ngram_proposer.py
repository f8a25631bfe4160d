"""The n-gram proposer: matching rules, and the incremental index against a linear scan."""

import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_lm_server.spec_decode.drafts import PLACEHOLDER_TOKEN, ProposalResult
from mlx_lm_server.spec_decode.proposer.ngram import NGramProposer, continuation


def propose(context, k=5, ngram_min=1, ngram_max=4, prompt_len=0, prompt_lookup=True):
    p = NGramProposer(ngram_min, ngram_max, prompt_lookup)
    p.add_sequence(0, prompt_len)
    r = p.propose([0], [context], [k])
    return [int(t) for t in r.draft_tokens[0, : r.num_proposed[0]]]


def linear_scan(context, k, ngram_min, ngram_max, min_end=0):
    """Obviously-correct reference: longest n first, most recent earlier match first."""
    L = len(context)
    if k <= 0:
        return []
    for n in range(min(ngram_max, L), ngram_min - 1, -1):
        suffix = context[L - n :]
        for e in range(L - 1, max(n, min_end) - 1, -1):
            if context[e - n : e] == suffix:
                return continuation(context, e, k)
    return []


def test_exact_repeat():
    assert propose([1, 2, 3, 4, 5, 6, 1, 2, 3], k=3) == [4, 5, 6]


def test_no_match():
    assert propose([1, 2, 3, 4, 5], k=3) == []


def test_longest_n_wins():
    # "3" alone last continued with 9; "2 3" continued with 4.
    ctx = [2, 3, 4, 7, 3, 9, 2, 3]
    assert propose(ctx, k=1, ngram_max=2) == [4]
    assert propose(ctx, k=1, ngram_max=1) == [9]


def test_most_recent_wins():
    ctx = [5, 1, 5, 2, 5]
    assert propose(ctx, k=1, ngram_max=1) == [2]


def test_capped_at_k():
    ctx = list(range(20)) + [0, 1]
    assert propose(ctx, k=4) == [2, 3, 4, 5]


def test_short_tail_reads_into_the_draft():
    # The only earlier "7 8" ends right before the suffix: the draft repeats the period.
    assert propose([7, 8, 7, 8], k=5, ngram_max=2) == [7, 8, 7, 8, 7]


def test_mixed_batch_and_zero_k():
    p = NGramProposer(1, 3)
    for uid in (10, 11, 12):
        p.add_sequence(uid, 0)
    r = p.propose([10, 11, 12], [[1, 2, 3, 1, 2], [4, 5, 6], [9, 9, 9]], [3, 3, 0])
    assert r.num_proposed.tolist() == [3, 0, 0]
    assert r.draft_tokens[0].tolist() == [3, 1, 2]
    assert r.draft_tokens[1].tolist() == [PLACEHOLDER_TOKEN] * 3


def test_prompt_lookup_off_only_matches_generated_text():
    prompt = [1, 2, 3, 4]
    ctx = prompt + [9, 1, 2]
    assert propose(ctx, k=2, prompt_len=len(prompt)) == [3, 4]
    assert propose(ctx, k=2, prompt_len=len(prompt), prompt_lookup=False) == []
    ctx2 = prompt + [6, 7, 8, 6, 7]
    assert propose(ctx2, k=1, prompt_len=len(prompt), prompt_lookup=False) == [8]


def test_empty_and_tiny_contexts():
    assert propose([], k=3) == []
    assert propose([1], k=3) == []
    assert propose([1, 1], k=3) == [1, 1, 1]


def test_index_follows_a_growing_context():
    p = NGramProposer(1, 4)
    p.add_sequence(0, 0)
    rng = np.random.default_rng(0)
    ctx = []
    for _ in range(200):
        ctx.extend(int(t) for t in rng.integers(0, 6, size=int(rng.integers(1, 4))))
        r = p.propose([0], [ctx], [4])
        got = r.draft_tokens[0, : r.num_proposed[0]].tolist()
        assert got == linear_scan(ctx, 4, 1, 4)


def test_index_rebuilds_when_context_is_not_an_extension():
    p = NGramProposer(1, 2)
    p.add_sequence(0, 0)
    p.propose([0], [[1, 2, 3, 1, 2]], [2])
    r = p.propose([0], [[4, 5, 4]], [2])
    assert r.draft_tokens[0].tolist() == [5, 4]


@settings(max_examples=300, deadline=None)
@given(
    context=st.lists(st.integers(0, 4), max_size=60),
    k=st.integers(0, 6),
    ngram_min=st.integers(1, 3),
    extra=st.integers(0, 3),
    prompt_len=st.integers(0, 20),
    prompt_lookup=st.booleans(),
)
def test_index_agrees_with_linear_scan(context, k, ngram_min, extra, prompt_len, prompt_lookup):
    ngram_max = ngram_min + extra
    expected = linear_scan(context, k, ngram_min, ngram_max, 0 if prompt_lookup else prompt_len)
    got = propose(context, k, ngram_min, ngram_max, prompt_len, prompt_lookup)
    assert got == expected


def test_from_lists_pads_with_placeholder():
    r = ProposalResult.from_lists([[1, 2], [], [3, 4, 5, 6]], 3)
    assert r.draft_tokens.tolist() == [[1, 2, -1], [-1, -1, -1], [3, 4, 5]]
    assert r.num_proposed.tolist() == [2, 0, 3]


def test_step_cost_does_not_grow_with_context():
    """32 sequences with 8k-token contexts: one proposing step stays cheap.

    Timing is printed, not asserted (machines are shared); the assertion is on
    the work done: a step indexes only the new positions.
    """
    rng = np.random.default_rng(0)
    B, L = 32, 8192
    p = NGramProposer(1, 4)
    contexts = [[int(t) for t in rng.integers(0, 500, size=L)] for _ in range(B)]
    for uid in range(B):
        p.add_sequence(uid, L)
    p.propose(list(range(B)), contexts, [8] * B)  # builds the indices once
    for c in contexts:
        c.extend(int(t) for t in rng.integers(0, 500, size=3))
    start = time.perf_counter()
    p.propose(list(range(B)), contexts, [8] * B)
    elapsed = time.perf_counter() - start
    print(f"\nn-gram proposal step, 32 x 8k contexts: {elapsed * 1e3:.2f} ms")
    assert all(idx._indexed_to == L + 3 for idx in p._indices.values())


def test_context_view_reads_like_the_full_list():
    from mlx_lm_server.spec_decode.drafts import Context

    history = [1, 2, 3, 4]
    c = Context(history, 9)
    full = history + [9]
    assert len(c) == 5 and c.tolist() == full
    for i in range(-5, 5):
        assert c[i] == full[i]
    for a in range(0, 6):
        for b in range(a, 7):
            assert c[a:b] == full[a:b]
    assert c[:-1] == full[:-1] and c[2:] == full[2:]
