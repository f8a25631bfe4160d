"""Quantized KV caches (``--kv-bits``) that stay batched, on the real SmolLM2.

Rows of a ``BatchQuantizedKVCache`` hold exactly what mlx-lm's one-sequence
``QuantizedKVCache`` holds for the same keys; a batch of quantized rows decodes
what one sequence through upstream's cache decodes; speculation over them
emits what plain decoding emits; and they take a fraction of the memory.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache
from parity import first_difference
from test_spec_engine import _chat, _run

from mlx_lm_server.assembly import make_scheduler
from mlx_lm_server.decoding.sampling import SamplingParams
from mlx_lm_server.kv import make_rollbackable, rollback
from mlx_lm_server.kv.quantized import BatchQuantizedKVCache, QuantizedRowCache, quantize_kv_caches
from mlx_lm_server.kv.support import cannot_speculate
from mlx_lm_server.serving.memory import layer_costs
from mlx_lm_server.serving.prompt_cache import PromptCache
from mlx_lm_server.serving.request import GenerationRequest
from mlx_lm_server.spec_decode import make_engine
from mlx_lm_server.spec_decode.config import SpecDecodeConfig

GREEDY = SamplingParams(temperature=0)
H, D = 2, 64  # heads, head size of the unit tests' keys
# Logits a change of pass shape moves through 8-bit entries. Keys computed
# one token at a time and seven at a time differ in their last float32 bits
# (BLAS sums in another order); an entry that lands on the other side of a
# rounding step of its group moves by a whole step, and the model carries
# that on: on SmolLM2 a top-2 gap moved by 0.37 (by 4.8 at 4 bits, so the
# exactness tests run at 8). Batched and speculative passes change shapes
# just so: the same flip mlx-lm's own quantized cache shows between chunkings.
QUANTIZED_TIE = 1.0


def _keys(n: int, seed: int) -> mx.array:
    return mx.random.normal((1, H, n, D), key=mx.random.key(seed))


def _row_parts(cache, row: int) -> list:
    """Row's (packed, scales, biases) for keys then values, as numpy, and its
    length, as the one-sequence cache ``extract`` gives (the prompt cache keeps it)."""
    one = cache.extract(row)
    return [np.array(p) for p in one.keys + one.values] + [one.offset]


def _reference(chunks: list) -> list:
    """mlx-lm's own one-sequence quantized cache fed ``chunks`` [(keys, values)]."""
    ref = QuantizedKVCache(group_size=64, bits=4)
    for k, v in chunks:
        ref.update_and_fetch(k, v)
    keys, values = ref.keys_and_values() if ref.keys is not None else ((), ())
    return [np.array(p) for p in keys + values] + [ref.offset]


def _same(got: list, want: list):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_rows_hold_what_one_sequence_holds():
    """Merge ragged rows, write, roll rows back by different counts, write
    again, drop a row and add one: each row holds exactly what mlx-lm's
    ``QuantizedKVCache`` holds for the entries it kept."""
    lengths = [5, 9, 2]
    chunks = [[(_keys(n, 10 * i), _keys(n, 10 * i + 1))] for i, n in enumerate(lengths)]
    rows = []
    for row_chunks in chunks:
        c = QuantizedRowCache(64, 4)
        c.update_and_fetch(*row_chunks[0])
        rows.append(c)
    batch = BatchQuantizedKVCache.merge(rows)
    assert batch.ends == [9, 9, 9] and batch.left_padding.tolist() == [4, 0, 7]

    def write(n, seed):
        k = mx.random.normal((3, H, n, D), key=mx.random.key(seed))
        v = mx.random.normal((3, H, n, D), key=mx.random.key(seed + 1))
        batch.update_and_fetch(k, v)
        return [(k[i : i + 1], v[i : i + 1]) for i in range(3)]

    new = write(4, 100)
    batch.rollback([3, 0, 1])  # rows keep 1, 4 and 3 of the 4
    kept = [1, 4, 3]
    for i in range(3):
        k, v = new[i]
        chunks[i].append((k[:, :, : kept[i]], v[:, :, : kept[i]]))
    assert not batch.aligned and batch.offset.tolist() == [6, 13, 5]
    for i, (k, v) in enumerate(write(2, 200)):  # a ragged write: a scatter per row
        chunks[i].append((k, v))
    for i in range(3):
        _same(_row_parts(batch, i), _reference(chunks[i]))

    batch.filter([0, 2])
    other = QuantizedRowCache(64, 4)
    extra = (_keys(3, 300), _keys(3, 301))
    other.update_and_fetch(*extra)
    batch.extend(BatchQuantizedKVCache.merge([other]))
    for i, row_chunks in enumerate([chunks[0], chunks[2], [extra]]):
        _same(_row_parts(batch, i), _reference(row_chunks))
    assert batch.offset.tolist() == [8, 7, 3]


