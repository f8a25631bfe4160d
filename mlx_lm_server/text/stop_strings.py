"""Stop strings in a stream of text: where the first one starts, and how
much of the text so far must be held back because it may still become one
(or a tool-call marker) once the next token arrives."""

from __future__ import annotations


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that could start a stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


def find_stop(text: str, start: int, stops: list[str]) -> int:
    """Index of the earliest stop string in ``text[start:]``, or -1."""
    hits = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else -1
