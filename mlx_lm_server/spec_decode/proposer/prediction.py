"""Predicted outputs (OpenAI's ``prediction``): a request's expected answer
as its first draft source.

A client that edits a file sends the file as the prediction; most of the
answer repeats it, with edits. The row drafts the prediction's continuation
from where the output stands in it; after an edit (the output leaves the
prediction and rejoins it further on, or inserts text and rejoins where it
left) the row finds the rejoin point as a diff would, and drafts from there.

The alignment (``Alignment``: where the output stands in the prediction) is
a pure walk over the output's tokens, one at a time:

- on track, a token equal to the prediction's next one moves the cursor on;
- otherwise the output rejoins the prediction at the nearest place its
  last tokens occur at or after the *floor*: of the suffixes (up to
  ``REJOIN_MAX`` tokens, of those no settled run matched) the one whose
  occurrence ends first, the least of the prediction skipped (the longer
  on a tie); one token may rejoin at the floor itself (an insertion
  ended), ``REJOIN_MIN`` further on (a deletion or a replacement); where
  they occur nowhere, the row is off track and drafts nothing from its
  prediction;
- a run that starts at the floor moves the floor along with it; a run that
  skipped ahead is tentative until it is ``CONFIRM`` tokens long, and looks
  for a nearer rejoin of ``REJOIN_MIN`` tokens or more at each of its
  tokens: a few tokens that also occur further on (a renamed argument
  followed by ``, height``, which the next function repeats) never carry
  the floor past the place the output rejoins.

The same walk counts the usage OpenAI reports (``prediction_counts``):
accepted, the prediction's tokens the walk matched in the output (the runs
that moved the floor, and a tentative run still open at the end); rejected,
the rest of the prediction. It depends on the completion's tokens only:
the same streamed or not, speculating or not.

The walk sees the answer only: for a model that thinks between markers,
the tokens the reasoning split (``text/reasoning.py``) shows as reasoning
are skipped, so that a thought quoting a later part of the file never
settles the alignment there, and a row drafts nothing from its prediction
while it reasons.

``Predictions`` holds the rows' walks; the per-row proposer
(``per_row.py``) drafts a row whose output stands in its prediction from
it, the other rows (no prediction, or off track now) from the mode's
sources. Drafts from a prediction are deterministic (one-hot q), so
rejection sampling keeps the target's distribution exactly, as for prompt
lookup.

One module because the walk is the contract between what is drafted and
what is counted: the usage must count exactly the alignment the drafts
followed, and a change to either is a change to both.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ...text.reasoning import ReasoningSplitter, Thinking

# The source named for a row's drafts from its prediction (usage, metrics).
PREDICTION = "prediction"

# Rejoining: the longest output suffix looked up, the shortest one that may
# skip ahead in the prediction, and a skipped-ahead run's length that moves
# the floor.
REJOIN_MAX = 4
REJOIN_MIN = 2
CONFIRM = 4


class Prediction:
    """A prediction's tokens and, built on first use (an output that
    leaves the prediction), where each of its n-grams starts: per n, the
    n-grams' hashes sorted (positions ascending within a hash), so that a
    100k-token prediction (the context allows one) is indexed in
    milliseconds, not the seconds a dict of tuples takes, on the step."""

    def __init__(self, tokens: Sequence[int]):
        self.tokens = tuple(tokens)
        self._index: Optional[dict] = None

    def __len__(self) -> int:
        return len(self.tokens)

    def first_at(self, ngram: Sequence[int], floor: int) -> Optional[int]:
        """Where ``ngram`` first starts at or after ``floor`` (None: nowhere)."""
        if self._index is None:
            self._index = ngram_index(self.tokens, REJOIN_MAX)
        n = len(ngram)
        if n not in self._index:
            return None
        keys, starts = self._index[n]
        key = _hash(np.asarray(ngram, np.int64)[None])[0]
        lo, hi = np.searchsorted(keys, key, "left"), np.searchsorted(keys, key, "right")
        candidates = starts[lo:hi]  # ascending
        ngram = tuple(ngram)
        for i in candidates[np.searchsorted(candidates, floor):].tolist():
            if self.tokens[i:i + n] == ngram:  # a hash collision is checked away
                return i
        return None


_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)


def _hash(windows: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each row of ``windows [M, n]`` (wrapping arithmetic)."""
    h = np.zeros(len(windows), np.uint64)
    with np.errstate(over="ignore"):
        for j in range(windows.shape[1]):
            h = h * _MULTIPLIER + windows[:, j].astype(np.uint64) + np.uint64(1)
    return h


