"""Prompt caches reused across requests.

Chats and agents resend their whole history with every request; without a
cache every turn prefills it again (on a CPU, 50-130 tokens a second). When a
sequence finishes, its layer caches (every token it holds, prompt and
completion) are stored under its tokens; a request takes the stored entry
that shares the longest prefix with its prompt and prefills only the rest.

Built on upstream's ``LRUPromptCache``: its token trie finds the nearest
entry (exact, shorter, or longer trimmed back to the common prefix when the
layers can be trimmed), its LRU evicts by entries and by bytes, and a fetch
returns a deep copy, so two live sequences never share a cache object. Three
additions here: the trie's search costs what it walks (upstream's costs the
square of a long entry's length when a prompt leaves it early: seconds on
the inference thread; ``mlx_lm_adapter.LinearSearchTrie``), an exact hit
keeps its last token to prefill (a sequence needs one fed token to predict
from; upstream's generator refuses an empty prompt), and hit counters.
Under a KV memory budget its bytes count against the budget, and the
scheduler evicts its least recently used entries first when a new request
needs the room (``evict_to``).

With ``--prompt-cache-dir`` a disk tier lies under it
(``prompt_cache_disk.py``): every stored entry is also written there, and a
prompt the disk serves further than memory does is read back from it, so a
restart or an entry evicted from memory costs a read instead of a prefill.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from ..runtime.mlx_lm_adapter import linear_search
from .prompt_cache_disk import DiskTier, open_disk_tier

log = logging.getLogger("mlx_lm_server.serving.prompt_cache")

_MODEL = "target"  # one model per server: every entry shares the key


class PromptCache:
    def __init__(self, max_entries: int, max_bytes: int, disk: Optional[DiskTier] = None):
        self._lru = linear_search(LRUPromptCache(max_entries, max_bytes))
        self.disk = disk
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of those, found cached (in memory or on disk)

    @classmethod
    def for_server(cls, config, model, link=None) -> Optional["PromptCache"]:
        """The prompt cache a ``ServerConfig`` asks for (None: off), with its
        disk tier when ``--prompt-cache-dir`` is given (not under tensor
        parallel: each rank holds its own shard of every layer)."""
        if config.prompt_cache_size <= 0:
            return None
        disk = None
        if config.prompt_cache_dir and link is not None and link.size > 1:
            log.warning("--prompt-cache-dir is not used under tensor parallel")
        elif config.prompt_cache_dir:
            disk = open_disk_tier(config.prompt_cache_dir, config.prompt_cache_disk_bytes,
                                  model, config.model, config.adapter_path, config.kv_bits,
                                  config.kv_group_size, config.prompt_cache_bytes)
        return cls(config.prompt_cache_size, config.prompt_cache_bytes, disk)

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def nbytes(self) -> int:
        """Bytes held: the entries in memory, and those waiting to be written
        to disk (the same arrays while the memory tier keeps them: counted
        twice, to stay above what is held)."""
        return self._lru.nbytes + (self.disk.pending_bytes if self.disk is not None else 0)

    def fetch(self, tokens: Sequence[int]) -> tuple[Optional[list], int]:
        """A private copy of the cache holding the longest stored prefix of
        ``tokens`` and that prefix's length (None, 0 on a miss): from memory,
        or from disk where the disk holds more of it."""
        tokens = list(tokens)
        self.queried_tokens += len(tokens)
        cache, cached = self._from_memory(tokens)
        if self.disk is not None:
            entry, on_disk = self.disk.lookup(tokens)
            if on_disk > cached:
                loaded = self.disk.load(entry, on_disk)
                if loaded is not None:
                    cache, cached = loaded, on_disk
            elif entry is not None:
                self.disk.touch(entry)  # served through memory: the bound keeps it too
        self.hit_tokens += cached
        return cache, cached

    def ready(self, tokens: Sequence[int]) -> bool:
        """False while the entry for ``tokens`` is read from disk in the
        background (the read starts at the first call): admission holds the
        request back and the batch decodes meanwhile."""
        return self.disk is None or self.disk.ready(tokens)

    def close(self) -> None:
        """Finish writing what waits for the disk."""
        if self.disk is not None:
            self.disk.close()

    def _from_memory(self, tokens: list) -> tuple[Optional[list], int]:
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
        return cache, cached

    def evict_to(self, max_bytes: int) -> None:
        """Drop the least recently used entries until at most ``max_bytes``
        remain (what waits for the disk counted first: it goes once written)."""
        pending = self.disk.pending_bytes if self.disk is not None else 0
        self._lru.trim_to(n_bytes=max(0, max_bytes - pending))

    def store(self, tokens: Sequence[int], cache: Optional[list]) -> None:
        """Keep ``cache``, which holds exactly ``tokens``, for later requests."""
        if not tokens or not cache:
            return
        # Evaluated now: a lazy slice of a batch's cache would keep the whole
        # batch's buffers alive for as long as the entry lives.
        mx.eval([a for c in cache for _, a in tree_flatten(c.state) if isinstance(a, mx.array)])
        self._lru.insert_cache(_MODEL, list(tokens), cache)
        if self.disk is not None:
            self.disk.put(tokens, cache)
