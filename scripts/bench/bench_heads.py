#!/usr/bin/env python
"""What a learned drafter costs per drafted token, as a share of a target step.

A drafter pays when the tokens it adds per verification are worth more than
its forwards; the controller prices it by its measured cost against the
target's step (``control/costs.py``). This script measures those prices side
by side, for drafters shaped as published ones are (random weights: the cost
does not depend on them), on B rows of C context tokens each:

- the target's plain step (B x 1 token) and its verification (B x (K+1));
- an EAGLE-3 head (one layer shaped like the target's, a 32k draft
  vocabulary) drafting K tokens, chained, through ``HeadProposer``;
- a DFlash drafter (``--dflash-layers`` layers shaped like the target's,
  block 16) drafting K tokens in one block pass, through ``DFlashProposer``;
- the hidden-state capture on a plain step (installed for heads only):
  blocks of steps with and without it, alternated.

Each proposal is timed in the steady state a server runs: one new target
state per row since the last, the previous block's entries rolled back.
The drafters and the features are in the target's compute dtype (a 4-bit
target's: its scales' dtype), as the server runs them.

    .venv/bin/python scripts/bench/bench_heads.py --model models/smollm2-135m-instruct \\
        --batch-sizes 1 4 16 --k 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mlx_lm_server.drafter.prices import (  # noqa: E402
    median_seconds,
    proposal_seconds,
    target_prices,
)
from mlx_lm_server.runtime.blas import ensure_fast_blas  # noqa: E402


def capture_ratio(model, layers, plain_step, reps: int, blocks: int = 4) -> float:
    """A plain step with the capture installed over one without, alternated."""
    from mlx_lm_server.runtime import mlx_lm_adapter

    on, off = [], []
    for i in range(2 * blocks):
        with_capture = i % 2 == 1
        capture = mlx_lm_adapter.capture_hidden(model, layers) if with_capture else None

        def run():
            plain_step()
            if capture is not None:
                capture.take()
        (on if with_capture else off).append(median_seconds(run, reps, warmup=2))
        if with_capture:
            mlx_lm_adapter.release_capture(model)
    return statistics.median(on) / statistics.median(off)


def eagle3_proposer(model):
    import mlx.core as mx

    from mlx_lm_server.drafter.train import make_head, new_head_config
    from mlx_lm_server.runtime import mlx_lm_adapter
    from mlx_lm_server.spec_decode.heads import compute_dtype
    from mlx_lm_server.spec_decode.heads.eagle3 import aux_layer_ids
    from mlx_lm_server.spec_decode.proposer.head import HeadProposer

    V = mlx_lm_adapter.text_args(model).vocab_size
    num_layers = len(mlx_lm_adapter.text_model(model).model.layers)
    config = new_head_config(model, min(32000, V))
    head = make_head(model, config, mx.arange(min(32000, V), dtype=mx.int32), seed=0)
    head.set_dtype(compute_dtype(model))
    layers = aux_layer_ids(config, num_layers)
    return HeadProposer(head, mlx_lm_adapter.token_embedding(model), head.logits, layers), layers


def dflash_proposer(model, num_layers: int):
    from mlx_lm_server.runtime import mlx_lm_adapter
    from mlx_lm_server.spec_decode.heads import compute_dtype
    from mlx_lm_server.spec_decode.heads.dflash import DFlashHead
    from mlx_lm_server.spec_decode.proposer.dflash import DFlashProposer

    args = mlx_lm_adapter.text_args(model)
    L = len(mlx_lm_adapter.text_model(model).model.layers)
    heads = args.num_attention_heads
    layers = sorted({round(1 + i * (L - 3) / 4) for i in range(5)})
    config = {"hidden_size": args.hidden_size, "num_hidden_layers": num_layers,
              "intermediate_size": getattr(args, "intermediate_size", 4 * args.hidden_size),
              "num_attention_heads": heads,
              "num_key_value_heads": getattr(args, "num_key_value_heads", None) or heads,
              "head_dim": getattr(args, "head_dim", None) or args.hidden_size // heads,
              "rms_norm_eps": 1e-6, "rope_theta": 1e6, "block_size": 16,
              "dflash_config": {"mask_token_id": 0, "target_layer_ids": layers}}
    head = DFlashHead(config, len(layers))
    head.set_dtype(compute_dtype(model))
    return DFlashProposer(head, mlx_lm_adapter.token_embedding(model),
                          mlx_lm_adapter.output_projection(model), layers), layers


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--context", type=int, default=512, help="tokens per row (C)")
    p.add_argument("--k", type=int, default=4, help="drafts per proposal (K)")
    p.add_argument("--dflash-layers", type=int, default=5,
                   help="DFlash drafter layers (z-lab's Qwen3 drafters: 5)")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)

    ensure_fast_blas()
    from mlx_lm import load

    from mlx_lm_server.runtime import mlx_lm_adapter
    from mlx_lm_server.spec_decode.heads import compute_dtype

    model, _ = load(args.model)
    dtype = compute_dtype(model)  # a 4-bit target's too: its scales' dtype, not uint32
    H = mlx_lm_adapter.text_args(model).hidden_size
    eagle3, e_layers = eagle3_proposer(model)
    dflash, d_layers = dflash_proposer(model, args.dflash_layers)
    print(f"{args.model}: C={args.context}, K={args.k}, DFlash {args.dflash_layers} layers, "
          f"{dtype}", flush=True)
    print("| B | target step ms | verify (K+1) ms | EAGLE-3 ms/draft | share of a step "
          "| DFlash ms/draft | share of a step | step with capture |")
    print("|---|---|---|---|---|---|---|---|")
    for B in args.batch_sizes:
        prices = target_prices(model, B, args.context, [args.k], args.reps)
        e = proposal_seconds(eagle3, 3 * H, B, args.context, args.k, dtype, args.reps) / args.k
        d = proposal_seconds(dflash, len(d_layers) * H, B, args.context, args.k, dtype,
                             args.reps) / args.k
        ratio = capture_ratio(model, e_layers, prices["run_step"], args.reps)
        step = prices["step"]
        print(f"| {B} | {step * 1e3:.1f} | {prices['verify'][args.k] * 1e3:.1f} | {e * 1e3:.2f} | "
              f"{e / step:.2f} | {d * 1e3:.2f} | {d / step:.2f} | {ratio:.3f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
