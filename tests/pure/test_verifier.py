"""Verifier: exact-match, threshold and one-hot rejection sampling, as pure functions."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm_server.spec_decode.drafts import PLACEHOLDER_TOKEN as P
from mlx_lm_server.spec_decode.verifier import (
    greedy_verify,
    rejection_sample,
    threshold_verify,
)


def _greedy(target, draft, num):
    out, n = greedy_verify(mx.array(target), mx.array(draft), mx.array(num))
    return out.tolist(), n.tolist()


def test_greedy_all_none_partial():
    target = [[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]]
    draft = [[5, 6, 7], [9, 6, 7], [5, 6, 9]]
    out, n = _greedy(target, draft, [3, 3, 3])
    assert n == [3, 0, 2]
    assert out == [[5, 6, 7, 8], [5, P, P, P], [5, 6, 7, P]]


def test_greedy_respects_proposal_lengths_and_zero_length():
    target = [[5, 6, 7, 8], [5, 6, 7, 8]]
    draft = [[5, 6, P], [P, P, P]]
    out, n = _greedy(target, draft, [2, 0])
    assert n == [2, 0]
    assert out == [[5, 6, 7, P], [5, P, P, P]]


def test_bonus_token_when_everything_is_accepted():
    out, n = _greedy([[1, 2, 3]], [[1, 2]], [2])
    assert n == [2] and out == [[1, 2, 3]]


def test_threshold_strict_and_permissive():
    target = [[5, 6, 7]]
    draft = [[9, 6]]
    p_draft = [[0.3, 0.9]]
    args = (mx.array(target), mx.array(p_draft), mx.array(draft), mx.array([2]))
    out, n = threshold_verify(*args, threshold=0.5)
    assert n.tolist() == [0] and out.tolist() == [[5, P, P]]
    out, n = threshold_verify(*args, threshold=0.25)
    assert n.tolist() == [2] and out.tolist() == [[9, 6, 7]]


def _random_dist(rng, V, sharp):
    logits = rng.normal(size=V) * sharp
    p = np.exp(logits - logits.max())
    return p / p.sum()


def _emitted_distribution(sampler, p, draft_token, n_samples, seed):
    """Frequencies of the first emitted token for one position with a one-hot draft."""
    B = n_samples
    V = len(p)
    probs = mx.broadcast_to(mx.array(p, dtype=mx.float32)[None, None, :], (B, 2, V))
    draft = mx.full((B, 1), draft_token, mx.int32)
    key_u, key_g = mx.random.split(mx.random.key(seed))
    uniforms = mx.random.uniform(shape=(B, 1), key=key_u)
    gumbels = mx.random.gumbel(shape=(B, V), key=key_g)
    out, n = sampler(probs, draft, mx.array([1] * B), uniforms, gumbels)
    first = np.asarray(out[:, 0])
    return np.bincount(first, minlength=V) / B, float(np.asarray(n).mean())


def _wrong_sampler(probs, draft, num, uniforms, gumbels):
    """Resamples the rejected position from p itself, the draft token not removed."""
    B, K = draft.shape
    p_draft = mx.take_along_axis(probs[:, :K], draft[..., None], axis=2)[..., 0]
    accept = uniforms < p_draft
    final = mx.argmax(mx.log(probs[:, 0]) + gumbels, axis=1).astype(mx.int32)
    first = mx.where(accept[:, 0], draft[:, 0], final)
    return mx.stack([first, final], axis=1), accept[:, 0].astype(mx.int32)


@pytest.mark.parametrize("V,sharp,rank", [(10, 1.0, 1), (10, 3.0, 0), (64, 1.5, 2)])
def test_onehot_rejection_reproduces_the_target_distribution(V, sharp, rank):
    """TV distance to p below 0.015 at 100k samples; a wrong sampler is caught.

    The draft is the rank-th most likely token, so that a sampler that forgets
    to remove it from the residual is visibly off.
    """
    rng = np.random.default_rng(V + rank)
    p = _random_dist(rng, V, sharp)
    draft_token = int(np.argsort(-p)[rank])
    freq, accept_rate = _emitted_distribution(rejection_sample, p, draft_token, 100_000, 0)
    tv = 0.5 * np.abs(freq - p).sum()
    assert tv < 0.015, tv
    assert accept_rate == pytest.approx(p[draft_token], abs=0.01)

    wrong, _ = _emitted_distribution(_wrong_sampler, p, draft_token, 100_000, 0)
    assert 0.5 * np.abs(wrong - p).sum() > 0.015


def test_onehot_rejection_multi_position_and_bonus():
    """With all drafts accepted the bonus comes from the last position's p."""
    V = 6
    p = np.zeros((1, 3, V), np.float32)
    p[0, 0, 2] = 1.0  # draft 2 is certain
    p[0, 1, 4] = 1.0  # draft 4 is certain
    p[0, 2, 5] = 1.0  # bonus must be 5
    out, n = rejection_sample(
        mx.array(p), mx.array([[2, 4]]), mx.array([2]), mx.array([[0.5, 0.9]]),
        mx.zeros((1, V)),
    )
    assert n.tolist() == [2] and out.tolist() == [[2, 4, 5]]
    # a zero-probability draft is always rejected and never re-emitted
    p2 = np.full((1, 2, V), 1.0 / (V - 1), np.float32)
    p2[0, 0, 1] = 0.0
    out, n = rejection_sample(
        mx.array(p2), mx.array([[1]]), mx.array([1]), mx.array([[0.0]]),
        mx.random.gumbel(shape=(1, V), key=mx.random.key(3)),
    )
    assert n.tolist() == [0] and out.tolist()[0][0] != 1


def test_onehot_rejection_guards_all_mass_on_rejected_draft():
    """Rounding can make p(d)=1 yet u >= p(d): the draw falls back to p, never NaN."""
    V = 4
    p = np.zeros((1, 2, V), np.float32)
    p[0, 0, 2] = 1.0
    out, n = rejection_sample(
        mx.array(p), mx.array([[2]]), mx.array([1]), mx.array([[1.0]]), mx.zeros((1, V))
    )
    assert out.tolist()[0][0] == 2
