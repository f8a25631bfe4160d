"""The controller's cost inputs are what steps really cost on the real model."""

import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from test_spec_engine import _run

from mlx_lm_server.assembly import make_scheduler
from mlx_lm_server.decoding.sampling import SamplingParams
from mlx_lm_server.serving.request import GenerationRequest
from mlx_lm_server.spec_decode.config import SpecDecodeConfig
from mlx_lm_server.spec_decode.control.controller import Decision, DynamicSpecController
from mlx_lm_server.spec_decode.control.costs import StepCosts
from mlx_lm_server.spec_decode.control.timing import StepTimer
from mlx_lm_server.spec_decode.engine import SpecDecodeEngine
from mlx_lm_server.spec_decode.proposer.ngram import NGramProposer


class _Recorder:
    """The controller's side of the timer: its cost table and what it was told."""

    def __init__(self):
        self.costs = StepCosts()
        self.reports = []

    def observe(self, report):
        self.reports.append((report.batch_size, report.k, round(report.seconds * 1e3, 6)))
        if report.k:
            self.costs.observe_verify(report.batch_size, report.k, report.seconds)
        else:
            self.costs.observe_plain(report.batch_size, report.seconds)


def _replay(steps, controller=None):
    """Feed a StepTimer step starts: (start ms, kind, uids, prompt tokens[, k[,
    grammar]]) with kind "P", "V" or "F" (a pass over grammar-forced tokens
    alone), "*" after it where the pass shape is new, k its draft columns
    (10 unless given) and grammar whether the batch had a grammar row (the
    cost table it is priced and timed in, ``StepCosts.use``)."""
    controller = controller or _Recorder()
    timer = StepTimer(controller)
    for start, kind, uids, prompt_tokens, *rest in steps:
        timer.step(start / 1e3, uids, prompt_tokens)
        if len(rest) > 1:  # as the controller's choice does, after the timer's step
            controller.costs.use(rest[1])
        if kind != "P":
            timer.verifying(rest[0] if rest else 10, charge=not kind.endswith("*"))
    return controller.reports


def test_a_verification_is_charged_its_cycle_and_what_the_plain_steps_after_it_pay():
    """Plain samples are cycles of plain steps in a run; the two plain steps
    after a verification are charged to it (their excess over the plain
    median: on an H200 the first realigns and restarts the pipeline), a pass
    over grammar-forced tokens alone as one, and nothing is charged across a
    prefill or a pass that compiled."""
    rows, rows3 = {0, 1, 2, 3}, {0, 1, 2}
    script = [
        (0, "P", rows, 100), (4, "P", rows, 100), (8, "P", rows, 100), (12, "P", rows, 100),
        (16, "V", rows, 100),            # cycle 8
        (24, "P", rows, 100),            # 7: 3 over a plain cycle of 4
        (31, "P", rows, 100),            # 4.5: 0.5 over
        (35.5, "P", rows, 100),          # 4: a plain sample again
        (39.5, "V", rows, 100),          # 8, then a verification straight after:
        (47.5, "V", rows, 100),          # 7.5, then one plain step and a verification
        (55, "P", rows, 100),            # 5: 1 over
        (60, "V", rows, 100),            # 8, its first plain step after prefilled:
        (68, "P", rows, 100),
        (73, "P", rows, 120),            # prefilled before this step: nothing charged
        (77, "V*", rows, 120),           # compiled: nothing charged, and the two
        (90, "P", rows, 120),            # plain steps after it are no samples
        (97, "P", rows, 120),
        (101, "P", rows, 120),           # 4: a sample (a row left before the next)
        (105, "P", rows3, 120),          # 4: a sample
        (109, "V", rows3, 120),          # at B=3 (bucket 4): 6
        (115, "P", rows3, 120),          # 4
        (119, "P", rows3, 120),          # 4
        (123, "P", rows3, 120),          # 4: a sample
        (127, "F", rows3, 120),          # forced tokens alone: 8, charged as a
        (135, "P", rows3, 120),          # verification, the plain steps after it
        (139, "P", rows3, 120),          # no samples (4 and 4: nothing over)
        (143, "P", rows3, 120),
    ]
    assert _replay(script) == [
        (4, 0, 4.0), (4, 0, 4.0), (4, 0, 4.0), (4, 0, 4.0),
        (4, 10, 11.5),
        (4, 0, 4.0),
        (4, 10, 8.0),
        (4, 10, 8.5),
        (4, 0, 4.0),
        (3, 0, 4.0),
        (3, 10, 6.0),
        (3, 0, 4.0),
        (3, 10, 8.0),
    ]


