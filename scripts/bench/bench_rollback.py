#!/usr/bin/env python
"""What rolling back sliding-window and recurrent layers costs, against the
verify forward it follows.

For each family (random weights, built with mlx-lm's own classes as the tests
build them): a batch of B rows with a 256-token context verifies k+1 tokens,
then every row keeps a random 1..k+1 of them. Timed, each evaluated to the
end: the verify forward; the rollback (attention rows: host bookkeeping;
sliding windows: host bookkeeping; recurrent layers: the replay of the kept
inputs through their mixers, evaluated). ``--width`` picks the tiny test
shapes (64) or a wider model (e.g. 1024) whose matmuls dominate as in real
models.

    .venv/bin/python scripts/bench/bench_rollback.py --width 64 --width 1024
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from mlx_lm_server.runtime.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()  # before MLX is imported

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402


def _config(family: str, width: int) -> dict:
    from tiny_models import CONFIGS

    config = copy.deepcopy(CONFIGS[family])
    text = config.get("text_config", config)
    scale = width // 64
    text["hidden_size"] = width
    for key in ("intermediate_size", "block_ff_dim", "block_dim"):
        if key in text:
            text[key] = text[key] * scale if key != "block_dim" else width
    for key in ("linear_num_value_heads", "linear_num_key_heads", "num_attention_heads",
                "num_key_value_heads"):
        if key in text:
            text[key] = text[key] * scale
    return config


def _model(family: str, width: int):
    import tiny_models
    from mlx_lm import load

    folder = Path(tempfile.mkdtemp()) / family
    saved = tiny_models.CONFIGS[family]
    tiny_models.CONFIGS[family] = _config(family, width)
    try:
        tokenizer_src = ROOT / "models" / "smollm2-135m-instruct"
        tiny_models.build(family, folder, tokenizer_src)
    finally:
        tiny_models.CONFIGS[family] = saved
    return load(str(folder))[0]


def measure(model, batch: int, k: int, context: int, repeats: int, rng) -> dict:
    from mlx_lm_server.kv import (
        Checkpoint,
        batch_caches,
        install_recorders,
        make_rollbackable,
        rollback,
    )
    from mlx_lm_server.kv.recurrent import snapshot

    install_recorders(model)
    caches = batch_caches(model, [0] * batch)
    mx.eval(model(mx.array(rng.integers(100, 5000, (batch, context))), cache=caches))
    for c in caches:
        c.finalize()
    caches = make_rollbackable(caches)
    forward, back = [], []
    for r in range(repeats + 1):
        tokens = mx.array(rng.integers(100, 5000, (batch, k + 1)))
        keep = rng.integers(1, k + 2, batch).tolist()
        mx.eval([c.state for c in caches])
        tic = time.perf_counter()
        with Checkpoint(caches) as checkpoint:
            mx.eval(model(tokens, cache=caches))
        mid = time.perf_counter()
        rollback(caches, [k + 1 - n for n in keep])
        checkpoint.rollback(keep, k + 1)
        mx.eval(snapshot(caches))
        end = time.perf_counter()
        if r:  # the first run compiles
            forward.append(mid - tic)
            back.append(end - mid)
    return {"forward_ms": 1e3 * statistics.median(forward),
            "rollback_ms": 1e3 * statistics.median(back)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", action="append",
                        help="gemma3_text, qwen3_5, lfm2 (default: all)")
    parser.add_argument("--width", action="append", type=int, help="hidden size (default 64)")
    parser.add_argument("--batch", action="append", type=int, help="rows (default 1 and 8)")
    parser.add_argument("-k", type=int, default=4, help="drafts per row (default 4)")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    families = args.family or ["gemma3_text", "qwen3_5", "lfm2"]
    rng = np.random.default_rng(0)
    print(f"device {mx.default_device()}, k={args.k}, context {args.context}, "
          f"median of {args.repeats}")
    print(f"{'family':<12} {'width':>5} {'B':>3} {'forward ms':>11} {'rollback ms':>12} {'ratio':>6}")
    for width in args.width or [64]:
        for family in families:
            model = _model(family, width)
            for batch in args.batch or [1, 8]:
                m = measure(model, batch, args.k, args.context, args.repeats, rng)
                print(f"{family:<12} {width:>5} {batch:>3} {m['forward_ms']:>11.2f} "
                      f"{m['rollback_ms']:>12.2f} {m['rollback_ms'] / m['forward_ms']:>6.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
