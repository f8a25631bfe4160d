"""The KV memory budget (``--max-kv-memory``): the arithmetic, admission by
it (wait in order, or a 400 with the numbers), an allocation failure inside a
step, and a flood of long requests against a budget a quarter of their need.

One server for the server tests: SmolLM2 in float32 holds 30 layers x 3 KV
heads x 64 x 2 (keys, values) x 4 bytes = 46,080 bytes per token; its budget
of 360 MiB is less than one request of the model's whole context (8,192
tokens) needs, so the refusal can be reached.
"""

import asyncio
import json
import random

import httpx
import mlx.core as mx
import pytest

from mlx_lm_server.serving.kv_budget import KVBudget, LayerCost, batch_bytes, room_tokens, row_bytes

PER_TOKEN = 46080  # SmolLM2-135M, float32, all 30 layers
BUDGET = 360 << 20
COMP = "/v1/completions"


# ---- the arithmetic ------------------------------------------------------------------


def test_each_layer_kind_by_hand():
    full, window, state = LayerCost(per_token=10), LayerCost(per_token=10, window=40), \
        LayerCost(fixed=7)
    # Attention grows a step at a time from wherever it stands: n + step - 1 slots at most.
    assert room_tokens(full, 1, step=16) == 16
    assert room_tokens(full, 100, step=16) == 115
    # A window takes one prefill chunk whole before trimming back to it.
    assert room_tokens(window, 20, step=16) == 35
    assert room_tokens(window, 25, step=16) == 40  # capped: 25 + 15 > 40
    assert room_tokens(window, 1000, step=16, chunk=8) == 47
    assert row_bytes([full, window, state], 100, step=16, chunk=8) == 1150 + 470 + 7
    assert row_bytes([state], 10**6) == 7  # recurrent state does not grow
    # A left-padded batch: every row as long as the longest.
    assert batch_bytes([full], [5, 100, 30], step=16) == 3 * 1150
    assert batch_bytes([full], []) == 0


def test_reservations_are_a_padded_batch_and_the_limit_is_exact():
    layers = [LayerCost(per_token=10)]
    b = KVBudget(3 * 10 * 115, layers, margin=2, step=16)
    assert b.length(90, 8) == 100
    assert b.reserved_with(100) == 1150
    b.reserve(1, 100)
    b.reserve(2, 5)  # short, but padded to the longest row
    assert b.reserved == 2 * 1150 and b.reserved_with(50) == 3 * 1150 == b.limit
    assert b.reserved_with(101) == 3 * 1160 > b.limit  # one token past
    b.release(1)
    assert b.reserved == 10 * 20 and len(b) == 1
    b.release(1)  # idempotent
    b.clear()
    assert b.reserved == 0

    # A request alone: exactly at the limit fits, one token more is refused.
    alone = KVBudget(10 * 115, layers, margin=2, step=16)
    assert alone.refusal(90, 8) is None
    message = alone.refusal(90, 9)
    assert "1160 bytes" in message and "90 prompt tokens + 9 max_tokens" in message
    assert "budget of 1150 bytes" in message and "at most 8 max_tokens" in message
    assert alone.most_tokens(90) == 8 and alone.most_tokens(99) == 0
    assert "prompt alone" in alone.refusal(99, 1)
    bounded = KVBudget(100, [LayerCost(fixed=100)])
    assert bounded.most_tokens(10**6) > 10**6  # nothing grows: any length fits


def test_the_flag():
    from mlx_lm_server.cli import build_parser, config_from_args
    from mlx_lm_server.config import ServerConfig

    def config(*flag):
        return config_from_args(build_parser().parse_args(["--model", "m", *flag]), environ={})

    assert config().max_kv_memory is None  # a share of the device's memory
    assert config("--max-kv-memory", "512M").max_kv_memory == 512 << 20
    assert config("--max-kv-memory", "1.5G").max_kv_memory == 3 << 29
    assert config("--max-kv-memory", "none").max_kv_memory == 0
    assert config("--max-kv-memory", "0").max_kv_memory == 0
    with pytest.raises(ValueError, match="--max-kv-memory must be 0 or more"):
        ServerConfig(model="m", max_kv_memory=-1)


