"""Per-request samplers and logits processors built from upstream's pieces.

Upstream's ``make_sampler`` draws from MLX's global random state, so a
request's ``seed`` could not make its output reproducible while other requests
share the batch. Here a seeded request owns its key and splits it once per
sampled token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
)

Sampler = Callable[[mx.array], mx.array]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    logit_bias: tuple = ()  # ((token id, bias), ...)
    repetition_context_size: int = 20
    presence_context_size: int = 20
    frequency_context_size: int = 20

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# Each consumer of a seeded request's randomness owns its own key stream, so
# that drawing in one never shifts the draws of another: upstream's plain step
# samples with the request's sampler, verification draws acceptance uniforms
# and residual samples, a draft model samples its drafts.
SAMPLER_STREAM = 0
VERIFIER_STREAM = 1
DRAFT_STREAM = 2


def request_key(params: "SamplingParams", stream: int) -> Optional[mx.array]:
    """The key of one randomness stream of a seeded request (None when unseeded)."""
    return None if params.seed is None else mx.random.key(params.seed + stream)


def make_sampler(params: SamplingParams) -> Sampler:
    """A sampler over one request's log-probabilities ``[1, vocab]``.

    Greedy requests all share upstream's ``greedy_sampler`` object, which lets
    the generation batch sample them in one call. Others draw from
    ``sampling_logits``: the very distribution verification compares against.
    """
    if params.greedy:
        return greedy_sampler
    key = request_key(params, SAMPLER_STREAM)
    keys = [key] if key is not None else None

    def sampler(logprobs: mx.array) -> mx.array:
        logits = sampling_logits(params, logprobs)
        if keys is None:
            return mx.random.categorical(logits)
        keys[0], sub = mx.random.split(keys[0])
        return mx.random.categorical(logits, key=sub)

    return sampler


def make_processors(params: SamplingParams) -> list:
    """Upstream's processors for the request. They change the distribution
    before sampling, and verification runs them at every draft position with
    the context grown by the drafts before it, so they stay lossless."""
    return make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        repetition_context_size=params.repetition_context_size,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=params.presence_context_size,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=params.frequency_context_size,
    )


def sampling_logits(params: SamplingParams, logprobs: mx.array) -> mx.array:
    """Logits whose softmax is the distribution ``make_sampler(params)`` draws from.

    Same filters, same order, applied to log-probabilities before temperature,
    as upstream's sampler; verification must compare against exactly this.
    """
    if params.greedy:
        raise ValueError("a greedy request samples from no distribution")
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p > 0.0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if params.top_k > 0:
        logprobs = apply_top_k(logprobs, params.top_k)
    return logprobs * (1.0 / params.temperature)
