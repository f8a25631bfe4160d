"""What every proposer gives the engine: up to k draft tokens per sequence."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

# Fills draft slots past a sequence's proposal length.
PLACEHOLDER_TOKEN = -1


@dataclass
class ProposalResult:
    draft_tokens: np.ndarray  # [B, k] int32, PLACEHOLDER_TOKEN past num_proposed
    num_proposed: np.ndarray  # [B] int32
    # [B, k, vocab] draft distribution q, or None for deterministic (one-hot) drafts.
    draft_probs: Optional[object] = None
    # [B] the proposer each row's draft came from, where several take part
    # (``mixed.py``); reported per request and in the metrics.
    sources: Optional[list] = None
    # [B, k] int32: a tree of drafts (``tree.py``): each node's parent's
    # input position (0: the pending token). None: every row a chain.
    parents: Optional[np.ndarray] = None
    # [B, k] float: each node's chance that its whole path is kept, where the
    # proposer measures it (``node_scores.py``); the engine prices trees by it.
    # NaN on a row whose source measures none (merged rows): not priced.
    chances: Optional[np.ndarray] = None

    @classmethod
    def from_trees(cls, trees: Sequence[tuple], k: int) -> "ProposalResult":
        """Rows of ``(tokens, parents)`` in tree order, or ``(tokens,
        parents, chances)``; all chains: no parents."""
        out = cls.from_lists([t[0] for t in trees], k)
        parents = np.broadcast_to(np.arange(k, dtype=np.int32), out.draft_tokens.shape).copy()
        for i, tree in enumerate(trees):
            parents[i, : len(tree[1])] = tree[1][:k]
        if (parents == np.arange(k, dtype=np.int32)).all():
            return out
        out.parents = parents
        if any(len(tree) > 2 for tree in trees):
            out.chances = np.zeros(out.draft_tokens.shape, np.float32)
            for i, tree in enumerate(trees):
                if len(tree) > 2:
                    out.chances[i, : len(tree[2])] = tree[2][:k]
        return out

    @classmethod
    def from_lists(cls, drafts: Sequence[Sequence[int]], k: int) -> "ProposalResult":
        out = np.full((len(drafts), k), PLACEHOLDER_TOKEN, dtype=np.int32)
        lengths = np.zeros(len(drafts), dtype=np.int32)
        for i, d in enumerate(drafts):
            d = list(d)[:k]
            out[i, : len(d)] = d
            lengths[i] = len(d)
        return cls(out, lengths)


def row_chances(chances: Optional[np.ndarray], B: int, K: int) -> np.ndarray:
    """A proposal's chances as ``[B, K]``, NaN where it measured none."""
    out = np.full((B, K), np.nan, np.float32)
    if chances is not None:
        width = min(K, chances.shape[1])
        out[:, :width] = chances[:, :width]
    return out


def merge_chances(rows: np.ndarray, ours: Optional[np.ndarray], theirs: Optional[np.ndarray],
                  K: int) -> Optional[np.ndarray]:
    """The chances of a proposal whose ``rows`` [B] come from one source
    (``ours``) and the rest from another (``theirs``): each row keeps its
    own source's, so that merging never leaves a measured tree unpriced;
    None where neither measured any."""
    if ours is None and theirs is None:
        return None
    B = len(rows)
    return np.where(rows[:, None], row_chances(ours, B, K), row_chances(theirs, B, K))


class Context:
    """A sequence's tokens plus its pending token, without copying the history.

    Copying an 8k-token history for 32 sequences every step would cost more
    than proposing; a proposer reads only the tail it has not seen yet.
    """

    __slots__ = ("history", "pending")

    def __init__(self, history: list[int], pending: int):
        self.history = history
        self.pending = pending

    def __len__(self) -> int:
        return len(self.history) + 1

    def __getitem__(self, i):
        n = len(self.history)
        if isinstance(i, slice):
            start, stop, step = i.indices(n + 1)
            if step != 1:
                raise ValueError("Context slices must be contiguous")
            head = self.history[start : min(stop, n)]
            return head + [self.pending] if start <= n < stop else head
        if i < 0:
            i += n + 1
        if i == n:
            return self.pending
        return self.history[i]

    def tolist(self) -> list[int]:
        return self.history + [self.pending]


