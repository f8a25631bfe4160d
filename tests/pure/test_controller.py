"""DynamicSpecController: exact arithmetic with alpha = 1, boundaries, forced modes."""

import pytest

from mlx_lm_server.spec_decode.control.controller import DynamicSpecController
from mlx_lm_server.spec_decode.control.costs import batch_bucket
from mlx_lm_server.spec_decode.control.estimates import AcceptanceEma
from mlx_lm_server.spec_decode.control.gain import (expected_tokens, forced_run_cap,
                                                    tokens_per_step)
from mlx_lm_server.spec_decode.control.step import StepReport


def make(**kw):
    # A new row's first step is left to its own test (first_token_delay).
    defaults = dict(alpha=1.0, matching_alpha=1.0, cost_window=9, warmup=1, margin_on=0.1,
                    margin_off=0.0, probe_interval=0, first_token_delay=float("inf"))
    defaults.update(kw)
    return DynamicSpecController(kw.pop("max_k", 4), **{k: v for k, v in defaults.items()
                                                          if k != "max_k"})


def plain_steps(c, batch_size, seconds):
    """The three plain steps a bucket's plain figure rests on (``has_plain``)."""
    for _ in range(3):
        c.observe_plain_step(batch_size, seconds)


def set_costs(c, batch_size, plain, verify_by_k):
    plain_steps(c, batch_size, plain)
    for k, t in verify_by_k.items():
        c.observe_verify_step(batch_size, k, t)


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.9, 0) == 1.0


def test_acceptance_ema_counts_rejections_only_when_they_happen():
    a = AcceptanceEma(alpha=1.0)
    a.update(drafted=4, accepted=4)  # no rejection observed
    assert a.value == 1.0
    a.update(drafted=4, accepted=1)  # one success, one failure
    assert a.value == 0.5
    a.update(drafted=0, accepted=0)  # nothing drafted: no information
    assert a.value == 0.5 and a.count == 2


def test_ema_with_smoothing():
    a = AcceptanceEma(alpha=0.5)
    a.update(4, 4)  # s=4, t=4
    a.update(4, 0)  # s=2, t=2.5
    assert a.value == pytest.approx(2 / 2.5)


def test_k_from_expected_gain_for_a_cost_curve():
    """With a = 0.8 and a verify cost of 1 + 0.25 k, gain peaks at k = 3."""
    c = make(max_k=8)
    set_costs(c, 1, 1.0, {k: 1.0 + 0.25 * k for k in range(1, 9)})
    c.observe_acceptance(7, drafted=5, accepted=4)  # a = 4/5
    gains = {k: expected_tokens(0.8, k) / (1 + 0.25 * k) for k in range(1, 9)}
    best = max(gains, key=gains.get)
    assert best == 3
    d = c.choose([7])
    assert d.k == best and d.per_sequence_k == {7: best}
    assert "gain" in d.reason and "k=3" in d.reason


def test_k_zero_when_gain_below_one():
    c = make(max_k=4)
    set_costs(c, 4, 1.0, {k: 1.0 + 0.5 * k for k in range(1, 5)})
    for uid in range(4):
        c.observe_acceptance(uid, drafted=4, accepted=0)  # a = 0
    d = c.choose([0, 1, 2, 3])
    assert d.k == 0 and d.reason.startswith("off")


def test_hysteresis_boundaries():
    """Switching on needs gain >= 1 + margin_on; staying on needs gain >= 1 + margin_off."""
    c = make(max_k=1, margin_on=0.1, margin_off=0.0)
    # k = 1: expected tokens 1 + a, cost 1.5 -> gain (1 + a) / 1.5
    set_costs(c, 1, 1.0, {1: 1.5})
    c.speculating = False
    c.observe_acceptance(1, drafted=2, accepted=1)  # a = 0.5: gain exactly 1.0
    assert c.choose([1]).k == 0  # below 1.1 while off
    c.observe_acceptance(1, drafted=20, accepted=13)  # a = 13/14 -> gain 1.2857
    assert c.choose([1]).k == 1  # on
    c.observe_acceptance(1, drafted=2, accepted=1)  # gain exactly 1.0 = 1 + margin_off
    assert c.choose([1]).k == 1  # stays on at the boundary
    c.observe_acceptance(1, drafted=4, accepted=0)  # a = 0 -> gain 0.667
    assert c.choose([1]).k == 0  # one past the boundary: off


def test_warmup_uses_global_estimate_then_per_sequence():
    c = make(max_k=2, warmup=2)
    set_costs(c, 2, 1.0, {1: 1.1, 2: 1.2})
    c.observe_acceptance(1, drafted=2, accepted=2)  # global a = 1
    assert c.acceptance(2) == 1.0  # unseen sequence: global
    c.observe_acceptance(2, drafted=2, accepted=0)  # seq 2 one observation: still warming up
    assert c.acceptance(2) == 0.0  # global now also 0 (alpha = 1)
    c.observe_acceptance(1, drafted=2, accepted=2)
    c.observe_acceptance(2, drafted=2, accepted=0)  # seq 2 warmed up: its own value
    assert c.acceptance(2) == 0.0 and c.acceptance(1) == 1.0


def test_per_sequence_decision_in_a_mixed_batch():
    """A code edit keeps drafting while a story in the same batch does not."""
    c = make(max_k=4)
    set_costs(c, 2, 1.0, {k: 1.0 + 0.1 * k for k in range(1, 5)})
    c.observe_acceptance(10, drafted=4, accepted=4)  # code edit
    c.observe_acceptance(11, drafted=4, accepted=0)  # story
    d = c.choose([10, 11])
    assert d.k > 0 and d.per_sequence_k[10] == d.k and d.per_sequence_k[11] == 0


def test_batch_cap_is_hard():
    c = make(max_k=4, disable_by_batch_size=8)
    for uid in range(8):
        c.observe_acceptance(uid, drafted=4, accepted=4)
    plain_steps(c, 7, 1.0)
    assert c.choose(list(range(7))).k > 0
    d = c.choose(list(range(8)))
    assert d.k == 0 and "disable cap" in d.reason


def test_forced_modes():
    fixed = make(max_k=5, dynamic=False, adaptive_k=False)
    fixed.observe_acceptance(1, drafted=5, accepted=0)
    assert fixed.choose([1]).k == 5  # never switched off, never adapted

    no_dynamic = make(max_k=5, dynamic=False)
    set_costs(no_dynamic, 1, 1.0, {k: 1.0 + 2.0 * k for k in range(1, 6)})
    no_dynamic.observe_acceptance(1, drafted=5, accepted=0)
    assert no_dynamic.choose([1]).k >= 1  # gain < 1 but it may not switch off

    no_adaptive = make(max_k=5, adaptive_k=False)
    set_costs(no_adaptive, 1, 1.0, {5: 1.5})
    no_adaptive.observe_acceptance(1, drafted=5, accepted=5)
    assert no_adaptive.choose([1]).k == 5