def _cache_bytes(caches) -> int:
    mx.eval([c.state for c in caches])
    return sum(c.nbytes for c in caches)


def test_smollm2_layers_measured_and_bounding_its_real_caches(smollm2):
    """The measured cost equals the configuration's arithmetic, and the
    bound holds for a one-row cache and for upstream's left-padded batch."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_server.runtime import mlx_lm_adapter
    from mlx_lm_server.serving.memory import layer_costs

    model, tokenizer = smollm2
    layers = layer_costs(model)
    assert layers == [LayerCost(per_token=2 * 3 * 64 * 4)] * 30  # = PER_TOKEN per token

    for n in (1, 256, 257):  # one pass of n tokens: ceil(n / 256) steps, exactly
        caches = make_prompt_cache(model)
        model(mx.array([[7] * n]), cache=caches)
        assert _cache_bytes(caches) == PER_TOKEN * -(-n // 256) * 256 <= row_bytes(layers, n)

    # Two rows (20 and 150 prompt tokens) prefilled in chunks of 64, then decoded.
    gen = BatchGenerator(model, prefill_step_size=64, completion_batch_size=2,
                         prefill_batch_size=2)
    prompts = [tokenizer.encode("x " * 20)[:20], tokenizer.encode("y " * 150)[:150]]
    gen.insert(prompts, max_tokens=[20, 20])  # still running after 6 steps
    steps = 0
    while steps < 6:
        _, responses = gen.next()
        steps += bool(responses)
    batch = mlx_lm_adapter.generation_batch(gen)
    held = _cache_bytes(batch.prompt_cache)
    bound = batch_bytes(layers, [len(p) + steps for p in prompts])
    assert held <= bound and held > bound - 256 * PER_TOKEN * 2
    gen.close()


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_5"])
def test_window_and_recurrent_layers_bound_their_real_caches(family, tmp_path, smollm2_path):
    """Sliding-window (gemma3) and recurrent (qwen3_5) layers: the bound holds
    after a prompt fed in chunks and after decoding past the window."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache
    from tiny_models import build

    from mlx_lm_server.serving.memory import layer_costs

    model, _ = load(str(build(family, tmp_path / family, smollm2_path)))
    layers = layer_costs(model)
    assert any(c.window for c in layers) if family == "gemma3_text" else \
        any(c.fixed and not c.per_token for c in layers)
    caches, fed, chunk = make_prompt_cache(model), 0, 24
    assert len(caches) == len(layers)
    for size in (chunk, chunk, 1, 1, 1):  # a window of 16 takes 24 before trimming back
        model(mx.array([[3] * size]), cache=caches)
        fed += size
        _cache_bytes(caches)
        for cache, cost in zip(caches, layers):  # layer by layer
            assert cache.nbytes <= row_bytes([cost], fed, chunk=chunk)


