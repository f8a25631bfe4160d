"""Predicted outputs (OpenAI's ``prediction``): the alignment of an output
with its prediction as a pure walk, the proposer that drafts from it before
the mode's, and the request field end to end on SmolLM2 (the same greedy
text, drafts from the prediction kept, usage streamed and whole, 400s)."""

import json
import random

import httpx
import mlx.core as mx
import numpy as np
import pytest

from mlx_lm_server.spec_decode.config import SpecDecodeConfig
from mlx_lm_server.spec_decode.proposer.base import BaseProposer
from mlx_lm_server.spec_decode.drafts import Context, ProposalResult
from mlx_lm_server.spec_decode.proposer.ngram import NGramProposer
from mlx_lm_server.spec_decode.proposer.per_row import PerRowProposer
from mlx_lm_server.text.reasoning import Thinking
from mlx_lm_server.spec_decode.proposer.prediction import (
    CONFIRM,
    PREDICTION,
    Alignment,
    Prediction,
    prediction_counts,
    rejoin,
)

P = list(range(1, 13))  # a prediction: 1 2 ... 12


def _drafts(prediction, output, k=4) -> list:
    """The draft after each output token (``alignment.draft(k)``)."""
    a = Alignment(Prediction(prediction))
    out = []
    for t in output:
        a.add(t)
        out.append(a.draft(k))
    return out


# ---- the alignment, pure -----------------------------------------------------


def test_an_output_that_follows_its_prediction_drafts_what_comes_next():
    assert _drafts(P, [1, 2, 3]) == [[2, 3, 4, 5], [3, 4, 5, 6], [4, 5, 6, 7]]
    assert _drafts(P, P)[-3:] == [[11, 12], [12], []]  # the prediction's end
    a = Alignment(Prediction(P))
    assert a.draft(3) == [1, 2, 3]  # before any output: its start
    assert prediction_counts(P, P) == (12, 0)


def test_after_an_insertion_the_output_rejoins_where_it_left():
    output = [1, 2, 3, 50, 51, 4, 5]
    assert _drafts(P, output) == [[2, 3, 4, 5], [3, 4, 5, 6], [4, 5, 6, 7], [], [],
                                  [5, 6, 7, 8], [6, 7, 8, 9]]
    assert prediction_counts(P, output) == (5, 7)


def test_after_a_deletion_two_tokens_rejoin_further_on():
    """One token may occur anywhere; two are the anchor of a skip ahead."""
    output = [1, 2, 3, 7, 8, 9]
    assert _drafts(P, output)[3:] == [[], [9, 10, 11, 12], [10, 11, 12]]
    assert prediction_counts(P, output) == (6, 6)
    assert prediction_counts(P, output + [10, 11, 12]) == (9, 3)


def test_after_a_replacement_the_output_rejoins_past_the_replaced_token():
    output = [1, 2, 3, 40, 5, 6, 7, 8, 9]
    assert _drafts(P, output)[3:6] == [[], [], [7, 8, 9, 10]]
    assert prediction_counts(P, output) == (8, 4)  # 4, 10, 11 and 12 missed


def test_a_tentative_rejoin_does_not_carry_the_floor_past_the_real_one():
    """A preamble's common pair occurs late in the prediction: drafts follow
    it, but the output then starts the prediction from its beginning, and
    the alignment takes it there (the floor stayed at 0)."""
    prediction = [10, 11, 12, 13, 14, 15, 90, 91, 16]
    output = [90, 91, 10, 11, 12]
    assert _drafts(prediction, output, 2) == [[], [16], [11, 12], [12, 13], [13, 14]]
    assert prediction_counts(prediction, output) == (3, 6)


def test_a_skip_ahead_settles_after_confirm_tokens():
    a = Alignment(Prediction(P))
    for t in [1, 2, 6, 7]:  # a skip over 3..5: tentative
        a.add(t)
    assert (a.floor, a.start, a.cursor, a.settled) == (2, 5, 7, False)
    for t in range(8, 5 + CONFIRM + 1):
        a.add(t)
    assert a.settled and a.floor == a.cursor == 5 + CONFIRM
    assert a.counts() == (2 + CONFIRM, len(P) - 2 - CONFIRM)


def test_a_settled_token_is_never_matched_again():
    """``1 2`` settled at the start; ``1 2 4`` occurs later, but the two
    tokens are counted once: the rejoin's anchor is the unsettled ``4``."""
    assert prediction_counts([1, 2, 3, 1, 2, 4], [1, 2, 4]) == (2, 4)