def test_acceptance_threshold_switches_off_and_probes_with_backoff():
    c = make(max_k=3, acceptance_threshold=0.5, probe_interval=3, max_probe_interval=6)
    set_costs(c, 1, 1.0, {k: 1.0 for k in range(1, 4)})  # free verification
    c.observe_acceptance(1, drafted=3, accepted=1)  # a = 0.5: at the threshold
    assert c.choose([1]).k > 0
    c.observe_acceptance(1, drafted=3, accepted=0)  # a = 0
    decisions = [c.choose([1]) for _ in range(3 + 6 + 6)]
    probes = [d.probe for d in decisions]
    assert "below threshold" in decisions[-1].reason
    # probes after 3 steps off, then 6, then 6 (capped)
    assert [i for i, p in enumerate(probes) if p] == [2, 8, 14]
    c.observe_acceptance(1, drafted=3, accepted=3)  # a probe that found good drafts
    assert c.choose([1]).k > 0 and c.speculating


def test_cost_line_fills_unmeasured_k_and_smooths_noise():
    c = make(max_k=8)
    plain_steps(c, 1, 1.0)
    for k, t in [(2, 1.2), (4, 1.4), (2, 1.2), (4, 1.4)]:
        c.observe_verify_step(1, k, t)
    assert c.cost(1, 3) == pytest.approx(1.3)  # interpolated
    assert c.cost(1, 8) == pytest.approx(1.8)  # extrapolated along the line
    assert c.cost(1, 0) == pytest.approx(1.0)  # never below a plain step


def test_steps_with_a_grammar_row_are_timed_and_priced_apart():
    """JSON to a schema at B=4 on a CPU: passes over the grammar rows cost
    1.8 to 2.9 plain steps (their masks, k + 1 a row, share the cores with
    the pass) where code edits' cost 1.0 to 1.5; in one table the code edits
    priced the JSON rows' passes, and those verified at a loss. A step's
    report arrives before the next step is chosen, so it goes to the table
    of the kind that step was chosen as."""
    c = make(max_k=2, margin_off=0.05)
    rows = [0, 1, 2, 3]
    for uid in rows:
        c.observe_acceptance(uid, drafted=2, accepted=1)
    for grammar, verify in ((False, 1.2), (True, 2.0)):
        assert c.choose(rows, grammar=grammar).k == 0  # plain steps timed first
        plain_steps(c, 4, 1.0)
        for _ in range(3):
            c.observe(StepReport(4, k=2, seconds=verify))
    assert c.choose(rows, grammar=True).k == 0
    assert c.cost(4, 2) == pytest.approx(2.0)
    assert c.choose(rows, grammar=False).k == 2
    assert c.cost(4, 2) == pytest.approx(1.2)


def test_one_measured_k_prices_the_others_on_the_line_from_a_plain_step():
    """A single k=10 pass at 3.66 plain steps says about 0.27 per draft token
    (a pass over the pending token alone is a plain step), so k=1 costs 1.27."""
    c = make(max_k=10)
    plain_steps(c, 4, 2.0)
    c.observe_verify_step(4, 10, 7.32)
    assert c.cost(4, 10) == pytest.approx(3.66)
    assert c.cost(4, 1) == pytest.approx(1.266)
    assert c.cost(4, 5) == pytest.approx(2.33)


def test_one_slow_step_never_prices_a_k_out():
    """Seen on an H200: one verification step at k = 2 took 84 plain steps (a
    kernel compiled inside it that its pass shape does not name); the line
    through it priced every k >= 2 out, so none ran again to correct it. A k
    seen fewer than three times is no dearer than the line through the
    others; from three steps on, its median rules, a truly dear k included."""
    c = make(max_k=10)
    set_costs(c, 4, 1.0, {1: 1.36})
    for _ in range(8):
        c.observe_verify_step(4, 1, 1.36)
    c.observe_verify_step(4, 2, 84.8)
    assert c.cost(4, 2) == pytest.approx(1.72)
    assert c.cost(4, 10) == pytest.approx(4.6)
    for uid in range(4):
        c.observe_acceptance(uid, drafted=10, accepted=9)
    assert c.choose([0, 1, 2, 3]).k >= 2
    c.observe_verify_step(4, 2, 1.5)
    c.observe_verify_step(4, 2, 1.5)
    assert c.cost(4, 2) == pytest.approx(1.5)  # the median of three

    c = make(max_k=10)
    set_costs(c, 4, 1.0, {1: 1.36})
    for _ in range(3):
        c.observe_verify_step(4, 2, 5.0)
    assert c.cost(4, 2) == pytest.approx(5.0)


def test_a_pass_timed_over_long_contexts_is_priced_against_the_plain_steps_beside_it():
    """Seen on a CPU at B=4: a long summary's verification passes (0.5 s
    beside 0.25 s plain steps), then short records whose plain steps take
    0.08 s. Priced in seconds over today's plain step, those passes cost
    6.25 plain steps, every k looked unpayable and speculation stayed off;
    a pass is 2 plain steps in either regime."""
    c = make(max_k=4)
    for _ in range(9):
        c.observe_plain_step(4, 0.25)
    for _ in range(3):
        c.observe_verify_step(4, 4, 0.5)
    assert c.cost(4, 4) == pytest.approx(2.0)
    for _ in range(9):
        c.observe_plain_step(4, 0.08)
    assert c.cost(4, 4) == pytest.approx(2.0)
    for uid in range(4):
        c.observe_acceptance(uid, drafted=4, accepted=3)
    assert c.choose([0, 1, 2, 3]).k > 0


def test_a_pass_for_some_rows_only_is_held_to_what_it_costs_the_others():
    """Chat at 4 clients on a CPU: one row copying, three with nothing to
    draft. Throughput says k=6 (1.16x), but each such pass holds the three
    others back 0.9 plain steps for nothing, and their requests end later.
    Only k=1 speeds the one row up more than it slows the three down (a
    geometric mean), so it verifies at k=1. Where a pass costs about a plain
    step (a GPU), the same row verifies at k=16; where every row copies,
    fairness and throughput agree."""
    cpu = {1: 1.15, 2: 1.3, 3: 1.45, 4: 1.6, 6: 1.9, 8: 2.2, 10: 2.5, 12: 2.8, 16: 3.1}
    gpu = {k: 1.0 + 0.005 * k for k in cpu}

    def batch(prices, copying):
        c = make(max_k=16)
        plain_steps(c, 4, 1.0)
        for k, t in prices.items():
            for _ in range(3):
                c.observe_verify_step(4, k, t)
        for u in range(4):
            if u < copying:
                c.observe_acceptance(u, drafted=16, accepted=15)
            c.observe_proposal(u, u < copying)
        return c, c.choose([0, 1, 2, 3])

    c, d = batch(cpu, copying=1)
    assert c.gain([0, 1, 2, 3], 6) > 1.15
    assert d.k == 1, d.reason
    d = batch({**cpu, 1: 1.3}, copying=1)[1]  # no k is fair: plain
    assert d.k == 0 and d.reason.startswith("off: no k speeds the rows with drafts"), d.reason
    assert batch(gpu, copying=1)[1].k == 16
    assert batch(cpu, copying=4)[1].k == 16


