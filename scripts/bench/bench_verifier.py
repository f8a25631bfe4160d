"""Cost of one verification verdict at temperature > 0 (``verify_rows``):
the sampling filters, the noise and the rejection sampling over a batch's
[B, k + 1, V] logits, without the model.

Rows sample at T=0.7 with top-p 0.95 (``--top-p 1.0``: no filter; seeded: each row's own random stream;
unseeded: MLX's global one). ``--baseline DIR`` runs the same measurements
against the package in DIR (another checkout, e.g. ``git worktree add
/tmp/before HEAD~1``) in a subprocess, and prints both side by side with
the ratio.

    python scripts/bench/bench_verifier.py [--batch-sizes 16 32] [--k 5] [--vocab 49152]
    python scripts/bench/bench_verifier.py --baseline /tmp/before
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Optional

from baseline import baseline_figures


@dataclass
class Row:
    params: object
    key: Optional[object]
    processors: list


def measure(batch_sizes, k: int, vocab: int, steps: int, top_p: float = 0.95) -> dict:
    import mlx.core as mx

    from mlx_lm_server.decoding.sampling import SamplingParams
    from mlx_lm_server.spec_decode.verifier import verify_rows

    params = SamplingParams(temperature=0.7, top_p=top_p)
    out = {}
    for B in batch_sizes:
        for seeded in (True, False):
            mx.random.seed(0)
            logits = mx.random.normal((B, k + 1, vocab)) * 4
            draft = mx.random.randint(0, vocab, (B, k)).astype(mx.int32)
            num_drafts = mx.full((B,), k, mx.int32)
            rows = [Row(params, mx.random.key(i) if seeded else None, []) for i in range(B)]
            mx.eval(logits, draft, num_drafts)
            times = []
            for step in range(steps + 3):  # three to warm up (compiled shapes)
                start = time.perf_counter()
                verdict = verify_rows(rows, logits, draft, num_drafts, max_k=k)
                mx.eval(verdict.output, verdict.num_accepted)
                if step >= 3:
                    times.append(time.perf_counter() - start)
            times.sort()
            out[f"B={B} {'seeded' if seeded else 'unseeded'}"] = 1000 * times[len(times) // 2]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary by default")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top-p", type=float, default=0.95, help="1.0: no top-p filter (no sort)")
    ap.add_argument("--baseline", help="a checkout whose package to compare against")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    ours = measure(args.batch_sizes, args.k, args.vocab, args.steps, args.top_p)
    if args.json:
        print(json.dumps(ours))
        return
    base = None
    if args.baseline:
        base = baseline_figures(__file__, ["--k", str(args.k), "--vocab", str(args.vocab),
                                           "--steps", str(args.steps), "--top-p",
                                           str(args.top_p), "--batch-sizes",
                                           *map(str, args.batch_sizes)], args.baseline)
    print(f"verify_rows, T=0.7 top-p {args.top_p}, k={args.k}, V={args.vocab}: "
          "median ms per verdict")
    for name, ms in ours.items():
        line = f"  {name:<16} {ms:8.2f} ms"
        if base is not None:
            line += f"   baseline {base[name]:8.2f} ms   {base[name] / ms:5.2f}x faster"
        print(line)


if __name__ == "__main__":
    main()
