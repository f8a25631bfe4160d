"""Shared fixtures: real converted models, a tiny qwen3, and the fast BLAS;
each test's tier marker, from its folder.

The whole suite runs with OpenBLAS preloaded, as the server does (see
``mlx_lm_server/pytest_plugin.py``).
"""

import json
from pathlib import Path

import pytest


# The tests by what they need, one folder and one marker each (set here from
# the folder; declared in pyproject.toml). `scripts/test.sh quick` runs
# `-m "pure or tiny"`, the inner loop; the default run is all of them.
TIERS = ("pure", "tiny", "model", "server", "processes")
HERE = Path(__file__).resolve().parent


def pytest_addoption(parser):
    parser.addoption(
        "--run-slow", action="store_true", default=False, help="also run tests marked slow"
    )


def tier(path: Path) -> str:
    """The tier of the test file at ``path``: the folder under tests/ it is in."""
    parts = path.resolve().relative_to(HERE).parts
    if len(parts) < 2 or parts[0] not in TIERS:
        raise pytest.UsageError(f"{path}: a test file belongs in one of the folders "
                                f"tests/{{{','.join(TIERS)}}}/ (docs/testing.md)")
    return parts[0]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the markers set here
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(getattr(pytest.mark, tier(item.path)))
    if config.getoption("--run-slow") or "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow: pass --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def _fetch(name: str) -> Path:
    from mlx_lm_server.models.store import fetch

    return fetch(name)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return _fetch("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def qwen05_path() -> Path:
    return _fetch("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="session")
def qwen15_path() -> Path:
    return _fetch("qwen2.5-coder-1.5b-instruct")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    from mlx_lm import load

    return load(str(smollm2_path))


@pytest.fixture(scope="session")
def grammar_tokenizer(smollm2):
    """SmolLM2's tokenizer for grammars (structured output), built once."""
    from mlx_lm_server.decoding.structured import GrammarTokenizer, logits_width

    model, tokenizer = smollm2
    return GrammarTokenizer(tokenizer, logits_width(model, tokenizer))


@pytest.fixture(scope="session")
def qwen05(qwen05_path):
    from mlx_lm import load

    return load(str(qwen05_path))


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory, smollm2_path) -> Path:
    """A random-weight qwen3 built with mlx-lm's own model class.

    It borrows SmolLM2's real tokenizer so text round-trips; only the weights
    are random. Later tests use it to exercise qwen3-specific code paths (q/k
    norms, explicit head_dim) that the GGUF models do not have.
    """
    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), smollm2_path)


def write_tiny_qwen3(folder: Path, smollm2_path: Path, vocab: int = 49152) -> Path:
    """``tiny_qwen3_path``'s model in ``folder``, over the tokenizer's first
    ``vocab`` tokens (distribution tests: see ``tiny_models.with_vocab``)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    config = {
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "eos_token_id": [2, 0],
    }
    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((smollm2_path / name).read_bytes())
    return folder


class LiveServer:
    """A real server on a loopback port, run in-process so tests can observe it."""

    def __init__(self, model_path: Path, wrap=None, **overrides):
        """``wrap``: an ASGI middleware class around the app (to observe
        every request the server answers)."""
        import threading

        from mlx_lm_server.assembly import load_service
        from mlx_lm_server.config import ServerConfig
        from mlx_lm_server.http.routes import create_app
        from mlx_lm_server.runtime.ports import free_ports
        from mlx_lm_server.server import make_uvicorn_server

        port, = free_ports()
        self.config = ServerConfig(model=str(model_path), port=port, log_level="warning", **overrides)
        self.service = load_service(self.config)
        self.scheduler = self.service.scheduler
        self.scheduler.start()
        app = create_app(self.service)
        if wrap is not None:
            app = wrap(app)
        self.server = make_uvicorn_server(app, self.config, self.scheduler.shutdown)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{port}"
        self.model = self.config.model_id
        self.tokenizer = self.service.tokenizer
        self._wait_ready()

    def _wait_ready(self, timeout: float = 60.0) -> None:
        wait_ready(self.url, timeout)

    def health(self) -> dict:
        import httpx

        return httpx.get(self.url + "/health", timeout=5).json()

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Wait until no sequence is left anywhere; return the last health report."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if h["sequences"] == 0 and h["queued"] == 0 and not any(h["batch"].values()):
                return h
            if time.monotonic() > deadline:
                return h
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.scheduler.shutdown()
        self.scheduler.join(10)
        forget_fastapi_endpoints()


def wait_ready(url: str, timeout: float = 60.0) -> None:
    """Until ``url``'s /health answers 200."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError("server did not start")


def forget_fastapi_endpoints() -> None:
    """FastAPI's dependency code memoises facts about endpoint functions in
    module-level LRU caches (4,096 entries each), which keep every app's
    endpoint closures, and through them its service, scheduler and model,
    alive after the app is gone. A server makes one app and never notices;
    this suite makes dozens, and its process grew by each one's model (to a
    23 GB peak)."""
    from fastapi.dependencies import models

    for value in vars(models).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


@pytest.fixture(autouse=True, scope="module")
def _forget_apps_after_each_module():
    """Apps a module made outside ``LiveServer`` (a TestClient over
    ``create_app``) go too."""
    yield
    forget_fastapi_endpoints()


@pytest.fixture(scope="session")
def live_server(smollm2_path):
    server = LiveServer(smollm2_path, max_batch_size=32, max_queued_requests=256)
    yield server
    server.close()


@pytest.fixture
def make_server(smollm2_path):
    """Start a server with non-default settings; closed after the test."""
    servers = []

    def make(**overrides):
        servers.append(LiveServer(smollm2_path, **overrides))
        return servers[-1]

    yield make
    for s in servers:
        s.close()
