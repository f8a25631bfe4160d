#!/usr/bin/env python
"""Two models in one server against two one-model servers, side by side.

A user who serves a coding model and a chat model can run one server with
both (``--model A --model B``: one inference thread steps each in turn) or
two servers (two processes contending for the device). Each phase keeps C
streaming clients per model busy for T seconds (every client sends its next
request as soon as the last ends) and reports, per model, tokens per second
and the median inter-token latency (ITL):

- ``alone``: the set server, one model's clients only (the bar's reference);
- ``together``: the set server, both models' clients at once;
- ``two servers``: one server per model, both loads at once.

    .venv/bin/python scripts/bench/bench_models.py --models models/smollm2-135m-instruct \\
        models/qwen2.5-coder-0.5b-instruct --clients 4 --seconds 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from servers import OUT_DIR, PROMPTS, launch, ours_command, progress, stop, wait_ready


async def client_loop(base: str, model: str, until: float, max_tokens: int, tag: str,
                      out: list) -> None:
    """Requests back to back until ``until``: each (tokens, seconds, gaps)."""
    url = f"{base}/v1/chat/completions"
    n = 0
    async with httpx.AsyncClient(timeout=300) as client:
        while time.monotonic() < until:
            body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True},
                    "messages": [{"role": "user",
                                  "content": f"[{tag}-{n}] {PROMPTS[n % len(PROMPTS)]}"}]}
            n += 1
            arrivals, tokens, start = [], 0, time.monotonic()
            async with client.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"{model}: HTTP {r.status_code}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    data = json.loads(line[6:])
                    if data.get("usage"):
                        tokens = data["usage"]["completion_tokens"]
                    elif data.get("choices") and data["choices"][0]["delta"].get("content"):
                        arrivals.append(time.monotonic())
            out.append((tokens, time.monotonic() - start,
                        [b - a for a, b in zip(arrivals, arrivals[1:])]))


def summary(results: list, seconds: float) -> dict:
    gaps = [g for _, _, gs in results for g in gs]
    return {"requests": len(results),
            "tokens_per_s": round(sum(t for t, _, _ in results) / seconds, 2),
            "median_itl_ms": round(1e3 * statistics.median(gaps), 1) if gaps else None}


async def phase(targets: list[tuple], clients: int, seconds: float, max_tokens: int,
                tag: str) -> dict:
    """``targets``: (base url, model name) per model; C clients each."""
    until = time.monotonic() + seconds
    outs = {model: [] for _, model in targets}
    await asyncio.gather(*[client_loop(base, model, until, max_tokens, f"{tag}-{i}",
                                       outs[model])
                           for base, model in targets for i in range(clients)])
    elapsed = seconds + max(0.0, time.monotonic() - until)
    return {model: summary(results, elapsed) for model, results in outs.items()}


def serve(models: list[str], port: int, width: int) -> list[subprocess.Popen]:
    """A server for ``models`` (one, or a set) on ``port``, ready."""
    procs = launch(ours_command(models, port, "--max-batch-size", str(width), "--log-level",
                                "warning", "--max-loaded-models", str(len(models))),
                   f"bench_models_{port}")
    wait_ready(procs, f"http://127.0.0.1:{port}", 300)
    return procs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs=2, required=True, help="two model folders")
    p.add_argument("--clients", type=int, default=4, help="streaming clients per model")
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--port", type=int, default=8765)
    args = p.parse_args(argv)
    names = [Path(m.rstrip("/")).name for m in args.models]
    OUT_DIR.mkdir(exist_ok=True)
    width = 2 * args.clients
    out = {}
    procs = serve(args.models, args.port, width)
    base = f"http://127.0.0.1:{args.port}"
    try:
        for name in names:  # loads the second model too, before timing anything
            httpx.post(f"{base}/v1/completions", timeout=300, json={
                "model": name, "prompt": "warm up", "max_tokens": 4})
        for name in names:
            progress(f"alone: {name}")
            out[f"alone {name}"] = asyncio.run(phase([(base, name)], args.clients,
                                                     args.seconds, args.max_tokens, "a"))[name]
        progress("together, one server")
        out["together"] = asyncio.run(phase([(base, n) for n in names], args.clients,
                                            args.seconds, args.max_tokens, "t"))
    finally:
        progress(f"set server stopped (exit status {stop(procs, grace=15)[0]})")
    procs = [serve([m], args.port + 1 + i, args.clients)[0] for i, m in enumerate(args.models)]
    try:
        progress("two servers")
        out["two servers"] = asyncio.run(phase(
            [(f"http://127.0.0.1:{args.port + 1 + i}", n) for i, n in enumerate(names)],
            args.clients, args.seconds, args.max_tokens, "s"))
    finally:
        statuses = [stop([proc], grace=15)[0] for proc in procs]
        progress(f"one-model servers stopped (exit statuses {statuses})")
    print(json.dumps(out, indent=2))
    print("\n| model | alone tok/s | ITL ms | together tok/s | ITL ms (x alone) | "
          "two servers tok/s | ITL ms |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        a, t, s = out[f"alone {name}"], out["together"][name], out["two servers"][name]
        ratio = t["median_itl_ms"] / a["median_itl_ms"] if a["median_itl_ms"] else float("nan")
        print(f"| {name} | {a['tokens_per_s']} | {a['median_itl_ms']} | {t['tokens_per_s']} | "
              f"{t['median_itl_ms']} ({ratio:.2f}x) | {s['tokens_per_s']} | "
              f"{s['median_itl_ms']} |")
    (OUT_DIR / "bench_models.json").write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
