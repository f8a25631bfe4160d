#!/usr/bin/env python
"""A trained EAGLE-3 head: the speed-up its acceptance predicts against the one measured.

On held-out traffic records (``prompt_ids`` and the model's own greedy
``output_ids``, as ``train --regenerate`` writes them): the head's
teacher-forced mean accepted length at k on those very sequences
(``evaluate``), this machine's
prices (``drafter/prices.py``) and the speed-up they predict; then the
model decodes the same prompts at B=1 through the engine, plain and with
the head at a fixed k, and the measured ratio of decode speeds (first
token to last, prefill left out) is set beside the prediction. Greedy
output must be identical.

    .venv/bin/python scripts/bench/bench_head_speedup.py --model models/smollm2-135m-instruct \\
        --head bench_out/heads/smollm2-chat \\
        --data bench_out/prompts/held_out_answers/regenerated.jsonl --prompts 8 --k 3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from waves import run_one_by_one  # noqa: E402

from mlx_lm_server.runtime.blas import ensure_fast_blas  # noqa: E402


def decode(model, tokenizer, prompts: list, max_tokens: int, mode: str, head: str, k: int):
    """(outputs, decode seconds summed over requests, tokens after the first)."""
    from mlx_lm_server.assembly import make_scheduler
    from mlx_lm_server.decoding.sampling import SamplingParams
    from mlx_lm_server.serving.request import GenerationRequest
    from mlx_lm_server.spec_decode import make_engine
    from mlx_lm_server.spec_decode.config import SpecDecodeConfig

    engine = None
    if mode != "none":
        engine = make_engine(model, SpecDecodeConfig(
            mode=mode, draft_model_path=head, num_speculative_tokens=k, dynamic=False,
            adaptive_k=False, calibration_seconds=0), tokenizer, "target")
    scheduler = make_scheduler(model, tokenizer, max_batch_size=1, engine=engine)
    scheduler.start()
    try:
        records = run_one_by_one(scheduler, [GenerationRequest(p, max_tokens,
                                                               SamplingParams(temperature=0))
                                             for p in prompts])
        counts = scheduler.spec_stats.tokens
    finally:
        scheduler.shutdown()
        scheduler.join(timeout=10)
    per_verification = (1 + counts.num_accepted_tokens / counts.num_drafts
                        if counts.num_drafts else None)
    return ([r["ids"] for r in records], sum(r["done"] - r["first"] for r in records),
            sum(len(r["ids"]) - 1 for r in records), per_verification)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--head", required=True)
    p.add_argument("--data", required=True, help="traffic records (prompt_ids, output_ids)")
    p.add_argument("--prompts", type=int, default=8, help="prompts decoded per mode")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=3)
    args = p.parse_args(argv)
    ensure_fast_blas()
    from mlx_lm import load

    from mlx_lm_server.drafter.prices import head_speedups
    from mlx_lm_server.drafter.train import Target, evaluate
    from mlx_lm_server.runtime import mlx_lm_adapter
    from mlx_lm_server.spec_decode.heads.eagle3 import load_eagle3_head

    model, tokenizer = load(args.model)
    head, layers, embed = load_eagle3_head(model, args.head)
    embed = embed or mlx_lm_adapter.token_embedding(model)
    everything = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    records = everything[:args.prompts]
    prompts = [r["prompt_ids"] for r in records]
    # The answers' positions only (the records hold the model's greedy answers):
    # over every record, and over the very sequences decoded below.
    target = Target(model, layers, head.draft_ids())

    def acceptance(chosen):
        return evaluate(head, embed, target, [r["prompt_ids"] + r["output_ids"][:args.max_tokens]
                                              for r in chosen], args.k,
                        starts=[len(r["prompt_ids"]) - 1 for r in chosen])

    held_out = acceptance(everything)
    accepted = acceptance(records)
    # Priced at the decoded prompts' typical context: the prompt and half the answer.
    context = round(sum(len(r["prompt_ids"]) + min(len(r["output_ids"]), args.max_tokens) / 2
                        for r in records) / len(records))
    predicted = head_speedups(model, head, embed, layers,
                              {args.k: accepted["tokens_per_verification"][args.k]},
                              context=context)
    plain, plain_s, plain_n, _ = decode(model, tokenizer, prompts, args.max_tokens, "none",
                                        args.head, args.k)
    ours, ours_s, ours_n, emitted = decode(model, tokenizer, prompts, args.max_tokens,
                                           "eagle3", args.head, args.k)
    measured = (ours_n / ours_s) / (plain_n / plain_s)
    out = {"held_out_answers": held_out, "acceptance": accepted, "on_this_machine": predicted,
           "plain_tok_s": round(plain_n / plain_s, 2), "eagle3_tok_s": round(ours_n / ours_s, 2),
           "measured_speedup": round(measured, 3),
           "engine_tokens_per_verification": round(emitted, 3) if emitted else None,
           "predicted_speedup": predicted["predicted_speedup"][args.k],
           "identical": plain == ours}
    print(json.dumps(out))
    return 0 if plain == ours else 1


if __name__ == "__main__":
    from mlx_lm_server.parallel.liveness import exit_now

    exit_now(main())
