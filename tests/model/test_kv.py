"""Gate test for per-sequence rollback: batched logits equal never-extended references.

Rows of different lengths are extended by a k+1 verification block, rolled
back by different amounts (twice), then continue; every logit must equal a
single-sequence run that only ever saw the kept tokens.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from mlx_lm_server.kv import RaggedKVCache, make_rollbackable, realign, rollback

TOL = 2e-4


def _batched_prefill(model, prompts):
    """Left-pad and prefill like upstream's prompt batch."""
    n = max(len(p) for p in prompts)
    pad = [n - len(p) for p in prompts]
    cache = [BatchKVCache(pad) for _ in model.layers]
    tokens = mx.array([[0] * d + p for d, p in zip(pad, prompts)])
    model(tokens, cache=cache)
    return cache


def _reference_next_logits(model, tokens):
    """Logits after ``tokens`` from a fresh single-sequence cache."""
    cache = make_prompt_cache(model)
    return model(mx.array([tokens]), cache=cache)[0, -1]


@pytest.fixture(scope="module")
def model(smollm2):
    return smollm2[0]


def _run_rounds(model, prompts, rounds, rng):
    """Apply verification blocks and ragged rollbacks; compare each continuation."""
    cache = make_rollbackable(_batched_prefill(model, prompts))
    kept = [list(p) for p in prompts]
    B = len(prompts)
    for k in rounds:
        block = [[int(t) for t in rng.integers(100, 2000, size=k + 1)] for _ in range(B)]
        model(mx.array(block), cache=cache)
        keep = [int(rng.integers(1, k + 2)) for _ in range(B)]  # 1..k+1 entries
        rollback(cache, [k + 1 - n for n in keep])
        for i in range(B):
            kept[i] += block[i][: keep[i]]
        nxt = [int(t) for t in rng.integers(100, 2000, size=B)]
        logits = model(mx.array(nxt)[:, None], cache=cache)[:, -1]
        for i in range(B):
            kept[i].append(nxt[i])
            ref = _reference_next_logits(model, kept[i])
            diff = mx.abs(logits[i] - ref).max().item()
            assert diff < TOL, (i, diff)
    return cache, kept


def test_ragged_rollback_matches_reference(model):
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(100, 2000, size=n)) for n in (20, 35, 7, 28)]
    prompts = [[int(t) for t in p] for p in prompts]
    _run_rounds(model, prompts, rounds=[5, 3, 8], rng=rng)


def test_lowering_offset_alone_would_be_wrong(model):
    """The failure RaggedKVCache exists for: BatchKVCache's mask ignores per-row ends."""
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(100, 2000, size=n)] for n in (20, 35)]
    cache = _batched_prefill(model, prompts)
    block = [[int(t) for t in rng.integers(100, 2000, size=6)] for _ in prompts]
    model(mx.array(block), cache=cache)
    for c in cache:  # keep 3 and 5 entries by lowering offsets only
        c.offset = c.offset - mx.array([3, 1])
    nxt = [11, 12]
    logits = model(mx.array(nxt)[:, None], cache=cache)[:, -1]
    ref = _reference_next_logits(model, prompts[0] + block[0][:3] + [nxt[0]])
    assert mx.abs(logits[0] - ref).max().item() > 0.1


def test_filter_extend_extract_while_ragged(model):
    """Batch membership changes in the ragged state keep every row exact."""
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(100, 2000, size=n)] for n in (12, 30, 21)]
    cache, kept = _run_rounds(model, prompts, rounds=[4], rng=rng)
    assert not cache[0].aligned

    # one sequence leaves
    for c in cache:
        c.filter([0, 2])
    kept = [kept[0], kept[2]]
    # a freshly prefilled one joins
    newcomer = [int(t) for t in rng.integers(100, 2000, size=40)]
    fresh = _batched_prefill(model, [newcomer])
    for c, f in zip(cache, fresh):
        c.extend(f)
    kept.append(newcomer)

    nxt = [101, 102, 103]
    logits = model(mx.array(nxt)[:, None], cache=cache)[:, -1]
    for i in range(3):
        kept[i].append(nxt[i])
        diff = mx.abs(logits[i] - _reference_next_logits(model, kept[i])).max().item()
        assert diff < TOL, (i, diff)

    # extract hands back exactly the kept entries
    single = [c.extract(0) for c in cache]
    assert single[0].offset == len(kept[0])
    out = model(mx.array([[7]]), cache=single)[0, -1]
    ref = _reference_next_logits(model, kept[0] + [7])
    assert mx.abs(out - ref).max().item() < TOL