def test_rejoin_takes_the_nearest_suffix_at_or_after_the_floor():
    pred = Prediction([5, 6, 7, 5, 6, 8, 6, 8])
    assert rejoin(pred, [5, 6], 0) == (0, 2)
    assert rejoin(pred, [5, 6], 2) == (3, 5)
    assert rejoin(pred, [5, 6], 1) == (1, 2)  # "6" at the floor ends before "5 6" at 3
    assert rejoin(pred, [9, 6, 8], 0) == (4, 6)  # "6 8" at 4 before 6
    assert rejoin(pred, [6], 1) == (1, 2)  # one token: at the floor itself
    assert rejoin(pred, [6], 0) is None  # ... and nowhere further
    assert rejoin(pred, [9], 0) is None
    assert rejoin(Prediction([3, 4, 0, 7, 3, 4]), [7, 3, 4], 0) == (0, 2)  # nearest, not longest
    assert rejoin(Prediction([1, 2, 3]), [1, 2, 3], 0) == (0, 3)  # the longer on a tie


def test_a_tentative_run_moves_to_a_nearer_rejoin_its_next_token_reveals():
    """A renamed argument (30 31 -> 40): ``40 4`` occurs only in the next
    function, ``4 5`` right here; the run moves back at ``5`` and the first
    function is not skipped (SmolLM2's answer to an edited prediction was)."""
    first, second = [30, 31, 4, 5, 6, 7, 8], [9, 40, 4, 5, 6, 7, 8]
    prediction = [1, 2] + first + second
    output = [1, 2, 40, 4, 5, 6, 7, 8] + second
    a = Alignment(Prediction(prediction))
    cursors = []
    for t in output[:8]:
        a.add(t)
        cursors.append(a.cursor)
    assert cursors == [1, 2, None, 12, 6, 7, 8, 9]  # 12: tentative, in the next function
    assert a.draft(2) == [9, 40] and a.floor == 9
    assert prediction_counts(prediction, output) == (14, 2)  # all but 30 31


def test_a_following_run_is_not_taken_back_to_the_floor_by_one_token():
    """``7`` is also the token at the floor: one token may rejoin there only
    off track, not pull back a run that follows its prediction."""
    prediction = [1, 2, 7, 3, 4, 5, 6, 7, 8, 9]
    output = [1, 2, 50, 5, 6, 7, 8, 9]
    assert _drafts(prediction, output, 2)[4:] == [[7, 8], [8, 9], [9], []]
    assert prediction_counts(prediction, output) == (7, 3)


def _lcs(a, b) -> int:
    row = [0] * (len(b) + 1)
    for x in a:
        prev = 0
        for j, y in enumerate(b):
            prev, row[j + 1] = row[j + 1], prev + 1 if x == y else max(row[j + 1], row[j])
    return row[-1]


def test_accepted_tokens_are_a_common_subsequence_and_an_unedited_copy_is_all():
    """Random predictions and edited copies: accepted never exceeds the
    longest common subsequence (the walk matches in order, each token once),
    and a copy with one edit keeps all but the edited span."""
    rng = random.Random(0)
    for _ in range(300):
        prediction = [rng.randrange(6) for _ in range(rng.randrange(1, 30))]
        output = [rng.randrange(6) for _ in range(rng.randrange(0, 30))]
        accepted, rejected = prediction_counts(prediction, output)
        assert 0 <= accepted <= _lcs(prediction, output)
        assert accepted + rejected == len(prediction)
    for _ in range(300):
        prediction = [rng.randrange(1000) for _ in range(40)]  # distinct-ish tokens
        i, j = sorted(rng.sample(range(41), 2))
        inserted = [rng.randrange(1000, 2000) for _ in range(rng.randrange(4))]
        output = prediction[:i] + inserted + prediction[j:]
        accepted, _ = prediction_counts(prediction, output)
        assert accepted >= len(prediction) - (j - i) - 1, (i, j, inserted)


# ---- the answer only, for a model that thinks -------------------------------------

START, END = 3, 4  # <think>, </think>
FILE = list(range(100, 140))  # a 40-token prediction
# The reasoning quotes tokens 20-30 of the file, then the answer is the file.
THOUGHT = [50, 51, *FILE[20:31], 52]


