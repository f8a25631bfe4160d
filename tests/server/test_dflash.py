"""``--spec-decode dflash``: a DFlash block drafter (``heads/dflash.py``,
``proposer/dflash.py``) drafts K tokens per pass for SmolLM2-135M under
continuous batching.

The drafter's numbers are checked against mlx-vlm 0.7.10's
``DFlashDraftModel`` (its wheel, as in ``test_mtp_head.py``) on a random
checkpoint reading SmolLM2's layers 1, 14 and 26; the path through the
engine by the output (the plain model's, token for token), by the
drafter's cache (always a fresh pass over the target's states: it never
holds a draft), and by the distribution of sampled tokens, with a
"silent" drafter whose layers add nothing, so that its drafts (the mask
token's nearest embeddings) are kept now and then.
"""

import json
import math

import mlx.core as mx
import pytest
from test_mtp_head import mlx_vlm  # noqa: F401  (puts the reference on sys.path)
from test_mtp_proposer import _greedy, _scheduler, _stop
from test_spec_engine import _chat, _run
from tiny_models import build, build_dflash

from mlx_lm_server.decoding.sampling import SamplingParams
from mlx_lm_server.runtime import mlx_lm_adapter
from mlx_lm_server.serving.request import GenerationRequest
from mlx_lm_server.spec_decode.config import SpecDecodeConfig
from mlx_lm_server.spec_decode.heads.dflash import load_dflash_head
from mlx_lm_server.spec_decode.proposer.dflash import DFlashProposer

LAYERS = [1, 14, 26]
PROMPT = [5, 17, 99, 3, 42, 7, 200, 11, 64, 9, 301, 12, 8]
TEXTS = ["Write a haiku about rain.", "What is 2 + 2?", "Name three colours.",
         "def add(a, b):", "Say hello in French.", "List the days of the week."]


@pytest.fixture(scope="module")
def target_config(smollm2_path):
    return json.loads((smollm2_path / "config.json").read_text())


@pytest.fixture(scope="module")
def head_path(tmp_path_factory, target_config):
    return build_dflash(tmp_path_factory.mktemp("dflash"), target_config, LAYERS,
                        mask_token_id=2, seed=4)


def _features(model, tokens, layers=LAYERS):
    """The outputs of the listed decoder layers over ``tokens``, concatenated
    [1, T, 3H], by hand."""
    inner = mlx_lm_adapter.text_model(model).model
    h = inner.embed_tokens(mx.array([tokens]))
    outs = []
    for i, layer in enumerate(inner.layers):
        h = layer(h, "causal", None)
        if i in layers:
            outs.append(h)
    return mx.concatenate(outs, axis=-1)


@pytest.mark.parametrize("unfused", [False, True])
def test_the_drafter_matches_mlx_vlms(mlx_vlm, smollm2, head_path, monkeypatch,  # noqa: F811
                                      unfused):
    """A block after the prompt's context, then a block after three more
    target states: the logits at every block position agree with mlx-vlm's
    ``DFlashDraftModel`` bound to the same target (float32, 1e-4); with the
    block's attention from matmuls too (what CUDA runs: ``kv/unfused.py``)."""
    from mlx_vlm.speculative.drafters.qwen3_dflash import DFlashDraftModel, ModelConfig

    from mlx_lm_server.spec_decode.heads import dflash

    monkeypatch.setattr(dflash, "UNFUSED", unfused)

    model, _ = smollm2
    config = json.loads((head_path / "config.json").read_text())
    reference = DFlashDraftModel(ModelConfig.from_dict(config))
    reference.load_weights(list(mx.load(str(head_path / "model.safetensors")).items()))
    reference.bind(model)
    head, layers, embed = load_dflash_head(model, str(head_path))
    assert layers == LAYERS and embed is None
    embed = mlx_lm_adapter.token_embedding(model)
    project = mlx_lm_adapter.output_projection(model)

    features = _features(model, PROMPT)
    ours_cache, theirs_cache = head.make_cache(), reference.make_cache()
    worst = 0.0
    for start, stop in ((0, 10), (10, 13)):
        block = mx.array([[PROMPT[stop - 1] + 1] + [head.mask_token_id] * 7])
        theirs = reference(block, features[:, start:stop], theirs_cache)
        head.context(features[:, start:stop], ours_cache)
        ours = project(head.block(embed(block), ours_cache))
        for c in ours_cache:
            c.trim(block.shape[1])
        worst = max(worst, mx.abs(ours - theirs).max().item())
        assert mx.array_equal(ours[0, 1:].argmax(-1), theirs[0, 1:].argmax(-1)).item()
    assert worst <= 1e-4, worst


