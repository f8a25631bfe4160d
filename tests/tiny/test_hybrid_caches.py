"""Speculation on sliding-window and recurrent (linear-attention) model families.

Tiny random-weight ``gemma3_text`` (``RotatingKVCache``, window 16),
``qwen3_5`` (gated delta net), ``lfm2`` (short convolutions) and
``granitemoehybrid`` (Mamba-2), the last three ``ArraysCache``, built with
mlx-lm's own classes (``tiny_models.py``).
Checked: rollback leaves each row's layers exactly as plain decoding of its
kept tokens would; greedy output equals plain decoding with n-gram and draft
proposers; sampled output keeps the exact distribution; a layer kind that
cannot roll back is refused at start-up. Through the server, and
``olmo_hybrid``, which cannot speculate: ``test_hybrid_caches_server.py``.
"""

import itertools
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from test_quantized import _parity, _stop
from test_spec_engine import SOURCE, _run
from tiny_models import build

from mlx_lm_server.assembly import make_scheduler
from mlx_lm_server.decoding.sampling import SamplingParams
from mlx_lm_server.kv import (
    Checkpoint,
    batch_caches,
    install_recorders,
    make_rollbackable,
    rollback,
)
from mlx_lm_server.kv.support import rollback_mismatch, unsupported_layers
from mlx_lm_server.serving.request import GenerationRequest
from mlx_lm_server.spec_decode import make_engine
from mlx_lm_server.spec_decode.config import SpecDecodeConfig

# Layer scales at which each family's greedy output wanders, then loops: n-gram
# drafts are then partly kept and partly refused.
FAMILIES = {"gemma3_text": 0.5, "qwen3_5": 1.0, "lfm2": 1.0, "granitemoehybrid": 1.0}
# A draft for each target: another family, so that drafts are often refused.
DRAFT_FOR = {"gemma3_text": "qwen3_5", "qwen3_5": "lfm2", "lfm2": "granitemoehybrid",
             "granitemoehybrid": "lfm2"}


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory, smollm2_path) -> dict:
    root = tmp_path_factory.mktemp("tiny-families")
    return {f: build(f, root / f, smollm2_path, scale) for f, scale in FAMILIES.items()}


@pytest.fixture(scope="module")
def tiny_models(tiny_paths) -> dict:
    from mlx_lm import load

    return {f: load(str(p)) for f, p in tiny_paths.items()}


# ---- rollback equals plain decoding of the kept tokens ------------------------


def _logits_after(model, tokens):
    """Next-token logits of one sequence, decoded plainly with upstream's own caches."""
    cache = make_prompt_cache(model)
    return model(mx.array([tokens]), cache=cache)[0, -1]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rollback_leaves_each_row_as_plain_decoding_of_its_kept_tokens(tiny_models, family):
    """A ragged, left-padded batch goes through twelve verify passes of 4 tokens,
    each row keeping 1..4 of them in every combination across rows (windows of
    16 wrap several times); after each rollback, one more multi-token pass and
    one single-token pass per row give the logits that plain decoding of that
    row's kept tokens gives."""
    model, _ = tiny_models[family]
    install_recorders(model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 5000, n).tolist() for n in (21, 9, 14)]
    width = max(map(len, prompts))
    caches = batch_caches(model, [width - len(p) for p in prompts])
    model(mx.array([[0] * (width - len(p)) + p for p in prompts]), cache=caches)
    for c in caches:
        c.finalize()
    caches = make_rollbackable(caches)
    histories = [list(p) for p in prompts]
    keeps = list(itertools.product(range(1, 5), repeat=3))
    rng.shuffle(keeps)
    for keep in keeps[:12] + [(4, 4, 4)]:
        new = rng.integers(100, 5000, (3, 4))
        with Checkpoint(caches) as checkpoint:
            model(mx.array(new), cache=caches)
        rollback(caches, [4 - k for k in keep])
        checkpoint.rollback(list(keep), 4)
        for h, row, k in zip(histories, new.tolist(), keep):
            h.extend(row[:k])
    # Two more tokens per row: a two-token pass (ragged rows) then one token.
    probe = rng.integers(100, 5000, (3, 3))
    two = model(mx.array(probe[:, :2]), cache=caches)
    one = model(mx.array(probe[:, 2:]), cache=caches)
    for i, h in enumerate(histories):
        want2 = _logits_after(model, h + probe[i, :2].tolist())
        want1 = _logits_after(model, h + probe[i].tolist())
        assert mx.abs(two[i, -1] - want2).max().item() < 1e-4, (family, i)
        assert mx.abs(one[i, -1] - want1).max().item() < 1e-4, (family, i)