def test_a_verification_before_three_plain_steps_at_its_bucket_prices_nothing():
    """Chat at B=4 on a CPU: the bucket's first plain step took 92 ms, the
    next ones 72-74. A verification charged on that one step (its cycle, 85,
    less what its recovery steps ran under 92) entered the table at 0.49
    plain steps and priced k=2 at 1.00 where its steps cost 1.7-2.0. Only
    verifications after three plain steps price the bucket."""
    rows = {0, 1, 2, 3}
    script = [
        (0, "P", rows, 100),             # 92: the bucket's first plain step
        (92, "V", rows, 100),            # 85, charged (72 - 92) twice: 45
        (177, "P", rows, 100), (249, "P", rows, 100),
        (321, "P", rows, 100),           # 74
        (395, "P", rows, 100),           # 72: three plain steps, median 74
        (467, "V", rows, 100),           # 85, its recovery at the median: 85
        (552, "P", rows, 100), (626, "P", rows, 100), (700, "P", rows, 100),
    ]
    recorder = _Recorder()
    assert [r[1:] for r in _replay(script, recorder) if r[1]] == [(10, 45.0), (10, 85.0)]
    assert recorder.costs.observed(4, 10) == 1
    assert recorder.costs.cost(4, 10) == pytest.approx(85 / 74)


def _scheduled_engine(model, verify_every: int):
    """An engine that verifies k=4 drafts every ``verify_every`` steps."""
    controller = DynamicSpecController(4, dynamic=False, adaptive_k=False)
    engine = SpecDecodeEngine(model, SpecDecodeConfig(mode="ngram", num_speculative_tokens=4),
                              NGramProposer(1, 4), controller)
    calls = {"n": 0}

    def schedule(uids, *_):
        calls["n"] += 1
        k = 4 if calls["n"] % verify_every == 0 else 0
        return Decision(k, {u: k for u in uids}, "test schedule")

    controller._decide = schedule
    return engine, controller


def test_measured_plain_step_is_a_forward_pass_not_a_dispatch(smollm2):
    """On the real model, the controller's plain-step cost is at least most of
    a synchronous one-token forward pass over the batch (a step's call alone
    can return before its pass has run)."""
    model, tokenizer = smollm2
    cache = make_prompt_cache(model)
    B = 8
    mx.eval(model(mx.array([[1] * 64] * B), cache=cache))
    times = []
    for _ in range(7):
        tic = time.perf_counter()
        mx.eval(model(mx.array([[2]] * B), cache=cache))
        times.append(time.perf_counter() - tic)
    forward = min(times)  # the fastest: a busy machine only slows the reference

    # Three plain steps between verifications: the third is a plain sample.
    engine, controller = _scheduled_engine(model, verify_every=4)
    s = make_scheduler(model, tokenizer, engine=engine)
    s.start()
    prompt = tokenizer.encode("one two three one two three " * 8)
    try:
        _run(s, [GenerationRequest(prompt + [i], 40, SamplingParams(temperature=0))
                 for i in range(B)])
    finally:
        s.shutdown()
        s.join(10)
    plain = controller.costs.plain_seconds(B)
    assert engine.steps.plain_steps > 5 and engine.steps.verify_steps > 5
    assert plain is not None and plain > 0.5 * forward, (plain, forward)