def test_a_k_seen_once_is_no_cheaper_than_its_calibration_rescaled_by_the_steps_seen():
    """Seen on a CPU (Qwen2.5-0.5B, B=1): k=10 run once was priced at its bare
    start-up pass, 1.21 plain steps, where real steps at k=1 had shown steps
    cost 1.5x their bare passes; it verified long drafts on that price. The
    fastest-of-few rule takes the calibration rescaled as for a k never seen."""
    c = make(max_k=10)
    c.costs.calibrate(1, {1: 1.1, 10: 1.21})
    plain_steps(c, 1, 1.0)
    for _ in range(3):
        c.observe_verify_step(1, 1, 1.65)  # 1.5x its bare pass
    assert c.cost(1, 10) == pytest.approx(1.815)  # never seen: rescaled
    c.observe_verify_step(1, 10, 2.4)
    assert c.cost(1, 10) == pytest.approx(1.815)  # seen once, dearer: still rescaled
    c.observe_verify_step(1, 10, 1.7)
    assert c.cost(1, 10) == pytest.approx(1.7)  # a faster real step wins


def test_the_calibration_is_rescaled_by_every_real_step_of_its_bucket_whatever_its_k():
    """Chat at B=4 on a CPU: the bare start-up line under a real plain step
    priced k=1 to 3 at 1.00 plain steps, while its steps at k=1, 2 and 3
    cost 1.2-1.65, one each; waiting for three at one k, it went on
    verifying rows at acceptance 0.5 on the bare price. Three steps at any
    k rescale the line; two move nothing (one slow step must not)."""
    c = make(max_k=3, alpha=0.5, margin_off=0.05)
    c.costs.calibrate(4, {1: 0.86, 16: 2.5}, plain_seconds=0.78)
    plain_steps(c, 4, 1.0)
    uids = [0, 1, 2, 3]
    for u in uids:
        c.observe_acceptance(u, drafted=3, accepted=1)  # acceptance 0.5
        for proposed in (True, False, False):  # a draft a quarter of the time
            c.observe_proposal(u, proposed)
    assert [c.cost(4, k) for k in (1, 2, 3)] == pytest.approx([1.0, 1.0, 1.08], abs=0.01)
    c.observe_verify_step(4, 1, 1.2)
    c.observe_verify_step(4, 2, 1.65)
    assert c.cost(4, 3) == pytest.approx(1.08, abs=0.01)  # two steps: still the bare line
    assert c.choose(uids).k > 0
    c.observe_verify_step(4, 3, 1.3)
    assert [c.cost(4, k) for k in (1, 2, 3)] == pytest.approx([1.2, 1.25, 1.3], abs=0.01)
    assert c.cost(4, 16) == pytest.approx(1.395 * 2.5, abs=0.01)  # never seen: rescaled
    assert c.choose(uids).k == 0


def test_a_new_rows_first_step_is_plain_where_a_pass_would_hold_its_first_token_back():
    """A row's first token leaves with its first step's pass: on a CPU a
    pass at 3 plain steps delays it by 2, so that step is plain; where a
    pass costs 1.2 plain steps (a GPU) the step verifies. Fixed k is left
    as it is asked."""
    for verify, new_row_k in ((3.0, 0), (1.2, 4)):
        c = make(max_k=4, first_token_delay=0.5)
        for B in (1, 2):
            set_costs(c, B, 1.0, {4: verify, 2: 1 + (verify - 1) / 2})
        for uid in (1, 2):
            c.observe_acceptance(uid, drafted=4, accepted=4)
        assert c.choose([1]).k == (0 if verify > 1.5 else 4)  # 1 is new
        assert c.choose([1]).k == 4  # its second step
        d = c.choose([1, 2])
        assert d.k == new_row_k
        assert new_row_k or "first token" in d.reason
        assert c.choose([1, 2]).k == 4
    c = make(max_k=4, dynamic=False, adaptive_k=False, first_token_delay=0.5)
    assert c.choose([7]).k == 4


def test_a_step_before_a_prefill_chunk_is_plain_where_a_pass_would_hold_that_prompt_back():
    """Upstream prefills a chunk after each decode step, in the same call, so
    a verification delays every prompt in prefill by what it costs over a
    plain step: on a CPU (a pass at 3 plain steps) that step is plain; on a
    GPU (1.2) it verifies."""
    for verify, k_while_prefilling in ((3.0, 0), (1.2, 4)):
        c = make(max_k=4, first_token_delay=0.5)
        set_costs(c, 1, 1.0, {4: verify, 2: 1 + (verify - 1) / 2})
        c.observe_acceptance(1, drafted=4, accepted=4)
        c.choose([1])  # the row's own first step
        d = c.choose([1], prefilling=2)
        assert d.k == k_while_prefilling
        assert d.k or d.reason.startswith("2 prompt(s) in prefill: their first token"), d
        assert c.choose([1]).k == 4


def test_unmeasured_costs_use_a_prior_and_buckets_share():
    c = make(max_k=2)
    assert c.cost(3, 2) == pytest.approx(1.16)
    plain_steps(c, 3, 2.0)
    c.observe_verify_step(4, 2, 3.0)
    assert batch_bucket(3) == batch_bucket(4) == 4
    assert c.cost(4, 2) == pytest.approx(1.5)


def test_each_batch_bucket_times_plain_steps_first():
    """Costs are relative to a plain step at the same batch size, so the first
    steps in a new bucket are plain; then speculation follows the gain rule."""
    c = make(max_k=4)
    c.observe_acceptance(1, drafted=4, accepted=4)
    for _ in range(3):  # three: a bucket's first plain step can be slow (``has_plain``)
        d = c.choose([1])
        assert d.k == 0 and d.reason.startswith("calibrate")
        c.observe_plain_step(1, 1.0)
    assert c.choose([1]).k > 0
    d = c.choose([1, 2, 3])  # bucket 4: not timed yet
    assert d.k == 0 and "bucket 4" in d.reason


