"""The verification step's own costs and knobs: host transfers, the
positions its processors run at, calibration, the per-request override."""

from dataclasses import dataclass
from typing import Optional

import httpx
import mlx.core as mx
import numpy as np
import pytest
from test_spec_engine import SOURCE, _run, _scheduler

from mlx_lm_server.assembly import make_scheduler
from mlx_lm_server.decoding.sampling import SamplingParams, make_processors, request_key
from mlx_lm_server.serving.request import GenerationRequest
from mlx_lm_server.spec_decode import make_engine
from mlx_lm_server.spec_decode.config import SpecDecodeConfig
from mlx_lm_server.spec_decode.control.costs import k_buckets, padded_k
from mlx_lm_server.spec_decode.control.calibration import calibrate
from mlx_lm_server.spec_decode.control.controller import DynamicSpecController
from mlx_lm_server.spec_decode.drafts import Context
from mlx_lm_server.spec_decode.engine import SpecDecodeEngine
from mlx_lm_server.spec_decode.proposer.ngram import NGramProposer
from mlx_lm_server.spec_decode.target_probs import process_logits
from mlx_lm_server.spec_decode.verifier import verify_rows


def _edit_prompt(tokenizer):
    return tokenizer.encode("Repeat this code exactly:\n" + SOURCE + "\nHere it is:\n" + SOURCE[:80])


class HostTransfers:
    """Records every MLX array converted to a Python or NumPy value."""

    def __init__(self):
        self.shapes = []
        self._saved = {}

    def __enter__(self):
        for name in ("tolist", "item", "__array__"):
            original = getattr(mx.array, name)
            self._saved[name] = original

            def spy(arr, *a, _original=original, **kw):
                self.shapes.append(tuple(arr.shape))
                return _original(arr, *a, **kw)
            setattr(mx.array, name, spy)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(mx.array, name, original)


def test_greedy_verify_step_moves_nothing_vocabulary_sized_to_the_host(smollm2):
    """At temperature 0 a verify step converts only [B, k+1] ids and [B] counts
    (plus the pending tokens when a plain step came before): at most three
    conversions, none with the vocabulary in its shape (steps where a row
    leaves are not counted: upstream's cache filter syncs per layer)."""
    model, tokenizer = smollm2
    V = model.args.vocab_size
    engine = make_engine(model, SpecDecodeConfig(mode="ngram", num_speculative_tokens=6,
                                                 dynamic=False, adaptive_k=False))
    per_step = []
    real_step = engine.speculative_step

    def counted(batch):
        size = len(batch.uids)
        with HostTransfers() as t:
            before = engine.steps.verify_steps
            out = real_step(batch)
        # A row leaving runs upstream's cache filter (one small sync per layer).
        if engine.steps.verify_steps > before and len(batch.uids) == size:
            per_step.append(t.shapes)
        return out

    engine.speculative_step = counted  # installed on the generator at start
    s = make_scheduler(model, tokenizer, engine=engine)
    s.start()
    prompt = _edit_prompt(tokenizer)
    try:
        _run(s, [GenerationRequest(prompt + [i], 48, SamplingParams(temperature=0))
                 for i in range(3)])
    finally:
        s.shutdown()
        s.join(10)
    assert len(per_step) > 3
    for shapes in per_step:
        assert len(shapes) <= 3, shapes
        assert not any(V in shape for shape in shapes), shapes
    # After a verify step the pending tokens are known on the host: two conversions.
    assert min(len(shapes) for shapes in per_step) == 2
    # The [B, K+1] ids: K padded to a bucket, so passes come from a few shapes.
    widths = {shape[1] - 1 for shapes in per_step for shape in shapes if len(shape) == 2}
    assert widths and widths <= set(k_buckets(6)), widths


@dataclass
class _Row:
    params: SamplingParams
    key: Optional[mx.array]


def _prepared_batch():
    """Logits, drafts and rows of a batch mixing penalties, logit bias,
    filters, XTC, seeded and unseeded rows, greedy and sampled."""
    settings = [
        SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.5,
                       frequency_penalty=0.2, logit_bias=((3, 2.0),), seed=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=0.7, repetition_context_size=2),
        SamplingParams(temperature=1.2, top_k=5, logit_bias=((1, -5.0),)),
        SamplingParams(temperature=0.8, xtc_probability=1.0, xtc_threshold=0.05, seed=2),
    ]
    B, K, V = len(settings), 3, 32
    logits = mx.random.normal((B, K + 1, V), key=mx.random.key(0)) * 3
    contexts = [Context([5, 6], 5), Context([1], 1), Context([7, 8, 9], 7), Context([2], 4),
                Context([3], 3)]
    drafts = np.array([[5, 9, 9], [1, 2, 3], [7, 7, 4], [0, -1, -1], [-1, -1, -1]])
    num_drafts = [3, 2, 1, 1, 0]
    rows = [_Row(p, request_key(p, 1)) for p in settings]
    return logits, [make_processors(p) for p in settings], contexts, drafts, num_drafts, rows


