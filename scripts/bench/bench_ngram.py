"""Cost of one proposal step (n-gram or suffix) for a large batch with long contexts.

32 sequences with 8k-token contexts each gain 3 tokens per step (the pending
token plus two accepted drafts), as in a speculative decode step; the
incremental index makes the step cost independent of context length.

With ``--proposer suffix`` the global index is first filled to its bound
(``--index-tokens``) with slices of one corpus, and each row's new tokens
follow that corpus, so that nearly every row drafts from the index, as far
as k allows: the most work a suffix proposal does.

    python scripts/bench/bench_ngram.py [--batch 32] [--context 8192] [--steps 200]
    python scripts/bench/bench_ngram.py --proposer suffix [--index-tokens 32768]
"""

import argparse
import time

import numpy as np

from mlx_lm_server.spec_decode.drafts import Context
from mlx_lm_server.spec_decode.proposer.ngram import NGramProposer
from mlx_lm_server.spec_decode.proposer.suffix import SuffixProposer


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--proposer", choices=["ngram", "suffix"], default="ngram")
    ap.add_argument("--index-tokens", type=int, default=32768)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    B = args.batch
    history = [[int(t) for t in rng.integers(0, 500, size=args.context)] for _ in range(B)]
    pending = [1] * B
    corpus = [int(t) for t in rng.integers(0, 500, size=4096)]
    at = [int(rng.integers(0, len(corpus))) for _ in range(B)]  # each row's place in it
    if args.proposer == "suffix":
        proposer = SuffixProposer(1, 4, prompt_lookup=False, max_tokens=args.index_tokens)
        while proposer.index.tokens_held < args.index_tokens:
            start = int(rng.integers(0, len(corpus) - 256))
            proposer.index.add(corpus[start:start + 256])
    else:
        proposer = NGramProposer(1, 4)
    for uid in range(B):
        proposer.add_sequence(uid, args.context)
    uids = list(range(B))
    proposer.propose(uids, [Context(h, q) for h, q in zip(history, pending)], [args.k] * B)
    times = []
    for _ in range(args.steps):
        for i, h in enumerate(history):
            h.append(pending[i])
            if args.proposer == "suffix":
                h.extend(corpus[(at[i] + j) % len(corpus)] for j in range(2))
                pending[i] = corpus[(at[i] + 2) % len(corpus)]
                at[i] += 3
            else:
                h.extend(int(t) for t in rng.integers(0, 500, size=2))
                pending[i] = int(rng.integers(0, 500))
        contexts = [Context(h, q) for h, q in zip(history, pending)]
        start = time.perf_counter()
        result = proposer.propose(uids, contexts, [args.k] * B)
        times.append(time.perf_counter() - start)
        drafted = int(result.num_proposed.sum())
    extra = ""
    if args.proposer == "suffix":
        extra = (f", index {proposer.index.tokens_held} tokens / {len(proposer.index)} entries,"
                 f" {proposer.global_drafts} of {proposer.drafts} drafts from it")
    print(f"{args.proposer}: {B} sequences x {args.context} tokens, k={args.k}: median "
          f"{1e3 * np.median(times):.3f} ms per step, min {1e3 * min(times):.3f} ms, "
          f"{drafted} draft tokens in the last step{extra}")


if __name__ == "__main__":
    main()
