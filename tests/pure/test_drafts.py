"""``spec_decode/drafts.py``: one proposal merged from two sources' per row."""

import mlx.core as mx
import numpy as np

from mlx_lm_server.spec_decode.drafts import ProposalResult, merge_rows


def test_each_row_keeps_its_sources_tokens_q_links_chances_and_name():
    ours = ProposalResult.from_lists([[3, 4], [5]], 2)  # deterministic: one-hot q
    ours.sources = ["prediction"] * 2
    theirs = ProposalResult.from_trees([([7, 8, 9], [0, 0, 1], [0.9, 0.2, 0.5])] * 2, 3)
    theirs.draft_probs = mx.full((2, 3, 16), 1 / 16)
    merged = merge_rows(np.array([True, False]), ours, theirs, 3)
    assert merged.draft_tokens.tolist() == [[3, 4, -1], [7, 8, 9]]
    assert merged.num_proposed.tolist() == [2, 3]
    q = np.array(merged.draft_probs)
    assert (q[0, 0] == np.eye(16)[3]).all() and (q[0, 1] == np.eye(16)[4]).all()
    assert np.allclose(q[1], 1 / 16)
    assert merged.parents.tolist() == [[0, 1, 2], [0, 0, 1]]  # ours a chain
    assert np.isnan(merged.chances[0]).all()  # not measured: not priced
    assert merged.chances[1].tolist() == np.float32([0.9, 0.2, 0.5]).tolist()
    assert merged.sources == ["prediction", None]


def test_chains_and_deterministic_drafts_stay_plain():
    a = ProposalResult.from_lists([[1, 2], [3]], 2)
    b = ProposalResult.from_lists([[4], [5, 6, 7]], 3)
    merged = merge_rows(np.array([False, True]), a, b, 3)
    assert merged.draft_tokens.tolist() == [[4, -1, -1], [3, -1, -1]]
    assert merged.draft_probs is None and merged.parents is None and merged.chances is None


def test_rows_all_from_one_side_keep_its_q_or_none():
    sampled = ProposalResult.from_lists([[1, 2], [3, 4]], 2)
    sampled.draft_probs = mx.full((2, 2, 8), 1 / 8)
    one_hot = ProposalResult.from_lists([[5], [6]], 2)
    assert merge_rows(np.array([False, False]), sampled, one_hot, 3).draft_probs is None
    q = merge_rows(np.array([True, True]), sampled, one_hot, 3).draft_probs
    assert q.shape == (2, 3, 8) and np.allclose(np.array(q[:, :2]), 1 / 8)
    assert (np.array(q[:, 2]) == 0).all()  # padding past a row's drafts: never accepted
