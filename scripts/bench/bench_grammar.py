"""Per-step cost of computing grammar masks for a batch, by grammar engine.

Structured output computes, every decode step, one token mask per constrained
row over the whole vocabulary. This script measures that cost for the grammar
engines on the package registry, for a JSON schema at a real tokenizer's
vocabulary (Qwen2.5: 151,936 logits), stepping B rows through valid
documents token by token:

    .venv/bin/python scripts/bench/bench_grammar.py --model models/qwen2.5-coder-0.5b-instruct --batch 32

It reports grammar compile time and the mean time per step to fill the
batch's masks (llguidance one row after another and with its thread pool;
outlines-core one row after another). xgrammar is not measured: its Linux
wheels require PyTorch and the CUDA toolkit (several GB) for a host-side
mask we would not use them for.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from mlx_lm_server.runtime.blas import ensure_fast_blas

ensure_fast_blas()

import numpy as np  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "email": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "status": {"enum": ["active", "inactive", "pending"]},
    },
    "required": ["name", "email", "age", "city", "tags", "status"],
    "additionalProperties": False,
}


def documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = "alpha beta gamma delta orbit river stone maple cedar quartz harbor".split()
    out = []
    for _ in range(n):
        name = " ".join(rng.choice(words).title() for _ in range(2))
        out.append(json.dumps({
            "name": name, "email": f"{name.split()[0].lower()}@example.com",
            "age": rng.randint(18, 90), "city": rng.choice(words).title(),
            "tags": [rng.choice(words) for _ in range(rng.randint(1, 4))],
            "status": rng.choice(["active", "inactive", "pending"]),
        }))
    return out


def bench_llguidance(tokenizer, vocab: int, docs: list[list[int]]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lnp

    tic = time.perf_counter()
    lt = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    tokenizer_s = time.perf_counter() - tic
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    tic = time.perf_counter()
    matchers = [llguidance.LLMatcher(lt, grammar) for _ in docs]
    compile_s = (time.perf_counter() - tic) / len(docs)
    mask = lnp.allocate_token_bitmask(len(docs), vocab)
    executor = llguidance.LLExecutor()
    out = {"tokenizer_s": tokenizer_s, "compile_s": compile_s}
    for name, parallel in (("serial", False), ("thread_pool", True)):
        for m in matchers:
            m.reset()
        steps, total = 0, 0.0
        for j in range(max(map(len, docs))):
            live = [(m, i) for i, (m, d) in enumerate(zip(matchers, docs)) if j < len(d)]
            tic = time.perf_counter()
            if parallel:
                lnp.fill_next_token_bitmask_par(executor, live, mask)
            else:
                for m, i in live:
                    lnp.fill_next_token_bitmask(m, mask, i)
            total += time.perf_counter() - tic
            steps += 1
            for m, i in live:
                assert m.consume_token(docs[i][j]), m.get_error()
        out[f"{name}_ms_per_step"] = 1e3 * total / steps
    return out


def bench_outlines(tokenizer, vocab: int, docs: list[list[int]]) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    tic = time.perf_counter()
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    table: dict = {}
    eos = tokenizer.eos_token_id
    for token, i in tokenizer.get_vocab().items():
        if i == eos or token in tokenizer.all_special_tokens:
            continue
        try:
            key = bytes(byte_of[c] for c in token)
        except KeyError:
            key = token.encode()
        table.setdefault(key, []).append(i)
    vocabulary = Vocabulary(eos, table)
    tokenizer_s = time.perf_counter() - tic
    regex = build_regex_from_schema(json.dumps(SCHEMA))
    tic = time.perf_counter()
    index = Index(regex, vocabulary)
    compile_s = time.perf_counter() - tic
    guides = [Guide(index) for _ in docs]
    mask = np.zeros((len(docs), (vocab + 31) // 32), np.int32)
    steps, total = 0, 0.0
    for j in range(max(map(len, docs))):
        live = [i for i, d in enumerate(docs) if j < len(d)]
        tic = time.perf_counter()
        for i in live:
            guides[i].write_mask_into(mask[i].ctypes.data, mask.shape[1], 4)
        total += time.perf_counter() - tic
        steps += 1
        for i in live:
            guides[i].advance(docs[i][j])
    return {"tokenizer_s": tokenizer_s, "compile_s": compile_s,
            "serial_ms_per_step": 1e3 * total / steps}


def _bytes_to_unicode() -> dict:
    """GPT-2's byte-level BPE alphabet: byte -> the character standing for it."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=None, help="logits width (default: the model's)")
    ap.add_argument("--engines", nargs="+", default=["llguidance", "outlines-core"])
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    vocab = args.vocab
    if vocab is None:
        with open(f"{args.model}/config.json") as f:
            vocab = json.load(f)["vocab_size"]
    docs = [tokenizer.encode(d) for d in documents(args.batch)]
    print(f"vocabulary {vocab}, batch {args.batch}, "
          f"{sum(map(len, docs)) / len(docs):.0f} tokens per document")
    for engine in args.engines:
        fn = bench_llguidance if engine == "llguidance" else bench_outlines
        result = fn(tokenizer, vocab, docs)
        print(engine, json.dumps({k: round(v, 4) for k, v in result.items()}))


if __name__ == "__main__":
    main()
