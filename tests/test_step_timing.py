"""The controller's cost inputs are what steps really cost on the real model."""

import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_lm_server.sampling import SamplingParams
from mlx_lm_server.scheduler import GenerationRequest, Scheduler
from mlx_lm_server.spec_decode.config import SpecDecodeConfig
from mlx_lm_server.spec_decode.controller import Decision, DynamicSpecController
from mlx_lm_server.spec_decode.engine import SpecDecodeEngine
from mlx_lm_server.spec_decode.proposer.ngram import NGramProposer

from test_spec_engine import _run


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

    def alternate(uids):
        calls["n"] += 1
        k = 4 if calls["n"] % 2 == 0 else 0
        return Decision(k, {u: k for u in uids}, "test schedule")

    controller._decide = alternate
    s = Scheduler(model, tokenizer, engine=engine)
    s.start()
    prompt = tokenizer.encode("one two three one two three " * 8)
    try:
        _run(s, [GenerationRequest(prompt + [i], 40, SamplingParams(temperature=0))
                 for i in range(B)])
    finally:
        s.shutdown()
        s.join(10)
    plain = controller._plain_time[B].value
    assert engine.stats.fallback_steps > 5 and engine.stats.steps > 5
    assert plain is not None and plain > 0.5 * forward, (plain, forward)
