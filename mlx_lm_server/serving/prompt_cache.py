"""Prompt caches reused across requests.

Chats and agents resend their whole history with every request; without a
cache every turn prefills it again (on a CPU, 50-130 tokens a second). When a
sequence finishes, its layer caches (every token it holds, prompt and
completion) are stored under its tokens; a request takes the stored entry
that shares the longest prefix with its prompt and prefills only the rest.

Built on upstream's ``LRUPromptCache``: its token trie finds the nearest
entry (exact, shorter, or longer trimmed back to the common prefix when the
layers can be trimmed), its LRU evicts by entries and by bytes, and a fetch
returns a deep copy, so two live sequences never share a cache object. Two
additions here: an exact hit keeps its last token to prefill (a sequence
needs one fed token to predict from; upstream's generator refuses an empty
prompt), and hit counters. Under a KV memory budget its bytes count against
the budget, and the scheduler evicts its least recently used entries first
when a new request needs the room (``evict_to``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

_MODEL = "target"  # one model per server: every entry shares the key


class PromptCache:
    def __init__(self, max_entries: int, max_bytes: int):
        self._lru = LRUPromptCache(max_entries, max_bytes)
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of those, found cached

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    def fetch(self, tokens: Sequence[int]) -> tuple[Optional[list], int]:
        """A private copy of the cache holding the longest stored prefix of
        ``tokens`` and that prefix's length (None, 0 on a miss)."""
        tokens = list(tokens)
        self.queried_tokens += len(tokens)
        cache, rest = self._lru.fetch_nearest_cache(_MODEL, tokens)
        if cache is None:
            return None, 0
        if not rest:
            if not can_trim_prompt_cache(cache):
                return None, 0
            trim_prompt_cache(cache, 1)
            rest = tokens[-1:]
        cached = len(tokens) - len(rest)
        if cached <= 0:
            return None, 0
        self.hit_tokens += cached
        return cache, cached

    def evict_to(self, max_bytes: int) -> None:
        """Drop the least recently used entries until at most ``max_bytes`` remain."""
        self._lru.trim_to(n_bytes=max_bytes)

    def store(self, tokens: Sequence[int], cache: Optional[list]) -> None:
        """Keep ``cache``, which holds exactly ``tokens``, for later requests."""
        if not tokens or not cache:
            return
        # Evaluated now: a lazy slice of a batch's cache would keep the whole
        # batch's buffers alive for as long as the entry lives.
        mx.eval([a for c in cache for _, a in tree_flatten(c.state) if isinstance(a, mx.array)])
        self._lru.insert_cache(_MODEL, list(tokens), cache)