def test_a_rollback_that_is_skipped_is_caught(tiny_models):
    """The test above fails when the recurrent rollback is left out."""
    model, _ = tiny_models["qwen3_5"]
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    caches = make_rollbackable(batch_caches(model, [0, 0]))
    model(mx.array(prompts), cache=caches)
    new = [[20, 21, 22, 23], [30, 31, 32, 33]]
    model(mx.array(new), cache=caches)
    rollback(caches, [2, 2])  # attention only: the recurrent states keep all four
    got = model(mx.array([[40], [41]]), cache=caches)[:, -1]
    want = _logits_after(model, prompts[0] + new[0][:2] + [40])
    assert mx.abs(got[0] - want).max().item() > 1e-3


# ---- through the engine --------------------------------------------------------


def _prompts(tokenizer, n=16):
    base = "Repeat this code exactly:\n" + SOURCE + "\nHere it is:\n"
    return [tokenizer.encode(base + SOURCE[: 10 + 7 * i]) for i in range(n)]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_greedy_parity_16_staggered(tiny_models, tiny_paths, family, mode):
    model, tokenizer = tiny_models[family]
    spec = dict(mode=mode, num_speculative_tokens=4)
    if mode == "draft":
        spec["draft_model_path"] = str(tiny_paths[DRAFT_FOR[family]])
    identical, usage = _parity(model, tokenizer, spec, max_tokens=40,
                               prompts=_prompts(tokenizer))
    assert identical == 16  # float32: no near-tie was needed on these weights
    drafted = sum(u["draft_tokens"] for u in usage)
    accepted = sum(u["accepted_tokens"] for u in usage)
    assert 0 < accepted < drafted, (drafted, accepted)


def _exact_distribution(model, prompt, num_tokens, top_k, temperature,
                        logits_after=_logits_after):
    """P(t_1..t_n) after temperature and top-k, from plain forwards of the
    model (``logits_after(model, tokens)``: the next-token logits)."""

    def dist(tokens):
        logits = logits_after(model, tokens).astype(mx.float32) / temperature
        lp = np.asarray(logits - mx.logsumexp(logits))
        top = np.argsort(-lp)[:top_k]
        w = np.exp(lp[top] - lp[top].max())
        return dict(zip(top.tolist(), (w / w.sum()).tolist()))

    out = {(): 1.0}
    for _ in range(num_tokens):
        out = {seq + (t,): p * q for seq, p in out.items() for t, q in dist(list(prompt) + list(seq)).items()}
    return out


def test_sampled_tokens_keep_the_exact_distribution_on_a_hybrid(tmp_path, smollm2_path):
    """qwen3_5 drafted for by lfm2 (a draft is made at every step, and often
    refused), temperature 1.5, top_k 2: joint frequencies of three tokens over
    800 seeded requests against the exact distribution. Whenever the draft
    for the second token is refused, the third is drawn from recurrent states
    rolled back past it. Bound: TV below 0.09 over 8 outcomes (sampling error
    alone about 0.045; 0.45 with the target's rollback left out). Both over
    the tokenizer's first 2,048 tokens."""
    from mlx_lm import load

    paths = {f: build(f, tmp_path / f, smollm2_path, FAMILIES[f], vocab=2048)
             for f in ("qwen3_5", "lfm2")}
    model, tokenizer = load(str(paths["qwen3_5"]))
    config = SpecDecodeConfig(mode="draft", draft_model_path=str(paths["lfm2"]),
                              num_speculative_tokens=4, dynamic=False, adaptive_k=False)
    s = make_scheduler(model, tokenizer, max_batch_size=32, max_queued_requests=1024,
                  engine=make_engine(model, config, tokenizer, "target"))
    s.start()
    prompt = tokenizer.encode("one two three one two three one two three one two")
    params = dict(temperature=1.5, top_k=2)
    exact = _exact_distribution(model, prompt, 3, 2, 1.5)
    try:
        n = 800
        reqs = [GenerationRequest(prompt, 3, SamplingParams(seed=i, **params)) for i in range(n)]
        counts = {}
        for ids, _, _ in _run(s, reqs):
            counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
        drafts, accepted = s.spec_stats.tokens.num_draft_tokens, s.spec_stats.tokens.num_accepted_tokens
    finally:
        _stop(s)
    assert drafts >= n and accepted < drafts // 2, (drafts, accepted)  # mostly refused
    keys = set(exact) | set(counts)
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in keys)
    assert tv < 0.09, (tv, counts, exact)
    assert math.isclose(sum(exact.values()), 1.0, rel_tol=1e-5)


# ---- what cannot roll back is found at start-up -----------------------------------


def test_a_layer_kind_that_cannot_roll_back_means_plain_decoding(tiny_models, caplog):
    """A model with a cache kind speculation does not know (here a quantized KV
    cache, as a later upstream layer type would be) is served without
    speculation, said in one warning, instead of failing every request."""
    from mlx_lm.models.cache import QuantizedKVCache

    model, tokenizer = tiny_models["qwen3_5"]
    assert unsupported_layers(model) == []

    class Unknown(type(model)):
        def make_cache(self):
            return [QuantizedKVCache() for _ in self.layers]

    model.__class__ = Unknown
    try:
        assert unsupported_layers(model) == ["QuantizedKVCache"]
        with caplog.at_level("WARNING", logger="mlx_lm_server.spec_decode"):
            engine = make_engine(model, SpecDecodeConfig(mode="ngram"), tokenizer, "tiny")
    finally:
        model.__class__ = Unknown.__mro__[1]
    assert engine is None
    assert [r.message for r in caplog.records if "plain decoding" in r.message]


