"""The suffix proposer: drafts from the request itself, else from what earlier
requests' outputs continued with; scored, bounded, and exact after verification."""

import random

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
from mlx_lm_server.spec_decode.drafts import Context
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


def _random_index(seed: int, vocab: int = 12) -> tuple[SuffixIndex, random.Random]:
    """Short sequences over a small vocabulary: every context has several
    continuations, with unequal counts."""
    rng = random.Random(seed)
    index = SuffixIndex(10**6)
    for _ in range(60):
        index.add([rng.randrange(vocab) for _ in range(rng.randrange(4, 30))])
    return index, rng


def test_a_tree_of_width_one_is_the_chain_node_for_node():
    index, rng = _random_index(1)
    drafted = 0
    for _ in range(500):
        context = [rng.randrange(12) for _ in range(rng.randrange(2, 8))]
        k, min_p, alpha = rng.randrange(1, 9), rng.choice([0.0, 0.05, 0.1, 0.3]), 4.0
        chain, expected = index.draft(context, k, min_p, alpha)
        tokens, parents, probs, _ = index.tree(context, k, min_p, alpha, width=1)
        assert tokens == chain and parents == list(range(len(chain)))
        assert sum(probs) == pytest.approx(expected)
        drafted += len(chain) > 1
    assert drafted > 100


def test_the_second_most_frequent_continuation_is_a_sibling_ranked_after_the_first():
    index = SuffixIndex(1000)
    for tail in ([30, 31], [30, 31], [30, 31], [20, 21], [20, 21], [10, 11]):
        index.add([1, 2, 3] + tail)
    tokens, parents, probs, _ = index.tree([1, 2, 3], 8, 0.1, 4.0, width=3)
    # Likeliest first: 30 (3/6) and its child, then 20 (2/6) and its child,
    # then 10 (1/6) and its child; each branch hangs off the root.
    assert tokens == [30, 31, 20, 21, 10, 11]
    assert parents == [0, 1, 0, 3, 0, 5]
    assert probs == pytest.approx([3 / 6, 3 / 6, 2 / 6, 2 / 6, 1 / 6, 1 / 6])
    # Width 2: the least frequent continuation is not offered.
    assert index.tree([1, 2, 3], 8, 0.1, 4.0, width=2)[0] == [30, 31, 20, 21]
    # Below min_probability a branch is not taken, however wide the tree.
    assert index.tree([1, 2, 3], 8, 0.3, 4.0, width=3)[0] == [30, 31, 20, 21]


def test_a_tree_keeps_its_budget_its_order_and_takes_the_likeliest_nodes():
    """Random indexes and contexts: at most k nodes, no deeper than the
    chain's limit; parents before children and siblings distinct, likeliest
    first; and best first: no node left out whose parent was taken is
    likelier than a node taken (checked against the index's own counts)."""
    index, rng = _random_index(2)
    branched = full = 0
    for _ in range(400):
        context = [rng.randrange(12) for _ in range(rng.randrange(2, 8))]
        k, width, min_p = rng.randrange(1, 13), rng.randrange(2, 5), rng.choice([0.01, 0.1])
        tokens, parents, probs, _ = index.tree(context, k, min_p, 4.0, width)
        _, match = index._lookup(context[-index.max_order:])
        assert len(tokens) <= k
        depth, tails, taken = [0], [list(context)], {}
        for j, (t, parent) in enumerate(zip(tokens, parents)):
            assert 0 <= parent <= j  # input positions: the parent comes first
            assert (parent, t) not in taken  # siblings are distinct tokens
            taken[(parent, t)] = probs[j]
            depth.append(depth[parent] + 1)
            tails.append(tails[parent] + [t])
            entry, _ = index._lookup(tails[parent][-index.max_order:])
            p_parent = probs[parent - 1] if parent else 1.0
            assert probs[j] == pytest.approx(p_parent * entry.counts[t] / entry.total)
            assert probs[j] >= min_p and depth[-1] <= max(1, int(4.0 * match))
        for j, parent in enumerate(parents):  # siblings likeliest first
            later = [probs[i] for i in range(j + 1, len(parents)) if parents[i] == parent]
            assert all(probs[j] >= p for p in later)
        # The frontier: each taken node's (and the root's) offered children not taken.
        for at in range(len(tokens) + 1):
            if at and depth[at] >= max(1, int(4.0 * match)):
                continue
            entry, _ = index._lookup(tails[at][-index.max_order:])
            if entry is None:
                continue
            p_at = probs[at - 1] if at else 1.0
            ranked = sorted(entry.counts.items(), key=lambda tc: (-tc[1], tc[0]))
            offered = [entry.best] + [t for t, _ in ranked if t != entry.best][:width - 1]
            for t in offered:
                p = p_at * entry.counts[t] / entry.total
                if (at, t) not in taken and p >= min_p:
                    assert len(tokens) == k and p <= min(probs) + 1e-12
        branched += len(set(parents)) < len(parents)
        full += len(tokens) == k
    assert branched > 100 and full > 100


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


