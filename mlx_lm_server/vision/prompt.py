"""What a prompt's images are on the request's way to the batch: the
model's image inputs (numpy, from the processor) and the key the prompt
cache stores the prompt under. No MLX here.

The prompt's token ids alone cannot key a cache: every image is the same
run of placeholder tokens whatever its pixels. The key is the prompt's
tokens with each image's placeholders replaced by an id made from the hash
of that image's bytes (negative, so never a real token's), so a
conversation that resends a screenshot finds the turn before it, in memory
and on disk, and another image never does.

An M-RoPE prompt (Qwen) also carries its positions: time, height and width
per token, shifted so that the text after its last image is numbered from
its index (``positions``). Its cache entries are apart from every other
shift's (``shifted_key``): the text before the image sits at other
positions than a text prompt's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence


@dataclass(frozen=True)
class PromptImages:
    """A prompt's images as the model's merge takes them."""

    inputs: dict  # numpy arrays: pixel_values, and what else the family reads (grids)
    digests: tuple  # sha256 of each image's bytes, in prompt order
    key: tuple  # the prompt cache's key for the prompt (``cache_key``)
    end: int  # the index after the prompt's last image placeholder token
    # M-RoPE: [3, len(prompt)] numpy positions (time, height, width), None otherwise.
    positions: Optional[Any] = None


def image_id(digest: bytes) -> int:
    """The key's id for an image's placeholder tokens: below every real token id."""
    return -1 - int.from_bytes(hashlib.sha256(b"image:" + digest).digest()[:7], "big")


def _runs(tokens: Sequence[int], image_token: int) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive placeholder tokens."""
    runs, start = [], None
    for i, t in enumerate(tokens):
        if t == image_token and start is None:
            start = i
        elif t != image_token and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(tokens)))
    return runs


def cache_key(tokens: Sequence[int], image_token: int, digests: Sequence[bytes]) -> tuple:
    """``tokens`` with each image's placeholder run replaced by its image's
    id. Where the runs are not one per image (two images' runs touching), every
    placeholder takes the id of all the images together: never a wrong
    hit, only fewer hits."""
    key = list(tokens)
    runs = _runs(tokens, image_token)
    if len(runs) == len(digests):
        ids = [image_id(d) for d in digests]
    else:
        ids = [image_id(b"".join(digests))] * len(runs)
    for (start, end), ident in zip(runs, ids):
        key[start:end] = [ident] * (end - start)
    return tuple(key)


def shifted_key(key: Sequence[int], shift: int) -> tuple:
    """``key`` for a prompt whose every position is moved by ``shift``: its
    first id names the shift (none for 0), so it matches only prompts moved
    as far."""
    if shift == 0 or not key:
        return tuple(key)
    ident = -1 - int.from_bytes(hashlib.sha256(b"shift:%d" % shift).digest()[:7], "big")
    return (ident, *key[1:])


def placeholders_end(tokens: Sequence[int], image_token: int) -> int:
    """The index after the last placeholder token (0: none)."""
    runs = _runs(tokens, image_token)
    return runs[-1][1] if runs else 0