@pytest.mark.parametrize("batch,stagger", [(1, 0.0), (6, 0.1)])
def test_greedy_output_is_the_targets(smollm2, head_path, batch, stagger):
    model, tokenizer = smollm2
    prompts = [_chat(tokenizer, t) for t in TEXTS[:batch]]
    plain, _ = _greedy(model, tokenizer, head_path, "none", prompts, stagger, 24)
    ours, counts = _greedy(model, tokenizer, "target", "dflash", prompts, stagger, 24,
                           draft_model_path=str(head_path))
    assert ours == plain
    assert counts.num_draft_tokens > 20 * batch, counts


class CheckedDFlash(DFlashProposer):
    """Before every proposal, each row's cache (first and last layer)
    against a fresh context pass over the target's states of the positions
    it holds; records (never raises: the engine would take an exception for
    a failed proposal) the worst difference, and the widest held feed."""

    def __init__(self, model, head, layers):
        super().__init__(head, mlx_lm_adapter.token_embedding(model),
                         mlx_lm_adapter.output_projection(model), layers)
        self.model = model
        self.checked, self.worst, self.widest = 0, 0.0, 0
        self.problems, self.firsts = [], set()

    def _feed_held(self, rows, pairs):
        self.widest = max(self.widest, max(h.shape[0] for h, _ in pairs))
        return super()._feed_held(rows, pairs)

    def propose(self, uids, contexts, k):
        for row, uid in enumerate(self.uids):
            context = contexts[list(uids).index(uid)].tolist()
            ends, pad = self.cache[0].ends[row], int(self.cache[0].left_padding[row].item())
            last = len(context) - 2 - self.waiting_len[uid]  # the last position held
            first = last - (ends - pad) + 1
            self.firsts.add(first)
            fresh = self.head.make_cache()
            self.head.context(_features(self.model, context[:-1])[:, first:last + 1], fresh)
            for layer in (0, -1):
                cache = self.cache[layer]
                keys = cache.keys[row:row + 1, :, pad:ends]
                expected = fresh[layer].keys[..., :fresh[layer].offset, :]
                if keys.shape != expected.shape:
                    self.problems.append((uid, keys.shape, expected.shape))
                    break
                self.worst = max(self.worst, mx.abs(keys - expected).max().item())
            self.checked += 1
        return super().propose(uids, contexts, k)


def test_the_drafters_cache_holds_only_the_targets_states(smollm2, head_path):
    """``ngram,dflash`` on prompts that copy: lookup drafts are kept, so
    several target states come back at once; rows join and leave. The
    cache always equals a fresh context pass over the target's states from
    each row's first prompt token, never a block's entries."""
    from mlx_lm_server.assembly import make_scheduler
    from mlx_lm_server.spec_decode.engine import SpecDecodeEngine
    from mlx_lm_server.spec_decode.proposer.per_row import PerRowProposer
    from mlx_lm_server.spec_decode.proposer.ngram import NGramProposer

    model, tokenizer = smollm2
    head, layers, _ = load_dflash_head(model, str(head_path))
    checked = CheckedDFlash(model, head, layers)
    proposer = PerRowProposer(NGramProposer(1, 4, True), checked, "ngram", model_name="dflash")
    config = SpecDecodeConfig(mode="ngram,dflash", draft_model_path=str(head_path),
                              num_speculative_tokens=3, dynamic=False, adaptive_k=False,
                              calibration_seconds=0)
    copy = "Repeat: the quick brown fox jumps over the lazy dog. " * 2 + "the quick"
    prompts = [tokenizer.encode(t) for t in [copy, TEXTS[0], copy + " brown", TEXTS[3]]]
    s = make_scheduler(model, tokenizer, max_batch_size=16, max_queued_requests=64,
                       engine=SpecDecodeEngine(model, config, proposer))
    s.start()
    try:
        _run(s, [GenerationRequest(p, 16 + 6 * (i % 3), SamplingParams(temperature=0))
                 for i, p in enumerate(prompts)], 0.1)
        by = s.spec_stats.snapshot()["totals"]["by_proposer"]
    finally:
        _stop(s)
    assert by["ngram"]["accepted_tokens"] > 0 and by["dflash"]["draft_tokens"] > 0, by
    assert not checked.problems, checked.problems[:5]
    assert checked.checked > 20 and checked.widest > 1, (checked.checked, checked.widest)
    assert checked.firsts == {0}, checked.firsts
    assert checked.worst < 1e-4, checked.worst