def test_the_requests_own_continuation_and_the_indexs_alternatives_share_one_tree():
    """The request's own path decays by OWN_TRUST a depth; where the index
    also has a next token it takes the rest of the chance: a sibling that
    enters the tree once it is likelier than the own path's next node."""
    index = SuffixIndex(1000)
    index.add([1, 2, 3, 50, 51])
    own = [[60, 61, 62, 63]]
    tokens, parents, probs, from_index = index.tree([9, 2, 3], 6, 0.1, 4.0, 2, own, [1.0])
    assert tokens == [60, 61, 62, 63, 50, 51] and parents == [0, 1, 2, 3, 0, 5]
    assert probs == pytest.approx([0.8, 0.64, 0.512, 0.4096, 0.2, 0.2]) and from_index == 2
    # Four nodes: the own path is likelier all along; width 1: no sibling at all.
    assert index.tree([9, 2, 3], 4, 0.1, 4.0, 2, own, [1.0])[0] == [60, 61, 62, 63]
    assert index.tree([9, 2, 3], 6, 0.1, 4.0, 1, own, [1.0])[0] == [60, 61, 62, 63]
    # Two own paths share the trust by weight, the index's token the rest;
    # at a tie the own path comes first.
    tokens, parents, probs, _ = index.tree([9, 2, 3], 3, 0.1, 4.0, 3,
                                           [[60, 61], [70, 71]], [3.0, 1.0])
    assert tokens == [60, 61, 70] and parents == [0, 1, 0]
    assert probs == pytest.approx([0.6, 0.48, 0.2])
    # An even split where both offer: the index's branch, sure beyond its
    # first token, goes deeper than the own path, which decays alone.
    tokens, parents, probs, _ = index.tree([9, 2, 3], 4, 0.1, 4.0, 2, own, [1.0], share=0.5)
    assert tokens == [60, 50, 51, 61] and parents == [0, 0, 2, 1]
    assert probs == pytest.approx([0.5, 0.5, 0.5, 0.4])


def test_a_wide_proposer_drafts_one_tree_of_its_own_text_and_the_index():
    p = SuffixProposer(max_tokens=1000, tree_width=2)
    p.index.add([7, 8, 30, 31, 32])
    prompt = [7, 8, 20, 21, 22, 5, 6]
    p.add_sequence(0, len(prompt))
    got = p.propose([0], [Context(prompt + [7], 8)], [8])
    tokens, parents = got.draft_tokens[0].tolist(), got.parents[0].tolist()
    # A match of 2 tokens (under ngram_max): prompt lookup's 20 and the
    # index's 30 split the root evenly; the index's branch, certain after
    # it, goes on at 0.5, the own path decays by 0.8 a node.
    assert tokens == [20, 30, 31, 32, 21, 22, 5, 6]
    assert parents == [0, 0, 2, 3, 1, 5, 6, 7]
    # A full-order match (7, 8, 20, 21) trusts the request: its path at
    # 0.8, 0.64, 0.51 outranks the index's 40 at 0.2 (an even split: 0.5).
    p.index.add([8, 20, 21, 40, 41])
    got = p.propose([0], [Context(prompt + [7, 8, 20], 21)], [3])
    assert got.draft_tokens.tolist() == [[22, 5, 6]] and got.parents is None
    assert p.drafts == 2 and p.global_drafts == 1  # the second: the request's own nodes only


def _chain(proposer: SuffixProposer, uid: int, context, k: int) -> list:
    """The chain a suffix proposer drafted before trees: prompt lookup at a
    full-order match, else the global draft where it expects more than one
    token kept."""
    own = proposer._synced(uid, context)
    mine = own.propose(k)
    if k <= 0 or (mine and own.match >= own.ngram_max):
        return mine
    theirs, expected = proposer.index.draft(own.tokens, k, proposer.min_probability,
                                            proposer.alpha)
    return theirs if theirs and (not mine or expected > 1.0) else mine


def test_the_proposer_at_tree_width_one_drafts_the_chain_it_drafted_before():
    """Requests that repeat each other's phrases, served one after another:
    every step's proposal equals the chain, with no parents."""
    rng = random.Random(3)
    phrases = [[rng.randrange(40) for _ in range(rng.randrange(3, 9))] for _ in range(6)]
    p = SuffixProposer(max_tokens=2000)
    from_index = 0
    for uid in range(30):
        tokens = [t for _ in range(12) for t in rng.choice(phrases)]
        prompt, output = tokens[:10], tokens[10:]
        p.add_sequence(uid, len(prompt))
        for pos in range(1, len(output)):
            context, k = Context(prompt + output[:pos - 1], output[pos - 1]), rng.randrange(9)
            want = _chain(p, uid, context, k)
            before = p.global_drafts
            got = p.propose([uid], [context], [k])
            from_index += p.global_drafts > before
            assert got.parents is None
            assert got.draft_tokens[0, :got.num_proposed[0]].tolist() == want
        p.remove_sequence(uid)
    assert from_index > 20 and p.drafts > from_index


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
        proposer = suffix.engine.proposer.lookup  # the mode's, a source of the per-row proposer
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
    index = spec.engine.proposer.lookup.index
    for tail in ([" three", " one"], [" three", " four"], [" one", " two"]):
        index.add(prompt + [tokenizer.encode(t)[0] for t in tail])
    try:
        _check_two_token_distribution(model, tokenizer, spec)
    finally:
        spec.shutdown()
        spec.join(10)
    assert spec.engine.proposer.lookup.global_drafts > 0


def test_the_metrics_report_drafts_from_the_index(smollm2):
    model, tokenizer = smollm2
    s = _scheduler(model, tokenizer, "suffix", prompt_lookup=False)
    prompt = tokenizer.encode(COUNTING)
    s.engine.proposer.lookup.index.add(prompt + tokenizer.encode(" three one two three"))
    try:
        _run(s, [GenerationRequest(prompt, 6, SamplingParams(temperature=0))])
        body = s.spec_stats.snapshot()
    finally:
        s.shutdown()
        s.join(10)
    assert body["proposer"]["drafts_from_index"] > 0
    assert body["proposer"]["index_tokens"] >= len(prompt)
