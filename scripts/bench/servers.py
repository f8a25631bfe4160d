"""Running servers for the benchmarks that time them over HTTP: start ours
or upstream's ``mlx_lm.server`` (one process, or one per rank), wait until
it answers, stream one request and time it, stop it.

Every server benchmark starts and stops its servers here, so all of them
give upstream the same OpenBLAS, log to ``bench_out/`` and time a request
the same way (TTFT to the first content delta, decode tok/s after it).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
OUT_DIR = ROOT / "bench_out"
sys.path.insert(0, str(ROOT))

from mlx_lm_server.runtime.blas import find_openblas, needs_openblas  # noqa: E402  (no MLX import)

_CONTEXT = (
    "The city council met on Tuesday to discuss the new public transport plan. "
    "The plan adds three bus lines, extends the tram to the northern suburbs, "
    "and replaces paper tickets with a contactless card. Supporters say it will "
    "cut car traffic in the centre by a fifth within five years; critics point "
    "to the cost, which has doubled since the first estimate, and to the loss of "
    "parking spaces along the main avenue. Shop owners asked for a delivery lane. "
    "Cyclists asked for protected bike paths on the bridge. "
)

# Varied prompt lengths: a few words up to a few hundred tokens of context.
PROMPTS = [
    "Write a long story about a robot who learns to paint.",
    "Explain in detail how a hash table works, with examples.",
    _CONTEXT + "Summarize the arguments on both sides, then give your opinion.",
    "List twenty facts about the ocean, one per line, each with a short explanation.",
    (_CONTEXT * 3) + "Write a detailed letter to the council about this plan.",
    "Describe the water cycle step by step for a ten-year-old.",
    "Write a Python function that parses a CSV file and explain each line of it.",
    (_CONTEXT * 2) + "What questions should a journalist ask the mayor? Explain each.",
]

# A 60-line file to rename a function in and return whole: what n-gram drafting serves best.
CODE = "\n".join(f"def step_{i}(state, value):\n    total = state.get('total', 0) + value * {i}\n"
                 f"    state['total'] = total\n    return total" for i in range(15))


def prompts_for(workload: str, n: int, tag: str) -> list[str]:
    """``n`` prompts of ``workload`` (``chat``: PROMPTS in turn; ``code-edit``:
    a rename in CODE), each starting with a tag unique to ``tag`` and its index,
    so no server's prompt cache reuses another wave's prompt."""
    if workload == "code-edit":
        return [f"[{tag}-{i}] Rename step_{i % 15} to advance_{i % 15}. Return the whole "
                f"file, nothing else.\n\n{CODE}" for i in range(n)]
    return [f"[{tag}-{i}] {PROMPTS[i % len(PROMPTS)]}" for i in range(n)]


def progress(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


# ---------------------------------------------------------------- servers

def ours_command(models: str | list[str], port: int, *flags: str) -> list[str]:
    """``mlx-lm-server`` from this interpreter's environment, serving ``models``;
    ``python -m`` where the package is on ``PYTHONPATH`` without its entry point
    (the GPU machine's wheels)."""
    models = [models] if isinstance(models, str) else models
    entry = Path(sys.executable).with_name("mlx-lm-server")
    server = [str(entry)] if entry.exists() else [sys.executable, "-m", "mlx_lm_server.server"]
    return [*server,
            *(a for m in models for a in ("--model", m)), "--port", str(port), *flags]


def upstream_command(model: str, port: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", str(port), *flags]


def upstream_env() -> dict:
    """This environment with OpenBLAS preloaded, as ours preloads it for
    itself: without it upstream would run on the reference BLAS (Linux CPU
    wheels), which makes any comparison meaningless."""
    env = dict(os.environ)
    blas = find_openblas()
    if blas is None and needs_openblas():
        raise SystemExit("error: OpenBLAS not found; upstream would run with the slow "
                         "reference BLAS, which makes the comparison meaningless")
    env["LD_PRELOAD"] = " ".join(filter(None, [blas, env.get("LD_PRELOAD", "")]))
    return env


def request_model_name(upstream: bool, model_path: str) -> str:
    """What each server accepts as `model`: ours the folder name, upstream its alias."""
    return "default_model" if upstream else Path(model_path.rstrip("/")).name


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def launch(cmd: list[str], name: str, env: dict | None = None,
           ring: list[int] = ()) -> list[subprocess.Popen]:
    """Start ``cmd``: one process, or with a ``ring`` of ports one rank per
    port (``MLX_RANK``, a hostfile of the ring). Each in a new session, so
    its whole process group can be signalled; logs to ``bench_out/NAME*.log``."""
    OUT_DIR.mkdir(exist_ok=True)
    env = dict(os.environ) if env is None else env
    progress(f"[{name}] starting: {' '.join(cmd)}" + (f" x{len(ring)} ranks" if ring else ""))
    if not ring:
        log = open(OUT_DIR / f"{name}.log", "w")
        return [subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 cwd=ROOT, start_new_session=True)]
    hostfile = OUT_DIR / f"{name}_hosts.json"
    hostfile.write_text(json.dumps([f"127.0.0.1:{p}" for p in ring]))
    procs = []
    for rank in range(len(ring)):
        log = open(OUT_DIR / f"{name}_rank{rank}.log", "w")
        procs.append(subprocess.Popen(
            cmd, env=dict(env, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile)), stdout=log,
            stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True))
    return procs


