"""Rejection sampling with a draft distribution q against exact target distributions, with fixed seeds.

For every position j the token emitted there (given that the step reached j)
must be distributed as p_j, and the acceptance rate at j must be
sum(min(p_j, q_j)). A sampler that draws the recovered token from p instead of
norm(max(0, p - q)) must fail the same bound. A slow, obviously-correct
reference agrees draw for draw with the vectorised sampler.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm_server.spec_decode.drafts import PLACEHOLDER_TOKEN as P
from mlx_lm_server.spec_decode.target_probs import draw_noise
from mlx_lm_server.spec_decode.verifier import assemble_output, rejection_sample


def _rs(target, dprobs, draft, num, uniforms, gumbels, greedy=None):
    """Rejection sampling with a full draft distribution q (draft-model drafts)."""
    return rejection_sample(target, draft, num, uniforms, gumbels, dprobs, greedy)


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _pair(kind, V, rng):
    p = _softmax(rng.normal(size=V) * 2.0)
    if kind == "same":
        q = p.copy()
    elif kind == "flat":
        q = 0.7 * np.full(V, 1.0 / V) + 0.3 * p
    elif kind == "onehot":
        q = np.zeros(V)
        q[int(np.argsort(-p)[1])] = 1.0
    elif kind == "disjoint":
        half = V // 2
        p = np.concatenate([_softmax(rng.normal(size=half)), np.zeros(V - half)])
        q = np.concatenate([np.zeros(half), _softmax(rng.normal(size=V - half))])
    else:
        raise ValueError(kind)
    return p.astype(np.float32), q.astype(np.float32)


def _run_positions(ps, qs, n, seed, sampler=_rs, chunk=200_000):
    """Emitted tokens [n, K+1] and accepted counts [n] for per-position (p_j, q_j)."""
    K = len(qs)
    V = len(ps[0])
    outs, accs = [], []
    key = mx.random.key(seed)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        key, kd, ku, kg = mx.random.split(key, 4)
        q = mx.array(np.stack(qs))  # [K, V]
        draft = mx.random.categorical(mx.log(q)[None].astype(mx.float32), shape=(m, K), key=kd)
        target = mx.broadcast_to(mx.array(np.stack(ps))[None], (m, K + 1, V))
        dprobs = mx.broadcast_to(q[None], (m, K, V))
        out, acc = sampler(target, dprobs, draft.astype(mx.int32), mx.full((m,), K, mx.int32),
                           mx.random.uniform(shape=(m, K), key=ku),
                           mx.random.gumbel(shape=(m, V), key=kg))
        mx.eval(out, acc)
        outs.append(np.asarray(out))
        accs.append(np.asarray(acc))
    return np.concatenate(outs), np.concatenate(accs)


def _tv_per_position(out, acc, ps):
    V = len(ps[0])
    tvs = []
    for j, p in enumerate(ps):
        reached = out[:, j] != P
        freq = np.bincount(out[reached, j], minlength=V) / max(reached.sum(), 1)
        tvs.append(0.5 * np.abs(freq - p).sum())
    return tvs


def _wrong_sampler(target, dprobs, draft, num, uniforms, gumbels):
    """Keeps the real acceptance decisions but draws the final token from p, not max(0, p - q)."""
    _, n = _rs(target, dprobs, draft, num, uniforms, gumbels)
    p_n = mx.take_along_axis(target, n[:, None, None], axis=1)[:, 0]
    final = mx.argmax(mx.log(p_n) + gumbels, axis=1).astype(mx.int32)
    return assemble_output(draft, n, final), n


CASES = [
    (10, 100_000, 0.015, "disjoint", 1),
    (10, 100_000, 0.015, "same", 2),
    (10, 100_000, 0.015, "onehot", 4),
    (10, 100_000, 0.015, "flat", 8),
    (64, 1_000_000, 0.010, "flat", 2),
    (64, 1_000_000, 0.010, "onehot", 1),
]


@pytest.mark.parametrize("V,n,bound,kind,K", CASES)
def test_emitted_tokens_follow_p_and_acceptance_is_overlap(V, n, bound, kind, K):
    rng = np.random.default_rng(V * 100 + K)
    pairs = [_pair(kind, V, rng) for _ in range(K)]
    ps = [p for p, _ in pairs] + [_pair("flat", V, rng)[0]]  # the bonus position's p
    qs = [q for _, q in pairs]
    out, acc = _run_positions(ps, qs, n, seed=K)
    tvs = _tv_per_position(out, acc, ps)
    # positions reached rarely have few samples: only judge those seen 20k+ times
    reached = [(out[:, j] != P).sum() for j in range(K + 1)]
    for j, (tv, m) in enumerate(zip(tvs, reached)):
        if m >= 20_000:
            assert tv <= bound * np.sqrt(n / m), (j, tv, m)
    for j in range(K):
        got_to_j = acc >= j
        rate = (acc[got_to_j] > j).mean()
        expected = np.minimum(ps[j], qs[j]).sum()
        assert rate == pytest.approx(expected, abs=0.01 + 3 / np.sqrt(got_to_j.sum())), j


@pytest.mark.parametrize("kind", ["flat", "onehot"])
def test_a_wrong_residual_is_caught(kind):
    rng = np.random.default_rng(7)
    p, q = _pair(kind, 10, rng)
    out, acc = _run_positions([p, p], [q], 100_000, seed=3, sampler=_wrong_sampler)
    assert _tv_per_position(out, acc, [p, p])[0] > 0.015


def _reference(target, dprobs, draft, num, uniforms, gumbels, greedy):
    """Row by row, position by position, in plain numpy."""
    B, K = draft.shape
    out = np.full((B, K + 1), P, dtype=np.int64)
    acc = np.zeros(B, dtype=np.int64)
    for b in range(B):
        j = 0
        while j < num[b]:
            t = draft[b, j]
            if greedy[b]:
                ok = t == np.argmax(target[b, j])
            else:
                ok = target[b, j, t] > 0 and uniforms[b, j] * dprobs[b, j, t] < target[b, j, t]
            if not ok:
                break
            out[b, j] = t
            j += 1
        acc[b] = j
        p = target[b, j]
        if greedy[b]:
            out[b, j] = np.argmax(p)
            continue
        r = np.maximum(p - dprobs[b, j], 0) if j < num[b] else p
        if r.sum() <= 0:
            r = p
        with np.errstate(divide="ignore"):
            out[b, j] = np.argmax(np.log(r) + gumbels[b])
    return out, acc


def test_vectorised_agrees_with_reference_draw_for_draw():
    rng = np.random.default_rng(0)
    B, K, V = 64, 4, 12
    target = np.stack([np.stack([_softmax(rng.normal(size=V) * 2) for _ in range(K + 1)])
                       for _ in range(B)]).astype(np.float32)
    dprobs = np.stack([np.stack([_softmax(rng.normal(size=V)) for _ in range(K)])
                       for _ in range(B)]).astype(np.float32)
    target[3, 0] = dprobs[3, 0]  # p == q: no residual, falls back to p
    dprobs[5, 1, :] = 0
    dprobs[5, 1, 2] = 1.0  # one-hot q
    draft = np.array([[rng.choice(V, p=dprobs[b, j]) for j in range(K)] for b in range(B)])
    num = rng.integers(0, K + 1, size=B)
    uniforms = rng.random((B, K)).astype(np.float32)
    uniforms[7, 0] = 0.0  # a uniform of exactly zero
    gumbels = rng.gumbel(size=(B, V)).astype(np.float32)
    greedy = rng.random(B) < 0.25
    draft_masked = np.where(np.arange(K)[None] < num[:, None], draft, P)
    out, acc = _rs(mx.array(target), mx.array(dprobs), mx.array(draft_masked),
                                mx.array(num), mx.array(uniforms), mx.array(gumbels),
                                mx.array(greedy))
    ref_out, ref_acc = _reference(target, dprobs, draft, num, uniforms, gumbels, greedy)
    assert np.asarray(acc).tolist() == ref_acc.tolist()
    assert np.asarray(out).tolist() == ref_out.tolist()


def test_edge_cases():
    V = 5
    p = np.full((1, 3, V), 0.2, np.float32)
    q = np.full((1, 2, V), 0.2, np.float32)
    g = mx.zeros((1, V))
    # q = p: always accepted, bonus drawn from p
    out, n = _rs(mx.array(p), mx.array(q), mx.array([[1, 2]]), mx.array([2]),
                              mx.array([[0.99, 0.99]]), g)
    assert n.tolist() == [2] and out.tolist()[0][:2] == [1, 2] and 0 <= out.tolist()[0][2] < V
    # p(d) = 0: rejected even with u = 0, never re-emitted, ids stay in the vocabulary
    p2 = p.copy()
    p2[0, 0] = [0.0, 0.25, 0.25, 0.25, 0.25]
    out, n = _rs(mx.array(p2), mx.array(q), mx.array([[0, 2]]), mx.array([2]),
                              mx.array([[0.0, 0.0]]), mx.random.gumbel(shape=(1, V), key=mx.random.key(1)))
    assert n.tolist() == [0] and out.tolist()[0][0] in (1, 2, 3, 4)
    # top-k style masks (zeros in p) are respected by recovered tokens
    p3 = np.zeros((200, 2, V), np.float32)
    p3[:, :, :2] = 0.5
    q3 = np.full((200, 1, V), 0.2, np.float32)
    out, n = _rs(mx.array(p3), mx.array(q3), mx.full((200, 1), 4, mx.int32),
                              mx.full((200,), 1, mx.int32), mx.zeros((200, 1)),
                              mx.random.gumbel(shape=(200, V), key=mx.random.key(2)))
    assert set(np.asarray(out)[:, 0].tolist()) <= {0, 1}
    # mixed greedy and sampled rows
    out, n = _rs(mx.array(np.concatenate([p2, p2])), mx.array(np.concatenate([q, q])),
                              mx.array([[1, 2], [1, 2]]), mx.array([2, 2]),
                              mx.array([[0.0, 0.0], [0.0, 0.0]]), mx.zeros((2, V)),
                              mx.array([True, False]))
    assert n.tolist()[0] == 1  # greedy row: argmax p_0 is token 1 (first of the ties)


def test_seeded_rows_are_reproducible_in_any_batch():
    """A seeded row draws the same noise, so keeps the same tokens, whatever
    else shares its batch."""
    rng = np.random.default_rng(1)
    V, K = 8, 3
    p = mx.array(np.stack([np.stack([_softmax(rng.normal(size=V)) for _ in range(K + 1)])]).astype(np.float32))
    q = mx.array(np.stack([np.stack([_softmax(rng.normal(size=V)) for _ in range(K)])]).astype(np.float32))
    d = mx.array([[1, 2, 3]])
    draws = [("uniform", (K,)), ("gumbel", (V,))]
    (u1, g1), _ = draw_noise([mx.random.key(5)], draws)
    (u2, g2), keys = draw_noise([None, mx.random.key(5)], draws)
    a, _ = _rs(p, q, d, mx.array([3]), u1, g1)
    b, _ = _rs(mx.concatenate([p, p]), mx.concatenate([q, q]), mx.concatenate([d, d]),
               mx.array([3, 3]), u2, g2)
    assert a.tolist()[0] == b.tolist()[1]
    assert keys[0] is None and keys[1] is not None
    (u3, _), _ = draw_noise([keys[1]], draws)  # the advanced key draws anew
    assert u3.tolist() != u1.tolist()


def _reference_verdict(rows, logits, draft, num_drafts, max_k, mode="lossless"):
    """``verify_rows`` one row at a time: each row's own filters and its own
    draws from its own key, in the obvious loops."""
    from mlx_lm_server.decoding.sampling import sampling_logits
    from mlx_lm_server.spec_decode.target_probs import log_softmax
    from mlx_lm_server.spec_decode.verifier import greedy_verify, threshold_verify

    B, K1, V = logits.shape
    greedy_ids = mx.argmax(logits, axis=-1).astype(mx.int32)
    xtc, noise, probs, ids = {}, {}, [], []
    for i, row in enumerate(rows):
        if row.params.greedy:
            probs.append(mx.softmax(logits[i].astype(mx.float32), axis=-1))
            ids.append(greedy_ids[i])
            continue
        if row.params.xtc_probability > 0:
            row.key, sub = mx.random.split(row.key)
            xtc[i] = mx.random.uniform(shape=(1,), key=sub)[0]
        row_logits = sampling_logits(row.params, log_softmax(logits[i]), xtc.get(i))
        probs.append(mx.softmax(row_logits, axis=-1))
        shapes = [("gumbel", (max_k + 1, V))] if mode == "threshold" else \
            [("uniform", (max_k,)), ("gumbel", (V,))]
        noise[i] = []
        for kind, shape in shapes:
            row.key, sub = mx.random.split(row.key)
            noise[i].append(getattr(mx.random, kind)(shape=shape, key=sub))
        if mode == "threshold":
            ids.append(mx.argmax(row_logits + noise[i][0][:K1], axis=-1).astype(mx.int32))
    if mode == "threshold":
        p = mx.stack(probs)
        p_draft = mx.take_along_axis(p[:, :K1 - 1], mx.maximum(draft, 0)[..., None],
                                     axis=2)[..., 0]
        return threshold_verify(mx.stack(ids), p_draft, draft, num_drafts, 0.3)
    verdicts = [greedy_verify(greedy_ids[i:i + 1], draft[i:i + 1], num_drafts[i:i + 1])
                if i not in noise else
                rejection_sample(probs[i][None], draft[i:i + 1], num_drafts[i:i + 1],
                                 noise[i][0][None, :K1 - 1], noise[i][1][None])
                for i in range(B)]
    return (mx.concatenate([out for out, _ in verdicts]),
            mx.concatenate([n for _, n in verdicts]))


@pytest.mark.parametrize("mode", ["lossless", "threshold"])
def test_rows_that_filter_alike_are_verified_together_as_one_at_a_time(mode):
    """The batched verdict (rows grouped by their filters, seeded draws
    vmapped) keeps exactly what row-by-row filtering and drawing keeps, in a
    batch mixing a greedy row, two filter settings interleaved, and two XTC
    rows (their draws taken together; with these keys one excludes its top
    choices and the other does not)."""
    from dataclasses import dataclass
    from typing import Optional

    from mlx_lm_server.decoding.sampling import SamplingParams
    from mlx_lm_server.spec_decode.verifier import verify_rows

    @dataclass
    class Row:
        params: SamplingParams
        key: Optional[mx.array]

    settings = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9),
                SamplingParams(temperature=1.3, top_k=5, min_p=0.05),
                SamplingParams(temperature=0.8, xtc_probability=0.5, xtc_threshold=0.05)]
    pick = [1, 2, 1, 3, 3, 2, 1, 0]
    B, K, V = len(pick), 4, 64
    logits = mx.random.normal((B, K + 1, V), key=mx.random.key(3)) * 3
    draft = mx.argmax(logits[:, :K], axis=-1).astype(mx.int32)  # likely drafts: long prefixes
    num_drafts = mx.array([4, 3, 4, 0, 0, 2, 1, 4])  # XTC rows never draft

    def rows():
        return [Row(settings[s], mx.random.key(10 + i)) for i, s in enumerate(pick)]

    ours_rows, reference_rows = rows(), rows()
    verdict = verify_rows(ours_rows, logits, draft, num_drafts, max_k=K, mode=mode,
                          threshold=0.3)
    out, n = verdict.output, verdict.num_accepted
    ref_out, ref_n = _reference_verdict(reference_rows, logits, draft, num_drafts, K, mode)
    assert out.tolist() == ref_out.tolist() and n.tolist() == ref_n.tolist()
    assert len(set(n.tolist())) > 1  # the batch is not trivially all kept or all rejected
    for a, b in zip(ours_rows, reference_rows):  # each key advanced the same way
        assert mx.array_equal(a.key, b.key).item()
