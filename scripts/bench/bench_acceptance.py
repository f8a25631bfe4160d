"""Proposers replayed over recorded greedy outputs: drafts kept per verify step, no model in the loop.

At temperature 0 a draft's fate is fixed by the output alone: verification
keeps the longest prefix of the draft that equals what the model emits next.
So once a workload's greedy outputs are recorded (one batched run of the
model, cached under ``bench_out/``), any proposer can be replayed over them
in seconds, request after request in the order a server at B=1 serves them
(a global index sees the outputs that finished before). This is for tuning
proposers; the speed they buy is measured end to end by ``bench_spec.py``.

Every step asks for up to ``k`` drafts; a step where the proposer has none
is a plain step (cost 1, one token), one with a draft of n tokens is a
verification priced ``1 + fixed + cost * K`` plain steps (K: the pass shape
holding n, as the server pads it), emitting the kept drafts + 1. The defaults are what the controller measured for
Qwen2.5-Coder-0.5B at B=1 on 2 CPU cores (c(1, 1) = 1.44 ... c(1, 8) =
1.98 plain steps); on a GPU both are near 0. Per proposer: how often it drafts, the share of drafted tokens
kept, tokens per step, and the modelled speed-up over plain decoding
(tokens / priced steps), over all requests and over those after the first
``--warm`` (a global index warmed by the earlier ones). A proposer that
drafts only where it is likely right wins here as it does in the server,
whose controller weighs acceptance where drafts exist apart from how often
they do.

    .venv/bin/python scripts/bench/bench_acceptance.py --workload repeated
    .venv/bin/python scripts/bench/bench_acceptance.py --workload agent-loop --k 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from workloads import WORKLOADS, chat_tokens, workload_prompts  # noqa: E402

from mlx_lm_server.runtime.blas import ensure_fast_blas  # noqa: E402  (no MLX import)


def record(model_name: str, workload: str, max_tokens: int, model=None,
           tokenizer=None) -> list[dict]:
    """Each prompt's tokens and its greedy output (cached), by the model
    given or else the one in models/``model_name``."""
    path = ROOT / "bench_out" / f"acceptance_{model_name}_{workload}_{max_tokens}.json"
    if path.exists():
        return json.loads(path.read_text())
    from mlx_lm import batch_generate, load

    if model is None:
        model, tokenizer = load(str(ROOT / "models" / model_name))
    prompts = [chat_tokens(tokenizer, p) for p in workload_prompts(workload)]
    tic = time.perf_counter()
    out = batch_generate(model, tokenizer, prompts, max_tokens=max_tokens,
                         return_token_ids=True)
    print(f"recorded {len(prompts)} outputs in {time.perf_counter() - tic:.0f} s", file=sys.stderr)
    runs = [{"prompt": p, "output": list(map(int, o))} for p, o in zip(prompts, out.token_ids)]
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(runs))
    return runs


def step_cost(k: int, fixed: float, cost: float) -> float:
    """A step's price in plain steps: 1, or a verification over k drafts."""
    return 1.0 + (fixed + cost * k if k else 0.0)


def make_controller(max_k: int, fixed: float, cost: float):
    """The server's controller, its step costs seeded from the price model
    (as the start-up calibration seeds them from timed passes)."""
    from mlx_lm_server.spec_decode.control.costs import k_buckets
    from mlx_lm_server.spec_decode.control.controller import DynamicSpecController

    controller = DynamicSpecController(max_k)
    for _ in range(3):
        controller.observe_plain_step(1, step_cost(0, fixed, cost))
        for k in k_buckets(max_k):
            controller.observe_verify_step(1, k, step_cost(k, fixed, cost))
    return controller


def replay(proposer, runs: list[dict], k: int, fixed: float, cost: float,
           controller=None) -> list[dict]:
    """Serve ``runs`` one after another through ``proposer``; per request:
    steps, verify steps, drafted and kept tokens, priced steps. With a
    ``controller``, it decides each step's k as in the server: 0 is a plain
    step, which drafts nothing into the pass; the engine's shadow drafts
    (``control/shadow.py``) then teach the controller what its drafts would
    have kept as the tokens are emitted, never before (a replay that told
    it a plain step's outcome at once would see up to k tokens ahead)."""
    from mlx_lm_server.spec_decode.control.costs import padded_k
    from mlx_lm_server.spec_decode.control.controller import StepReport
    from mlx_lm_server.spec_decode.control.shadow import ShadowDrafts, matching_prefix
    from mlx_lm_server.spec_decode.drafts import Context
    from mlx_lm_server.spec_decode.tree import kept_path

    stats = []
    shadow = ShadowDrafts()
    for uid, run in enumerate(runs):
        prompt, output = run["prompt"], run["output"]
        # The first token comes from the prefill; every step then feeds the
        # pending token and verifies the draft after it.
        proposer.add_sequence(uid, len(prompt))
        history, pos = list(prompt), 1
        steps = verified = drafted = kept = 0
        priced = 0.0
        while pos < len(output):
            decision = None
            if controller is not None:
                shadow.report_settled(controller, [uid], [history])
                decision = controller.choose([uid], shadow.matching([uid]))
            k_step = k if decision is None else decision.per_sequence_k.get(uid, decision.k)
            if k_step == 0:
                # A plain step (only a controller decides one): the engine's
                # shadow draft, after the fed tokens, teaches it.
                if not decision.cannot_pay:
                    shadow.report_asked(controller, [uid], [history], k, proposer.propose)
                n = a = 0
            else:
                shadow.clear()
                room = len(output) - pos  # tokens the request may still emit after the pending one
                ask = min(k_step, room)
                result = proposer.propose([uid], [Context(history, output[pos - 1])], [ask])
                n = int(result.num_proposed[0])
                drafts = result.draft_tokens[0, :n].tolist()
                if result.parents is None:
                    a = matching_prefix(drafts, output[pos:])
                else:  # a tree: the longest root path the output follows
                    a = len(kept_path(drafts, result.parents[0, :n].tolist(), output[pos:]))
                if controller is not None:
                    controller.observe(StepReport(1, (uid,), (ask,), (n,), (a,),
                                                  decision if n else None))
                if n:
                    proposer.observe_verification([uid], [a])
            K = padded_k(n, k) if n else 0  # the pass shape the server pays for
            if controller is not None:
                controller.observe(StepReport(1, k=K, seconds=step_cost(K, fixed, cost)))
            history.extend(output[pos - 1:pos + a])
            pos += a + 1
            steps += 1
            verified += n > 0
            drafted += n
            kept += a
            priced += step_cost(K, fixed, cost)
        proposer.remove_sequence(uid)
        shadow.forget(uid)
        if controller is not None:
            controller.remove_sequence(uid)
        stats.append({"tokens": len(output), "steps": steps, "verified": verified,
                      "drafted": drafted, "kept": kept, "priced": priced})
    return stats


