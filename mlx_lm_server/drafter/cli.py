"""``mlx-lm-server-drafter``: train and evaluate EAGLE-3 heads for a model.

    mlx-lm-server-drafter train --model M --data chats.jsonl src/*.py --out heads/M --steps 2000
    mlx-lm-server-drafter evaluate --model M --head heads/M --data held_out.jsonl
    mlx-lm-server --model M --spec-decode eagle3 --draft-model heads/M
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import fields
from pathlib import Path

from ..runtime.blas import ensure_fast_blas


def build_parser() -> argparse.ArgumentParser:
    from .train import TrainConfig

    p = argparse.ArgumentParser(prog="mlx-lm-server-drafter", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train an EAGLE-3 head (the speculators format) for a model")
    t.add_argument("--model", required=True, help="the target: an MLX model folder")
    t.add_argument("--data", nargs="+", required=True,
                   help="chat JSONL ({\"messages\": [...]} per line, through the model's chat "
                        "template) and/or text and source files")
    t.add_argument("--out", required=True, help="the head's folder (config.json, "
                   "model.safetensors; checkpoints beside them)")
    t.add_argument("--init", help="start from this EAGLE-3 head (fine-tuning)")
    t.add_argument("--resume", action="store_true",
                   help="continue from the checkpoint in --out (same batches, same curve)")
    t.add_argument("--eval-fraction", type=float, default=0.05,
                   help="share of the sequences held out for the acceptance figures")
    t.add_argument("--regenerate", action="store_true",
                   help="the model writes the answers itself: each chat record's "
                        "conversation up to its last user turn (and each recorded prompt) "
                        "is answered through the batched engine and the answer replaces "
                        "the data's, so the head learns the model's own text (recommended); "
                        "kept in OUT/regenerated.jsonl for --resume")
    t.add_argument("--regenerate-max-tokens", type=int, default=256,
                   help="--regenerate: most tokens per answer (default %(default)s)")
    t.add_argument("--max-minutes", type=float,
                   help="stop after this many minutes of the whole command (data generation "
                        "included), with a checkpoint at the stop; the schedule still "
                        "follows --steps")
    t.add_argument("--regenerate-temperature", type=float, default=0.0,
                   help="--regenerate: sampling temperature of the answers (default "
                        "%(default)s: greedy)")
    d = TrainConfig()
    helps = {"steps": "optimizer steps", "batch_size": "sequences per step",
             "max_len": "tokens per sequence (longer text is cut into windows)",
             "ttt_steps": "draft steps unrolled in training (training-time test)",
             "learning_rate": "peak AdamW learning rate", "warmup": "linear warm-up steps",
             "weight_decay": "AdamW weight decay",
             "draft_vocab": "draft vocabulary: the most frequent target tokens in the data",
             "checkpoint_every": "steps between checkpoints",
             "eval_every": "steps between held-out acceptance figures", "seed": "random seed"}
    for f in fields(TrainConfig):
        t.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(d, f.name)),
                       default=getattr(d, f.name), help=f"{helps[f.name]} (default %(default)s)")
    r = sub.add_parser("regenerate", help="the model's own answers to chat JSONL records, "
                       "as train --regenerate writes them (held-out text for evaluate)")
    r.add_argument("--model", required=True)
    r.add_argument("--data", nargs="+", required=True, help="chat JSONL files")
    r.add_argument("--out", required=True, help="folder for regenerated.jsonl")
    r.add_argument("--max-tokens", type=int, default=256, help="most tokens an answer has")
    r.add_argument("--temperature", type=float, default=0.0)
    e = sub.add_parser("evaluate", help="teacher-forced acceptance of a head on held-out text")
    e.add_argument("--model", required=True)
    e.add_argument("--head", required=True, help="an EAGLE-3 head folder")
    e.add_argument("--data", nargs="+", required=True)
    e.add_argument("--max-len", type=int, default=512)
    e.add_argument("--k", type=int, default=3, help="draft positions scored")
    e.add_argument("--window", type=int, default=None,
                   help="the head attends to the last N pairs only, as a row whose head "
                        "cache restarted over them (the server restarts a row that waited "
                        "more than 64): what that costs its acceptance")
    e.add_argument("--price-batch", type=int, default=1,
                   help="rows at which the target's steps and the head's drafts are timed "
                        "for the predicted speed-up (0: no timing)")
    e.add_argument("--price-context", type=int, default=512,
                   help="context tokens per row for that timing")
    return p


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _regenerated(model, tokenizer, files, out: str, max_tokens: int, temperature: float):
    """The data with the chat records' answers the model's own (``OUT/regenerated.jsonl``)."""
    from .regenerate import regenerated_files

    Path(out).mkdir(parents=True, exist_ok=True)
    return regenerated_files(model, tokenizer, files, Path(out), max_tokens, temperature,
                             progress=_say)


def main(argv=None) -> int:
    ensure_fast_blas()
    args = build_parser().parse_args(argv)
    # Ctrl-C, and SIGTERM, stop training at once and keep the last checkpoint
    # (a job started in the background inherits SIGINT ignored: set it again).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    from mlx_lm import load

    from .train import TrainConfig, train

    started = time.monotonic()
    model, tokenizer = load(args.model)
    if args.command == "train":
        deadline = started + 60 * args.max_minutes if args.max_minutes else None
        cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
        try:
            files = args.data
            if args.regenerate:
                files = _regenerated(model, tokenizer, files, args.out,
                                     args.regenerate_max_tokens, args.regenerate_temperature)
            result = train(model, tokenizer, files, args.out, cfg, init=args.init,
                           resume=args.resume, eval_fraction=args.eval_fraction,
                           progress=_say, deadline=deadline)
        except KeyboardInterrupt:
            return 130
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(json.dumps({"head": args.out, "steps": result["step"],
                          "evaluation": result["evaluation"]}))
        return 0
    if args.command == "regenerate":
        try:
            files = _regenerated(model, tokenizer, args.data, args.out, args.max_tokens,
                                 args.temperature)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(json.dumps({"regenerated": files}))
        return 0
    from ..runtime import mlx_lm_adapter
    from ..spec_decode.heads.eagle3 import load_eagle3_head
    from . import data
    from .train import Target, evaluate

    try:
        head, layers, embed = load_eagle3_head(model, args.head)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    draft_ids = head.draft_ids()
    sequences = data.read_sequences(tokenizer, args.data, args.max_len)
    target = Target(model, layers, draft_ids)
    embed = embed or mlx_lm_adapter.token_embedding(model)
    result = evaluate(head, embed, target, sequences, args.k, window=args.window)
    if args.price_batch > 0 and result.get("pairs"):
        from .prices import head_speedups

        result["on_this_machine"] = head_speedups(model, head, embed, layers,
                                                  result["tokens_per_verification"],
                                                  args.price_batch, args.price_context)
    print(json.dumps(result))
    return 0


def entry() -> None:
    """The console script: ``main``, then out without interpreter teardown,
    which after the batched engine's thread has run MLX (``regenerate``)
    aborted in some runs ("terminate called without an active exception")."""
    from ..parallel.liveness import exit_now

    exit_now(main())


if __name__ == "__main__":
    entry()
