"""A tree of drafts in one pass over a real model: every node's logits equal
a never-branched reference over its root path, and after the accepted path
is kept the rows decode as if only that path had ever been fed."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from mlx_lm_server.kv import hold_trees, keep_paths, make_rollbackable, rollback, set_tree
from mlx_lm_server.runtime.mlx_lm_adapter import node_positions
from mlx_lm_server.spec_decode.tree import layout, pad_trees

TOL = 2e-4


def _prefill(model, prompts):
    n = max(len(p) for p in prompts)
    pad = [n - len(p) for p in prompts]
    cache = [BatchKVCache(pad) for _ in model.layers]
    model(mx.array([[0] * d + p for d, p in zip(pad, prompts)]), cache=cache)
    return make_rollbackable(cache)


def _reference(model, tokens):
    return model(mx.array([tokens]), cache=make_prompt_cache(model))[0, -1]


def _random_tree(rng, N):
    parents, tokens = [], []
    for j in range(N):
        parents.append(int(rng.integers(0, j + 1)))
        tokens.append(int(rng.integers(100, 2000)))
    return tokens, parents


def _root_path(parents, i):
    """Input positions from the root to input position i."""
    path = [i]
    while path[-1] != 0:
        path.append(parents[path[-1] - 1])
    return path[::-1]


def _tree_pass(model, cache, pending, tokens, parents, num):
    tree = layout(parents, num)
    inputs = mx.concatenate([mx.array(pending)[:, None], mx.maximum(mx.array(tokens), 0)], 1)
    slot = node_positions(model)
    set_tree(cache, mx.array(tree.ancestors))
    slot[0] = mx.array(tree.depth)
    try:
        return model(inputs, cache=cache)
    finally:
        slot[0] = None


@pytest.fixture(scope="module")
def models(smollm2, tiny_qwen3_path):
    return {"llama": smollm2[0], "qwen3": load(str(tiny_qwen3_path))[0]}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_tree_pass_equals_each_root_path_fed_alone_and_keeps_only_the_accepted(models,
                                                                                 family):
    model = models[family]
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(100, 2000, size=n)] for n in (9, 17, 4)]
    cache = _prefill(model, prompts)
    assert hold_trees(cache)
    fed = [list(p) for p in prompts]
    for N in (6, 3):  # two tree rounds, rows kept at different depths
        trees = [_random_tree(rng, N) for _ in prompts]
        trees[2] = (trees[2][0][:2], trees[2][1][:2])  # a smaller tree: placeholders
        tokens, parents, num = pad_trees(trees, N)
        pending = [int(t) for t in rng.integers(100, 2000, size=len(prompts))]
        logits = _tree_pass(model, cache, pending, tokens, parents, num)
        for b, (t, p) in enumerate(trees):
            for i in range(len(t) + 1):
                path = _root_path(p, i)
                ref = _reference(model, fed[b] + [pending[b]] + [t[j - 1] for j in path[1:]])
                diff = mx.abs(logits[b, i] - ref).max().item()
                assert diff < TOL, (family, N, b, i, diff)
        # Keep each row's path to a random node of its own tree.
        kept = [_root_path(p, int(rng.integers(0, len(t) + 1))) for t, p in trees]
        D = max(len(k) for k in kept)
        path = mx.array([k + [k[-1]] * (D - len(k)) for k in kept])
        keep_paths(cache, path, N + 1)
        rollback(cache, [N + 1 - len(k) for k in kept])
        for b, (t, p) in enumerate(trees):
            fed[b] += [pending[b]] + [t[j - 1] for j in kept[b][1:]]
        nxt = [int(t) for t in rng.integers(100, 2000, size=len(prompts))]
        step = model(mx.array(nxt)[:, None], cache=cache)[:, -1]
        for b in range(len(prompts)):
            fed[b].append(nxt[b])
            diff = mx.abs(step[b] - _reference(model, fed[b])).max().item()
            assert diff < TOL, (family, "after", N, b, diff)