def test_gain_counts_only_the_steps_where_the_proposer_has_drafts():
    """An n-gram proposer that finds a copy for a chat sequence one step in four
    brings a quarter of the drafts its acceptance alone promises; and a step
    where no row has a draft runs no pass, so it costs a plain step. Alone
    (B = 1) the sequence pays for a pass one step in four; among eight such
    rows some row has a draft in 90% of the steps."""
    costs = {k: 1.0 + 0.3 * k for k in range(1, 5)}
    always, rarely = make(max_k=4, alpha=0.5), make(max_k=4, alpha=0.5)
    for c in (always, rarely):
        for B in (1, 8):
            set_costs(c, B, 1.0, costs)
        for uid in range(8):
            c.observe_acceptance(uid, drafted=4, accepted=4)  # a = 1 whenever it drafts
    always.observe_proposal(1, True)
    for uid in range(8):
        for proposed in (True, False, False):  # EMA: 1, 0.5, 0.25
            rarely.observe_proposal(uid, proposed)
    assert rarely.proposal_rate(1) == pytest.approx(0.25)
    assert tokens_per_step(always.acceptance(1), always.proposal_rate(1), 4) == pytest.approx(5.0)
    assert tokens_per_step(rarely.acceptance(1), rarely.proposal_rate(1), 4) == pytest.approx(2.0)
    assert always.choose([1]).k == 4  # 5 tokens for 2.2 plain steps: gain 2.3
    # 2 tokens for 1 + 0.25 * 1.2 plain steps
    assert rarely.gain([1], 4) == pytest.approx(2.0 / 1.3)
    assert rarely.choose([1]).k == 4
    eight = list(range(8))
    some_draft = 1 - 0.75 ** 8
    assert rarely.gain(eight, 4) == pytest.approx(2.0 / (1 + some_draft * 1.2))
    assert rarely.gain(eight, 1) == pytest.approx(1.25 / (1 + some_draft * 0.3))
    d = rarely.choose(eight)  # below 1 at every k
    assert d.k == 0 and "gain below" in d.reason, d.reason


def test_probes_are_spaced_to_cost_at_most_the_budget():
    """A probe at 1.5x a plain step costs half a step: with a 2% budget, at
    least 25 plain steps between probes, whatever the backoff says."""
    c = make(max_k=1, probe_interval=4, max_probe_interval=64, probe_budget=0.02)
    set_costs(c, 16, 1.0, {1: 1.5})
    uids = list(range(16))
    for u in uids:
        c.observe_acceptance(u, drafted=1, accepted=0)
    probes = [i for i in range(80) if c.choose(uids).probe]
    assert probes == [24, 49, 74], probes
    cheap = make(max_k=1, probe_interval=4, max_probe_interval=64, probe_budget=0.02)
    set_costs(cheap, 1, 1.0, {1: 1.02})  # 1 step's floor: the backoff rules
    cheap.observe_acceptance(1, drafted=1, accepted=0)
    assert [i for i in range(40) if cheap.choose([1]).probe] == [3, 11, 27]


def test_a_sequence_joining_brings_the_next_probe_forward():
    """While off, probes come at doubling intervals (2, 4, 8 plain steps); a
    sequence joining is new evidence: the next probe comes after the first
    interval again."""
    c = make(probe_interval=2, max_probe_interval=16, probe_budget=0.0)
    for B in (1, 2):
        set_costs(c, B, 1.0, {k: 1.5 for k in range(1, 5)})
    c.observe_acceptance(7, drafted=4, accepted=0)
    c.observe_acceptance(8, drafted=4, accepted=0)

    def steps_to_probe(uids):
        return next(n for n in range(1, 100) if c.choose(uids).probe)

    assert [steps_to_probe([7]) for _ in range(3)] == [2, 4, 8]
    assert steps_to_probe([7, 8]) == 2
    assert steps_to_probe([7, 8]) == 4  # known now: the doubling goes on


def test_fruitless_probes_shrink_the_probe_budget_until_one_keeps_a_draft():
    """A head that always drafts and is never right: a probe at 1.25x a plain
    step waits 13 steps at a 2% budget, then 25, 50, 100 after one, two,
    three rejected probes, and stays at 100; a probe that keeps a draft
    restores the 2% budget (the doubling backoff, at 64 by then, rules)."""
    c = make(max_k=1, probe_interval=4, max_probe_interval=64, probe_budget=0.02)
    set_costs(c, 1, 1.0, {1: 1.25})
    c.observe_acceptance(1, drafted=1, accepted=0)
    probes = []
    for i in range(400):
        d = c.choose([1])
        if d.probe:
            probes.append(i)
            kept = len(probes) == 5
            c.observe(StepReport(1, (1,), (1,), (1,), (int(kept),), d))
            if kept:
                c.observe_acceptance(1, drafted=1, accepted=0)  # still off
    assert probes == [12, 37, 87, 187, 287, 351], probes


def test_probes_that_keep_too_little_to_pay_shrink_the_budget_too():
    """A weak head at B=4: probes at 1.5 plain steps where one row of four
    keeps its draft (1.25 tokens a row) do not pay, and each doubles the
    wait (25, 50, 100, 200 steps, then stays); one where every row keeps
    its draft (2 tokens a row) pays and restores the 2% budget (the
    doubling backoff, at 64 by then, rules)."""
    c = make(max_k=1, probe_interval=4, max_probe_interval=64, probe_budget=0.02)
    set_costs(c, 4, 1.0, {1: 1.5})
    gaps = _weak_rows_probe_gaps(c, 800, lambda n: (1, 1, 1, 1) if n == 5 else (1, 0, 0, 0))
    assert gaps[:6] == [25, 50, 100, 200, 200, 64], gaps


def _weak_rows_probe_gaps(c, steps, kept):
    """Steps between probes over four rows that keep ``kept(n)`` drafts at
    the n-th probe, their estimates weak again after each."""
    uids = (1, 2, 3, 4)

    def weak():
        for u in uids:
            c.observe_acceptance(u, drafted=1, accepted=0)

    weak()
    probes = []
    for i in range(steps):
        d = c.choose(list(uids))
        if d.probe:
            probes.append(i)
            c.observe(StepReport(4, uids, (1,) * 4, (1,) * 4, kept(len(probes)), d))
            weak()
    return [b - a for a, b in zip([-1] + probes, probes)]


