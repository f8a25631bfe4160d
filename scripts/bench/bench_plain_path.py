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

    .venv/bin/python scripts/bench/bench_plain_path.py --model models/qwen2.5-coder-0.5b-instruct \\
        --batch-sizes 4 16 --proposer ngram suffix

``--grammar`` holds every row to a JSON schema, as ``response_format``
does: both paths then fill and apply its masks every step, and the
engine's also looks for grammar-forced tokens to verify alone.

``--live`` compares the engine with its controller left alone (probes,
verifications, a head's drafts, where it decides so) against the same
engine forced to plain steps (the plain path above, whose cost against
upstream's the default run measures), by tokens emitted per second over
their blocks. Greedy output is the same
either way, so both paths write one text; blocks alternate along it, one
fresh batch per chat prompt in turn (``--prompts``), so that the text's easy
and hard stretches fall to both. This is what speculation costs or buys
where whole-request waves (``bench_spec.py``) cannot resolve a few percent:
on this machine a 6 s wave's rate moves by 5% from one run to the next.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from intervals import ratio_interval  # noqa: E402

from mlx_lm_server.runtime.blas import ensure_fast_blas  # noqa: E402


def plain_only(controller, when=lambda: True) -> None:
    """The controller decides as it would, then (while ``when()``) the step
    stays plain with its shadow drafts (as a decision that could pay but did
    not)."""
    choose = controller.choose

    def forced(*args, **kwargs):
        decision = choose(*args, **kwargs)
        if not when():
            return decision
        return dataclasses.replace(decision, k=0, per_sequence_k={}, cannot_pay=False)

    controller.choose = forced


def emitted(batch) -> int:
    """Tokens the batch's rows have emitted so far, less their budgets (only
    differences mean anything)."""
    from mlx_lm_server.runtime import mlx_lm_adapter

    return -sum(mlx_lm_adapter.tokens_left(batch, i) for i in range(len(batch.uids)))


def run(model, tokenizer, B: int, proposer: str, args) -> dict:
    from workloads import CHAT, chat_tokens

    from mlx_lm_server.spec_decode import make_engine
    from mlx_lm_server.spec_decode.config import SpecDecodeConfig

    needs_folder = proposer.split(",")[-1] in ("draft", "eagle3", "dflash")
    engine = make_engine(model, SpecDecodeConfig(
        mode=proposer, num_speculative_tokens=args.k,
        draft_model_path=args.draft_model if needs_folder else None), tokenizer, args.model)
    live = [False]  # with --live: whether the controller is left alone now
    plain_only(engine.controller, when=lambda: not live[0])
    proposed = [0]  # rows the shadow drafts asked the proposer for
    shadow = engine.proposer.shadow or engine.proposer  # a mix's: its cheap proposer
    propose = shadow.propose

    def counted(uids, *a, **kw):
        proposed[0] += len(uids)
        return propose(uids, *a, **kw)

    shadow.propose = counted
    times: dict = {True: [], False: []}
    tokens: dict = {True: [], False: []}
    for p in range(args.prompts if args.live else 1):
        prompts = [chat_tokens(tokenizer, CHAT[(p * B + i) % len(CHAT)]) for i in range(B)]
        context = blocks(model, engine, prompts, args, times, tokens, live,
                         turn=(p * B // len(CHAT)) % 2)
    if args.live:
        rate = {e: 1e3 * sum(tokens[e]) / sum(times[e]) for e in (True, False)}
        ratios = [(n / t) / (m / u) for n, t, m, u
                  in zip(tokens[True], times[True], tokens[False], times[False])]
        return {"B": B, "proposer": proposer, "context": context, "live": True,
                "engine_tok_s": rate[True], "plain_tok_s": rate[False],
                "ratio": rate[True] / rate[False], "ratio_ci95": list(ratio_interval(ratios)),
                "verify_steps": engine.steps.verify_steps,
                "plain_steps": engine.steps.plain_steps,
                "propose_s": engine.steps.time_propose,
                "proposer_stats": engine.proposer.stats(),
                "engine_blocks_ms": times[True], "plain_blocks_ms": times[False],
                "engine_blocks_tokens": tokens[True], "plain_blocks_tokens": tokens[False]}
    ratios = [e / u for e, u in zip(times[True], times[False])]
    return {"B": B, "proposer": proposer, "context": context, "shadow_rows": proposed[0],
            "engine_ms": statistics.median(times[True]),
            "upstream_ms": statistics.median(times[False]),
            "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
            "engine_blocks_ms": times[True], "upstream_blocks_ms": times[False]}


def grammar_batch(model, tokenizer, engine, prompts: list) -> tuple:
    """``prefilled_batch`` with a grammar on every row: JSON records to
    ``bench_matrix``'s function schema, one a line, and no end of sequence
    (a logit bias), so that no row finishes mid-run."""
    import json

    from bench_matrix import FUNCTION_SCHEMA
    from profile_step import prefilled_batch

    from mlx_lm_server.decoding.sampling import SamplingParams
    from mlx_lm_server.decoding.structured import (JSON_OPTIONS, Constraint, GrammarTokenizer,
                                                   lark_grammar, logits_width)

    eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])
    params = SamplingParams(temperature=0.0, logit_bias=tuple((t, -1e9) for t in eos))
    words = GrammarTokenizer(tokenizer, logits_width(model, tokenizer))
    schema = {**FUNCTION_SCHEMA, "x-guidance": JSON_OPTIONS}
    grammar = lark_grammar(f'start: record+\nrecord: %json {json.dumps(schema)} "\\n"\n')
    return prefilled_batch(model, engine, prompts, params,
                           [Constraint(words, grammar, len(p)) for p in prompts])


def blocks(model, engine, prompts, args, times: dict, tokens: dict, live: list,
           turn: int = 0) -> int:
    """One prefilled batch of ``prompts``, blocks alternating (A B, B A, ...)
    between the engine's step, its controller forced to plain steps, and
    upstream's step; with ``--live``, between the engine's step with its
    controller left alone (``live[0]``) and forced (so that a head's and the
    n-gram index's bookkeeping stays whole in both). Each block's ms per
    step (``--live``: ms) into ``times``, its emitted tokens into
    ``tokens``; returns the context length reached. An odd ``turn`` starts
    with the other path (a prompt's second pass puts each block on the
    other path's stretch of the same text)."""
    import mlx.core as mx
    from profile_step import prefilled_batch

    from mlx_lm_server.runtime import mlx_lm_adapter

    if args.grammar:
        gen, batch = grammar_batch(model, args.tokenizer, engine, prompts)
    else:
        gen, batch = prefilled_batch(model, engine, prompts)

    def use(engine_on: bool) -> None:
        if args.live:
            live[0] = engine_on
            return
        step = engine.speculative_step if engine_on else mlx_lm_adapter.plain_step
        mlx_lm_adapter.install_generation_step(gen, step)

    for engine_on in (True, False):  # warm both paths
        use(engine_on)
        for _ in range(args.warmup):
            gen.next()
    r, start = 0, emitted(batch)

    def more() -> bool:
        """--live: the answers' first --max-tokens tokens, as a server's
        requests would end there (past its natural end a model's text often
        repeats itself, which flatters any copying proposer); else --rounds."""
        if args.live:
            return emitted(batch) - start < args.max_tokens * len(prompts)
        return r < args.rounds

    while more():
        r += 1
        for engine_on in ((True, False) if (r + turn) % 2 == 1 else (False, True)):
            use(engine_on)
            gen.next()  # the switch-over step
            mx.synchronize()
            before = emitted(batch)
            tic = time.perf_counter()
            for _ in range(args.block):
                gen.next()
            mx.synchronize()
            elapsed = 1e3 * (time.perf_counter() - tic)
            if args.live:
                times[engine_on].append(elapsed)
                tokens[engine_on].append(emitted(batch) - before)
            else:
                times[engine_on].append(elapsed / args.block)
    for uid in list(batch.uids):
        engine.remove_sequence(uid)
    context = len(batch.tokens[0])
    gen.close()
    return context


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
    p.add_argument("--live", action="store_true",
                   help="the engine with its controller left alone (verifications "
                        "included) against the same engine forced to plain steps, by "
                        "tokens emitted per second")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="with --live: each batch's blocks end once its rows emitted this many")
    p.add_argument("--prompts", type=int, default=8,
                   help="with --live: fresh batches, one per chat prompt in turn")
    p.add_argument("--grammar", action="store_true",
                   help="every row held to a JSON schema (records without end), as "
                        "response_format holds a request: both paths apply its masks")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    ensure_fast_blas()
    from mlx_lm import load

    model, tokenizer = load(args.model)
    args.tokenizer = tokenizer
    rows = []
    for B in args.batch_sizes:
        for proposer in args.proposer:
            row = run(model, tokenizer, B, proposer, args)
            rows.append(row)
            if args.live:
                lo, hi = row["ratio_ci95"]
                print(f"B={B:<3} {proposer:<7} live: engine {row['engine_tok_s']:.2f} tok/s, "
                      f"forced plain {row['plain_tok_s']:.2f}, ratio {row['ratio']:.3f} "
                      f"(95% CI of the mean block ratio {lo:.3f}-{hi:.3f}); "
                      f"{row['verify_steps']} of {row['verify_steps'] + row['plain_steps']} "
                      f"engine steps verified, {row['propose_s']:.2f} s proposing", flush=True)
                print(f"  proposer: {json.dumps(row['proposer_stats'])}", flush=True)
                continue
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
