"""Several models in one server (``http/model_set.py``, ``serving/device_loop.py``):
chosen by each request's ``model``, loaded on demand, at most
``--max-loaded-models`` at once (the least recently used idle one unloaded),
unloaded after ``--keep-alive`` idle seconds, all stepped by one inference
thread; each answers as it would alone."""

import asyncio
import json
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import httpx
import mlx.core as mx
import pytest
from tiny_models import build

from mlx_lm_server.cli import build_parser, config_from_args
from mlx_lm_server.config import ServerConfig, read_models_file


class LiveSet:
    """A server over a set of models, on a loopback port, in-process."""

    def __init__(self, config: ServerConfig):
        from conftest import wait_ready

        from mlx_lm_server.assembly import load_service_in_steps
        from mlx_lm_server.http.model_set import ModelSet
        from mlx_lm_server.http.routes import create_app
        from mlx_lm_server.runtime.ports import free_ports
        from mlx_lm_server.server import make_uvicorn_server

        port, = free_ports()
        self.config = config = ServerConfig(**{**config.__dict__, "port": port,
                                               "log_level": "warning"})
        self.models = ModelSet(config, load_service_in_steps)
        self.models.start()
        self.server = make_uvicorn_server(create_app(self.models), config, self.models.shutdown)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{port}"
        wait_ready(self.url)

    def loaded(self) -> dict:
        data = httpx.get(self.url + "/v1/models", timeout=5).json()["data"]
        return {m["id"]: m["loaded"] for m in data}

    def complete(self, model: str, prompt: str, max_tokens: int = 8) -> dict:
        r = httpx.post(self.url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    def close(self) -> None:
        from conftest import forget_fastapi_endpoints

        self.server.should_exit = True
        self.thread.join(10)
        self.models.shutdown()
        self.models.join(10)
        forget_fastapi_endpoints()


def _greedy_text(model, tokenizer, prompt: str, n: int) -> str:
    tokens = tokenizer.encode(prompt)
    start = len(tokens)
    for _ in range(n):
        tokens.append(model(mx.array([tokens]))[0, -1].argmax().item())
    return tokenizer.decode(tokens[start:])


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, smollm2_path):
    return build("qwen3_5", tmp_path_factory.mktemp("set-tiny") / "tiny-qwen3_5", smollm2_path,
                 scale=2.0, seed=3)


@pytest.fixture(scope="module")
def model_set(smollm2_path, qwen05_path, tiny_path):
    config = ServerConfig(model=str(smollm2_path), models=(
        ServerConfig(model=str(qwen05_path), aliases=("coder",)),
        ServerConfig(model=str(tiny_path))), max_loaded_models=2)
    server = LiveSet(config)
    yield server
    server.close()