def summary(stats: list[dict]) -> dict:
    def total(key):
        return sum(s[key] for s in stats)

    tokens = sum(s["tokens"] - 1 for s in stats)  # the first comes from the prefill
    return {"drafts": total("verified") / max(1, total("steps")),
            "kept": total("kept") / max(1, total("drafted")),
            "tok/step": tokens / max(1, total("steps")),
            "speed-up": tokens / max(1e-9, total("priced"))}


def proposers(args) -> dict:
    from mlx_lm_server.spec_decode.proposer.ngram import NGramProposer
    from mlx_lm_server.spec_decode.proposer.suffix import SuffixProposer

    return {"ngram": lambda: NGramProposer(),
            f"ngram tree {args.tree_width}": lambda: NGramProposer(tree_paths=args.tree_width),
            "suffix": lambda: SuffixProposer(),
            f"suffix tree {args.tree_width}": lambda: SuffixProposer(tree_width=args.tree_width),
            "suffix+prompts": lambda: SuffixProposer(index_prompts=True),
            f"suffix+prompts tree {args.tree_width}":
                lambda: SuffixProposer(index_prompts=True, tree_width=args.tree_width)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct",
                    help="a folder under models/ (its outputs are recorded once)")
    ap.add_argument("--workload", default="repeated", choices=WORKLOADS,
                    help="a workload of workloads.py")
    ap.add_argument("--max-tokens", type=int, default=160, help="per recorded output")
    ap.add_argument("--k", type=int, default=8, help="draft room per step")
    ap.add_argument("--fixed", type=float, default=0.4,
                    help="a verification's cost over a plain step's, in plain steps")
    ap.add_argument("--cost", type=float, default=0.08,
                    help="a verification's cost per draft token, in plain steps")
    ap.add_argument("--warm", type=int, default=4,
                    help="requests after which the index counts as warm")
    ap.add_argument("--controller", action="store_true",
                    help="the server's controller decides each step's k (else every "
                         "step drafts up to k)")
    ap.add_argument("--matching-run", type=int, nargs="*", default=[], metavar="N",
                    help="with --controller: replay once per N, a shadow draft counting "
                         "as matching after N copied tokens (control/shadow.py: 1)")
    ap.add_argument("--proposers", nargs="*", default=None, metavar="NAME",
                    help="only these rows (e.g. ngram suffix); default: all")
    ap.add_argument("--tree-width", type=int, default=4,
                    help="continuations a tree of drafts merges, in the same k nodes "
                         "(the tree rows beside their chains)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="serve the recorded requests this many times over")
    ap.add_argument("--slices", nargs="*", default=[], metavar="FIRST:END",
                    help="also the speed-up over these request ranges (e.g. 0:15 15:40): "
                         "what a window of the server sees as the index warms")
    args = ap.parse_args()
    slices = [tuple(int(x) for x in s.split(":")) for s in args.slices]
    ensure_fast_blas()
    runs = record(args.model, args.workload, args.max_tokens) * args.repeat
    print(f"{args.model}, {args.workload}: {len(runs)} requests, "
          f"{sum(len(r['output']) for r in runs)} output tokens, k={args.k}")
    keys = ["drafts", "kept", "tok/step", "speed-up"]
    print(f"{'':<22} " + " ".join(f"{'all: ' + k if i == 0 else k:>12}" for i, k in enumerate(keys))
          + "  " + " ".join(f"{'warm: ' + k if i == 0 else k:>13}" for i, k in enumerate(keys)))
    from mlx_lm_server.spec_decode.control import shadow

    chosen = {n: m for n, m in proposers(args).items()
              if args.proposers is None or n in args.proposers}
    cases = [(name, make, n) for name, make in chosen.items() for n in (args.matching_run or [1])]
    for name, make, run_length in cases:
        # shadow._matching with ``run_length`` copied tokens in place of one
        shadow._matching = lambda draft, reported, n=run_length: \
            reported >= n and len(draft) - reported >= 2
        label = f"{name}, matching {run_length}" if args.matching_run else name
        controller = make_controller(args.k, args.fixed, args.cost) if args.controller else None
        stats = replay(make(), runs, args.k, args.fixed, args.cost, controller)
        a, w = summary(stats), summary(stats[args.warm:])
        print(f"{label:<22} " + " ".join(f"{a[k]:>12.2f}" for k in keys) + "  "
              + " ".join(f"{w[k]:>13.2f}" for k in keys))
        if slices:
            print(f"{'':<22} speed-up over requests " + ", ".join(
                f"{first}-{end}: {summary(stats[first:end])['speed-up']:.2f}"
                for first, end in slices))

if __name__ == "__main__":
    main()