def test_processors_run_position_by_position_up_to_each_rows_last_draft():
    """A row with processors has position j processed with its tokens plus
    its first j drafts, as upstream's processors process one position, up to
    its last draft (later positions are never read); rows without processors
    are untouched, and so are the caller's logits."""
    logits, processors, contexts, drafts, num_drafts, _ = _prepared_batch()
    before = np.array(logits)
    out = process_logits(logits, processors, contexts, drafts, num_drafts)
    for i, row_processors in enumerate(processors):
        for j in range(logits.shape[1]):
            expected = logits[i, j][None]
            if j <= num_drafts[i]:
                context = mx.array(contexts[i].tolist() + drafts[i, :j].tolist())
                for p in row_processors:
                    expected = p(context, expected)
            assert mx.array_equal(out[i, j], expected[0]).item(), (i, j)
    assert np.array_equal(np.array(logits), before)
    assert not mx.array_equal(out, logits).item()  # the batch does have processors


@pytest.mark.parametrize("mode", ["lossless", "threshold"])
def test_preparing_a_verdict_moves_nothing_to_the_host(mode):
    """Processors, filters, XTC and every row's draws: preparing p and judging
    by it convert no MLX array to a Python or NumPy value (the step's one
    sync, on [B, K+1] ids and [B] counts, is the engine's)."""
    logits, processors, contexts, drafts, num_drafts, rows = _prepared_batch()
    with HostTransfers() as t:
        processed = process_logits(logits, processors, contexts, drafts, num_drafts)
        verdict = verify_rows(rows, processed, mx.array(drafts), mx.array(num_drafts),
                              mode=mode, max_k=drafts.shape[1], threshold=0.3)
        out, n = verdict.output, verdict.num_accepted
    assert t.shapes == []
    mx.eval(out, n)


def test_key_lengths_come_from_a_few_sizes_per_octave():
    from mlx_lm_server.kv import key_length

    assert [key_length(n) for n in (1, 256, 257, 2048, 2049, 4097, 5000)] == [
        256, 256, 512, 2048, 2560, 5120, 5120]
    # 256-wide to 2,048, then an eighth of the enclosing power of two (four per octave)
    assert len({key_length(n) for n in range(1, 8193)}) == 8 + 4 + 4


def test_a_ragged_pass_attends_over_a_rounded_key_length(smollm2):
    from mlx_lm.models.cache import BatchKVCache

    from mlx_lm_server.kv import key_length, make_rollbackable, rollback

    model, _ = smollm2
    caches = [BatchKVCache([0, 0]) for _ in model.layers]
    model(mx.zeros((2, 300), mx.int32), cache=caches)
    caches = make_rollbackable(caches)
    rollback(caches, [0, 2])  # rows end at 300 and 298
    keys, _ = caches[0].update_and_fetch(mx.zeros((2, 3, 5, 64)), mx.zeros((2, 3, 5, 64)))
    assert keys.shape[2] == key_length(305) == 512
    assert caches[1].make_mask(5).shape[-1] == key_length(305)


def test_draft_lengths_come_from_buckets():
    assert k_buckets(10) == (1, 2, 3, 4, 6, 8, 10)
    assert k_buckets(5) == (1, 2, 3, 4, 5)
    assert [padded_k(k, 10) for k in (1, 5, 7, 9, 10)] == [1, 6, 8, 10, 10]


def test_calibration_times_every_bucket_within_its_budget(smollm2):
    model, _ = smollm2
    figures = calibrate(model, [1, 2], [1, 4], budget_s=60.0, context=32)
    assert sorted(figures) == [1, 2]
    for plain, verify in figures.values():
        assert plain > 0 and sorted(verify) == [1, 4] and all(t > 0 for t in verify.values())
    assert calibrate(model, [1, 2], [1, 4], budget_s=0.0, context=32) == {}