class _StepClock:
    """``time`` for the engine, frozen within each step at the step's entry
    (set by the test), so that the timer reads exactly the test's starts."""

    now = 0.0

    def perf_counter(self) -> float:
        return self.now


def _timed_serving(smollm2, monkeypatch, reqs, grammar_tokenizer=None, verify_every=4,
                   compiles=True, price=None, calibrated=()):
    """Serve ``reqs`` (each joining a running batch) on an engine that verifies every
    ``verify_every``-th step, its timer told that new pass shapes compile
    (a GPU) or not (this CPU);
    return what the controller was told of steps' costs and the steps as seen
    from outside the engine: (start ms, kind, rows, prompt tokens, columns,
    grammar rows or not) with kind "P", "V" or "F" (grammar-forced tokens alone), "*" after it
    for a new pass shape; ``price``: the controller's pass costs, where fixed;
    ``calibrated``: batch buckets given start-up figures (a pass over k + 1
    tokens at (1 + k / 4) plain passes)."""
    from mlx_lm_server.runtime import mlx_lm_adapter
    from mlx_lm_server.spec_decode import engine as engine_module

    model, tokenizer = smollm2
    engine, controller = _scheduled_engine(model, verify_every=verify_every)
    engine.timer.compiles = compiles
    if price is not None:  # (B, k) -> a pass's cost in plain steps
        controller.cost = price
    for B in calibrated:
        controller.costs.calibrate(B, {k: 0.01 * (1 + k / 4) for k in (1, 16)}, 0.01)
    clock = _StepClock()
    monkeypatch.setattr(engine_module, "time", clock)
    told = []
    real_observe = controller.observe

    def observe(report):
        if report.seconds is not None:
            told.append((report.batch_size, report.k, round(report.seconds * 1e3, 6)))
            told_grammar.append(controller.costs.grammar)
        real_observe(report)

    told_grammar = []  # the cost table (with grammar rows or not) each report went to

    controller.observe = observe
    steps = []
    real_step = engine.speculative_step

    def recorded(batch):
        clock.now = time.perf_counter()
        uids = set(batch.uids)
        prompt_tokens = mlx_lm_adapter.prompt_tokens_processed(engine._gen)
        verified, forced = engine.steps.verify_steps, engine.steps.forced_steps
        shapes = engine.timer.shapes_run
        grammar = bool(engine._constraints(batch))
        out = real_step(batch)
        kind = "P"
        if engine.steps.verify_steps > verified:
            kind = "F" if engine.steps.forced_steps > forced else "V"
            kind += "*" if engine.timer.shapes_run > shapes else ""
        steps.append((clock.now * 1e3, kind, uids, prompt_tokens, columns[-1], grammar))
        return out

    columns = [0]
    real_verify = engine._verify_step

    def verify(batch, plan):
        columns.append(plan.drafts.shape[1])
        return real_verify(batch, plan)

    engine._verify_step = verify
    engine.speculative_step = recorded  # installed on the generator at start
    s = make_scheduler(model, tokenizer, engine=engine, grammar_tokenizer=grammar_tokenizer)
    s.start()
    try:
        _run(s, reqs, one_by_one=True)
    finally:
        s.shutdown()
        s.join(10)
    return told, steps, told_grammar


def test_the_engine_times_every_step_from_its_start(smollm2, monkeypatch):
    """What the controller was told of the engine's steps, in serving with
    joins and prefills, is what a timer fed the steps' starts, kinds, rows
    and prefill counts (as seen from outside the engine) tells it."""
    model, tokenizer = smollm2
    prompt = tokenizer.encode("one two three one two three " * 8)
    reqs = [GenerationRequest(prompt + [i], 96, SamplingParams(temperature=0))
            for i in range(6)]
    told, steps, _ = _timed_serving(smollm2, monkeypatch, reqs)
    assert sum(k > 0 for _, k, _ in told) >= 5 and sum(k == 0 for _, k, _ in told) >= 5
    assert any(kind == "V*" for _, kind, *_ in steps)
    # Each prompt was prefilled alone, between decode steps.
    assert len({p for _, _, _, p, *_ in steps}) == len(reqs)
    assert told == _replay(steps, _Recorder())


