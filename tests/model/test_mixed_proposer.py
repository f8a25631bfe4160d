"""A cheap proposer mixed with a draft model, per row (``--spec-decode ngram,draft``).

SmolLM2 drafts for itself (its drafts are the target's own greedy tokens), so
which proposer a row took is visible in what it keeps.
"""

import pytest
from test_draft_model import _scheduler, _stop
from test_spec_engine import (
    _assert_same_or_near_tie,
    _prompts,
    _run,
    _tv,
    exact_two_token_distribution,
)

from mlx_lm_server.decoding.sampling import SamplingParams
from mlx_lm_server.serving.request import GenerationRequest
from mlx_lm_server.spec_decode.drafts import Context
from mlx_lm_server.spec_decode.proposer.draft_model import DraftModelProposer
from mlx_lm_server.spec_decode.proposer.per_row import PerRowProposer
from mlx_lm_server.spec_decode.proposer.ngram import NGramProposer

GREEDY = SamplingParams(temperature=0)


@pytest.fixture
def mixed(smollm2):
    """The mix with two greedy rows (uids 0 and 1), and a record of the
    draft model's proposals."""
    proposer = PerRowProposer(NGramProposer(), DraftModelProposer(smollm2[0]))
    calls = []
    propose = proposer.model.propose

    def counted(uids, contexts, k):
        calls.append(list(uids))
        return propose(uids, contexts, k)

    proposer.model.propose = counted
    for uid in (0, 1):
        proposer.add_sequence(uid, 1, GREEDY)
    return proposer, calls


def _contexts(tokenizer, texts):
    out = []
    for t in texts:
        ids = tokenizer.encode(t)
        out.append(Context(ids[:-1], ids[-1]))
    return out


COPYING = "red green blue red green blue red green blue red"
NOVEL = "The history of the printing press begins"


def test_rows_without_a_cheap_draft_take_the_draft_model(smollm2, mixed):
    proposer, calls = mixed
    tokenizer = smollm2[1]
    contexts = _contexts(tokenizer, [COPYING, NOVEL])
    result = proposer.propose([0, 1], contexts, [4, 4])
    assert result.sources == ["ngram", "draft"]
    assert calls == [[1]]  # the copying row has no record yet: no shadow draft
    assert result.num_proposed.tolist() == [4, 4]
    # The copying row's draft is prompt lookup's: " green blue red green".
    assert tokenizer.decode(result.draft_tokens[0].tolist()) == " green blue red green"
    proposer.observe_verification([0, 1], [4, 4])


def test_a_step_where_every_row_copies_skips_the_draft_model(smollm2, mixed):
    proposer, calls = mixed
    tokenizer = smollm2[1]
    contexts = _contexts(tokenizer, [COPYING, COPYING + " green"])
    result = proposer.propose([0, 1], contexts, [4, 4])
    assert result.sources == ["ngram", "ngram"] and result.num_proposed.tolist() == [4, 4]
    assert calls == []
    assert proposer.stats()["draft_model_skipped_steps"] == 1
    proposer.observe_verification([0, 1], [4, 4])


def test_a_row_whose_cheap_drafts_are_kept_is_never_prefilled_on_the_draft_model(
        smollm2, mixed):
    """The draft model runs every step for the novel row, and never for the
    copying row whose prompt-lookup drafts are all kept: its prompt is not
    prefilled on the draft model for drafts no one would use."""
    proposer, calls = mixed
    tokenizer = smollm2[1]
    copying, novel = COPYING, _contexts(tokenizer, [NOVEL])[0]
    emitted = [1000, 2000, 3000]  # by row 1: new tokens, nothing for prompt lookup
    assert not set(emitted) & set(novel.tolist())
    for token in emitted:
        contexts = [_contexts(tokenizer, [copying])[0], novel]
        result = proposer.propose([0, 1], contexts, [4, 4])
        assert result.sources == ["ngram", "draft"]
        proposer.observe_verification([0, 1], [4, 0])
        # Row 0 emitted its four drafts and one more; row 1 one token.
        copying += tokenizer.decode(result.draft_tokens[0].tolist()) + " blue"
        novel = Context(novel.tolist(), token)
    assert calls == [[1], [1], [1]]
    assert not proposer.model.holds(0) and proposer.model.holds(1)


