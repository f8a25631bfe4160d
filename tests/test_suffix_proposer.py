"""The suffix proposer: drafts from the request itself, else from what earlier
requests' outputs continued with; scored, bounded, and exact after verification."""

import pytest
from test_spec_engine import (
    COUNTING,
    _assert_same_or_near_tie,
    _chat,
    _check_two_token_distribution,
    _run,
)

from mlx_lm_server.assembly import make_scheduler
from mlx_lm_server.decoding.sampling import SamplingParams
from mlx_lm_server.serving.request import GenerationRequest
from mlx_lm_server.spec_decode import make_engine
from mlx_lm_server.spec_decode.config import SpecDecodeConfig
from mlx_lm_server.spec_decode.proposer.base import Context
from mlx_lm_server.spec_decode.proposer.suffix import SuffixIndex, SuffixProposer


def _table(index: SuffixIndex) -> dict:
    return {key: dict(entry.counts) for key, entry in index._table.items()}


def test_a_seen_continuation_is_drafted_as_far_as_its_match_allows():
    index = SuffixIndex(1000)
    index.add([1, 2, 3, 4, 5, 6, 7, 8, 9])
    # Matched on (2, 3): order 2, so alpha=2 allows 4 tokens.
    assert index.draft([9, 2, 3], 10, 0.1, alpha=2.0) == ([4, 5, 6, 7], 4.0)
    # A longer match drafts further.
    assert index.draft([1, 2, 3, 4], 10, 0.1, alpha=2.0)[0] == [5, 6, 7, 8, 9]
    assert index.draft([7, 7], 10, 0.1, alpha=2.0) == ([], 0.0)


def test_the_most_frequent_continuation_wins_and_weak_evidence_stops_the_draft():
    index = SuffixIndex(1000)
    for tail in ([10, 11], [10, 11], [20, 21]):
        index.add([1, 2, 3] + tail)
    draft, expected = index.draft([1, 2, 3], 10, 0.5, alpha=4.0)
    assert draft == [10, 11] and expected == pytest.approx(2 * 2 / 3)
    # Below the threshold at the split: nothing is drafted.
    assert index.draft([1, 2, 3], 10, 0.7, alpha=4.0) == ([], 0.0)


def test_the_index_stays_within_its_bound_and_forgets_exactly_the_oldest():
    """2,000 sequences through a 5,000-token index: never more held, and the
    table is exactly the one built from the sequences still held."""
    import random

    rng = random.Random(0)
    index = SuffixIndex(5000)
    for _ in range(2000):
        index.add([rng.randrange(50) for _ in range(rng.randrange(3, 60))])
        assert index.tokens_held <= 5000
    fresh = SuffixIndex(10**9)
    for seq in index._sequences:
        fresh.add(seq)
    assert _table(index) == _table(fresh)
    assert len(index) <= (index.max_order - index.min_order + 1) * index.tokens_held
    for entry in index._table.values():
        assert entry.best_count == max(entry.counts.values())
        assert entry.counts[entry.best] == entry.best_count
        assert entry.total == sum(entry.counts.values())


def test_the_proposer_copies_its_own_text_first_and_learns_from_finished_outputs():
    p = SuffixProposer(max_tokens=1000)
    prompt = [5, 6, 7, 8, 9, 1, 2, 3, 4]
    p.add_sequence(0, len(prompt))
    # The request's own text matches at full order: prompt lookup.
    ctx = Context(prompt + [5, 6], 7)
    assert p.propose([0], [ctx], [3]).draft_tokens.tolist() == [[8, 9, 1]]
    assert p.global_drafts == 0
    p.remove_sequence(0)  # its output (everything after the prompt) is indexed
    assert p.index.tokens_held == 3
    # A new request whose output repeats that one's: drafted from the index.
    p.add_sequence(1, 2)
    got = p.propose([1], [Context([40, 41, 5], 6)], [4])
    assert got.draft_tokens.tolist()[0][:1] == [7] and p.global_drafts == 1
    # Prompts are indexed only when asked for.
    q = SuffixProposer(max_tokens=1000, index_prompts=True)
    q.add_sequence(0, len(prompt))
    q.propose([0], [Context(prompt, 5)], [2])
    q.remove_sequence(0)
    assert q.index.tokens_held == len(prompt) + 1


def _scheduler(model, tokenizer, mode, **spec):
    config = SpecDecodeConfig(mode=mode, dynamic=False, adaptive_k=False,
                              num_speculative_tokens=6, **spec) if mode != "none" else None
    s = make_scheduler(model, tokenizer, max_batch_size=32, max_queued_requests=1000,
                  engine=make_engine(model, config) if config else None)
    s.start()
    return s


def test_repeated_work_drafts_from_earlier_outputs_with_greedy_output_unchanged(smollm2):
    """Prompt lookup off, so only the global index can draft: the second time
    a task's answer is written, earlier outputs supply accepted drafts, and
    every answer equals plain decoding's."""
    model, tokenizer = smollm2
    plain = _scheduler(model, tokenizer, "none")
    suffix = _scheduler(model, tokenizer, "suffix", prompt_lookup=False)
    greedy = SamplingParams(temperature=0)
    tasks = ["Write a Python function that returns the square of a number.",
             "Write a Python function that returns the cube of a number."]
    try:
        for text in tasks * 2:
            prompt = _chat(tokenizer, text)
            req = GenerationRequest(prompt, 48, greedy)
            (a, _, _), = _run(plain, [req])
            (b, _, done), = _run(suffix, [req])
            _assert_same_or_near_tie(model, prompt, a, b)
        proposer = suffix.engine.proposer
        counts = suffix.spec_stats.tokens
    finally:
        for s in (plain, suffix):
            s.shutdown()
            s.join(10)
    assert proposer.global_drafts > 0
    assert counts.num_accepted_tokens > 20, counts
    assert done.spec_decode["accepted_tokens"] > 0


@pytest.mark.slow  # long by nature (a distribution, 36 s): --run-slow runs it
def test_sampled_tokens_follow_the_target_distribution_with_global_drafts(smollm2):
    """Drafts from the global index are deterministic (one-hot q): rejection
    sampling keeps the exact distribution. Prompt lookup off and the index
    seeded with the prompt's likely continuations, so the drafts verified are
    the global index's."""
    model, tokenizer = smollm2
    spec = _scheduler(model, tokenizer, "suffix", prompt_lookup=False)
    prompt = tokenizer.encode(COUNTING)
    index = spec.engine.proposer.index
    for tail in ([" three", " one"], [" three", " four"], [" one", " two"]):
        index.add(prompt + [tokenizer.encode(t)[0] for t in tail])
    try:
        _check_two_token_distribution(model, tokenizer, spec)
    finally:
        spec.shutdown()
        spec.join(10)
    assert spec.engine.proposer.global_drafts > 0


def test_the_metrics_report_drafts_from_the_index(smollm2):
    model, tokenizer = smollm2
    s = _scheduler(model, tokenizer, "suffix", prompt_lookup=False)
    prompt = tokenizer.encode(COUNTING)
    s.engine.proposer.index.add(prompt + tokenizer.encode(" three one two three"))
    try:
        _run(s, [GenerationRequest(prompt, 6, SamplingParams(temperature=0))])
        body = s.spec_stats.snapshot()
    finally:
        s.shutdown()
        s.join(10)
    assert body["proposer"]["drafts_from_index"] > 0
    assert body["proposer"]["index_tokens"] >= len(prompt)
