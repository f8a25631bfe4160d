"""What speculation is doing, in one ``SpecStats``: tokens in ``SpecCounts``,
steps in ``StepCounts``, throughput.

The scheduler feeds every emitted token to a ``SpecCounts`` (per request and
in total), after stop strings, EOS and ``max_tokens`` have been applied, so
nothing past a stop is ever counted and ``emitted = steps + accepted`` holds.
The engine counts its own steps and their time in a ``StepCounts``; the
controller's last ``Decision`` says what it chose and why.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class SpecCounts:
    steps: int = 0  # decode steps that emitted to a sequence
    num_drafts: int = 0  # of those, steps that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list = field(default_factory=list)
    # Where several proposers take part: proposer -> [draft tokens, accepted].
    by_proposer: dict = field(default_factory=dict)

    def observe(self, draft_position: Optional[int], num_drafted: int,
                proposer: Optional[str] = None) -> None:
        """One emitted token; ``draft_position`` None marks the first of a step."""
        if draft_position is None:
            self.steps += 1
            if num_drafted > 0:
                self.num_drafts += 1
                self.num_draft_tokens += num_drafted
                if proposer is not None:
                    self.by_proposer.setdefault(proposer, [0, 0])[0] += num_drafted
            return
        self.num_accepted_tokens += 1
        if proposer is not None:
            self.by_proposer.setdefault(proposer, [0, 0])[1] += 1
        while len(self.accepted_per_pos) <= draft_position:
            self.accepted_per_pos.append(0)
        self.accepted_per_pos[draft_position] += 1

    @property
    def emitted(self) -> int:
        return self.steps + self.num_accepted_tokens

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification pass: 1 + accepted drafts per draft."""
        return 1.0 + (self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0)

    def usage(self) -> dict:
        body = {
            "draft_tokens": self.num_draft_tokens,
            "accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
        }
        if self.by_proposer:
            body["by_proposer"] = self.per_proposer()
        return body

    def per_proposer(self) -> dict:
        return {name: {"draft_tokens": d, "accepted_tokens": a,
                       "acceptance_rate": round(a / d, 4) if d else 0.0}
                for name, (d, a) in sorted(self.by_proposer.items())}

    def per_position_rates(self) -> list[float]:
        return [n / self.num_drafts for n in self.accepted_per_pos] if self.num_drafts else []


@dataclass
class StepCounts:
    """The engine's batch steps and where their time went (tokens: ``SpecCounts``)."""

    verify_steps: int = 0  # batch steps that verified drafts
    plain_steps: int = 0  # batch steps of upstream's one-token decode
    bonus_tokens: int = 0  # rows of a verify step that kept every draft
    forced_steps: int = 0  # verify steps of grammar-forced tokens only (speculation off)
    fault_steps: int = 0  # speculative steps that failed and decoded plainly instead
    matching_steps: int = 0  # steps verified, speculation off, for rows copying their shadow draft
    time_propose: float = 0.0
    time_verify: float = 0.0
    time_rollback: float = 0.0
    time_verify_first: float = 0.0  # of time_verify, in passes of a shape run for the first time
    last_decision: Optional[object] = None  # the controller's latest Decision
    k_counts: dict = field(default_factory=dict)  # decisions per k
    # Decisions to verify by why (``verify_kind``): where a workload's
    # verifications come from (chat at 4 clients verified on 10-20% of its
    # steps on a CPU, against a 2% probe budget).
    verify_why: dict = field(default_factory=dict)
    # Trees of drafts (``tree.py``): verify steps with a branching row, their
    # rows that drafted, those rows' draft nodes, the drafts they kept (the
    # accepted depth), and the kept drafts by rank among their siblings
    # (rank 0 the drafter's first guess; the rest is what chains would lose).
    tree_steps: int = 0
    tree_rows: int = 0
    tree_nodes: int = 0
    tree_accepted: int = 0
    tree_accepted_by_rank: list = field(default_factory=list)

    def tree_pass(self, num_nodes, accepted, ranks: Optional[list]) -> None:
        """A verification step's counts, for a tree (``ranks``: its kept
        drafts' sibling ranks; None, a chain's step: nothing to count here)."""
        if ranks is None:
            return
        self.tree_steps += 1
        self.tree_rows += sum(n > 0 for n in num_nodes)
        self.tree_nodes += sum(num_nodes)
        self.tree_accepted += sum(accepted)
        for r in ranks:
            self.tree_accepted_by_rank.extend([0] * (r + 1 - len(self.tree_accepted_by_rank)))
            self.tree_accepted_by_rank[r] += 1

    @property
    def tree_off_first(self) -> int:
        """Kept drafts that were not their parent's first child."""
        return sum(self.tree_accepted_by_rank[1:])

    def decided(self, decision) -> None:
        self.last_decision = decision
        self.k_counts[decision.k] = self.k_counts.get(decision.k, 0) + 1
        self.matching_steps += bool(decision.k and decision.matching)
        if decision.k:
            why = verify_kind(decision.reason)
            self.verify_why[why] = self.verify_why.get(why, 0) + 1


