"""The KV memory budget: what a request's caches can grow to, and admission by it.

Plain Python, no MLX: ``memory.layer_costs`` measures a model's layers once,
and everything here is arithmetic over those figures.

Glossary:
- a *row* is one sequence's share of a batch's layer caches;
- a request's *length* is the most tokens its row can hold: prompt +
  ``max_tokens`` (+ the k + 1 a verification pass writes before it rolls
  back, when speculation is on).

A layer holds, per row (``LayerCost``):
- full attention: ``per_token`` bytes for every token;
- a sliding window: the same, but never more than ``window`` tokens;
- recurrent state (Mamba, GatedDeltaNet): ``fixed`` bytes at any length.

mlx-lm grows an attention cache ``step`` (256) tokens at a time from
wherever it stands, so a row holding n tokens has room for at most
n + step - 1; a rotating (sliding-window) cache takes a prefill chunk whole
before it trims back to its window, so it holds at most window + chunk - 1.
A batch's caches are left-padded: every row is as long as the batch's
longest. So a batch of rows costs ``num_rows * row_bytes(longest length)``,
and that is what the budget reserves for the requests it has admitted
(``batch_bytes``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

KV_STEP = 256  # mlx-lm's KVCache.step: tokens added per allocation
MAX_LENGTH = 1 << 26  # no search goes past this many tokens


@dataclass(frozen=True)
class LayerCost:
    """Bytes one layer's cache holds for one row."""

    per_token: int = 0
    window: Optional[int] = None  # at most this many tokens (None: every token)
    fixed: int = 0


def room_tokens(cost: LayerCost, num_tokens: int, step: int = KV_STEP, chunk: int = 1) -> int:
    """The most token slots ``cost``'s layer allocates for a row once it has
    held ``num_tokens`` tokens, fed at most ``chunk`` at a time."""
    room = num_tokens + step - 1
    return room if cost.window is None else min(room, cost.window + chunk - 1)


def row_bytes(layers: Sequence[LayerCost], num_tokens: int, step: int = KV_STEP,
              chunk: int = 1) -> int:
    """Bytes of one row holding ``num_tokens`` tokens, over ``layers``."""
    return sum(c.fixed + c.per_token * room_tokens(c, num_tokens, step, chunk) for c in layers)


def batch_bytes(layers: Sequence[LayerCost], lengths: Iterable[int], step: int = KV_STEP,
                chunk: int = 1) -> int:
    """Bytes of a left-padded batch of rows of these lengths: each as long as the longest."""
    lengths = list(lengths)
    return len(lengths) * row_bytes(layers, max(lengths), step, chunk) if lengths else 0


def mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"