def ngram_index(tokens: Sequence[int], n_max: int) -> dict:
    """n (1..n_max) -> (the hashes of every n-gram of ``tokens``, sorted;
    the n-grams' start positions in the same order, ascending per hash)."""
    a = np.asarray(tokens, np.int64)
    index = {}
    for n in range(1, min(n_max, len(a)) + 1):
        windows = np.lib.stride_tricks.sliding_window_view(a, n)  # [len - n + 1, n]
        keys = _hash(windows)
        order = np.argsort(keys, kind="stable")
        index[n] = (keys[order], order)
    return index


def rejoin(prediction: Prediction, tail: Sequence[int], floor: int,
           at_floor: bool = True) -> Optional[tuple[int, int]]:
    """Where an output whose last tokens are ``tail`` rejoins the
    prediction: ``(start, end)`` of the suffix of ``tail`` whose earliest
    occurrence at or after ``floor`` ends first (the longer on a tie); a
    single token only at the floor itself (``at_floor``). None: nowhere."""
    best = None
    for n in range(min(len(tail), REJOIN_MAX), 0, -1):
        start = prediction.first_at(tail[len(tail) - n:], floor)
        if start is None or (n < REJOIN_MIN and (start != floor or not at_floor)):
            continue
        if best is None or start + n < best[1]:
            best = (start, start + n)
    return best


class Alignment:
    """Where one output stands in its prediction (see the module docstring).

    ``cursor``: the prediction's position the next output token is expected
    at (None: off track); ``floor``: how far the alignment is settled (a
    rejoin never goes before it); ``start``: where the current run began;
    ``tail``: the output's last tokens not in a settled run (a rejoin's
    anchor: a settled token is never matched twice); ``accepted``: the
    prediction's tokens matched in settled runs."""

    def __init__(self, prediction: Prediction):
        self.prediction = prediction
        self.floor = 0
        self.cursor: Optional[int] = 0
        self.start = 0
        self.settled = True  # the current run moves the floor
        self.accepted = 0
        self.seen = 0  # output tokens walked
        self.tail: list[int] = []

    def add(self, token: int) -> None:
        """One more output token."""
        self.seen += 1
        self.tail.append(token)
        del self.tail[:-REJOIN_MAX]
        tokens = self.prediction.tokens
        follows = (self.cursor is not None and self.cursor < len(tokens)
                   and tokens[self.cursor] == token)
        if follows and self.settled:
            self.cursor += 1
        else:  # off track, or a tentative run: the nearest rejoin (maybe where it goes on)
            found = rejoin(self.prediction, self.tail, self.floor, at_floor=not follows)
            if found is None:
                self.cursor = None
                return
            if not (follows and found[1] == self.cursor + 1):
                self.start, self.settled = found[0], False
            self.cursor = found[1]
        if not self.settled and (self.start == self.floor or self.cursor - self.start >= CONFIRM):
            self.settled = True
        if self.settled:
            self.accepted += self.cursor - max(self.start, self.floor)
            self.floor = self.cursor
            self.tail.clear()

    def follow(self, tokens: Sequence[int], offset: int = 0) -> None:
        """Walk the output ``tokens[offset:]`` (which extends what was
        walked before) from its first token not walked yet."""
        for i in range(offset + self.seen, len(tokens)):
            self.add(tokens[i])

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens of the prediction after the cursor."""
        if self.cursor is None or k <= 0:
            return []
        return list(self.prediction.tokens[self.cursor:self.cursor + k])

    def counts(self) -> tuple[int, int]:
        """(accepted, rejected) prediction tokens: the settled runs' and the
        open run's matches, and the rest."""
        accepted = self.accepted
        if not self.settled and self.cursor is not None:
            accepted += self.cursor - self.start
        return accepted, len(self.prediction) - accepted


