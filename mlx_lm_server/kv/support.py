"""Which models speculation can roll back, decided once at start-up.

A model whose layers speculation cannot roll back must be served with plain
decoding, never fail per request. Two checks:

- the layer cache kinds: those ``dispatch.KINDS`` registers (plain attention,
  full precision or quantized by ``--kv-bits``, sliding-window attention,
  recurrent ``ArraysCache`` layers) are known, and each kind's
  ``cannot_roll_back`` says whether the model's layers of it can be rolled
  back; anything else (a kind upstream adds later) is not;
- for models with a kind that asks for it (``checked_on_model``: sliding-window
  and recurrent layers), a rollback on the model itself: a ragged two-row
  batch verifies twelve tokens, keeps one and five, and must then predict
  what plain decoding of the kept tokens predicts. This catches a recurrent
  mixer that ignores right padding (the replay relies on it) in any family,
  at the cost of a few short forwards.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from .dispatch import KINDS, batch_caches, layer_kind, make_rollbackable, rollback
from .recurrent import Checkpoint, install_recorders


def unsupported_layers(model) -> list[str]:
    """The model's layer cache kinds that speculation cannot roll back (empty:
    every layer can): kinds ``dispatch.KINDS`` does not name, then what each
    named kind says of the model's layers of its kind."""
    caches = make_prompt_cache(model)
    bad = sorted({type(c).__name__ for c in caches if layer_kind(c) is None})
    for kind in KINDS:
        layers = [c for c in caches if layer_kind(c) is kind]
        reason = kind.rows.cannot_roll_back(model, layers) if layers else ""
        if reason:
            bad.append(reason)
    return bad


def rollback_mismatch(model) -> float:
    """The largest logit difference between a rolled-back ragged batch and
    plain decoding of the kept tokens, relative to the logits' scale (0 for
    a model with only kinds the suite covers: plain attention, quantized or
    not).

    The pass is long (12 tokens) and keeps few (1 and 5): a recurrent layer
    that lets dropped tokens touch its state (a decay applied for each of
    them, say) then drifts well beyond rounding.
    """
    kinds = [layer_kind(c) for c in make_prompt_cache(model)]
    if not any(kind is None or kind.rows.checked_on_model for kind in kinds):
        return 0.0
    install_recorders(model)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17]]
    new = [list(range(20, 32)), list(range(40, 52))]
    keep, probe = [1, 5], [[60], [61]]
    pad = len(prompts[0]) - len(prompts[1])
    caches = batch_caches(model, [0, pad])
    model(mx.array([prompts[0], [0] * pad + prompts[1]]), cache=caches)
    for c in caches:
        c.finalize()
    caches = make_rollbackable(caches)
    with Checkpoint(caches) as checkpoint:
        model(mx.array(new), cache=caches)
    rollback(caches, [len(new[0]) - k for k in keep])
    checkpoint.rollback(keep, len(new[0]))
    got = model(mx.array(probe), cache=caches)[:, -1].astype(mx.float32)
    worst = 0.0
    for i in range(2):
        tokens = prompts[i] + new[i][: keep[i]] + probe[i]
        want = model(mx.array([tokens]), cache=make_prompt_cache(model))[0, -1].astype(mx.float32)
        scale = mx.abs(want).max().item() + 1e-6
        worst = max(worst, mx.abs(got[i] - want).max().item() / scale)
    return worst


def mismatch_limit(model) -> float:
    """Relative logit difference above which a rollback is wrong. A batched
    forward differs from a single-sequence one by rounding only, far less in
    float32 than in half precision; a layer that mishandles dropped tokens is
    off by more (BENCHMARKS.md has the measured figures)."""
    dtype = next((v.dtype for _, v in tree_flatten(model.parameters())
                  if v.dtype in (mx.float32, mx.float16, mx.bfloat16)), mx.float32)
    return 1e-3 if dtype == mx.float32 else 3e-2


def cannot_speculate(model) -> str:
    """Why speculation cannot run on this model ("" if it can). Never raises:
    whatever goes wrong while checking is itself the reason."""
    try:
        bad = unsupported_layers(model)
        if bad:
            return f"it cannot roll back {', '.join(bad)} layers"
        mismatch = rollback_mismatch(model)
    except Exception as e:  # a mixer that cannot be recorded or replayed, ...
        return f"a rollback check on the model failed ({type(e).__name__}: {e})"
    if mismatch > mismatch_limit(model):
        return (f"a rollback check on the model failed (logits off by {mismatch:.1e} of "
                "their scale: a recurrent layer that does not honour right padding?)")
    return ""
