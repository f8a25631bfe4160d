"""Reasoning apart from the answer, for models that think between markers
(Qwen3's ``<think>`` ... ``</think>``, which mlx-lm's ``TokenizerWrapper``
knows as ``think_start_tokens`` / ``think_end_tokens``).

Everything here works on token ids, not text, so the split is where the
model put its markers whatever the detokenizer holds back:

- ``Thinking``: a model's markers, and whether the prompt leaves the output
  inside an open block (a template that forces thinking ends its prompt
  with the start marker; then the prompt's last marker is a start marker);
- ``ReasoningSplitter``: generated tokens in, the tokens to show as
  reasoning or as answer out, markers dropped, reasoning tokens counted;
- and in ``decoding/structured.py``, ``after_thinking``: a grammar made to apply
  from the end marker on, the thinking before it free.

Nothing here touches MLX.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class Thinking:
    start: tuple[int, ...]  # the start marker's tokens
    end: tuple[int, ...]  # the end marker's tokens
    in_reasoning: bool  # the output starts inside an open block


def rfind(tokens: Sequence[int], marker: Sequence[int]) -> int:
    """Index of the last occurrence of ``marker`` in ``tokens``, or -1."""
    n = len(marker)
    for i in range(len(tokens) - n, -1, -1):
        if tokens[i] == marker[0] and tuple(tokens[i:i + n]) == tuple(marker):
            return i
    return -1


def thinking_of(tokenizer, prompt: Sequence[int]) -> Optional[Thinking]:
    """The model's thinking markers and where ``prompt`` leaves the output;
    None for a model without markers."""
    if not getattr(tokenizer, "has_thinking", False):
        return None
    start, end = tuple(tokenizer.think_start_tokens), tuple(tokenizer.think_end_tokens)
    return Thinking(start, end, rfind(prompt, start) > rfind(prompt, end))


class ReasoningSplitter:
    """One request's generated tokens in (``feed``, one at a time), the
    tokens to show out, in the part the splitter was in before the call:
    reasoning while ``reasoning`` was true, else the answer. Markers are
    dropped; a token that may begin one (markers can be several tokens) is
    held until the next decides. ``num_tokens``: generated reasoning
    tokens so far, markers included."""

    def __init__(self, thinking: Thinking):
        self.start, self.end = list(thinking.start), list(thinking.end)
        self.reasoning = thinking.in_reasoning
        self.num_tokens = 0
        self._held: list[int] = []

    def feed(self, token: int) -> list[int]:
        """The tokens ``token`` lets out; a marker ends only with the call's
        own token, so every token returned is in the part before the call."""
        part = self.reasoning
        self._held.append(token)
        out = []
        while self._held:
            marker = self.end if self.reasoning else self.start
            if self._held == marker[:len(self._held)]:
                if len(self._held) == len(marker):  # a whole marker: the part changes
                    self.num_tokens += len(marker)
                    self.reasoning = not self.reasoning
                    self._held = []
                break
            out.append(self._held.pop(0))  # cannot begin the marker: text
        self.num_tokens += len(out) if part else 0
        return out

    def close(self) -> list[int]:
        """The tokens still held at the end (a marker cut off), as text."""
        out, self._held = self._held, []
        self.num_tokens += len(out) if self.reasoning else 0
        return out