def test_the_draft_models_layers_and_the_verification_margin_count(smollm2, smollm2_path):
    """With a draft model (SmolLM2 drafting for itself) every row holds both
    models' caches, each k + 1 tokens past its length during a verification."""
    from mlx_lm_server.assembly import make_scheduler
    from mlx_lm_server.spec_decode import make_engine
    from mlx_lm_server.spec_decode.config import SpecDecodeConfig

    model, tokenizer = smollm2
    spec = SpecDecodeConfig(mode="draft", draft_model_path=str(smollm2_path),
                            num_speculative_tokens=4, calibration_seconds=0)
    s = make_scheduler(model, tokenizer, engine=make_engine(model, spec, tokenizer, str(smollm2_path)),
                  max_kv_memory=1 << 30)
    assert s.budget.layers == (LayerCost(per_token=PER_TOKEN // 30),) * 60
    assert s.budget.row_bytes(s.budget.length(90, 10)) == 2 * PER_TOKEN * (105 + 255)
    assert make_scheduler(model, tokenizer).budget is None  # 0: no budget


# ---- through a server --------------------------------------------------------------


@pytest.fixture(scope="module")
def server(smollm2_path):
    from conftest import LiveServer

    s = LiveServer(smollm2_path, max_kv_memory=BUDGET, max_batch_size=32,
                   max_queued_requests=256)
    yield s
    s.close()


def _row(tokens: int) -> int:
    return PER_TOKEN * (tokens + 255)


def test_a_request_that_can_never_fit_is_a_400_with_the_numbers(server):
    body = {"model": server.model, "prompt": "Hello", "temperature": 0}
    prompt = len(server.tokenizer.encode("Hello"))
    for stream in (False, True):
        r = httpx.post(server.url + COMP, json={**body, "max_tokens": 8000, "stream": stream},
                       timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "kv_memory_exceeded" and error["param"] == "max_tokens"
        need = _row(prompt + 8000)
        assert f"needs {need} bytes" in error["message"]
        assert f"budget of {BUDGET} bytes" in error["message"]
        assert f"at most {BUDGET // PER_TOKEN - 255 - prompt} max_tokens" in error["message"]
    # The largest that fits is served (its reservation is the whole budget).
    most = {**body, "max_tokens": BUDGET // PER_TOKEN - 255 - prompt}

    async def first_chunk():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            await _first_chunk_then_hold(c, most, asyncio.Event(), _set())

    asyncio.run(first_chunk())
    h = server.wait_idle()["memory"]
    assert h["kv_budget"] == BUDGET and h["kv_reserved"] == 0 and h["waiting_for_memory"] == 0
    metrics = dict(line.rsplit(" ", 1) for line in httpx.get(
        server.url + "/metrics", timeout=10).text.splitlines() if not line.startswith("#"))
    assert float(metrics["kv_memory_budget_bytes"]) == BUDGET
    assert float(metrics["kv_memory_reserved_bytes"]) == 0
    assert float(metrics["prompt_cache_bytes"]) == server.scheduler.prompt_cache.nbytes
    assert float(metrics["mlx_peak_memory_bytes"]) >= float(metrics["mlx_active_memory_bytes"])


def _set() -> asyncio.Event:
    e = asyncio.Event()
    e.set()
    return e


async def _first_chunk_then_hold(client, body, holding: asyncio.Event, release: asyncio.Event):
    """Stream ``body``: read its first chunk, set ``holding``, then leave
    (cancelling it) when ``release`` is set."""
    async with client.stream("POST", COMP, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                holding.set()
                await release.wait()
                return


def test_requests_wait_for_room_in_order(server, monkeypatch):
    """A (40% of the budget) runs; B (70%) cannot join it and waits; C would
    fit beside A (2 rows at A's length: 80%) but arrived after B, so it waits
    behind B. Cancel A: B runs, C still waits (2 rows at B's length: 140%).
    Cancel B: C runs and finishes."""
    joined = []
    real_join = server.scheduler.batch.join

    def join(req):
        joined.append(req.max_tokens)
        return real_join(req)

    monkeypatch.setattr(server.scheduler.batch, "join", join)
    prompt = "1, 2, 3, 4, 5, 6,"
    n = len(server.tokenizer.encode(prompt))
    a = int(0.4 * BUDGET) // PER_TOKEN - 255 - n
    b = int(0.7 * BUDGET) // PER_TOKEN - 255 - n
    body = {"model": server.model, "prompt": prompt, "temperature": 0}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            held = [asyncio.Event() for _ in range(2)]
            go = [asyncio.Event() for _ in range(2)]
            ta = asyncio.create_task(_first_chunk_then_hold(c, {**body, "max_tokens": a},
                                                            held[0], go[0]))
            await held[0].wait()
            tb = asyncio.create_task(_first_chunk_then_hold(c, {**body, "max_tokens": b},
                                                            held[1], go[1]))
            await _until(lambda: server.health()["memory"]["waiting_for_memory"] == 1)
            tc = asyncio.create_task(c.post(COMP, json={**body, "max_tokens": 4}))
            await _until(lambda: server.health()["memory"]["waiting_for_memory"] == 2)
            assert joined == [a]
            assert server.health()["memory"]["kv_reserved"] == _row(n + a)
            go[0].set()
            await held[1].wait()
            await asyncio.sleep(0.5)
            assert joined == [a, b] and not tc.done()
            go[1].set()
            r = await tc
            await asyncio.gather(ta, tb)
            return r

    r = asyncio.run(run())
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert joined == [a, b, 4]
    assert server.wait_idle()["memory"]["kv_reserved"] == 0


def test_a_request_cancelled_while_waiting_for_room_leaves_and_never_runs(server, monkeypatch):
    """A (70% of the budget) runs; B (70%) waits for room; B's client goes
    away: B leaves the waiting room at once (A still running) and never
    joins, and its queue slot is given back."""
    joined = []
    real_join = server.scheduler.batch.join

    def join(req):
        joined.append(req.max_tokens)
        return real_join(req)

    monkeypatch.setattr(server.scheduler.batch, "join", join)
    prompt = "1, 2, 3, 4, 5, 6,"
    n = len(server.tokenizer.encode(prompt))
    big = int(0.7 * BUDGET) // PER_TOKEN - 255 - n
    body = {"model": server.model, "prompt": prompt, "temperature": 0, "max_tokens": big}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            held, go = asyncio.Event(), asyncio.Event()
            ta = asyncio.create_task(_first_chunk_then_hold(c, body, held, go))
            await held.wait()
            tb = asyncio.create_task(c.post(COMP, json={**body, "stream": True}))
            await _until(lambda: server.health()["memory"]["waiting_for_memory"] == 1)
            tb.cancel()
            await _until(lambda: server.health()["memory"]["waiting_for_memory"] == 0)
            assert server.health()["queued"] == 0 and not ta.done()
            go.set()
            await ta

    asyncio.run(run())
    assert joined == [big]
    assert server.wait_idle()["memory"]["kv_reserved"] == 0


async def _until(check, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await asyncio.to_thread(check):
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_an_allocation_failure_in_a_step_ends_its_requests_and_the_server_serves_on(
        server, monkeypatch):
    """MLX raises when an allocation fails: the step's requests end with an
    out-of-memory error event, their memory is given back, and the next
    request is served."""
    generation = server.scheduler.batch
    real_step, failed = generation.step, []

    def step():
        if not failed:
            failed.append(True)
            raise RuntimeError("[malloc] Unable to allocate 2147483648 bytes.")
        return real_step()

    server.wait_idle()
    mx.eval(mx.zeros(1))
    before = mx.get_active_memory() - server.scheduler.prompt_cache.nbytes
    monkeypatch.setattr(generation, "step", step)
    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 16,
            "temperature": 0}

    async def stream():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            async with c.stream("POST", COMP, json={**body, "stream": True}) as r:
                return [line async for line in r.aiter_lines() if line.startswith("data: ")]

    lines = asyncio.run(stream())
    assert lines[-1] == "data: [DONE]" and failed
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == "out_of_memory" and "Unable to allocate" in error["message"]
    h = server.wait_idle()
    assert h["sequences"] == 0 and h["memory"]["kv_reserved"] == 0
    assert mx.get_active_memory() - server.scheduler.prompt_cache.nbytes <= before * 1.02

    r = httpx.post(server.url + COMP, json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16


# ---- the flood -----------------------------------------------------------------------

FLOOD = 64
# 90 prompt tokens; SmolLM2 answers in a few tokens and stops, but each
# request reserves its max_tokens: the budget admits the worst case.
CONTEXT = ("We keep a log of the harbour. " + " ".join(
    f"Day {i}: the boats went out at dawn and came back at dusk with fish." for i in range(3)))
FLOOD_MAX_TOKENS = 160
# The slow variant asks for long answers, so rows do grow to their worst case.
ASK = {"short": "reply with one word, yes or no.",
       "full": "write every number from 1 to 500, separated by commas."}
# What the peak may exceed the idle memory + budget by: activations of a
# prefill batch and a step, caches being copied as a batch grows or merges.
# Measured: short answers peak 36-53 MiB below idle + budget, full answers
# 46 MiB above it; without the budget's check, full answers 381 MiB above.
SLACK = 64 << 20


def _messages(i: int, answers: str) -> list:
    return [{"role": "system", "content": CONTEXT},
            {"role": "user", "content": f"Request {i}: {ASK[answers]}"}]


async def _flood_one(client, model, i: int, cancel: bool, answers: str) -> tuple:
    """('done', text) | ('error', message) | ('cancelled', None)."""
    body = {"model": model, "messages": _messages(i, answers),
            "max_tokens": FLOOD_MAX_TOKENS, "temperature": 0, "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return "error", (await r.aread()).decode()
        text = []
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return "error", chunk["error"]["message"]
            if cancel:
                return "cancelled", None
            text.append(chunk["choices"][0]["delta"].get("content") or "")
    return "done", "".join(text)


@pytest.mark.parametrize("answers", ["short", pytest.param("full", marks=pytest.mark.slow)])
def test_a_flood_of_long_requests_stays_within_the_budget(server, monkeypatch, answers):
    """64 streams at once whose worst cases need about four times the budget;
    a quarter dropped after their first chunk. Nothing fails, the budget is
    never overdrawn, MLX's peak stays within idle + budget + slack, and the
    memory returns to its idle level. Short answers (the default) reserve
    far more than they use; full ones (``--run-slow``) use it all."""
    sched = server.scheduler
    prompt = len(server.tokenizer.apply_chat_template(_messages(10, answers),
                                                      add_generation_prompt=True))
    need = FLOOD * _row(prompt + FLOOD_MAX_TOKENS)
    assert 3.5 * BUDGET < need < 4.5 * BUDGET  # a quarter of what the flood needs

    overdrawn, waiting = [], []
    real_join = sched.batch.join

    def join(req):  # every admission leaves the budget whole, prompt cache included
        used = sched.budget.reserved_with(sched.budget.length(
            len(req.prompt_tokens), req.max_tokens)) + sched.prompt_cache.nbytes
        if used > BUDGET:
            overdrawn.append(used)
        waiting.append(sched.stats()["memory"]["waiting_for_memory"])
        return real_join(req)

    monkeypatch.setattr(sched.batch, "join", join)
    server.wait_idle()
    mx.eval(mx.zeros(1))
    idle = mx.get_active_memory() - sched.prompt_cache.nbytes
    mx.reset_peak_memory()
    rng = random.Random(0)
    cancel = [rng.random() < 0.25 for _ in range(FLOOD)]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            return await asyncio.gather(*[_flood_one(c, server.model, i, cancel[i], answers)
                                          for i in range(FLOOD)])

    results = asyncio.run(run())
    h = server.wait_idle()
    peak = h["memory"]["peak"]
    print(f"flood: idle {idle / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB, "
          f"peak - idle - budget {(peak - idle - BUDGET) / 2**20:.1f} MiB, "
          f"most waiting {max(waiting)}, prompt cache {h['memory']['prompt_cache'] / 2**20:.1f}")
    assert not overdrawn and max(waiting) > FLOOD / 2  # the budget held most back
    assert [kind for kind, _ in results].count("error") == 0, results
    assert all(kind == ("cancelled" if c else "done") for (kind, _), c in zip(results, cancel))
    assert all(text for kind, text in results if kind == "done")
    assert h["sequences"] == 0 and h["memory"]["kv_reserved"] == 0
    assert h["memory"]["prompt_cache"] <= BUDGET
    assert peak <= idle + BUDGET + SLACK, (peak - idle) / (1 << 20)
    mx.eval(mx.zeros(1))
    after = mx.get_active_memory() - sched.prompt_cache.nbytes
    assert after <= idle * 1.02, (idle, after)