def test_a_window_that_keeps_its_first_tokens_cannot_roll_back(tiny_models):
    """Rings hold each row's last positions only: a sliding window that also
    keeps its first tokens (``keep``) is refused at start-up, a plain one is
    not (the window kind's ``cannot_roll_back``)."""
    from mlx_lm.models.cache import RotatingKVCache

    model = tiny_models["gemma3_text"][0]
    try:
        model.make_cache = lambda: [RotatingKVCache(8, keep=4) for _ in model.layers]
        assert unsupported_layers(model) == ["RotatingKVCache with kept tokens"]
        model.make_cache = lambda: [RotatingKVCache(8) for _ in model.layers]
        assert unsupported_layers(model) == []
    finally:
        del model.make_cache


def test_the_check_never_raises(tiny_models, monkeypatch):
    """A mixer that cannot be replayed (jamba's takes no mask) is a reason
    to decode plainly, not an exception at start-up."""
    from mlx_lm_server.kv import cannot_speculate, recurrent

    def fail(self, keep, n):
        raise RuntimeError("a recurrent layer's pass was not recorded")

    monkeypatch.setattr(recurrent.Checkpoint, "rollback", fail)
    assert "RuntimeError" in cannot_speculate(tiny_models["qwen3_5"][0])


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_5"])
def test_a_draft_model_rolls_back_to_the_drafts_it_kept(tiny_models, family):
    """After verification keeps a different number of drafts per row, the
    draft's next drafts equal those of a fresh draft that prefilled each row's
    kept context from scratch (greedy drafts are a function of the state)."""
    from mlx_lm_server.spec_decode.proposer.draft_model import DraftModelProposer

    model, tokenizer = tiny_models[family]
    contexts = [p[:40 + 5 * i] for i, p in enumerate(_prompts(tokenizer, 3))]
    used = DraftModelProposer(model)
    for uid, c in enumerate(contexts):
        used.add_sequence(uid, len(c))
    proposal = used.propose([0, 1, 2], contexts, [4, 4, 4])
    accepted = [0, 2, 4]
    used.observe_verification([0, 1, 2], accepted)
    # The target kept the accepted drafts and a different next token (pending).
    kept = [c + proposal.draft_tokens[i, :n].tolist() + [7 + i]
            for i, (c, n) in enumerate(zip(contexts, accepted))]
    again = used.propose([0, 1, 2], kept, [4, 4, 4])
    fresh = DraftModelProposer(model)
    for uid, c in enumerate(kept):
        fresh.add_sequence(uid, len(c))
    want = fresh.propose([0, 1, 2], kept, [4, 4, 4])
    assert (again.draft_tokens == want.draft_tokens).all(), (again.draft_tokens, want.draft_tokens)


def test_the_start_up_rollback_check_passes_here_and_catches_a_broken_replay(tiny_models,
                                                                            monkeypatch):
    """Each family passes the start-up check; a recurrent mixer that ignores
    right padding (as one without upstream's padding support would) replays
    every token, leaving the state after all of them, and fails it."""
    from mlx_lm_server.kv import recurrent
    from mlx_lm_server.kv.support import mismatch_limit

    for family, (model, _) in tiny_models.items():
        assert rollback_mismatch(model) < 1e-4, family
    model, _ = tiny_models["qwen3_5"]
    monkeypatch.setattr(recurrent.Checkpoint, "rollback", lambda self, keep, n: None)
    assert rollback_mismatch(model) > mismatch_limit(model)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_follow_up_reuses_the_prompt_cache_on_each_family(tiny_models, family):
    """The next turn starts from the first turn's cached layers (recurrent
    states and rings included, reached as a shorter prefix: those layers
    cannot be trimmed) and speculates to the same text as without a cache."""
    from test_prompt_cache import _scheduler
    from test_prompt_cache import _stop as stop

    model, tokenizer = tiny_models[family]
    cached, fresh = _scheduler(model, tokenizer, "ngram"), \
        _scheduler(model, tokenizer, "ngram", cache=False)
    greedy = SamplingParams(temperature=0)
    first = tokenizer.encode("Repeat: " + SOURCE[:200])
    try:
        (reply, _, _), = _run(cached, [GenerationRequest(first, 16, greedy)])
        second = first + reply + tokenizer.encode(" and again: " + SOURCE[:50])
        (got, _, done), = _run(cached, [GenerationRequest(second, 16, greedy)])
        (want, _, _), = _run(fresh, [GenerationRequest(second, 16, greedy)])
    finally:
        stop(cached)
        stop(fresh)
    assert done.cached_tokens == len(first) + len(reply)
    assert got == want