def test_each_model_answers_as_it_would_alone(model_set, smollm2):
    """Greedy completions from SmolLM2 (the default, loaded at start) and
    Qwen2.5-Coder-0.5B (loaded by its first request, by its alias, while
    SmolLM2 streams: its load goes in steps between SmolLM2's, whose stream
    never waits for the whole load): each the model's own tokens; /v1/models
    lists all three with what is loaded."""
    assert model_set.loaded() == {"smollm2-135m-instruct": True,
                                  "qwen2.5-coder-0.5b-instruct": False, "tiny-qwen3_5": False}

    async def stream(arrivals, done):
        async with httpx.AsyncClient(timeout=120) as client:
            async with client.stream("POST", model_set.url + "/v1/completions", json={
                    "model": "smollm2-135m-instruct", "prompt": "Once upon a time",
                    "max_tokens": 400, "temperature": 0, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.monotonic())
                    if done.is_set():  # leaving cancels the request
                        return

    async def main():
        arrivals, done = [], asyncio.Event()
        streaming = asyncio.create_task(stream(arrivals, done))
        while len(arrivals) < 3:
            await asyncio.sleep(0.01)
        tic = time.monotonic()
        coder = await asyncio.to_thread(model_set.complete, "coder", "def fibonacci(n):")
        loaded_in = time.monotonic() - tic
        done.set()
        await streaming
        during = [b - a for a, b in zip(arrivals, arrivals[1:]) if tic <= a <= tic + loaded_in]
        return coder, loaded_in, during

    coder, loaded_in, gaps = asyncio.run(main())
    assert gaps and max(gaps) < 0.6 * loaded_in, (loaded_in, max(gaps, default=None))
    assert coder["model"] == "qwen2.5-coder-0.5b-instruct"
    small = model_set.complete("smollm2-135m-instruct", "The capital of France is")
    assert small["choices"][0]["text"] == _greedy_text(*smollm2, "The capital of France is", 8)
    # The loaded model's own plain forwards (the server is idle now): the
    # argmax loop, not the engine.
    served = model_set.models.services["qwen2.5-coder-0.5b-instruct"]
    qwen = (served.scheduler.batch.model, served.tokenizer)
    assert coder["choices"][0]["text"] == _greedy_text(*qwen, "def fibonacci(n):", 8)
    assert model_set.loaded()["qwen2.5-coder-0.5b-instruct"] is True
    default = httpx.post(model_set.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "model": "smollm2-135m-instruct"}).json()
    assert default["model"] == "smollm2-135m-instruct"
    anthropic = httpx.post(model_set.url + "/v1/messages", timeout=60, json={
        "model": "coder", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert anthropic.status_code == 200 and anthropic.json()["model"] == \
        "qwen2.5-coder-0.5b-instruct", anthropic.text
    page = httpx.get(model_set.url + "/metrics", timeout=10).text
    assert page.count("# TYPE generation_tokens_total counter") == 1
    for name in ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"):
        series = [line for line in page.splitlines()
                  if line.startswith(f'generation_tokens_total{{model="{name}"}}')]
        assert len(series) == 1 and float(series[0].split()[-1]) > 0, (name, series)


def test_an_unknown_model_is_a_404_naming_the_served_ones(model_set):
    r = httpx.post(model_set.url + "/v1/completions", timeout=10, json={
        "model": "../../etc/passwd", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and "'tiny-qwen3_5'" in error["message"]
    assert httpx.get(model_set.url + "/v1/models/nope", timeout=5).status_code == 404


def test_a_third_model_loads_while_another_streams_and_the_idle_one_makes_room(model_set):
    """SmolLM2 streams 48 tokens; meanwhile the tiny model is asked for:
    with two loaded, the idle one (Qwen) is unloaded, the tiny one loads and
    answers, the stream finishes whole. Asked for again, Qwen reloads in
    place of the least recently used (the tiny one: SmolLM2 streamed after
    its answer) and answers as before."""
    before = model_set.complete("coder", "def add(a, b):")

    async def stream():
        async with httpx.AsyncClient(timeout=120) as client:
            async with client.stream("POST", model_set.url + "/v1/completions", json={
                    "model": "smollm2-135m-instruct", "prompt": "Once upon a time",
                    "max_tokens": 48, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}) as r:
                usage = None
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        usage = json.loads(line[6:]).get("usage") or usage
                return usage

    async def main():
        streaming = asyncio.create_task(stream())
        await asyncio.sleep(0.5)
        tiny = await asyncio.to_thread(model_set.complete, "tiny-qwen3_5", "hello there", 6)
        return await streaming, tiny

    usage, tiny = asyncio.run(main())
    assert usage["completion_tokens"] == 48
    assert tiny["usage"]["completion_tokens"] == 6
    assert model_set.loaded() == {"smollm2-135m-instruct": True,
                                  "qwen2.5-coder-0.5b-instruct": False, "tiny-qwen3_5": True}
    time.sleep(1.1)  # past the grace for a model just asked for
    again = model_set.complete("coder", "def add(a, b):")
    assert again["choices"][0]["text"] == before["choices"][0]["text"]
    assert model_set.loaded() == {"smollm2-135m-instruct": True,
                                  "qwen2.5-coder-0.5b-instruct": True, "tiny-qwen3_5": False}


def test_an_idle_model_unloads_after_keep_alive(tiny_path, tmp_path, smollm2_path):
    other = build("qwen3_5", tmp_path / "other-tiny", smollm2_path, scale=2.0, seed=4)
    server = LiveSet(ServerConfig(model=str(tiny_path), models=(ServerConfig(model=str(other)),),
                                  keep_alive=1.0))
    try:
        first = server.complete("other-tiny", "one two", 4)
        assert server.loaded()["other-tiny"] is True
        deadline = time.monotonic() + 10
        while any(server.loaded().values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.loaded() == {"tiny-qwen3_5": False, "other-tiny": False}
        health = httpx.get(server.url + "/health", timeout=5).json()
        assert health["status"] == "ok" and health["loaded"] is False
        assert server.complete("other-tiny", "one two", 4)["choices"] == first["choices"]
    finally:
        server.close()


def test_a_streaming_model_is_not_unloaded_to_make_room(smollm2_path, tiny_path):
    """Room for one model: while SmolLM2 streams (past the grace for a model
    just asked for), a request for the tiny model is a 503 ``models_busy``
    and the stream goes on; once the stream has ended, the tiny model loads
    in SmolLM2's place."""
    server = LiveSet(ServerConfig(model=str(smollm2_path), max_loaded_models=1,
                                  models=(ServerConfig(model=str(tiny_path)),)))

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            async with client.stream("POST", server.url + "/v1/completions", json={
                    "model": "smollm2-135m-instruct", "prompt": "Once upon a time",
                    "max_tokens": 400, "temperature": 0, "stream": True}) as r:
                lines, before, after = r.aiter_lines(), 0, 0
                tic = time.monotonic()
                async for line in lines:
                    before += line.startswith("data: {")
                    if before and time.monotonic() - tic > 1.2:
                        break
                refused = await client.post(server.url + "/v1/completions", json={
                    "model": "tiny-qwen3_5", "prompt": "x", "max_tokens": 2})
                async for line in lines:
                    assert '"error"' not in line, line
                    after += line.startswith("data: {")
                    if after == 3:
                        break
                return refused, server.loaded()  # leaving ends the stream

    try:
        refused, loaded = asyncio.run(main())
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "models_busy"
        assert loaded == {"smollm2-135m-instruct": True, "tiny-qwen3_5": False}
        deadline = time.monotonic() + 30
        while True:  # the cancelled stream leaves at SmolLM2's next step
            r = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": "tiny-qwen3_5", "prompt": "one two", "max_tokens": 3})
            if r.status_code != 503 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 200, r.text
        assert server.loaded() == {"smollm2-135m-instruct": False, "tiny-qwen3_5": True}
    finally:
        server.close()


class _Scheduler:
    """A loaded model's scheduler as the model set and its loop see it: the
    test sets how many requests it has (one at first: a model loads for a
    request); a step with requests takes ``step_s`` and, as the real one,
    marks its end as the model's last activity."""

    def __init__(self, step_s: float):
        self.step_s, self.requests, self.stopped = step_s, 1, False
        self.last_active = time.monotonic()

    @property
    def idle(self) -> bool:
        return not self.requests

    @property
    def has_sequences(self) -> bool:
        return bool(self.requests)

    def attach(self, wake) -> None:
        pass

    def begin(self) -> bool:
        return True

    def tick(self, block: bool = False) -> bool:
        if self.requests:
            time.sleep(self.step_s)
            self.last_active = time.monotonic()
        return True

    def end(self) -> None:
        pass

    def shutdown(self) -> None:
        self.stopped = True


def _stand_in_set(tmp_path, names, step_s: float, stages: int = 1, **settings):
    """A model set over stand-in models (no weights), started; each loads
    in ``stages`` rounds of the loop."""
    from mlx_lm_server.http.model_set import ModelSet

    def load(config):
        for _ in range(stages):
            yield
        return SimpleNamespace(config=config, scheduler=_Scheduler(step_s))

    first, *others = [ServerConfig(model=str(tmp_path / n), max_kv_memory=1 << 20)
                      for n in names]
    models = ModelSet(replace(first, models=tuple(others), models_memory=1 << 30, **settings),
                      load)
    models.start()
    return models


def _service(models, name: str):
    return asyncio.run(asyncio.wait_for(models.service(name), 10))


def test_a_busy_model_is_never_unloaded_to_make_room(tmp_path, monkeypatch):
    """Two loaded models with requests (no grace for one just asked for): a
    third model's request is a 503 ``models_busy`` and neither is stopped;
    once one is idle, it makes the room."""
    from mlx_lm_server.http import model_set
    from mlx_lm_server.http.api_error import APIError

    monkeypatch.setattr(model_set, "RECENT_S", 0.0)
    models = _stand_in_set(tmp_path, ["a", "b", "c"], step_s=0.005)
    try:
        a, b = _service(models, "a"), _service(models, "b")
        with pytest.raises(APIError) as refused:
            _service(models, "c")
        assert refused.value.status == 503 and refused.value.code == "models_busy"
        assert set(models.services) == {"a", "b"}
        assert not a.scheduler.stopped and not b.scheduler.stopped
        b.scheduler.requests = 0
        _service(models, "c")
        assert set(models.services) == {"a", "c"} and b.scheduler.stopped
    finally:
        models.join(5)


def test_a_busy_model_outlives_keep_alive_beside_a_long_step(tmp_path):
    """--keep-alive 0.1 s, two models with requests whose steps take 0.3 s:
    each waits longer than that for its next step, yet neither is unloaded;
    once idle, both are."""
    models = _stand_in_set(tmp_path, ["a", "b"], step_s=0.3, keep_alive=0.1)
    try:
        a, b = models.services["a"], _service(models, "b")
        time.sleep(1.5)
        assert set(models.services) == {"a", "b"}
        assert not a.scheduler.stopped and not b.scheduler.stopped
        a.scheduler.requests = b.scheduler.requests = 0
        deadline = time.monotonic() + 5
        while models.services and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not models.services and a.scheduler.stopped and b.scheduler.stopped
    finally:
        models.join(5)


def test_a_model_being_loaded_takes_its_room(tmp_path, monkeypatch):
    """Room for two, the default busy, two other models asked for at once:
    the first loads (over many rounds) and the second is a 503
    ``models_busy``, never a third model loaded past --max-loaded-models."""
    from mlx_lm_server.http import model_set
    from mlx_lm_server.http.api_error import APIError

    monkeypatch.setattr(model_set, "RECENT_S", 0.0)
    models = _stand_in_set(tmp_path, ["a", "b", "c"], step_s=0.005, stages=20)

    async def both():
        return await asyncio.gather(models.service("b"), models.service("c"),
                                    return_exceptions=True)

    try:
        b, c = asyncio.run(asyncio.wait_for(both(), 10))
        assert isinstance(b, SimpleNamespace), b
        assert isinstance(c, APIError) and c.code == "models_busy", c
        assert set(models.services) == {"a", "b"}
    finally:
        models.join(5)


def test_models_come_from_the_command_line_and_a_models_file(tmp_path):
    toml = tmp_path / "models.toml"
    toml.write_text('[[model]]\npath = "models/b"\nname = "chat"\naliases = ["gpt-4o-mini"]\n'
                    'spec_decode = "suffix"\ntemperature = 0.2\n\n'
                    '[[model]]\npath = "models/c"\nkv_bits = 8\n')
    args = build_parser().parse_args(["--model", "models/a", "--model", "models/x",
                                      "--models-file", str(toml), "--spec-decode", "ngram",
                                      "--max-loaded-models", "3", "--keep-alive", "300"])
    config = config_from_args(args)
    assert [m.model_id for m in config.all_models] == ["a", "x", "chat", "c"]
    chat = config.models[1]
    assert chat.aliases == ("gpt-4o-mini",) and chat.spec.mode == "suffix"
    assert chat.sampling_defaults.temperature == 0.2
    assert config.models[2].kv_bits == 8 and config.models[2].spec.mode == "ngram"
    assert config.max_loaded_models == 3 and config.keep_alive == 300
    bad = tmp_path / "bad.toml"
    bad.write_text('[[model]]\npath = "m"\nmodel_path = "oops"\n')
    with pytest.raises(ValueError, match="unknown keys model_path"):
        read_models_file(str(bad), ServerConfig(model="a"))
    twice = tmp_path / "twice.json"
    twice.write_text(json.dumps([{"path": "models/z", "name": "a"}]))
    with pytest.raises(ValueError, match="two models are served as 'a'"):
        config_from_args(build_parser().parse_args(["--model", "models/a",
                                                    "--models-file", str(twice)]))


def test_a_memory_bound_unloads_to_fit_and_refuses_what_never_fits(tiny_path, tmp_path,
                                                                   smollm2_path):
    """--models-memory fitting two of three tiny models (the model count
    allows three): loading the third unloads the least recently used; a
    model larger than the bound is a 503 naming its size, and the loaded
    ones keep answering."""
    from mlx_lm_server.http.model_set import footprint

    b = build("qwen3_5", tmp_path / "tiny-b", smollm2_path, scale=2.0, seed=5)
    c = build("qwen3_5", tmp_path / "tiny-c", smollm2_path, scale=2.0, seed=6)
    kv = 1 << 20
    size = footprint(ServerConfig(model=str(tiny_path), max_kv_memory=kv))
    assert size > 2 << 20
    server = LiveSet(ServerConfig(
        model=str(tiny_path), max_kv_memory=kv,
        models=(ServerConfig(model=str(b), max_kv_memory=kv),
                ServerConfig(model=str(c), max_kv_memory=kv),
                ServerConfig(model=str(smollm2_path), max_kv_memory=kv)),
        max_loaded_models=3, models_memory=int(2.5 * size)))
    try:
        server.complete("tiny-b", "one two", 3)
        time.sleep(1.1)  # past the grace for a model just asked for
        server.complete("tiny-c", "one two", 3)
        assert server.loaded() == {"tiny-qwen3_5": False, "tiny-b": True, "tiny-c": True,
                                   "smollm2-135m-instruct": False}
        r = httpx.post(server.url + "/v1/completions", timeout=30, json={
            "model": "smollm2-135m-instruct", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "model_does_not_fit" and "--models-memory" in error["message"]
        assert server.complete("tiny-b", "one two", 3)["usage"]["completion_tokens"] == 3
        assert server.loaded()["tiny-c"] is True
    finally:
        server.close()


def test_every_model_gets_its_share_of_the_memory_less_its_weights(tiny_path, smollm2_path):
    """Without max_kv_memory of its own, a model of a set gets the budget /
    --max-loaded-models less its weights as its KV budget, so the loaded
    models' reservations never add up past the budget; weights that fill
    their share are a start-up error naming the model."""
    from mlx_lm_server.assembly import load_service_in_steps
    from mlx_lm_server.http.api_error import APIError
    from mlx_lm_server.http.model_set import ModelSet, footprint

    smol = footprint(ServerConfig(model=str(smollm2_path)))
    limit = 4 * smol
    own = 5 << 20
    models = ModelSet(ServerConfig(model=str(smollm2_path), models_memory=limit,
                                   models=(ServerConfig(model=str(tiny_path),
                                                        max_kv_memory=own),)),
                      load_service_in_steps)
    budgets = {n: c.max_kv_memory for n, c in models.configs.items()}
    assert budgets == {"smollm2-135m-instruct": limit // 2 - smol, "tiny-qwen3_5": own}
    assert sum(footprint(c) for c in models.configs.values()) <= limit
    tight = dict(models_memory=2 * smol + (32 << 20), max_loaded_models=2)
    models = ModelSet(ServerConfig(model=str(tiny_path), **tight,
                                   models=(ServerConfig(model=str(smollm2_path)),)),
                      load_service_in_steps)
    with pytest.raises(APIError, match="'smollm2-135m-instruct': its weights") as refused:
        asyncio.run(asyncio.wait_for(models.service("smollm2-135m-instruct"), 10))
    assert refused.value.status == 503 and refused.value.code == "model_does_not_fit"
    with pytest.raises(ValueError, match="'smollm2-135m-instruct': its weights"):
        ModelSet(ServerConfig(model=str(smollm2_path), **tight,
                              models=(ServerConfig(model=str(tiny_path)),)),
                 load_service_in_steps)


def test_allow_any_model_loads_a_hub_id_from_the_cache_and_never_a_path(
        tiny_path, tmp_path, monkeypatch):
    """--allow-any-model: a request naming a repo id in the Hugging Face hub
    cache loads it (the same weights answer as the served model does); an id
    that is nowhere is a 404 saying where it looked; a path, climbing or
    not, is a 404 as any name outside the set is."""
    import shutil

    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny-any"
    shutil.copytree(tiny_path, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    server = LiveSet(ServerConfig(model=str(tiny_path), allow_any_model=True))
    try:
        served = server.complete("tiny-qwen3_5", "one two", 5)
        named = server.complete("acme/tiny-any", "one two", 5)
        assert named["model"] == "acme/tiny-any"
        assert named["choices"][0]["text"] == served["choices"][0]["text"]
        assert server.loaded() == {"tiny-qwen3_5": True, "acme/tiny-any": True}
        for name in ("acme/nowhere", "../tiny-qwen3_5", str(repo / "snapshots" / commit),
                     "acme/../../etc",
                     "~/models/x"):
            r = httpx.post(server.url + "/v1/completions", timeout=30, json={
                "model": name, "prompt": "x", "max_tokens": 2})
            assert r.status_code == 404, (name, r.text)
            assert r.json()["error"]["code"] == "model_not_found"
        from mlx_lm_server.models.source import is_repo_id

        # Never a path even before the hub is asked (it refuses them too).
        assert not any(is_repo_id(p) for p in ("acme/../../etc", "acme/..", "acme/.",
                                                 "../acme", "/acme/x", "~/acme"))
        missing = httpx.post(server.url + "/v1/completions", timeout=30, json={
            "model": "acme/nowhere", "prompt": "x", "max_tokens": 2}).json()["error"]
        assert "hub cache" in missing["message"], missing
        assert set(server.loaded()) == {"tiny-qwen3_5", "acme/tiny-any"}
    finally:
        server.close()


async def _streams(url: str, model: str, clients: int, until: float, max_tokens: int) -> list:
    """``clients`` streams back to back until ``until``: for each stream its
    finish reason and the gaps between its tokens' arrivals."""
    done = []

    async def client(c: int):
        n = 0
        async with httpx.AsyncClient(timeout=300) as http:
            while time.monotonic() < until:
                body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                        "stream": True, "messages": [{"role": "user", "content":
                                                      f"Story {c}-{n}: tell me about a fox."}]}
                n += 1
                arrivals, finish = [], None
                async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200, await r.aread()
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        choice = json.loads(line[6:])["choices"][0]
                        if choice["delta"].get("content"):
                            arrivals.append(time.monotonic())
                        finish = choice.get("finish_reason") or finish
                done.append((finish, [b - a for a, b in zip(arrivals, arrivals[1:])]))

    await asyncio.gather(*(client(c) for c in range(clients)))
    return done


@pytest.mark.slow
def test_two_models_under_load_share_the_device(smollm2_path, qwen05_path):
    """Eight streaming clients on each of two models for five minutes: every
    stream finishes, neither model's median inter-token latency passes 2.5x
    its own with the other idle, and the process stays within the models'
    memory budget."""
    import statistics

    server = LiveSet(ServerConfig(model=str(smollm2_path),
                                  models=(ServerConfig(model=str(qwen05_path)),)))
    names = list(server.models.configs)
    try:
        server.complete(names[1], "warm up", 2)
        alone = {}
        for name in names:
            runs = asyncio.run(_streams(server.url, name, 8, time.monotonic() + 30, 48))
            alone[name] = statistics.median(g for _, gaps in runs for g in gaps)

        async def together():
            until = time.monotonic() + 300
            return await asyncio.gather(*(_streams(server.url, n, 8, until, 48) for n in names))

        for name, runs in zip(names, asyncio.run(together())):
            assert runs and all(finish in ("stop", "length") for finish, _ in runs), name
            shared = statistics.median(g for _, gaps in runs for g in gaps)
            print(f"{name}: {len(runs)} streams, median ITL {1000 * shared:.0f} ms together, "
                  f"{1000 * alone[name]:.0f} ms alone ({shared / alone[name]:.2f}x)")
            assert shared <= 2.5 * alone[name], (name, shared, alone[name])
        peak = httpx.get(server.url + "/health", timeout=5).json()["memory"]["peak"]
        assert peak <= server.models.limit, (peak, server.models.limit)
    finally:
        server.close()


class _Busy:
    """A scheduler stand-in whose every step takes ``seconds``: the loop's
    sharing policy on its own, with step times no model here gives exactly."""

    def __init__(self, seconds: float, busy: bool = True):
        self.seconds, self.has_sequences, self.steps = seconds, busy, 0

    def tick(self, block: bool = False) -> bool:
        if self.has_sequences:
            time.sleep(self.seconds)
            self.steps += 1
        return True


def test_the_loop_shares_the_device_time_not_the_steps():
    """A model whose steps take 3x longer gets a third of the steps: both get
    the same time; one that starts working later is placed level with the
    others rather than given the time it did not use."""
    from mlx_lm_server.serving.device_loop import DeviceLoop

    loop = DeviceLoop()
    fast, slow, late = _Busy(0.002), _Busy(0.006), _Busy(0.002, busy=False)
    loop.schedulers = {"fast": fast, "slow": slow, "late": late}
    loop.used = {"fast": 0.0, "slow": 0.0, "late": 0.0}
    for _ in range(200):
        loop._turn()
    # Sleeps overshoot under load, so the ratio of steps is 3 only roughly;
    # a loop sharing steps instead of time gives 1.
    assert fast.steps > 2 * slow.steps, (fast.steps, slow.steps)
    assert abs(loop.used["fast"] - loop.used["slow"]) < 0.15 * loop.used["slow"], loop.used
    late.has_sequences = True
    before = {n: s.steps for n, s in loop.schedulers.items()}
    for _ in range(60):
        loop._turn()
    gained = {n: s.steps - before[n] for n, s in loop.schedulers.items()}
    assert gained["late"] < 2.5 * gained["fast"], gained  # no catching up on the past
    assert gained["slow"] > 5, gained
