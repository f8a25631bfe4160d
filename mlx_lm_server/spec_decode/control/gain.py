"""What speculating is expected to gain per step: the controller's arithmetic.

Plain Python, no MLX. From each sequence's acceptance a_i and proposal rate
r_i (``estimates.py``) and the price of a pass (``costs.py``):

    E_i(k)    = 1 + r_i (e(a_i, k) - 1)   tokens sequence i emits per step, where
              e(a, k) = (1 - a^(k+1)) / (1 - a) (Leviathan et al. 2023), k + 1
              when a = 1
    c(B, k)   = T_verify(B, k + 1) / T_plain(B)   the measured cost of a
              verification step over k + 1 tokens relative to a plain step,
              at batch size B. T_plain is a plain step's cycle in a run of
              them (start to next start, pipelined), T_verify the
              verification step's cycle plus what the plain steps after it
              pay over T_plain (realigning, an empty pipeline: see
              ``timing.py``); per power-of-two bucket of B and per k bucket,
              the median of the last few (``costs.StepCosts``), seeded by the
              start-up calibration; unseen k are priced on the line through
              the seen ones and a plain step at k = 0
    P(B)      = 1 - prod_i (1 - r_i)   how often some row has a draft: a step
              where none has one is a plain step (the engine runs no pass
              without drafts), so it costs 1, not c(B, k). At B = 1 on a chat
              (r = 0.2) this is the difference between paying c and paying
              1 + 0.2 (c - 1); at B = 16 it is 1 within 0.3%.
    rho       realisation: over verification steps, the EMA of the tokens
              emitted by the rows that had drafts over the EMA of the tokens
              e(a_i, k_i) predicted for them when k was chosen, at most 1;
              rows still on the global prior (not warmed up) are left out
    gain(k)   = rho * sum_i E_i(k) / (B * (1 + P(B) (c(B, k) - 1)))

Why rho: the controller speculates exactly when its estimates look good, so
the steps it verifies are the ones where noisy per-sequence estimates run
high, and they then fall back (regression to the mean). Where the gain is
thin (a chat batch whose n-gram drafts pay a few percent on paper), that
optimism is the whole margin. rho scales every k alike, so it never changes
which k is best, only whether speculating pays at all; it is capped at 1 so
a lucky run never makes speculation look better than the model says. It
measures the optimism of acceptance only: proposal rates are in P(B) and
E_i, so rows without drafts are left out of it (at B = 1 every verified row
has one, and 1 + r (e - 1) predicted against e emitted read as a lucky run).
Rows still on the global prior are left out too: a new sequence's misses are
the previous request's ending carried over (see ``estimates.py``), and
counting them in rho would hold speculation back well after (seen on a CPU:
two such steps took rho to 0.62 and cost five plain steps a request).

rho is floored at ``realisation_floor`` (0.8). The optimism it corrects is
that of choosing steps by noisy estimates, about 0.9 on chat. Far below
that it measures something else, and feeds on itself: where acceptance
comes in bursts (the suffix index drafting a repeated task: a record's keys
copied, its values not), a per-row EMA peaks as a burst ends, so a
controller that verifies only where its estimates are highest verifies just
after each burst, realises a third to a half of its prediction, and, every
gain scaled by that, verifies rarer and later still. On that task at B=1
(Qwen2.5-Coder-0.5B, CPU) rho sat at 0.30-0.56 and 80% of steps were plain;
replayed over its recorded outputs, the controller reached 1.30x plain
decoding where drafting every step would have reached 1.75x, and 1.65x with
the floor, chat and code edit unchanged. The floor bounds that lag; the
controller's matching rows remove most of it.

gain(k) is throughput: the batch's tokens per plain step. Every row pays for
a verification pass, and a row without drafts gets nothing for it: where a
pass costs c plain steps, it waits c - 1 more for its next token. So a k is
also held to the rows' proportional fairness:

    fair(k)   = rho * (prod_i E_i(k))^(1/B) / (1 + P(B) (c(B, k) - 1))

the geometric mean of the rows' speed-ups, at least 1: a step that speeds
one row up 4x may slow three others 1.4x each (4 > 1.4^3), not 3x (the
pass of a CPU at k = 16 and B = 4). Chat at 4 clients on a CPU verified at
k = 16 for the one row whose shadow draft was copying (3.1 plain steps a
pass): throughput said 1.5x; the other three rows, their requests, and the
cell all finished later, 0.96-0.98x plain decoding. Where a pass costs
about a plain step (a GPU) the same row still verifies: 11.6 tokens at
1.05 plain steps is 1.76 at B = 4. At B = 1 fair(k) is gain(k); where
every row drafts alike they are equal; the controller picks the k of
highest gain among those fair (``controller.py``).
"""