def test_where_nothing_compiles_a_new_pass_shapes_first_verification_is_charged(
        smollm2, monkeypatch):
    """On a CPU a pass shape's first run is a run like any other: charged,
    so its batch bucket has a real step to price probes by."""
    model, tokenizer = smollm2
    prompt = tokenizer.encode("one two three one two three " * 8)
    reqs = [GenerationRequest(prompt + [i], 24, SamplingParams(temperature=0))
            for i in range(2)]
    told, steps, _ = _timed_serving(smollm2, monkeypatch, reqs, compiles=False)
    assert "V*" not in [kind for _, kind, *_ in steps]
    assert told == _replay(steps, _Recorder())  # every clean verification charged
    # The same serving where shapes compile leaves each shape's first out.
    told_gpu, steps_gpu, _ = _timed_serving(smollm2, monkeypatch, reqs, compiles=True)
    assert any(kind == "V*" for _, kind, *_ in steps_gpu)
    charged = lambda t: sum(k > 0 for _, k, _ in t)  # noqa: E731
    assert charged(told) > charged(told_gpu)


# Long property names: a row at a key has more forced tokens than there are rows.
FORCED_KEYS = {"type": "object", "properties": {
    "the_full_name_of_the_person_mentioned": {"type": "string", "maxLength": 40},
    "the_city_where_that_person_lives_now": {"type": "string", "maxLength": 40}},
    "required": ["the_full_name_of_the_person_mentioned", "the_city_where_that_person_lives_now"],
    "additionalProperties": False}


def test_passes_over_grammar_forced_tokens_are_charged_as_verifications(
        smollm2, grammar_tokenizer, monkeypatch):
    """A pass that verifies grammar-forced tokens alone (speculation off that
    step) is charged to the controller as a verification of its shape (the
    grammar table prices such passes, ``forced_run_cap``), and neither it nor
    the two plain steps after it is a plain step: the controller is told
    exactly what a timer that knows which passes were forced tells it."""
    from mlx_lm_server.decoding.structured import response_format_grammar

    model, tokenizer = smollm2
    grammar = response_format_grammar({"type": "json_schema", "json_schema": {
        "name": "out", "schema": FORCED_KEYS, "strict": True}})
    prompt = tokenizer.encode("Alice Smith lives in Paris. As JSON: ")
    reqs = [GenerationRequest(prompt + [i], 96, SamplingParams(temperature=0), grammar=grammar)
            for i in range(3)]
    # And a row without a grammar, last: its steps after the others finish
    # are plain samples to tell, whichever way the forced passes of the
    # others fell (they break the plain runs where each request joined).
    reqs.append(GenerationRequest(prompt + [3], 96, SamplingParams(temperature=0)))
    # Passes priced at a plain step (a GPU): every run of forced tokens pays.
    told, steps, told_grammar = _timed_serving(smollm2, monkeypatch, reqs, grammar_tokenizer,
                                               price=lambda B, k: 1.0)
    assert sum(kind.startswith("F") for _, kind, *_ in steps) >= 2
    assert "F" in [kind for _, kind, *_ in steps]  # one of a shape run before: charged
    assert sum(k == 0 for _, k, _ in told) >= 3
    assert told == _replay(steps, _Recorder())
    # Steps of a batch with grammar rows are timed into a table of their
    # own, and the last row's steps alone into the other (StepCosts.use).
    assert told_grammar[0] is True and told_grammar[-1] is False
    assert any(kind.startswith("F") and columns > 1 for _, kind, _, _, columns, _ in steps)


