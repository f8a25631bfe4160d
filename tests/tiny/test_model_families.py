"""The README's list of mlx-lm 0.32.2 families that speculate, and of those
served with plain decoding, checked the way the README says it was: the
start-up check (``cannot_speculate``) on a tiny random-weight model of each
family (``tiny_models.py``), then greedy parity on 8 staggered prompts with
n-gram drafts for the families that speculate.

Speculate: ``gemma4_text`` (sliding-window and full attention, KV-shared
layers, per-layer inputs), ``gpt_oss`` (sliding-window attention with sinks,
experts), ``qwen3_next`` (gated delta net and full attention, experts),
``mamba2`` (Mamba-2 only), ``kimi_linear`` (delta attention and MLA),
``recurrent_gemma`` (RG-LRU blocks and local attention).
Plain: ``nemotron_h`` (its Mamba-2 mixer lets dropped tokens decay the state:
the rollback check on the model fails), ``jamba`` (its mixer takes no mask:
the pass cannot be recorded), ``rwkv7`` (no (x, mask, cache) mixer),
``falcon_h1`` (``CacheList`` layers). ``olmo_hybrid`` is checked in
``test_hybrid_caches.py``.
"""

import pytest
from test_hybrid_caches import _prompts
from test_quantized import _parity, _stop
from test_spec_engine import SOURCE, _run
from tiny_models import build

from mlx_lm_server.assembly import make_scheduler
from mlx_lm_server.decoding.sampling import SamplingParams
from mlx_lm_server.kv import cannot_speculate
from mlx_lm_server.serving.request import GenerationRequest
from mlx_lm_server.spec_decode import make_engine
from mlx_lm_server.spec_decode.config import SpecDecodeConfig

# Layer scales at which each family's greedy output wanders, then loops: n-gram
# drafts are then partly kept and partly refused (drafted / accepted over the
# 8 prompts when chosen: 96/40, 127/64, 163/82, 136/37, 129/68, 134/117).
SPECULATING = {"gemma4_text": 1.0, "gpt_oss": 1.25, "qwen3_next": 1.0, "mamba2": 0.7,
               "kimi_linear": 0.9, "recurrent_gemma": 1.3}
# What the start-up check says about each family it refuses.
PLAIN = {
    "nemotron_h": "a rollback check on the model failed (logits off by",
    "jamba": "a recurrent layer's pass was not recorded",
    "rwkv7": "ArraysCache of a layer without a (x, mask, cache) mixer",
    "falcon_h1": "it cannot roll back CacheList layers",
}


@pytest.fixture(scope="module")
def family_model(tmp_path_factory, smollm2_path):
    """Each family's model and tokenizer, built and loaded once per module."""
    from mlx_lm import load

    root = tmp_path_factory.mktemp("tiny-model-families")
    loaded = {}

    def get(family):
        if family not in loaded:
            path = build(family, root / family, smollm2_path, SPECULATING.get(family, 1.0))
            loaded[family] = load(str(path))
        return loaded[family]

    return get


@pytest.mark.parametrize("family", list(SPECULATING))
def test_the_start_up_check_accepts(family_model, family):
    model, _ = family_model(family)
    assert cannot_speculate(model) == ""


@pytest.mark.parametrize("family", list(PLAIN))
def test_the_start_up_check_refuses_and_the_family_is_served_plainly(family_model, family):
    """The check gives its reason; with n-gram speculation configured there is
    then no engine, and the scheduler decodes a ragged batch plainly."""
    model, tokenizer = family_model(family)
    reason = cannot_speculate(model)
    assert PLAIN[family] in reason, reason
    engine = make_engine(model, SpecDecodeConfig(mode="ngram"), tokenizer, family)
    assert engine is None
    s = make_scheduler(model, tokenizer, max_batch_size=4, engine=engine)
    s.start()
    try:
        prompts = [tokenizer.encode(SOURCE[: 40 + 30 * i]) for i in range(2)]
        done = [d for _, _, d in _run(s, [GenerationRequest(p, 6, SamplingParams(temperature=0))
                                         for p in prompts])]
    finally:
        _stop(s)
    assert all(d.spec_decode is None for d in done)
    assert all(d.completion_tokens == 6 or d.finish_reason == "stop" for d in done)


@pytest.mark.parametrize("family", list(SPECULATING))
def test_greedy_parity_8_staggered_ngram(family_model, family):
    """n-gram speculation (k = 4) gives the plain greedy tokens, and really
    speculated: some drafts kept, some refused (so rollbacks happened)."""
    model, tokenizer = family_model(family)
    identical, usage = _parity(model, tokenizer, dict(mode="ngram", num_speculative_tokens=4),
                               max_tokens=24, prompts=_prompts(tokenizer, 8))
    assert identical == 8  # float32: no near-tie was needed on these weights
    drafted = sum(u["draft_tokens"] for u in usage)
    accepted = sum(u["accepted_tokens"] for u in usage)
    assert 0 < accepted < drafted, (drafted, accepted)
