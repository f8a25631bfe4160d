"""The controller's cost inputs are what steps really cost on the real model."""

import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_lm_server.sampling import SamplingParams
from mlx_lm_server.requests import GenerationRequest
from mlx_lm_server.scheduler import Scheduler
from mlx_lm_server.spec_decode.config import SpecDecodeConfig
from mlx_lm_server.spec_decode.control.controller import Decision, DynamicSpecController
from mlx_lm_server.spec_decode.engine import SpecDecodeEngine
from mlx_lm_server.spec_decode.proposer.ngram import NGramProposer

from test_spec_engine import _run


def _alternating_engine(model):
    """An engine whose steps alternate plain and k=4 verification."""
    controller = DynamicSpecController(4, dynamic=False, adaptive_k=False)
    engine = SpecDecodeEngine(model, SpecDecodeConfig(mode="ngram", num_speculative_tokens=4),
                              NGramProposer(1, 4), controller)
    calls = {"n": 0}

    def alternate(uids, *_):
        calls["n"] += 1
        k = 4 if calls["n"] % 2 == 0 else 0
        return Decision(k, {u: k for u in uids}, "test schedule")

    controller._decide = alternate
    return engine, controller


def test_measured_plain_step_is_a_forward_pass_not_a_dispatch(smollm2):
    """On the real model, the controller's plain-step time is at least most of a
    synchronous one-token forward pass over the batch (timing the call alone
    reads only its dispatch after a verify step)."""
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

    # Plain and verify steps alternate: each plain step's pass is still running
    # when the verify step after it starts.
    engine, controller = _alternating_engine(model)
    s = Scheduler(model, tokenizer, engine=engine)
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
    (set by the test), so that a period's charge is exact, not a wall-clock
    reading taken a little later than the test's own."""

    now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_verify_cost_is_the_period_to_the_next_step(smollm2, monkeypatch):
    """A verification step is charged from the moment its pending tokens are
    on the host to the next step's start (the emitting after it included,
    the wait for the plain pass before it not: a run of plain steps pays
    that too), and a period in which prompts were prefilled or sequences
    joined, or whose pass had a shape never run before (compiling), is not
    charged at all."""
    from mlx_lm_server import upstream
    from mlx_lm_server.spec_decode import engine as engine_module
    from mlx_lm_server.spec_decode.control import timing as timing_module

    model, tokenizer = smollm2
    engine, controller = _alternating_engine(model)
    clock = _StepClock()
    monkeypatch.setattr(engine_module, "time", clock)
    monkeypatch.setattr(timing_module, "time", clock)
    observed = []
    real_observe = controller.observe_verify_step
    controller.observe_verify_step = lambda B, k, s: (observed.append(s), real_observe(B, k, s))
    # (entry, charged from, uids, prompt tokens so far, verified?, seconds in the step, new shape?)
    steps = []
    real_step = engine.speculative_step
    real_pending_list = engine._pending_list
    wait = 0.003  # what the engine's clock shows a wait for a plain pass to take

    def pending_list(pending):
        if engine._pending_host[0] is not pending:  # a plain pass still running
            clock.now += wait
        return real_pending_list(pending)

    engine._pending_list = pending_list

    def recorded(batch):
        tic = clock.now = time.perf_counter()
        uids = set(batch.uids)
        prompt_tokens = upstream.prompt_tokens_processed(engine._gen)
        verified = engine.steps.verify_steps
        shapes = engine.timer.shapes_run
        out = real_step(batch)
        steps.append((tic, clock.now, uids, prompt_tokens, engine.steps.verify_steps > verified,
                      time.perf_counter() - tic, engine.timer.shapes_run > shapes))
        return out

    engine.speculative_step = recorded  # installed on the generator at start
    s = Scheduler(model, tokenizer, engine=engine)
    s.start()
    prompt = tokenizer.encode("one two three one two three " * 8)
    try:
        # Staggered: later requests join (and are prefilled) while others
        # decode. The first run compiles every pass shape; the second, timed
        # one has joins that are not also new shapes. Long enough that the
        # steady steps after the last join outnumber the skipped ones.
        reqs = [GenerationRequest(prompt + [i], 96, SamplingParams(temperature=0))
                for i in range(8)]
        _run(s, reqs, stagger=0.3)
        steps.clear()
        observed.clear()
        _run(s, reqs, stagger=0.3)
    finally:
        s.shutdown()
        s.join(10)

    expected = []
    for (_, charged_from, uids, prompt_tokens, verified, _, new_shape), \
            (t_next, _, uids_next, prompt_next, *_) in zip(steps, steps[1:]):
        if not verified:
            continue
        if prompt_next == prompt_tokens and uids >= uids_next and not new_shape:
            expected.append(t_next - charged_from)
    assert len(expected) >= 8, len(expected)
    # Some charged steps waited for a plain pass, and that wait was left out.
    assert any(charged_from > t for t, charged_from, _, _, verified, *_ in steps if verified)
    # Joins skipped for themselves, not only because they also had new shapes.
    assert any(not new_shape and (prompt_next != prompt_tokens or not uids >= uids_next)
               for (_, _, uids, prompt_tokens, verified, _, new_shape),
               (_, _, uids_next, prompt_next, *_) in zip(steps, steps[1:]) if verified)
    assert len(observed) == len(expected)
    assert observed == expected
    in_step = [sec for *_, verified, sec, _ in steps[:-1] if verified]
    assert sum(observed) > sum(sorted(in_step)[: len(observed)]) - wait * len(observed)


def test_plain_steps_are_timed_often_until_the_window_fills_then_rarely(smollm2):
    """Each timed plain step drains the pipeline (a GPU idles while the host
    emits): one in 8 is timed until the bucket's median has its window of 9,
    then one in 64."""
    from mlx_lm_server.spec_decode.control import timing as timing_module

    model, tokenizer = smollm2
    engine = SpecDecodeEngine(model, SpecDecodeConfig(mode="ngram", num_speculative_tokens=4,
                                                      disable_by_batch_size=1,
                                                      calibration_seconds=0),
                              NGramProposer(1, 4))
    timed = []
    real = engine.controller.observe_plain_step
    engine.controller.observe_plain_step = lambda B, s: (
        timed.append(engine.timer._plain_steps[1]), real(B, s))
    s = Scheduler(model, tokenizer, engine=engine)
    s.start()
    try:
        counting = ", ".join(str(i) for i in range(1, 40)) + ","
        _run(s, [GenerationRequest(tokenizer.encode(counting), 200,
                                   SamplingParams(temperature=0))])
    finally:
        s.shutdown()
        s.join(10)
    n = engine.timer._plain_steps[1] + 1
    assert n > 128, n  # the counting goes on: the settled interval is seen
    assert engine.controller.costs.window == 9
    assert timed == list(range(0, 65, 8)) + list(range(128, n, 64))
    assert timing_module.SETTLED_PLAIN_TIMING_INTERVAL == 64
