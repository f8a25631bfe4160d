"""The never-slower contract as a benchmark: the server's default against
the same server with ``--spec-decode none`` and upstream ``mlx_lm.server``,
workload by workload and client count by client count.

Servers (``--servers``, any of):

- ``default``: ``mlx-lm-server`` with no ``--spec-decode`` flag, so it measures
  whatever the default is (plus ``--default-args``, e.g. "--spec-decode auto");
- ``none``: the same server with ``--spec-decode none``;
- ``upstream``: ``python -m mlx_lm.server`` (skipped with a message when
  mlx_lm is not installed), with OpenBLAS preloaded as ours preloads it.

All run with their own defaults otherwise (both batch 32 rows in decode, 8
prompts in prefill), at temperature 0, on one port, one after the other.

Workloads (``--workloads``; each request a streamed chat completion):

- ``chat``: open questions (``workloads.CHAT``);
- ``code-edit``: a real file of this repository (``workloads.code_edit_prompts``)
  in the prompt, an identifier to rename, the whole file asked back;
- ``prediction``: the same edit with the file also sent as an OpenAI Predicted
  Output (``"prediction": {"type": "content", "content": FILE}``); upstream
  ignores the field; a server that rejects it is skipped there;
- ``agent``: a coding agent's next step: a system prompt, ``tools``
  (read_file, edit_file, run_tests), the task, the assistant's read_file
  call and the file as its tool result; the answer is the edit. For a model
  whose chat template has no tool calling (our server refuses ``tools``
  then) the same turns are sent as text, to every server, and the run says so;
- ``json-schema``: a standard-library function's documentation to a JSON
  record under ``response_format`` json_schema; upstream has no
  ``response_format``, so it is not run there (n/a in the tables);
- ``summarize``: a section of this repository's README (~1.5k tokens) to
  three sentences;
- ``repeated``: one instruction over different CSV records, "convert this
  record to JSON": outputs resemble one another, what a suffix index serves.

Every client count N (``--clients``) is one cell: N clients, each sending
``--per-client`` requests back to back. A cell's figures: aggregate tok/s (all
completion tokens, ``usage.completion_tokens`` from the include_usage chunk,
over the wall time from the first request sent to the last stream finished,
prefill included), p50 and p95 request latency, p50 time to first token
(content, reasoning or tool-call delta).

Rounds (``--rounds``, at least 3 for a result): each round starts every
server fresh, one after another, the order rotated by one each round (the
machine drifts; no cache survives from one round into the next); each
server first gets one untimed warm-up request of every workload, then runs
every workload x clients cell. Before the first round, its first server
runs once untimed (``--no-discard-first`` skips it): in two five-round runs
the first round was the default server's worst, and the only one where it
was the first process after the harness started. Every request starts with a tag unique to
its round, cell and index (the same tags for every server), so no prompt
cache serves it from an earlier request; the ``repeated`` task shares one
tag within a cell, as the same instruction arriving again. A cell's figure
is the median over rounds with its min-max; a ratio is of the medians, its
spread the min-max of the per-round ratios (the servers of one round ran
next to each other). Cells where ``default`` is below 0.97x ``none`` in tok/s
or above 1.05x in p95 latency are flagged (the issue's bars); default and
none should also answer with the same text at temperature 0 (counted).

    .venv/bin/python scripts/bench/bench_matrix.py --model models/qwen2.5-coder-0.5b-instruct
    .venv/bin/python scripts/bench/bench_matrix.py --workloads chat code-edit --clients 1 \\
        --rounds 1 --max-tokens 16 --servers default none

``--first-waves N`` measures start-up's cost first: default and none each
started fresh and, with no warm-up, N waves of one workload (code edit at 8
clients unless told) back to back; each one's first wave's tok/s against its
last, and default's ratio over none's (on a GPU, verification shapes compile
on first use; on a CPU, prefill warms up on either server).

Writes ``bench_out/bench_matrix.json`` (``--out``), prints the Markdown tables
(also to ``--markdown FILE``) and, with matplotlib, the default/none chart
(``--chart FILE``, default ``bench_out/bench_matrix.png``); server logs in
``bench_out/bench_matrix_<server>.log``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx

from servers import (OUT_DIR, launch, one_request, ours_command, port_in_use, progress,
                     request_model_name, stop, upstream_command, upstream_env, wait_ready)
from workloads import (AGENT_FUNCTIONS, CHAT, agent_function, code_edit_prompts,
                       code_edit_sources, csv_table, repeated_prompts, repo_file)

WORKLOADS = ["chat", "code-edit", "prediction", "agent", "json-schema", "summarize", "repeated"]
SERVERS = ["default", "none", "upstream"]
METRICS = ("agg_tok_s", "p50_s", "p95_s", "ttft_p50_s")
ARRIVAL_GAP_S = 0.025  # between clients' first requests (``run_cell``)
# Output a client sees: text, a thinking model's reasoning, a tool call.
FIELDS = ("content", "reasoning", "tool_calls")
# The bars: default's tok/s at least this much of none's, its p95 at most this.
MIN_TOK_S_RATIO, MAX_P95_RATIO = 0.97, 1.05


# ---------------------------------------------------------------- workloads

def chat_items() -> list[list[dict]]:
    return [[{"role": "user", "content": q}] for q in CHAT]


def code_edit_items(predicted: bool) -> list[tuple[list[dict], dict]]:
    """Messages and extra fields: with ``predicted`` the file, in the code
    block the answer is asked in, as the prediction."""
    out = []
    for prompt, src in zip(code_edit_prompts(), code_edit_sources()):
        extra = ({"prediction": {"type": "content", "content": f"```python\n{src}```"}}
                 if predicted else {})
        out.append(([{"role": "user", "content": prompt}], extra))
    return out


AGENT_TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file, or one function or class of it.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "path from the repository root"},
            "symbol": {"type": "string", "description": "a function or class name"}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "edit_file",
        "description": "Replace the exact text `old` in a file with `new`.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}},
            "required": ["path", "old", "new"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the tests of a path; returns their output.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]}}},
]
AGENT_SYSTEM = ("You are a coding agent working in a Python checkout. Use the tools to read "
                "and change files. Change only what the task asks; to change a file, call "
                "edit_file with the exact old text and its replacement.")


def agent_items(as_text: bool) -> list[tuple[list[dict], dict]]:
    """The agent's next step after reading the function to edit: ``tools`` and
    tool messages, or (``as_text``) the same turns as plain text."""
    out = []
    for name in AGENT_FUNCTIONS:
        path, attr, source = agent_function(name)
        task = f"Add type hints to `{name}` in {path}, keeping its behaviour."
        args = {"path": path, "symbol": attr}
        if as_text:
            tools = json.dumps([t["function"] for t in AGENT_TOOLS])
            out.append(([
                {"role": "system", "content": f"{AGENT_SYSTEM}\nTools: {tools}\nCall a tool "
                 "as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>."},
                {"role": "user", "content": task},
                {"role": "assistant", "content": "<tool_call>" + json.dumps(
                    {"name": "read_file", "arguments": args}) + "</tool_call>"},
                {"role": "user", "content": f"<tool_result>\n{source}</tool_result>"},
            ], {}))
            continue
        out.append(([
            {"role": "system", "content": AGENT_SYSTEM},
            {"role": "user", "content": task},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_0", "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": "call_0", "content": source},
        ], {"tools": AGENT_TOOLS}))
    return out


FUNCTION_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "summary": {"type": "string"},
        "parameters": {"type": "array", "items": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "description": {"type": "string"}},
            "required": ["name", "description"], "additionalProperties": False}},
        "returns": {"type": "string"},
        "raises": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "summary", "parameters", "returns", "raises"],
    "additionalProperties": False,
}


def json_schema_items() -> list[tuple[list[dict], dict]]:
    fmt = {"type": "json_schema", "json_schema": {
        "name": "function_doc", "schema": FUNCTION_SCHEMA, "strict": True}}
    return [([{"role": "user", "content": p}], {"response_format": fmt})
            for p in repeated_prompts()[:24]]


def summarize_items(chars: int = 4500) -> list[list[dict]]:
    """Sections of this repository's README (as of PROMPT_COMMIT), cut at
    paragraph breaks after ``chars`` characters, at a line break before
    1.4x that (about 1.5k to 2k tokens each)."""
    sections, cur = [], ""
    for para in repo_file("README.md").split("\n\n"):
        cur += para + "\n\n"
        if len(cur) >= chars:
            sections.append(cur[:cur.rfind("\n", 0, int(chars * 1.4)) + 1])
            cur = ""
    return [[{"role": "user", "content": "Summarize the document below in three sentences "
              f"for someone deciding whether to use it.\n\nDocument:\n\n{s}"}]
            for s in sections]


def repeated_items() -> list[list[dict]]:
    """One instruction, first, then a record: requests share their prefix
    and their answers resemble one another."""
    header, *rows = csv_table(40).splitlines()
    keys = header.split(",")
    out = []
    for row in rows:
        record = " | ".join(f"{k}={v}" for k, v in zip(keys, row.split(",")))
        out.append([{"role": "user", "content": (
            "Convert the record below to one JSON object with the keys id (a number), "
            "name, city, department, salary (a number) and start_date (YYYY-MM-DD), in "
            f"this order. Output only the JSON object.\n\nRecord: {record}")}])
    return out


class Workloads:
    """Each workload's requests as (messages, extra body fields), built once;
    ``agent_as_text`` is decided per model by the first of our servers."""

    def __init__(self, names: list[str]):
        build = {"chat": lambda: [(m, {}) for m in chat_items()],
                 "code-edit": lambda: code_edit_items(False),
                 "prediction": lambda: code_edit_items(True),
                 "agent": lambda: agent_items(False),
                 "json-schema": json_schema_items,
                 "summarize": lambda: [(m, {}) for m in summarize_items()],
                 "repeated": lambda: [(m, {}) for m in repeated_items()]}
        self.items = {name: build[name]() for name in names}
        self.agent_as_text = None  # None: not decided yet

    def use_agent_text(self) -> None:
        self.agent_as_text = True
        self.items["agent"] = agent_items(True)

    def bodies(self, workload: str, model: str, tag: str, clients: int, per_client: int,
               max_tokens: int) -> list[list[dict]]:
        """Per client, its requests: item k of the workload for the k-th
        request, tagged ``[TAG-k]`` (``repeated``: ``[TAG]`` for all)."""
        items = self.items[workload]
        out = []
        for c in range(clients):
            row = []
            for j in range(per_client):
                k = c * per_client + j
                messages, extra = items[k % len(items)]
                mark = f"[{tag}] " if workload == "repeated" else f"[{tag}-{k}] "
                messages = [dict(m) for m in messages]
                messages[0]["content"] = mark + messages[0]["content"]
                row.append({"model": model, "messages": messages, "max_tokens": max_tokens,
                            "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}, **extra})
            out.append(row)
        return out


# ---------------------------------------------------------------- timing

def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    values = sorted(values)
    pos = (len(values) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


async def run_cell(base: str, bodies: list[list[dict]], timeout: float) -> dict:
    """Each client's requests back to back, the clients concurrently, the
    first requests ``ARRIVAL_GAP_S`` apart in client order. Arriving at once,
    they reached the server in a random order; where prompts are prefilled
    one after another that order alone moved a cell's median time to first
    token by up to 20% (four code-edit prompts of 1.2k-1.8k tokens), so each server
    now sees the same order."""
    url = f"{base}/v1/chat/completions"
    n = len(bodies)
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async def one_client(i, row):
            await asyncio.sleep(i * ARRIVAL_GAP_S)
            return [await one_request(client, url, b, FIELDS) for b in row]
        t0 = time.perf_counter()
        per_client = await asyncio.gather(*(one_client(i, row) for i, row in enumerate(bodies)))
        wall = time.perf_counter() - t0
    results = [r for row in per_client for r in row]
    ok = [r for r in results if r["error"] is None]
    tokens = sum(r["completion_tokens"] for r in results)
    latencies = [r["end"] - r["start"] for r in ok]
    ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    return {
        "wall_s": wall, "completion_tokens": tokens,
        "agg_tok_s": tokens / wall if wall > 0 and ok else None,
        "p50_s": percentile(latencies, 0.5), "p95_s": percentile(latencies, 0.95),
        "ttft_p50_s": percentile(ttfts, 0.5),
        # Each request's own, in the order of ``texts``: where prompts are
        # prefilled one after another, the median alone hides which waited.
        "ttfts_s": [r["ttft_s"] for r in results],
        "errors": [r["error"] for r in results if r["error"]],
        "load_avg": os.getloadavg()[0],
        "texts": [r["text"] for r in results],
        "prompt_tokens": [r["prompt_tokens"] for r in results],
    }


# ---------------------------------------------------------------- servers

def start(name: str, model: str, args):
    if port_in_use(args.port):
        raise SystemExit(f"error: port {args.port} is already in use; pass --port")
    log = f"bench_matrix_{name}"
    if name == "upstream":
        return launch(upstream_command(model, args.port, "--log-level", "WARNING"), log,
                      upstream_env())
    flags = shlex.split(args.default_args) if name == "default" else ["--spec-decode", "none"]
    return launch(ours_command(model, args.port, "--log-level", args.server_log_level, *flags), log)


def rejected(error: str | None) -> bool:
    return error is not None and error.startswith("HTTP 4")


def warm_up(name: str, base: str, model_name: str, wl: Workloads, args,
            skipped: dict) -> None:
    """One untimed request of every workload (at most 32 tokens: enough to
    compile the decode steps' shapes); a workload this server refuses
    (HTTP 4xx) is skipped for it, and the reason kept in ``skipped``. The
    first of our servers to refuse ``tools`` turns the agent's turns to text."""
    for workload in wl.items:
        if (name, workload) in skipped:
            continue
        if name == "upstream" and workload == "json-schema":
            skipped[name, workload] = "upstream has no response_format"
            continue
        for attempt in range(2):
            body = wl.bodies(workload, model_name, "warm", 1, 1, min(args.max_tokens, 32))
            r = asyncio.run(run_cell(base, body, args.request_timeout))
            error = r["errors"][0] if r["errors"] else None
            if (workload == "agent" and name != "upstream" and wl.agent_as_text is None
                    and rejected(error) and "tools" in error):
                progress(f"[{name}] refuses tools ({error[:120]}); the agent's turns go "
                         "as text, to every server, for this model")
                wl.use_agent_text()
                continue
            break
        if workload == "agent" and error is None and name != "upstream":
            wl.agent_as_text = bool(wl.agent_as_text)
        if rejected(error):
            skipped[name, workload] = error[:300]
            progress(f"[{name}] {workload}: refused, skipped for this server: {error[:160]}")
        elif error:
            raise RuntimeError(f"[{name}] warm-up of {workload} failed: {error}")


def run_server(name: str, model: str, rnd: int, wl: Workloads, args, skipped: dict) -> dict:
    """One server, fresh: warm-up, then every workload x clients cell; ours
    also report what their speculation did (``/v1/spec_decode/metrics``)."""
    base = f"http://127.0.0.1:{args.port}"
    model_name = request_model_name(name == "upstream", model)
    procs = start(name, model, args)
    cells = {}
    try:
        t0 = time.perf_counter()
        wait_ready(procs, base, args.ready_timeout)
        progress(f"[{name}] ready after {time.perf_counter() - t0:.1f} s; warming up")
        warm_up(name, base, model_name, wl, args, skipped)
        for workload in wl.items:
            if (name, workload) in skipped:
                continue
            for n in args.clients:
                tag = f"r{rnd}-{workload}-c{n}"
                bodies = wl.bodies(workload, model_name, tag, n, args.per_client,
                                   args.max_tokens)
                cell = asyncio.run(run_cell(base, bodies, args.request_timeout))
                if procs[0].poll() is not None:
                    raise RuntimeError(f"[{name}] server exited with status "
                                       f"{procs[0].returncode}; see bench_out/")
                progress(f"[{name}] {workload} c={n}: {cell['completion_tokens']} tokens, "
                         f"{fmt(cell['agg_tok_s'])} tok/s, p50 {fmt(cell['p50_s'], 2)} s, "
                         f"p95 {fmt(cell['p95_s'], 2)} s, TTFT {fmt(cell['ttft_p50_s'], 3)} s, "
                         f"load {cell['load_avg']:.1f}"
                         + (f", {len(cell['errors'])} ERRORS: {cell['errors'][:1]}"
                            if cell["errors"] else ""))
                if name != "upstream":  # the controller's state after the cell
                    spec = httpx.get(f"{base}/v1/spec_decode/metrics", timeout=30).json()
                    cell["spec"] = {"k": spec.get("k"), "totals": spec.get("totals")}
                cells[f"{workload}/{n}"] = cell
        spec = None
        if name != "upstream":
            spec = httpx.get(f"{base}/v1/spec_decode/metrics", timeout=30).json()
        return {"cells": cells, "spec": spec}
    finally:
        progress(f"[{name}] stopped (exit status {stop(procs, grace=15)[0]})")


def first_waves(model: str, wl: Workloads, servers: list[str], args) -> dict:
    """Start-up's cost: each server started fresh and, with no warm-up,
    ``--first-waves`` waves of one workload at one client count back to
    back; each wave's aggregate tok/s and the first's ratio to the last (the
    issue's bar: within 10% of the third). Every server gets the same waves,
    and the waves differ (fresh prompts, no cache hits) in length, so the
    figure that isolates speculation's start-up is default's first/last
    over none's: what default loses beyond the same requests on ``none``
    (on a CPU, prefill itself warms up over the first requests)."""
    workload, n = args.first_wave_workload, args.first_wave_clients
    base = f"http://127.0.0.1:{args.port}"
    out = {"workload": workload, "clients": n, "servers": {}}
    for name in servers:
        procs = start(name, model, args)
        try:
            t0 = time.perf_counter()
            wait_ready(procs, base, args.ready_timeout)
            ready = time.perf_counter() - t0
            waves, ttft = [], []
            for i in range(args.first_waves):
                bodies = wl.bodies(workload, request_model_name(False, model),
                                   f"first-{i}", n, args.per_client, args.max_tokens)
                cell = asyncio.run(run_cell(base, bodies, args.request_timeout))
                progress(f"[{name}] first waves, {workload} c={n}, wave {i + 1}: "
                         f"{fmt(cell['agg_tok_s'])} tok/s, TTFT {fmt(cell['ttft_p50_s'], 3)} s")
                waves.append(cell["agg_tok_s"])
                ttft.append(cell["ttft_p50_s"])
        finally:
            progress(f"[{name}] stopped (exit status {stop(procs, grace=15)[0]})")
        out["servers"][name] = {"ready_s": ready, "tok_s": waves, "ttft_p50_s": ttft,
                                "first_over_last": ratio(waves[0], waves[-1]) if waves else None}
    d, none = (out["servers"].get(s, {}).get("first_over_last") for s in ("default", "none"))
    if d and none:
        out["default_over_none"] = d / none
    return out


def first_waves_note(f: dict) -> str:
    parts = []
    for name, r in f["servers"].items():
        parts.append(f"{name} (ready after {r['ready_s']:.1f} s): "
                     + ", ".join(fmt(t) for t in r["tok_s"])
                     + f" tok/s, the first wave {fmt(r['first_over_last'], 2)}x the last")
    waves = max(len(r["tok_s"]) for r in f["servers"].values())
    line = (f"start-up: each server fresh, {waves} waves of {f['workload']} at "
            f"{f['clients']} clients with no warm-up; " + "; ".join(parts))
    if "default_over_none" in f:
        line += (f"; default's first/last over none's: {f['default_over_none']:.2f}x "
                 "(what speculation's start-up costs beyond the same requests' own)")
    return line


# ---------------------------------------------------------------- summary

def spread(values: list) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def ratio(a, b):
    return a / b if a is not None and b else None


def summarize(rounds: list[dict], servers: list[str], args) -> dict:
    """Per cell and server each metric's median and min-max over rounds, the
    ratios default/none and default/upstream, and default's same-text count."""
    rounds = [{s: run["cells"] for s, run in rd.items()} for rd in rounds]
    out = {}
    for workload in args.workloads:
        for n in args.clients:
            key = f"{workload}/{n}"
            cell = {"servers": {}, "ratios": {}}
            for s in servers:
                runs = [rd[s][key] for rd in rounds if key in rd.get(s, {})]
                if runs:
                    cell["servers"][s] = {m: spread([r[m] for r in runs]) for m in METRICS}
                    cell["servers"][s]["failed"] = sum(len(r["errors"]) for r in runs)
            d = cell["servers"].get("default")
            for other in ("none", "upstream"):
                o = cell["servers"].get(other)
                if d is None or o is None:
                    continue
                per_metric = {}
                for m in METRICS:
                    paired = [ratio(rd["default"][key][m], rd[other][key][m]) for rd in rounds
                              if key in rd.get("default", {}) and key in rd.get(other, {})]
                    paired = [x for x in paired if x is not None]
                    per_metric[m] = {
                        "of_medians": ratio(d[m] and d[m]["median"], o[m] and o[m]["median"]),
                        "min": min(paired, default=None), "max": max(paired, default=None)}
                cell["ratios"][f"default/{other}"] = per_metric
            if "default" in cell["servers"] and "none" in cell["servers"]:
                pairs = [(a, b) for rd in rounds
                         if key in rd.get("default", {}) and key in rd.get("none", {})
                         for a, b in zip(rd["default"][key]["texts"], rd["none"][key]["texts"])]
                cell["same_text"] = [sum(a == b for a, b in pairs), len(pairs)]
                r = cell["ratios"]["default/none"]
                cell["flags"] = [
                    f for f, bad in (
                        (f"tok/s {r['agg_tok_s']['of_medians']:.2f}x none"
                         if r["agg_tok_s"]["of_medians"] is not None else "",
                         (r["agg_tok_s"]["of_medians"] or 1) < MIN_TOK_S_RATIO),
                        (f"p95 {r['p95_s']['of_medians']:.2f}x none"
                         if r["p95_s"]["of_medians"] is not None else "",
                         (r["p95_s"]["of_medians"] or 1) > MAX_P95_RATIO)) if bad]
            out[key] = cell
    return out


# ---------------------------------------------------------------- output

def fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def fmt_spread(s: dict | None, digits: int) -> str:
    if s is None:
        return "n/a"
    if s["n"] == 1:
        return fmt(s["median"], digits)
    return f"{fmt(s['median'], digits)} ({fmt(s['min'], digits)}-{fmt(s['max'], digits)})"


def fmt_ratio(r: dict | None) -> str:
    if r is None or r["of_medians"] is None:
        return "n/a"
    if r["min"] is None or r["min"] == r["max"]:
        return f"{r['of_medians']:.2f}"
    return f"{r['of_medians']:.2f} ({r['min']:.2f}-{r['max']:.2f})"


def markdown(results: dict, servers: list[str], args, notes: dict) -> str:
    lines = [f"bench_matrix: {args.rounds} round(s), clients {args.clients}, "
             f"{args.per_client} request(s) per client, max_tokens {args.max_tokens}, "
             f"temperature 0; {platform.machine()}, {os.cpu_count()} CPUs. "
             "Each figure: median over rounds (min-max)."]
    for model, summary in results.items():
        lines += ["", f"### {Path(model).name}", ""]
        for note in notes.get(model, []):
            lines.append(f"- {note}")
        lines += ["", "| workload | clients | server | tok/s | p50 s | p95 s | TTFT p50 s "
                  "| failed |", "|---|---:|---|---:|---:|---:|---:|---:|"]
        for key, cell in summary.items():
            workload, n = key.split("/")
            for s in servers:
                f = cell["servers"].get(s)
                if f is None:
                    lines.append(f"| {workload} | {n} | {s} | n/a | n/a | n/a | n/a | - |")
                    continue
                lines.append(
                    f"| {workload} | {n} | {s} | {fmt_spread(f['agg_tok_s'], 1)} | "
                    f"{fmt_spread(f['p50_s'], 2)} | {fmt_spread(f['p95_s'], 2)} | "
                    f"{fmt_spread(f['ttft_p50_s'], 3)} | {f['failed']} |")
        lines += ["", "Ratios of the medians (min-max of the per-round ratios); tok/s: "
                  "higher is better for default, latency: lower.", "",
                  "| workload | clients | d/none tok/s | d/none p50 | d/none p95 | "
                  "d/none TTFT | d/upstream tok/s | d/upstream p95 | same text d=none | "
                  "bars |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for key, cell in summary.items():
            workload, n = key.split("/")
            dn = cell["ratios"].get("default/none", {})
            du = cell["ratios"].get("default/upstream", {})
            same = cell.get("same_text")
            flags = cell.get("flags")
            lines.append(
                f"| {workload} | {n} | {fmt_ratio(dn.get('agg_tok_s'))} | "
                f"{fmt_ratio(dn.get('p50_s'))} | {fmt_ratio(dn.get('p95_s'))} | "
                f"{fmt_ratio(dn.get('ttft_p50_s'))} | {fmt_ratio(du.get('agg_tok_s'))} | "
                f"{fmt_ratio(du.get('p95_s'))} | "
                f"{f'{same[0]}/{same[1]}' if same else 'n/a'} | "
                f"{'**' + '; '.join(flags) + '**' if flags else ('ok' if flags == [] else '-')} |")
    return "\n".join(lines) + "\n"


def chart(results: dict, args, path: Path) -> None:
    """default/none tok/s per workload, a bar per client count, the per-round
    min-max as error bars, one panel per model."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib)")
        return
    models = list(results)
    fig, axes = plt.subplots(len(models), 1, figsize=(max(8, 1.3 * len(args.workloads) *
                             max(1, len(args.clients)) / 2), 4 * len(models)), squeeze=False)
    width = 0.8 / len(args.clients)
    for ax, model in zip(axes[:, 0], models):
        summary = results[model]
        for i, n in enumerate(args.clients):
            xs, ys, lo, hi = [], [], [], []
            for x, workload in enumerate(args.workloads):
                r = summary[f"{workload}/{n}"]["ratios"].get("default/none", {}).get("agg_tok_s")
                if r is None or r["of_medians"] is None:
                    continue
                xs.append(x + (i - (len(args.clients) - 1) / 2) * width)
                ys.append(r["of_medians"])
                lo.append(r["of_medians"] - (r["min"] if r["min"] is not None else r["of_medians"]))
                hi.append((r["max"] if r["max"] is not None else r["of_medians"]) - r["of_medians"])
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=f"{n} client(s)")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(MIN_TOK_S_RATIO, color="red", linewidth=0.8, linestyle="--",
                   label=f"{MIN_TOK_S_RATIO}x (the bar)")
        ax.set_xticks(range(len(args.workloads)), args.workloads)
        ax.set_ylabel("default / none, aggregate tok/s")
        ax.set_title(f"{Path(model).name}: the default server over --spec-decode none\n"
                     f"median of {args.rounds} round(s); whiskers: per-round min-max")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# ---------------------------------------------------------------- driver

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", nargs="+", default=["models/smollm2-135m-instruct"])
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=WORKLOADS)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--per-client", type=int, default=2,
                   help="requests each client sends, back to back, in a cell")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds, each server started fresh in each, the order rotated")
    p.add_argument("--no-discard-first", dest="discard_first", action="store_false",
                   help="skip the untimed run of the first round's first server")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=SERVERS)
    p.add_argument("--default-args", default="",
                   help="extra flags for the default server, e.g. \"--spec-decode auto\"")
    p.add_argument("--port", type=int, default=8767)
    p.add_argument("--server-log-level", default="warning", choices=("debug", "info", "warning"),
                   help="our servers' --log-level; debug logs every step's decision and why "
                        "(the last round's, in bench_out/bench_matrix_default.log)")
    p.add_argument("--ready-timeout", type=float, default=300)
    p.add_argument("--request-timeout", type=float, default=900)
    p.add_argument("--out", type=Path, default=OUT_DIR / "bench_matrix.json")
    p.add_argument("--markdown", type=Path, help="also write the tables to this file")
    p.add_argument("--chart", type=Path, default=OUT_DIR / "bench_matrix.png",
                   help="the default/none chart (needs matplotlib)")
    p.add_argument("--first-waves", type=int, default=0, metavar="N",
                   help="also start the default server fresh and run N waves of "
                        "--first-wave-workload back to back with no warm-up (start-up's "
                        "cost: the first wave against the last)")
    p.add_argument("--first-wave-workload", choices=WORKLOADS, default="code-edit")
    p.add_argument("--first-wave-clients", type=int, default=8)
    args = p.parse_args(argv)
    if "--spec-decode" in args.default_args and "default" in args.servers:
        print("note: --default-args sets --spec-decode: `default` is then not the "
              "server's own default")
    if args.rounds < 3:
        print(f"note: {args.rounds} round(s): a figure needs at least 3 to be a median "
              "with a spread")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    servers = list(dict.fromkeys(args.servers))
    if "upstream" in servers and importlib.util.find_spec("mlx_lm") is None:
        print("mlx_lm is not installed: upstream skipped")
        servers.remove("upstream")
    t_start = time.perf_counter()
    results, raw, notes, skipped_all = {}, {}, {}, {}
    starts = {}
    for model in args.model:
        wl = Workloads(args.workloads)
        skipped: dict = {}
        rounds = []
        notes[model] = []
        if args.first_waves:
            starts[model] = first_waves(model, Workloads([args.first_wave_workload]),
                                        [x for x in servers if x in ("default", "none")], args)
            notes[model].append(first_waves_note(starts[model]))
        if args.discard_first and args.rounds:
            progress(f"{Path(model).name}: {servers[0]} once, untimed (the first process)")
            run_server(servers[0], model, -1, wl, args, skipped)
        for rnd in range(args.rounds):
            order = servers[rnd % len(servers):] + servers[:rnd % len(servers)]
            progress(f"{Path(model).name} round {rnd + 1}/{args.rounds}: {' '.join(order)}")
            rounds.append({s: run_server(s, model, rnd, wl, args, skipped) for s in order})
            partial = args.out.with_suffix(".partial.json")  # what an interrupted run keeps
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps({**raw, model: rounds}, indent=1))
        results[model] = summarize(rounds, servers, args)
        loads = [c["load_avg"] for rd in rounds for run in rd.values()
                 for c in run["cells"].values()]
        if loads:
            notes[model].append(f"load average (1 min) at the end of the cells: "
                                f"{min(loads):.1f} to {max(loads):.1f} on {os.cpu_count()} CPUs")
        for s in ("default", "none"):
            specs = [rd[s]["spec"] for rd in rounds if s in rd and rd[s]["spec"]]
            if specs:
                modes = sorted({str(x.get("mode")) for x in specs})
                accepted = sum(x["totals"]["accepted_tokens"] for x in specs)
                drafted = sum(x["totals"]["draft_tokens"] for x in specs)
                notes[model].append(
                    f"{s}: --spec-decode mode {', '.join(modes)} (/v1/spec_decode/metrics); "
                    f"{accepted} of {drafted} drafted tokens accepted over the run")
        raw[model] = rounds
        notes[model] += [f"{w}: not run on {s}: {why}" for (s, w), why in skipped.items()]
        if "upstream" in servers and "prediction" in wl.items \
                and ("upstream", "prediction") not in skipped:
            notes[model].append("prediction: upstream accepts the `prediction` field and "
                                "ignores it (it answers the plain code edit)")
        if wl.agent_as_text:
            notes[model].append("agent: this model's chat template has no tool calling (our "
                                "server refuses `tools`), so the tool definitions, call and "
                                "result went as text, to every server")
        skipped_all[model] = {f"{s}/{w}": why for (s, w), why in skipped.items()}
    wall = time.perf_counter() - t_start
    table = markdown(results, servers, args, notes)
    table += f"\nWall time {wall / 60:.1f} min.\n"
    print("\n" + table)
    if args.markdown:
        args.markdown.write_text(table)
        print(f"wrote {args.markdown}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "servers": servers, "wall_s": wall, "summary": results, "skipped": skipped_all,
        "first_waves": starts,
        "notes": notes, "rounds": raw,
        "token_count": "usage.completion_tokens from the include_usage chunk"}, indent=1))
    print(f"wrote {args.out}")
    if "default" in servers and "none" in servers:
        chart(results, args, args.chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
