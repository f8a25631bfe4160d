"""StepClock: steps are charged completion to completion, as the pipeline runs them."""

import asyncio
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_lm_server.sampling import SamplingParams
from mlx_lm_server.scheduler import DoneEvent, ErrorEvent, GenerationRequest, Scheduler
from mlx_lm_server.spec_decode.config import SpecDecodeConfig
from mlx_lm_server.spec_decode.controller import Decision, DynamicSpecController
from mlx_lm_server.spec_decode.engine import SpecDecodeEngine
from mlx_lm_server.spec_decode.proposer.ngram import NGramProposer
from mlx_lm_server.spec_decode.step_clock import StepClock


def recording_clock():
    seen = []
    clock = StepClock(lambda b, s: seen.append(("plain", b, s)),
                      lambda b, k, s: seen.append(("verify", b, k, s)))
    return clock, seen


def test_pipelined_plain_steps_are_charged_their_period():
    # Each plain step returns when the previous pass is done (times 1, 2, 3 ...),
    # having dispatched its own pass.
    clock, seen = recording_clock()
    uids = [1, 2]
    for t in (1.0, 2.0, 3.0, 4.0):
        clock.completed(t, uids)
        clock.dispatched("plain", uids)
    assert seen == [("plain", 2, 1.0), ("plain", 2, 1.0)]


def test_plain_pass_is_charged_to_the_plain_step_not_the_verify_step_after_it():
    clock, seen = recording_clock()
    uids = [7]
    clock.dispatched("verify", uids, 4)
    clock.completed(10.0, uids)  # verify ends at 10
    clock.completed(10.1, uids)  # plain step returns at once: nothing was in flight
    clock.dispatched("plain", uids)
    clock.completed(11.0, uids)  # the next verify step reads the pending token at 11
    clock.dispatched("verify", uids, 4)
    clock.completed(13.5, uids)
    assert seen == [("plain", 1, 1.0), ("verify", 1, 4, 2.5)]


def test_an_interval_with_a_join_is_dropped():
    clock, seen = recording_clock()
    clock.completed(0.0, [1])
    clock.dispatched("plain", [1])
    clock.completed(1.0, [1])
    clock.dispatched("plain", [1])
    clock.completed(5.0, [1, 2])  # sequence 2 joined: a prefill ran in this interval
    clock.dispatched("plain", [1, 2])
    clock.completed(6.0, [1, 2])  # its predecessor's batch lacked 2: still dropped
    clock.dispatched("plain", [1, 2])
    clock.completed(7.0, [1, 2])
    clock.dispatched("plain", [1])
    clock.completed(8.0, [1])  # a leave is fine
    assert seen == [("plain", 2, 1.0), ("plain", 1, 1.0)]


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
    forward = sorted(times)[len(times) // 2]

    controller = DynamicSpecController(4, dynamic=False, adaptive_k=False)
    engine = SpecDecodeEngine(model, SpecDecodeConfig(mode="ngram", num_speculative_tokens=4),
                              NGramProposer(1, 4), controller)
    # Plain and verify steps alternate: each plain step's pass is still running
    # when the verify step after it starts.
    calls = {"n": 0}

    def every_third(uids):
        calls["n"] += 1
        k = 4 if calls["n"] % 2 == 0 else 0
        return Decision(k, {u: k for u in uids}, "test schedule")

    controller._decide = every_third
    s = Scheduler(model, tokenizer, engine=engine)
    s.start()
    prompt = tokenizer.encode("one two three one two three " * 8)

    async def one(i):
        handle = s.submit(GenerationRequest(prompt + [i], 40, SamplingParams(temperature=0)))
        while True:
            event = await asyncio.wait_for(handle.events.get(), 120)
            assert not isinstance(event, ErrorEvent), event.message
            if isinstance(event, DoneEvent):
                return

    async def run():
        await asyncio.gather(*[one(i) for i in range(B)])

    try:
        asyncio.run(run())
    finally:
        s.shutdown()
        s.join(10)
    plain = controller._plain_time[1].value
    assert engine.stats.fallback_steps > 5 and engine.stats.steps > 5
    assert plain is not None and plain > 0.5 * forward, (plain, forward)
