"""Requests that share a long prefix: the prompt cache on against off, and
against upstream ``mlx_lm.server`` (whose prompt cache is on by default).

Two workloads, each request streamed, temperature 0, one at a time:

- chat: five turns of one conversation; each turn adds a user message (a
  block of code to review) and the previous reply, so turn 5 resends the
  whole history;
- agent: five calls with the same long system prompt (a tool catalogue, as
  agents send with every call) and a different short question each.

Reported per server configuration: time to first token (TTFT) per turn, the
whole run's time, and the ratios of cache on against cache off. Servers run
one after the other on one port (started and stopped as in
``bench_server.py``); every run's text starts with a tag unique to the run,
so no server can reuse a previous run's prompts.

    .venv/bin/python scripts/bench/bench_prompt_cache.py --model models/smollm2-135m-instruct
    .venv/bin/python scripts/bench/bench_prompt_cache.py --model models/qwen2.5-coder-0.5b-instruct \\
        --configs ours-cache ours-nocache

Results also go to ``bench_out/bench_prompt_cache.json``.

``--restart`` measures the disk tier instead: an agent client's captured
first request (``tests/fixtures``, replayed as ``bench_agent_turns.py`` does)
answered by a server with ``--prompt-cache-dir``, the server stopped once the
entry is written and started again on the same folder, and the same request
sent again: time to first token of each, and whether the text is the same.

    .venv/bin/python scripts/bench/bench_prompt_cache.py --restart \
        --model models/qwen2.5-coder-0.5b-instruct --clients claude codex

Results go to ``bench_out/bench_prompt_cache_restart.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from servers import (OUT_DIR, launch, one_request, ours_command, port_in_use, progress,
                     request_model_name, stop, upstream_command, upstream_env, wait_ready)

# name -> (server, extra flags)
CONFIGS = {
    "ours-cache": ("ours", ["--spec-decode", "ngram"]),
    "ours-nocache": ("ours", ["--spec-decode", "ngram", "--prompt-cache-size", "0"]),
    "ours-cache-nospec": ("ours", ["--spec-decode", "none"]),
    "ours-nocache-nospec": ("ours", ["--spec-decode", "none", "--prompt-cache-size", "0"]),
    "upstream": ("upstream", []),
}

CODE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals; returns a sorted list."""
    intervals = sorted(intervals, key=lambda iv: iv[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
'''

TOOL = '''{"type": "function", "function": {"name": "%s", "description": "%s: reads the
project's files and returns what it finds, with line numbers, as JSON.", "parameters":
{"type": "object", "properties": {"path": {"type": "string", "description": "file or
folder, relative to the repository root"}, "pattern": {"type": "string", "description":
"a regular expression"}, "max_results": {"type": "integer", "minimum": 1}},
"required": ["path"]}}}'''

TOOLS = ["search_code", "read_file", "list_folder", "find_symbol", "run_tests", "git_log",
         "git_diff", "open_issue", "lint_file", "format_file", "count_lines", "find_todo"]


def chat_turns(tag: str, turns: int):
    """Message lists of one growing conversation (replies filled in as they come)."""
    for t in range(turns):
        yield {"role": "user", "content": f"[{tag}] Review change {t + 1}:\n{CODE}\n"
                                          f"What would you rename in change {t + 1}?"}


def agent_system(tag: str) -> str:
    catalogue = "\n".join(TOOL % (name, name.replace("_", " ")) for name in TOOLS)
    return (f"[{tag}] You are a coding agent. Call one tool per answer, as JSON.\n"
            f"Tools:\n{catalogue}\n")


def body(model: str, messages: list, max_tokens: int) -> dict:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}


async def run_chat(url: str, model: str, tag: str, turns: int, max_tokens: int) -> list[dict]:
    out, messages = [], []
    async with httpx.AsyncClient(timeout=600) as client:
        for user in chat_turns(tag, turns):
            messages.append(user)
            r = await one_request(client, url, body(model, list(messages), max_tokens))
            out.append(r)
            # The reply goes back into the history as the client saw it.
            messages.append({"role": "assistant", "content": r["text"]})
    return out


async def run_agent(url: str, model: str, tag: str, calls: int, max_tokens: int) -> list[dict]:
    out = []
    system = agent_system(tag)
    async with httpx.AsyncClient(timeout=600) as client:
        for c in range(calls):
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": f"Task {c + 1}: where is {TOOLS[c]} used?"}]
            out.append(await one_request(client, url, body(model, messages, max_tokens)))
    return out


def start(config: str, args) -> list[subprocess.Popen]:
    server, flags = CONFIGS[config]
    if port_in_use(args.port):
        raise SystemExit(f"error: port {args.port} is already in use; pass --port")
    if server == "ours":
        cmd = ours_command(args.model, args.port, "--log-level", "warning", *flags)
        return launch(cmd, f"bench_prompt_cache_{config}")
    cmd = upstream_command(args.model, args.port, "--log-level", "WARNING", *flags)
    return launch(cmd, f"bench_prompt_cache_{config}", upstream_env())


def bench(config: str, args) -> dict:
    procs = start(config, args)
    base = f"http://127.0.0.1:{args.port}"
    model = request_model_name(CONFIGS[config][0] == "upstream", args.model)
    url = base + "/v1/chat/completions"
    try:
        wait_ready(procs, base, 600)
        asyncio.run(run_agent(url, model, f"warm-{config}", 1, 4))
        result = {}
        for name, fn in (("chat", run_chat), ("agent", run_agent)):
            tag = f"{name}-{config}-{time.time_ns()}"
            tic = time.perf_counter()
            reqs = asyncio.run(fn(url, model, tag, args.turns, args.max_tokens))
            bad = [r["error"] for r in reqs if r["error"]]
            if bad:
                raise RuntimeError(f"{config} {name}: {bad[0]}")
            result[name] = {"ttft_s": [r["ttft_s"] for r in reqs],
                            "prompt_tokens": [r["prompt_tokens"] for r in reqs],
                            "total_s": time.perf_counter() - tic}
            progress(f"[{config}] {name}: TTFT " +
                     " ".join(f"{t:.2f}" for t in result[name]["ttft_s"]) +
                     f" s; total {result[name]['total_s']:.1f} s")
        return result
    finally:
        progress(f"[{config}] stopped (exit status {stop(procs, grace=15)[0]})")


def _entry_written(folder: Path, timeout: float = 600) -> None:
    """Until the disk tier's file is there whole (no partial write left)."""
    deadline = time.monotonic() + timeout
    while not list(folder.glob("pc-*.safetensors")) or list(folder.glob(".pc-tmp-*")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no prompt cache entry written in {folder}")
        time.sleep(0.5)


def restart(args) -> dict:
    """Each client's first request, before and after a restart on one
    --prompt-cache-dir."""
    from bench_agent_turns import FIXTURES, REQUESTS, turn

    base = f"http://127.0.0.1:{args.port}"
    model = request_model_name(False, args.model)
    results = {}
    for kind in args.clients:
        folder = Path(tempfile.mkdtemp(prefix=f"bench-prompt-cache-{kind}-"))
        fixture = json.loads((FIXTURES / REQUESTS[kind][0]).read_text())
        cap = "max_tokens" if kind == "claude" else "max_output_tokens"
        body = {**fixture, "model": model, "stream": True, cap: args.max_tokens,
                "temperature": 0}
        runs = []
        for run in ("first", "restarted"):
            if port_in_use(args.port):
                raise SystemExit(f"error: port {args.port} is already in use; pass --port")
            procs = launch(ours_command(args.model, args.port, "--log-level", "info",
                                        "--prompt-cache-dir", str(folder)),
                           f"bench_prompt_cache_restart_{kind}_{run}")
            try:
                wait_ready(procs, base, 600)
                with httpx.Client(timeout=3600) as client:
                    runs.append(turn(client, base, kind, body))
                if run == "first":
                    _entry_written(folder)
            finally:
                progress(f"[{kind} {run}] stopped (exit status {stop(procs, grace=60)[0]})")
            progress(f"[{kind} {run}] TTFT {runs[-1]['ttft_s']:.2f} s, prompt "
                     f"{runs[-1].get('prompt')} tokens, {runs[-1].get('cached')} cached")
        first, again = runs
        results[kind] = {"first": first, "restarted": again,
                         "ttft_ratio": again["ttft_s"] / first["ttft_s"],
                         "same_text": again["text"] == first["text"],
                         "entry_bytes": sum(p.stat().st_size
                                            for p in folder.glob("pc-*.safetensors"))}
        progress(f"[{kind}] {results[kind]['ttft_ratio']:.3f}x the first TTFT, same text: "
                 f"{results[kind]['same_text']}")
        OUT_DIR.mkdir(exist_ok=True)  # each client's figures as soon as they are in
        (OUT_DIR / "bench_prompt_cache_restart.json").write_text(json.dumps(results, indent=1))
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS),
                   default=["ours-cache", "ours-nocache", "upstream"])
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--port", type=int, default=8093)
    p.add_argument("--restart", action="store_true",
                   help="the disk tier: agent clients' first requests before and after a "
                        "restart on one --prompt-cache-dir")
    p.add_argument("--clients", nargs="+", choices=["claude", "codex"],
                   default=["claude", "codex"], help="--restart: whose captured request")
    args = p.parse_args(argv)
    if args.restart:
        results = restart(args)
        print(f"\nmodel {args.model}, max_tokens {args.max_tokens}")
        for kind, r in results.items():
            print(f"  {kind:<7} prompt {r['first'].get('prompt')} tokens: TTFT "
                  f"{r['first']['ttft_s']:.2f} s, after a restart {r['restarted']['ttft_s']:.2f} s "
                  f"({r['ttft_ratio']:.3f}x, {r['restarted'].get('cached')} cached), same text: "
                  f"{r['same_text']}, entry {r['entry_bytes'] / 2**20:.0f} MiB")
        return 0
    results = {c: bench(c, args) for c in args.configs}
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / "bench_prompt_cache.json").write_text(json.dumps(results, indent=1))
    print(f"\nmodel {args.model}, {args.turns} turns, max_tokens {args.max_tokens}")
    for workload in ("chat", "agent"):
        print(f"\n{workload}: TTFT per turn (s), prompt tokens of the last turn, total (s)")
        for c, r in results.items():
            w = r[workload]
            print(f"  {c:<20} " + " ".join(f"{t:6.2f}" for t in w["ttft_s"]) +
                  f"   {w['prompt_tokens'][-1]:>5}   {w['total_s']:6.1f}")
        for on, off in (("ours-cache", "ours-nocache"), ("ours-cache-nospec", "ours-nocache-nospec"),
                        ("ours-cache", "upstream")):
            if on in results and off in results:
                a, b = results[on][workload], results[off][workload]
                print(f"  {on} / {off}: last-turn TTFT {a['ttft_s'][-1] / b['ttft_s'][-1]:.2f}, "
                      f"total {a['total_s'] / b['total_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