from __future__ import annotations

import math
from typing import Sequence

from .estimates import Ema


def expected_tokens(a: float, k: int) -> float:
    """e(a, k): tokens emitted per step with k drafts and per-token acceptance a."""
    if k <= 0:
        return 1.0
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def tokens_per_step(acceptance: float, proposal_rate: float, k: int) -> float:
    """E(k) = 1 + r (e(a, k) - 1): only steps with drafts add to the one token."""
    return 1.0 + proposal_rate * (expected_tokens(acceptance, k) - 1.0)


def _step_cost(estimates: Sequence[tuple[float, float]], cost: float) -> float:
    """1 + P(B) (c(B, k) - 1): a step where no row has a draft is a plain one."""
    none_drafts = math.prod(1.0 - r for _, r in estimates)
    return 1.0 + (1.0 - none_drafts) * (cost - 1.0)


def expected_gain(estimates: Sequence[tuple[float, float]], k: int, cost: float,
                  rho: float) -> float:
    """gain(k) for a batch of per-sequence (a_i, r_i), at c(B, k) = ``cost``."""
    tokens = sum(tokens_per_step(a, r, k) for a, r in estimates)
    return rho * tokens / (len(estimates) * _step_cost(estimates, cost))


def fair_gain(estimates: Sequence[tuple[float, float]], k: int, cost: float,
              rho: float) -> float:
    """The geometric mean of the rows' speed-ups, rho E_i(k) over the step's
    cost: at least 1 where the rows a step speeds up gain more, in
    proportion, than the rows it slows down lose (see the module docstring).
    At B = 1 it is gain(k)."""
    log_tokens = sum(math.log(tokens_per_step(a, r, k)) for a, r in estimates)
    return rho * math.exp(log_tokens / len(estimates)) / _step_cost(estimates, cost)


def fair_ks(estimates: Sequence[tuple[float, float]], ks: Sequence[int], costs: dict,
            rho: float) -> list:
    """The k of ``ks`` (priced by ``costs``) whose fair(k) is at least 1."""
    return [k for k in ks if fair_gain(estimates, k, costs[k], rho) >= 1.0]


class Realisation:
    """rho: how much of its predicted tokens speculation has delivered."""

    def __init__(self, alpha: float, floor: float):
        self.floor = floor
        self._emitted = Ema(alpha)
        self._predicted = Ema(alpha)

    def observe(self, predicted_tokens: float, emitted_tokens: int) -> None:
        """A verification step's tokens (pending plus accepted, over the rows
        that had drafts) against the e(a_i, k_i) expected of them when k was
        chosen."""
        if predicted_tokens > 0:
            self._emitted.update(emitted_tokens)
            self._predicted.update(predicted_tokens)

    @property
    def value(self) -> float:
        """Emitted over predicted, at most 1 (1 before any verification)."""
        if self._predicted.value is None:
            return 1.0
        return min(1.0, self._emitted.value / self._predicted.value)

    @property
    def factor(self) -> float:
        """rho as the gain uses it: the value, floored."""
        return max(self.floor, self.value)


def forced_run_cap(forced: Sequence[int], ks: Sequence[int], cost, most: float = math.inf) -> int:
    """How many grammar-forced tokens a row verifies in a step where no row
    speculates and the grammars' forced tokens are verified alone (they are
    always kept), or 0 for a plain step: the k of ``ks`` whose pass emits the
    most tokens per plain step, (B + sum_i min(n_i, k)) / (B c(B, k)) for the
    rows' forced runs n_i, where that beats a plain step's B tokens and the
    pass costs under ``most`` plain steps (a prompt waits for its first
    token). ``cost``: k -> c(B, k).

    Unpriced, with every run verified whole, such a pass was padded to the
    longest run: one row's run of keys made every row's pass that long,
    which a CPU pays per token (k = 16 at B = 16 costs about 9 plain steps).
    """
    B = len(forced)
    best, best_rate = 0, 1.0
    for k in ks:
        c = cost(k)
        if c >= most:
            continue
        rate = (B + sum(min(n, k) for n in forced)) / (B * c)
        if rate > best_rate:
            best, best_rate = k, rate
    return best