class KVBudget:
    """Reservations of KV bytes against ``limit``.

    ``layers`` are the target's layers and, with a draft model, the draft's
    (its cache has a row for every sequence too). Each admitted request
    reserves its length (``reserve``) until it leaves (``release``); the
    reserved bytes are ``batch_bytes`` over those lengths. The caller counts
    other holders (the prompt cache) against the same ``limit``.
    """

    def __init__(self, limit: int, layers: Sequence[LayerCost], *, margin: int = 0,
                 step: int = KV_STEP, chunk: int = 1):
        assert limit > 0 and layers
        self.limit = limit
        self.layers = tuple(layers)
        self.margin = margin  # tokens a row may hold beyond its length
        self.step = step
        self.chunk = chunk  # most prompt tokens fed at once (the prefill step)
        self._lengths: dict[int, int] = {}
        self._longest = 0
        self.reserved = 0  # bytes: batch_bytes of every reservation

    def __len__(self) -> int:
        return len(self._lengths)

    def length(self, num_prompt: int, max_tokens: int) -> int:
        return num_prompt + max_tokens + self.margin

    def row_bytes(self, length: int) -> int:
        return row_bytes(self.layers, length, self.step, self.chunk)

    def reserved_with(self, length: int) -> int:
        """Reserved bytes once a row of ``length`` is admitted too."""
        return (len(self._lengths) + 1) * self.row_bytes(max(self._longest, length))

    def reserve(self, uid: int, length: int) -> None:
        self._lengths[uid] = length
        self._update()

    def release(self, uid: int) -> None:
        if self._lengths.pop(uid, None) is not None:
            self._update()

    def clear(self) -> None:
        self._lengths.clear()
        self._update()

    def _update(self) -> None:
        self._longest = max(self._lengths.values(), default=0)
        self.reserved = batch_bytes(self.layers, self._lengths.values(), self.step, self.chunk)

    def refusal(self, num_prompt: int, max_tokens: int) -> Optional[str]:
        """Why a request can never be admitted (alone it needs more than the
        limit), with the numbers; None when it can."""
        need = self.row_bytes(self.length(num_prompt, max_tokens))
        if need <= self.limit:
            return None
        most = self.most_tokens(num_prompt)
        advice = (f"at most {most} max_tokens fit with this prompt" if most > 0
                  else "the prompt alone does not fit; send a shorter one")
        return (f"this request needs {need} bytes ({mib(need)}) of KV cache for "
                f"{num_prompt} prompt tokens + {max_tokens} max_tokens, more than the "
                f"server's KV memory budget of {self.limit} bytes ({mib(self.limit)}); "
                f"{advice}")

    def most_tokens(self, num_prompt: int) -> int:
        """The largest ``max_tokens`` a request with this prompt can have alone
        (0: none; ``MAX_LENGTH`` when nothing grows without bound)."""
        if self.row_bytes(self.length(num_prompt, 0)) > self.limit:
            return 0
        lo, hi = 0, MAX_LENGTH  # lo fits; find the last that does
        if self.row_bytes(self.length(num_prompt, hi)) <= self.limit:
            return hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.row_bytes(self.length(num_prompt, mid)) <= self.limit:
                lo = mid
            else:
                hi = mid
        return lo


def admit_in_order(budget: Optional[KVBudget], waiting, prompt_cache, join, rows) -> None:
    """Admit waiting requests (handles, oldest first) while the next one
    fits (``budget`` None: no KV budget), the prompt cache giving up entries
    first; a later, smaller request never passes the one at the head (no
    starvation). One whose prefix is read from disk waits while ``rows``
    (the batch's sequences) decode. ``join(handle)`` admits one and
    reserves its bytes."""
    while waiting:
        req = waiting[0].request
        if budget is not None:
            room = budget.limit - budget.reserved_with(
                budget.length(len(req.prompt_tokens), req.max_tokens))
            if room < 0:
                break
            if prompt_cache is not None and prompt_cache.nbytes > room:
                prompt_cache.evict_to(room)
        # Asked after the eviction (which may drop its prefix from memory),
        # and always: the read starts now even when nothing decodes.
        if prompt_cache is not None and not prompt_cache.ready(req.cache_key) and rows:
            break  # its prefix is read from disk meanwhile; with nothing to decode, it joins
        join(waiting.popleft())
    if budget is not None and prompt_cache is not None \
            and prompt_cache.nbytes > budget.limit - budget.reserved:
        prompt_cache.evict_to(budget.limit - budget.reserved)  # entries stored since


class WaitingForMemory:
    """Requests that do not fit the KV budget yet, or whose prefix is read
    from disk, in order of arrival."""

    def __init__(self, budget: Optional[KVBudget], prompt_cache, rows):
        self.budget = budget
        self.prompt_cache = prompt_cache
        self.rows = rows  # the batch's sequences (a live collection)
        self._handles: deque = deque()

    def __len__(self) -> int:
        return len(self._handles)

    def add(self, handle) -> None:
        self._handles.append(handle)

    def admit(self, join) -> None:
        """Join those that fit now, oldest first (``admit_in_order``)."""
        admit_in_order(self.budget, self._handles, self.prompt_cache, join, self.rows)

    def take(self, handle_id: int):
        """The waiting handle with this ``id()``, taken out (None: not waiting)."""
        for handle in self._handles:
            if id(handle) == handle_id:
                self._handles.remove(handle)
                return handle
        return None

    def take_all(self) -> list:
        handles, self._handles = list(self._handles), deque()
        return handles