def test_probes_are_budgeted_at_what_their_steps_cost_not_at_the_optimistic_price():
    """Chat at B=4 on a CPU: k=1 calibrated at 1.16 plain steps, its one real
    step at 1.40. Deciding prices k=1 at the cheaper figure (a k is never
    priced out by one step), but probes are an expense: spaced at 1.40 they
    wait 20 steps, not 8; and one that emits 1.25 tokens a row did not pay
    for a 1.40 pass, so the wait doubles (40, 80, 160, then stays)."""
    c = make(max_k=1, probe_interval=4, max_probe_interval=64, probe_budget=0.02)
    c.costs.calibrate(4, {1: 1.16}, plain_seconds=1.0)
    set_costs(c, 4, 1.0, {1: 1.4})
    assert c.cost(4, 1) == pytest.approx(1.16)
    gaps = _weak_rows_probe_gaps(c, 600, lambda n: (1, 0, 0, 0))
    assert gaps[:5] == [20, 40, 80, 160, 160], gaps


def test_probes_at_a_k_never_timed_are_spaced_by_the_line_real_steps_anchor():
    """Real steps timed at k=4 only, probes chosen at k=1 (poor acceptance):
    the line through the real k=4 step prices k=1 at 1.5 plain steps, so
    probes wait 25 steps, as if k=1 itself had been timed."""
    c = make(max_k=4, probe_interval=4, max_probe_interval=64, probe_budget=0.02)
    set_costs(c, 16, 1.0, {4: 3.0})
    uids = list(range(16))
    for u in uids:
        c.observe_acceptance(u, drafted=4, accepted=0)
    decisions = [c.choose(uids) for _ in range(80)]
    probes = [i for i, d in enumerate(decisions) if d.probe]
    assert {decisions[i].k for i in probes} == {1}
    assert probes == [24, 49, 74], probes


def test_realisation_scales_the_gain_and_never_raises_it():
    """Steps that deliver 80% of the predicted tokens turn a gain of 1.125 into
    0.9 (off); steps that deliver more than predicted leave the gain alone.
    Scaling every k alike keeps the best k where it was."""
    def controller():
        c = make(max_k=4)
        set_costs(c, 1, 1.0, {k: 1.0 + 0.6 * k for k in range(1, 5)})
        c.observe_acceptance(7, drafted=5, accepted=4)  # a = 0.8
        return c

    c = controller()
    base = {k: c.gain([7], k) for k in range(1, 5)}
    assert base[1] == pytest.approx(1.8 / 1.6)
    assert c.choose([7]).k == 1

    lucky = controller()
    lucky.observe_realisation(predicted_tokens=2.0, emitted_tokens=5)
    assert lucky.rho.factor == 1.0
    assert lucky.gain([7], 1) == pytest.approx(base[1])
    assert lucky.choose([7]).k == 1

    short = controller()
    short.observe_realisation(predicted_tokens=10.0, emitted_tokens=8)
    assert short.rho.factor == pytest.approx(0.8)
    assert {k: short.gain([7], k) for k in base} == pytest.approx(
        {k: 0.8 * g for k, g in base.items()})
    d = short.choose([7])
    assert d.k == 0 and "realisation 0.80" in d.reason, d.reason


def test_realisation_far_below_its_prediction_does_not_hold_a_clear_gain_off():
    """Verifications that delivered 30% of the tokens predicted for them (bursty
    acceptance, read as each burst ends) scale the gain by 0.8, not 0.3: a
    step whose gain clears the margin at 0.8 speculates."""
    c = make(max_k=4)
    set_costs(c, 1, 1.0, {k: 1.0 + 0.3 * k for k in range(1, 5)})
    for _ in range(2):
        c.observe_acceptance(7, drafted=4, accepted=4)  # a = 1: 5 tokens for 2.2 at k=4
    for _ in range(5):
        c.observe_realisation(predicted_tokens=5.0, emitted_tokens=1.5)
    assert c.realisation == pytest.approx(0.3)
    assert c.gain([7], 4) == pytest.approx(0.8 * 5 / 2.2)
    d = c.choose([7])
    assert d.k == 4 and "realisation 0.80" in d.reason, d.reason


def test_realisation_is_a_ratio_of_averages():
    """A step predicted at 1 token that delivers 1 and one predicted at 9 that
    delivers 3: 4 of 10 predicted tokens came (0.4 with alpha = 0.5: 2 / 5),
    not the mean of the ratios 1 and 1/3 (0.67), which a small step would sway."""
    c = make(max_k=4, alpha=0.5)
    c.observe_realisation(predicted_tokens=1.0, emitted_tokens=1)
    assert c.realisation == 1.0
    c.observe_realisation(predicted_tokens=9.0, emitted_tokens=3)
    assert c.realisation == pytest.approx(2.0 / 5.0)
    c.observe_realisation(predicted_tokens=0.0, emitted_tokens=0)  # no prediction: ignored
    assert c.realisation == pytest.approx(2.0 / 5.0)


def test_realisation_uses_the_estimates_the_decision_was_made_on():
    """A verify step's own outcome updates the acceptance before realisation is
    recorded; the prediction it is compared with must be the one k was chosen on."""

    c = make(max_k=4)
    set_costs(c, 1, 1.0, {k: 1.0 + 0.1 * k for k in range(1, 5)})
    c.observe_acceptance(7, drafted=4, accepted=4)  # a = 1
    d = c.choose([7])
    assert d.k == 4
    report = StepReport(1, (7,), (4,), (4,), (0,), d)
    c.observe_acceptance(7, drafted=4, accepted=0)  # the step's outcome: a = 0
    assert tokens_per_step(c.acceptance(7), c.proposal_rate(7), 4) == 1.0
    assert c.realised(report) == (5.0, 1)


def test_realisation_counts_rows_with_drafts_decided_on_their_own_estimates():
    """rho measures how optimistic per-sequence acceptance estimates were.
    A row without a draft emitted its one token as predicted, whatever its
    proposal rate said; a row still on the global estimate (a new request,
    inheriting the last one's ending) says nothing of that optimism."""

    c = make(max_k=4, warmup=2)
    set_costs(c, 3, 1.0, {k: 1.0 + 0.1 * k for k in range(1, 5)})
    for uid in (1, 2):
        for _ in range(2):
            c.observe_acceptance(uid, drafted=4, accepted=4)  # a = 1, warm
            c.observe_proposal(uid, True)
    c.observe_proposal(2, False)  # proposes half the time: E = 3, not 5
    d = c.choose([1, 2, 3])  # uid 3 is new: the global a = 1
    assert d.own == {1, 2} and d.k == 4
    # uid 1 kept 1 of 4, uid 2 had no draft, uid 3 kept none
    report = StepReport(3, (1, 2, 3), (4, 4, 4), (4, 0, 4), (1, 0, 0), d)
    assert c.realised(report) == (5.0, 2)
    c.observe(report)
    assert c.realisation == pytest.approx(2 / 5)


