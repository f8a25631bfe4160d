"""Where a speculative decode step spends its time, against the bare forward.

For each batch size B: B code-edit prompts are prefilled together through
upstream's ``BatchGenerator``, the engine is installed at a fixed k (controller
off), and then, after warm-up steps that compile every shape:

- ``step``: one engine step, synchronised before and after (its whole cost);
- ``forward``: the model alone over ``[B, k+1]`` on the same (ragged) cache,
  rolled back afterwards, and over ``[B, 1]``;
- ``plain``: upstream's one-token step on the same batch;
- a cProfile of ``--profile-steps`` engine steps, top functions by own time
  (time inside ``tolist``/``eval`` is the host waiting for the device).

Ratios ``step / forward`` are the overhead a verify step adds to its forward.

    .venv/bin/python scripts/bench/profile_step.py --model models/qwen2.5-coder-0.5b-instruct \\
        --batch-sizes 1 16 --k 10
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mlx_lm_server.runtime.blas import ensure_fast_blas  # noqa: E402


def timed(fn, repeats: int) -> float:
    import mlx.core as mx

    times = []
    for _ in range(repeats):
        mx.synchronize()
        tic = time.perf_counter()
        fn()
        mx.synchronize()
        times.append(time.perf_counter() - tic)
    return 1e3 * statistics.median(times)


def synced(fn, phases: dict, name: str):
    import mlx.core as mx

    def wrapper(*a, **kw):
        mx.synchronize()
        tic = time.perf_counter()
        out = fn(*a, **kw)
        mx.eval(out) if isinstance(out, mx.array) else None
        mx.synchronize()
        phases.setdefault(name, []).append(time.perf_counter() - tic)
        return out
    return wrapper


def instrument(engine, phases: dict) -> list:
    """Wrap the engine's phases (whichever of these names exist) in synced timers."""
    restore = []
    targets = [(engine, n) for n in ("_process", "_verify", "_emit", "_target_logits",
                                     "_verify_batch", "_accept")]
    targets += [(engine.proposer, "propose")]
    for obj, name in targets:
        fn = getattr(obj, name, None)
        if fn is not None:
            restore.append((obj, name, fn))
            setattr(obj, name, synced(fn, phases, name))
    restore.append((engine, "model", engine.model))
    engine.model = synced(engine.model, phases, "forward")
    return restore


def prefilled_batch(model, engine, prompts: list, params=None, constraints=None) -> tuple:
    """``(generator, its decoding batch)``: the prompts prefilled together
    through upstream's ``BatchGenerator`` with ``engine`` installed, greedy
    unless ``params`` says otherwise, decoding without a length limit;
    ``constraints``: a grammar's ``Constraint`` per prompt, installed as a
    server installs it (upstream's processor, the engine's constraint)."""
    from mlx_lm.generate import BatchGenerator

    from mlx_lm_server.decoding.sampling import SamplingParams, make_processors, make_sampler
    from mlx_lm_server.decoding.structured import GrammarProcessor
    from mlx_lm_server.runtime import mlx_lm_adapter

    B = len(prompts)
    gen = BatchGenerator(model, completion_batch_size=B, prefill_batch_size=B)
    engine.install(gen)
    params = params or SamplingParams(temperature=0.0)
    constraints = constraints or [None] * B
    upstream = [make_processors(params) + ([GrammarProcessor(c)] if c else [])
                for c in constraints]
    uids = gen.insert(prompts, max_tokens=[100_000] * B, samplers=[make_sampler(params)] * B,
                      logits_processors=upstream)
    for uid, p, c in zip(uids, prompts, constraints):
        engine.add_sequence(uid, params, len(p), processors=make_processors(params), constraint=c)
    while len(mlx_lm_adapter.generation_batch(gen)) < B:
        gen.next()
    return gen, mlx_lm_adapter.generation_batch(gen)


def run(model, tokenizer, B: int, k: int, args) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache
    from workloads import chat_tokens, code_edit_prompts

    from mlx_lm_server.runtime import mlx_lm_adapter
    from mlx_lm_server.spec_decode import make_engine
    from mlx_lm_server.spec_decode.config import SpecDecodeConfig

    prompts = [chat_tokens(tokenizer, t) for t in code_edit_prompts()]
    prompts = [prompts[i % len(prompts)] for i in range(B)]
    config = SpecDecodeConfig(mode="ngram", num_speculative_tokens=k, dynamic=False,
                              adaptive_k=False)
    engine = make_engine(model, config)
    gen, batch = prefilled_batch(model, engine, prompts)

    for _ in range(args.warmup):
        gen.next()
    step_ms = timed(gen.next, args.steps)
    caches = batch.prompt_cache
    Bn = len(batch.uids)

    def forward(T):
        def f():
            x = mx.zeros((Bn, T), mx.int32)
            mx.eval(model(x, cache=caches))
            for c in caches:
                c.rollback([T] * Bn) if hasattr(c, "rollback") else c.trim(T)
        return f

    fwd_k = timed(forward(k + 1), args.steps)
    fwd_1 = timed(forward(1), args.steps)
    plain = timed(lambda: mlx_lm_adapter.plain_step(batch), args.steps)

    # Bare forward with upstream's plain KVCache at the same context, one row.
    ctx = len(batch.tokens[0])
    plain_cache = [KVCache() for _ in model.layers]
    mx.eval(model(mx.zeros((Bn, ctx), mx.int32), cache=plain_cache))

    def bare(T):
        def f():
            mx.eval(model(mx.zeros((Bn, T), mx.int32), cache=plain_cache))
            for c in plain_cache:
                c.trim(T)
        return f

    bare_k = timed(bare(k + 1), args.steps)
    bare_1 = timed(bare(1), args.steps)
    plain_cache.clear()  # its memory, before the next batch size

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.profile_steps):
        gen.next()
    mx.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)

    # Phases, each synchronised before and after (cProfile cannot see MLX's
    # nanobind calls, so their time lands in the Python caller).
    phases: dict = {}
    restore = instrument(engine, phases)
    total = timed(gen.next, args.profile_steps)
    for obj, name, fn in restore:
        setattr(obj, name, fn)
    phases = {n: 1e3 * sum(v) / args.profile_steps for n, v in phases.items()}
    phases["other"] = total - sum(phases.values())
    gen.close()
    row = {"B": Bn, "k": k, "context": ctx, "step_ms": step_ms, "forward_k_ms": fwd_k,
           "forward_1_ms": fwd_1, "plain_step_ms": plain, "bare_forward_k_ms": bare_k,
           "bare_forward_1_ms": bare_1, "phases_ms": phases, "profile": s.getvalue()}
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    ensure_fast_blas()
    from mlx_lm import load

    model, tokenizer = load(args.model)
    rows = []
    for B in args.batch_sizes:
        row = run(model, tokenizer, B, args.k, args)
        rows.append(row)
        print(f"B={row['B']} k={row['k']} ctx={row['context']}: step {row['step_ms']:.2f} ms, "
              f"forward(k+1) {row['forward_k_ms']:.2f}, forward(1) {row['forward_1_ms']:.2f}, "
              f"plain step {row['plain_step_ms']:.2f}, bare KVCache forward(k+1) "
              f"{row['bare_forward_k_ms']:.2f}, forward(1) {row['bare_forward_1_ms']:.2f}; "
              f"step/bare(k+1) {row['step_ms'] / row['bare_forward_k_ms']:.2f}x", flush=True)
        print("  phases (ms/step, synced): " + ", ".join(
            f"{n} {v:.2f}" for n, v in row["phases_ms"].items()), flush=True)
        print(row["profile"], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
