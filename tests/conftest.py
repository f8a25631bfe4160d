"""Shared fixtures: real converted models, a tiny qwen3, and the fast BLAS.

The whole suite runs with OpenBLAS preloaded, as the server does: the re-exec
in ``pytest_configure`` happens before any test module imports MLX.
"""

import json
from pathlib import Path

import pytest

from mlx_lm_server.blas import ensure_fast_blas


def pytest_configure(config):
    # Give the terminal back to the process before exec: pytest's output
    # capture would otherwise swallow everything the re-executed run prints.
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.stop_global_capturing()
    ensure_fast_blas()
    if capman is not None:
        capman.start_global_capturing()


def pytest_addoption(parser):
    parser.addoption(
        "--run-slow", action="store_true", default=False, help="also run tests marked slow"
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow") or "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow: pass --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def _fetch(name: str) -> Path:
    from mlx_lm_server.model_store import fetch

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
        "vocab_size": 49152,
        "max_position_embeddings": 2048,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "eos_token_id": [2, 0],
    }
    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((smollm2_path / name).read_bytes())
    return folder