def test_one_step_report_feeds_every_estimate():
    """``observe(StepReport)`` is what the engine calls: proposals, acceptance,
    realisation against the decision's own estimates, and step times."""

    c = make(max_k=4)
    for _ in range(3):  # timed plain steps
        c.observe(StepReport(1, k=0, seconds=1.0))
    assert c.costs.plain_seconds(1) == 1.0
    c.observe(StepReport(1, (7,), (4,), (4,), (4,)))  # a = 1 for uid 7
    d = c.choose([7])
    assert d.k == 4 and d.speculating and d.estimates == {7: (1.0, 1.0)} and d.acceptance == 1.0
    # the step kept 1 of 4 drafts: 2 tokens against the 5 it was chosen on
    c.observe(StepReport(1, (7,), (4,), (4,), (1,), d))
    assert c.realisation == pytest.approx(2 / 5)
    assert c.acceptance(7) == pytest.approx(0.5)
    c.observe(StepReport(1, (7,), (4,), (0,)))  # no draft this time: proposal rate falls
    assert c.proposal_rate(7) == 0.0
    c.observe(StepReport(1, k=4, seconds=2.5))  # a verification period
    assert c.cost(1, 4) == pytest.approx(2.5)


def _calibrated_controller(k10_calibrated: float):
    """B=1, acceptance 0.9, k=8 timed for real at its calibrated 2.2 plain steps,
    k=10 calibrated only: k=8 is the best k on these figures."""
    c = make(max_k=10)
    c.costs.calibrate(1, {1: 1.15, 2: 1.3, 3: 1.45, 4: 1.6, 6: 1.9, 8: 2.2, 10: k10_calibrated})
    set_costs(c, 1, 1.0, {8: 2.2})
    c.observe_verify_step(1, 8, 2.2)
    c.observe_verify_step(1, 8, 2.2)
    c.observe_acceptance(0, drafted=10, accepted=9)
    assert c.gain([0], 8) > max(c.gain([0], k) for k in (1, 2, 3, 4, 6, 10))
    return c


def test_an_untimed_k_bucket_above_the_best_is_tried_and_a_real_timing_decides():
    """k=10 calibrated at 2.6 plain steps predicts 0.95 of k=8's gain: it is
    tried; a real step cheaper than its calibration keeps it, a dearer one
    leaves k=8 for good."""
    c = _calibrated_controller(2.6)
    d = c.choose([0])
    assert d.k == 10 and d.reason.startswith("try k=10"), d.reason
    c.observe_verify_step(1, 10, 2.3)  # really cheaper: gain 2.98 against 2.79
    d = c.choose([0])
    assert d.k == 10 and d.reason.startswith("speculate"), d.reason

    c = _calibrated_controller(2.6)
    assert c.choose([0]).k == 10
    c.observe_verify_step(1, 10, 3.0)  # dearer than calibrated: the calibration stands
    assert [c.choose([0]).k for _ in range(5)] == [8] * 5


def test_untimed_buckets_are_tried_a_bounded_number_of_times_and_only_near_the_best():
    c = _calibrated_controller(2.6)  # never timed at 10 (e.g. drafts too short to fill it)
    assert [c.choose([0]).k for _ in range(5)] == [10, 10, 10, 8, 8]
    c = _calibrated_controller(3.5)  # predicted 0.70 of the best: not worth a try
    assert c.choose([0]).k == 8
    c = _calibrated_controller(2.6)
    c.explore_tries = 0
    assert c.choose([0]).k == 8


def test_a_grammar_batch_priced_on_a_borrowed_line_explores_no_untimed_k():
    """Bucket 16 above the calibration (bucket 4's): a batch without grammar
    rows tries the k above the best, a grammar batch does not (its borrowed
    line is a floor known to be low: its untimed k can only cost more)."""
    def chosen(grammar: bool):
        c = make(max_k=16)
        c.costs.calibrate(4, {1: 0.152, 16: 0.330}, 0.145)
        uids = list(range(16))
        for u in uids:
            c.observe_acceptance(u, drafted=8, accepted=7)
        c.costs.use(grammar)
        for _ in range(3):
            c.observe_plain_step(16, 0.222)
        return c.choose(uids, grammar=grammar)

    plain = chosen(grammar=False)
    assert plain.k and plain.reason.startswith("try"), plain.reason
    constrained = chosen(grammar=True)
    assert constrained.k and constrained.reason.startswith("speculate"), constrained.reason
    assert constrained.k < plain.k


def test_where_no_k_can_pay_neither_probes_nor_shadow_drafts_only_cost_probes():
    """At a batch size where a pass over k + 1 tokens costs k + 1 plain steps
    (a CPU at B=16), even every draft kept gains nothing: the controller stays
    off without acceptance probes, tells the engine not to shadow-draft, and
    verifies only once per cost-probe interval, at the k closest to paying.
    A cost probe measured cheaper brings the gain rule back."""
    c = make(max_k=4, probe_interval=4, max_probe_interval=64, probe_budget=0.02,
             cost_probe_interval=100)
    uids = list(range(16))
    set_costs(c, 16, 1.0, {1: 2.0, 2: 3.0, 4: 5.2})
    for u in uids:
        c.observe_acceptance(u, drafted=4, accepted=4)  # perfect acceptance: moot
    # One real step at k=1 (the k closest to paying) is not yet a verdict:
    # the gain rule decides, and probes without waiting on that cost.
    assert not c.choose(uids).cannot_pay
    for _ in range(2):
        c.observe_verify_step(16, 1, 2.0)
    decisions = [c.choose(uids) for _ in range(300)]
    probes = [i for i, d in enumerate(decisions) if d.probe]
    assert probes == [99, 199, 299], probes
    assert {decisions[i].k for i in probes} == {1}  # (1 + 1) / 2.0 is the highest ceiling
    assert all(d.k == 0 and d.cannot_pay for i, d in enumerate(decisions) if i not in probes)
    assert "no k can pay" in decisions[0].reason

    for _ in range(9):  # the cost probes find k=4 at 1.5 plain steps: the window's median
        c.observe_verify_step(16, 4, 1.5)
    d = c.choose(uids)
    assert d.k == 4 and not d.cannot_pay and d.reason.startswith("speculate"), d.reason


