"""What a step costs, per batch bucket: a plain step and a verification step per k.

Each figure is the median of the last few observations, so one slow step (a
kernel compiled on first use, a page fault, another process) moves nothing,
while a lasting change (a longer context) wins within half a window. A
verification step is kept in plain steps of its own time, so that passes
timed over one workload's contexts price the next one's fairly. While a
k has fewer than three, its figure is the fastest of them, and no dearer than
the line through the other k's figures says: a single slow step must not
price a k out, or the k is never run again to correct it (on a GPU one
verification step at k = 2 that compiled a kernel the pass shape does not
name took 84 plain steps, and the line through it priced every k >= 2 out
for the rest of the run). Before
any observation a figure comes from the start-up calibration, if any (bare
forward passes over the same shapes, rescaled once three real steps, at any
k, show how much a step adds to its pass), else from a prior. A k never seen is
priced on the piecewise line through a plain step at k = 0 and the k seen;
a bucket with no figure at all borrows the calibrated line of the largest
smaller bucket that has one (for grammar batches, rescaled by the bucket's
real steps: ``_borrowed_cost``).

Steps whose batch holds a grammar-constrained row are timed and priced apart
(``use``): each row's masks are host work, k + 1 of them a row in a
verification, and on a CPU that work shares the cores with the pass. Mixed
into one table, the cheap passes of code edits priced the JSON rows' passes:
JSON to a schema at B=4 on a CPU verified at k=2 to 4 for 1.8 plain steps a
pass where the table said 1.3, and ran at 0.95x plain decoding. Both kinds
share the start-up calibration (bare passes, no grammar).
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Optional

# Cost prior for a bucket never measured nor calibrated: cheap enough to be tried once.
PRIOR_COST_PER_TOKEN = 0.08
# Observations after which a figure is their median, outliers and all.
SETTLED_SAMPLES = 3


# Draft lengths a verification pass is padded to: every pass over k + 1 tokens
# is one of a few shapes, compiled once (GPU kernels are built per shape).
K_BUCKETS = (1, 2, 3, 4, 6, 8, 10, 12, 16, 24, 32, 48, 64)


def k_buckets(max_k: int) -> tuple[int, ...]:
    """The draft lengths used up to ``max_k`` (``max_k`` itself included)."""
    return tuple(sorted({k for k in K_BUCKETS if k < max_k} | {max_k}))


def padded_k(k: int, max_k: int) -> int:
    """The smallest bucket holding ``k`` drafts."""
    return next(b for b in k_buckets(max_k) if b >= k)


def batch_bucket(batch_size: int) -> int:
    """Power-of-two bucket: costs measured at 5 and 7 sequences are shared."""
    b = 1
    while b < batch_size:
        b *= 2
    return b


class RobustTime:
    """The median of the last ``window`` observations; with fewer than three,
    the fastest of them (a step is slowed by outliers, never sped up: one
    slow step must not price a k)."""

    def __init__(self, window: int):
        self._samples: deque = deque(maxlen=window)

    def observe(self, seconds: float) -> None:
        self._samples.append(seconds)

    @property
    def count(self) -> int:
        return len(self._samples)

    @property
    def samples(self) -> tuple:
        return tuple(self._samples)

    @property
    def typical(self) -> Optional[float]:
        """The median of every observation kept, slow ones included."""
        return statistics.median(self._samples) if self._samples else None

    @property
    def value(self) -> Optional[float]:
        if len(self._samples) >= SETTLED_SAMPLES:
            return statistics.median(self._samples)
        return min(self._samples) if self._samples else None


class StepCosts:
    """Plain and verification step times per batch bucket; costs relative to a plain step."""

    def __init__(self, window: int = 9):
        self.window = window
        # grammar -> (bucket -> plain steps, bucket -> {k: verification steps})
        self._kinds: dict[bool, tuple[dict, dict]] = {False: ({}, {}), True: ({}, {})}
        self._plain: dict[int, RobustTime]
        self._verify: dict[int, dict[int, RobustTime]]
        self.use(grammar=False)
        # bucket -> {k: a calibrated pass over k + 1 tokens, in seconds}
        self._calibrated_seconds: dict[int, dict[int, float]] = {}
        # bucket -> {k: calibrated pass over k + 1 tokens / calibrated plain pass}
        self._calibrated_ratio: dict[int, dict[int, float]] = {}
        # bucket -> its calibrated plain pass, seconds
        self._calibrated_plain: dict[int, float] = {}

    def use(self, grammar: bool) -> None:
        """Time and price the steps from here on as those of a batch with
        (or without) a grammar-constrained row (see the module docstring)."""
        self._plain, self._verify = self._kinds[grammar]

    @property
    def grammar(self) -> bool:
        """Whether steps are timed and priced as a batch with a grammar row."""
        return self._plain is self._kinds[True][0]

    def observe_plain(self, batch_size: int, seconds: float) -> None:
        self._time(self._plain, batch_bucket(batch_size)).observe(seconds)

    def observe_verify(self, batch_size: int, k: int, seconds: float) -> None:
        """Kept in plain steps of its time (the plain median when it ran), not
        in seconds: contexts grow and shrink between workloads, and a pass
        timed over long contexts divided by plain steps timed later over
        short ones priced every k out (a long summary at B=4, then short
        records: verification passes at 5x a plain step where they cost
        2x, speculation off for good and the records 0.96x plain decoding).
        A step before its bucket has a plain figure (``has_plain``) prices
        nothing (a cost is relative to a plain step) and is dropped."""
        plain = self.plain_seconds(batch_size)
        if not self.has_plain(batch_size) or plain <= 0:
            return
        per_k = self._verify.setdefault(batch_bucket(batch_size), {})
        self._time(per_k, k).observe(seconds / plain)

    def calibrate(self, batch_size: int, verify_seconds: dict,
                  plain_seconds: Optional[float] = None) -> None:
        """Start-up figures for verification passes, used until real steps are
        observed. Plain steps are always timed for real first (the
        controller asks for three per bucket, ``has_plain``), so costs are
        relative to a real step; the calibrated plain pass only prices larger
        buckets the calibration did not reach (see ``cost``)."""
        bucket = batch_bucket(batch_size)
        self._calibrated_seconds[bucket] = dict(verify_seconds)
        for _, verify in self._kinds.values():
            per_k = verify.setdefault(bucket, {})
            for k in verify_seconds:
                self._time(per_k, k)
        if plain_seconds and verify_seconds:
            self._calibrated_plain[bucket] = plain_seconds
            self._calibrated_ratio[bucket] = {k: s / plain_seconds
                                              for k, s in verify_seconds.items()}

    def _time(self, table: dict, key: int) -> RobustTime:
        t = table.get(key)
        if t is None:
            t = table[key] = RobustTime(self.window)
        return t

    def has_plain(self, batch_size: int) -> bool:
        """Whether real plain steps were timed at this bucket, three of them
        (calibration times bare passes, a step also pays for host work around
        its pass). One is not enough: the first plain step of a bucket can be
        slow, and a verification is charged in plain steps and for its
        recovery steps' excess over the plain figure: chat at B=4 on a CPU
        timed its first plain step at 92 ms where the next ones took 72-76,
        and its first verification entered the table at 0.51 plain steps,
        which priced k=2 at 1.00 where its steps cost 1.7-2.0."""
        return self.plain_count(batch_size) >= SETTLED_SAMPLES

    def plain_count(self, batch_size: int) -> int:
        """How many real plain steps were timed in this bucket (the window's worth at most)."""
        t = self._plain.get(batch_bucket(batch_size))
        return 0 if t is None else t.count

    def observed(self, batch_size: int, k: int) -> int:
        """How many real verification steps at this k were timed in this bucket."""
        t = self._verify.get(batch_bucket(batch_size), {}).get(k)
        return 0 if t is None else t.count

    def real_steps(self, batch_size: int) -> int:
        """How many real verification steps, at any k, this bucket keeps."""
        return sum(t.count for t in self._verify.get(batch_bucket(batch_size), {}).values())

    def priced_by_real_steps(self, batch_size: int) -> bool:
        """Whether the bucket's prices rest on three real verification steps,
        at any k (the calibration is rescaled by them, see ``_scale``)."""
        return self.real_steps(batch_size) >= SETTLED_SAMPLES

    def observed_any(self, batch_size: int) -> bool:
        """Whether a real verification step at any k was timed in this bucket
        (the cost line then rests on a real step, not on calibration alone)."""
        return self.real_steps(batch_size) > 0

    def plain_seconds(self, batch_size: int) -> Optional[float]:
        t = self._plain.get(batch_bucket(batch_size))
        return None if t is None else t.value

    def cost(self, batch_size: int, k: int) -> float:
        """A verification step over k + 1 tokens, in plain steps (at least 1)."""
        plain = self.plain_seconds(batch_size)
        if plain is None or plain <= 0:
            return 1.0 + PRIOR_COST_PER_TOKEN * k
        points = self._verify_points(batch_size, plain)
        # Borrowed only where this bucket has no calibration of its own.
        borrowed = (None if self._calibrated_seconds.get(batch_bucket(batch_size))
                    else self._borrowed_cost(batch_size, k))
        if not points:
            return borrowed or 1.0 + PRIOR_COST_PER_TOKEN * k
        cost = max(1.0, _on_line({0: plain, **points}, k) / plain)
        if borrowed and self.observed(batch_size, k) < SETTLED_SAMPLES:
            # Real steps here, no calibration: one probe at k=1 timed under a
            # noisy plain median made the line flat, and k=16 at B=16 was
            # verified at 1.00 plain steps four times, 8.5 each (chat at 16
            # clients on a CPU). The rows' price stays a floor until a k has
            # a median of its own.
            cost = max(cost, borrowed)
        return cost

    def spent(self, batch_size: int, k: int) -> float:
        """What a step at k costs for a budget, in plain steps: the dearer of
        ``cost`` and the median of the real steps at k, slow ones included.
        ``cost`` is optimistic on purpose (one slow step must not price a k
        out for good), and a budget spent at that price is overspent: chat
        at B=4 on a CPU priced k=1 at 1.16 plain steps (calibration) where
        its steps took 1.38-1.40, probed every 8 steps, and each probe that
        emitted 1.3 tokens a row counted as paid."""
        t = self._verify.get(batch_bucket(batch_size), {}).get(k)
        seen = t.typical if t is not None and t.count else None
        return max(self.cost(batch_size, k), seen or 0.0)

    def verify_seconds(self, batch_size: int, k: int) -> Optional[float]:
        """A verification step over k + 1 tokens in seconds (None before a
        plain step at this batch size was timed)."""
        plain = self.plain_seconds(batch_size)
        return None if plain is None else plain * self.cost(batch_size, k)

    def priced_low(self, batch_size: int) -> bool:
        """Whether this bucket's untimed k are priced at a floor known to be
        low: a grammar batch's borrowed line (``_borrowed_cost``). A k
        never timed there can only be dearer than its price says, so trying
        it in case its price is too high (the controller's exploration)
        only spends: JSON to a schema at 16 clients on a CPU explored k=6,
        3 and 2 at B=16 as its first three verifications, at 2.2-3.9 plain
        steps each, and ran at 0.9x plain decoding. Nor does a pass over
        grammar-forced tokens alone run there (the engine's ``_forced_priced``):
        it pays only if its price is right."""
        return (self.grammar and not self._calibrated_seconds.get(batch_bucket(batch_size))
                and self._borrowed_line(batch_size) is not None)

    def _borrowed_cost(self, batch_size: int, k: int) -> Optional[float]:
        """A bucket with no figure of its own (above what the calibration
        reached), from the largest smaller bucket that has one: the dearer of
        its cost in its plain steps, and its extra seconds a row (what k
        drafts add to a pass) times this bucket's rows, over this bucket's
        plain step. Where a pass is compute-bound (a CPU) the drafts' tokens
        cost in proportion to the rows while a plain step grows far less:
        bucket 4's 2.9 plain steps priced k=16 at B=16 where the step took
        9.2 (SmolLM2, chat at 16 clients), 8.1 by the rows.

        For steps with a grammar row the line is rescaled by how this
        bucket's real steps, at any k, compare with it (``_scale``: their
        median from three on, the smallest before), and never lowered (it is
        a floor for the k seen fewer than three times): bare passes know
        nothing of the k + 1 grammar masks a row such a step builds and
        applies on the pass's cores. JSON at 16
        clients on a CPU verified at k=10 at B=13 on a borrowed 2.45 plain
        steps where the step took 5.7, after steps at k=1 to 3 had cost
        about twice their borrowed price, and ran 0.89-0.90x plain decoding.
        Other steps keep the line as borrowed, which their steps were
        measured against (above)."""
        line = self._borrowed_line(batch_size)
        if line is None:
            return None  # nothing to borrow: the caller's prior
        if not self.grammar:
            return line(k)
        times = self._verify.get(batch_bucket(batch_size), {})
        # The line is in plain steps already: a plain step of 1. A floor known
        # to be low is raised from the first real step (``_scale``'s early).
        return line(k) * max(1.0, _scale(times, {j: line(j) for j in times}, 1.0, early=True))

    def _borrowed_line(self, batch_size: int):
        """k -> the bare line ``_borrowed_cost`` borrows, in this bucket's
        plain steps, or None where nothing can be borrowed."""
        below = [b for b in self._calibrated_ratio if b < batch_bucket(batch_size)]
        plain = self.plain_seconds(batch_size)
        if not below or not plain:
            return None
        b = max(below)

        def line(k: int) -> float:
            ratio = max(1.0, _on_line({0: 1.0, **self._calibrated_ratio[b]}, k))
            extra_a_row = (ratio - 1.0) * self._calibrated_plain[b] / b
            return max(ratio, 1.0 + extra_a_row * batch_size / plain)
        return line


    def _verify_points(self, batch_size: int, plain: float) -> dict:
        """k -> seconds: observed medians; calibrated figures for the other k,
        rescaled by how observed steps compare with their calibrated passes (a
        step also pays for host work around its pass). A k observed fewer than
        three times is capped by the line through the other points (the
        module docstring says why)."""
        bucket = batch_bucket(batch_size)
        times = self._verify.get(bucket, {})
        bare = self._calibrated_seconds.get(bucket, {})
        # Observed in plain steps (see ``observe_verify``), back in seconds at
        # today's plain step.
        observed = {k: t.value * plain for k, t in times.items() if t.count}
        scale = _scale(times, {k: s for k, s in bare.items() if s}, plain)
        rescaled = {k: scale * s for k, s in bare.items() if s}
        # Fewer than three: the fastest, the calibrated figure included (a
        # step is slowed by outliers, never sped up), that figure rescaled as
        # for a k never seen: a bare pass over a short start-up context priced
        # a k run once at what its step does not cost (k=10 at 1.21 plain
        # steps at B=1, Qwen2.5-0.5B on a CPU, verified on that price).
        observed = {k: s if times[k].count >= SETTLED_SAMPLES else min(s, rescaled.get(k, s))
                    for k, s in observed.items()}
        points = {**rescaled, **observed}
        capped = {}
        for k, t in times.items():
            if 0 < t.count < SETTLED_SAMPLES and len(points) > 1:
                others = {j: s for j, s in points.items() if j != k}
                capped[k] = min(points[k], _on_line({0: plain, **others}, k))
        return {**points, **capped}


def _scale(times: dict, bare: dict, plain: float, early: bool = False) -> float:
    """How real steps compare with their bare calibrated passes: the median,
    over every real step the bucket has timed at any k, of its time over the
    calibrated line at its k; 1 before three such steps (one slow step must
    not reprice every k). Pooled over k, not per k: a workload that
    verifies now and then spreads its steps over the k buckets, and waiting
    for three at one k kept every other k at its bare price. Chat at B=4 on
    a CPU verified at k=2 and 3 on 1.00 plain steps, the bare line under a
    real plain step, where its steps had cost 1.2-1.65 at k=1, 2 and 3.

    ``early``: before three, the smallest ratio (a step is slowed by
    outliers, never sped up), for a line the caller knows to be low (a
    grammar batch's borrowed one, ``_borrowed_cost``): waiting for three
    there spent them all on that line's price. JSON at 16 clients on a CPU
    explored k=6, 3 and 2 at B=16 on borrowed prices of 1.4-2.3 plain steps
    where the first of them cost 3.9."""
    ratios = [s * plain / _on_line(bare, k) for k, t in times.items()
              if k in bare or (len(bare) > 1 and k > min(bare)) for s in t.samples]
    if len(ratios) >= SETTLED_SAMPLES:
        return statistics.median(ratios)
    return min(ratios) if early and ratios else 1.0


def _on_line(points: dict, k: int) -> float:
    """Piecewise-linear through ``points`` (k -> seconds); beyond the last
    point, along the slope of the last two (never falling)."""
    ks = sorted(points)
    if k in points:
        return points[k]
    for lo, hi in zip(ks, ks[1:]):
        if lo < k < hi:
            return points[lo] + (points[hi] - points[lo]) * (k - lo) / (hi - lo)
    lo, hi = ks[-2], ks[-1]
    slope = max(0.0, (points[hi] - points[lo]) / (hi - lo))
    return points[hi] + slope * (k - hi)
