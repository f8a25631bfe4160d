"""Generated tokens turned into what a client reads: text deltas that never
split a UTF-8 character or show the start of a stop string, stop strings
applied, logprobs.

Text that could still become a stop string (or a tool-call marker, see
``text/tool_calls.py``) is held back until the next token decides it. For a
model with thinking markers, the reasoning comes apart from the answer
(``text/reasoning.py``).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ..runtime import mlx_lm_adapter
from ..spec_decode.metrics import SpecCounts
from ..spec_decode.proposer.prediction import prediction_counts
from ..text.reasoning import ReasoningSplitter, Thinking
from ..text.stop_strings import find_stop, held_back
from .request import DoneEvent, RequestHandle, TextEvent


class TextOutput:
    """One request's generated text as the client sees it.

    Tokens go in one at a time (``add``); what comes out is the text that is
    safe to send: no split UTF-8 character, no prefix of a stop string that
    the next token might complete, nothing after a stop string.

    With ``thinking`` (the model's markers) the tokens between them are
    reasoning, sent apart as soon as they are text; stop strings apply to
    the answer only, and the whitespace that opens an answer after the
    reasoning is dropped (Qwen3 writes ``</think>\n\n``).
    """

    def __init__(self, tokenizer, stops: list[str], top_logprobs: Optional[int],
                 thinking: Optional[Thinking] = None, continues_prompt: bool = False):
        self.tokenizer = tokenizer
        self.detokenizer = tokenizer.detokenizer
        if continues_prompt:
            mlx_lm_adapter.keep_leading_space(self.detokenizer)
        self.stops = stops
        self.top_logprobs = top_logprobs
        self.text = ""
        self.sent = 0
        self.unsent_ids: list[int] = []
        self.split = ReasoningSplitter(thinking) if thinking is not None else None
        self.reasoning = ""
        self.reasoning_sent = 0
        self._trim = False  # the answer's opening whitespace is still to drop

    def add(self, token: int, logprobs, finish: Optional[str]) -> tuple:
        """Take one token; (the event to post or None, the finish reason or
        None). An end-of-sequence token (``finish == "stop"``: upstream's only
        stop sequences are EOS tokens) adds no text."""
        self.unsent_ids.append(token)
        is_eos = finish == "stop"
        if self.split is None:
            if not is_eos:
                self.detokenizer.add_token(token)
            if finish is not None:
                self.detokenizer.finalize()
            self.text += self.detokenizer.last_segment
        else:
            self._add_split(None if is_eos else token, finish is not None)

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
        reasoning = self.reasoning[self.reasoning_sent:]
        event = None
        if end > self.sent or reasoning or entries or finish is not None:
            event = TextEvent(self.text[self.sent:end], entries, self.unsent_ids, reasoning)
            self.unsent_ids = []
            self.sent = max(self.sent, end)
            self.reasoning_sent = len(self.reasoning)
        return event, finish

    def _add_split(self, token: Optional[int], last: bool) -> None:
        """Detokenize ``token`` into the part it belongs to (reasoning or answer)."""
        part = self.split.reasoning
        for t in (self.split.feed(token) if token is not None else []):
            self.detokenizer.add_token(t)
        if self.split.reasoning != part or last:
            # A marker ended the part (or the request ended): its text is all out.
            self.detokenizer.finalize()
        self._append(part, self.detokenizer.last_segment)
        if self.split.reasoning != part:
            self._trim = part
        if last:
            for t in self.split.close():
                self.detokenizer.add_token(t)
            self.detokenizer.finalize()
            self._append(self.split.reasoning, self.detokenizer.last_segment)

    def _append(self, reasoning: bool, text: str) -> None:
        if reasoning:
            self.reasoning += text
            return
        if self._trim:
            text = text.lstrip()
            self._trim = not text
        self.text += text


class RequestOutput:
    """Inference-thread state of one request: its text, its counts, and the
    events they become on its handle."""

    def __init__(self, handle: RequestHandle, uid: int, tokenizer, cached_tokens: int,
                 constraint=None, speculating: bool = False, keep_ids: bool = False):
        req = handle.request
        self.handle = handle
        self.uid = uid
        self.text = TextOutput(tokenizer, req.stop, req.top_logprobs, req.thinking,
                               req.continues_prompt)
        self.cached_tokens = cached_tokens
        self.constraint = constraint  # its grammar (counts forced tokens)
        self.spec = SpecCounts()  # reported as usage.spec_decode when speculating
        self.speculating = speculating
        self.started = False
        self.first_token_at: Optional[float] = None
        self.completion_tokens = 0
        # The generated ids, for a traffic record (``traffic.py``) or the
        # prediction's counts; None: not kept.
        keep_ids = keep_ids or req.prediction is not None
        self.token_ids: Optional[list[int]] = [] if keep_ids else None

    def add(self, token: int, logprobs, finish: Optional[str]) -> Optional[str]:
        """Post what one token adds; the finish reason once the request is done
        (after its ``DoneEvent``)."""
        self.completion_tokens += 1
        if self.token_ids is not None:
            self.token_ids.append(token)
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
        split = self.text.split
        predicted = (None if req.prediction is None
                     else prediction_counts(req.prediction, self.token_ids, req.thinking))
        return DoneEvent(finish, len(req.prompt_tokens), self.completion_tokens, usage,
                         self.cached_tokens, forced,
                         split.num_tokens if split is not None else None, self.text.reasoning,
                         predicted)


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
