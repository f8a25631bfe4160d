"""Draft-model speculation vs plain decoding, and vs upstream's match-the-sample rule.

Side by side in one run, on one target/draft pair (default: Qwen2.5-Coder-1.5B
with the 0.5B drafting, float32 on CPU):

1. Costs: c = draft forward / target forward (one token per sequence) and the
   target's verification cost T(k+1)/T(1), at each batch size.
2. Temperature 0, batch sizes 1 and 4: decode tokens/s with ``--spec-decode
   none`` and with the draft (fixed k), ``--repeats`` times with the cost
   measurements of step 1 interleaved (medians reported, since a shared
   machine drifts by 20% or more within minutes), acceptance rate, mean accepted length
   L (tokens per verification pass), the speedup the standard formula predicts
   from those measured numbers, L / (k c + T(k+1)/T(1)), and the ratio of the
   measured speedup to it.
3. Temperature 0.7: mean accepted length with our rejection sampler vs
   upstream mlx-lm's rule (keep a draft only if an independent target sample
   equals it), same pair, same prompts, same k.

    python scripts/bench/bench_draft.py
    python scripts/bench/bench_draft.py --target models/qwen2.5-coder-1.5b-instruct \\
        --draft models/qwen2.5-coder-0.5b-instruct --k 4 --batch-sizes 1 4 --max-tokens 96
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from waves import decode_tok_s, run_wave

PROMPTS = [
    "Explain what this function does, step by step:\n\n"
    "def merge(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n"
    "        else:\n            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
    "Write a Python function that reads a CSV file and returns the average of a column.",
    "Write a Python class for a stack with push, pop and peek, with docstrings.",
    "Explain the difference between a process and a thread.",
]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="models/qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="models/qwen2.5-coder-0.5b-instruct")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2,
                   help="cost measurements and waves per batch size, interleaved; medians reported")
    p.add_argument("--skip-temperature", action="store_true",
                   help="skip the temperature-0.7 comparison with match-the-sample")
    p.add_argument("--out", default="bench_out/bench_draft.json")
    return p.parse_args()


def forward_ms(model, batch, tokens_per_row, context=64, repeats=5):
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    bcache = [BatchKVCache([0] * batch) for _ in model.layers]
    model(mx.zeros((batch, context), mx.int32) + 5, cache=bcache)
    mx.eval([c.state for c in bcache])
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        mx.eval(model(mx.zeros((batch, tokens_per_row), mx.int32) + 7, cache=bcache))
        times.append(time.perf_counter() - t)
        for c in bcache:
            c.trim(tokens_per_row)
    return 1e3 * statistics.median(times[1:])


def chat_ids(tokenizer, text):
    return tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False)


def wave_tok_s(scheduler, requests) -> float:
    return decode_tok_s(run_wave(scheduler, requests))


def match_the_sample(target_probs, draft, num_drafts, uniforms, gumbels, draft_probs=None,
                     greedy=None):
    """Upstream mlx-lm's rule at temperature > 0: keep d_j only if an independent
    sample from p_j equals it; the sample at the first mismatch is emitted."""
    import mlx.core as mx

    from mlx_lm_server.spec_decode.verifier import accepted_prefix, assemble_output, valid_mask

    B, K1, V = target_probs.shape
    g = mx.random.gumbel(shape=(B, K1, V))
    samples = mx.argmax(mx.log(target_probs) + g, axis=-1).astype(mx.int32)
    n = accepted_prefix((draft == samples[:, :-1]) & valid_mask(draft, num_drafts))
    final = mx.take_along_axis(samples, n[:, None], axis=1)[:, 0]
    return assemble_output(draft, n, final), n


def main():
    from mlx_lm_server.runtime.blas import ensure_fast_blas

    ensure_fast_blas()
    args = parse_args()
    from mlx_lm import load

    from mlx_lm_server.assembly import make_scheduler
    from mlx_lm_server.decoding.sampling import SamplingParams
    from mlx_lm_server.serving.request import GenerationRequest
    from mlx_lm_server.spec_decode import verifier as verifier_module
    from mlx_lm_server.spec_decode.config import SpecDecodeConfig
    from mlx_lm_server.spec_decode.engine import SpecDecodeEngine
    from mlx_lm_server.spec_decode.proposer.draft_model import DraftModelProposer, check_tokenizers

    print(f"loading {args.target} and {args.draft}", flush=True)
    target, tokenizer = load(args.target)
    draft, draft_tokenizer = load(args.draft)
    check_tokenizers(tokenizer, draft_tokenizer, args.target, args.draft)
    prompts = [chat_ids(tokenizer, p) for p in PROMPTS]
    k = args.k
    report = {"args": vars(args), "batches": {}}

    def scheduler(mode):
        spec = SpecDecodeConfig(mode=mode, num_speculative_tokens=k, dynamic=False,
                                adaptive_k=False,
                                draft_model_path=args.draft if mode == "draft" else None)
        # One copy of the draft model for every run (it is already loaded).
        engine = None
        if mode == "draft":
            engine = SpecDecodeEngine(target, spec, DraftModelProposer(draft))
        s = make_scheduler(target, tokenizer, max_batch_size=32, engine=engine)
        s.start()
        return s

    def reqs(batch, temperature, seed=0):
        return [GenerationRequest(prompts[i % len(prompts)], args.max_tokens,
                                  SamplingParams(temperature=temperature, seed=seed + i))
                for i in range(batch)]

    for B in args.batch_sizes:
        plain, spec = scheduler("none"), scheduler("draft")
        wave_tok_s(plain, reqs(1, 0.0))  # warm-up
        wave_tok_s(spec, reqs(1, 0.0))
        costs, speeds = [], {"none": [], "draft": []}
        drafts = draft_tokens = accepted = 0
        for rep in range(args.repeats):
            # Costs and speeds interleaved, so drift on a shared machine hits both.
            print(f"batch {B}, repeat {rep + 1}/{args.repeats}: forward costs, then waves",
                  flush=True)
            costs.append((forward_ms(target, B, 1), forward_ms(target, B, k + 1),
                          forward_ms(draft, B, 1)))
            speeds["none"].append(wave_tok_s(plain, reqs(B, 0.0)))
            sc = spec.spec_stats.tokens
            before = (sc.num_drafts, sc.num_draft_tokens, sc.num_accepted_tokens)
            speeds["draft"].append(wave_tok_s(spec, reqs(B, 0.0)))
            drafts += sc.num_drafts - before[0]
            draft_tokens += sc.num_draft_tokens - before[1]
            accepted += sc.num_accepted_tokens - before[2]
            print(f"  costs (ms) target {costs[-1][0]:.0f}, target k+1 {costs[-1][1]:.0f}, "
                  f"draft {costs[-1][2]:.0f}; tok/s none {speeds['none'][-1]:.2f}, "
                  f"draft {speeds['draft'][-1]:.2f}", flush=True)
        for s in (plain, spec):
            s.shutdown()
            s.join(10)

        t1, tk, d1 = (statistics.median(c[i] for c in costs) for i in range(3))
        c, verify = d1 / t1, tk / t1
        tps_none = statistics.median(speeds["none"])
        tps_draft = statistics.median(speeds["draft"])
        L = 1 + accepted / max(drafts, 1)
        predicted = L / (k * c + verify)
        measured = tps_draft / tps_none
        row = {"target_ms": t1, "target_k1_ms": tk, "draft_ms": d1, "c": c,
               "verify_cost": verify, "costs_ms": costs, "tokens_per_s": speeds,
               "tokens_per_s_none": tps_none, "tokens_per_s_draft": tps_draft,
               "acceptance_rate": accepted / max(draft_tokens, 1), "mean_accepted_length": L,
               "predicted_speedup": predicted, "measured_speedup": measured,
               "measured_over_predicted": measured / predicted}
        report["batches"][B] = row
        print(json.dumps({B: row}, indent=1), flush=True)

    temp = None
    if args.skip_temperature:
        return finish(report, temp, args, k)
    print("temperature 0.7: rejection sampling vs match-the-sample", flush=True)
    temp = {}
    for name in ("rejection_sampling", "match_the_sample"):
        original = verifier_module.rejection_sample
        if name == "match_the_sample":
            verifier_module.rejection_sample = match_the_sample
        try:
            s = scheduler("draft")
            run_wave(s, reqs(len(prompts), 0.7, seed=100))
            sc = s.spec_stats.tokens
            temp[name] = {"mean_accepted_length": sc.mean_accepted_length,
                          "acceptance_rate": sc.acceptance_rate, "drafts": sc.num_drafts}
            s.shutdown(); s.join(10)
        finally:
            verifier_module.rejection_sample = original
    temp["ratio"] = (temp["rejection_sampling"]["mean_accepted_length"]
                     / temp["match_the_sample"]["mean_accepted_length"])
    return finish(report, temp, args, k)


def finish(report, temp, args, k) -> int:
    report["temperature_0.7"] = temp
    print("\n   B   none tok/s  draft tok/s  speedup  predicted  meas/pred  accept  L      c     T(k+1)/T(1)")
    for B, r in report["batches"].items():
        print(f"{B:4d} {r['tokens_per_s_none']:11.2f} {r['tokens_per_s_draft']:12.2f} "
              f"{r['measured_speedup']:8.2f} {r['predicted_speedup']:10.2f} "
              f"{r['measured_over_predicted']:10.2f} {r['acceptance_rate']:7.2f} "
              f"{r['mean_accepted_length']:5.2f} {r['c']:6.2f} {r['verify_cost']:8.2f}")
    if temp is not None:
        print(f"temperature 0.7, k={k}: mean accepted length "
              f"{temp['rejection_sampling']['mean_accepted_length']:.2f} (rejection sampling) vs "
              f"{temp['match_the_sample']['mean_accepted_length']:.2f} (match the sample): "
              f"{temp['ratio']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
