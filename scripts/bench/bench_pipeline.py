"""Pipeline parallel, side by side in one run: one process against two
pipeline ranks, and ours against upstream's ``mlx_lm.server --pipeline``.

Configurations (each started, measured and stopped before the next):

- ``one``: our server in one process;
- ``pp-2``: our server as two pipeline ranks (``--pipeline``), n-gram on;
  each workload is sent with ``spec_decode: false`` and then ``true``;
- ``up-one`` / ``up-pp-2``: upstream ``mlx_lm.server`` in one process / as
  two pipeline ranks. Upstream's pipeline loader needs a
  ``model.safetensors.index.json``: a folder of links to the model with one
  written beside them stands in for the model folder.

Two-rank servers are started as ``mlx.launch`` starts them, but directly
(``MLX_RANK``, ``MLX_HOSTFILE``), as in ``bench_tp.py``. One client at a
time, temperature 0; reported per cell: decode tokens/s (prefill left out),
time to first token, and the greedy text's agreement with ``one``.

    .venv/bin/python scripts/bench/bench_pipeline.py --model models/qwen2.5-coder-0.5b-instruct

Results go to ``bench_out/bench_pipeline.json``; logs beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

from servers import (OUT_DIR, launch, make_body, one_request, ours_command, prompts_for,
                     rank_arguments, rank_plan, request_model_name, stop, upstream_command,
                     upstream_env, wait_ready)

from mlx_lm_server.runtime.ports import free_ports

CONFIGS = ("one", "pp-2", "up-one", "up-pp-2")


def indexed_copy(model: Path) -> Path:
    """``model`` as links plus a ``model.safetensors.index.json``: what
    upstream's pipeline loader reads to pick each rank's files."""
    from safetensors import safe_open

    folder = OUT_DIR / f"{model.name}-indexed"
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for f in sorted(model.iterdir()):
        link = folder / f.name
        if not link.exists():
            link.symlink_to(f.resolve())
        if f.suffix == ".safetensors":
            with safe_open(str(f), "numpy") as st:
                weight_map.update({k: f.name for k in st.keys()})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def start(config: str, model: str):
    port, *ring = free_ports(3)
    pipeline = ["--pipeline"] if config.endswith("-2") else []
    if config.startswith("up"):
        cmd = upstream_command(model, port, "--log-level", "WARNING", *pipeline)
    else:
        cmd = ours_command(model, port, "--spec-decode", "ngram", "--log-level", "info",
                           *pipeline)
    procs = launch(cmd, f"bench_pipeline_{config}",
                   upstream_env() if config.startswith("up") else None,
                   ring if config.endswith("-2") else [])
    wait_ready(procs, f"http://127.0.0.1:{port}", 600)
    return procs, port


def request(url: str, model: str, prompt: str, max_tokens: int, spec) -> dict:
    body = make_body(model, prompt, max_tokens)
    if spec is not None:
        body["spec_decode"] = spec

    async def go():
        async with httpx.AsyncClient(timeout=1200) as client:
            return await one_request(client, url, body)

    return asyncio.run(go())


def run_config(config: str, args) -> dict:
    print(f"[{config}] starting", file=sys.stderr, flush=True)
    model = args.indexed if config.startswith("up") else args.model
    tic = time.perf_counter()
    procs, port = start(config, model)
    started = time.perf_counter() - tic
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    name = request_model_name(config.startswith("up"), model)
    specs = (False, True) if not config.startswith("up") else (None,)
    out = {"start_s": started}
    try:
        request(url, name, "warm up", 8, None)
        for workload in args.workloads:
            prompt = prompts_for(workload, 1, "p")[0]
            for spec in specs:
                r = request(url, name, prompt, args.max_tokens, spec)
                cell = f"{workload}" + {None: "", False: "/plain", True: "/ngram"}[spec]
                out[cell] = r
                print(f"[{config}] {cell}: decode {r['decode_tok_s'] or 0:.2f} tok/s, TTFT "
                      f"{r['ttft_s'] or 0:.1f} s, {r['completion_tokens']} tokens"
                      + (f", error {r['error']}" if r["error"] else ""),
                      file=sys.stderr, flush=True)
        if not config.startswith("up") and config.endswith("-2"):
            out["plan"] = rank_plan(port)
    finally:
        out["exit"] = stop(procs)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    rank_arguments(p, CONFIGS, max_tokens=64)
    args = p.parse_args(argv)
    OUT_DIR.mkdir(exist_ok=True)
    args.model = str(Path(args.model).resolve())
    args.indexed = str(indexed_copy(Path(args.model)))
    results = {c: run_config(c, args) for c in args.configs}
    (OUT_DIR / "bench_pipeline.json").write_text(json.dumps(results, indent=1))

    ref = results.get("one", {})
    cells = sorted({k for r in results.values() for k in r
                    if isinstance(r[k], dict) and "decode_tok_s" in r[k]})
    print(f"\n{args.model}, one client, max_tokens {args.max_tokens}, temperature 0")
    print("| config | cell | decode tok/s | vs one (same cell) | TTFT s | text = one's |")
    print("|---|---|---|---|---|---|")
    for c, r in results.items():
        for cell in cells:
            if cell not in r:
                continue
            x = r[cell]
            base = ref.get(cell) or ref.get(cell.split("/")[0] + "/plain")
            ratio = (f"{x['decode_tok_s'] / base['decode_tok_s']:.2f}x"
                     if base and base.get("decode_tok_s") and x["decode_tok_s"] else "-")
            same = "yes" if base and x["text"] == base["text"] else "no"
            print(f"| {c} | {cell} | {x['decode_tok_s'] or 0:.2f} | {ratio} | "
                  f"{x['ttft_s'] or 0:.1f} | {same} |")
    for c, r in results.items():
        print(f"{c}: started in {r['start_s']:.0f} s; exit {r['exit']}"
              + (f"; {r['plan']['bytes_per_plan']} bytes and {r['plan']['ms_per_plan']} ms "
                 f"per plan over {r['plan']['plans']} plans" if "plan" in r else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
