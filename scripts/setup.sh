#!/usr/bin/env bash
# Set up a fresh clone: OpenBLAS (Linux), a .venv, and the package.
#   scripts/setup.sh          server only
#   scripts/setup.sh test     server plus the test tools
#   scripts/setup.sh cuda     server on MLX's CUDA backend (NVIDIA GPUs): no OpenBLAS
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" != "cuda" ] && [ "$(uname -s)" = "Linux" ] && ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libopenblas.so.0'; then
    if command -v apt-get >/dev/null 2>&1; then
        SUDO=""
        [ "$(id -u)" -ne 0 ] && SUDO="sudo"
        echo "Installing OpenBLAS (libopenblas0-pthread): MLX's Linux wheel is ~40x slower without it" >&2
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libopenblas0-pthread >/dev/null
    else
        echo "WARNING: no apt-get here. Install OpenBLAS with your package manager and, if it is" >&2
        echo "not in a standard place, set MLX_LM_SERVER_BLAS=/path/to/libopenblas.so.0." >&2
        echo "Without it MLX uses the reference BLAS (about 40x slower matmul)." >&2
    fi
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
if [ "${1:-}" = "test" ]; then
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
elif [ "${1:-}" = "cuda" ]; then
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[cuda]"
else
    .venv/bin/python -m pip install -q --disable-pip-version-check -e .
fi