def test_right_padded_prefill_ends_where_each_prompt_ends():
    """Upstream's prefill right-pads ragged prompts, then ``finalize``: each
    row then holds its own prompt only, aligned to the right."""
    batch = BatchQuantizedKVCache([0, 0], 64, 4)
    batch.prepare(lengths=[6, 3], right_padding=[0, 3])
    k, v = mx.random.normal((2, H, 6, D)), mx.random.normal((2, H, 6, D))
    batch.update_and_fetch(k, v)
    batch.finalize()
    assert batch.aligned and batch.offset.tolist() == [6, 3]
    _same(_row_parts(batch, 0), _reference([(k[:1], v[:1])]))
    _same(_row_parts(batch, 1), _reference([(k[1:, :, :3], v[1:, :, :3])]))


def test_upstream_attention_takes_the_quantized_path():
    """mlx-lm sends attention down its quantized path for a cache with ``bits``:
    (packed, scales, biases) in, the dequantized entries' attention out."""
    from mlx_lm.models.base import scaled_dot_product_attention

    batch = BatchQuantizedKVCache([0], 64, 8)
    k, v = mx.random.normal((1, H, 5, D)), mx.random.normal((1, H, 5, D))
    mask = batch.make_mask(5)
    qk, qv = batch.update_and_fetch(k, v)
    q = mx.random.normal((1, H, 5, D))
    dk, dv = (mx.dequantize(*p, group_size=64, bits=8) for p in (qk, qv))
    want = mx.fast.scaled_dot_product_attention(q, dk, dv, scale=D ** -0.5, mask=mask)
    mx.eval(want)  # upstream's quantized path scales the queries in place
    out = scaled_dot_product_attention(q, qk, qv, cache=batch, scale=D ** -0.5, mask=mask)
    assert mx.abs(out - want).max().item() < 1e-4


# ---- on SmolLM2 -----------------------------------------------------------------


@pytest.fixture(scope="module")
def quantized(smollm2_path):
    """A second SmolLM2 whose caches are quantized (its bits set per test)."""
    return load(str(smollm2_path))


def _prompts(tokenizer) -> list:
    texts = ["Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
             "What is the capital of France?",
             "List the numbers from 1 to 20, separated by commas.",
             "Copy this list: apples, pears, plums, apples, pears, plums, apples, pears."]
    return [_chat(tokenizer, t) for t in texts]


def _scheduler(model, tokenizer, mode="none", prompt_cache=None, **kw):
    engine = make_engine(model, SpecDecodeConfig(mode=mode, **kw))
    s = make_scheduler(model, tokenizer, max_batch_size=8, engine=engine, prompt_cache=prompt_cache)
    s.start()
    return s


def _greedy(model, prompt, n) -> list:
    """One sequence, through whatever caches the model makes."""
    cache, out = make_prompt_cache(model), []
    logits = model(mx.array([prompt]), cache=cache)
    for _ in range(n):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)
    return out


def _teacher_forced_agreement(model, prompt, answer) -> float:
    """Share of ``answer``'s tokens that ``model`` also ranks first given the
    same prefix (one pass over prompt + answer)."""
    logits = model(mx.array([prompt + answer]), cache=make_prompt_cache(model))[0]
    picks = mx.argmax(logits[len(prompt) - 1 : -1], axis=-1).tolist()
    return float(np.mean([p == a for p, a in zip(picks, answer)]))


def _assert_same_or_quantized_tie(model, prompt, got, want):
    """Identical, or the first difference is where the model, one sequence
    through the same quantized caches, ranks the two within QUANTIZED_TIE."""
    if got == want:
        return
    i = first_difference(got, want)
    assert i < min(len(got), len(want)), f"one output is a prefix of the other: {got} / {want}"
    logits = model(mx.array([prompt + want[:i]]), cache=make_prompt_cache(model))[0, -1]
    gap = abs(logits[got[i]].item() - logits[want[i]].item())
    assert gap <= QUANTIZED_TIE, f"diverged at token {i} with a gap of {gap:.3g}: not a tie"


def _stop(*schedulers):
    for s in schedulers:
        s.shutdown()
        s.join(10)


def test_batched_rows_decode_what_one_sequence_decodes(quantized):
    """Four requests decoded together through ``BatchQuantizedKVCache`` give
    each what one sequence through mlx-lm's ``QuantizedKVCache`` gives, in
    fewer steps than tokens (one batch)."""
    model, tokenizer = quantized
    quantize_kv_caches(model, 8, 64)
    assert type(make_prompt_cache(model)[0]) is QuantizedRowCache
    prompts = _prompts(tokenizer)
    s = _scheduler(model, tokenizer)
    try:
        results = _run(s, [GenerationRequest(p, 16, GREEDY) for p in prompts])
        total = sum(len(ids) for ids, _, _ in results)
        assert s.steps < total, (s.steps, total)  # rows decoded together
    finally:
        _stop(s)
    # The reference decodes one sequence through upstream's own cache code.
    assert QuantizedRowCache.update_and_fetch is QuantizedKVCache.update_and_fetch
    for p, (ids, _, _) in zip(prompts, results):
        _assert_same_or_quantized_tie(model, p, ids, _greedy(model, p, len(ids)))