def wait_ready(procs: list[subprocess.Popen], base: str, timeout: float) -> None:
    """Until ``base`` answers ``/health`` with ok; should a process exit or
    the time run out first, every process is stopped and the error raised."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            stop(procs, grace=15)
            raise RuntimeError(f"server exited with status {[p.returncode for p in procs]} "
                               "while starting; see its log in bench_out/")
        try:
            r = httpx.get(f"{base}/health", timeout=2)
            if r.status_code == 200 and r.json().get("status") == "ok":
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    stop(procs, grace=15)
    raise RuntimeError(f"server not ready after {timeout:.0f} s")


def stop(procs: list[subprocess.Popen], grace: float = 60) -> list[int]:
    """SIGINT to the first process (both servers shut down cleanly on it, and
    rank 0 takes the other ranks down), then SIGTERM, then SIGKILL to any
    process still running; the exit statuses."""
    for sig, wait_s in ((signal.SIGINT, grace), (signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        for i, proc in enumerate(procs):
            if proc.poll() is None and (i == 0 or sig != signal.SIGINT):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
        for proc in procs:
            try:
                proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                progress(f"pid {proc.pid} still running after {sig.name}")
        if all(p.poll() is not None for p in procs):
            break
    return [p.returncode for p in procs]


# ---------------------------------------------------------------- clients

def make_body(model: str, prompt: str, max_tokens: int) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def one_request(client: httpx.AsyncClient, url: str, body: dict,
                      fields: tuple[str, ...] = ("content",)) -> dict:
    """Send one streaming request; return its timings and token counts.
    ``fields``: the delta keys that count as output (TTFT is the first of
    them); ``("content", "reasoning", "tool_calls")`` times a thinking or a
    tool-calling answer too (a tool call's delta is kept as its JSON)."""
    start = time.perf_counter()
    first = None
    chunks = 0
    text = []
    usage = None
    error = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if "error" in data:
                        error = str(data["error"])
                    if data.get("usage"):
                        usage = data["usage"]
                    for choice in data.get("choices") or []:
                        delta = choice.get("delta") or {}
                        for piece in filter(None, map(delta.get, fields)):
                            chunks += 1
                            text.append(piece if isinstance(piece, str) else json.dumps(piece))
                            if first is None:
                                first = time.perf_counter()
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    if error is None and usage is None:
        error = "no usage chunk in the stream"
    tokens = usage["completion_tokens"] if usage else 0
    decode_s = end - first if first is not None else 0.0
    return {
        "start": start, "end": end, "error": error, "text": "".join(text),
        "ttft_s": (first - start) if first is not None else None,
        "completion_tokens": tokens, "content_chunks": chunks,
        "prompt_tokens": usage["prompt_tokens"] if usage else None,
        "decode_tok_s": (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else None,
    }


def rank_arguments(parser, configs: tuple, max_tokens: int) -> None:
    """The options every multi-rank benchmark (``bench_tp.py``,
    ``bench_pipeline.py``) shares: the model, which configurations, which
    workloads, the answer's length."""
    parser.add_argument("--model", default="models/qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--configs", nargs="+", default=list(configs), choices=configs)
    parser.add_argument("--workloads", nargs="+", default=["chat", "code-edit"],
                        choices=["chat", "code-edit"])
    parser.add_argument("--max-tokens", type=int, default=max_tokens)


def rank_plan(port: int) -> dict:
    """How a multi-rank server split the model (its ``/health``)."""
    return httpx.get(f"http://127.0.0.1:{port}/health").json()["tensor_parallel"]
