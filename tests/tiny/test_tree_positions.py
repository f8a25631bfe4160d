"""Trees of drafts only where a pass places each node at its depth.

The adapter's ``node_positions`` takes over a module named ``rope`` in each
attention layer. A family whose positions come another way (GPT-2's learned
position embeddings, Qwen 1's ``rotary_emb``) would put every node at its
index: such a model is refused (``node_positions_refused``), its rows draft
chains, and one line says so. Every tiny family the tests build is either
held (a tree's nodes get the logits of chains of their own root paths) or
refused; a refused one that could have run a tree shows why (its tree's
logits are not its chains')."""

import logging

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.utils import _get_classes
from parity import assert_same_or_near_tie
from test_spec_engine import _prompts, _run, _scheduler
from tiny_models import CONFIGS, save_model

from mlx_lm_server.decoding.sampling import SamplingParams
from mlx_lm_server.kv import hold_trees, make_rollbackable, rollback, set_tree
from mlx_lm_server.kv.dispatch import batch_caches
from mlx_lm_server.serving.request import GenerationRequest
from mlx_lm_server.spec_decode.tree import layout
from mlx_lm_server.spec_decode.tree_step import verification_pass

# Families without a ``rope`` module (mlx-lm 0.32.2): learned positions, and a
# RoPE named ``rotary_emb``.
NO_ROPE = {
    "gpt2": dict(model_type="gpt2", n_ctx=1024, n_embd=64, n_head=4, n_layer=2,
                 n_positions=1024, layer_norm_epsilon=1e-5, vocab_size=49152),
    "qwen": dict(model_type="qwen", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                 kv_channels=16, intermediate_size=256, max_position_embeddings=1024,
                 layer_norm_epsilon=1e-6, no_bias=True, vocab_size=49152),
}
FAMILIES = {**CONFIGS, **NO_ROPE}
# Every layer rotates through a ``rope`` module; the others have a layer
# without one (a recurrent mixer, or positions another way).
HELD = {"gemma3_text", "qwen3_5_mtp_copy", "glm4_moe_nextn", "deepseek_v3_nextn", "gemma4_text",
        "gpt_oss", "falcon_h1"}
# Families whose caches take a tree at all (ragged attention in every layer).
TREE_CACHES = {"qwen3_5_mtp_copy", "glm4_moe_nextn", "deepseek_v3_nextn", "gpt2", "qwen"}
TOL = 2e-4
REFUSED = "trees of drafts off for"


def _model(family: str, seed: int = 0):
    config = FAMILIES[family]
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    return model_class(args_class.from_dict(config))


def _caches_that_take_trees(model):
    """The model's batched caches for one row, or None where a layer cannot
    hold a tree (or speculation cannot roll it back at all)."""
    try:
        caches = make_rollbackable(batch_caches(model, [0]))
    except TypeError:
        return None
    return caches if hold_trees(caches) else None


def _sibling_gap(model, caches) -> float:
    """A tree of two siblings under the pending token, against a chain of
    each sibling alone: the largest logit gap over the root and both."""
    model(mx.array([[5, 17, 300, 42, 9, 1000]]), cache=caches)
    root, x, y = 77, 123, 4567
    tree = layout(np.array([[0, 0]]), [2])
    logits = verification_pass(model, mx.array([[root, x, y]]), caches, tree)[0]  # [3, V]
    set_tree(caches, None)
    rollback(caches, [3])
    gap = 0.0
    for i, node in ((1, x), (2, y)):
        chain = model(mx.array([[root, node]]), cache=caches)[0]  # [2, V]
        rollback(caches, [2])
        gap = max(gap, mx.abs(logits[0] - chain[0]).max().item(),
                  mx.abs(logits[i] - chain[1]).max().item())
    return gap


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_tiny_family_holds_a_nodes_depth_or_refuses_trees(family):
    from mlx_lm_server.runtime.mlx_lm_adapter import node_positions_refused

    model = _model(family)
    refused = node_positions_refused(model)
    assert (refused is None) == (family in HELD), refused
    if refused is not None:
        assert "has no `rope` module" in refused and type(model).__module__.split(".")[-1] \
            in refused
    caches = _caches_that_take_trees(model)
    assert (caches is not None) == (family in TREE_CACHES)
    if caches is None:
        return  # its rows draft chains whatever the positions (``hold_trees``)
    gap = _sibling_gap(model, caches)
    if refused is None:
        assert gap < TOL, (family, gap)
    else:  # the refusal is needed: a node at its index is not at its depth
        assert gap > 100 * TOL, (family, gap)


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory, smollm2_path):
    """A random-weight gpt2 (learned position embeddings), saved as a
    checkpoint is and loaded through mlx-lm; weights doubled so that its
    output wanders instead of repeating one token."""
    weights = {k: 2.0 * v for k, v in tree_flatten(_model("gpt2").parameters())}
    folder = save_model(tmp_path_factory.mktemp("tiny-gpt2"), smollm2_path, NO_ROPE["gpt2"],
                        weights)
    return load(str(folder))