def test_grammar_forced_tokens_are_verified_alone_only_as_far_as_their_pass_pays(
        smollm2, grammar_tokenizer, monkeypatch):
    """A pass over grammar-forced tokens alone takes as many a row as pay at
    the controller's price (``forced_run_cap``), not the longest run: priced
    where one token a row pays and two never do, one a row."""
    from mlx_lm_server.decoding.structured import response_format_grammar

    tokenizer = smollm2[1]
    grammar = response_format_grammar({"type": "json_schema", "json_schema": {
        "name": "out", "schema": FORCED_KEYS, "strict": True}})
    prompt = tokenizer.encode("Alice Smith lives in Paris. As JSON: ")
    reqs = [GenerationRequest(prompt + [i], 96, SamplingParams(temperature=0), grammar=grammar)
            for i in range(4)]
    _, steps, _ = _timed_serving(smollm2, monkeypatch, reqs, grammar_tokenizer,
                                 price=lambda B, k: 1.2 if k == 1 else 100.0)
    forced = [columns for _, kind, _, _, columns, _ in steps if kind.startswith("F")]
    assert forced and set(forced) == {1}


def test_no_pass_verifies_grammar_forced_tokens_alone_on_a_borrowed_floor(
        smollm2, grammar_tokenizer, monkeypatch):
    """Priced at a plain step, every run of forced tokens pays; yet at a
    batch bucket the grammar table prices on the line borrowed from a
    smaller calibrated one (``StepCosts.priced_low``, a floor known to be
    low) no pass verifies forced tokens alone, nor before a bucket's plain
    steps are timed, and at one with start-up figures of its own they do."""
    from mlx_lm_server.decoding.structured import response_format_grammar

    tokenizer = smollm2[1]
    grammar = response_format_grammar({"type": "json_schema", "json_schema": {
        "name": "out", "schema": FORCED_KEYS, "strict": True}})
    prompt = tokenizer.encode("Alice Smith lives in Paris. As JSON: ")
    reqs = [GenerationRequest(prompt + [i], 96, SamplingParams(temperature=0), grammar=grammar)
            for i in range(4)]

    def forced_batch_sizes(calibrated):
        _, steps, _ = _timed_serving(smollm2, monkeypatch, reqs, grammar_tokenizer,
                                     price=lambda B, k: 1.0, calibrated=calibrated)
        return {len(uids) for _, kind, uids, *_ in steps if kind.startswith("F")}

    assert forced_batch_sizes((1,)) <= {1}
    assert forced_batch_sizes((1, 2, 4)) - {1}


def test_each_step_is_chosen_knowing_the_prompts_whose_prefill_chunk_follows_it(smollm2):
    """A prompt prefilled in chunks while another row decodes: upstream runs
    each chunk after a decode step of the same call, so the steps between
    its chunks are chosen knowing it waits (the controller holds a dear pass
    back for it), and the steps after it joined are not."""
    model, tokenizer = smollm2
    engine, controller = _scheduled_engine(model, verify_every=10**6)  # plain steps only
    seen = []  # (rows, prompts in prefill) per decision
    choose = controller.choose
    controller.choose = lambda uids, *args, **kw: seen.append(
        (len(uids), kw.get("prefilling", 0))) or choose(uids, *args, **kw)
    s = make_scheduler(model, tokenizer, engine=engine, prefill_step_size=64)
    s.start()
    try:
        short = tokenizer.encode("one two three " * 4)
        long = tokenizer.encode("four five six " * 60)  # about 180 tokens: 3 chunks
        _run(s, [GenerationRequest(short, 40, SamplingParams(temperature=0)),
                 GenerationRequest(long, 8, SamplingParams(temperature=0))], one_by_one=True)
    finally:
        s.shutdown()
        s.join(10)
    assert sum(rows == 1 and waiting == 1 for rows, waiting in seen) >= 2, seen
    assert all(waiting == 0 for rows, waiting in seen if rows == 2), seen
