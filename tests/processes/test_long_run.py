"""Long run: mixed load for 20 minutes (``--run-slow``; ``LONG_RUN_MINUTES``
to change), with memory and latency sampled each minute.

Six clients loop over what a server sees in a day: chat and completions,
streamed and not, greedy and seeded sampling, n-gram speculation on, streams
dropped midway, bad requests, and long prompts (a standard-library source)
with long replies. The KV memory budget is on and small (``BUDGET``: two
long requests and four short ones fit at once, three long ones and one
short do not), so requests wait for memory much of the time.

Each minute the report takes, for one fixed request shape (chat, 32 greedy
tokens, streamed), the median time per chunk from its first chunk (the role,
sent at once) to its last: the wait for memory and the decode together; MLX's active memory and the process
RSS; the steps the server ran; and the budget's use (reserved bytes and
requests waiting, sampled every second). Nothing may grow: the last minutes'
time between chunks stays within 30% of the first minutes', active memory
within 10%, reservations never pass the budget, and once idle nothing is
reserved and the server's memory is back where it started. Figures go to
``bench_out/long_run.json`` and stdout.
"""

import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from test_soak import _rss

MINUTES = float(os.environ.get("LONG_RUN_MINUTES", "20"))
CLIENTS = 6
PROBE = "Name three colours."
BUDGET = 160 << 20  # SmolLM2-135M, float32: 46 KB a token, so about 3,640 tokens
LONG_PROMPT = Path(json.__file__).with_name("decoder.py").read_text()[:2400] + "\n# Summary:"


async def _client(c, model, seed: int, deadline: float, probes: list, counts: dict):
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        kind = rng.choice(["probe", "probe", "stream", "cancel", "sampled", "bad", "code",
                           "long"])
        counts[kind] = counts.get(kind, 0) + 1
        if kind == "probe":
            tic = time.monotonic()
            stamps = []
            async with c.stream("POST", "/v1/chat/completions", json={
                    "model": model, "max_tokens": 32, "temperature": 0, "stream": True,
                    "messages": [{"role": "user", "content": PROBE}]}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        stamps.append(time.monotonic())
            # The first chunk (the role) is sent at once: what follows holds the
            # wait for memory and the decode.
            probes.append((tic, (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)))
        elif kind in ("stream", "cancel", "code", "long"):
            prompt = {"code": "def f(x):\n    return x + 1\n" * 20 + "# again:\n",
                      "long": LONG_PROMPT}.get(kind, f"Story {rng.randint(0, 99)}: once upon a time")
            stop_after = rng.randint(1, 12) if kind == "cancel" else None
            async with c.stream("POST", "/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": 160 if kind == "long" else 48,
                    "temperature": 0, "stream": True}) as r:
                assert r.status_code == 200
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if stop_after is not None and seen >= stop_after:
                        break
        elif kind == "sampled":
            r = await c.post("/v1/completions", json={
                "model": model, "prompt": "A list of fruit:", "max_tokens": 24,
                "temperature": 0.8, "top_p": 0.9, "seed": rng.randint(0, 10**6)})
            assert r.status_code == 200, r.text
        else:
            r = await c.post("/v1/chat/completions", json={
                "model": model, "messages": [], "max_tokens": 8})
            assert r.status_code == 400


@pytest.mark.slow
def test_a_long_mixed_load_grows_nothing(make_server):
    from mlx_lm_server.serving.memory import release_idle_memory
    from mlx_lm_server.spec_decode.config import SpecDecodeConfig

    server = make_server(spec=SpecDecodeConfig(mode="ngram"), max_batch_size=8,
                         max_kv_memory=BUDGET)
    httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": server.model, "max_tokens": 32, "temperature": 0,
        "messages": [{"role": "user", "content": PROBE}]})
    server.wait_idle()
    release_idle_memory()
    cached = server.scheduler.prompt_cache
    active0, rss0 = mx.get_active_memory() - cached.nbytes, _rss()

    start = time.monotonic()
    deadline = start + MINUTES * 60
    probes, counts, minutes = [], {}, []

    async def sample(c):
        while time.monotonic() < deadline:
            end = min(deadline, time.monotonic() + 60)
            reserved, waiting, steps = [], [], []
            while time.monotonic() < end:
                h = (await c.get("/health")).json()
                reserved.append(h["memory"]["kv_reserved"])
                waiting.append(h["memory"]["waiting_for_memory"])
                steps.append(h["steps"])
                await asyncio.sleep(1)
            minutes.append({"minute": len(minutes) + 1, "active_mb": mx.get_active_memory() / 2**20,
                            "rss_mb": _rss() / 2**20, "steps": steps[-1] - steps[0],
                            "kv_reserved_mb_max": max(reserved) / 2**20,
                            "kv_reserved_mb_median": statistics.median(reserved) / 2**20,
                            "waiting_max": max(waiting),
                            "waiting_share": sum(w > 0 for w in waiting) / len(waiting)})
            print(json.dumps(minutes[-1]), flush=True)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as c:
            await asyncio.gather(sample(c), *[
                _client(c, server.model, i, deadline, probes, counts) for i in range(CLIENTS)])

    asyncio.run(run())
    for m in minutes:
        window = [p for p in probes if (m["minute"] - 1) * 60 <= p[0] - start < m["minute"] * 60]
        m["probes"] = len(window)
        m["probe_ms_per_chunk"] = 1000 * statistics.median(p[1] for p in window) if window else None

    health = server.wait_idle(timeout=120)
    assert health["sequences"] == health["queued"] == 0
    assert health["memory"]["kv_reserved"] == 0 and health["memory"]["waiting_for_memory"] == 0
    release_idle_memory()
    # The prompt cache keeps recent prompts' KV by design, up to its bounds:
    # it is counted apart.
    active1, rss1 = mx.get_active_memory() - cached.nbytes, _rss()
    report = {"kv_budget_mb": BUDGET / 2**20, "peak_mb": mx.get_peak_memory() / 2**20,
              "prompt_cache_mb": cached.nbytes / 2**20, "minutes": minutes, "requests": counts, "active_mb_before": active0 / 2**20,
              "active_mb_after": active1 / 2**20, "rss_mb_before": rss0 / 2**20,
              "rss_mb_after": rss1 / 2**20}
    out = Path(__file__).resolve().parents[2] / "bench_out"
    out.mkdir(exist_ok=True)
    (out / "long_run.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))

    timed = [m["probe_ms_per_chunk"] for m in minutes if m["probe_ms_per_chunk"] is not None]
    n = max(1, len(timed) // 4)
    first, last = statistics.median(timed[:n]), statistics.median(timed[-n:])
    assert last <= first * 1.3, (first, last)
    first_mem = max(m["active_mb"] for m in minutes[:n])
    assert max(m["active_mb"] for m in minutes[-n:]) <= first_mem * 1.1
    assert active1 <= active0 * 1.05, (active0, active1)
    # The budget bound (requests waited for memory) and held.
    assert max(m["waiting_max"] for m in minutes) > 0
    assert max(m["kv_reserved_mb_max"] for m in minutes) <= BUDGET / 2**20
    # RSS also holds the prompt cache's entries and this process's own client.
    assert rss1 - cached.nbytes <= rss0 * 1.10, (rss0, rss1, cached.nbytes)