def test_calibration_prices_the_ends_of_every_bucket_before_the_middle(smollm2):
    """A budget that runs out part way leaves every batch bucket with k = 1
    and the largest k (the ends of its cost line) rather than the whole table
    of the first buckets and nothing of the last. The budget's clock is read
    through ``share`` (the ranks' shared reading): here it runs out after six
    readings."""
    model, _ = smollm2
    readings = []

    def share(fn):
        readings.append(fn())
        return len(readings) > 6

    figures = calibrate(model, [1, 2], [1, 2, 4], budget_s=600.0, context=16, share=share)
    assert {B: sorted(v) for B, (_, v) in figures.items()} == {1: [1, 4], 2: [1, 4]}
    full = calibrate(model, [1, 2], [1, 2, 4], budget_s=600.0, context=16)
    assert {B: sorted(v) for B, (_, v) in full.items()} == {1: [1, 2, 4], 2: [1, 2, 4]}


def test_a_bucket_the_calibration_missed_borrows_the_largest_smaller_ones_line():
    """Bucket 16 never calibrated: its costs come from bucket 8's calibrated
    passes relative to bucket 8's calibrated plain pass, not from the flat
    prior (which priced 11 tokens at B=16 like 1.8 plain steps on a CPU
    where they cost 10)."""
    from mlx_lm_server.spec_decode.control.costs import PRIOR_COST_PER_TOKEN, StepCosts

    costs = StepCosts()
    costs.calibrate(2, {1: 0.012, 10: 0.02}, 0.010)
    costs.calibrate(8, {1: 0.15, 10: 0.6}, 0.100)
    costs.observe_plain(16, 0.2)
    assert costs.cost(16, 1) == pytest.approx(1.5)
    assert costs.cost(16, 10) == pytest.approx(6.0)
    assert costs.cost(16, 4) == pytest.approx(1.5 + 3 * 0.5)  # on the line from 1 to 10
    costs.observe_plain(1, 0.01)  # nothing calibrated below bucket 1: the prior
    assert costs.cost(1, 10) == pytest.approx(1.0 + PRIOR_COST_PER_TOKEN * 10)


def test_a_borrowed_line_grows_with_the_rows_where_a_plain_step_does_not():
    """SmolLM2 on a CPU, chat at 16 clients: bucket 4 calibrated (plain 87 ms,
    k=16 256 ms), a real plain step at B=16 95 ms. k=16 drafts add 42 ms a row
    at B=4, so 676 ms at B=16: 8.1 plain steps (the step took 9.2), where
    bucket 4's own 2.9 plain steps priced it cheap enough to verify at."""
    from mlx_lm_server.spec_decode.control.costs import StepCosts

    costs = StepCosts()
    costs.calibrate(4, {1: 0.0975, 16: 0.256}, 0.087)
    for _ in range(3):  # the plain steps a bucket is priced on
        costs.observe_plain(16, 0.095)
    assert costs.cost(16, 16) == pytest.approx(1 + (0.256 - 0.087) / 4 * 16 / 0.095)
    assert 8.0 < costs.cost(16, 16) < 8.2
    # Where a plain step grows with the rows as much, bucket 4's own ratio stands.
    costs.observe_plain(8, 0.174)
    assert costs.cost(8, 16) == pytest.approx(0.256 / 0.087)
    # One probe at k=1 that happened to run under the plain median flattens
    # the line through real steps (1.0 for every k); until a k has a median
    # of three steps of its own, the rows' price stays its floor.
    borrowed = {k: costs.cost(16, k) for k in (1, 16)}
    costs.observe_verify(16, 1, 0.080)
    assert costs.cost(16, 16) == pytest.approx(borrowed[16])
    costs.observe_verify(16, 16, 0.80)  # a k run once, capped by that flat line
    assert costs.cost(16, 16) == pytest.approx(borrowed[16])
    assert costs.cost(16, 1) == pytest.approx(borrowed[1])
    for _ in range(2):
        costs.observe_verify(16, 1, 0.080)
    assert costs.cost(16, 1) == pytest.approx(1.0)  # three steps: their median stands
    # A batch of 9 in bucket 16 pays for its own 9 rows' drafts.
    assert costs.cost(9, 8) < costs.cost(16, 8)