# The controller's reasons for a step that verifies, by how they begin.
VERIFY_KINDS = ("cost probe", "probe", "matching", "try", "speculate", "fixed k", "dynamic off")


def verify_kind(reason: str) -> str:
    """``speculate``, ``probe``, ``matching``, ``try`` (an untimed k), ...;
    ``other`` for a reason no controller rule gives."""
    return next((kind for kind in VERIFY_KINDS if reason.startswith(kind)), "other")


class Throughput:
    """Decode tokens per second over a sliding window."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._events: deque = deque()

    def add(self, num_tokens: int, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        self._events.append((now, num_tokens))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()

    def rate(self, now: Optional[float] = None) -> float:
        now = time.monotonic() if now is None else now
        self._trim(now)
        if not self._events:
            return 0.0
        span = max(now - self._events[0][0], 1e-3)
        return sum(n for _, n in self._events) / span


class SpecStats:
    """Everything speculation reports, in one object: tokens (``SpecCounts``,
    fed by the scheduler after stops are applied), the engine's steps
    (``StepCounts``) and decode throughput. ``/v1/spec_decode/metrics``,
    Prometheus and the log line all read this one object."""

    def __init__(self, mode: str = "none", steps: Optional[StepCounts] = None, proposer=None):
        self.mode = mode
        self.tokens = SpecCounts()
        # None: no engine (speculation off or not possible for this model).
        self.steps = steps
        self.proposer = proposer
        self.throughput = Throughput()

    @property
    def last_decision(self):
        return self.steps.last_decision if self.steps is not None else None

    @property
    def current_k(self) -> int:
        last = self.last_decision
        return last.k if last else 0

    def snapshot(self) -> dict:
        """The JSON body of ``GET /v1/spec_decode/metrics``."""
        counts = self.tokens
        body = {
            "mode": self.mode,
            "enabled": self.steps is not None,
            "speculating": False,
            "k": {"current": 0, "distribution": {}, "reason": None},
            "acceptance_rate": {"ema": None, "overall": round(counts.acceptance_rate, 4)},
            "mean_accepted_length": round(counts.mean_accepted_length, 4),
            "acceptance_per_position": [round(r, 4) for r in counts.per_position_rates()],
            "totals": {
                "steps": counts.steps,
                "drafts": counts.num_drafts,
                "draft_tokens": counts.num_draft_tokens,
                "accepted_tokens": counts.num_accepted_tokens,
                "emitted_tokens": counts.emitted,
                "bonus_tokens": 0,
                "verify_steps": 0,
                "forced_steps": 0,
                "fallback_steps": 0,
                "fault_steps": 0,
                "matching_steps": 0,
            },
            "time_per_step_ms": {"propose": 0.0, "verify": 0.0, "rollback": 0.0},
            "decode_tokens_per_second": round(self.throughput.rate(), 2),
        }
        s = self.steps
        if s is None:
            return body
        proposer = self.proposer.stats() if self.proposer is not None else {}
        if proposer:
            body["proposer"] = proposer
        if counts.by_proposer:
            body["totals"]["by_proposer"] = counts.per_proposer()
        last = s.last_decision
        body["speculating"] = bool(last and last.speculating)
        body["k"] = {
            "current": self.current_k,
            "distribution": {str(k): n for k, n in sorted(s.k_counts.items())},
            "reason": last.reason if last else None,
            "verified_because": dict(sorted(s.verify_why.items())),
        }
        ema = last.acceptance if last else None
        body["acceptance_rate"]["ema"] = None if ema is None else round(ema, 4)
        body["totals"].update(
            bonus_tokens=s.bonus_tokens, verify_steps=s.verify_steps, forced_steps=s.forced_steps,
            fallback_steps=s.plain_steps, fault_steps=s.fault_steps,
            matching_steps=s.matching_steps,
        )
        if s.tree_steps:
            rows = max(1, s.tree_rows)
            body["trees"] = {
                "steps": s.tree_steps,
                "rows": s.tree_rows,
                "nodes_per_row": round(s.tree_nodes / rows, 3),
                "accepted_tokens": s.tree_accepted,
                "accepted_depth_per_row": round(s.tree_accepted / rows, 3),
                "accepted_by_sibling_rank": {str(r): n for r, n
                                             in enumerate(s.tree_accepted_by_rank)},
                "accepted_off_first_child": s.tree_off_first,
            }
        n = max(s.verify_steps, 1)
        body["time_per_step_ms"] = {
            "propose": round(1e3 * s.time_propose / n, 3),
            "verify": round(1e3 * s.time_verify / n, 3),
            "rollback": round(1e3 * s.time_rollback / n, 3),
        }
        return body

    def log_line(self, now: Optional[float] = None) -> str:
        """A periodic summary in the spirit of vLLM's spec-decode log."""
        counts = self.tokens
        per_pos = ", ".join(f"{r:.2f}" for r in counts.per_position_rates())
        return (
            f"spec decode: mean accepted length {counts.mean_accepted_length:.2f}, "
            f"acceptance {counts.acceptance_rate:.2%}, per position [{per_pos}], "
            f"k={self.current_k}, drafts {counts.num_drafts}, "
            f"decode {self.throughput.rate(now):.1f} tokens/s"
        )
