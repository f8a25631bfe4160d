"""Cost of one n-gram proposal step for a large batch with long contexts.

32 sequences with 8k-token contexts each gain 3 tokens per step (the pending
token plus two accepted drafts), as in a speculative decode step; the
incremental index makes the step cost independent of context length.

    python scripts/bench_ngram.py [--batch 32] [--context 8192] [--steps 200]
"""

import argparse
import time

import numpy as np

from mlx_lm_server.spec_decode.proposer.base import Context
from mlx_lm_server.spec_decode.proposer.ngram import NGramProposer


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--k", type=int, default=8)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    B = args.batch
    history = [[int(t) for t in rng.integers(0, 500, size=args.context)] for _ in range(B)]
    pending = [1] * B
    proposer = NGramProposer(1, 4)
    for uid in range(B):
        proposer.add_sequence(uid, args.context)
    uids = list(range(B))
    proposer.propose(uids, [Context(h, q) for h, q in zip(history, pending)], [args.k] * B)
    times = []
    for _ in range(args.steps):
        for i, h in enumerate(history):
            h.append(pending[i])
            h.extend(int(t) for t in rng.integers(0, 500, size=2))
            pending[i] = int(rng.integers(0, 500))
        contexts = [Context(h, q) for h, q in zip(history, pending)]
        start = time.perf_counter()
        proposer.propose(uids, contexts, [args.k] * B)
        times.append(time.perf_counter() - start)
    print(f"{B} sequences x {args.context} tokens, k={args.k}: median "
          f"{1e3 * np.median(times):.3f} ms per step, min {1e3 * min(times):.3f} ms")


if __name__ == "__main__":
    main()
