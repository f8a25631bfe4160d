#!/usr/bin/env python
"""What quantizing the target (or its drafter) costs a learned drafter's acceptance.

``mtp``: tiny Hugging Face folders whose MTP or nextn layer copies the
target's own layer (``tests/tiny_models.py``: Qwen3.5's ``mtp.*``, GLM-4.5's
nextn layer), each converted with ``mlx-lm-server-models convert
--quantize 4`` twice, the layer quantized like the target and left
unquantized, then served greedy with ``--spec-decode mtp`` at fixed k:
the share of drafted tokens kept and the tokens a verification emits.

``head``: an EAGLE-3 head's teacher-forced acceptance (``drafter evaluate``'s
figures) on the float32 target and on the same target quantized to 8 and
4 bits (mlx-lm's quantization, group size 64), the head unchanged. The
quantized targets run through their weights dequantized back to float32:
the function MLX's quantized matmul computes, whose CPU kernel is about 40
times slower than float32 BLAS here (SmolLM2, a 64-token pass: 19.1 s
4-bit, 0.45 s float32).

    .venv/bin/python scripts/bench/bench_drafter_precision.py mtp
    .venv/bin/python scripts/bench/bench_drafter_precision.py head \\
        --model models/smollm2-135m-instruct --head heads/smollm2-code --data held_out/*.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from mlx_lm_server.runtime.blas import ensure_fast_blas  # noqa: E402  (no MLX import)

PROMPTS = ["hello there my friend", "def f(x): return", "one two three four five",
           "the cat sat on the mat and", "a b c d e f g", "print('hi')",
           "Once upon a time", "import numpy as np"]


def served_acceptance(folder: Path, k: int, max_tokens: int) -> dict:
    """Greedy ``--spec-decode mtp`` over ``PROMPTS`` at once: drafted, kept."""
    from mlx_lm import load

    from mlx_lm_server.assembly import make_scheduler
    from mlx_lm_server.decoding.sampling import SamplingParams
    from mlx_lm_server.serving.request import DoneEvent, ErrorEvent, GenerationRequest
    from mlx_lm_server.spec_decode import make_engine
    from mlx_lm_server.spec_decode.config import SpecDecodeConfig

    model, tokenizer = load(str(folder))
    config = SpecDecodeConfig(mode="mtp", num_speculative_tokens=k, dynamic=False,
                              adaptive_k=False, calibration_seconds=0)
    scheduler = make_scheduler(model, tokenizer, max_batch_size=16, max_queued_requests=64,
                               engine=make_engine(model, config, tokenizer, str(folder)))
    scheduler.start()

    async def one(prompt):
        handle = scheduler.submit(GenerationRequest(tokenizer.encode(prompt), max_tokens,
                                                    SamplingParams(temperature=0.0)))
        while True:
            event = await handle.events.get()
            if isinstance(event, ErrorEvent):
                raise RuntimeError(event.message)
            if isinstance(event, DoneEvent):
                return

    async def run():
        await asyncio.gather(*[one(p) for p in PROMPTS])

    try:
        asyncio.run(run())
        counts = scheduler.spec_stats.tokens
    finally:
        scheduler.shutdown()
        scheduler.join(10)
    return {"drafted": counts.num_draft_tokens, "kept": counts.num_accepted_tokens,
            "acceptance": round(counts.acceptance_rate, 4),
            "tokens_per_verification": round(counts.mean_accepted_length, 3)}


def measure_mtp(args) -> dict:
    from tiny_models import build_mtp_copy, build_nextn

    from mlx_lm_server.models.convert import convert
    from mlx_lm_server.models.store import fetch

    tokenizer_folder = fetch("smollm2-135m-instruct")
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sources = {"qwen3_5 (mtp.*)": build_mtp_copy(root / "qwen3_5", tokenizer_folder),
                   "glm4_moe (nextn)": build_nextn(root / "glm4_moe", tokenizer_folder)}
        for name, source in sources.items():
            for drafter in ("quantized", "unquantized"):
                folder = root / f"{source.name}-{drafter}"
                convert(str(source), str(folder), bits=args.bits, dtype="float32",
                        drafter=drafter, say=lambda line: None)
                out[f"{name}, drafter {drafter}"] = served_acceptance(folder, args.k,
                                                                      args.max_tokens)
                print(json.dumps({f"{name}, drafter {drafter}": out[f"{name}, drafter {drafter}"]}),
                      flush=True)
    return out


def dequantized(folder: str, bits):
    """The model of ``folder``, its weights quantized to ``bits`` as mlx-lm's
    conversion quantizes them and dequantized back to float32 (``bits``
    None: as it is)."""
    from mlx_lm import load
    from mlx_lm.utils import dequantize_model, quantize_model

    model, tokenizer = load(folder)
    if bits:
        model, _ = quantize_model(model, {}, 64, bits)
        model = dequantize_model(model)
    return model, tokenizer


def measure_head(args) -> dict:
    import mlx.core as mx

    from mlx_lm_server.drafter import data
    from mlx_lm_server.drafter.train import Target, evaluate
    from mlx_lm_server.runtime import mlx_lm_adapter
    from mlx_lm_server.spec_decode.heads.eagle3 import load_eagle3_head

    out = {}
    for bits in (None, 8, 4):
        model, tokenizer = dequantized(args.model, bits)
        mx.eval(model.parameters())
        head, layers, embed = load_eagle3_head(model, args.head)
        sequences = data.read_sequences(tokenizer, args.data, args.max_len)
        target = Target(model, layers, head.draft_ids())
        result = evaluate(head, embed or mlx_lm_adapter.token_embedding(model), target,
                          sequences, args.k)
        name = f"{bits}-bit target" if bits else "float32 target"
        out[name] = result
        print(json.dumps({name: result}), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    m = sub.add_parser("mtp", help="an MTP layer quantized like its 4-bit target, or not")
    m.add_argument("--bits", type=int, default=4)
    m.add_argument("--k", type=int, default=3)
    m.add_argument("--max-tokens", type=int, default=48)
    h = sub.add_parser("head", help="an EAGLE-3 head on its float32 target and on 8/4 bits")
    h.add_argument("--model", required=True)
    h.add_argument("--head", required=True)
    h.add_argument("--data", nargs="+", required=True)
    h.add_argument("--max-len", type=int, default=256)
    h.add_argument("--k", type=int, default=3)
    args = p.parse_args(argv)
    ensure_fast_blas()
    result = measure_mtp(args) if args.what == "mtp" else measure_head(args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    from mlx_lm_server.parallel.liveness import exit_now

    exit_now(main())
