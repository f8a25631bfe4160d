"""Per-step timings of a speculative engine in serving, for ``bench_spec.py --trace``.

The bench's counters say how long verification passes took in a window on
average; they cannot say whether a slow pass was slow because of its shape
(batch size, draft columns, key length), because it compiled, because a
prefill ran in the same step, or whether the time went around the pass
(emitting, the scheduler's work before the next step). This wraps an
engine's step methods, adds no synchronisation of its own, and records per
step: its kind, shape, and the host times at which its parts ended.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict


def attach(engine, records: list, label: list) -> None:
    """Record every step of ``engine`` into ``records``; ``label[0]`` names
    the window a record belongs to (the bench sets it before each window).
    Call before the scheduler installs the engine's step."""
    from mlx_lm_server.kv import make_rollbackable
    from mlx_lm_server.kv.dispatch import longest_row
    from mlx_lm_server.spec_decode import engine as engine_module

    step, plan, verify, judge = (engine.speculative_step, engine._plan, engine._verify_step,
                                 engine._judge)
    emit = engine_module.emit
    pending_list = engine._pending_list
    current: dict = {}

    def traced_step(batch):
        rec = {"window": label[0], "entry": time.perf_counter(), "B": len(batch.uids),
               "prompt_tokens": engine._prompt_tokens(), "kind": "plain"}
        current.clear()
        current.update(rec)
        out = step(batch)
        current["end"] = time.perf_counter()
        records.append(dict(current))
        return out

    def traced_plan(batch):
        out = plan(batch)
        current["plan_end"] = time.perf_counter()
        return out

    def traced_pending_list(pending):
        # The wait for the plain pass before a verification ends here.
        out = pending_list(pending)
        current["proposed_from"] = time.perf_counter()
        return out

    def traced_verify(batch, p):
        shapes = engine.timer.shapes_run
        K = p.drafts.shape[1]
        current.update(kind="verify", K=K, drafted=sum(p.num_drafts),
                       key=longest_row(make_rollbackable(batch.prompt_cache)) + K + 1,
                       verify_entry=time.perf_counter())
        out = verify(batch, p)
        current["new_shape"] = engine.timer.shapes_run > shapes
        return out

    def traced_judge(*a, **kw):
        out = judge(*a, **kw)
        current["judge_end"] = time.perf_counter()
        return out

    def traced_emit(*a, **kw):
        current["emit_entry"] = time.perf_counter()
        return emit(*a, **kw)

    engine.speculative_step = traced_step
    engine._plan, engine._verify_step = traced_plan, traced_verify
    engine._judge = traced_judge
    engine_module.emit = traced_emit  # the engine emits through its module's name
    engine._pending_list = traced_pending_list


def _ms(xs: list) -> str:
    if not xs:
        return "-"
    return f"{1e3 * statistics.median(xs):.1f} ms (n={len(xs)})"


def summarise(records: list) -> list[str]:
    """Per window: plain cycles; verification steps split into the pass and
    judging, rollback and emitting, the scheduler's gap to the next step, and
    the whole cycle; steps that prefilled or compiled are counted apart."""
    lines = []
    by_window = defaultdict(list)
    for r in records:
        by_window[r["window"]].append(r)
    for window, recs in by_window.items():
        cycles = defaultdict(list)  # plain: entry to next entry, no prefill between
        after_verify = defaultdict(list)  # the same, for a plain step after a verification
        parts = defaultdict(lambda: defaultdict(list))  # verify, by (B, K + 1)
        keys = defaultdict(list)  # key lengths of those passes
        odd = {"prefill": 0, "new_shape": 0}
        for prev, r, nxt in zip([None] + recs, recs, recs[1:]):
            prefilled = nxt["prompt_tokens"] != r["prompt_tokens"]
            if r["kind"] == "plain":
                if not prefilled and nxt["kind"] == "plain" and nxt["B"] == r["B"]:
                    after = prev is not None and prev["kind"] == "verify"
                    (after_verify if after else cycles)[r["B"]].append(nxt["entry"] - r["entry"])
                continue
            if prefilled or r.get("new_shape"):
                odd["prefill" if prefilled else "new_shape"] += 1
                continue
            p = parts[(r["B"], r["K"] + 1)]
            p["wait"].append(r["proposed_from"] - r["entry"])
            p["propose"].append(r["verify_entry"] - r["proposed_from"])
            p["pass+judge"].append(r["judge_end"] - r["verify_entry"])
            p["rollback"].append(r["emit_entry"] - r["judge_end"])
            p["emit"].append(r["end"] - r["emit_entry"])
            p["gap"].append(nxt["entry"] - r["end"])
            p["cycle"].append(nxt["entry"] - r["entry"])  # what the controller charges,
            # before the plain steps after it add their excess (control/timing.py)
            keys[(r["B"], r["K"] + 1)].append(r["key"])
        lines.append(f"  [{window}] plain cycle by B: "
                     + ", ".join(f"B={b} {_ms(v)}" for b, v in sorted(cycles.items()))
                     + "; after a verification step: "
                     + ", ".join(f"B={b} {_ms(v)}" for b, v in sorted(after_verify.items()))
                     + f"; verification steps left out: {odd}")
        for (b, k1), p in sorted(parts.items()):
            lines.append(f"    B={b} K+1={k1}: "
                         + "; ".join(f"{name} {_ms(v)}" for name, v in p.items())
                         + f"; key median {statistics.median(keys[(b, k1)]):.0f}")
    return lines
