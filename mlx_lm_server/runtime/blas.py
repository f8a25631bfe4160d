"""Make MLX's Linux CPU backend use OpenBLAS instead of the reference BLAS.

MLX's Linux CPU wheel links the reference BLAS, whose float32 matmul is about
40x slower than OpenBLAS. Loading OpenBLAS first (``LD_PRELOAD``) makes MLX's
``cblas_*`` calls resolve to it. The preload only takes effect at process start,
so entry points call :func:`ensure_fast_blas` before importing MLX, which
re-executes the process once with the variable set.

Nothing in this module imports MLX at module level: it must run before MLX is
loaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

# Set in the re-executed child so that a failed preload never loops.
_REEXEC_MARK = "MLX_LM_SERVER_BLAS_REEXEC"
# "off" keeps the reference BLAS; a path names the OpenBLAS library to preload.
BLAS_ENV = "MLX_LM_SERVER_BLAS"

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

INSTALL_HINT = (
    "OpenBLAS was not found, so MLX uses the reference BLAS (about 40x slower "
    "matmul). On Debian/Ubuntu run `sudo apt-get install libopenblas0-pthread`; "
    "elsewhere install OpenBLAS and set MLX_LM_SERVER_BLAS=/path/to/libopenblas.so.0."
)


def gpu_backend() -> Optional[str]:
    """"cuda" where MLX's CUDA backend is installed, "metal" on Apple
    silicon, else None; read from the installed packages, without
    importing MLX."""
    import importlib.metadata
    import platform

    if sys.platform == "darwin" and platform.machine() == "arm64":
        return "metal"
    for name in ("mlx-cuda-13", "mlx-cuda-12"):
        try:
            importlib.metadata.distribution(name)
            return "cuda"
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def needs_openblas() -> bool:
    """Only Linux CPU wheels ship the reference BLAS (macOS uses Accelerate);
    with MLX's GPU backend the model runs on the GPU."""
    return sys.platform.startswith("linux") and gpu_backend() is None


def find_openblas() -> Optional[str]:
    """Path of an OpenBLAS shared library, or None when none is installed."""
    override = os.environ.get(BLAS_ENV)
    if override and override != "off":
        return override if Path(override).exists() else None
    for path in _CANDIDATES:
        if Path(path).exists():
            return path
    try:
        out = subprocess.run(
            ["ldconfig", "-p"], capture_output=True, text=True, timeout=5
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if "libopenblas.so.0" in line and "=>" in line:
            return line.split("=>", 1)[1].strip()
    return None


def loaded_blas_libraries() -> list[str]:
    """Shared libraries mapped into this process whose name mentions BLAS."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    libs = {
        line.split()[-1]
        for line in maps.splitlines()
        if "blas" in line.rsplit("/", 1)[-1].lower()
    }
    return sorted(libs)


def openblas_preloaded() -> bool:
    return any("libopenblas" in p for p in os.environ.get("LD_PRELOAD", "").split())


def openblas_loaded() -> bool:
    return any("libopenblas" in Path(p).name for p in loaded_blas_libraries())


def ensure_fast_blas(argv: Optional[list[str]] = None) -> None:
    """Re-execute this process once with OpenBLAS preloaded, when that helps.

    Must be called before ``mlx`` is imported. Does nothing off Linux, when
    OpenBLAS is already preloaded, when ``MLX_LM_SERVER_BLAS=off``, or when
    OpenBLAS is not installed (then it warns with the install command).
    """
    if not needs_openblas() or openblas_preloaded():
        return
    if os.environ.get(BLAS_ENV) == "off" or os.environ.get(_REEXEC_MARK):
        return
    lib = find_openblas()
    if lib is None:
        print(f"warning: {INSTALL_HINT}", file=sys.stderr)
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(filter(None, [lib, env.get("LD_PRELOAD", "")]))
    env[_REEXEC_MARK] = "1"
    args = argv if argv is not None else [sys.executable, *sys.orig_argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, args, env)


def measure_matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    """Float32 n x n matmul throughput through MLX in this process."""
    import mlx.core as mx

    a = mx.random.normal((n, n), key=mx.random.key(0))
    b = mx.random.normal((n, n), key=mx.random.key(1))
    mx.eval(a, b, a @ b)
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(a @ b)
    seconds = (time.perf_counter() - start) / repeats
    return 2 * n**3 / seconds / 1e9


def measure_reference_gflops(n: int = 2048, repeats: int = 1) -> float:
    """The same measurement in a child process that keeps the reference BLAS."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env[BLAS_ENV] = "off"
    code = (
        "from mlx_lm_server.runtime.blas import measure_matmul_gflops as m;"
        f"print(m({n}, {repeats}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True,
        check=True, timeout=600,
    )
    return float(out.stdout.strip().splitlines()[-1])