def test_a_rows_drafts_in_a_batch_are_its_drafts_alone(smollm2, head_path):
    """Rows of different lengths, one joining after the others drafted and
    took more states: each row's block sees its own context only (left
    padding and other rows' ends masked), so its greedy drafts are the ones
    a single-row pass gives."""
    model, _ = smollm2
    head, layers, _ = load_dflash_head(model, str(head_path))
    embed = mlx_lm_adapter.token_embedding(model)
    project = mlx_lm_adapter.output_projection(model)
    proposer = DFlashProposer(head, embed, project, layers)
    seqs = {0: PROMPT[:4], 1: PROMPT[:11], 2: PROMPT[3:9]}
    feats = {u: _features(model, t) for u, t in seqs.items()}

    def alone(u, n):
        cache = head.make_cache()
        head.context(feats[u][:, :n], cache)
        block = mx.array([[seqs[u][n]] + [head.mask_token_id] * 4])
        return project(head.block(embed(block), cache))[0, 1:].argmax(-1).tolist()

    def give(uids, counts):  # each row's next ``counts`` target states
        width = max(counts)
        hidden = mx.concatenate([mx.pad(feats[u][:, given[u]:given[u] + n],
                                        [(0, 0), (0, width - n), (0, 0)])
                                 for u, n in zip(uids, counts)])
        proposer.observe_target(uids, hidden, counts)
        for u, n in zip(uids, counts):
            given[u] += n

    given = {0: 0, 1: 0}
    for u in (0, 1):
        proposer.add_sequence(u, 2)
    give([0, 1], [2, 7])
    drafts = proposer.propose([0, 1], [seqs[0][:3], seqs[1][:8]], [4, 4])
    assert drafts.draft_tokens.tolist() == [alone(0, 2), alone(1, 7)]
    proposer.add_sequence(2, 5)
    given[2] = 0
    give([0, 1, 2], [1, 3, 5])
    drafts = proposer.propose([1, 2, 0], [seqs[1][:11], seqs[2][:6], seqs[0][:4]], [4, 4, 2])
    assert drafts.draft_tokens[:2].tolist() == [alone(1, 10), alone(2, 5)]
    assert drafts.draft_tokens[2, :2].tolist() == alone(0, 3)[:2]
    assert drafts.num_proposed.tolist() == [4, 4, 2]


def test_a_hybrid_target_keeps_its_output(tmp_path_factory, smollm2_path):
    """qwen3_5 with gated-delta layers between attention layers, the drafter
    reading a linear and two attention layers: staggered rows, output the
    plain model's."""
    from mlx_lm import load
    from tiny_models import CONFIGS

    root = tmp_path_factory.mktemp("dflash-hybrid")
    target = build("qwen3_5", root / "target", smollm2_path, scale=2.0, seed=3)
    head = build_dflash(root / "head", CONFIGS["qwen3_5"]["text_config"], [0, 1, 3], seed=5)
    model, tokenizer = load(str(target))
    prompts = [tokenizer.encode(t) for t in TEXTS[:4]]
    plain, _ = _greedy(model, tokenizer, target, "none", prompts, 0.1, 24)
    ours, counts = _greedy(model, tokenizer, target, "dflash", prompts, 0.1, 24,
                           draft_model_path=str(head))
    assert ours == plain
    assert counts.num_draft_tokens > 100, counts


