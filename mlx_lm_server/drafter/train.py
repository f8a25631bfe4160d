"""Training an EAGLE-3 head for a target, in MLX, on this machine.

The target's features (the outputs of the head's three layers) and its
next-token distribution come from one forward of the target per batch,
through the same capture the ``eagle3`` proposer uses, and are dropped after
the step: memory is bounded by a batch, whatever the data size. The head is
trained with training-time test (``ttt.py``) against the target's
distribution over the draft vocabulary, with AdamW, linear warm-up and
cosine decay. Checkpoints hold the head, the optimizer state and the step,
so ``--resume`` continues the same curve; the output folder is a head in the
``speculators`` format, which ``--spec-decode eagle3`` (and vLLM, SGLang)
load.

The head trains in float32 whatever the target's dtype (AdamW's small
updates vanish in bfloat16) on the target's features as the target computes
them (bfloat16 on a 4-bit target); where it drafts, in the held-out figures
here, in ``evaluate`` and when serving, it runs in the target's compute
dtype (``heads.compute_dtype``), never a quantized weight's storage dtype.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..runtime import mlx_lm_adapter
from ..spec_decode.heads import cast_floating, compute_dtype
from ..spec_decode.heads.eagle3 import Eagle3Head, aux_layer_ids
from . import data, ttt

# Beside the head, in a folder of their own (a loader reads the head's folder's weights).
CHECKPOINT = "checkpoint/checkpoint.safetensors"
STATE = "checkpoint/trainer_state.json"


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 4
    max_len: int = 512
    ttt_steps: int = 3
    learning_rate: float = 3e-4
    warmup: int = 50
    weight_decay: float = 0.01
    draft_vocab: int = 16384
    checkpoint_every: int = 100
    eval_every: int = 100
    seed: int = 0


class Target:
    """The target's features and draft-vocabulary distribution for a batch."""

    def __init__(self, model, layers: list[int], draft_ids: mx.array):
        self.model = model
        self.capture = mlx_lm_adapter.capture_hidden(model, layers)
        self.draft_ids = draft_ids

    def __call__(self, tokens: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """(features [B, T, 3H], log-probabilities over the draft vocabulary
        [B, T, Dv], the greedy next token over the whole vocabulary [B, T]),
        evaluated: constants to the head's gradient."""
        logits = self.model(tokens).astype(mx.float32)
        features = self.capture.take()
        greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
        draft = logits[..., self.draft_ids]
        logprobs = draft - mx.logsumexp(draft, axis=-1, keepdims=True)
        mx.eval(features, logprobs, greedy)
        return mx.stop_gradient(features), mx.stop_gradient(logprobs), greedy


def new_head_config(target, draft_vocab: int, layers: Optional[list[int]] = None) -> dict:
    """A ``speculators`` config for a head shaped like one of the target's layers."""
    args = mlx_lm_adapter.text_args(target)
    num_layers = len(mlx_lm_adapter.text_model(target).model.layers)
    H = args.hidden_size
    heads = args.num_attention_heads
    layer = {
        "model_type": "llama", "hidden_size": H,
        "intermediate_size": getattr(args, "intermediate_size", 4 * H),
        "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": getattr(args, "num_key_value_heads", None) or heads,
        "head_dim": getattr(args, "head_dim", None) or H // heads,
        "rms_norm_eps": getattr(args, "rms_norm_eps", 1e-6), "vocab_size": args.vocab_size,
        "max_position_embeddings": getattr(args, "max_position_embeddings", 8192),
        "rope_theta": getattr(args, "rope_theta", 10000.0)}
    ids = layers if layers is not None else [2, num_layers // 2, num_layers - 3]
    return {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
            "draft_vocab_size": draft_vocab, "norm_before_residual": False,
            "target_hidden_size": H, "eagle_aux_hidden_state_layer_ids": list(ids),
            "transformer_layer_config": layer}


def make_head(target, config: dict, draft_ids: mx.array, seed: int) -> Eagle3Head:
    args = mlx_lm_adapter.text_args(target)
    mx.random.seed(seed)
    head = Eagle3Head(config, args.hidden_size, args.vocab_size)
    if "d2t" in head:
        head.d2t = draft_ids - mx.arange(draft_ids.shape[0], dtype=mx.int32)
    return head


def trainable(head: Eagle3Head) -> dict:
    """The head's weights the optimizer moves (the draft map is data)."""
    return {k: v for k, v in tree_flatten(head.parameters()) if k != "d2t"}


def schedule(cfg: TrainConfig) -> Callable:
    warm = optim.linear_schedule(cfg.learning_rate / 100, cfg.learning_rate, max(cfg.warmup, 1))
    decay = optim.cosine_decay(cfg.learning_rate, max(cfg.steps - cfg.warmup, 1),
                               cfg.learning_rate / 10)
    return optim.join_schedules([warm, decay], [max(cfg.warmup, 1)])


def save_head(head: Eagle3Head, config: dict, draft_ids: mx.array, vocab: int,
              folder: Path) -> None:
    """The ``speculators`` layout: config.json and model.safetensors with
    ``fc``, ``layers.0.*``, ``norm``, ``lm_head``, ``d2t`` (int64) and ``t2d``."""
    folder.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(head.parameters()))
    weights["d2t"] = (draft_ids - mx.arange(draft_ids.shape[0], dtype=mx.int32)).astype(mx.int64)
    t2d = mx.zeros((vocab,), mx.bool_)
    t2d[draft_ids] = True
    weights["t2d"] = t2d
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config, indent=1))


