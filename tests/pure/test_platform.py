"""Where users run and get models: Hugging Face repo ids resolved offline
from a hub cache the test builds, the ``cuda`` extra, the GPU backend's
defaults (no OpenBLAS, bfloat16 4-bit fetches), and the benchmark charts."""

import importlib.metadata
import json
from pathlib import Path

import pytest

from mlx_lm_server.models.source import is_repo_id, resolve_model
from mlx_lm_server.runtime import blas

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def hub_cache(tmp_path, smollm2_path) -> Path:
    """A Hugging Face hub cache holding ``test-org/SmolLM2-135M`` as the hub
    lays it out (refs/main naming a snapshot of links to blobs)."""
    repo = tmp_path / "hub" / "models--test-org--SmolLM2-135M"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for f in smollm2_path.iterdir():
        if f.is_file():
            blob = repo / "blobs" / f.name
            blob.symlink_to(f.resolve())
            (snapshot / f.name).symlink_to(blob)
    return tmp_path / "hub"


def test_a_repo_id_resolves_from_the_hub_cache_offline(hub_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    folder, repo = resolve_model("test-org/SmolLM2-135M", cache_dir=str(hub_cache))
    assert repo == "test-org/SmolLM2-135M"
    assert (folder / "config.json").is_file() and folder.parent.name == "snapshots"
    # A local folder stays a folder, and has no repo id.
    assert resolve_model(str(folder)) == (folder, None)


def test_an_unknown_repo_id_says_where_it_looked(hub_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError) as e:
        resolve_model("test-org/no-such-model", cache_dir=str(hub_cache))
    assert str(hub_cache) in str(e.value) and "HF_HUB_OFFLINE" in str(e.value)
    with pytest.raises(ValueError, match="neither a model folder nor"):
        resolve_model("./no/such/folder")
    assert is_repo_id("mlx-community/Qwen3-4B-4bit") and not is_repo_id("models/a/b")


def test_the_server_serves_a_repo_id_under_its_name(hub_cache, monkeypatch, capsys):
    """``mlx-lm-server --model ORG/NAME``: resolved before loading; an unknown
    id is exit status 2 with the cache named."""
    from huggingface_hub import constants

    from mlx_lm_server import server

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    config = server.resolve_sources(server.config_from_args(server.build_parser().parse_args(
        ["--model", "test-org/SmolLM2-135M"])))
    assert Path(config.model).is_dir() and config.model_id == "test-org/SmolLM2-135M"
    assert server.main(["--model", "test-org/no-such-model"]) == 2
    assert str(hub_cache) in capsys.readouterr().err


def test_the_cuda_extra_pins_the_same_mlx():
    requires = importlib.metadata.requires("mlx-lm-server")
    cpu = [r for r in requires if r.startswith("mlx[cpu]==")]
    cuda = [r for r in requires if r.startswith("mlx[cuda13]==")]
    assert cpu and cuda, requires
    version = cpu[0].split("==")[1].split(";")[0].strip()
    assert cuda[0].split("==")[1].split(";")[0].strip() == version
    assert 'extra == "cuda"' in cuda[0]


def test_with_a_gpu_backend_openblas_is_skipped_and_fetch_picks_bf16_4bit(monkeypatch):
    from mlx_lm_server.models import cli as models_cli

    parser = models_cli.build_parser()
    monkeypatch.setattr(blas, "gpu_backend", lambda: "cuda")
    assert not blas.needs_openblas()
    args = parser.parse_args(["fetch", "smollm2-135m-instruct"])
    assert models_cli.fetch_options(args) == ("bfloat16", 4)
    monkeypatch.setattr(blas, "gpu_backend", lambda: None)
    assert blas.needs_openblas() == (blas.sys.platform.startswith("linux"))
    assert models_cli.fetch_options(args) == ("float32", None)
    explicit = parser.parse_args(["fetch", "smollm2-135m-instruct", "--dtype", "float16"])
    assert models_cli.fetch_options(explicit) == ("float16", None)


def test_bench_charts_are_drawn_from_results(tmp_path):
    import sys

    import matplotlib.image

    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    import plot_bench

    sample = ROOT / "docs" / "bench" / "cpu_2026-11-23.json"
    data = json.loads(sample.read_text())
    per_model = plot_bench.series(data["results"], "CPU")
    figures = plot_bench.figures(per_model)
    for model, fig in figures.items():
        ax = fig.axes[0]
        assert ax.get_xlabel().startswith("batch size") and "speculation" in ax.get_ylabel()
        assert len(ax.get_lines()) == len(per_model[model]) + 1  # and the break-even line
    paths = plot_bench.main([str(sample), "--out", str(tmp_path)])
    pngs = sorted(tmp_path.glob("*.png"))
    assert paths == 0 and len(pngs) == len(per_model) >= 1
    for png in pngs:
        h, w = matplotlib.image.imread(png).shape[:2]
        assert w >= 600 and h >= 400


@pytest.mark.parametrize("given, kept", [(None, "0"), ("1", "1")])
def test_mlx_cuda_cache_thrashing_check_is_off_unless_the_user_set_it(given, kept):
    """MLX's CUDA backend would raise after 512 attention graphs in a thread
    (one per prompt shape): a long-running server keeps serving instead."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_CACHE_THRASHING_CHECK"}
    if given is not None:
        env["MLX_ENABLE_CACHE_THRASHING_CHECK"] = given
    out = subprocess.run([sys.executable, "-c", "import os, mlx_lm_server; "
                          "print(os.environ['MLX_ENABLE_CACHE_THRASHING_CHECK'])"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == kept
