"""Shadow drafts: acceptance learned on plain steps, without verifying."""


import pytest
from test_spec_engine import _run

from mlx_lm_server.assembly import make_scheduler
from mlx_lm_server.decoding.sampling import SamplingParams
from mlx_lm_server.serving.request import GenerationRequest
from mlx_lm_server.spec_decode.config import SpecDecodeConfig
from mlx_lm_server.spec_decode.control.controller import DynamicSpecController
from mlx_lm_server.spec_decode.control.shadow import ShadowDrafts, matching_prefix
from mlx_lm_server.spec_decode.drafts import ProposalResult
from mlx_lm_server.spec_decode.engine import SpecDecodeEngine
from mlx_lm_server.spec_decode.proposer.base import BaseProposer
from mlx_lm_server.spec_decode.proposer.draft_model import DraftModelProposer
from mlx_lm_server.spec_decode.proposer.ngram import NGramProposer
from mlx_lm_server.spec_decode.proposer.per_row import PerRowProposer


def _proposer(drafts: dict):
    """Proposes ``drafts[uid]`` (a fixed list) whatever the context."""
    def propose(uids, contexts, ks):
        return ProposalResult.from_lists([drafts.get(u, []) for u in uids], max(ks))
    return propose


def _step(shadow, uids, histories, k, propose):
    """One plain step's shadow work, in the engine's order: settle, then ask."""
    return shadow.settle(uids, histories), shadow.ask(uids, histories, k, propose)


def _serve(model, tokenizer, request, engine=None):
    """(ids, text, done) of one request served alone, the scheduler stopped after."""
    s = make_scheduler(model, tokenizer, engine=engine)
    s.start()
    try:
        [result] = _run(s, [request])
    finally:
        s.shutdown()
        s.join(10)
    return result


def test_matching_prefix():
    assert matching_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert matching_prefix([1, 2], [1, 2, 3]) == 2
    assert matching_prefix([5], []) == 0


def test_a_draft_settles_when_the_emitted_tokens_decide_it():
    shadow = ShadowDrafts()
    propose = _proposer({1: [7, 8, 9], 2: [5, 5, 5], 3: []})
    settled, asked = _step(shadow, [1, 2, 3], [[0], [0], [0]], 3, propose)
    assert settled == [] and asked == [(1, 3, 3), (2, 3, 3), (3, 3, 0)]
    # uid 1 emitted 7 then 8 (still matching: its two tokens are reported kept
    # now, the draft stays open), uid 2 emitted 5 then 6 (rejected at 2)
    settled, asked = _step(shadow, [1, 2, 3], [[0, 7, 8], [0, 5, 6], [0, 1, 2]], 3, propose)
    assert settled == [(1, 2, 2, False), (2, 3, 1, False)]
    assert asked == [(2, 3, 3), (3, 3, 0)]  # uid 1 keeps its open draft
    settled, _ = _step(shadow, [1], [[0, 7, 8]], 3, propose)
    assert settled == []  # nothing new emitted: nothing reported twice
    settled, _ = _step(shadow, [1], [[0, 7, 8, 9, 4]], 3, propose)
    # The last draft token matched too: the rest kept. The draft had copied
    # two tokens before, but had only the pending token's left: not matching.
    assert settled == [(1, 1, 1, False)]
    # A draft rejected after part of it was reported: the rest and one failure.
    shadow = ShadowDrafts()
    _step(shadow, [1], [[0]], 3, propose)
    assert _step(shadow, [1], [[0, 7]], 3, propose)[0] == [(1, 1, 1, False)]
    assert shadow.matching([1, 2]) == {1}  # one copied, the pending one and one more left
    # The rest, after the draft had copied a token: a matching draft's outcome.
    assert _step(shadow, [1], [[0, 7, 5]], 3, propose)[0] == [(1, 2, 0, True)]
    assert shadow.matching([1]) == frozenset()
    shadow.forget(1)
    shadow.clear()
    assert _step(shadow, [1], [[0, 7, 8, 9, 4, 1]], 3, propose)[0] == []


def test_the_rest_of_a_matching_shadow_draft_teaches_the_matching_estimate():
    """What a shadow draft keeps after it copied its first token is what a
    verification of a matching row would have kept: the controller learns
    the matching acceptance from it while off, so an estimate that fell too
    low to verify can recover without verifying."""
    controller = DynamicSpecController(4, alpha=1.0)
    shadow = ShadowDrafts()
    shadow.report_asked(controller, [1], [[0]], 4, _proposer({1: [7, 8, 9, 10]}))
    shadow.report_settled(controller, [1], [[0, 7]])  # its first token: not matching before
    assert controller.estimates.matching_acceptance.value is None
    assert shadow.matching([1]) == {1}
    shadow.report_settled(controller, [1], [[0, 7, 8, 5]])  # 8 kept, 9 rejected
    assert controller.estimates.matching_acceptance.value == 0.5  # one success, one failure
    assert controller.acceptance(1) == 0.5  # the row's own estimate learns the same piece