@pytest.mark.parametrize("forced", [True, False])
def test_the_reasoning_is_neither_counted_nor_walked(forced):
    """A thought that quotes a later part of the file must not settle the
    alignment there: OpenAI counts the answer, the whole file, 40 / 0.
    ``forced``: the template opens the block (the prompt ends with the start
    marker), else the model opens it."""
    thinking = Thinking((START,), (END,), in_reasoning=forced)
    output = ([] if forced else [START]) + THOUGHT + [END] + FILE
    assert prediction_counts(FILE, output, thinking) == (40, 0)
    assert prediction_counts(FILE, output)[0] < 40  # walked whole, the quote settles it


def test_a_thinking_row_drafts_its_prediction_only_once_the_reasoning_ends():
    inner = _Recorder()
    p = PerRowProposer(inner, lookup_name="ngram")
    p.add_sequence(0, 2)
    p.predict(0, FILE, Thinking((START,), (END,), in_reasoning=True))
    drafts = []
    for n in range(len(THOUGHT) + 3):  # the thought, the end marker, two answer tokens
        output = (THOUGHT + [END] + FILE)[:n]
        out = p.propose([0], [Context([0, 0] + output[:-1], output[-1]) if output
                              else Context([0], 0)], [3])
        drafts.append((out.draft_tokens[0].tolist(), out.sources))
    assert all(d == ([7, 7, 7], ["ngram"]) for d in drafts[:len(THOUGHT) + 1])
    assert drafts[len(THOUGHT) + 1] == (FILE[0:3], [PREDICTION])  # after </think>
    assert drafts[len(THOUGHT) + 2] == (FILE[1:4], [PREDICTION])


def test_merged_proposals_keep_the_trees_chances_and_leave_the_others_unpriced():
    inner = _Recorder(tree=True)

    def propose(uids, contexts, k):
        out = _Recorder.propose(inner, uids, contexts, k)
        out.chances = np.array([[0.9, 0.5, 0.4]] * len(uids), np.float32)[:, :max(k)]
        return out

    inner.propose = propose
    p = _proposer(inner, {0: [3, 4, 5]})
    out = p.propose([0, 1], [Context([0, 0], 3), Context([0, 0], 9)], [2, 3])
    assert np.isnan(out.chances[0]).all()  # the prediction's chain: not measured
    assert out.chances[1].tolist() == pytest.approx([0.9, 0.5, 0.4])


# ---- the proposer --------------------------------------------------------------


class _Recorder(BaseProposer):
    """The mode's proposer: drafts ``[7, 7, ...]``, records what it is asked."""

    def __init__(self, q: bool = False, tree: bool = False):
        self.asked, self.observed, self.q, self.tree = [], [], q, tree

    def add_sequence(self, uid, prompt_len, params=None):
        pass

    def remove_sequence(self, uid):
        pass

    def propose(self, uids, contexts, k):
        self.asked.append(list(k))
        K = max(k, default=0)
        if self.tree:  # each row: two siblings under the root, then a chain
            return ProposalResult.from_trees(
                [([7, 8, 9][:k_i], [0, 0, 1][:k_i]) for k_i in k], K)
        out = ProposalResult.from_lists([[7] * k_i for k_i in k], K)
        if self.q:
            out.draft_probs = mx.full((len(uids), K, 16), 1 / 16)
        return out

    def observe_verification(self, uids, num_accepted):
        self.observed.append(list(num_accepted))


def _proposer(inner, predictions: dict, prompt_len: int = 2) -> PerRowProposer:
    p = PerRowProposer(inner, lookup_name="ngram")
    for uid in (0, 1):
        p.add_sequence(uid, prompt_len)
        p.predict(uid, predictions.get(uid, ()))
    return p


def test_rows_with_a_prediction_draft_it_and_the_others_the_modes():
    inner = _Recorder()
    p = _proposer(inner, {0: [3, 4, 5, 6]})
    contexts = [Context([0, 0], 3), Context([0, 0], 9)]  # row 0's output: 3
    out = p.propose([0, 1], contexts, [3, 3])
    assert out.draft_tokens.tolist() == [[4, 5, 6], [7, 7, 7]]
    assert out.num_proposed.tolist() == [3, 3]
    assert out.sources == [PREDICTION, None]  # a row without a prediction: as the mode names it
    assert out.draft_probs is None  # deterministic drafts: one-hot q
    assert inner.asked == [[0, 3]]  # the mode's proposer drafts for row 1 only
    p.observe_verification([0, 1], [2, 1])
    assert inner.observed == [[0, 1]]  # nothing of row 0's drafts was the mode's