def test_a_row_moves_to_the_draft_model_when_its_cheap_drafts_fail(smollm2, mixed):
    """The copying row's prompt-lookup drafts are all refused; from then on
    the draft model drafts for it too (unused: its shadow), and where those
    drafts match what the row emitted, the row takes the draft model's drafts."""
    proposer, calls = mixed
    tokenizer = smollm2[1]
    contexts = _contexts(tokenizer, [COPYING, NOVEL])
    result = proposer.propose([0, 1], contexts, [4, 4])
    assert result.sources == ["ngram", "draft"] and calls == [[1]]
    proposer.observe_verification([0, 1], [0, 0])
    green = tokenizer.encode(COPYING + " green")[-1]
    contexts = [Context(contexts[0].tolist(), green), Context(contexts[1].tolist(), 1000)]
    result = proposer.propose([0, 1], contexts, [4, 4])
    assert result.sources == ["ngram", "draft"] and calls[-1] == [0, 1]
    # The model's unused draft for row 0.
    shadow = [int(t) for t in proposer._last.chosen.model_drafts[0]]
    assert shadow != result.draft_tokens[0].tolist()
    proposer.observe_verification([0, 1], [0, 0])
    assert not proposer.choice.prefers_model(0)  # the shadow is settled at the next proposal
    # Row 0 emitted what the draft model had drafted, not prompt lookup's draft.
    contexts = [Context(contexts[0].tolist() + shadow[:-1], shadow[-1]),
                Context(contexts[1].tolist(), 2000)]
    result = proposer.propose([0, 1], contexts, [4, 4])
    assert proposer.choice.prefers_model(0)
    assert result.sources == ["draft", "draft"]


def test_the_draft_model_runs_only_where_its_drafts_pay_for_its_forwards(smollm2, mixed):
    """A row without a cheap draft takes the draft model's drafts only while
    what it keeps of them pays for the model's forwards at the step's price;
    priced out, the step verifies the cheap drafts alone, and the model still
    drafts in one step of MODEL_PROBE_INTERVAL to keep its record fresh."""
    from mlx_lm_server.spec_decode.proposer.mixed import MODEL_PROBE_INTERVAL

    proposer, calls = mixed
    contexts = _contexts(smollm2[1], [COPYING, NOVEL])
    fresh = iter(range(20000, 30000))  # tokens new to the novel row: nothing to copy

    def step(price=None):
        """One proposal and its verdict: the copying row keeps 3 of its 4
        drafts, the novel row 1 of the model's; both contexts move on."""
        nonlocal contexts
        proposer.price_step(lambda: price)
        result = proposer.propose([0, 1], contexts, [4, 4])
        drafts, lengths = result.draft_tokens.tolist(), result.num_proposed.tolist()
        kept = [min(n, 3 if i == 0 else 1) for i, n in enumerate(lengths)]
        proposer.observe_verification([0, 1], kept)
        contexts = [Context(contexts[0].tolist() + drafts[0][:3], drafts[0][3]),
                    Context(contexts[1].tolist() + drafts[1][:kept[1]], next(fresh))]
        return lengths

    assert step() == [4, 4] and calls == [[1]]  # nothing priced yet: it runs, and is timed
    forward = proposer.choice._forward_seconds[1].value
    # Without the model the step emits (1 + 3) + 1 tokens, with it one more:
    # it pays when the step costs more than 5 x 4 draft forwards.
    assert step(price=1000 * forward) == [4, 4] and len(calls) == 2
    assert step(price=2 * forward) == [4, 0] and len(calls) == 2
    assert proposer.stats()["draft_model_priced_out_steps"] == 1
    for _ in range(MODEL_PROBE_INTERVAL):
        step(price=2 * forward)
    assert len(calls) == 3  # one probe


def test_a_row_far_behind_in_the_draft_cache_is_prefilled_again(smollm2):
    """Rows that took cheap drafts for many steps lag in the draft model's
    cache; one that is cheaper to prefill again than to catch up (in a
    forward as wide as the lag for every row) leaves the cache, and its
    drafts are still the draft model's own."""
    model, tokenizer = smollm2
    proposer = DraftModelProposer(model)
    contexts = _contexts(tokenizer, [COPYING, NOVEL])
    for uid in (0, 1):
        proposer.add_sequence(uid, 1, GREEDY)
    proposer.propose([0, 1], contexts, [2, 2])
    proposer.observe_verification([0, 1], [0, 0])
    longer = tokenizer.encode(" and then " + NOVEL * 8)
    contexts = [Context(contexts[0].tolist() + longer, 13), Context(contexts[1].tolist(), 13)]
    proposer.forget_lagging([0, 1], contexts)
    assert 0 not in proposer.fed and 1 in proposer.fed  # row 1 lags by 1 token only
    result = proposer.propose([0, 1], contexts, [3, 3])
    fresh = DraftModelProposer(model)
    for uid in (0, 1):
        fresh.add_sequence(uid, 1, GREEDY)
    assert result.draft_tokens.tolist() == fresh.propose([0, 1], contexts, [3, 3]).draft_tokens.tolist()


