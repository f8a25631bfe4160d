"""Does a ragged KV cache slow plain steps down? Aligned vs ragged, side by side.

After a verification pass, rows keep different numbers of drafts and end at
different positions; ``RaggedKVCache`` then writes new entries with a scatter
and builds its mask per row, where upstream's aligned ``BatchKVCache`` uses a
slice update and one causal mask. Plain steps taken after speculation pay
that difference for as long as the rows stay ragged, and the controller
cannot see it (it compares verify steps with plain steps in the same state).

One run, one model, B sequences over a cache of L entries (random keys and
values: the cost of a step does not depend on them):

- ``forward``: a one-token forward pass of the whole model, aligned and
  ragged (rows rolled back by 0, 1, 2 entries), interleaved, median of N;
- ``write+mask``: the cache update and mask alone, all layers;
- ``realign``: what the first plain step after a verification pays to make
  ragged rows end together again, every layer's keys and values rotated
  row by row (``rotated_rows``), as one gather against as slices.

Run from the repository root (re-executes itself with OpenBLAS preloaded):

    .venv/bin/python scripts/bench/bench_ragged_cache.py --batch-size 16 --length 1000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mlx_lm_server.runtime.blas import ensure_fast_blas  # noqa: E402  (no MLX import)


def make_caches(model, B: int, L: int, ragged: bool, seed: int) -> list:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from mlx_lm_server.kv import make_rollbackable, rollback

    args = model.args
    H = args.num_key_value_heads
    D = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    key = mx.random.key(seed)
    pads = mx.random.randint(0, max(1, L // 4), (B,), key=key).tolist()
    caches = []
    for _ in model.layers:
        c = BatchKVCache(pads)
        c.update_and_fetch(mx.random.normal((B, H, L, D)), mx.random.normal((B, H, L, D)))
        caches.append(c)
    mx.eval([c.keys for c in caches] + [c.values for c in caches])
    if ragged:
        caches = make_rollbackable(caches)
        rollback(caches, [i % 3 for i in range(B)])
    return caches


def undo(caches: list, n: int) -> None:
    """Drop the entries a timed step appended, so every repeat sees the same cache
    (``RaggedKVCache.trim`` rolls every row back by n)."""
    from mlx_lm.models.cache import trim_prompt_cache

    trim_prompt_cache(caches, n)


def time_forward(model, caches, tokens) -> float:
    import mlx.core as mx

    tic = time.perf_counter()
    mx.eval(model(tokens, cache=caches))
    dt = time.perf_counter() - tic
    undo(caches, tokens.shape[1])
    return dt


def time_write_and_mask(caches, kv) -> float:
    import mlx.core as mx

    tic = time.perf_counter()
    out = []
    for c in caches:
        out += list(c.update_and_fetch(kv, kv))
        out.append(c.make_mask(kv.shape[2], return_array=True))
    mx.eval(out)
    dt = time.perf_counter() - tic
    undo(caches, kv.shape[2])
    return dt


def time_realign(caches, by_slices: bool) -> float:
    import mlx.core as mx

    from mlx_lm_server.kv.rows import rotated_rows

    ends = caches[0].ends
    shifts = [max(ends) - e for e in ends]
    tic = time.perf_counter()
    mx.eval([rotated_rows(a, shifts, by_slices) for c in caches for a in (c.keys, c.values)])
    return time.perf_counter() - tic


def side_by_side(fn_aligned, fn_ragged, repeats: int) -> tuple[float, float]:
    for _ in range(2):  # warm-up
        fn_aligned(), fn_ragged()
    a, r = [], []
    for _ in range(repeats):
        a.append(fn_aligned())
        r.append(fn_ragged())
    return statistics.median(a), statistics.median(r)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--length", type=int, default=1000, help="cache entries per row")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    ensure_fast_blas()

    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(args.model)
    B, L = args.batch_size, args.length
    print(f"{Path(args.model).name}: B={B}, L={L}, medians of {args.repeats}, "
          "aligned and ragged interleaved", flush=True)
    aligned = make_caches(model, B, L, ragged=False, seed=0)
    ragged = make_caches(model, B, L, ragged=True, seed=0)
    tokens = mx.random.randint(0, 1000, (B, 1)).astype(mx.int32)
    a, r = side_by_side(lambda: time_forward(model, aligned, tokens),
                        lambda: time_forward(model, ragged, tokens), args.repeats)
    print(f"  forward     aligned {a * 1e3:8.1f} ms  ragged {r * 1e3:8.1f} ms  ratio {r / a:.3f}")
    first = aligned[0].keys
    kv = mx.random.normal((B, first.shape[1], 1, first.shape[3]))
    a, r = side_by_side(lambda: time_write_and_mask(aligned, kv),
                        lambda: time_write_and_mask(ragged, kv), args.repeats)
    print(f"  write+mask  aligned {a * 1e3:8.1f} ms  ragged {r * 1e3:8.1f} ms  ratio {r / a:.3f}")
    g, sl = side_by_side(lambda: time_realign(ragged, False),
                         lambda: time_realign(ragged, True), args.repeats)
    print(f"  realign     gather  {g * 1e3:8.1f} ms  slices {sl * 1e3:8.1f} ms  ratio {sl / g:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
