"""What every proposer gives the engine: up to k draft tokens per sequence."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Optional, Sequence

from ..drafts import ProposalResult


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
        ``text.reasoning.Thinking``), drafted first by ``PerRowProposer``
        (``per_row.py``), every server's proposer."""
        if tokens:
            raise TypeError(f"{type(self).__name__} does not draft from a prediction: "
                            "use it as a source of a PerRowProposer")

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
        by a proposer that weighs a cost against it (``per_row.py``, for the
        choice of ``mixed.py``)."""

    def stats(self) -> dict:
        """What the proposer reports of itself in ``/v1/spec_decode/metrics``."""
        return {}

    @property
    def draft_model(self):
        """The draft model it runs, if any (its caches count against the KV budget)."""
        return None


class ModelDrafter(BaseProposer):
    """A proposer that runs a model with a cache row per sequence (a draft
    model, an MTP layer, an EAGLE-3 head, a DFlash drafter): the model source
    of ``per_row.py``, and what a mix of a cheap source and it (``mixed.py``)
    asks of it besides proposing."""

    @abstractmethod
    def holds(self, uid: int) -> bool:
        """Whether the sequence has a row in the drafter's cache: drafting for
        it costs a catch-up at most, never a prefill of its context."""

    @abstractmethod
    def forget_lagging(self, uids: Sequence[int], contexts: Sequence[Sequence[int]]) -> None:
        """Drop the rows that are cheaper to prefill again than to catch up."""

    @abstractmethod
    def propose_rows(self, rows: list[int], uids: Sequence[int],
                     contexts: Sequence[Sequence[int]], k: Sequence[int]) -> ProposalResult:
        """Drafts for ``rows`` of the batch only; the other rows get none."""


class FollowerStandIn(BaseProposer):
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
