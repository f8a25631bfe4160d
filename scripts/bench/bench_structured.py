"""Structured output under speculation: JSON extraction, constrained n-gram
against constrained plain decoding, side by side in one run.

Each request is a document (a customer record written as prose, with an
order table) and a JSON schema of its fields; the answer must follow the
schema (``response_format`` json_schema), greedy. Per model and batch size B,
one wave of B requests runs with speculation off, then with n-gram
speculation (the server's defaults: dynamic controller), in one process.

Reported: tokens per second of each and their ratio; the host time spent
filling grammar masks per decode step, against the plain step's time; and
the share of generated tokens the grammar forced (a forced token is the only
one its mask allowed).

    .venv/bin/python scripts/bench/bench_structured.py --models smollm2-135m-instruct \\
        qwen2.5-coder-0.5b-instruct --batch-sizes 1 8 32

Results also go to ``bench_out/bench_structured.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from mlx_lm_server.runtime.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()

from servers import OUT_DIR, progress  # noqa: E402
from waves import run_wave  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "string"},
        "email": {"type": "string"},
        "city": {"type": "string"},
        "account_id": {"type": "string"},
        "tier": {"enum": ["basic", "silver", "gold"]},
        "orders": {"type": "array", "maxItems": 4, "items": {
            "type": "object",
            "properties": {"sku": {"type": "string"}, "quantity": {"type": "integer"},
                           "status": {"enum": ["shipped", "pending", "returned"]}},
            "required": ["sku", "quantity", "status"], "additionalProperties": False}},
    },
    "required": ["customer", "email", "city", "account_id", "tier", "orders"],
    "additionalProperties": False,
}

FIRST = ["Alice", "Bruno", "Chen", "Dana", "Emeka", "Fatima", "Goran", "Hana", "Ivan", "Julia"]
LAST = ["Moreau", "Okafor", "Lindqvist", "Tanaka", "Rossi", "Novak", "Haddad", "Silva"]
CITIES = ["Lisbon", "Osaka", "Tromso", "Nairobi", "Montreal", "Krakow", "Valparaiso"]


def document(rng: random.Random) -> str:
    name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    email = name.lower().replace(" ", ".") + "@example.org"
    account = f"AC-{rng.randint(10000, 99999)}"
    tier = rng.choice(["basic", "silver", "gold"])
    rows = "\n".join(
        f"| SKU-{rng.randint(1000, 9999)}-{rng.choice('ABCDEF')} | {rng.randint(1, 9)} | "
        f"{rng.choice(['shipped', 'pending', 'returned'])} |" for _ in range(rng.randint(2, 4)))
    return (f"Support ticket. The customer {name} (account {account}, {tier} tier) wrote from "
            f"{rng.choice(CITIES)} using the address {email}. Their recent orders:\n"
            f"| sku | quantity | status |\n|---|---|---|\n{rows}\n")


def prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "user", "content": "Extract the customer record from this ticket "
                     "as JSON with the fields customer, email, city, account_id, tier and "
                     "orders (sku, quantity, status).\n\n" + document(rng)}]
        out.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return out


def run(model, tokenizer, grammar_tokenizer, mode: str, batch: list[list[int]],
        max_tokens: int) -> dict:
    from mlx_lm_server.assembly import make_scheduler
    from mlx_lm_server.decoding.sampling import SamplingParams
    from mlx_lm_server.decoding.structured import response_format_grammar
    from mlx_lm_server.serving.request import GenerationRequest
    from mlx_lm_server.spec_decode import make_engine
    from mlx_lm_server.spec_decode.config import SpecDecodeConfig

    grammar = response_format_grammar({"type": "json_schema",
                                       "json_schema": {"name": "record", "schema": SCHEMA}})
    engine = None if mode == "none" else make_engine(
        model, SpecDecodeConfig(mode=mode), tokenizer)
    s = make_scheduler(model, tokenizer, max_batch_size=max(32, len(batch)), engine=engine,
                       grammar_tokenizer=grammar_tokenizer)
    s.start()
    try:
        # Warm-up: compile the shapes this batch will use.
        run_wave(s, [GenerationRequest(p, 16, SamplingParams(temperature=0), grammar=grammar)
                     for p in batch])
        steps0, mask0 = s.steps, grammar_tokenizer.mask_seconds
        reqs = [GenerationRequest(p, max_tokens, SamplingParams(temperature=0), grammar=grammar)
                for p in batch]
        tic = time.perf_counter()
        out = run_wave(s, reqs)
        seconds = time.perf_counter() - tic
        steps = s.steps - steps0
        mask = grammar_tokenizer.mask_seconds - mask0
    finally:
        s.shutdown()
        s.join(10)
    tokens = sum(r["tokens"] for r in out)
    valid = 0
    for r in out:
        try:
            json.loads(r["text"])
            valid += 1
        except json.JSONDecodeError:
            pass
    return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds, "steps": steps,
            "ms_per_step": 1e3 * seconds / steps, "mask_ms_per_step": 1e3 * mask / steps,
            "forced": sum(r["forced"] for r in out), "parsed": valid,
            "texts": [r["text"] for r in out]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+",
                    default=["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    from mlx_lm import load

    from mlx_lm_server.decoding.structured import GrammarTokenizer, logits_width

    results = []
    for name in args.models:
        model, tokenizer = load(str(ROOT / "models" / name))
        grammar_tokenizer = GrammarTokenizer(tokenizer, logits_width(model, tokenizer))
        for B in args.batch_sizes:
            batch = prompts(tokenizer, B, seed=B)
            row = {"model": name, "B": B}
            for mode in ("none", "ngram"):
                progress(f"{name} B={B} {mode}")
                row[mode] = run(model, tokenizer, grammar_tokenizer, mode, batch, args.max_tokens)
            plain, spec = row["none"], row["ngram"]
            row["speedup"] = spec["tok_s"] / plain["tok_s"]
            row["same_output"] = plain["texts"] == spec["texts"]
            results.append(row)
            print(f"{name:28s} B={B:<3d} plain {plain['tok_s']:7.1f} tok/s  ngram "
                  f"{spec['tok_s']:7.1f} tok/s  x{row['speedup']:.2f}  "
                  f"mask {plain['mask_ms_per_step']:.2f} ms of a {plain['ms_per_step']:.1f} ms "
                  f"plain step ({100 * plain['mask_ms_per_step'] / plain['ms_per_step']:.1f}%)  "
                  f"forced {100 * plain['forced'] / plain['tokens']:.0f}%  "
                  f"parsed {plain['parsed']}/{B} {spec['parsed']}/{B}  "
                  f"same {row['same_output']}", flush=True)
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / "bench_structured.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
