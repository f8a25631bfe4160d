"""Quantized KV caches (``--kv-bits``) against full precision, side by side, in process.

For each model, the same loaded weights and the same chat prompts go through
the scheduler (no HTTP, no speculation) with full-precision caches and with
each ``--kv-bits``; each batch size B is one wave of B requests submitted at
once. Per configuration:

- KV bytes per token: what one token costs in every layer's cache, measured
  as the memory budget measures it (``memory.layer_costs``);
- decode tok/s: sum(tokens - 1) / (last end - first first token), prefill
  excluded (a wave of B rows decodes in one batch: quantized caches stay
  batched); the median of ``--repeats`` rounds, each running every setting
  in turn, and its ratio to full precision the median of each round's ratio;
- identical: requests whose greedy tokens equal full precision's at the same B;
- agreement: teacher-forced, the share of full precision's greedy tokens
  (its largest wave's answers, one per prompt) that the quantized model also
  ranks first given the same prefix (one pass over prompt + answer; 1.0 for
  full precision by definition).

Usage:
  python scripts/bench/bench_kv_bits.py --models models/smollm2-135m-instruct \\
      models/qwen2.5-coder-0.5b-instruct --batch-sizes 1 16 --bits 8 4 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mlx_lm_server.runtime.blas import ensure_fast_blas

ensure_fast_blas()

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlx_lm_server.assembly import make_scheduler
from mlx_lm_server.decoding.sampling import SamplingParams
from mlx_lm_server.kv.quantized import quantize_kv_caches
from mlx_lm_server.serving.memory import layer_costs
from mlx_lm_server.serving.request import GenerationRequest

from waves import decode_tok_s, run_wave

QUESTIONS = [
    "Explain in a paragraph how a hash map handles collisions.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "What are the main differences between TCP and UDP?",
    "Describe the water cycle for a ten-year-old.",
    "Give three tips for writing readable code, with a short example each.",
    "Summarise the plot of Romeo and Juliet in five sentences.",
    "How does binary search work? Show it on the list 2, 5, 8, 12, 16, 23, 38.",
    "Write a short story about a robot that learns to paint.",
]


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                      add_generation_prompt=True),
        add_special_tokens=False)


def wave(model, tokenizer, prompts, max_tokens: int) -> tuple[list, float]:
    """B requests at once: (token ids per request, decode tok/s)."""
    s = make_scheduler(model, tokenizer, max_batch_size=len(prompts),
                       prefill_batch_size=len(prompts), max_queued_requests=len(prompts))
    s.start()
    try:
        records = run_wave(s, [GenerationRequest(p, max_tokens, SamplingParams(temperature=0))
                               for p in prompts])
    finally:
        s.shutdown()
        s.join(10)
    return [r["ids"] for r in records], decode_tok_s(records)


def agreement(model, prompt, answer) -> float:
    logits = model(mx.array([prompt + answer]), cache=make_prompt_cache(model))[0]
    picks = mx.argmax(logits[len(prompt) - 1 : -1], axis=-1).tolist()
    return float(np.mean([p == a for p, a in zip(picks, answer)]))


def bench(path: str, batch_sizes, bits_list, max_tokens: int, group_size: int,
          repeats: int) -> list:
    """Every setting's waves in turn, ``repeats`` times over (load on a shared
    machine drifts: each setting sees the same drift); tok/s is the median."""
    model, tokenizer = load(path)
    prompts = [chat(tokenizer, q) for q in QUESTIONS]
    settings = [None] + list(bits_list)
    reference, rows = {}, {}
    for r in range(repeats):
        for bits in settings:
            quantize_kv_caches(model, bits, group_size)
            if r == 0:
                wave(model, tokenizer, prompts[:2], 4)  # warm-up: first shapes, kernels
            for B in batch_sizes:
                batch = [prompts[i % len(prompts)] for i in range(B)]
                ids, tps = wave(model, tokenizer, batch, max_tokens)
                if r == 0:
                    if bits is None:
                        reference[B] = ids
                    same = sum(a == b for a, b in zip(ids, reference[B]))
                    rows[bits, B] = {"model": Path(path).name, "kv_bits": bits or "none",
                                     "B": B, "identical": f"{same}/{B}", "tok_s": []}
                rows[bits, B]["tok_s"].append(tps)
    for bits in settings:
        quantize_kv_caches(model, bits, group_size)
        per_token = sum(c.per_token for c in layer_costs(model))
        # Teacher-forced, on full precision's answers to every prompt (the largest wave).
        answers = reference[batch_sizes[-1]][:len(prompts)]
        agree = float(np.mean([agreement(model, p, a) for p, a in zip(prompts, answers)]))
        for B in batch_sizes:
            row = rows[bits, B]
            row.update(kv_bytes_per_token=per_token, agreement=round(agree, 3),
                       decode_tok_s=round(float(np.median(row["tok_s"])), 1),
                       tok_s=[round(t, 1) for t in row["tok_s"]])
            print(json.dumps(row), flush=True)
    quantize_kv_caches(model, None)
    return [rows[bits, B] for bits in settings for B in batch_sizes]


def table(rows: list) -> str:
    base = {(r["model"], r["B"]): r for r in rows if r["kv_bits"] == "none"}
    out = ["| model | --kv-bits | B | KV bytes/token | vs none | decode tok/s | vs none "
           "| identical | agreement |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = base[(r["model"], r["B"])]
        # Each round's ratio to full precision's wave of the same round, then the median.
        ratio = np.median([t / u for t, u in zip(r["tok_s"], b["tok_s"])])
        out.append(f"| {r['model']} | {r['kv_bits']} | {r['B']} | {r['kv_bytes_per_token']} "
                   f"| {r['kv_bytes_per_token'] / b['kv_bytes_per_token']:.2f} "
                   f"| {r['decode_tok_s']} | {ratio:.2f} "
                   f"| {r['identical']} | {r['agreement']} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["models/smollm2-135m-instruct"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--bits", nargs="+", type=int, default=[8, 4])
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    rows = []
    for path in args.models:
        rows += bench(path, sorted(args.batch_sizes), args.bits, args.max_tokens,
                      args.group_size, args.repeats)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
