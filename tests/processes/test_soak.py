"""Cancel soak: many streams, half dropped at random points, nothing lost or leaked.

CI runs 60 streams per proposer (``--run-slow``: 200). Streams are cancelled
before their first token (mid-prefill), after a few chunks (mid-stream, which
under speculation is between or inside verified runs); survivors must equal
their prompt's solo greedy run. Afterwards the scheduler, engine, proposer
and controller hold nothing, and MLX's active memory is back where it was.
"""

import asyncio
import os
import random
import sys

import httpx
import mlx.core as mx
import pytest

STREAMS = 200 if "--run-slow" in sys.argv else 60
PROMPTS = [f"Note {i}: " + text for i, text in enumerate([
    "list the days of the week, then the months of the year.",
    "one two three four five one two three four five one two three",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "Write a short poem about the sea.",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Explain what a hash table is.",
])]
BODY = {"max_tokens": 32, "temperature": 0}


async def _stream(client, model: str, prompt: str, cancel_after) -> str:
    """The streamed text; None when cancelled after ``cancel_after`` chunks."""
    text = []
    async with client.stream("POST", "/v1/completions", json={
            "model": model, "prompt": prompt, "stream": True, **BODY}) as r:
        assert r.status_code == 200
        if cancel_after == 0:
            return None  # gone before the first token: mid-prefill
        seen = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            seen += 1
            text.append(__import__("json").loads(line[6:])["choices"][0]["text"])
            if cancel_after is not None and seen >= cancel_after:
                return None
    return "".join(text)


def _rss() -> int:
    """This process's resident bytes now (Linux; 0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _soak(server) -> None:
    engine = server.scheduler.engine

    def solo(p):
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"model": server.model, "prompt": p, **BODY})
        return r.json()["choices"][0]["text"]

    want = {p: solo(p) for p in PROMPTS}  # also warms every shape up
    server.wait_idle()
    mx.eval(mx.zeros(1))
    before, rss_before = mx.get_active_memory(), _rss()

    rng = random.Random(0)
    plan = [(PROMPTS[i % len(PROMPTS)], rng.choice([0, 1, 2, 5, 9]) if i % 2 else None)
            for i in range(STREAMS)]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            return await asyncio.gather(*[_stream(c, server.model, p, n) for p, n in plan])

    results = asyncio.run(run())
    survivors = [(p, t) for (p, n), t in zip(plan, results) if n is None]
    assert len(survivors) == STREAMS // 2
    assert [t for _, t in survivors] == [want[p] for p, _ in survivors]

    health = server.wait_idle(timeout=60)
    assert health["sequences"] == health["queued"] == health["active"] == 0
    assert not any(health["batch"].values())
    assert engine._rows == {} and engine._num_constrained == 0
    predictions = engine.proposer.predictions
    assert predictions._rows == predictions._prompt_lens == {}
    # The mode's proposer, a source of the per-row proposer.
    proposer = engine.proposer.lookup if engine.proposer.model is None else engine.proposer.model
    for name in ("_indices", "_params", "_keys", "fed"):
        assert getattr(proposer, name, {}) == {}, name
    assert getattr(proposer, "uids", []) == [] and getattr(proposer, "cache", None) is None
    estimates = engine.controller.estimates
    assert estimates.acceptance_of == estimates.proposal_rate_of == {}
    assert engine._shadow._open == {}
    mx.eval(mx.zeros(1))
    after = mx.get_active_memory()
    assert after <= before * 1.05, (before, after)
    # The server gave its buffer cache back when it went idle ...
    assert mx.get_cache_memory() < 16 << 20, mx.get_cache_memory()
    # ... and RSS returns to its level once freed pages are trimmed. The test's
    # own client lives in this process and freed its buffers after the server
    # went idle, so its pages are trimmed here the way the server trims its own.
    from mlx_lm_server.serving.memory import release_idle_memory

    release_idle_memory()
    rss_after = _rss()
    print(f"active memory {before} -> {after} bytes, RSS {rss_before} -> {rss_after} bytes")
    assert rss_after <= rss_before * 1.05, (rss_before, rss_after)


@pytest.mark.slow  # a soak: long by nature; scripts/mutants.py runs it
@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_cancel_soak_leaves_nothing_behind(make_server, smollm2_path, mode):
    from mlx_lm_server.spec_decode.config import SpecDecodeConfig

    spec = SpecDecodeConfig(mode=mode, num_speculative_tokens=4,
                            draft_model_path=str(smollm2_path) if mode == "draft" else None)
    server = make_server(spec=spec, prompt_cache_size=0, max_batch_size=16)
    _soak(server)
