"""What a request is on its way through the server, and what comes back.

The HTTP side builds a ``GenerationRequest``, submits it and reads the
request's events (``TextEvent``s, then one ``DoneEvent`` or ``ErrorEvent``)
from its ``RequestHandle``; the inference thread posts them. Nothing here
touches MLX.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from ..decoding.sampling import SamplingParams
from ..text.reasoning import Thinking
from ..vision.prompt import PromptImages


@dataclass
class GenerationRequest:
    prompt_tokens: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    # None: no logprobs; n: the sampled token's logprob and the n most likely.
    top_logprobs: Optional[int] = None
    # At most this many drafts per speculative step (0: none); None: the server's k.
    max_draft_tokens: Optional[int] = None
    # An llguidance grammar the output must follow (structured output).
    grammar: Optional[str] = None
    # The model's thinking markers (None: no reasoning split).
    thinking: Optional[Thinking] = None
    # The output continues the prompt's text (a completion): its first
    # token's leading space is text, not the start of an answer to trim.
    continues_prompt: bool = False
    # The predicted output's tokens (OpenAI's ``prediction``): drafted first
    # when speculating, counted in the usage (None: no prediction).
    prediction: Optional[tuple[int, ...]] = None
    # The prompt's images (None: text only): the model's image inputs, and
    # the prompt cache's key, which tells images apart.
    images: Optional[PromptImages] = None

    @property
    def cache_key(self) -> Sequence[int]:
        """What the prompt cache stores and finds the prompt under: its
        tokens, each image's placeholders named by the image's hash."""
        return self.images.key if self.images is not None else self.prompt_tokens


@dataclass
class TextEvent:
    text: str
    logprobs: Optional[list[dict]] = None
    # Every token generated since the previous event (text may lag behind
    # tokens: incomplete UTF-8 and possible stop-string prefixes are held back).
    token_ids: list[int] = field(default_factory=list)
    # Reasoning text (between thinking markers), apart from the answer in ``text``.
    reasoning: str = ""


@dataclass
class DoneEvent:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    # usage.spec_decode for this request when speculation is configured
    spec_decode: Optional[dict] = None
    # prompt tokens taken from the prompt cache (not prefilled)
    cached_tokens: int = 0
    # tokens the request's grammar forced (None: no grammar)
    forced_tokens: Optional[int] = None
    # generated tokens of the reasoning, markers included (None: no thinking markers)
    reasoning_tokens: Optional[int] = None
    # the whole reasoning (a stream has sent it in TextEvents already)
    reasoning: str = ""
    # (accepted, rejected) tokens of the request's prediction (None: it had none)
    prediction: Optional[tuple[int, int]] = None


@dataclass
class ErrorEvent:
    message: str
    type: str = "server_error"
    code: Optional[str] = None


Event = Union[TextEvent, DoneEvent, ErrorEvent]


class QueueFullError(RuntimeError):
    pass


class ShuttingDownError(RuntimeError):
    pass


class RequestHandle:
    """The HTTP side of one request: its events arrive on an asyncio queue."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self._loop = loop
        self.submitted_at = time.monotonic()
        self.closed = False

    def post(self, event: Event) -> None:
        """Thread-safe; events after ``close`` are dropped."""
        if self.closed:
            return
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening
            pass

    def close(self, event: Event) -> None:
        """Post a last event; the stream ends there whatever the inference thread does."""
        self.post(event)
        self.closed = True