@pytest.mark.parametrize("mode", ["ngram", "ngram,draft"])
def test_speculation_turns_back_on_without_probes(smollm2, mode):
    """A controller that starts off (first drafts rejected) and never probes
    turns speculation on once shadow drafts show the text is predictable; a
    mix's shadow drafts are its cheap proposer's, and its draft model never
    runs on a plain step."""
    model, tokenizer = smollm2
    controller = DynamicSpecController(6, alpha=0.5, warmup=1, probe_interval=0)
    controller.cost = lambda batch_size, k: 1.0 + 0.15 * k
    for uid in range(4):  # a pessimistic start: every draft so far was rejected
        controller.observe_acceptance(uid, drafted=6, accepted=0)
    proposer = NGramProposer(1, 4)
    if mode == "ngram,draft":  # SmolLM2 drafting for itself
        proposer = PerRowProposer(proposer, DraftModelProposer(model))
        model_calls = []
        propose = proposer.model.propose
        proposer.model.propose = lambda *a: model_calls.append(a) or propose(*a)
    engine = SpecDecodeEngine(model, SpecDecodeConfig(
        mode=mode, num_speculative_tokens=6, calibration_seconds=0,
        draft_model_path="smollm2" if mode != "ngram" else None), proposer, controller)
    loop = tokenizer.encode("the cat sat on the mat. " * 12)
    _serve(model, tokenizer, GenerationRequest(loop, 80, SamplingParams(temperature=0)), engine)
    assert engine.steps.plain_steps > 0  # it started off
    assert engine.steps.verify_steps > 3  # and came back on with no probe
    assert engine.steps.k_counts.get(0, 0) < 40
    if mode == "ngram,draft":
        assert len(model_calls) <= engine.steps.verify_steps


class _Oracle(BaseProposer):
    """Drafts the greedy continuation itself: every draft token matches."""

    cheap = True

    def __init__(self, full: list):
        self.full = full

    def add_sequence(self, uid, prompt_len, params=None):
        pass

    def remove_sequence(self, uid):
        pass

    def propose(self, uids, contexts, ks):
        return ProposalResult.from_lists(
            [self.full[len(c) : len(c) + k] for c, k in zip(contexts, ks)], max(ks))


def _decisions_serving_repeated_text(model, tokenizer, controller) -> tuple[list, object]:
    """The controller's decisions (and the engine) while one greedy request
    over repeated text is served with drafts that are its greedy
    continuation, on a cost line of real steps where a draft costs 0.1 of
    a plain step; the output is asserted equal to plain decoding's."""
    prompt = tokenizer.encode("the cat sat on the mat. " * 4)
    request = lambda: GenerationRequest(prompt, 12, SamplingParams(temperature=0))
    greedy, _, _ = _serve(model, tokenizer, request())
    controller.cost = lambda batch_size, k: 1.0 + 0.1 * k
    controller.costs.has_plain = lambda batch_size: True
    controller.costs.priced_by_real_steps = lambda batch_size: True
    decisions = []
    choose = controller.choose
    controller.choose = lambda uids, *args, **kw: decisions.append(choose(uids, *args, **kw)) \
        or decisions[-1]
    engine = SpecDecodeEngine(model, SpecDecodeConfig(mode="ngram", num_speculative_tokens=4,
                                                      calibration_seconds=0),
                              _Oracle(prompt + greedy), controller)
    ids, _, _ = _serve(model, tokenizer, request(), engine)
    assert ids == greedy
    return decisions, engine


def test_a_shadow_draft_counts_in_the_very_next_decision(smollm2):
    """Each step is decided after the tokens emitted before it have settled
    the open shadow drafts. Estimates follow the last observation (alpha = 1):
    a controller off on rejected drafts hears at the second step that the
    first step's shadow draft matched, and speculates there, not a step later."""
    controller = DynamicSpecController(4, alpha=1.0, warmup=1, probe_interval=0)
    controller.observe_acceptance(-1, drafted=4, accepted=0)  # the global estimate: off
    decisions, _ = _decisions_serving_repeated_text(*smollm2, controller)
    assert [d.k for d in decisions[:2]] == [0, 4], decisions[:2]
    assert not decisions[1].reason.startswith("matching"), decisions[1]


