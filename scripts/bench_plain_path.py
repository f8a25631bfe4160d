#!/usr/bin/env python
"""What a plain step costs through the speculative engine, against upstream's.

While the controller keeps speculation off, every step still passes through
the engine: the step timer, the controller's decision, the shadow drafts of a
cheap proposer (one proposal per row without an open draft) and the cache
realignment check, then upstream's own one-token step. None of that may cost
a plain step anything, on a CPU (where host work takes a core from the
forward) or on a GPU (where it must hide behind the pipelined pass).

One batch of B chat prompts is prefilled through upstream's
``BatchGenerator`` with the engine installed; the controller's real decision
is computed every step and then forced to k=0 (shadow drafts on), so the
engine pays its whole plain-path cost and never verifies (a learned drafter:
its capture of the target's hidden states, handed to the head every step). Blocks of steps
then alternate between the engine's step and upstream's own on the same
batch (A B, B A, ...; the first step of a block is not timed), in the
pipelined loop a server runs, synchronised only at block ends.

    .venv/bin/python scripts/bench_plain_path.py --model models/qwen2.5-coder-0.5b-instruct \\
        --batch-sizes 4 16 --proposer ngram suffix
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from mlx_lm_server.runtime.blas import ensure_fast_blas  # noqa: E402


def plain_only(controller) -> None:
    """The controller decides as it would, then the step stays plain with its
    shadow drafts (as a decision that could pay but did not)."""
    choose = controller.choose

    def forced(*args, **kwargs):
        return dataclasses.replace(choose(*args, **kwargs), k=0, per_sequence_k={},
                                   cannot_pay=False)

    controller.choose = forced


def run(model, tokenizer, B: int, proposer: str, args) -> dict:
    import mlx.core as mx
    from profile_step import prefilled_batch
    from workloads import CHAT, chat_tokens

    from mlx_lm_server.runtime import mlx_lm_adapter
    from mlx_lm_server.spec_decode import make_engine
    from mlx_lm_server.spec_decode.config import SpecDecodeConfig

    prompts = [chat_tokens(tokenizer, CHAT[i % len(CHAT)]) for i in range(B)]
    needs_folder = proposer.split(",")[-1] in ("draft", "eagle3", "dflash")
    engine = make_engine(model, SpecDecodeConfig(
        mode=proposer, num_speculative_tokens=args.k,
        draft_model_path=args.draft_model if needs_folder else None), tokenizer, args.model)
    plain_only(engine.controller)
    proposed = [0]  # rows the shadow drafts asked the proposer for
    propose = engine.proposer.propose

    def counted(uids, *a, **kw):
        proposed[0] += len(uids)
        return propose(uids, *a, **kw)

    engine.proposer.propose = counted
    gen, batch = prefilled_batch(model, engine, prompts)

    def use(engine_on: bool) -> None:
        step = engine.speculative_step if engine_on else mlx_lm_adapter.plain_step
        mlx_lm_adapter.install_generation_step(gen, step)

    for engine_on in (True, False):  # warm both paths
        use(engine_on)
        for _ in range(args.warmup):
            gen.next()
    times: dict = {True: [], False: []}
    for r in range(args.rounds):
        for engine_on in ((True, False) if r % 2 == 0 else (False, True)):
            use(engine_on)
            gen.next()  # the switch-over step
            mx.synchronize()
            tic = time.perf_counter()
            for _ in range(args.block):
                gen.next()
            mx.synchronize()
            times[engine_on].append(1e3 * (time.perf_counter() - tic) / args.block)
    context = len(batch.tokens[0])
    gen.close()
    ratios = [e / u for e, u in zip(times[True], times[False])]
    return {"B": B, "proposer": proposer, "context": context, "shadow_rows": proposed[0],
            "engine_ms": statistics.median(times[True]),
            "upstream_ms": statistics.median(times[False]),
            "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
            "engine_blocks_ms": times[True], "upstream_blocks_ms": times[False]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[4, 16])
    p.add_argument("--proposer", nargs="+", default=["ngram", "suffix"],
                   help="cheap proposers whose shadow drafts run on plain steps, or a "
                        "learned drafter's mode (eagle3 with --draft-model, mtp): its "
                        "hidden-state capture and bookkeeping on plain steps")
    p.add_argument("--draft-model", default=None, help="the head for eagle3 or dflash modes")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--block", type=int, default=12, help="timed steps per block")
    p.add_argument("--rounds", type=int, default=8, help="blocks per path")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    ensure_fast_blas()
    from mlx_lm import load

    model, tokenizer = load(args.model)
    rows = []
    for B in args.batch_sizes:
        for proposer in args.proposer:
            row = run(model, tokenizer, B, proposer, args)
            rows.append(row)
            lo, hi = row["ratio_range"]
            print(f"B={B:<3} {proposer:<7} context {row['context']}: engine's plain path "
                  f"{row['engine_ms']:.2f} ms/step, upstream's {row['upstream_ms']:.2f}, "
                  f"ratio {row['ratio']:.3f} (blocks {lo:.3f}-{hi:.3f}); shadow drafts asked for "
                  f"{row['shadow_rows']} rows", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
