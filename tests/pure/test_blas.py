"""The fast BLAS is really in use, and the doctor says so (or fails loudly)."""

import os
import subprocess
import sys

import pytest

from mlx_lm_server.runtime import blas

linux_only = pytest.mark.skipif(not blas.needs_openblas(), reason="Linux wheels only")


@linux_only
def test_suite_runs_with_openblas():
    import mlx.core as mx

    mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))
    assert blas.openblas_loaded(), blas.loaded_blas_libraries()


def _doctor(env):
    return subprocess.run(
        [sys.executable, "-m", "mlx_lm_server.models.cli", "doctor", "--skip-reference", "--size", "512"],
        capture_output=True, text=True, env=env, timeout=300,
    )


@linux_only
def test_doctor_reports_openblas():
    out = _doctor(dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert "libopenblas" in out.stdout and "GFLOP/s" in out.stdout


@linux_only
def test_doctor_fails_loudly_on_reference_blas():
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env[blas.BLAS_ENV] = "off"
    out = _doctor(env)
    assert out.returncode == 1
    assert "slow reference BLAS" in out.stderr


def test_blas_override_must_exist(monkeypatch, tmp_path):
    monkeypatch.setenv(blas.BLAS_ENV, str(tmp_path / "missing.so"))
    assert blas.find_openblas() is None
    lib = tmp_path / "libopenblas.so.0"
    lib.touch()
    monkeypatch.setenv(blas.BLAS_ENV, str(lib))
    assert blas.find_openblas() == str(lib)