def _save_checkpoint(folder: Path, head, optimizer, step: int, cfg: TrainConfig, config: dict,
                     draft_ids, vocab: int, history: list) -> None:
    state = dict(tree_flatten(optimizer.state))
    arrays = {f"head.{k}": v for k, v in trainable(head).items()}
    arrays.update({f"opt.{k}": v for k, v in state.items() if isinstance(v, mx.array)})
    arrays["draft_ids"] = draft_ids
    (folder / CHECKPOINT).parent.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / CHECKPOINT), arrays)
    (folder / STATE).write_text(json.dumps({"step": step, "train": asdict(cfg), "config": config,
                                            "vocab": vocab, "history": history}))
    save_head(head, config, draft_ids, vocab, folder)


def _load_checkpoint(folder: Path, head, optimizer) -> tuple[int, list]:
    arrays = mx.load(str(folder / CHECKPOINT))
    state = json.loads((folder / STATE).read_text())
    head.load_weights([(k[5:], v) for k, v in arrays.items() if k.startswith("head.")],
                      strict=False)
    optimizer.state = tree_unflatten([(k[4:], v) for k, v in arrays.items()
                                      if k.startswith("opt.")])
    return state["step"], state["history"]


def evaluate(head, embed, target: Target, sequences: list, ttt_steps: int,
             batch_size: int = 4, starts: Optional[list[int]] = None,
             window: Optional[int] = None) -> dict:
    """Teacher-forced on held-out sequences: per draft position, the share of
    pairs whose drafts up to it all equal the target's greedy tokens (over its
    whole vocabulary: a token outside the draft vocabulary is a miss); the
    mean accepted length over every position (bonus included) at k =
    1..ttt_steps; and the tokens a verification emits when decoding walks
    the sequence as the engine does (each verification starts after the
    last one's tokens). The walk is the figure that predicts a speed-up:
    verifications start more often after the positions a head misses (an
    easy stretch is crossed in one verification), so it is below the
    average over positions (SmolLM2's chat head: 1.91 tokens a verification
    in the engine, 2.49 averaged over positions, on the same text).
    ``starts[i]``: sequence i's first pair counted (its prompt's last token,
    for an answer the model decodes: the first proposal's pair). ``window``:
    the head attends to the last ``window`` pairs only (what a restart of
    its cache costs a row, ``ttt.unrolled_logits``)."""
    runs, walks = [], {k: [] for k in range(1, ttt_steps + 1)}
    for start in range(0, len(sequences), batch_size):
        tokens, mask = data.pad(sequences[start:start + batch_size])
        if tokens.shape[1] <= ttt_steps + 1:
            continue
        features, _, greedy = target(tokens)
        lengths = ttt.accepted_lengths(head, embed, tokens, features, greedy, target.draft_ids,
                                       ttt_steps, mask, window)
        n = tokens.shape[1] - ttt_steps
        valid = np.asarray(mask[:, :n] * mask[:, ttt_steps:ttt_steps + n]) > 0
        if starts is not None:
            for row, first in enumerate(starts[start:start + batch_size]):
                valid[row, :first] = False
        lengths = np.asarray(lengths)
        runs.append(lengths[valid])
        for row in range(lengths.shape[0]):
            for k, emitted in walks.items():
                emitted += _walk(lengths[row][valid[row]], k)
    if not runs:
        return {"pairs": 0}
    run = np.concatenate(runs)
    return {"pairs": int(run.size),
            "acceptance_per_position": [round(float((run > j).mean()), 4)
                                        for j in range(ttt_steps)],
            "mean_accepted_length": {k: round(float(1 + np.minimum(run, k).mean()), 4)
                                     for k in range(1, ttt_steps + 1)},
            "tokens_per_verification": {k: round(float(np.mean(w)), 4) if w else None
                                        for k, w in walks.items()}}


def evaluate_as_served(head: Eagle3Head, model, *args, **kwargs) -> dict:
    """``evaluate`` with the training head cast to ``model``'s compute dtype,
    as a server runs it; its float32 weights are put back afterwards."""
    weights = head.parameters()
    cast_floating(head, compute_dtype(model))
    try:
        return evaluate(head, *args, **kwargs)
    finally:
        head.update(weights)


def _walk(run: np.ndarray, k: int) -> list[int]:
    """Tokens each verification emits decoding along one sequence with k
    drafts: ``run[t]`` drafts from position t would be kept."""
    out, t = [], 0
    while t < len(run):
        kept = min(int(run[t]), k)
        out.append(kept + 1)
        t += kept + 1
    return out


