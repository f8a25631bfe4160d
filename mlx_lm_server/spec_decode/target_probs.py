"""The target's side of a verification pass: p, and the random draws that judge drafts by it.

``verifier.py`` judges drafts against p, the distribution each row samples
from at each position of the pass over ``[pending, d_1..d_k]``. This module
makes p from the pass's logits (``[B, k + 1, V]``), as the row's own
sampler would at each position:

- the row's logits processors (penalties, logit bias; grammars apart, see
  ``grammar.py``), with the context grown by the drafts before the position;
- the row's sampling filters (temperature, top-p, min-p, top-k, XTC), rows
  that filter alike together (``sampling_logits``, the plain sampler's own);
- the row's random draws (acceptance uniforms, Gumbel noise, XTC's draw),
  from its own key when it has a seed, so that its randomness depends on
  nothing else in the batch.

Everything vocabulary-sized stays on the device, lazy: the host handles
row indices, keys and the contexts of rows with processors, never logits.
Rows without processors are not looped over. A row with processors is the
one loop per position: processors are opaque ``(tokens, logits) -> logits``
callables (upstream's), and position j must see its own context, the row's
tokens plus the j drafts before it (a repetition penalty counts them). Its
positions past its last draft are left as they are: no verdict, logprob or
pending token reads them.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import mlx.core as mx

from ..decoding.sampling import sampling_logits


def log_softmax(logits: mx.array) -> mx.array:
    """Log-probabilities in float32 (sampling filters and probabilities need the precision)."""
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def process_logits(
    logits: mx.array,  # [B, K+1, V]
    processors_of: list,  # [B] lists of (tokens, logits) -> logits
    contexts: list,  # [B] each row's tokens so far, pending token included (``.tolist()``)
    drafts,  # [B, K] numpy int
    num_drafts: Optional[list] = None,  # [B]; None: every position
) -> mx.array:
    """Logits after each row's logits processors, position j seeing the row's
    context plus its first j drafts (see the module docstring). Normalising is
    left to the rows and positions that need it (sampled rows, asked-for
    logprobs): at temperature 0 nothing vocabulary-sized is computed beyond
    the argmax."""
    rows = [i for i, processors in enumerate(processors_of) if processors]
    if not rows:
        return logits
    K = logits.shape[1] - 1
    processed = [_process_row(logits[i], processors_of[i], contexts[i].tolist(),
                              drafts[i, :K if num_drafts is None else num_drafts[i]].tolist())
                 for i in rows]
    out = mx.array(logits)  # its own handle: the caller's logits stay unprocessed
    out[mx.array(rows)] = mx.stack(processed)
    return out


def _process_row(logits: mx.array, processors: list, context: list, drafts: list) -> mx.array:
    """[K+1, V] one row's logits, positions 0..len(drafts) processed."""
    tokens = mx.array(context + drafts, dtype=mx.int32)  # one host copy per row
    positions = []
    for j in range(len(drafts) + 1):
        row = logits[j : j + 1]
        for p in processors:
            row = p(tokens[: len(context) + j], row)  # the context grows by one draft a position
        positions.append(row)
    if len(drafts) + 1 < logits.shape[0]:
        positions.append(logits[len(drafts) + 1 :])
    return mx.concatenate(positions)


# ---- random draws ------------------------------------------------------------

_DISTRIBUTIONS = {"uniform": mx.random.uniform, "gumbel": mx.random.gumbel}


def draw_noise(keys: list, draws: list[tuple[str, tuple]]) -> tuple[list[mx.array], list]:
    """For each ``(distribution, shape)`` in ``draws``, one draw per row, stacked:
    ``[R, *shape]``.

    A row with a key (a request with a ``seed``) splits it once per draw, so
    its randomness depends on nothing else in the batch; all such rows draw
    at once (``vmap``: the numbers one row at a time would give). The rows
    without one draw together from MLX's global generator. Returns the draws
    and the rows' new keys.
    """
    seeded = [i for i, key in enumerate(keys) if key is not None]
    free = [i for i, key in enumerate(keys) if key is None]
    parts, new_keys = [], list(keys)
    if seeded:
        next_keys, *out = mx.vmap(partial(_split_and_draw, draws))(
            mx.stack([keys[i] for i in seeded]))
        for n, i in enumerate(seeded):
            new_keys[i] = next_keys[n]
        parts.append((seeded, out))
    if free:
        parts.append((free, [_DISTRIBUTIONS[d](shape=(len(free), *shape)) for d, shape in draws]))
    return [in_row_order([(rows, out[j]) for rows, out in parts]) for j in range(len(draws))], \
        new_keys


