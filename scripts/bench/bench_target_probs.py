"""Cost of preparing a verdict's p (``target_probs.py``): the rows' logits
processors over a batch's [B, k + 1, V] logits, and the whole verdict
(processors, filters, draws, rejection sampling), without the model.

Half the rows have a repetition and a presence penalty over a 1000-token
history, half have no processors; all sample at T=0.7 with top-p 0.95.
Two draft layouts: every row with k drafts, and a prompt-lookup-like mix
(drafts for some rows only). "host" is the time to build the lazy graph
(what a GPU's host pays before the device can start), "total" includes
evaluating it. ``--baseline DIR`` runs the same measurements against the
package in DIR (another checkout, e.g. ``git worktree add /tmp/before
HEAD~1``) in a subprocess and prints both side by side.

    python scripts/bench/bench_target_probs.py [--batch 8] [--k 8] [--vocab 49152]
    python scripts/bench/bench_target_probs.py --baseline /tmp/before
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from typing import Optional

from baseline import baseline_figures


@dataclass
class Row:
    params: object
    key: Optional[object]


def _process_logits():
    try:
        from mlx_lm_server.spec_decode.target_probs import process_logits
        return process_logits
    except ImportError:  # a checkout from before target_probs.py: every position processed
        from mlx_lm_server.spec_decode.verifier import process_logits as every_position
        return lambda logits, processors, contexts, drafts, num_drafts: every_position(
            logits, processors, contexts, drafts)


def measure(B: int, k: int, vocab: int, steps: int, history: int = 1000) -> dict:
    import mlx.core as mx
    import numpy as np

    from mlx_lm_server.decoding.sampling import SamplingParams, make_processors
    from mlx_lm_server.spec_decode.drafts import Context
    from mlx_lm_server.spec_decode.verifier import verify_rows

    process_logits = _process_logits()
    rng = np.random.default_rng(0)
    penalised = SamplingParams(temperature=0.7, top_p=0.95, repetition_penalty=1.1,
                               presence_penalty=0.3)
    plain = SamplingParams(temperature=0.7, top_p=0.95)
    params = [penalised if i % 2 == 0 else plain for i in range(B)]
    processors = [make_processors(p) for p in params]
    contexts = [Context(rng.integers(0, vocab, history).tolist(), 5) for _ in range(B)]
    drafts_np = rng.integers(0, vocab, (B, k))
    logits = mx.random.normal((B, k + 1, vocab), key=mx.random.key(0)) * 4
    drafts = mx.array(drafts_np, dtype=mx.int32)
    mx.eval(logits, drafts)
    layouts = {"every row k drafts": [k] * B,
               "drafts for some rows": [k if i % 4 == 0 else 0 for i in range(B)]}
    out = {}
    for layout, num in layouts.items():
        num_drafts = mx.array(num, dtype=mx.int32)

        def processed():
            return process_logits(logits, processors, contexts, drafts_np, num)

        def verdict():
            rows = [Row(p, None) for p in params]
            v = verify_rows(rows, processed(), drafts, num_drafts, max_k=k)
            return v.output, v.num_accepted

        for name, fn in (("processors", processed), ("verdict", verdict)):
            host, total = [], []
            for step in range(steps + 3):  # three to warm up
                start = time.perf_counter()
                result = fn()
                built = time.perf_counter()
                mx.eval(result)
                if step >= 3:
                    host.append(built - start)
                    total.append(time.perf_counter() - start)
            out[f"{layout}: {name}"] = (1000 * statistics.median(host),
                                        1000 * statistics.median(total))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary by default")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--baseline", help="a checkout whose package to compare against")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    ours = measure(args.batch, args.k, args.vocab, args.steps)
    if args.json:
        print(json.dumps(ours))
        return
    base = None
    if args.baseline:
        base = baseline_figures(__file__, ["--batch", str(args.batch), "--k", str(args.k),
                                           "--vocab", str(args.vocab), "--steps",
                                           str(args.steps)], args.baseline)
    print(f"B={args.batch}, k={args.k}, V={args.vocab}: median ms, host (graph built) / total")
    for name, (host, total) in ours.items():
        line = f"  {name:<40} {host:7.2f} / {total:8.2f}"
        if base is not None:
            b_host, b_total = base[name]
            line += f"   baseline {b_host:7.2f} / {b_total:8.2f}"
        print(line)


if __name__ == "__main__":
    main()