def test_a_row_off_its_prediction_takes_the_modes_drafts_under_the_modes_name():
    inner = _Recorder()
    p = _proposer(inner, {0: [3, 4, 5, 6]})
    out = p.propose([0], [Context([0, 0], 99)], [2])
    assert out.draft_tokens.tolist() == [[7, 7]] and out.sources == ["ngram"]


def test_the_modes_proposer_is_not_asked_when_every_row_drafts_a_prediction():
    inner = _Recorder()
    p = _proposer(inner, {0: [3, 4], 1: [5, 6]})
    out = p.propose([0, 1], [Context([0, 0], 3), Context([0, 0], 5)], [2, 2])
    assert out.draft_tokens.tolist() == [[4, -1], [6, -1]]
    p.observe_verification([0, 1], [1, 1])
    assert inner.asked == [] and inner.observed == []


def test_without_predictions_the_modes_proposal_passes_through():
    inner = _Recorder()
    p = _proposer(inner, {})
    out = p.propose([0, 1], [Context([0, 0], 3), Context([0, 0], 5)], [2, 1])
    assert out.sources is None and out.draft_tokens.tolist() == [[7, 7], [7, -1]]
    p.observe_verification([0, 1], [2, 0])
    assert inner.observed == [[2, 0]]


def test_a_prediction_row_is_one_hot_among_sampled_drafts_and_a_chain_among_trees():
    p = _proposer(_Recorder(q=True), {0: [3, 4, 5]})
    out = p.propose([0, 1], [Context([0, 0], 3), Context([0, 0], 9)], [2, 3])
    q = np.array(out.draft_probs)
    assert q.shape == (2, 3, 16)
    assert (q[0, 0] == np.eye(16)[4]).all() and (q[0, 1] == np.eye(16)[5]).all()
    assert np.allclose(q[1], 1 / 16)  # the mode's own q
    inner = _Recorder(tree=True)
    p = _proposer(inner, {0: [3, 4, 5]})
    p.set_tree_shape(2, 3)  # the engine's step by step choice reaches the mode's proposer
    assert (inner.tree_width, inner.tree_depth) == (2, 3)
    out = p.propose([0, 1], [Context([0, 0], 3), Context([0, 0], 9)], [2, 3])
    assert out.parents.tolist() == [[0, 1, 2], [0, 0, 1]]


def test_the_shadow_drafts_predictions_first():
    """While speculation is off the engine drafts with the shadow: a row that
    follows its prediction must be seen there (prompt lookup for the rest)."""
    ngram = NGramProposer(1, 2)
    p = PerRowProposer(ngram, lookup_name="ngram")
    assert p.shadow is ngram  # no prediction: the mode's own shadow
    for uid in (0, 1):
        p.add_sequence(uid, 2)
    p.predict(0, [3, 4, 5])
    out = p.shadow.propose([0, 1], [[0, 0, 3], [1, 2, 1]], [2, 2])
    assert out.draft_tokens.tolist() == [[4, 5], [2, 1]]
    p.remove_sequence(0)
    assert p.shadow is ngram


def test_a_proposer_that_cannot_draft_a_prediction_says_so():
    with pytest.raises(TypeError, match="PerRowProposer"):
        NGramProposer().predict(0, [1, 2])
    NGramProposer().predict(0, ())  # no prediction: nothing to refuse


# ---- over HTTP, on SmolLM2 -----------------------------------------------------

TEXT = ("def area(width, height):\n    return width * height\n\n"
        "def perimeter(width, height):\n    return 2 * (width + height)\n")


@pytest.fixture(scope="module")
def server(smollm2_path):
    """Prompt lookup off (the n-gram proposer drafts from the output only),
    a fixed k: drafts that copy the prompt come from the prediction."""
    from conftest import LiveServer

    s = LiveServer(smollm2_path, spec=SpecDecodeConfig(
        mode="ngram", num_speculative_tokens=8, dynamic=False, adaptive_k=False,
        calibration_seconds=0, prompt_lookup=False))
    yield s
    s.close()


def _body(server, **fields) -> dict:
    return {"model": server.model, "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content": "Repeat this code exactly:\n" + TEXT}],
            **fields}


