"""A server that never falls over: bad input, vanished clients, overload, faults, signals."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
RESP = "/v1/responses"


def _msgs(text="hi"):
    return [{"role": "user", "content": text}]


def _bad_requests(model):
    ok_chat = {"model": model, "messages": _msgs()}
    ok_comp = {"model": model, "prompt": "hi"}
    return [
        ("malformed json", CHAT, "{not json", 400),
        ("body is a list", CHAT, [1, 2], 400),
        ("missing messages", CHAT, {"model": model}, 400),
        ("missing model", CHAT, {"messages": _msgs()}, 400),
        ("empty messages", CHAT, {**ok_chat, "messages": []}, 400),
        ("bad role", CHAT, {**ok_chat, "messages": [{"role": "wizard", "content": "x"}]}, 400),
        ("content is a number", CHAT, {**ok_chat, "messages": [{"role": "user", "content": 5}]}, 400),
        ("image part", CHAT, {**ok_chat, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400),
        ("unknown model", CHAT, {**ok_chat, "model": "gpt-4"}, 404),
        ("temperature too high", CHAT, {**ok_chat, "temperature": 5}, 400),
        ("temperature is a string", CHAT, {**ok_chat, "temperature": "hot"}, 400),
        ("negative top_p", CHAT, {**ok_chat, "top_p": -0.1}, 400),
        ("top_k negative", CHAT, {**ok_chat, "top_k": -1}, 400),
        ("min_p above one", CHAT, {**ok_chat, "min_p": 1.5}, 400),
        ("max_tokens zero", CHAT, {**ok_chat, "max_tokens": 0}, 400),
        ("max_tokens is a float", CHAT, {**ok_chat, "max_tokens": 1.5}, 400),
        ("max_completion_tokens negative", CHAT, {**ok_chat, "max_completion_tokens": -3}, 400),
        ("n=2", CHAT, {**ok_chat, "n": 2}, 400),
        ("stream is a string", CHAT, {**ok_chat, "stream": "yes"}, 400),
        ("stop is a number", CHAT, {**ok_chat, "stop": 3}, 400),
        ("empty stop string", CHAT, {**ok_chat, "stop": [""]}, 400),
        ("too many stops", CHAT, {**ok_chat, "stop": [str(i) for i in range(17)]}, 400),
        ("top_logprobs without logprobs", CHAT, {**ok_chat, "top_logprobs": 2}, 400),
        ("top_logprobs too many", CHAT, {**ok_chat, "logprobs": True, "top_logprobs": 50}, 400),
        ("repetition_penalty zero", CHAT, {**ok_chat, "repetition_penalty": 0}, 400),
        ("stream_options without stream", CHAT, {**ok_chat, "stream_options": {"include_usage": True}}, 400),
        ("seed is a string", CHAT, {**ok_chat, "seed": "abc"}, 400),
        ("seed past 64 bits", CHAT, {**ok_chat, "seed": 2**64}, 400),
        ("seed below -2**63", COMP, {**ok_comp, "seed": -(2**63) - 1}, 400),
        ("empty prompt", COMP, {**ok_comp, "prompt": ""}, 400),
        ("two prompts", COMP, {**ok_comp, "prompt": ["a", "b"]}, 400),
        ("token id out of range", COMP, {**ok_comp, "prompt": [1, 10**9]}, 400),
        ("logprobs too many", COMP, {**ok_comp, "logprobs": 21}, 400),
        ("echo", COMP, {**ok_comp, "echo": True}, 400),
        ("unknown model (completions)", COMP, {**ok_comp, "model": "nope"}, 404),
        ("NaN temperature", CHAT, json.dumps(ok_chat)[:-1] + ', "temperature": NaN}', 400),
        ("infinite top_p", CHAT, json.dumps(ok_chat)[:-1] + ', "top_p": Infinity}', 400),
        ("negative infinite temperature", COMP,
         json.dumps(ok_comp)[:-1] + ', "temperature": -Infinity}', 400),
        ("tools not a list", CHAT, {**ok_chat, "tools": "search"}, 400),
        ("tool without a function", CHAT, {**ok_chat, "tools": [{"type": "function"}]}, 400),
        ("text part without text", CHAT, {**ok_chat, "messages": [
            {"role": "user", "content": [{"type": "text"}]}]}, 400),
        ("logit_bias id out of range", CHAT, {**ok_chat, "logit_bias": {"99999999": 1}}, 400),
        ("response_format unknown type", CHAT, {**ok_chat, "response_format": {"type": "xml"}}, 400),
    ]


def _assert_error_object(response, status):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and "code" in err


def test_bad_requests_get_openai_errors(live_server):
    cases = _bad_requests(live_server.model)
    assert len(cases) >= 40
    for name, path, body, status in cases:
        for stream in (False, True):
            if stream and isinstance(body, dict) and "stream_options" in body:
                continue  # valid once streaming
            if isinstance(body, dict):
                payload = json.dumps({**body, "stream": stream} if "stream" not in body else body)
            else:
                payload = body if isinstance(body, str) else json.dumps(body)
            r = httpx.post(live_server.url + path, content=payload,
                           headers={"content-type": "application/json"}, timeout=30)
            # Errors come before any stream starts: a plain JSON body, never SSE.
            assert not r.headers["content-type"].startswith("text/event-stream"), name
            _assert_error_object(r, status)
    assert live_server.wait_idle()["sequences"] == 0


def test_odd_but_valid_inputs_are_served(live_server):
    """Inputs at the edges that a server must take, not refuse or crash on."""
    chat = {"model": live_server.model, "max_tokens": 4, "temperature": 0}
    cases = {
        "content as text parts": {**chat, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Say"}, {"type": "text", "text": " hi"}]}]},
        "a 10 kB stop string": {**chat, "messages": _msgs(), "stop": ["x" * 10240]},
        "16 stop strings": {**chat, "messages": _msgs(), "stop": [f"s{i}" for i in range(16)]},
        "max_tokens far past the context": {**chat, "messages": _msgs(), "max_tokens": 10**12,
                                            "stop": ["."], "logit_bias": None},
        "non-ASCII and emoji": {**chat, "messages": _msgs("héllo wörld 你好 🙂")},
        "a negative seed": {**chat, "messages": _msgs(), "temperature": 1.0, "seed": -1},
        "the largest seed": {**chat, "messages": _msgs(), "temperature": 1.0, "seed": 2**64 - 1},
        "top_k past the vocabulary": {**chat, "messages": _msgs(), "temperature": 1.0,
                                      "top_k": 10**9},
        "a top_p float32 rounds to 0": {**chat, "messages": _msgs(), "temperature": 2.0,
                                        "top_p": 1e-300},
        "a temperature float32 rounds to 0": {**chat, "messages": _msgs(), "temperature": 1e-300},
    }
    for name, body in cases.items():
        r = httpx.post(live_server.url + CHAT, json=body, timeout=120)
        assert r.status_code == 200, (name, r.text)
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length"), name


def test_invalid_utf8_and_oversized_bodies_are_400s(live_server):
    bad = b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}'
    r = httpx.post(live_server.url + CHAT, content=bad,
                   headers={"content-type": "application/json"}, timeout=30)
    _assert_error_object(r, 400)
    big = json.dumps({"model": live_server.model, "prompt": "a " * (25 << 20)})  # 50 MB
    r = httpx.post(live_server.url + COMP, content=big,
                   headers={"content-type": "application/json"}, timeout=120)
    _assert_error_object(r, 413)

    def chunks():  # no Content-Length: the limit counts bytes as they arrive
        for _ in range(20):
            yield b"a" * (1 << 20)
    r = httpx.post(live_server.url + COMP, content=chunks(),
                   headers={"content-type": "application/json"}, timeout=120)
    _assert_error_object(r, 413)
    # On an Anthropic route, in Anthropic's error shape.
    r = httpx.post(live_server.url + "/v1/messages", content=chunks(),
                   headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code == 413
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "request_too_large"
    r = httpx.post(live_server.url + COMP, timeout=60, json={
        "model": live_server.model, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200


def test_a_body_that_never_finishes_does_not_block_others(live_server):
    """A client that sends headers and half a body, then goes quiet."""
    import socket

    sock = socket.create_connection(("127.0.0.1", int(live_server.url.rsplit(":", 1)[1])))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                     b'{"model": "')
        r = httpx.post(live_server.url + COMP, timeout=60, json={
            "model": live_server.model, "prompt": "Hi", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        sock.close()
    assert live_server.wait_idle()["sequences"] == 0


def test_unknown_route_is_an_error_object(live_server):
    _assert_error_object(httpx.get(live_server.url + "/v1/nothing", timeout=10), 404)
    _assert_error_object(httpx.get(live_server.url + CHAT, timeout=10), 405)


def test_prompt_longer_than_context(live_server):
    limit = live_server.service.max_context
    prompt = "hello " * (limit + 10)
    n = len(live_server.tokenizer.encode(prompt))
    for stream in (False, True):
        r = httpx.post(live_server.url + COMP, timeout=60, json={
            "model": live_server.model, "prompt": prompt, "stream": stream})
        _assert_error_object(r, 400)
        message = r.json()["error"]["message"]
        assert str(n) in message and str(limit) in message
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert r.json()["error"]["param"] == "prompt"
    r = httpx.post(live_server.url + CHAT, timeout=60, json={
        "model": live_server.model, "messages": _msgs(prompt)})
    _assert_error_object(r, 400)
    assert r.json()["error"]["param"] == "messages"


def test_disconnect_mid_prefill_and_non_streaming_timeout(live_server):
    """A client that gives up, before or after its first token, leaves no
    sequence behind. Each asks for 4,000 tokens with the end of sequence
    forbidden: only cancellation can idle the server within the check."""
    long_prompt = "Repeat after me: the quick brown fox jumps over the lazy dog. " * 60
    endless = {str(t): -100 for t in live_server.tokenizer.eos_token_ids}
    body = {"model": live_server.model, "prompt": long_prompt, "max_tokens": 4000,
            "temperature": 0, "logit_bias": endless}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live_server.url + COMP, json=body, timeout=httpx.Timeout(30, read=0.3))

    async def stream_then_leave():
        async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as c:
            async with c.stream("POST", COMP, json={**body, "stream": True}) as r:
                assert r.status_code == 200
                # leave before the first token: the prompt is still being prefilled

    asyncio.run(stream_then_leave())
    health = live_server.wait_idle(timeout=20)
    assert health["sequences"] == 0 and health["queued"] == 0 and health["active"] == 0
    # and the server still serves
    r = httpx.post(live_server.url + COMP, json={**body, "prompt": "Hi", "max_tokens": 3,
                                                  "logit_bias": None}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_queue_full_is_429_with_retry_after(make_server):
    server = make_server(max_batch_size=2, prefill_batch_size=1, max_queued_requests=2)
    body = {"model": server.model, "prompt": "Tell me a long story. " * 40, "max_tokens": 24,
            "temperature": 0}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            return await asyncio.wait_for(
                asyncio.gather(*[c.post(COMP, json=body) for _ in range(12)]), 120
            )

    responses = asyncio.run(run())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429} and codes.count(429) >= 1 and codes.count(200) >= 2
    for r in responses:
        if r.status_code == 429:
            _assert_error_object(r, 429)
            assert r.headers["retry-after"] == "1"
    assert server.wait_idle()["sequences"] == 0


def test_overload_gives_exactly_the_excess_429s(make_server):
    """Q + 20 simultaneous requests with Q queue slots: exactly 20 are 429
    (with Retry-After), the other Q complete. Their prompts are long enough
    that none gets its first token (and leaves the queue) before all arrive."""
    Q = 5
    server = make_server(max_batch_size=2, prefill_batch_size=1, max_queued_requests=Q)
    body = {"model": server.model, "prompt": "Tell me a long story. " * 120, "max_tokens": 4,
            "temperature": 0}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     limits=httpx.Limits(max_connections=Q + 20)) as c:
            return await asyncio.gather(*[c.post(COMP, json=body) for _ in range(Q + 20)])

    responses = asyncio.run(run())
    codes = [r.status_code for r in responses]
    assert codes.count(429) == 20 and codes.count(200) == Q, codes
    for r in responses:
        if r.status_code == 429:
            _assert_error_object(r, 429)
            assert r.headers["retry-after"] == "1"
        else:
            assert r.json()["usage"]["completion_tokens"] == 4
    assert server.wait_idle()["sequences"] == 0


def test_generation_error_fails_the_request_and_server_keeps_serving(make_server, monkeypatch):
    """A fault inside a decode step ends the request with an error event and [DONE].

    No real request makes the model raise, so a sampler that raises for one
    marked request stands in for a fault.
    """
    from mlx_lm_server.serving import batch as generation

    real = generation.make_sampler

    def faulty(params):
        if params.seed == 666:
            def boom(logprobs):
                raise RuntimeError("injected sampler fault")
            return boom
        return real(params)

    monkeypatch.setattr(generation, "make_sampler", faulty)
    server = make_server()
    bad = {"model": server.model, "prompt": "Hello", "max_tokens": 8, "temperature": 0.7, "seed": 666}

    async def stream():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            async with c.stream("POST", COMP, json={**bad, "stream": True}) as r:
                return [line async for line in r.aiter_lines() if line.startswith("data: ")]

    lines = asyncio.run(stream())
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])
    assert "injected sampler fault" in error["error"]["message"]

    r = httpx.post(server.url + COMP, json=bad, timeout=60)
    _assert_error_object(r, 500)
    good = httpx.post(server.url + COMP, json={**bad, "seed": 1}, timeout=60)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 8
    assert server.wait_idle()["sequences"] == 0


@pytest.mark.parametrize("where", ["verify", "propose", "tree verify"])
def test_a_failing_speculative_step_decodes_plainly(make_server, where):
    """A fault inside speculation (injected: no real input makes verification
    raise) costs only that step's speculation: the batch decodes plainly, the
    output is the same tokens, nothing errors. A tree step's fault leaves no
    tree mask behind for the plain and chain steps after it."""
    from mlx_lm_server.spec_decode.config import SpecDecodeConfig

    trees = dict(tree_width=4, adaptive_k=False) if where == "tree verify" else {}
    server = make_server(spec=SpecDecodeConfig(mode="ngram", dynamic=False, **trees))
    engine = server.scheduler.engine
    prompts = [f"{i}: one two three four five one two three four five one two" for i in range(4)]
    if trees:  # continuations that branch: the n-gram "a b" is followed by c, d and e
        prompts = [f"{i}: a b c a b d a b e a b c a b d a b e a b" for i in range(4)]
    body = {"model": server.model, "max_tokens": 24, "temperature": 0}

    def run():
        async def go():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
                rs = await asyncio.gather(*[c.post(COMP, json={**body, "prompt": p})
                                            for p in prompts])
            return [r.json()["choices"][0]["text"] for r in rs]
        return asyncio.run(go())

    want = run()
    calls = {"n": 0}
    target = "_plan" if where == "propose" else "_judge"
    real = getattr(engine, target)

    def every_other(*a, **k):
        calls["n"] += 1
        if calls["n"] % 2:
            raise RuntimeError(f"injected {where} fault")
        return real(*a, **k)

    setattr(engine, target, every_other)
    try:
        got = run()
    finally:
        delattr(engine, target)
    assert got == want
    assert engine.steps.fault_steps >= calls["n"] // 2 > 0
    if trees:
        assert engine.steps.tree_steps > 0  # the steps that did not fail drafted trees
    metrics = httpx.get(server.url + "/v1/spec_decode/metrics", timeout=5).json()
    assert metrics["totals"]["fault_steps"] == engine.steps.fault_steps
    assert server.wait_idle()["sequences"] == 0


def _start_server_process(model_path):
    from mlx_lm_server.runtime.ports import free_ports

    port, = free_ports()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_lm_server.server", "--model", str(model_path),
         "--port", str(port), "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


@pytest.mark.parametrize("sig,phase", [(signal.SIGTERM, "decode"), (signal.SIGINT, "decode"),
                                       (signal.SIGTERM, "prefill")])
def test_signal_ends_streams_and_exits_zero(smollm2_path, sig, phase):
    """Every open stream gets an error event and [DONE]; the process exits 0 quickly,
    even when the inference thread is inside a long prefill step."""
    proc, url = _start_server_process(smollm2_path)
    try:
        if phase == "decode":
            prompts = ["Once upon a time"]
        else:
            prompts = [f"{i} " + "Repeat after me: the quick brown fox. " * 120 for i in range(8)]
        bodies = [{"model": smollm2_path.name, "prompt": p, "max_tokens": 2000,
                   "temperature": 0, "stream": True} for p in prompts]

        async def one(c, body, started):
            lines = []
            async with c.stream("POST", COMP, json=body) as r:
                started.set()
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        if phase == "decode" and len(lines) == 3:
                            os.kill(proc.pid, sig)
            return lines

        async def run():
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                events = [asyncio.Event() for _ in bodies]
                tasks = [asyncio.create_task(one(c, b, e)) for b, e in zip(bodies, events)]
                if phase == "prefill":
                    for e in events:
                        await e.wait()
                    await asyncio.sleep(1.0)
                    os.kill(proc.pid, sig)
                return await asyncio.gather(*tasks)

        start = time.monotonic()
        for lines in asyncio.run(asyncio.wait_for(run(), 90)):
            assert lines[-1] == "[DONE]"
            assert json.loads(lines[-2])["error"]["code"] == "shutting_down"
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - start < 30
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_health_turns_503_when_shutting_down(make_server):
    server = make_server()
    server.scheduler.shutdown()
    r = httpx.get(server.url + "/health", timeout=10)
    assert r.status_code == 503 and r.json()["status"] == "shutting_down"
    r = httpx.post(server.url + COMP, json={"model": server.model, "prompt": "x"}, timeout=10)
    _assert_error_object(r, 503)


def test_a_port_in_use_is_an_error_and_exit_1(smollm2_path):
    """A second server on a taken port says so and exits 1: before loading
    the model, and (the port taken between that check and uvicorn's bind)
    after it, without the abort that interpreter teardown under MLX's
    threads gives."""
    import socket

    taken = socket.create_server(("127.0.0.1", 0))
    port = str(taken.getsockname()[1])
    argv = ["--model", str(smollm2_path), "--port", port, "--log-level", "info"]
    try:
        early = subprocess.run([sys.executable, "-m", "mlx_lm_server.server", *argv],
                               capture_output=True, text=True, timeout=120)
        assert early.returncode == 1, early.stderr
        assert f"cannot listen on 127.0.0.1:{port}" in early.stderr
        assert "loading" not in early.stderr
        # The check passes (as if the port were taken just after it): uvicorn's bind fails.
        late = subprocess.run(
            [sys.executable, "-c", "import sys; import mlx_lm_server.server as s; "
             "s.cannot_listen = lambda host, port: None; sys.exit(s.main(sys.argv[1:]))", *argv],
            capture_output=True, text=True, timeout=300)
        assert late.returncode == 1, late.stderr[-2000:]
        assert "loading" in late.stderr and "address already in use" in late.stderr.lower()
        assert "terminate called" not in late.stderr
    finally:
        taken.close()


def test_cli_help_and_bad_flags():
    out = subprocess.run([sys.executable, "-m", "mlx_lm_server.server", "--help"],
                         capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ("--model", "--max-batch-size", "--prefill-step-size", "--max-queued-requests"):
        assert flag in out.stdout
    bad = subprocess.run([sys.executable, "-m", "mlx_lm_server.server", "--model", "/nonexistent"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "mlx-lm-server-models fetch" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "mlx_lm_server.server", "--model", ".",
                          "--max-batch-size", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--max-batch-size" in bad.stderr


def test_the_queue_limit_is_exact(smollm2):
    """Q waiting requests are taken and the next is refused, counted before
    any of them can start (the inference thread is not running)."""
    from mlx_lm_server.assembly import make_scheduler
    from mlx_lm_server.serving.request import GenerationRequest, QueueFullError

    model, tokenizer = smollm2
    s = make_scheduler(model, tokenizer, max_queued_requests=5)

    async def submit_all():
        taken, refused = 0, 0
        for _ in range(25):
            try:
                s.submit(GenerationRequest([1, 2, 3], 4))
                taken += 1
            except QueueFullError:
                refused += 1
        return taken, refused

    assert asyncio.run(submit_all()) == (5, 20)


def test_the_batch_cap_holds_while_saturated(make_server):
    """What /health reports while 12 long requests compete for 4 slots."""
    server = make_server(max_batch_size=4)
    body = {"model": server.model, "prompt": "Count from one to one hundred in words:",
            "max_tokens": 48, "temperature": 0,
            "logit_bias": {str(t): -100 for t in server.tokenizer.eos_token_ids}}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            jobs = asyncio.gather(*[c.post(COMP, json=body) for _ in range(12)])
            seen = []
            while not jobs.done():
                seen.append((await c.get("/health")).json()["batch"]["decoding"])
                await asyncio.sleep(0.05)
            return seen, await jobs

    seen, responses = asyncio.run(run())
    assert all(r.status_code == 200 for r in responses)
    assert max(seen) == 4, seen


# A lone UTF-16 surrogate: valid JSON (JavaScript strings can hold one), but
# no Unicode text, and no tokenizer or chat template takes it.
LONE = "\ud800 broken"


def _lone_surrogate_cases(model):
    chat = {"model": model, "messages": _msgs(), "max_tokens": 2}
    comp = {"model": model, "prompt": "hi", "max_tokens": 2}
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "description": LONE}}}}}
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": LONE}}]}]
    schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"enum": [LONE]}}}
    return [
        (CHAT, {**chat, "messages": _msgs(LONE)}, "messages.0.content"),
        (CHAT, {**chat, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi"}, {"type": "text", "text": LONE}]}]},
         "messages.0.content.1.text"),
        (CHAT, {**chat, "messages": [{"role": "user", "content": "hi", "name": LONE}]},
         "messages.0.name"),
        (CHAT, {**chat, "messages": history}, "messages.1.tool_calls.0.function.arguments"),
        (CHAT, {**chat, "tools": [tool]},
         "tools.0.function.parameters.properties.city.description"),
        (CHAT, {**chat, "tools": [{"type": "function", "function": {"name": LONE}}]},
         "tools.0.function.name"),
        (CHAT, {**chat, "response_format": schema}, "response_format.json_schema.schema.enum.0"),
        (CHAT, {**chat, "chat_template_kwargs": {"persona": LONE}}, "chat_template_kwargs.persona"),
        (CHAT, {**chat, "chat_template_kwargs": {LONE: True}}, "chat_template_kwargs"),
        (CHAT, {**chat, "stop": ["ok", LONE]}, "stop.1"),
        (CHAT, {**chat, "model": LONE}, "model"),
        (COMP, {**comp, "prompt": LONE}, "prompt"),
        (COMP, {**comp, "prompt": [LONE]}, "prompt.0"),
        (COMP, {**comp, "stop": LONE}, "stop"),
        (COMP, {**comp, "logit_bias": {LONE: 1}}, "logit_bias"),
        # Echoed back in the response, never tokenized: it failed to encode (a 500).
        (RESP, {"model": model, "input": "hi", "metadata": {"tag": LONE}}, "metadata.tag"),
    ]


def test_text_with_a_lone_surrogate_is_a_400_naming_the_field(live_server):
    """Every string that reaches the tokenizer or the chat template, or is
    echoed back, on every route, streamed or not: a 400 whose ``param`` is
    the field (it was a TypeError inside the tokenizer, and a 500)."""
    for path, body, param in _lone_surrogate_cases(live_server.model):
        for stream in (False, True):
            # json.dumps escapes the surrogate as \ud800, as a JavaScript client does.
            r = httpx.post(live_server.url + path, content=json.dumps({**body, "stream": stream}),
                           headers={"content-type": "application/json"}, timeout=30)
            assert not r.headers["content-type"].startswith("text/event-stream"), param
            _assert_error_object(r, 400)
            assert r.json()["error"]["param"] == param, (r.json(), stream)
            assert "surrogate" in r.json()["error"]["message"]
    # A surrogate pair is one whole character, and served.
    r = httpx.post(live_server.url + COMP, content=json.dumps(
        {"model": live_server.model, "prompt": "\ud83d\ude00 fine", "max_tokens": 2}),
        headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_lone_surrogate_in_a_key_that_fails_validation_is_a_400(live_server):
    """The error names the key; the reply stays JSON that encodes."""
    r = httpx.post(live_server.url + COMP, content=json.dumps(
        {"model": live_server.model, "prompt": "hi", "logit_bias": {LONE: "much"}}),
        headers={"content-type": "application/json"}, timeout=30)
    _assert_error_object(r, 400)
    assert r.json()["error"]["param"].startswith("logit_bias.")


def test_health_says_starting_until_speculation_is_calibrated(smollm2_path):
    """Speculation's start-up calibration runs on the inference thread before
    any step: /health answers 503 ``starting`` until it ends (a client that
    waits for 200 does not send its first request into seconds of
    calibration), then 200 ``ok``."""
    import threading

    from fastapi.testclient import TestClient

    from mlx_lm_server.assembly import load_service
    from mlx_lm_server.config import ServerConfig
    from mlx_lm_server.http.routes import create_app
    from mlx_lm_server.spec_decode.config import SpecDecodeConfig

    service = load_service(ServerConfig(model=str(smollm2_path),
                                        spec=SpecDecodeConfig(mode="ngram")))
    scheduler, calibrating, release = service.scheduler, threading.Event(), threading.Event()

    def calibrate(max_batch_size):
        calibrating.set()
        release.wait(30)

    scheduler.engine.calibrate = calibrate
    scheduler.start()
    try:
        with TestClient(create_app(service)) as http:
            assert calibrating.wait(30)
            r = http.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "starting"
            release.set()
            deadline = time.monotonic() + 30
            while (r := http.get("/health")).status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert r.status_code == 200 and r.json()["status"] == "ok"
    finally:
        release.set()
        scheduler.shutdown()
        scheduler.join(10)
