"""Generated tokens turned into what a client reads: text deltas that never
split a UTF-8 character or show the start of a stop string, stop strings
applied, logprobs.

Text that could still become a stop string (or a tool-call marker, see
``tool_calls.py``) is held back until the next token decides it.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .requests import DoneEvent, RequestHandle, TextEvent
from .spec_decode.metrics import SpecCounts


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


class TextOutput:
    """One request's generated text as the client sees it.

    Tokens go in one at a time (``add``); what comes out is the text that is
    safe to send: no split UTF-8 character, no prefix of a stop string that
    the next token might complete, nothing after a stop string.
    """

    def __init__(self, tokenizer, stops: list[str], top_logprobs: Optional[int]):
        self.tokenizer = tokenizer
        self.detokenizer = tokenizer.detokenizer
        self.stops = stops
        self.top_logprobs = top_logprobs
        self.text = ""
        self.sent = 0
        self.unsent_ids: list[int] = []

    def add(self, token: int, logprobs, finish: Optional[str]) -> tuple:
        """Take one token; (the event to post or None, the finish reason or
        None). An end-of-sequence token (``finish == "stop"``: upstream's only
        stop sequences are EOS tokens) adds no text."""
        self.unsent_ids.append(token)
        is_eos = finish == "stop"
        if not is_eos:
            self.detokenizer.add_token(token)
        if finish is not None:
            self.detokenizer.finalize()
        self.text += self.detokenizer.last_segment

        entries = None
        if self.top_logprobs is not None and not is_eos:
            entries = [logprob_entry(self.tokenizer, token, logprobs, self.top_logprobs)]

        stop_at = find_stop(self.text, self.sent, self.stops) if self.stops else -1
        if stop_at >= 0:
            end, finish = stop_at, "stop"
        elif finish is not None:
            end = len(self.text)
        else:
            end = len(self.text) - held_back(self.text[self.sent:], self.stops)
        event = None
        if end > self.sent or entries or finish is not None:
            event = TextEvent(self.text[self.sent:end], entries, self.unsent_ids)
            self.unsent_ids = []
            self.sent = max(self.sent, end)
        return event, finish


class RequestOutput:
    """Inference-thread state of one request: its text, its counts, and the
    events they become on its handle."""

    def __init__(self, handle: RequestHandle, uid: int, tokenizer, cached_tokens: int,
                 constraint=None, speculating: bool = False):
        req = handle.request
        self.handle = handle
        self.uid = uid
        self.text = TextOutput(tokenizer, req.stop, req.top_logprobs)
        self.cached_tokens = cached_tokens
        self.constraint = constraint  # its grammar (counts forced tokens)
        self.spec = SpecCounts()  # reported as usage.spec_decode when speculating
        self.speculating = speculating
        self.started = False
        self.first_token_at: Optional[float] = None
        self.completion_tokens = 0

    def add(self, token: int, logprobs, finish: Optional[str]) -> Optional[str]:
        """Post what one token adds; the finish reason once the request is done
        (after its ``DoneEvent``)."""
        self.completion_tokens += 1
        event, finish = self.text.add(token, logprobs, finish)
        if event is not None:
            self.handle.post(event)
        if finish is not None:
            self.handle.post(self._done(finish))
        return finish

    def _done(self, finish: str) -> DoneEvent:
        req = self.handle.request
        usage = self.spec.usage() if self.speculating else None
        if usage is not None and not req.sampling.speculable:
            usage["disabled_by"] = "xtc_probability"  # see SamplingParams.speculable
        forced = self.constraint.forced if self.constraint is not None else None
        return DoneEvent(finish, len(req.prompt_tokens), self.completion_tokens, usage,
                         self.cached_tokens, forced)


def logprob_entry(tokenizer, token: int, logprobs: mx.array, top_n: int) -> dict:
    """The sampled token's logprob and the ``top_n`` most likely (OpenAI's shape)."""
    entry = {"token": tokenizer.decode([token]), "logprob": logprobs[token].item(), "top": []}
    if top_n > 0:
        top = mx.argpartition(-logprobs, kth=top_n - 1)[:top_n]
        values = logprobs[top]
        order = mx.argsort(-values)
        ids, vals = top[order].tolist(), values[order].tolist()
        # A grammar leaves fewer than top_n possible tokens: no -inf entries.
        entry["top"] = [
            {"token": tokenizer.decode([i]), "logprob": v}
            for i, v in zip(ids, vals) if v != float("-inf")
        ]
    return entry