def _post(server, body) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


def _streamed(server, body) -> tuple[str, dict]:
    text, usage = [], None
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json={**body, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                text.append(chunk["choices"][0]["delta"].get("content") or "")
            usage = chunk.get("usage") or usage
    return "".join(text), usage


def _prediction_details(usage) -> tuple:
    d = usage["completion_tokens_details"]
    return d["accepted_prediction_tokens"], d["rejected_prediction_tokens"]


def test_greedy_output_is_the_same_with_a_prediction_and_its_drafts_are_kept(server):
    plain = _post(server, _body(server)).json()
    text = plain["choices"][0]["message"]["content"]
    assert "completion_tokens_details" not in plain["usage"]  # no prediction: no counts
    predicted_tokens = len(server.tokenizer.encode(text, add_special_tokens=False))
    for prediction in (text, [{"type": "text", "text": text[:30]},
                              {"type": "text", "text": text[30:]}]):
        r = _post(server, _body(server, prediction={"type": "content", "content": prediction}))
        body = r.json()
        assert body["choices"][0]["message"]["content"] == text
        usage = body["usage"]
        accepted, rejected = _prediction_details(usage)
        assert accepted + rejected == predicted_tokens
        assert accepted >= predicted_tokens - 2 and rejected <= 2, usage
        kept = usage["spec_decode"]["by_proposer"][PREDICTION]
        assert kept["accepted_tokens"] >= usage["completion_tokens"] // 2, usage
    metrics = httpx.get(server.url + "/v1/spec_decode/metrics").json()
    assert metrics["totals"]["by_proposer"][PREDICTION]["accepted_tokens"] > 0
    assert metrics["proposer"]["rows_drafted_from_prediction"] > 0


def test_an_edited_prediction_gives_the_same_output_and_counts_what_it_missed(server):
    text = _post(server, _body(server)).json()["choices"][0]["message"]["content"]
    edited = text.replace("width", "breadth", 1).replace("return", "yield", 1) + "\n# end\n"
    body = _body(server, prediction={"type": "content", "content": edited})
    whole = _post(server, body).json()
    assert whole["choices"][0]["message"]["content"] == text
    accepted, rejected = _prediction_details(whole["usage"])
    # Every output token but the two renamed words' is matched, in order.
    assert accepted >= whole["usage"]["completion_tokens"] - 4 and rejected >= 3, whole["usage"]
    assert whole["usage"]["spec_decode"]["by_proposer"][PREDICTION]["accepted_tokens"] > 0
    streamed, usage = _streamed(server, body)
    assert streamed == text
    assert _prediction_details(usage) == (accepted, rejected)


def test_without_speculation_the_prediction_is_counted_only(live_server):
    """``--spec-decode none``: no engine, nothing drafts; the output is the
    plain one and the usage counts the prediction all the same."""
    plain = _post(live_server, _body(live_server)).json()
    text = plain["choices"][0]["message"]["content"]
    r = _post(live_server, _body(live_server, prediction={"type": "content", "content": text}))
    assert r.json()["choices"][0]["message"]["content"] == text
    accepted, rejected = _prediction_details(r.json()["usage"])
    assert accepted >= len(live_server.tokenizer.encode(text, add_special_tokens=False)) - 2
    assert "spec_decode" not in r.json()["usage"]


@pytest.mark.parametrize("prediction,param", [
    ({"type": "text", "content": "x"}, "prediction.type"),
    ({"content": "x"}, "prediction.type"),
    ({"type": "content", "content": 5}, "prediction.content"),
    ({"type": "content"}, "prediction.content"),
    ({"type": "content", "content": [{"type": "text", "text": "a"},
                                     {"type": "image_url", "image_url": {"url": "x"}}]},
     "prediction.content.1"),
    ({"type": "content", "content": [{"type": "text"}]}, "prediction.content.0"),
    ("def f(): pass", "prediction"),
    ({"type": "content", "content": "word " * 9000}, "prediction"),
])
def test_a_malformed_prediction_is_a_400_naming_the_field(live_server, prediction, param):
    r = _post(live_server, _body(live_server, prediction=prediction))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_a_user_message_with_null_content_is_a_400(live_server):
    body = _body(live_server)
    body["messages"] = [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": None}]
    r = _post(live_server, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages.1.content"
    r = _post(live_server, {**body, "stream": True})
    assert r.status_code == 400
