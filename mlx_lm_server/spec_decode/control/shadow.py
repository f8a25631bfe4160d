"""What verification would have kept while speculation is off, without verifying.

A switched-off controller learns acceptance only from probes, which are
spaced to cost little; a sequence whose early drafts failed (the preamble of
a code edit) then decodes plainly long after its text became predictable.
With a cheap proposer (n-gram: no model) the engine keeps drafting on plain
steps: each draft is compared with the tokens plain decoding then emits, and
the length of the matching prefix is what greedy verification would have
accepted. At temperature 0 that count is exact; above it, matching the sample
is a lower bound of what rejection sampling accepts. The estimates stay fresh
at the cost of a proposal per row per plain step, and nothing is verified.

A draft that keeps matching reports its matched tokens as they are emitted,
not when it is decided: a 10-token draft copying a file would otherwise tell
the controller nothing for 10 plain steps, just when the text has turned
predictable and every one of those steps could have verified.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..tree import first_path
from .step import StepReport


def matching_prefix(draft: Sequence[int], emitted: Sequence[int]) -> int:
    n = 0
    for d, t in zip(draft, emitted):
        if d != t:
            break
        n += 1
    return n


def _matching(draft: Sequence[int], reported: int) -> bool:
    """An open draft that copied at least one emitted token (all of them:
    a mismatch closes it) and holds a token past the pending one."""
    return reported >= 1 and len(draft) - reported >= 2


class ShadowDrafts:
    """Per sequence, at most one open draft: where it starts, its tokens and
    how many of them were reported kept already."""

    def __init__(self):
        self._open: dict[int, tuple[int, list[int], int]] = {}

    def forget(self, uid: int) -> None:
        self._open.pop(uid, None)

    def clear(self) -> None:
        self._open.clear()

    def settle(self, uids: Sequence[int], histories: Sequence[Sequence[int]]) -> list:
        """``(uid, drafted, accepted, matching)`` per draft or part of a
        draft the emitted tokens decide (``histories[i]``: the tokens fed so
        far); ``matching``: the part followed tokens the draft had copied
        already (see ``matching``). A still-matching draft reports its newly
        matched tokens as kept, its rejection later with the rest. Called
        before the step's decision, so that it rests on every token emitted
        so far."""
        settled = []
        if not self._open:  # speculating, or nothing drafted: every step comes here
            return settled
        for uid, history in zip(uids, histories):
            open_draft = self._open.get(uid)
            if open_draft is None:
                continue
            start, draft, reported = open_draft
            emitted = history[start : start + len(draft)]
            n = matching_prefix(draft, emitted)
            if n == len(emitted) < len(draft):  # every token so far matched
                if n > reported:
                    settled.append((uid, n - reported, n - reported, _matching(draft, reported)))
                    self._open[uid] = (start, draft, n)
                continue
            settled.append((uid, len(draft) - reported, n - reported,
                            _matching(draft, reported)))
            del self._open[uid]
        return settled

    def ask(self, uids: Sequence[int], histories: Sequence[Sequence[int]], k: int,
            propose: Callable) -> list:
        """Draft anew for the rows without an open draft; ``propose(uids,
        contexts, ks)`` is the proposer's. ``(uid, asked, proposed)`` per row asked."""
        ask = [(u, h) for u, h in zip(uids, histories) if u not in self._open]
        proposals = []
        if ask:
            result = propose([u for u, _ in ask], [h for _, h in ask], [k] * len(ask))
            for i, ((uid, history), row, num) in enumerate(zip(ask, result.draft_tokens,
                                                               result.num_proposed.tolist())):
                draft = [int(t) for t in row[:num]]
                if result.parents is not None:  # a tree: its first path, as a chain
                    draft = first_path(draft, result.parents[i, :num].tolist())
                proposals.append((uid, k, len(draft)))
                if draft:
                    self._open[uid] = (len(history), draft, 0)
        return proposals

    def matching(self, uids: Sequence[int]) -> frozenset:
        """The rows whose open draft (after ``settle``) has copied every token
        emitted since it was drafted, at least one, and still holds a token
        past the pending one: a run of predictable text in progress, known
        now, where an acceptance EMA learns of it only as it ends."""
        if not self._open:
            return frozenset()
        out = []
        for uid in uids:
            open_draft = self._open.get(uid)
            if open_draft is not None and _matching(*open_draft[1:]):
                out.append(uid)
        return frozenset(out)

    def report_settled(self, controller, uids: Sequence[int],
                       histories: Sequence[Sequence[int]]) -> None:
        """``settle``, told to the controller (acceptance only: the proposals
        were counted when asked)."""
        settled = self.settle(uids, histories)
        if settled:
            done, drafted, kept, matching = zip(*settled)
            controller.observe(StepReport(len(uids), done, (0,) * len(done), drafted, kept))
            for uid, d, n, m in zip(done, drafted, kept, matching):
                if m:
                    controller.observe_matching(uid, d, n)

    def draft_while_off(self, controller, shadow, uids: Sequence[int],
                        histories: Sequence[Sequence[int]], k: int) -> None:
        """``report_asked`` with ``shadow`` (the proposer's cheap one; None:
        it has none), where the controller can learn from it: it is dynamic
        and the batch is under its cap."""
        if shadow is not None and controller.dynamic and not controller.capped(len(uids)):
            self.report_asked(controller, uids, histories, k, shadow.propose)

    def report_asked(self, controller, uids: Sequence[int], histories: Sequence[Sequence[int]],
                     k: int, propose: Callable) -> None:
        """``ask``, told to the controller (how often the proposer has drafts)."""
        proposals = self.ask(uids, histories, k, propose)
        if proposals:
            asked_uids, asked, got = zip(*proposals)
            controller.observe(StepReport(len(uids), asked_uids, asked, got))
