"""Memory the server gives back when it goes idle."""

from __future__ import annotations

import ctypes

import mlx.core as mx


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