def test_agreement_with_full_precision(smollm2, quantized):
    """8 bits: greedy answers as without quantization (identical for at least
    three prompts of four; 97% of tokens teacher-forced). 4 bits: at least 80%
    teacher-forced (measured: BENCHMARKS.md)."""
    plain_model, tokenizer = smollm2
    model, _ = quantized
    prompts = _prompts(tokenizer)
    plain = _scheduler(plain_model, tokenizer)
    try:
        base = [ids for ids, _, _ in _run(plain, [GenerationRequest(p, 16, GREEDY)
                                                  for p in prompts])]
    finally:
        _stop(plain)
    quantize_kv_caches(model, 8, 64)
    s = _scheduler(model, tokenizer)
    try:
        ours = [ids for ids, _, _ in _run(s, [GenerationRequest(p, 16, GREEDY) for p in prompts])]
    finally:
        _stop(s)
    assert sum(a == b for a, b in zip(base, ours)) >= 3, (base, ours)
    for bits, floor in ((8, 0.97), (4, 0.8)):
        quantize_kv_caches(model, bits, 64)
        rate = np.mean([_teacher_forced_agreement(model, p, a) for p, a in zip(prompts, base)])
        print(f"{bits} bits: teacher-forced agreement {rate:.3f}")
        assert rate >= floor, (bits, rate)
    quantize_kv_caches(model, None)
    assert np.mean([_teacher_forced_agreement(model, p, a) for p, a in zip(prompts, base)]) == 1


def test_speculation_over_quantized_rows_is_exact(quantized):
    """n-gram speculation, rolled back per row in the quantized cache, emits
    what plain decoding with the same cache emits; a repeated prompt is taken
    from the prompt cache (quantized rows stored and merged back)."""
    model, tokenizer = quantized
    quantize_kv_caches(model, 8, 64)
    assert cannot_speculate(model) == ""
    prompts = _prompts(tokenizer)
    reqs = [GenerationRequest(p, 24, GREEDY) for p in prompts]
    plain = _scheduler(model, tokenizer)
    spec = _scheduler(model, tokenizer, "ngram", num_speculative_tokens=6, dynamic=False,
                      adaptive_k=False, prompt_cache=PromptCache(8, 1 << 30))
    try:
        base = _run(plain, reqs)
        ours = _run(spec, reqs)
        assert spec.spec_stats.tokens.num_accepted_tokens > 10
        again = _run(spec, reqs[:1])
    finally:
        _stop(plain, spec)
    for p, (a, _, _), (b, _, _) in zip(prompts, base, ours):
        _assert_same_or_quantized_tie(model, p, b, a)
    (ids, _, done), = again
    assert done.cached_tokens > 0 and ids == ours[0][0]


def test_rollback_keeps_logits_exact(smollm2_path):
    """A two-row quantized batch verifies six tokens, keeps two and five, then
    feeds one more: each row's logits are those of its kept tokens alone.

    In float16: float32 matmuls go through OpenBLAS, whose rounding depends on
    the shapes (a batch of two against one row) and the machine's kernels,
    and 8-bit quantization turns a last-bit difference in a key into a whole
    quantization step (0.15 in a logit of 26 on one machine, nothing on
    another). MLX's own float16 kernels compute each row alike in any batch."""
    model, _ = load(str(smollm2_path))
    model.set_dtype(mx.float16)
    quantize_kv_caches(model, 8, 64)
    prompts, new, keep = [list(range(5, 25)), list(range(30, 42))], [list(range(50, 56))] * 2, [2, 5]
    caches = [BatchQuantizedKVCache([0, 8], 64, 8) for _ in make_prompt_cache(model)]
    model(mx.array([prompts[0], [0] * 8 + prompts[1]]), cache=caches)
    caches = make_rollbackable(caches)
    model(mx.array(new), cache=caches)
    rollback(caches, [len(new[0]) - k for k in keep])
    got = model(mx.array([[60], [61]]), cache=caches)[:, -1]
    for i in range(2):
        want = model(mx.array([prompts[i] + new[i][: keep[i]] + [60 + i]]),
                     cache=make_prompt_cache(model))[0, -1]
        assert mx.abs(got[i] - want).max().item() < 1e-3 * mx.abs(want).max().item()


def test_quantized_rows_take_a_fraction_of_the_memory(smollm2, quantized):
    """Bytes per token per layer, as the memory budget measures them: keys and
    values of H heads of size D, packed to ``bits`` with a float32 scale and
    bias per group of 64, against 4 bytes an entry."""
    plain_model, _ = smollm2
    model, _ = quantized
    full = layer_costs(plain_model)[0].per_token
    heads, dim = plain_model.layers[0].self_attn.n_kv_heads, 64
    assert full == 2 * heads * dim * 4
    for bits in (8, 4):
        quantize_kv_caches(model, bits, 64)
        assert layer_costs(model)[0].per_token == 2 * heads * (dim * bits // 8 + 2 * 4)
    quantize_kv_caches(model, None)
    assert type(make_prompt_cache(model)[0]) is KVCache


def test_a_group_size_the_heads_do_not_divide_is_refused(quantized):
    model, _ = quantized
    with pytest.raises(ValueError, match="--kv-group-size"):
        quantize_kv_caches(model, 4, 128)
    quantize_kv_caches(model, None)
