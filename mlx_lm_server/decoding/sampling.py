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


# The smallest temperature or top-p taken as given (see SamplingParams).
TINY = 1e-30


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
    # XTC ("exclude top choices"): with this probability per token, every
    # token above the threshold but the least likely of them is excluded.
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_special_tokens: tuple = ()  # never excluded (newline, end of sequence)

    def __post_init__(self):
        # Values a client may send that float32 cannot carry: a temperature
        # whose inverse overflows is greedy, and a top-p that rounds to 0 would
        # mask every token; 1e-30 keeps only the most likely one, as any top-p
        # below 1 / vocabulary does.
        if 0 < self.temperature < TINY:
            object.__setattr__(self, "temperature", 0.0)
        if 0 < self.top_p < TINY:
            object.__setattr__(self, "top_p", TINY)

    @property
    def speculable(self) -> bool:
        """Whether verification can keep this request's distribution exact:
        XTC draws its own randomness per token, which a draft cannot be
        checked against."""
        return self.xtc_probability == 0

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
    """The key of one randomness stream of a seeded request (None when unseeded).

    Seeds are taken modulo 2**64 (MLX keys are unsigned 64-bit), so a negative
    seed is as good as any other.
    """
    return None if params.seed is None else mx.random.key((params.seed + stream) % 2**64)


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

    xtc = params.xtc_probability > 0

    def sampler(logprobs: mx.array) -> mx.array:
        if keys is None:
            draw = xtc_uniform(None) if xtc else None
            return mx.random.categorical(sampling_logits(params, logprobs, draw))
        if xtc:
            keys[0], sub, xtc_key = mx.random.split(keys[0], 3)
            return mx.random.categorical(
                sampling_logits(params, logprobs, xtc_uniform(xtc_key)), key=sub)
        keys[0], sub = mx.random.split(keys[0])
        return mx.random.categorical(sampling_logits(params, logprobs), key=sub)

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


def xtc_uniform(key: Optional[mx.array]) -> mx.array:
    """The draw that decides whether XTC excludes this token's top choices."""
    return mx.random.uniform(key=key) if key is not None else mx.random.uniform()


def apply_xtc(logprobs: mx.array, params: SamplingParams, uniform: mx.array) -> mx.array:
    """Upstream's XTC (``mlx_lm.sample_utils.apply_xtc``) with the draw given,
    so that a seeded request draws it from its own key."""
    probs = mx.softmax(logprobs, -1)
    above = mx.where(probs > params.xtc_threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    mask = probs > above
    if params.xtc_special_tokens:
        keep = mx.zeros(mask.shape[-1], mx.bool_)
        keep[mx.array(list(params.xtc_special_tokens))] = True
        mask = mask & ~keep
    return mx.where(uniform > params.xtc_probability, logprobs, mx.where(mask, -mx.inf, logprobs))


def sampling_logits(params: SamplingParams, logprobs: mx.array,
                    xtc_draw: Optional[mx.array] = None) -> mx.array:
    """Logits whose softmax is the distribution ``make_sampler(params)`` draws from.

    Same filters, same order, applied to log-probabilities before temperature,
    as upstream's sampler; verification must compare against exactly this.
    A request with XTC needs the token's XTC draw (``xtc_uniform``).
    """
    if params.greedy:
        raise ValueError("a greedy request samples from no distribution")
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p > 0.0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if params.xtc_probability > 0.0:
        if xtc_draw is None:
            raise ValueError("an XTC request needs its draw")
        logprobs = apply_xtc(logprobs, params, xtc_draw)
    if 0 < params.top_k < logprobs.shape[-1]:  # a top-k past the vocabulary keeps it all
        logprobs = apply_top_k(logprobs, params.top_k)
    return logprobs * (1.0 / params.temperature)