def test_engine_calibration_seeds_the_cost_table(smollm2, caplog):
    model, _ = smollm2
    config = SpecDecodeConfig(mode="ngram", num_speculative_tokens=4, calibration_seconds=60)
    engine = SpecDecodeEngine(model, config, NGramProposer())
    caplog.set_level("INFO", logger="mlx_lm_server.spec_decode")
    engine.calibrate(max_batch_size=2)
    # Buckets 1 and 2, a plain pass and k = 1..4 each: all warmed, the time logged.
    assert "warmed up before serving: 10 of 10 pass shapes compiled and timed in" in caplog.text
    costs = engine.controller.costs
    # Calibrated bare passes price k, but the first real step at a bucket is
    # still plain: costs are relative to a real step.
    assert not costs.has_plain(1) and costs.plain_seconds(1) is None
    costs.observe_plain(1, 0.05)
    calibrated = costs._calibrated_seconds[1]
    assert sorted(calibrated) == [1, 2, 3, 4] and all(v > 0 for v in calibrated.values())
    assert costs.cost(1, 4) == pytest.approx(max(1.0, calibrated[4] / 0.05))
    assert costs.plain_seconds(2) is None and 4 in costs._verify[2]


def test_a_first_of_shape_outlier_does_not_switch_speculation_off():
    """Calibrated costs, then one verification period 30x too slow (a kernel
    compiled on first use) among normal ones: the median ignores it."""
    c = DynamicSpecController(4, alpha=1.0, warmup=1, probe_interval=0)
    c.costs.calibrate(1, {k: 0.010 + 0.001 * k for k in k_buckets(4)})
    for _ in range(3):  # the plain steps a bucket is priced on
        c.observe_plain_step(1, 0.010)
    c.observe_acceptance(1, drafted=4, accepted=4)
    assert c.choose([1]).k == 4
    c.observe_verify_step(1, 4, 0.300)
    d = c.choose([1])
    assert d.k > 0 and c.speculating, d.reason  # other k keep their calibrated cost
    c.observe_verify_step(1, 4, 0.014)
    assert c.choose([1]).k == 4  # two periods: the faster one prices k, not their mean
    c.observe_verify_step(1, 4, 0.014)
    assert c.choose([1]).k == 4  # three: the median
    # A lasting change does win: a window of slow periods switches it off.
    for _ in range(9):
        c.observe_verify_step(1, 4, 0.300)
    assert c.choose([1]).k == 0


def test_per_request_cap_on_drafts(smollm2):
    """A request's own cap: 0 never drafts; 2 drafts at most 2 per step; the
    output stays the greedy one."""
    model, tokenizer = smollm2
    s = _scheduler(model, tokenizer, "ngram", num_speculative_tokens=6, dynamic=False,
                   adaptive_k=False)
    prompt = _edit_prompt(tokenizer)
    try:
        out = {}
        for cap in (None, 0, 2):
            (ids, _, done), = _run(s, [GenerationRequest(
                prompt, 40, SamplingParams(temperature=0), max_draft_tokens=cap)])
            out[cap] = (ids, done.spec_decode)
    finally:
        s.shutdown()
        s.join(10)
    assert out[None][0] == out[0][0] == out[2][0]
    assert out[0][1]["draft_tokens"] == 0
    assert out[None][1]["accepted_tokens"] > 10
    assert out[2][1]["draft_tokens"] > 0
    assert out[2][1]["mean_accepted_length"] <= 3.0  # at most 2 drafts + 1 per step


@pytest.mark.parametrize("value, status", [
    (False, 200), (True, 200), ({"num_speculative_tokens": 3}, 200),
    ({"num_speculative_tokens": 0}, 200), ({"num_speculative_tokens": 7}, 400),
    ({"num_speculative_tokens": -1}, 400), ({"num_speculative_tokens": "4"}, 400),
    ({"k": 3}, 400), ("yes", 400), (3, 400),
])
def test_spec_decode_request_field(spec_server, value, status):
    r = httpx.post(spec_server.url + "/v1/completions", timeout=60, json={
        "model": spec_server.model, "prompt": "one two three one two three", "max_tokens": 4,
        "temperature": 0, "spec_decode": value})
    assert r.status_code == status, r.text
    if status == 400:
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and "spec_decode" in (
            err["message"] + str(err["param"]))
    else:
        assert r.json()["usage"]["completion_tokens"] == 4


@pytest.fixture(scope="module")
def spec_server(smollm2_path):
    from conftest import LiveServer

    server = LiveServer(smollm2_path, max_batch_size=4, spec=SpecDecodeConfig(
        mode="ngram", num_speculative_tokens=6, calibration_seconds=0))
    yield server
    server.close()