def test_a_batch_size_that_can_pay_is_unaffected_by_the_ceiling():
    """Just above the ceiling (k=4 at 4.5 plain steps: 5 tokens at best, 1.11),
    the ordinary gain rule decides."""
    c = make(max_k=4)
    set_costs(c, 1, 1.0, {4: 4.5})
    c.observe_acceptance(1, drafted=4, accepted=4)
    d = c.choose([1])
    assert d.k == 4 and not d.cannot_pay, d.reason
    c.observe_verify_step(1, 4, 4.6)  # 5 / 4.6 = 1.087 < 1.1
    for _ in range(8):
        c.observe_verify_step(1, 4, 4.6)
    assert c.choose([1]).cannot_pay


def test_a_calibrated_cost_alone_never_delays_the_probe_that_corrects_it():
    """One slow calibration pass (k=1 at 2.3x a plain step where real steps
    cost 1.2x) must not space probes as if it were measured: the first probe
    comes after the backoff's interval, not after (2.3 - 1) / 2% steps."""
    c = make(max_k=1, probe_interval=4, max_probe_interval=64, probe_budget=0.02)
    c.costs.calibrate(1, {1: 2.3})
    plain_steps(c, 1, 1.0)
    decisions = [c.choose([1]) for _ in range(8)]
    assert [i for i, d in enumerate(decisions) if d.probe] == [3]
    assert not any(d.cannot_pay for d in decisions)  # calibration alone is no verdict


def test_a_verification_step_is_priced_in_seconds_from_real_steps():
    """What a mix weighs its draft model against: plain seconds times the
    cost ratio, and nothing before a plain step at that batch size was timed."""
    from mlx_lm_server.spec_decode.control.costs import StepCosts

    costs = StepCosts()
    assert costs.verify_seconds(4, 4) is None
    for _ in range(3):
        costs.observe_plain(4, 0.010)
        costs.observe_verify(4, 4, 0.030)
    assert costs.verify_seconds(4, 4) == pytest.approx(0.030)
    assert costs.verify_seconds(3, 4) == pytest.approx(0.030)  # the same bucket
    assert costs.verify_seconds(16, 4) is None


def _off_on_rejections(**kw):
    """A pass over k + 1 tokens at 1 + 0.3 k plain steps at B=1, 1 + 0.05 k at
    B=2, and every row's own drafts rejected so far: off."""
    c = make(**kw)
    set_costs(c, 1, 1.0, {k: 1.0 + 0.3 * k for k in range(1, 5)})
    set_costs(c, 2, 1.0, {k: 1.0 + 0.05 * k for k in range(1, 5)})
    for uid in (7, 8):
        c.observe_acceptance(uid, drafted=4, accepted=0)
    assert c.choose([7]).k == 0 and c.choose([7, 8]).k == 0
    return c


def test_a_row_whose_shadow_draft_is_matching_verifies_at_once_on_the_matching_estimate():
    """A run of predictable text in progress (its shadow draft copied the
    tokens emitted since) is decided on what such rows' drafts kept (the
    prior 0.7 before any), not on the row's EMA, which learns of the run only
    as it ends. The override leaves the controller off: the next step without
    a matching row is decided on the row's own estimate again."""
    c = _off_on_rejections(max_k=4)
    d = c.choose([7], frozenset({7, 99}))  # 99: not in this batch
    gains = {k: expected_tokens(0.7, k) / (1 + 0.3 * k) for k in range(1, 5)}
    best = max(gains, key=gains.get)
    assert gains[best] > 1.1
    assert d.k == best and d.matching == {7} and d.estimates[7] == (0.7, 1.0)
    assert d.reason.startswith("matching") and not d.speculating
    assert 7 not in d.own  # its prediction is not the row's own estimate: no rho
    assert c.choose([7]).k == 0


def test_the_matching_estimate_learns_from_verifications_and_from_shadow_drafts():
    """Verified rows that were matching, and the rest of shadow drafts that
    had matched (told by ``observe_matching``), teach the matching
    acceptance; rows that were not matching do not. Rho does not scale it:
    it is measured on the steps it decides."""

    c = _off_on_rejections(max_k=4)
    d = c.choose([7, 8], frozenset({7}))
    assert d.k > 0 and d.per_sequence_k == {7: d.k, 8: 0}
    c.observe(StepReport(2, (7, 8), (d.k, 0), (d.k, 3), (0, 3), d))  # 7 rejected at once
    assert c.estimates.matching_acceptance.value == 0.0  # alpha = 1; uid 8's 3 kept not counted
    assert c.choose([7], frozenset({7})).k == 0  # acceptance 0: nothing pays
    c.observe_matching(7, drafted=4, accepted=2)  # 2 kept, one rejection: 2/3
    c.observe_realisation(predicted_tokens=10.0, emitted_tokens=3)  # rho at its floor, 0.8
    d = c.choose([7], frozenset({7}))
    # k=2: 1 + 2/3 + 4/9 tokens for 1.6 plain steps, 1.32 (1.06 were it scaled by rho)
    assert d.k == 2 and d.estimates[7] == pytest.approx((2 / 3, 1.0))


def test_a_row_is_priced_at_its_own_matching_drafts_once_it_has_two():
    """Code edits took the shared matching estimate to 0.9, and the chat
    after them verified at k=16 each time one token of its shadow draft
    matched. A row's own matching drafts price it once it has two; a new
    row starts from the shared estimate."""
    c = _off_on_rejections(max_k=4, warmup=2, matching_alpha=0.05)
    for _ in range(5):
        c.observe_matching(1, drafted=4, accepted=4)  # an earlier request's copies
    c.remove_sequence(1)
    assert c.choose([7], frozenset({7})).k == 4  # on the shared estimate, 1.0
    c.observe_matching(7, drafted=4, accepted=0)
    assert c.choose([7], frozenset({7})).k > 0  # one of its own: still shared
    c.observe_matching(7, drafted=4, accepted=0)
    assert c.choose([7], frozenset({7})).k == 0  # two: its own, 0
    assert c.choose([8], frozenset({8})).k == 4  # another row: shared