def test_realigned_rows_decode_through_upstreams_path_and_stay_exact(model):
    """After ragged rollbacks, realigning moves rows to one end: the next
    one-token steps take upstream's aligned path and every logit still equals
    the never-extended reference; a later ragged round still works."""
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(100, 2000, size=n)] for n in (9, 26, 17)]
    cache, kept = _run_rounds(model, prompts, rounds=[6], rng=rng)
    assert not cache[0].aligned
    offsets = cache[0].offset.tolist()
    realign(cache)
    assert all(c.aligned for c in cache) and cache[0].offset.tolist() == offsets
    for step in range(2):
        assert cache[0]._upstream_path(1)
        nxt = [int(t) for t in rng.integers(100, 2000, size=3)]
        logits = model(mx.array(nxt)[:, None], cache=cache)[:, -1]
        for i in range(3):
            kept[i].append(nxt[i])
            diff = mx.abs(logits[i] - _reference_next_logits(model, kept[i])).max().item()
            assert diff < TOL, (step, i, diff)
    block = [[int(t) for t in rng.integers(100, 2000, size=4)] for _ in range(3)]
    model(mx.array(block), cache=cache)
    rollback(cache, [3, 0, 2])
    for i, n in enumerate((1, 4, 2)):
        kept[i] += block[i][:n]
    logits = model(mx.array([[5], [6], [7]]), cache=cache)[:, -1]
    for i, t in enumerate((5, 6, 7)):
        diff = mx.abs(logits[i] - _reference_next_logits(model, kept[i] + [t])).max().item()
        assert diff < TOL, (i, diff)


def test_rollback_refuses_impossible_counts(model):
    cache = make_rollbackable(_batched_prefill(model, [[5, 6, 7], [8, 9]]))
    with pytest.raises(ValueError, match="one count per row"):
        cache[0].rollback([1])
    with pytest.raises(ValueError, match="cannot drop"):
        cache[0].rollback([0, 99])


def test_make_rollbackable_refuses_other_caches(model):
    """Unbatched or unknown kinds are refused (the engine checks kinds at start-up)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    for cache in (KVCache(), QuantizedKVCache()):
        with pytest.raises(TypeError, match=f"cannot roll back a {type(cache).__name__}"):
            make_rollbackable([cache])
    caches = _batched_prefill(model, [[1, 2, 3]])
    assert all(isinstance(c, RaggedKVCache) for c in make_rollbackable(caches))


def test_every_registered_kind_has_the_verbs():
    """A cache kind is one row of ``dispatch.KINDS`` and a class of ours with
    the verbs ``RowCache`` names (``from_batch`` where upstream's batch class
    is not ours): a kind short of one fails here, not at its first pass. One
    row per one-sequence class and per batch class, or a lookup would be
    ambiguous."""
    from mlx_lm_server.kv.dispatch import KINDS, RowCache

    verbs = {n for n in vars(RowCache) if not n.startswith("_")} | set(RowCache.__annotations__)
    assert {"empty_batch", "from_batch", "cannot_roll_back", "rollback", "checked_on_model"} <= verbs
    for kind in KINDS:
        needs = verbs if kind.batch is not kind.rows else verbs - {"from_batch"}
        missing = {v for v in needs if not hasattr(kind.rows, v)}
        assert not missing, (kind.rows.__name__, missing)
    assert len({k.sequence for k in KINDS}) == len({k.batch for k in KINDS}) == len(KINDS)


def test_a_batchs_ragged_layers_share_their_write_positions(model):
    """One scatter index per step for every layer, not one per layer."""
    caches = make_rollbackable(_batched_prefill(model, [[5, 6, 7], [8, 9]]))
    assert len({id(c.positions) for c in caches}) == 1


def test_passes_attend_over_whole_buffers_of_the_rounded_length(model):
    """GPU attention is built per shape and per stride (CUDA: a cuDNN graph
    keyed on both): a multi-token pass must see whole buffers of the rounded
    key length, whatever length upstream's filter or growth left, and a pass
    that follows a pass must reuse them."""
    from mlx_lm_server.kv.ragged import key_length

    cache = _batched_prefill(model, [[5] * 20, [6] * 35])
    for c in cache:
        c.filter([0])  # cuts the common left padding: a 241-long view of a 256 buffer
    c = make_rollbackable(cache)[0]
    assert c.keys.shape[2] == 241
    new = mx.zeros((1, c.keys.shape[1], 5, c.keys.shape[3]), c.keys.dtype)
    keys, values = c.update_and_fetch(new, new)
    assert keys is c.keys and values is c.values
    assert keys.shape[2] == key_length(c.ends[0]) == 256
    buffer = c.keys
    c.rollback([3])
    keys, _ = c.update_and_fetch(new, new)
    assert keys is buffer  # written in place: no second copy

    # Rows left ragged (a scatter writes a new buffer) and realigned before
    # a plain step (a gather does) keep buffers the next pass reuses.
    cache = make_rollbackable(_batched_prefill(model, [[5] * 20, [6] * 35]))
    new = mx.zeros((2, c.keys.shape[1], 5, c.keys.shape[3]), c.keys.dtype)
    for layer in cache:
        layer.update_and_fetch(new, new)
        layer.rollback([3, 1])
        layer.update_and_fetch(new, new)
    c = cache[0]
    assert not c.aligned and c._fitted is c.keys
    realign(cache)
    buffer = c.keys
    keys, _ = c.update_and_fetch(new, new)
    assert keys is buffer