def test_trees_on_a_family_without_rope_draft_chains_with_plain_decodings_output(tiny_gpt2,
                                                                                 caplog):
    """Trees asked for (width 4) on a gpt2, every step's proposal a tree over
    the target's own two likeliest tokens (``test_tree_engine.TopTwoTree``):
    every row drafts its first path instead, no tree pass runs, the output
    is plain decoding's, and one line says why."""
    from test_tree_engine import TopTwoTree

    from mlx_lm_server.assembly import make_scheduler
    from mlx_lm_server.spec_decode.config import SpecDecodeConfig
    from mlx_lm_server.spec_decode.engine import SpecDecodeEngine

    model, tokenizer = tiny_gpt2
    plain = _scheduler(model, tokenizer, "none")
    config = SpecDecodeConfig(mode="ngram", num_speculative_tokens=4, dynamic=False,
                              adaptive_k=False, tree_width=4, calibration_seconds=0)
    trees = make_scheduler(model, tokenizer, max_batch_size=32, max_queued_requests=100,
                           engine=SpecDecodeEngine(model, config, TopTwoTree(model)))
    trees.start()
    prompts = _prompts(tokenizer)[2:6]
    reqs = [GenerationRequest(p, max_tokens=32, sampling=SamplingParams(temperature=0))
            for p in prompts]
    try:
        with caplog.at_level(logging.WARNING, logger="mlx_lm_server.spec_decode"):
            base, ours = _run(plain, reqs), _run(trees, reqs)
        steps = trees.spec_stats.steps
    finally:
        for s in (plain, trees):
            s.shutdown()
            s.join(10)
    for p, (a, _, _), (b, _, _) in zip(prompts, base, ours):
        assert_same_or_near_tie(model, p, a, b, mx.float32)
    assert steps.tree_steps == steps.tree_rows == 0, (steps.tree_steps, steps.tree_rows)
    assert steps.verify_steps > 0 and steps.fault_steps == 0  # chains drafted and verified
    said = [r.getMessage() for r in caplog.records if REFUSED in r.getMessage()]
    assert len(said) == 1 and "the target" in said[0] and "gpt2" in said[0], said


def test_a_draft_model_without_rope_drafts_chains(tiny_gpt2, caplog):
    """The drafter's own tree expansion places its nodes through the same
    ``node_positions``: a gpt2 drafter grows no tree, it drafts chains."""
    from mlx_lm_server.spec_decode.drafts import Context
    from mlx_lm_server.spec_decode.proposer.draft_model import DraftModelProposer

    model, tokenizer = tiny_gpt2
    proposer = DraftModelProposer(model, tree_width=3)
    prompts = [tokenizer.encode(t) for t in ("one two three four", "def f(x):\n    return")]
    for uid, p in enumerate(prompts):
        proposer.add_sequence(uid, len(p), SamplingParams(temperature=0))
    # Two steps: the prompt's last token pending, then the target's next (7),
    # no draft kept.
    steps = [[Context(p[:-1], p[-1]) for p in prompts], [Context(p, 7) for p in prompts]]
    with caplog.at_level(logging.WARNING, logger="mlx_lm_server.spec_decode"):
        for contexts in steps:
            proposal = proposer.propose([0, 1], contexts, [4, 4])
            assert proposal.parents is None and proposal.num_proposed.tolist() == [4, 4]
            proposer.observe_verification([0, 1], [0, 0])
    said = [r.getMessage() for r in caplog.records if REFUSED in r.getMessage()]
    assert len(said) == 1 and "the drafter" in said[0], said