def test_matching_rows_never_override_where_no_k_can_pay_or_no_real_pass_was_timed():
    """No override where the step must stay plain (no k can pay at this batch
    size, a plain step was never timed here, nothing may speculate), nor
    where the pass is priced before three real steps rescaled the start-up
    calibration: the override is optimistic by design, a bare calibration
    pass priced k=8 at 1.8 plain steps at B=16 on a CPU where real steps
    cost 4-7, and chat at 4 clients on a CPU, its bucket priced by one real
    step, verified for rows copying their shadow drafts at k=4 and 6 for
    1.8 and 2.05 plain steps where those steps cost 2.05 and 2.7."""
    c = _off_on_rejections(max_k=4)
    set_costs(c, 1, 1.0, {k: 1.0 * (k + 1) for k in range(1, 5)})
    for k in range(1, 5):
        for _ in range(2):
            c.observe_verify_step(1, k, 1.0 * (k + 1))
    d = c.choose([7], frozenset({7}))
    assert d.k == 0 and d.cannot_pay and not d.matching
    fresh = make(max_k=4)
    assert fresh.choose([7], frozenset({7})).k == 0  # calibrate: a plain step first
    capped = _off_on_rejections(max_k=4, disable_by_batch_size=1)
    assert capped.choose([7], frozenset({7})).k == 0
    calibrated = make(max_k=4)
    calibrated.costs.calibrate(1, {k: 1.0 + 0.1 * k for k in range(1, 5)})
    plain_steps(calibrated, 1, 1.0)
    calibrated.observe_acceptance(7, drafted=4, accepted=0)
    assert calibrated.choose([7], frozenset({7})).k == 0
    for k in (1, 2):  # two real passes: the calibration still prices the rest
        calibrated.observe_verify_step(1, k, 1.0 + 0.1 * k)
        assert calibrated.choose([7], frozenset({7})).k == 0
    calibrated.observe_verify_step(1, 3, 1.3)  # three: the line rests on real steps
    assert calibrated.choose([7], frozenset({7})).k > 0


def test_decisions_to_verify_are_counted_by_why_the_controller_verified():
    """The metrics' ``verified_because``: what a workload's verifications were
    (speculate, an untimed k tried, fixed k, ...); a plain step counts nowhere."""
    from mlx_lm_server.spec_decode.metrics import StepCounts

    counts = StepCounts()
    c = _calibrated_controller(2.6)
    counts.decided(c.choose([0]))  # try k=10
    c.observe_verify_step(1, 10, 2.3)
    counts.decided(c.choose([0]))  # speculate at k=10
    counts.decided(make(dynamic=False, adaptive_k=False).choose([0]))  # fixed k
    off = make(max_k=4)
    set_costs(off, 1, 1.0, {k: 1.0 + 0.3 * k for k in range(1, 5)})
    off.observe_acceptance(0, drafted=4, accepted=0)
    counts.decided(off.choose([0]))  # plain
    assert counts.verify_why == {"try": 1, "speculate": 1, "fixed k": 1}


def test_grammar_forced_runs_are_verified_alone_only_as_far_as_their_pass_pays():
    """A step that verifies grammar-forced tokens alone caps the runs at the
    k whose pass emits the most tokens per plain step: one row's long run
    does not make sixteen rows pay a long pass where each token of it is
    dear (a CPU), and does where passes cost about a plain step (a GPU)."""
    runs = [8] + [1] * 15  # one row at a key, fifteen with a token each
    ks = (1, 2, 3, 4, 6, 8)
    cpu = lambda k: 1.0 + 0.5 * k  # noqa: E731
    gpu = lambda k: 1.0 + 0.02 * k  # noqa: E731
    # CPU: k=1 emits 32 tokens for 1.5 plain steps (1.33 B a step); k=8 39 for 5.
    assert forced_run_cap(runs, ks, cpu) == 1
    # GPU: k=8 emits 39 for 1.16 (2.10 B a step), k=1 32 for 1.02 (1.96).
    assert forced_run_cap(runs, ks, gpu) == 8
    # No k beats a plain step's B tokens: a plain step.
    assert forced_run_cap([1] * 16, ks, lambda k: 2.5 + k) == 0
    # A prompt waiting for its first token: no pass of 1.5 plain steps or more.
    assert forced_run_cap(runs, ks, cpu, most=1.5) == 0
    assert forced_run_cap(runs, ks, gpu, most=1.5) == 8


def test_a_borrowed_line_is_rescaled_by_the_real_grammar_steps_of_its_bucket_never_lowered():
    """JSON to a schema at 16 clients, SmolLM2 on a CPU: bucket 4 calibrated
    (plain 145 ms, k=16 330 ms), plain steps at B=16 222 ms. Steps at k=1 to
    3 cost 2.3-4.1 plain steps (k + 1 grammar masks a row share the cores)
    where the borrowed line said about 1.1-1.5, and k=10 at B=13 was
    verified on a borrowed 2.45 where it took 5.7."""
    from mlx_lm_server.spec_decode.control.costs import StepCosts

    costs = StepCosts()
    costs.use(grammar=True)
    costs.calibrate(4, {1: 0.152, 16: 0.330}, 0.145)
    for _ in range(3):
        costs.observe_plain(16, 0.222)
    borrowed = {k: costs.cost(13, k) for k in (1, 2, 3, 10)}
    assert borrowed[10] < 3.0
    real = {1: 0.906, 2: 0.504, 3: 0.775}
    for k, seconds in real.items():
        costs.observe_verify(16, k, seconds)
    scale = sorted(real[k] / 0.222 / costs._borrowed_line(13)(k) for k in real)[1]
    assert scale > 2.0
    assert costs.cost(13, 10) == pytest.approx(borrowed[10] * scale)
    assert costs.cost(13, 10) > 5.0

    # Before three real steps, the smallest ratio of those there are: the
    # first step at a fresh bucket already prices the next.
    early = StepCosts()
    early.use(grammar=True)
    early.calibrate(4, {1: 0.152, 16: 0.330}, 0.145)
    for _ in range(3):
        early.observe_plain(16, 0.222)
    # The trace's first step at B=16: k=6 at 976 ms. Below it the line
    # through it (2.1 plain steps at k=2) would price k=2 under that ratio.
    line = early._borrowed_line(13)
    early.observe_verify(16, 6, 0.976)
    first = 0.976 / 0.222 / line(6)
    assert first > 2.0
    assert early.cost(13, 2) == pytest.approx(early._borrowed_line(13)(2) * first)
    early.observe_verify(16, 1, real[1])  # dearer still: the smaller ratio holds
    assert real[1] / 0.222 / line(1) > first
    assert early.cost(13, 2) == pytest.approx(early._borrowed_line(13)(2) * first)

    # Steps cheaper than the borrowed line leave it a floor.
    cheap = StepCosts()
    cheap.use(grammar=True)
    cheap.calibrate(4, {1: 0.152, 16: 0.330}, 0.145)
    for _ in range(3):
        cheap.observe_plain(16, 0.222)
    for k in (1, 2, 3):
        cheap.observe_verify(16, k, 0.222)
    assert cheap.cost(13, 10) == pytest.approx(borrowed[10])

    # Steps without a grammar row keep the line as borrowed: it held for
    # them (chat at 16 clients, 8.1 plain steps where the step took 9.2).
    costs.use(grammar=False)
    for _ in range(3):
        costs.observe_plain(16, 0.222)
    for k, seconds in real.items():
        costs.observe_verify(16, k, seconds)
    assert costs.cost(13, 10) == pytest.approx(borrowed[10])