def test_a_run_of_matching_text_verifies_before_the_acceptance_estimate_learns_of_it(smollm2):
    """The step after a shadow draft's first token matched verifies on the
    matching estimate (see ``ShadowDrafts.matching``), while the acceptance
    EMA (slow, alpha = 0.05, the row still on the global estimate, every
    earlier draft rejected) would keep the engine off for many more steps."""
    controller = DynamicSpecController(4, alpha=0.05, warmup=2, probe_interval=0)
    for _ in range(10):
        controller.observe_acceptance(-1, drafted=4, accepted=0)  # the global estimate: off
    decisions, engine = _decisions_serving_repeated_text(*smollm2, controller)
    assert [d.k for d in decisions[:2]] == [0, 4], decisions[:2]
    second = decisions[1]
    assert second.reason.startswith("matching") and second.acceptance < 0.1, second
    assert engine.steps.matching_steps >= 1


def _proposals_while_serving(model, tokenizer, engine) -> list:
    """The proposer calls an engine makes while serving one short greedy request."""
    asked = []
    real = engine.proposer.propose
    engine.proposer.propose = lambda *a: asked.append(a) or real(*a)
    _serve(model, tokenizer, GenerationRequest(tokenizer.encode("the cat sat on the mat. " * 4),
                                               12, SamplingParams(temperature=0)), engine)
    return asked


def test_no_shadow_drafts_above_the_batch_cap(smollm2):
    """At or above ``--spec-decode-disable-batch-size`` nothing can speculate:
    drafting on its plain steps would be host work for nothing."""
    model, tokenizer = smollm2
    engine = SpecDecodeEngine(model, SpecDecodeConfig(mode="ngram", num_speculative_tokens=4,
                                                      disable_by_batch_size=1,
                                                      calibration_seconds=0),
                              NGramProposer(1, 4))
    asked = _proposals_while_serving(model, tokenizer, engine)
    assert engine.steps.plain_steps > 5 and asked == []


def test_no_shadow_drafts_where_no_k_can_pay(smollm2):
    """Where a pass over k + 1 tokens costs k + 1 plain steps, no acceptance
    could make speculation pay: shadow drafting would be host work for
    nothing, on every plain step. The same engine with a cheap pass does draft."""
    model, tokenizer = smollm2
    asked_by_cost = {}
    for per_token in (1.0, 0.1):
        controller = DynamicSpecController(4, warmup=1, probe_interval=0,
                                           cost_probe_interval=0)
        controller.cost = lambda batch_size, k, c=per_token: 1.0 + c * k
        controller.costs.has_plain = lambda batch_size: True
        controller.costs.observed = lambda batch_size, k: 3  # real steps, not calibration
        for uid in range(4):  # drafts rejected so far: off, but could come back
            controller.observe_acceptance(uid, drafted=4, accepted=0)
        engine = SpecDecodeEngine(model, SpecDecodeConfig(mode="ngram", num_speculative_tokens=4,
                                                          calibration_seconds=0),
                                  NGramProposer(1, 4), controller)
        asked_by_cost[per_token] = _proposals_while_serving(model, tokenizer, engine)
        # Off for the whole request where nothing pays; off at first where a
        # pass is cheap, until the shadow drafts bring speculation back.
        assert engine.steps.plain_steps > (5 if per_token == 1.0 else 0)
    assert asked_by_cost[1.0] == [] and len(asked_by_cost[0.1]) > 0


def test_a_matching_draft_turns_speculation_on_before_it_is_decided():
    """Text turns predictable after a preamble whose drafts all failed: the
    controller should hear of each matching shadow token as it is emitted, not
    after the whole 10-token draft has been (k plain steps later)."""
    from mlx_lm_server.spec_decode.control.controller import StepReport

    controller = DynamicSpecController(10, warmup=1, probe_interval=0)
    controller.cost = lambda batch_size, k: 1.0 + 0.15 * k
    for _ in range(3):  # the plain steps a bucket is priced on
        controller.observe_plain_step(1, 0.1)
    for _ in range(4):  # the preamble: every draft rejected at once
        controller.observe_acceptance(0, drafted=10, accepted=0)
    assert controller.choose([0]).k == 0
    shadow = ShadowDrafts()
    text = list(range(100, 140))
    propose = lambda uids, contexts, ks: ProposalResult.from_lists(
        [text[len(contexts[0]) - 1 : len(contexts[0]) - 1 + ks[0]]], ks[0])
    history = [1]
    for plain_steps in range(1, 11):
        settled, _ = _step(shadow, [0], [history], 10, propose)
        if settled:
            uids, drafted, kept, _ = zip(*settled)
            controller.observe(StepReport(1, uids, (0,) * len(uids), drafted, kept))
        if controller.choose([0]).k > 0:
            break
        history = history + [text[len(history) - 1]]  # plain decoding emits the draft's next token
    assert plain_steps <= 4