class AnswerWalk:
    """An output's tokens in, its prediction's alignment walked over the
    answer's tokens only (``thinking``: the model's markers; None: all of
    the output is answer)."""

    def __init__(self, prediction: Sequence[int], thinking: Optional[Thinking] = None):
        self.alignment = Alignment(Prediction(prediction))
        self.split = ReasoningSplitter(thinking) if thinking is not None else None
        self.seen = 0  # output tokens fed

    @property
    def reasoning(self) -> bool:
        """Whether the output is inside a reasoning block now."""
        return self.split is not None and self.split.reasoning

    def follow(self, tokens: Sequence[int], offset: int = 0) -> None:
        """Walk the output ``tokens[offset:]`` (which extends what was
        walked before) from its first token not walked yet."""
        for i in range(offset + self.seen, len(tokens)):
            self.seen += 1
            if self.split is None:
                self.alignment.add(tokens[i])
                continue
            part = self.split.reasoning
            for t in self.split.feed(tokens[i]):
                if not part:
                    self.alignment.add(t)

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens of the prediction after the cursor; none while reasoning."""
        return [] if self.reasoning else self.alignment.draft(k)

    def counts(self) -> tuple[int, int]:
        """(accepted, rejected) once the output is whole: tokens the split
        still held (a marker cut off) count as the part they end in."""
        if self.split is not None and not self.split.reasoning:
            for t in self.split.close():
                self.alignment.add(t)
        return self.alignment.counts()


def prediction_counts(prediction: Sequence[int], completion: Sequence[int],
                      thinking: Optional[Thinking] = None) -> tuple[int, int]:
    """OpenAI's ``accepted_prediction_tokens`` and ``rejected_prediction_tokens``
    of a finished completion (see the module docstring), its reasoning apart."""
    walk = AnswerWalk(prediction, thinking)
    walk.follow(completion)
    return walk.counts()


class Predictions:
    """The rows' predictions, each walked over its row's output: a row's
    draft from where its output stands (``per_row.py`` drafts a row from it
    before any other source)."""

    def __init__(self):
        self._prompt_lens: dict[int, int] = {}
        # uid -> (where the output starts, the walk): rows with a prediction.
        self._rows: dict[int, tuple[int, AnswerWalk]] = {}

    def __bool__(self) -> bool:
        return bool(self._rows)

    def __contains__(self, uid: int) -> bool:
        return uid in self._rows

    def add(self, uid: int, prompt_len: int) -> None:
        self._prompt_lens[uid] = prompt_len

    def predict(self, uid: int, tokens: Sequence[int], thinking: Optional[Thinking] = None) -> None:
        """The sequence's predicted output (after ``add``; empty: none),
        walked over the answer after ``thinking``'s reasoning."""
        if tokens:
            self._rows[uid] = (self._prompt_lens[uid], AnswerWalk(tokens, thinking))

    def remove(self, uid: int) -> None:
        self._prompt_lens.pop(uid, None)
        self._rows.pop(uid, None)

    def drafts(self, uids, contexts, k) -> list[list[int]]:
        """Each row's draft from its prediction, up to ``k[i]`` tokens ([]
        where it has none, or its output stands nowhere in it now)."""
        return [self._draft(u, c, k_i) for u, c, k_i in zip(uids, contexts, k)]

    def _draft(self, uid: int, context, k: int) -> list[int]:
        row = self._rows.get(uid)
        if row is None or k <= 0:
            return []
        prompt_len, walk = row
        walk.follow(context, prompt_len)
        return walk.draft(k)