@pytest.mark.slow  # 80 s; scripts/mutants.py runs it with the mutant it guards
def test_sampled_tokens_keep_the_exact_distribution(smollm2, target_config, tmp_path):
    """Temperature 1.5, top_k 2, three tokens of 600 seeded requests after
    "Hello". The silent drafter's mask token is 'by', whose nearest
    embeddings are 'by' (q 0.66) and 'BY': after "Hello-" (the likelier
    first token) the target's own top two are 'by' (0.62) and 'be', so its
    block drafts are kept or refused by chance; each is drawn from its
    position's q, and the rejection sampler keeps the target's distribution
    (a draft always 'by' with that q gives 'by' 0.95 of the time there). TV
    below 0.09 over 8 outcomes (sampling error about 0.04)."""
    from test_hybrid_caches import _exact_distribution

    model, tokenizer = smollm2
    head = build_dflash(tmp_path / "silent", target_config, LAYERS, mask_token_id=1717,
                        silent=True, norm_scale=0.05)
    prompt = tokenizer.encode("Hello")
    s = _scheduler(model, tokenizer, "target", mode="dflash", k=2, draft_model_path=str(head))
    n = 600
    try:
        reqs = [GenerationRequest(prompt, 3, SamplingParams(seed=i, temperature=1.5, top_k=2))
                for i in range(n)]
        counts = {}
        for ids, _, _ in _run(s, reqs):
            counts[tuple(ids[:3])] = counts.get(tuple(ids[:3]), 0) + 1
        tokens = s.spec_stats.tokens
    finally:
        _stop(s)
    assert tokens.num_draft_tokens >= n, tokens
    assert 0 < tokens.num_accepted_tokens < tokens.num_draft_tokens, tokens
    exact = _exact_distribution(model, prompt, 3, 2, 1.5,
                                lambda m, t: m(mx.array([t]))[0, -1])
    keys = set(exact) | set(counts)
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in keys)
    assert tv < 0.09, (tv, counts, exact)
    assert math.isclose(sum(exact.values()), 1.0, rel_tol=1e-5)


def test_the_server_drafts_with_a_dflash_drafter(make_server, smollm2, head_path,
                                                 target_config, tmp_path):
    """``--spec-decode dflash --draft-model DIR`` answers through the HTTP
    server and reports the drafter's drafts; drafters that do not fit the
    target, or use what is not implemented, are refused naming why."""
    import httpx

    from mlx_lm_server.spec_decode.heads.dflash import load_dflash_head

    spec = SpecDecodeConfig(mode="suffix,dflash", draft_model_path=str(head_path),
                            dynamic=False, adaptive_k=False, calibration_seconds=0,
                            num_speculative_tokens=4)
    server = make_server(spec=spec)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": server.model, "messages": [{"role": "user", "content": "Hi!"}],
        "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    metrics = httpx.get(server.url + "/v1/spec_decode/metrics", timeout=5).json()
    assert metrics["mode"] == "suffix,dflash", metrics
    assert metrics["totals"]["by_proposer"]["dflash"]["draft_tokens"] > 0, metrics

    with pytest.raises(ValueError, match="needs --draft-model the DFlash drafter's folder"):
        SpecDecodeConfig(mode="dflash")
    model, _ = smollm2
    cases = [({"hidden_size": 1024}, "hidden size is 1024"),
             ({"dflash_config": {"mask_token_id": 2, "target_layer_ids": [1, 30]}},
              r"target_layer_ids \[1, 30\]"),
             ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding-window"),
             ({"dflash_config": {"mask_token_id": 60000, "target_layer_ids": [1]}},
              "mask_token_id 60000"),
             ({"dflash_config": None, "architectures": ["Qwen3ForCausalLM"]},
              "not a DFlash drafter")]
    for change, message in cases:
        folder = build_dflash(tmp_path / message[:8].replace(" ", "_"), target_config, LAYERS)
        config = json.loads((folder / "config.json").read_text())
        config.update(change)
        if config["dflash_config"] is None:
            del config["dflash_config"]
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            load_dflash_head(model, str(folder))
