"""Benchmark this project's server against upstream ``mlx_lm.server``.

One run starts OUR server (``mlx-lm-server``) and then UPSTREAM's
(``python -m mlx_lm.server``) on the same model and port, one after the other,
and stops each before the next starts. Against each it sends waves of N
concurrent streaming ``/v1/chat/completions`` requests (N from
``--concurrency``), temperature 0 and a fixed ``max_tokens``, and measures:

- TTFT: seconds from sending a request to its first non-empty content delta
  (our server's empty ``role`` chunk does not count);
- per-request decode tok/s: (completion tokens - 1) / (end of stream - first token);
- aggregate tok/s: all completion tokens of the wave / wall time from the
  first request sent to the last stream finished (prefill included).

Tokens are counted the same way for both servers: ``usage.completion_tokens``
from the final chunk that ``"stream_options": {"include_usage": true}`` asks
for (both servers send it). The number of content chunks is recorded too, as
a cross-check. Each wave is repeated ``--repeats`` times; the tables show the
median over repeats of each wave's numbers (TTFT and per-request tok/s are
first averaged over the wave's successful requests); ``failed`` counts
requests that got an error or a broken stream, summed over repeats.

Fairness:
- both servers batch at least N wide: ours ``--max-batch-size`` and
  ``--prefill-batch-size``, upstream ``--decode-concurrency`` and
  ``--prompt-concurrency`` all set to the largest N;
- both run with OpenBLAS preloaded (ours re-execs itself with it; upstream is
  started with ``LD_PRELOAD`` from ``mlx_lm_server.runtime.blas.find_openblas()``);
- every request starts with a tag unique within a run (the same tags, so the
  same prompts, for both servers), so neither server's prompt cache can
  reuse a previous wave's prompt;
- each server gets one untimed warm-up request first.

Run it from the repository root:

    .venv/bin/python scripts/bench/bench_server.py --model models/smollm2-135m-instruct
    .venv/bin/python scripts/bench/bench_server.py --concurrency 1 4 --max-tokens 64 --only ours

``--variants`` instead compares our server with itself, as a user would try
two settings: one server per variant, one after another, the order turned
around each of ``--rounds`` rounds (the machine drifts), and prints each
variant's aggregate tok/s over the first's, per round and on the whole, and
whether every answer was the same text:

    .venv/bin/python scripts/bench/bench_server.py --model models/qwen2.5-coder-0.5b-instruct \
        --variants "none=--spec-decode none" "ngram=--spec-decode ngram" --concurrency 1 8

Results also go to ``bench_out/bench_server.json``; server logs to
``bench_out/bench_server_<name>.log``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import httpx

from servers import (OUT_DIR, PROMPTS, launch, make_body, one_request, ours_command,
                     port_in_use, progress, request_model_name, stop, upstream_command,
                     upstream_env, wait_ready)


# ---------------------------------------------------------------- servers

def start_server(name: str, args, width: int, extra: tuple = ()):
    """Server `name` on args.port, batching ``width`` wide (ours with
    ``extra`` flags after its own)."""
    if port_in_use(args.port):
        raise SystemExit(f"error: port {args.port} is already in use; pass --port")
    if name == "upstream":
        cmd = upstream_command(args.model, args.port, "--decode-concurrency", str(width),
                               "--prompt-concurrency", str(width), "--max-tokens",
                               str(args.max_tokens), "--log-level", "WARNING")
        return launch(cmd, f"bench_server_{name}", upstream_env())
    cmd = ours_command(args.model, args.port, "--max-batch-size", str(width),
                       "--prefill-batch-size", str(width), "--log-level", "warning", *extra)
    return launch(cmd, f"bench_server_{name}")


# ---------------------------------------------------------------- clients

def wave_prompts(n: int, wave_tag: str) -> list[str]:
    return [f"[{wave_tag}-{i}] {PROMPTS[i % len(PROMPTS)]}" for i in range(n)]


async def run_wave(base: str, model: str, n: int, max_tokens: int, tag: str,
                   timeout: float) -> dict:
    url = f"{base}/v1/chat/completions"
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        bodies = [make_body(model, p, max_tokens) for p in wave_prompts(n, tag)]
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, url, b) for b in bodies))
        wall = time.perf_counter() - t0
    return summarize_wave(results, wall)


def mean_of(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def summarize_wave(results: list[dict], wall: float) -> dict:
    tokens = sum(r["completion_tokens"] for r in results)
    ttfts = [r["ttft_s"] for r in results]
    return {
        "wall_s": wall,
        "total_tokens": tokens,
        "content_chunks": sum(r["content_chunks"] for r in results),
        "agg_tok_s": tokens / wall if wall > 0 else None,
        "req_tok_s": mean_of(r["decode_tok_s"] for r in results),
        "ttft_s": mean_of(ttfts),
        "ttft_max_s": max((t for t in ttfts if t is not None), default=None),
        "errors": [r["error"] for r in results if r["error"]],
        "requests": [{k: v for k, v in r.items() if k not in ("start", "end")}
                     for r in results],
    }


def median_of(waves: list[dict], key: str) -> float | None:
    values = [w[key] for w in waves if w[key] is not None]
    return statistics.median(values) if values else None


# ---------------------------------------------------------------- driver

def bench_server(name: str, args, extra: tuple = ()) -> dict:
    width = max(args.concurrency)
    base = f"http://127.0.0.1:{args.port}"
    model = request_model_name(name == "upstream", args.model)
    procs = start_server(name, args, width, extra)
    proc = procs[0]
    try:
        t0 = time.perf_counter()
        wait_ready(procs, base, args.ready_timeout)
        progress(f"[{name}] ready after {time.perf_counter() - t0:.1f} s; warming up")
        warm = asyncio.run(run_wave(base, model, 1, args.max_tokens, "warmup",
                                    args.request_timeout))
        check_wave(name, "warm-up", warm)
        results = {}
        for n in args.concurrency:
            waves = []
            for rep in range(args.repeats):
                tag = f"n{n}-r{rep}"  # the same prompts for both servers
                wave = asyncio.run(run_wave(base, model, n, args.max_tokens, tag,
                                            args.request_timeout))
                check_wave(name, f"N={n} repeat {rep + 1}", wave)
                if proc.poll() is not None:
                    raise RuntimeError(f"[{name}] server exited with status "
                                       f"{proc.returncode} during N={n}; see bench_out/")
                waves.append(wave)
            results[n] = {"waves": waves, **{k: median_of(waves, k) for k in SUMMARY_KEYS},
                          "failed_requests": sum(len(w["errors"]) for w in waves)}
        return results
    finally:
        progress(f"[{name}] stopped (exit status {stop(procs, grace=15)[0]})")


SUMMARY_KEYS = ("agg_tok_s", "req_tok_s", "ttft_s", "ttft_max_s", "total_tokens",
                "content_chunks", "wall_s")


def check_wave(name: str, label: str, wave: dict) -> None:
    progress(f"[{name}] {label}: {wave['total_tokens']} tokens in {wave['wall_s']:.2f} s, "
             f"agg {fmt(wave['agg_tok_s'])} tok/s, req {fmt(wave['req_tok_s'])} tok/s, "
             f"TTFT {fmt(wave['ttft_s'], 3)} s, load avg {os.getloadavg()[0]:.1f}"
             + (f", {len(wave['errors'])} ERRORS: {wave['errors'][:2]}"
                if wave["errors"] else ""))


# ---------------------------------------------------------------- output

def fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(name: str, results: dict) -> None:
    print(f"\n{name}: median of repeats")
    print(f"{'N':>4} {'agg tok/s':>10} {'req tok/s':>10} {'TTFT s':>8} "
          f"{'TTFT max':>9} {'tokens':>7} {'chunks':>7} {'wall s':>7} {'failed':>6}")
    for n, r in results.items():
        print(f"{n:>4} {fmt(r['agg_tok_s']):>10} {fmt(r['req_tok_s']):>10} "
              f"{fmt(r['ttft_s'], 3):>8} {fmt(r['ttft_max_s'], 3):>9} "
              f"{fmt(r['total_tokens'], 0):>7} {fmt(r['content_chunks'], 0):>7} "
              f"{fmt(r['wall_s'], 2):>7} {r['failed_requests']:>6}")


def ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def ratios(ours: dict, upstream: dict) -> dict:
    return {n: {k: ratio(ours[n][k], upstream[n][k])
                for k in ("agg_tok_s", "req_tok_s", "ttft_s")}
            for n in ours if n in upstream}


def print_ratios(table: dict) -> None:
    print("\nours / upstream (tok/s: higher is better for ours; TTFT: lower is better)")
    print(f"{'N':>4} {'agg tok/s':>10} {'req tok/s':>10} {'TTFT':>8}")
    for n, r in table.items():
        print(f"{n:>4} {fmt(r['agg_tok_s'], 2):>10} {fmt(r['req_tok_s'], 2):>10} "
              f"{fmt(r['ttft_s'], 2):>8}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--only", choices=("ours", "upstream"), default=None)
    p.add_argument("--variants", nargs="+", metavar="NAME=FLAGS",
                   help="compare our server with itself under these flags (the first is "
                        "the reference), e.g. \"none=--spec-decode none\"")
    p.add_argument("--rounds", type=int, default=2,
                   help="--variants: rounds, the order turned around each round")
    p.add_argument("--ready-timeout", type=float, default=300,
                   help="seconds to wait for a server to come up")
    p.add_argument("--request-timeout", type=float, default=900,
                   help="seconds one streaming request may take")
    return p.parse_args(argv)


def compare_variants(args) -> dict:
    """Each variant's server in turn, ``args.rounds`` rounds in alternating
    order: per N, every round's aggregate tok/s ratio to the first variant,
    and how many answers differ from the first variant's text."""
    variants = dict(v.split("=", 1) for v in args.variants)
    names = list(variants)
    rounds = []
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        rounds.append({name: bench_server(name, args, tuple(variants[name].split()))
                       for name in order})
    base = names[0]
    table = {}
    for n in args.concurrency:
        for name in names[1:]:
            per_round = [ratio(rd[name][n]["agg_tok_s"], rd[base][n]["agg_tok_s"])
                         for rd in rounds]
            differ = sum(a["text"] != b["text"]
                         for rd in rounds
                         for wa, wb in zip(rd[name][n]["waves"], rd[base][n]["waves"])
                         for a, b in zip(wa["requests"], wb["requests"]))
            total = sum(len(w["requests"]) for rd in rounds for w in rd[name][n]["waves"])
            table[f"{name}/{base} N={n}"] = {
                "mean": statistics.fmean(per_round), "rounds": per_round,
                "base_tok_s": [rd[base][n]["agg_tok_s"] for rd in rounds],
                "identical": f"{total - differ}/{total}"}
    print(f"\naggregate tok/s over {base}'s, per round (order turned each round)")
    for key, row in table.items():
        print(f"{key:>24}  mean {row['mean']:.3f}  rounds "
              + " ".join(f"{x:.3f}" for x in row["rounds"])
              + f"  ({base}: " + " ".join(f"{x:.2f}" for x in row["base_tok_s"])
              + f" tok/s)  identical {row['identical']}")
    return {"rounds": rounds, "ratios": table}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.variants:
        out = {"args": vars(args), **compare_variants(args)}
        OUT_DIR.mkdir(exist_ok=True)
        (OUT_DIR / "bench_server_variants.json").write_text(json.dumps(out, indent=2))
        print(f"\nwrote {OUT_DIR / 'bench_server_variants.json'}")
        return 0
    names = [args.only] if args.only else ["ours", "upstream"]
    all_results = {}
    for name in names:
        all_results[name] = bench_server(name, args)
    for name in names:
        print_table(name, all_results[name])
    table = None
    if len(names) == 2:
        table = ratios(all_results["ours"], all_results["upstream"])
        print_ratios(table)
    OUT_DIR.mkdir(exist_ok=True)
    out = {"args": vars(args), "results": all_results, "ratios": table,
           "token_count": "usage.completion_tokens from include_usage chunk"}
    (OUT_DIR / "bench_server.json").write_text(json.dumps(out, indent=2))
    print(f"\nwrote {OUT_DIR / 'bench_server.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
