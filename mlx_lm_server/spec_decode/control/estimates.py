"""What the controller estimates per sequence: EMAs of acceptance and of how
often the proposer has a draft, and the tokens a step emits given them.

Plain Python, no MLX.
"""

from __future__ import annotations

from typing import Optional


def expected_tokens(a: float, k: int) -> float:
    """Tokens emitted per step with k drafts and per-token acceptance a."""
    if k <= 0:
        return 1.0
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def tokens_per_step(acceptance: float, proposal_rate: float, k: int) -> float:
    """E(k) = 1 + r (e(a, k) - 1): only steps with drafts add to the one token."""
    return 1.0 + proposal_rate * (expected_tokens(acceptance, k) - 1.0)


class Ema:
    """Exponential moving average that reports None until its first update."""

    def __init__(self, alpha: float):
        self.alpha = alpha
        self.value: Optional[float] = None
        self.count = 0

    def update(self, x: float) -> float:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x
        self.count += 1
        return self.value


class AcceptanceEma:
    """Per-token acceptance from (drafted, accepted) observations.

    A step that drafted d and kept n < d saw n successes and one failure; one
    that kept all d saw d successes and no failure. The estimate is the ratio
    of the EMAs of successes and trials.
    """

    def __init__(self, alpha: float):
        self.successes = Ema(alpha)
        self.trials = Ema(alpha)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.successes.update(accepted)
        self.trials.update(accepted + (1 if accepted < drafted else 0))

    @property
    def count(self) -> int:
        return self.successes.count

    @property
    def value(self) -> Optional[float]:
        if self.trials.value is None:
            return None
        if self.trials.value <= 0:
            return 0.0
        return min(1.0, self.successes.value / self.trials.value)
