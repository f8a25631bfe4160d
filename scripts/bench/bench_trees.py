#!/usr/bin/env python
"""Trees of drafts against chains at the same pass size, through the engine.

A model drafter (an EAGLE-3 head, an MTP layer, a draft model) decodes the
same prompts at B=1, greedy, at a fixed pass size k: once drafting chains
of k, once trees of k nodes (``--tree-width`` children a node). Tokens a
verification is the figure trees change (a pass over k + 1 tokens costs the
same either way); decode tok/s beside it says what it cost on this machine
(the drafter runs ``width`` tokens a row each depth). Greedy output must be
identical to plain decoding's.

    .venv/bin/python scripts/bench/bench_trees.py --model models/smollm2-135m-instruct \\
        --mode eagle3 --drafter bench_out/heads/smollm2-open \\
        --data bench_out/open_prompts/held_out_answers/regenerated.jsonl --prompts 12 \\
        --k 4 8 --tree-width 3
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


def decode(model, tokenizer, path: str, prompts: list, max_tokens: int, **spec) -> dict:
    """Outputs, decode tok/s (first token to last, summed over requests) and
    tokens a verification of one configuration (``spec``: the speculation
    config's fields; none: plain decoding)."""
    from mlx_lm_server.assembly import make_scheduler
    from mlx_lm_server.decoding.sampling import SamplingParams
    from mlx_lm_server.serving.request import GenerationRequest
    from mlx_lm_server.spec_decode import make_engine
    from mlx_lm_server.spec_decode.config import SpecDecodeConfig

    engine = None
    if spec:
        engine = make_engine(model, SpecDecodeConfig(dynamic=False, adaptive_k=False,
                                                     calibration_seconds=0, **spec),
                             tokenizer, path)
    scheduler = make_scheduler(model, tokenizer, max_batch_size=1, engine=engine)
    scheduler.start()
    try:
        records = run_one_by_one(scheduler, [
            GenerationRequest(p, max_tokens, SamplingParams(temperature=0)) for p in prompts])
        counts = scheduler.spec_stats.tokens
        steps = scheduler.spec_stats.steps
    finally:
        scheduler.shutdown()
        scheduler.join(timeout=10)
    seconds = sum(r["done"] - r["first"] for r in records)
    return {"ids": [r["ids"] for r in records],
            "tok_s": sum(len(r["ids"]) - 1 for r in records) / max(seconds, 1e-9),
            "per_verification": (1 + counts.num_accepted_tokens / counts.num_drafts
                                 if counts and counts.num_drafts else None),
            "by_rank": list(steps.tree_accepted_by_rank) if steps else [],
            "per_position": [round(r, 3) for r in counts.per_position_rates()] if counts else []}


def prompt_ids(tokenizer, record: dict) -> list:
    """A traffic record's prompt, or a chat record's conversation up to its
    last user turn through the chat template."""
    if "prompt_ids" in record:
        return record["prompt_ids"]
    messages = record["messages"]
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return tokenizer.apply_chat_template(messages[:last + 1], add_generation_prompt=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--mode", required=True, choices=["eagle3", "mtp", "draft"])
    p.add_argument("--drafter", default=None, help="--draft-model's folder (eagle3, draft)")
    p.add_argument("--data", required=True,
                   help="traffic records (prompt_ids per line, as train --regenerate "
                        "writes them) or chat records ({\"messages\": [...]})")
    p.add_argument("--prompts", type=int, default=12, help="prompts decoded per configuration")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, nargs="+", default=[4, 8], help="pass sizes (draft nodes)")
    p.add_argument("--tree-width", type=int, default=3)
    p.add_argument("--drafter-scores", action="store_true",
                   help="score tree nodes by the drafter's own probabilities (EAGLE-2's "
                        "scores) instead of the kept rates measured as it runs")
    args = p.parse_args(argv)
    ensure_fast_blas()
    if args.drafter_scores:
        from mlx_lm_server.spec_decode.proposer.node_scores import KeptRates

        KeptRates.log_rates = lambda self: None
    from mlx_lm import load

    model, tokenizer = load(args.model)
    records = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    prompts = [prompt_ids(tokenizer, r) for r in records[:args.prompts]]
    plain = decode(model, tokenizer, args.model, prompts, args.max_tokens)
    rows = []
    for k in args.k:
        for width in (1, args.tree_width):
            r = decode(model, tokenizer, args.model, prompts, args.max_tokens, mode=args.mode,
                       draft_model_path=args.drafter, num_speculative_tokens=k,
                       tree_width=width)
            rows.append({"k": k, "width": width, "tokens_per_verification":
                         round(r["per_verification"] or 0.0, 3),
                         "tok_s": round(r["tok_s"], 2),
                         "vs_plain": round(r["tok_s"] / plain["tok_s"], 3),
                         "accepted_by_sibling_rank": r["by_rank"],
                         "accepted_per_position": r["per_position"],
                         "identical": r["ids"] == plain["ids"]})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.mode} {args.drafter or ''}: {len(prompts)} prompts, B=1, greedy; "
          f"plain {plain['tok_s']:.2f} tok/s; node scores: "
          f"{'the drafter' if args.drafter_scores else 'measured kept rates'}")
    print("| k | chain tok/verif | tree tok/verif | tree / chain | chain tok/s | tree tok/s |")
    print("|---|---|---|---|---|---|")
    for chain, tree in zip(rows[::2], rows[1::2]):
        print(f"| {chain['k']} | {chain['tokens_per_verification']} | "
              f"{tree['tokens_per_verification']} | "
              f"{tree['tokens_per_verification'] / max(chain['tokens_per_verification'], 1e-9):.3f}x"
              f" | {chain['vs_plain']}x | {tree['vs_plain']}x |")
    out = ROOT / "bench_out"
    out.mkdir(exist_ok=True)
    (out / f"bench_trees_{args.mode}.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    from mlx_lm_server.parallel.liveness import exit_now

    exit_now(main())