def train(model, tokenizer, files: list[str], out: str, cfg: TrainConfig,
          init: Optional[str] = None, resume: bool = False, eval_fraction: float = 0.05,
          progress: Callable[[str], None] = print, deadline: Optional[float] = None) -> dict:
    """Train a head and write it to ``out``; returns the last evaluation.

    ``deadline`` (``time.monotonic()``) stops training after the step that
    passes it, with an evaluation and a checkpoint there: a time budget for
    the whole command, data generation included, that ``--resume`` can
    extend.
    """
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    sequences = data.read_sequences(tokenizer, files, cfg.max_len)
    if len(sequences) < 2:
        raise ValueError(f"{', '.join(files)}: fewer than two sequences of text to train on")
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(sequences))
    held = max(1, int(len(sequences) * eval_fraction))
    held_out = [sequences[i] for i in order[:held]]
    train_set = [sequences[i] for i in order[held:]] or held_out
    vocab = mlx_lm_adapter.text_args(model).vocab_size
    embed = mlx_lm_adapter.token_embedding(model)

    if resume and (folder / STATE).exists():
        state = json.loads((folder / STATE).read_text())
        config = state["config"]
        draft_ids = mx.load(str(folder / CHECKPOINT))["draft_ids"]
    elif init:
        config = json.loads((Path(init) / "config.json").read_text())
        d2t = mx.load(str(next(Path(init).glob("*.safetensors"))))["d2t"].astype(mx.int32)
        draft_ids = mx.arange(d2t.shape[0], dtype=mx.int32) + d2t
    else:
        draft_ids = data.draft_vocabulary(train_set, cfg.draft_vocab, vocab)
        config = new_head_config(model, int(draft_ids.shape[0]))
    num_layers = len(mlx_lm_adapter.text_model(model).model.layers)
    layers = aux_layer_ids(config, num_layers)
    head = make_head(model, config, draft_ids, cfg.seed)
    if init and not resume:
        from ..spec_decode.heads.eagle3 import load_eagle3_head

        loaded, _, _ = load_eagle3_head(model, init)
        head.load_weights(list(trainable(loaded).items()), strict=False)
    target = Target(model, layers, draft_ids)
    optimizer = optim.AdamW(learning_rate=schedule(cfg), weight_decay=cfg.weight_decay)
    step, history = 0, []
    if resume and (folder / CHECKPOINT).exists():
        step, history = _load_checkpoint(folder, head, optimizer)
        progress(f"resuming at step {step} of {cfg.steps}")
    if "d2t" in head:
        head.freeze(keys=["d2t"])  # the draft map is data, not a weight

    def loss_fn(head, tokens, features, logprobs, mask):
        return ttt.ttt_loss(head, embed, tokens, features, logprobs, cfg.ttt_steps, mask)

    grad = nn.value_and_grad(head, lambda h, *a: loss_fn(h, *a)[0])
    stream = data.batches(train_set, min(cfg.batch_size, len(train_set)),
                          np.random.default_rng(cfg.seed))
    for _ in range(step):  # the same batches as an uninterrupted run
        next(stream)
    last_eval: dict = {}
    tic, first_step = time.perf_counter(), step
    try:
        while step < cfg.steps:
            tokens, mask = next(stream)
            features, logprobs, _ = target(tokens)
            loss, grads = grad(head, tokens, features, logprobs, mask)
            optimizer.update(head, grads)
            mx.eval(head.parameters(), optimizer.state, loss)
            step += 1
            history.append(round(loss.item(), 6))
            rate = (step - first_step) / max(time.perf_counter() - tic, 1e-9)
            out_of_time = deadline is not None and time.monotonic() >= deadline
            last = step == cfg.steps or out_of_time
            if step % 10 == 0 and step % cfg.eval_every and not last:
                progress(f"step {step}/{cfg.steps}  loss {loss.item():.4f}  {rate:.2f} steps/s")
            if step % cfg.eval_every == 0 or last:
                last_eval = evaluate_as_served(head, model, embed, target, held_out,
                                               cfg.ttt_steps)
                progress(f"step {step}/{cfg.steps}  loss {loss.item():.4f}  held-out "
                         f"acceptance {last_eval.get('acceptance_per_position')}  "
                         f"{rate:.2f} steps/s")
            if step % cfg.checkpoint_every == 0 or last:
                _save_checkpoint(folder, head, optimizer, step, cfg, config, draft_ids, vocab,
                                 history)
            if out_of_time:
                progress(f"out of time at step {step} of {cfg.steps}: the head and a checkpoint "
                         f"are in {folder} (--resume continues)")
                break
    except KeyboardInterrupt:
        progress(f"interrupted at step {step}: the last checkpoint is kept in {folder}")
        raise
    if history and not math.isfinite(history[-1]):
        raise RuntimeError("the loss is not finite: lower --learning-rate")
    return {"step": step, "history": history, "evaluation": last_eval}
