"""Greedy parity with a near-tie allowance that knows the logits' dtype.

Speculation verifies k + 1 positions in one pass; plain decoding computes one.
The two passes have different shapes, so their logits may differ in the last
bits, and where the two best tokens are that close the greedy choice may
differ: a near-tie, not a bug. How close is close depends on the dtype the
model computes in: float32 keeps 24 significant bits, bfloat16 8, float16 11.
A divergence is accepted only when the top-2 gap of a single-sequence forward
at the first differing token is within ``ULPS[dtype]`` units in the last place of
that dtype, at the magnitude of the top logit.
"""

import math

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

MANTISSA_BITS = {mx.float32: 23, mx.bfloat16: 7, mx.float16: 10}
# Units in the last place a shape change may move the top-2 gap: in float32
# the BLAS accumulation order differs by shape and the difference grows over
# the layers (about 1e-4 at logits near 20); in 16-bit types every layer
# rounds its output, and the output's own rounding dominates.
ULPS = {mx.float32: 64, mx.bfloat16: 2, mx.float16: 2}


def ulp(value: float, dtype) -> float:
    """Spacing of ``dtype`` numbers at ``value``."""
    exponent = math.floor(math.log2(max(abs(value), 1e-30)))
    return 2.0 ** (exponent - MANTISSA_BITS[dtype])


def model_dtype(model):
    """The dtype the model's logits come out in."""
    logits = model(mx.array([[1]]), cache=make_prompt_cache(model))
    return logits.dtype


def top2(model, tokens) -> tuple[float, float]:
    logits = model(mx.array([tokens]), cache=make_prompt_cache(model))[0, -1].astype(mx.float32)
    top = np.sort(np.asarray(logits))[-2:]
    return float(top[1]), float(top[0])


def first_difference(a, b) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def assert_same_or_near_tie(model, prompt, got, want, dtype) -> bool:
    """True when identical; a divergence must be a ``dtype`` near-tie."""
    if got == want:
        return True
    i = first_difference(got, want)
    assert i < min(len(got), len(want)), f"one output is a prefix of the other: {got} / {want}"
    best, second = top2(model, prompt + want[:i])
    tolerance = ULPS[dtype] * ulp(best, dtype)
    assert best - second <= tolerance, (
        f"diverged at token {i} with a top-2 gap of {best - second:.3g}, more than "
        f"{ULPS[dtype]} ulps of {dtype} at {best:.3g} ({tolerance:.3g}): not a near-tie")
    return False