class BaseProposer(ABC):
    """Proposes continuations; owns whatever per-sequence state it needs.

    Sequences are identified by the generator's uid. ``context`` is every token
    the sequence has so far (prompt, generated, and the pending next input), so
    a proposer may rebuild its state from it at any time.
    """

    # Proposing costs next to nothing (no model): the engine also drafts on
    # plain steps to keep acceptance estimates fresh (``control/shadow.py``).
    cheap: bool = False

    @property
    def shadow(self) -> Optional["BaseProposer"]:
        """The proposer whose drafts the engine makes on plain steps
        (``control/shadow.py``): this one where proposing is cheap, else none."""
        return self if self.cheap else None

    # Children a node of a tree of drafts may keep (1: chains), up to the
    # configured width; the engine sets it step by step (``tree_step.TreeChoice``).
    tree_width: int = 1
    # How deep a model drafter grows a tree (None: as deep as its node count);
    # set with a node budget above the controller's k (``draft_tree.grown_depth``).
    tree_depth: Optional[int] = None

    def set_tree_shape(self, width: int, depth: Optional[int] = None) -> None:
        self.tree_width, self.tree_depth = width, depth

    # Drafts from the target's final hidden states (a learned head): the
    # engine then captures them from its own passes (``observe_target``).
    needs_hidden: bool = False
    # Which: the outputs of these decoder layers, concatenated (None: the final hidden state).
    hidden_layers: Optional[list] = None

    @abstractmethod
    def add_sequence(self, uid: int, prompt_len: int, params=None) -> None:
        """A sequence joined; its first ``prompt_len`` context tokens are its prompt.

        ``params`` (its ``SamplingParams``) lets a model proposer sample drafts
        from the distribution the request will be verified against.
        """

    def predict(self, uid: int, tokens: Sequence[int], thinking=None) -> None:
        """The sequence's predicted output (a request's ``prediction``; empty:
        none; ``thinking``: the model's reasoning markers, a
        ``text.reasoning.Thinking``), drafted first by ``PredictionProposer``,
        which wraps the mode's proposer in every server."""
        if tokens:
            raise TypeError(f"{type(self).__name__} does not draft from a prediction: "
                            "wrap it in a PredictionProposer")

    @abstractmethod
    def remove_sequence(self, uid: int) -> None:
        """A sequence left; drop its state."""

    @abstractmethod
    def propose(
        self, uids: Sequence[int], contexts: Sequence[Sequence[int]], k: Sequence[int]
    ) -> ProposalResult:
        """Up to ``k[i]`` draft tokens continuing ``contexts[i]``, for each sequence."""

    def observe_verification(self, uids: Sequence[int], num_accepted: Sequence[int]) -> None:
        """How many drafts of the last proposal each sequence kept (a proposer
        with a KV cache rolls back here)."""

    def observe_target(self, uids: Sequence[int], hidden, kept: Sequence[int]) -> None:
        """The target's final hidden states of its last pass, [B, T, H]:
        row i's first ``kept[i]`` are those of the tokens that entered its
        KV cache (only for a proposer that ``needs_hidden``)."""

    def price_step(self, seconds: Callable[[], Optional[float]]) -> None:
        """How to price the coming verification step, in seconds (the
        controller's estimate; None: not known yet). A function, called only
        by a proposer that weighs a cost against it (``mixed.py``)."""

    def stats(self) -> dict:
        """What the proposer reports of itself in ``/v1/spec_decode/metrics``."""
        return {}

    @property
    def draft_model(self):
        """The draft model it runs, if any (its caches count against the KV budget)."""
        return None


class Followed(BaseProposer):
    """A tensor-parallel follower's stand-in: rank 0 proposes, and its drafts
    arrive in the step plan (``parallel/distributed.py``); this one is never asked."""

    def add_sequence(self, uid: int, prompt_len: int, params=None) -> None:
        pass

    def predict(self, uid: int, tokens: Sequence[int], thinking=None) -> None:
        pass

    def remove_sequence(self, uid: int) -> None:
        pass

    def propose(self, uids, contexts, k) -> ProposalResult:
        raise RuntimeError("a tensor-parallel follower does not propose: rank 0 does")


def pad_columns(draft_np, K: int):
    """[B, k] drafts padded with placeholders to [B, K]."""
    B, k = draft_np.shape
    if k >= K:
        return draft_np[:, :K]
    return np.concatenate([draft_np, np.full((B, K - k), PLACEHOLDER_TOKEN, draft_np.dtype)], 1)