def test_greedy_output_equals_plain_decoding_with_both_proposers(smollm2, smollm2_path):
    """Copying and open prompts together, staggered: tokens equal plain
    decoding, both proposers drafted, and usage counts drafts per proposer."""
    model, tokenizer = smollm2
    from mlx_lm_server.assembly import make_scheduler

    plain = make_scheduler(model, tokenizer)
    plain.start()
    spec = _scheduler(model, tokenizer, smollm2_path, smollm2_path, mode="ngram,draft",
                      num_speculative_tokens=4, dynamic=False, adaptive_k=False)
    try:
        prompts = _prompts(tokenizer)
        reqs = [GenerationRequest(p, 32, GREEDY) for p in prompts]
        base = _run(plain, reqs)
        ours = _run(spec, reqs, stagger=0.2)
        for p, (a, _, _), (b, _, done) in zip(prompts, base, ours):
            _assert_same_or_near_tie(model, p, a, b)
        totals = spec.spec_stats.snapshot()["totals"]["by_proposer"]
        assert totals["ngram"]["draft_tokens"] > 0 and totals["draft"]["draft_tokens"] > 0
        per_request = [d.spec_decode.get("by_proposer", {}) for _, _, d in ours]
        for name in ("ngram", "draft"):
            assert sum(u.get(name, {}).get("accepted_tokens", 0) for u in per_request) == \
                totals[name]["accepted_tokens"]
    finally:
        _stop(plain, spec)


@pytest.mark.slow  # long by nature (a distribution); scripts/mutants.py runs it
def test_sampled_rows_keep_the_target_distribution_from_either_proposer(
        smollm2, smollm2_path, tiny_qwen3_path, monkeypatch):
    """Temperature 1, top_k 3: joint frequencies of the first two tokens
    against the exact ones, for a row drafted by prompt lookup (one-hot q)
    and a row drafted by a random-weight draft model (its q far from p, so
    most of its drafts are refused), verified in the same passes. 300 seeds
    per prompt; TV below 0.1 over 9 outcomes. Drafts that are refused do
    not pay for the model's forwards: every step probes, so that it drafts."""
    from mlx_lm_server.spec_decode.proposer import mixed as mixed_module

    monkeypatch.setattr(mixed_module, "MODEL_PROBE_INTERVAL", 1)
    model, tokenizer = smollm2
    s = _scheduler(model, tokenizer, smollm2_path, tiny_qwen3_path, mode="ngram,draft",
                   num_speculative_tokens=2, dynamic=False, adaptive_k=False)
    prompts = [tokenizer.encode(COPYING), tokenizer.encode(NOVEL)]
    n = 300
    try:
        reqs = [GenerationRequest(prompts[i % 2], 2, SamplingParams(temperature=1.0, top_k=3,
                                                                   seed=i))
                for i in range(2 * n)]
        counts = [{}, {}]
        for i, (ids, _, _) in enumerate(_run(s, reqs)):
            counts[i % 2][tuple(ids)] = counts[i % 2].get(tuple(ids), 0) + 1 / n
        by = s.spec_stats.snapshot()["totals"]["by_proposer"]
        assert by["ngram"]["draft_tokens"] >= n // 2 and by["draft"]["draft_tokens"] >= n // 2
        # The random draft model's guesses are mostly refused.
        assert by["draft"]["acceptance_rate"] < 0.5
        for prompt, seen in zip(prompts, counts):
            exact = exact_two_token_distribution(model, prompt, top_k=3)
            assert _tv(seen, exact) < 0.1, (_tv(seen, exact), seen, exact)
    finally:
        _stop(s)


def test_a_rows_tree_of_cheap_drafts_keeps_its_parent_links(smollm2):
    """Prompt lookup's tree for a copying row, beside the draft model's chain
    for a novel one: the mix hands both on as they were drafted."""
    tokenizer = smollm2[1]
    proposer = PerRowProposer(NGramProposer(tree_paths=3), DraftModelProposer(smollm2[0]))
    alone = NGramProposer(tree_paths=3)
    for p in (proposer, alone):
        p.add_sequence(0, 1, GREEDY)
    proposer.add_sequence(1, 1, GREEDY)
    branching = "fox 1; the quick brown fox jumps; the quick red fox naps; the quick"
    contexts = _contexts(tokenizer, [branching, NOVEL])
    own = alone.propose([0], contexts[:1], [6])
    assert own.parents is not None  # the lookup branches here
    result = proposer.propose([0, 1], contexts, [6, 6])
    assert result.sources == ["ngram", "draft"]
    assert result.draft_tokens[0].tolist() == own.draft_tokens[0].tolist()
    assert result.parents[0].tolist() == own.parents[0].tolist()
    assert result.parents[1].tolist() == list(range(6))  # the model's chain
