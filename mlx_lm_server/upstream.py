"""The one place that reads mlx-lm's private state.

mlx-lm's internals move between releases (the package pins the exact version).
Everything here is covered by ``tests/test_upstream_adapter.py``, which fails
loudly when an attribute this module relies on disappears.
"""

from __future__ import annotations

from mlx_lm.generate import BatchGenerator


def sequences_in_generator(gen: BatchGenerator) -> dict[str, int]:
    """How many sequences each stage of ``gen`` holds: waiting, prefilling, decoding."""
    return {
        "waiting": len(gen._unprocessed_sequences),
        "prefilling": len(gen._prompt_batch),
        "decoding": len(gen._generation_batch),
    }
