"""What a head's acceptance buys on this machine: step prices and the speed-up they predict.

A verification of k drafts costs the target's pass over k + 1 tokens plus
the head's k drafting passes, and emits the mean accepted length a(k)
tokens (bonus included); plain decoding emits one token per step. So

    speed-up(k) = a(k) * step / (verify(k + 1) + k * draft)

at the prices measured here, on B rows of C context tokens each (the
controller prices proposals the same way from its live measurements).
``evaluate`` reports it beside the acceptance; ``scripts/bench/bench_heads.py``
prints the prices themselves.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable


def median_seconds(fn: Callable[[], None], reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def target_prices(model, batch: int, context: int, ks, reps: int = 10) -> dict:
    """Seconds of the target's plain step (``"step"``) and of its pass over
    k + 1 tokens for each k (``"verify"``: {k: s}), on ``batch`` rows of
    ``context`` tokens; ``"run_step"`` runs one more plain step."""
    import mlx.core as mx

    from ..kv import batch_caches, make_rollbackable, rollback
    from ..runtime import mlx_lm_adapter

    V = mlx_lm_adapter.text_args(model).vocab_size
    cache = make_rollbackable(batch_caches(model, [0] * batch))
    mx.eval(model(mx.random.randint(0, V, (batch, context)), cache=cache))

    def step(n):
        def run():
            mx.eval(model(mx.random.randint(0, V, (batch, n)), cache=cache))
            rollback(cache, [n] * batch)
        return run

    return {"step": median_seconds(step(1), reps),
            "verify": {k: median_seconds(step(k + 1), reps) for k in ks},
            "run_step": step(1)}


def proposal_seconds(proposer, num_features: int, batch: int, context: int, k: int,
                     dtype, reps: int = 10) -> float:
    """One proposal of k drafts for ``batch`` rows holding ``context`` target
    states each, one new state per row since the last (a server's steady
    state); the rows leave the proposer afterwards."""
    import mlx.core as mx

    from ..spec_decode.drafts import Context

    uids = list(range(batch))
    histories = [list(range(1, context + 1)) for _ in uids]
    for u in uids:
        proposer.add_sequence(u, context)
    proposer.observe_target(uids, mx.random.normal((batch, context, num_features)).astype(dtype),
                            [context] * batch)
    proposer.propose(uids, [Context(h, 7) for h in histories], [k] * batch)
    proposer.observe_verification(uids, [0] * batch)

    def run():
        proposer.observe_target(uids, mx.random.normal((batch, 1, num_features)).astype(dtype),
                                [1] * batch)
        for h in histories:
            h.append(7)
        proposer.propose(uids, [Context(h, 7) for h in histories], [k] * batch)
        proposer.observe_verification(uids, [0] * batch)

    try:
        return median_seconds(run, reps)
    finally:
        for u in uids:
            proposer.remove_sequence(u)


def predicted_speedup(mean_accepted: dict, step: float, verify: dict, draft: dict) -> dict:
    """{k: a(k) * step / (verify[k] + draft[k])}, ``draft[k]`` the seconds of
    one proposal of k drafts."""
    return {k: round(a * step / (verify[k] + draft[k]), 3) for k, a in mean_accepted.items()}


def head_speedups(model, head, embed, layers, mean_accepted: dict, batch: int = 1,
                  context: int = 512, reps: int = 10) -> dict:
    """The speed-up ``mean_accepted`` (an ``evaluate`` result's) buys an
    EAGLE-3 head on this machine at ``batch`` rows, with the prices. The
    drafts are timed on features in the target's compute dtype (a 4-bit
    target's too), as the head meets them when serving."""
    from ..runtime import mlx_lm_adapter
    from ..spec_decode.heads import compute_dtype
    from ..spec_decode.proposer.head import HeadProposer

    ks = [int(k) for k in mean_accepted]
    prices = target_prices(model, batch, context, ks, reps)
    proposer = HeadProposer(head, embed, head.logits, layers)
    features = 3 * mlx_lm_adapter.text_args(model).hidden_size
    draft = {k: proposal_seconds(proposer, features, batch, context, k, compute_dtype(model),
                                 reps) for k in ks}
    accepted = {int(k): a for k, a in mean_accepted.items()}
    return {"batch": batch, "context": context,
            "step_ms": round(prices["step"] * 1e3, 2),
            "verify_ms": {k: round(v * 1e3, 2) for k, v in prices["verify"].items()},
            "draft_ms": {k: round(v * 1e3, 2) for k, v in draft.items()},
            "predicted_speedup": predicted_speedup(accepted, prices["step"], prices["verify"],
                                                   draft)}
