"""Training an EAGLE-3 head for SmolLM2-135M (``mlx_lm_server/drafter/``):
the unrolled training steps are the head's own drafting, the loss falls, a
head trained on text the target repeats drafts it (teacher-forced and in the
engine, with identical greedy output), ``--resume`` continues the same curve,
and the written head loads here and in mlx-vlm's EAGLE-3 drafter.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_mtp_head import mlx_vlm  # noqa: F401  (puts the reference on sys.path)
from tiny_models import build_eagle3

from mlx_lm_server.drafter import data, ttt
from mlx_lm_server.drafter.train import Target, TrainConfig, make_head, new_head_config, train
from mlx_lm_server.runtime import mlx_lm_adapter
from mlx_lm_server.spec_decode.heads.eagle3 import aux_layer_ids, load_eagle3_head

REPEATED = "The cat sat on the mat. The dog ran to the park. "
SMALL = dict(batch_size=2, max_len=64, draft_vocab=256, learning_rate=1e-3, warmup=10)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("drafter-data") / "repeated.txt"
    path.write_text(REPEATED * 40)
    return path


@pytest.fixture(scope="module")
def trained(smollm2, text_file, tmp_path_factory):
    model, tokenizer = smollm2
    out = tmp_path_factory.mktemp("drafter-head")
    cfg = TrainConfig(steps=40, eval_every=40, checkpoint_every=40, **SMALL)
    return out, train(model, tokenizer, [str(text_file)], str(out), cfg, eval_fraction=0.2,
                      progress=lambda line: None)


@pytest.mark.parametrize("window", [None, 5])
def test_the_unrolled_steps_are_the_heads_own_drafting(smollm2, smollm2_path, tmp_path, window):
    """Step j of training at pair t gives the logits the head gives at
    inference for the j-th draft after pair t, with its cache holding the
    target's pairs up to t (``window``: only the last ones, as a row whose
    cache restarted over them) and its own chained entries (true tokens fed)."""
    model, tokenizer = smollm2
    config = json.loads((smollm2_path / "config.json").read_text())
    head, layers, _ = load_eagle3_head(model, str(build_eagle3(tmp_path / "h", config)))
    embed = mlx_lm_adapter.token_embedding(model)
    capture = mlx_lm_adapter.capture_hidden(model, layers)
    tokens = mx.array([tokenizer.encode(REPEATED + "The quick brown fox")])
    model(tokens)
    features = capture.take()
    steps = 3
    unrolled = ttt.unrolled_logits(head, embed, tokens, features, steps, window)
    worst = 0.0
    for t in range(tokens.shape[1] - 1 - steps):
        cache = head.make_cache()
        s = 0 if window is None else max(0, t + 1 - window)
        state = head(embed(tokens[:, s + 1:t + 2]), features[:, s:t + 1], cache)[:, -1:]
        for j in range(steps):
            logits = head.lm_head(head.norm(state))[:, 0]
            worst = max(worst, mx.abs(logits - unrolled[j][:, t]).max().item())
            state = head(embed(tokens[:, t + 2 + j:t + 3 + j]), state, cache)
    assert worst < 1e-4, worst


def test_the_loss_falls_on_a_fixed_batch(smollm2, text_file):
    model, tokenizer = smollm2
    sequences = data.read_sequences(tokenizer, [str(text_file)], 48)[:2]
    draft_ids = data.draft_vocabulary(sequences, 128, 49152)
    config = new_head_config(model, int(draft_ids.shape[0]))
    head = make_head(model, config, draft_ids, seed=0)
    head.freeze(keys=["d2t"])
    target = Target(model, aux_layer_ids(config, 30), draft_ids)
    embed = mlx_lm_adapter.token_embedding(model)
    tokens, mask = data.pad(sequences)
    features, logprobs, _ = target(tokens)
    optimizer = optim.AdamW(learning_rate=1e-3)
    import mlx.nn as nn

    grad = nn.value_and_grad(head, lambda h: ttt.ttt_loss(h, embed, tokens, features, logprobs,
                                                          3, mask)[0])
    losses = []
    for _ in range(15):
        loss, grads = grad(head)
        optimizer.update(head, grads)
        mx.eval(head.parameters(), optimizer.state)
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_a_head_trained_on_repeated_text_drafts_it(smollm2, trained):
    """Held-out windows of the same text, teacher-forced: most first drafts
    are the target's token. In the engine, on a prompt the target continues
    by repeating itself: identical greedy output, and a verification emits
    at least 1.8 tokens (k=3)."""
    from test_mtp_proposer import _scheduler, _stop
    from test_spec_engine import _run

    from mlx_lm_server.decoding.sampling import SamplingParams
    from mlx_lm_server.serving.request import GenerationRequest

    out, result = trained
    evaluation = result["evaluation"]
    assert evaluation["acceptance_per_position"][0] >= 0.75, evaluation
    assert evaluation["mean_accepted_length"][3] >= 2.5, evaluation
    assert result["history"][-1] < 0.5 * result["history"][0]

    model, tokenizer = smollm2
    prompt = tokenizer.encode(REPEATED * 3 + "The cat")
    outputs = {}
    for mode in ("none", "eagle3"):
        s = _scheduler(model, tokenizer, "target", mode=mode,
                       draft_model_path=None if mode == "none" else str(out))
        try:
            outputs[mode] = _run(s, [GenerationRequest(prompt, 60, SamplingParams(temperature=0))])
            snapshot = s.spec_stats.snapshot()
        finally:
            _stop(s)
    assert outputs["eagle3"][0][0] == outputs["none"][0][0]
    assert snapshot["mean_accepted_length"] >= 1.8, snapshot


def test_resume_continues_the_same_curve(smollm2, text_file, tmp_path):
    """Ten steps at once, or five, a checkpoint, and five more from it: the
    same losses, step for step. A run out of time (``--max-minutes``) stops
    with a checkpoint the same resume continues."""
    model, tokenizer = smollm2
    quiet = dict(eval_fraction=0.2, progress=lambda line: None)
    cfg = TrainConfig(steps=10, eval_every=100, checkpoint_every=5, **SMALL)
    whole = train(model, tokenizer, [str(text_file)], str(tmp_path / "a"), cfg, **quiet)
    half = TrainConfig(steps=5, eval_every=100, checkpoint_every=5, **SMALL)
    train(model, tokenizer, [str(text_file)], str(tmp_path / "b"), half, **quiet)
    stopped = train(model, tokenizer, [str(text_file)], str(tmp_path / "c"), cfg,
                    deadline=time.monotonic(), **quiet)
    assert stopped["step"] == 1 and stopped["evaluation"]
    stopped = train(model, tokenizer, [str(text_file)], str(tmp_path / "c"), cfg, resume=True,
                    **quiet)
    np.testing.assert_allclose(stopped["history"], whole["history"], rtol=1e-4)
    resumed = train(model, tokenizer, [str(text_file)], str(tmp_path / "b"), cfg, resume=True,
                    **quiet)
    assert len(resumed["history"]) == 10
    np.testing.assert_allclose(resumed["history"], whole["history"], rtol=1e-4)


def test_the_written_head_loads_in_mlx_vlm(mlx_vlm, smollm2, trained):  # noqa: F811
    """An independent reader of the format: mlx-vlm 0.7.10's Eagle3DraftModel
    takes every weight the folder holds (the embedding it binds from the
    target) and computes the same logits as this server's loader."""
    from mlx_vlm.speculative.drafters.eagle3.config import Eagle3Config
    from mlx_vlm.speculative.drafters.eagle3.eagle3 import Eagle3DraftModel

    model, _ = smollm2
    out, _ = trained
    config = json.loads((out / "config.json").read_text())
    reference = Eagle3DraftModel(Eagle3Config.from_dict(config))
    weights = reference.sanitize(dict(mx.load(str(out / "model.safetensors"))))
    expected = {k for k, _ in tree_flatten(reference.parameters())} - {"embed_tokens.weight"}
    assert set(weights) == expected
    reference.load_weights(list(weights.items()), strict=False)
    reference.reset(model)
    head, layers, _ = load_eagle3_head(model, str(out))
    embed = mlx_lm_adapter.token_embedding(model)
    tokens = mx.array([[5, 17, 99, 3, 42, 7]])
    features = mx.random.normal((1, 6, 3 * 576), key=mx.random.key(0))
    ours = head.logits(head(embed(tokens), features))
    theirs = reference._logits(reference._forward_tokens(tokens, features, mx.int32))
    ids = mx.arange(head.draft_vocab_size) + reference.d2t
    assert mx.abs(ours[..., ids] - theirs).max().item() <= 1e-4