def _split_and_draw(draws: list, key: mx.array) -> tuple:
    out = []
    for distribution, shape in draws:
        key, sub = mx.random.split(key)
        out.append(_DISTRIBUTIONS[distribution](shape=shape, key=sub))
    return (key, *out)


def row_noise(rows: list, draws: list) -> list:
    """Random draws for these rows (each with its ``key``; see ``draw_noise``),
    advancing their keys."""
    out, keys = draw_noise([r.key for r in rows], draws)
    for r, key in zip(rows, keys):
        r.key = key
    return out


def xtc_draws(rows: list, indices: list) -> dict:
    """Row index -> the XTC row's draw for the one token it samples this step
    (such rows never have drafts, so only their first position is used);
    every XTC row draws at once."""
    xtc = [i for i in indices if rows[i].params.xtc_probability > 0]
    if not xtc:
        return {}
    (u,) = row_noise([rows[i] for i in xtc], [("uniform", (1,))])  # [R, 1]
    return {i: u[n, 0] for n, i in enumerate(xtc)}


def in_row_order(parts: list[tuple[list, mx.array]]) -> mx.array:
    """Arrays computed for groups of rows (``(row indices, [len, ...])``),
    stacked back in the order of the indices."""
    if len(parts) == 1:
        return parts[0][1]
    order = [i for rows, _ in parts for i in rows]
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return mx.concatenate([a for _, a in parts])[mx.array(inverse)]


# ---- p for the rows that sample ---------------------------------------------


def sampled_logits(rows: list, indices: list, logits: mx.array, xtc: dict) -> mx.array:
    """[R, K+1, V] the logits rows ``indices`` sample from (``sampling_logits``
    after ``log_softmax``). Rows that filter alike (temperature, top-p,
    min-p, top-k) go through the filters together; an XTC row, with its own
    draw, alone."""
    groups: dict = {}
    for i in indices:
        p = rows[i].params
        alike = ("xtc", i) if p.xtc_probability > 0 else (p.temperature, p.top_p, p.min_p,
                                                             p.top_k)
        groups.setdefault(alike, []).append(i)
    parts = []
    for members in groups.values():
        rows_logits = logits if members == list(range(logits.shape[0])) \
            else logits[mx.array(members)]
        parts.append((members, sampling_logits(rows[members[0]].params, log_softmax(rows_logits),
                                               xtc.get(members[0]))))
    order = {i: n for n, i in enumerate(indices)}
    return in_row_order([([order[i] for i in members], a) for members, a in parts])


def sampled_targets(rows: list, sampled: list, logits: mx.array,
                    max_k: int) -> tuple[mx.array, mx.array, mx.array]:
    """What rejection sampling needs of rows ``sampled``: ``(p [R, K+1, V],
    uniforms [R, K], gumbels [R, V])``. ``max_k`` fixes the shape of a row's
    draws (the most drafts a step can have), so a seeded row's randomness
    does not depend on its batch."""
    K1, V = logits.shape[1:]
    probs = mx.softmax(sampled_logits(rows, sampled, logits, xtc_draws(rows, sampled)), axis=-1)
    uniforms, gumbels = row_noise([rows[i] for i in sampled],
                                  [("uniform", (max_k,)), ("gumbel", (V,))])
    return probs, uniforms[:, : K1 - 1], gumbels


def threshold_targets(rows: list, logits: mx.array, greedy_ids: mx.array,
                      max_k: int) -> tuple[mx.array, mx.array]:
    """What the lossy threshold rule needs: ``(target_ids [B, K+1], p [B, K+1, V])``.
    Greedy rows judge by the target's softmax and emit its argmax; sampled
    rows judge by their sampling distribution and emit a draw from it."""
    K1, V = logits.shape[1:]
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    plain = [i for i, row in enumerate(rows) if row.params.greedy]
    parts_ids, parts_probs = [], []
    if plain:
        idx = mx.array(plain)
        parts_ids.append((plain, greedy_ids[idx]))
        parts_probs.append((plain, mx.softmax(logits[idx].astype(mx.float32), axis=-1)))
    if sampled:
        row_logits = sampled_logits(rows, sampled, logits, xtc_draws(rows, sampled))
        (g,) = row_noise([rows[i] for i in sampled], [("gumbel", (max_k + 1, V))])
        parts_ids.append((sampled, mx.argmax(row_logits + g[:, :K1], axis=-1).astype(mx.int32)))
        parts_probs.append((sampled, mx.softmax(row_logits, axis=-1)))
    return in_row_order(parts_ids), in_row_order(parts_probs)
