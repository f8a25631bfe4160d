"""Tensor parallel, side by side in one run: one process against two ranks,
and ours against upstream's ``mlx_lm.server`` over the same two ranks.

Configurations (each started, measured and stopped before the next):

- ``one-none``: our server in one process, speculation off;
- ``up-2``: upstream ``mlx_lm.server`` as two ranks (it has no n-gram
  speculation and refuses draft models when distributed);
- ``ours-2-none`` / ``ours-2-ngram``: our server as two ranks, speculation
  off / n-gram.

Two-rank servers are started as ``mlx.launch`` starts them, but directly
(``MLX_RANK``, ``MLX_HOSTFILE``): on a small machine ``mlx.launch``'s own
output relay takes about half a core, which would tax both servers alike.
Workloads: ``chat`` (servers.py's prompts) and ``code-edit`` (rename a
function in a 60-line file, return the whole file: what n-gram drafting
serves best), each at 1 and 8 concurrent clients, temperature 0. Reported
per cell (median of ``--repeats`` waves): end-to-end tokens/s, decode
tokens/s (prefill left out), time to first token, their ratios, and for
our two-rank servers the bytes and time one plan costs per step (from
``/health``).

    .venv/bin/python scripts/bench/bench_tp.py --model models/qwen2.5-coder-0.5b-instruct
    .venv/bin/python scripts/bench/bench_tp.py --configs ours-2-none up-2 --clients 1

Results go to ``bench_out/bench_tp.json``; logs to
``bench_out/bench_tp_<config>.log`` (one process) or ``bench_tp_<config>_rank<r>.log``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

import httpx

from servers import (OUT_DIR, launch, make_body, one_request, ours_command, prompts_for,
                     rank_arguments, rank_plan, request_model_name, stop, upstream_command,
                     upstream_env, wait_ready)

from mlx_lm_server.runtime.ports import free_ports

CONFIGS = ("one-none", "up-2", "ours-2-none", "ours-2-ngram")


def start(config: str, args) -> tuple[list[subprocess.Popen], int]:
    port, *ring = free_ports(3)
    if config == "up-2":
        cmd = upstream_command(args.model, port, "--decode-concurrency", "8",
                               "--prompt-concurrency", "8", "--log-level", "WARNING")
    else:
        cmd = ours_command(args.model, port, "--spec-decode", config.rsplit("-", 1)[1],
                           "--max-batch-size", "8", "--prefill-batch-size", "8",
                           "--log-level", "info")
    procs = launch(cmd, f"bench_tp_{config}", upstream_env() if config == "up-2" else None,
                   [] if config.startswith("one") else ring)
    wait_ready(procs, f"http://127.0.0.1:{port}", 300)
    return procs, port


async def wave(url: str, model: str, prompts: list[str], max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        bodies = [make_body(model, p, max_tokens) for p in prompts]
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, url, b) for b in bodies))
        wall = time.perf_counter() - t0
    errors = [r["error"] for r in results if r["error"]]
    tokens = sum(r["completion_tokens"] for r in results)
    # Decode alone: each request's tokens after its first over the time they
    # took, summed over the concurrent requests (prefill is left out: on a CPU
    # it is most of a wave's wall time, and speculation does not touch it).
    decode = sum(r["decode_tok_s"] or 0.0 for r in results)
    ttft = statistics.median(r["ttft_s"] or 0.0 for r in results)
    return {"tok_s": tokens / wall, "decode_tok_s": decode, "ttft_s": ttft, "tokens": tokens,
            "wall_s": wall, "errors": errors, "texts": [r.get("text") for r in results]}


def run_config(config: str, args) -> dict:
    print(f"[{config}] starting", file=sys.stderr, flush=True)
    procs, port = start(config, args)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    model = request_model_name(config.startswith("up"), args.model)
    out = {}
    try:
        asyncio.run(wave(url, model, ["warm up"], 8))
        for workload in args.workloads:
            for n in args.clients:
                waves = [asyncio.run(wave(url, model,
                                          prompts_for(workload, n, f"r{r}"),
                                          args.max_tokens))
                         for r in range(args.repeats)]
                cell = {key: statistics.median(w[key] for w in waves)
                        for key in ("tok_s", "decode_tok_s", "ttft_s")}
                cell.update(errors=sum(len(w["errors"]) for w in waves),
                            texts=waves[0]["texts"])
                out[f"{workload}/{n}"] = cell
                print(f"[{config}] {workload} x{n}: {cell['tok_s']:.1f} tok/s, decode "
                      f"{cell['decode_tok_s']:.1f} tok/s, TTFT {cell['ttft_s']:.1f} s"
                      + (f", {cell['errors']} errors" if cell["errors"] else ""),
                      file=sys.stderr, flush=True)
        if config.startswith("ours-2"):
            out["plan"] = rank_plan(port)
    finally:
        out["exit"] = stop(procs)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    rank_arguments(p, CONFIGS, max_tokens=128)
    p.add_argument("--clients", nargs="+", type=int, default=[1, 8])
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args(argv)
    OUT_DIR.mkdir(exist_ok=True)
    results = {c: run_config(c, args) for c in args.configs}
    (OUT_DIR / "bench_tp.json").write_text(json.dumps(results, indent=1))

    cells = [f"{w}/{n}" for w in args.workloads for n in args.clients]
    pairs = [("ours-2-none", "up-2"), ("ours-2-ngram", "up-2"), ("ours-2-none", "one-none"),
             ("ours-2-ngram", "ours-2-none")]
    for key, what in (("tok_s", "end-to-end tokens/s"), ("decode_tok_s", "decode tokens/s"),
                      ("ttft_s", "time to first token, s")):
        print(f"\n{what} (median of {args.repeats}), {args.model}, max_tokens {args.max_tokens}")
        print("| config | " + " | ".join(cells) + " |")
        print("|---|" + "---|" * len(cells))
        for c, r in results.items():
            print(f"| {c} | " + " | ".join(f"{r[x][key]:.1f}" for x in cells) + " |")
        for a, b in pairs if key != "ttft_s" else ():
            if a in results and b in results:
                print(f"| {a} / {b} | " + " | ".join(
                    f"{results[a][x][key] / max(results[b][x][key], 1e-9):.2f}x"
                    for x in cells) + " |")
    for c, r in results.items():
        if "plan" in r:
            pl = r["plan"]
            print(f"{c}: {pl['bytes_per_plan']} bytes per plan over {pl['plans']} plans; the "
                  f"fastest share {pl['fastest_share_ms']} ms, the mean {pl['ms_per_plan']} ms "
                  f"(with the wait for the slower rank's pass); exit {r['exit']}")
        else:
            print(f"{c}: exit {r['exit']}")
    if "ours-2-none" in results and "ours-2-ngram" in results:
        same = sum(a == b for x in cells for a, b in zip(results["ours-2-none"][x]["texts"],
                                                         results["ours-2-ngram"][x]["texts"]))
        total = sum(len(results["ours-2-none"][x]["texts"]) for x in cells)
        print(f"ours-2-ngram outputs identical to ours-2-none: {same} of {total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