def test_the_command_evaluates_a_head(trained, text_file, smollm2_path):
    out, _ = trained
    done = subprocess.run(
        [sys.executable, "-m", "mlx_lm_server.drafter.cli", "evaluate", "--model",
         str(smollm2_path), "--head", str(out), "--data", str(text_file), "--max-len", "64",
         "--price-context", "64"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["pairs"] > 100 and result["acceptance_per_position"][0] >= 0.75, result
    # The speed-up the acceptance buys at this machine's measured prices:
    # a(k) * step / (verify(k + 1) + a proposal of k drafts).
    prices = result["on_this_machine"]
    for k in ("1", "2", "3"):
        a = result["tokens_per_verification"][k]
        expected = a * prices["step_ms"] / (prices["verify_ms"][k] + prices["draft_ms"][k])
        assert prices["predicted_speedup"][k] == pytest.approx(expected, rel=0.02), prices
        assert prices["draft_ms"][k] > 0 and prices["verify_ms"][k] > 0


def test_regenerate_replaces_the_datas_answers_with_the_models(smollm2, tmp_path):
    """``--regenerate``: each chat record is cut at its last user turn and
    answered by the model through the batched engine (greedy: the tokens a
    plain argmax loop gives); traffic records are answered from their
    prompt; text files stay; a second run reuses the answers."""
    from mlx_lm_server.drafter.regenerate import REGENERATED, regenerated_files

    model, tokenizer = smollm2
    chats = tmp_path / "chats.jsonl"
    asks = ["Name a colour.", "What is 3 + 4?", "Say hi."]
    chats.write_text("\n".join(json.dumps({"messages": [
        {"role": "user", "content": q}, {"role": "assistant", "content": "WRONG ANSWER"}]})
        for q in asks) + "\n" + json.dumps({"prompt_ids": [1, 9690, 198], "output_ids": [5]}))
    notes = tmp_path / "notes.txt"
    notes.write_text(REPEATED)
    out = tmp_path / "head"
    out.mkdir()
    files = regenerated_files(model, tokenizer, [str(chats), str(notes)], out, max_tokens=6,
                              temperature=0.0, progress=lambda line: None)
    assert files == [str(out / REGENERATED), str(notes)]
    records = [json.loads(line) for line in (out / REGENERATED).read_text().splitlines()]
    assert len(records) == 4
    for record, ask in zip(records, asks + [None]):
        if ask is not None:
            expected_prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": ask}], add_generation_prompt=True)
            assert record["prompt_ids"] == list(expected_prompt)
        tokens = list(record["prompt_ids"])
        for _ in range(len(record["output_ids"])):
            tokens.append(model(mx.array([tokens]))[0, -1].argmax().item())
        assert record["output_ids"] == tokens[len(record["prompt_ids"]):]
        assert 1 <= len(record["output_ids"]) <= 6
    assert records[3]["prompt_ids"] == [1, 9690, 198]
    assert "WRONG" not in tokenizer.decode(sum((r["output_ids"] for r in records), []))
    (out / REGENERATED).write_text(json.dumps({"prompt_ids": [7], "output_ids": [8]}) + "\n")
    again = regenerated_files(model, tokenizer, [str(chats), str(notes)], out, max_tokens=6,
                              temperature=0.0, progress=lambda line: None)
    assert again == files
    assert data.read_sequences(tokenizer, again[:1], 64) == []  # reused (too short to train)


def test_the_command_regenerates_held_out_answers(smollm2_path, tmp_path):
    """``mlx-lm-server-drafter regenerate``: the answers ``train --regenerate``
    would write, for held-out questions; the console script exits 0 (a
    plain interpreter teardown after the engine's thread ran MLX aborted in
    some runs: "terminate called without an active exception", status 134)."""
    chats = tmp_path / "held_out.jsonl"
    chats.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": q}]})
                               for q in ("Name a colour.", "Say hi.")) + "\n")
    done = subprocess.run(
        [str(Path(sys.executable).with_name("mlx-lm-server-drafter")), "regenerate",
         "--model", str(smollm2_path), "--data", str(chats), "--out", str(tmp_path / "out"),
         "--max-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    [written] = json.loads(done.stdout.strip().splitlines()[-1])["regenerated"]
    records = [json.loads(line) for line in Path(written).read_text().splitlines()]
    assert len(records) == 2 and all(1 <= len(r["output_ids"]) <= 4 for r in records)


def test_the_walk_counts_tokens_per_verification_as_decoding_does():
    """Decoding crosses an easy stretch in one verification: with k=2 and
    drafts kept [3, 0, 2, 1, 0] from each position, verifications start at
    0 (3 kept, capped at 2: 3 tokens) and 3 (1 kept: 2 tokens)."""
    from mlx_lm_server.drafter.train import _walk

    assert _walk(np.array([3, 0, 2, 1, 0]), 2) == [3, 2]
    assert _walk(np.array([0, 0, 0]), 3) == [1, 1, 1]
    assert _walk(np.array([5, 5, 5, 5, 5, 5, 5, 5]), 3) == [4, 4]
