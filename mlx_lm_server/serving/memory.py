"""Memory: what a model's layer caches cost, the device's share for them, and
memory the server gives back when it goes idle."""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from .kv_budget import KVBudget, LayerCost, mib

log = logging.getLogger("mlx_lm_server.serving.memory")

# Shares of the memory left after the weights that KV caches may take by
# default: the rest is for activations and everything else on the machine.
# Metal's recommended working set already leaves the system its share.
GPU_KV_SHARE = 0.75
CPU_KV_SHARE = 0.5
PROBE_TOKENS = 3


def layer_costs(model) -> list[LayerCost]:
    """What each of ``model``'s layer caches holds per row, measured: fresh
    caches (``make_cache``: the layer kinds) take one forward pass of a few
    tokens, then each is read. An attention cache's bytes per token are its
    bytes over the tokens it has room for (keys and values, any dtype or
    quantization); a rotating cache is capped at its ``max_size``; anything
    else (recurrent state) is fixed at what it holds. Under tensor parallel
    every rank must call it (the pass is collective). A drafter head that
    takes hidden states rather than tokens runs its own ``probe``."""
    caches = make_prompt_cache(model)
    if hasattr(model, "probe"):
        model.probe(PROBE_TOKENS, caches)
    else:
        model(mx.array([[0] * PROBE_TOKENS]), cache=caches)
    mx.eval([a for c in caches for _, a in tree_flatten(c.state) if isinstance(a, mx.array)])
    return [cost for c in caches for cost in _costs(c)]


def _costs(cache) -> list[LayerCost]:
    if hasattr(cache, "caches"):  # CacheList: several caches in one layer
        return [cost for c in cache.caches for cost in _costs(c)]
    keys = getattr(cache, "keys", None)
    if keys is None:
        return [LayerCost(fixed=cache.nbytes)]
    room = tree_flatten(keys)[0][1].shape[2]  # [B, heads, tokens, dim], or quantized parts
    per_token = -(-cache.nbytes // room)
    return [LayerCost(per_token=per_token, window=getattr(cache, "max_size", None))]


def make_kv_budget(model, limit: Optional[int], chunk: int, engine=None,
                   announce: bool = True) -> KVBudget:
    """The KV budget: ``limit`` bytes, or (None) a share of the device's
    memory left after the weights and the draft model's. Its layers are the
    model's and the draft model's; with speculation a verification pass
    writes k + 1 tokens before it rolls back (the margin)."""
    layers = layer_costs(model)  # on every rank: the pass is collective
    margin = 0
    if engine is not None:
        margin = engine.config.most_drafts + 1
        draft = engine.proposer.draft_model
        if draft is not None:
            layers += layer_costs(draft)
    source = "--max-kv-memory"
    if limit is None:
        limit, source = default_kv_budget()
    if limit <= 0:
        raise ValueError("no memory is left for KV caches after the weights; "
                         "pass --max-kv-memory")
    budget = KVBudget(limit, layers, margin=margin, chunk=chunk)
    if announce:
        log.info("KV memory budget %s (%s); a request of 1,000 tokens reserves %s",
                 mib(limit), source, mib(budget.row_bytes(1000 + margin)))
    return budget


def memory_stats(budget: Optional[KVBudget], prompt_cache, waiting: int) -> dict:
    """Bytes: the KV budget (None: none) and what holds it, and MLX's own
    figures (peak: since start-up or the last ``mx.reset_peak_memory``)."""
    return {
        "kv_budget": budget.limit if budget is not None else None,
        "kv_reserved": budget.reserved if budget is not None else 0,
        "prompt_cache": prompt_cache.nbytes if prompt_cache is not None else 0,
        "waiting_for_memory": waiting,
        "active": mx.get_active_memory(),
        "peak": mx.get_peak_memory(),
    }


def is_out_of_memory(e: Exception) -> bool:
    """An allocation failure: MLX raises a RuntimeError naming the allocation."""
    text = str(e).lower()
    return isinstance(e, MemoryError) or (
        isinstance(e, RuntimeError) and ("alloc" in text or "out of memory" in text))


def device_room() -> tuple[int, str, bool]:
    """Bytes this process's device can still give (Metal: its recommended
    working set less what is loaded; CUDA: free memory; CPU: available RAM),
    what that figure is (for the log), and whether it is a GPU's."""
    info = mx.device_info()
    if "max_recommended_working_set_size" in info:  # Metal
        return (int(info["max_recommended_working_set_size"]) - mx.get_active_memory(),
                "Metal's recommended working set less what is loaded", True)
    if "free_memory" in info and mx.default_device() == mx.gpu:  # CUDA: after what is loaded
        return int(info["free_memory"]), "the GPU's free memory", True
    return available_ram(), "available RAM", False


def default_kv_budget() -> tuple[int, str]:
    """The KV budget when ``--max-kv-memory`` is not given, after the
    weights are loaded, and where it came from (for the log)."""
    room, what, gpu = device_room()
    share = GPU_KV_SHARE if gpu else CPU_KV_SHARE
    return int(share * room), f"{share:.0%} of {what}"


def default_models_memory() -> tuple[int, str]:
    """What a set of models (weights and KV budgets together) may take by
    default, read before any is loaded, and where it came from."""
    room, what, _ = device_room()
    return int(GPU_KV_SHARE * room), f"{GPU_KV_SHARE:.0%} of {what}"


def available_ram() -> int:
    """Bytes of RAM the system can still give (Linux: MemAvailable, which
    counts reclaimable page cache; elsewhere the free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    pages: Optional[int] = None
    for name in ("SC_AVPHYS_PAGES", "SC_PHYS_PAGES"):
        if name in os.sysconf_names:
            pages = os.sysconf(name)
            break
    if pages is None:
        raise RuntimeError("cannot read this machine's memory; pass --max-kv-memory")
    return pages * os.sysconf("SC_PAGE_SIZE")


def release_idle_memory() -> None:
    """Give MLX's buffer cache back to the system once no request is left.

    A burst of requests grows the cache by the batch's activations and KV
    (several hundred MB for a small model); an idle server should not keep
    holding it. The next request allocates afresh, a cost far below a step's.
    On Linux (the CPU and CUDA backends) glibc keeps freed pages mapped until
    it is asked to trim them.
    """
    mx.clear_cache()
    if _malloc_trim is not None:
        _malloc_trim(0)


def _find_malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl)
        return None


_malloc_trim = _find_malloc_trim()
