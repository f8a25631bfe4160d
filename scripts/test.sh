#!/usr/bin/env bash
# Set up everything the tests need (packages, OpenBLAS, real models) and run them.
# Extra arguments go to pytest, e.g. `scripts/test.sh --run-slow`, `-k server`, or
# `scripts/test.sh --quick` (the inner loop: the pure pieces and the engine, under 5 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
.venv/bin/mlx-lm-server-models doctor --skip-reference
for model in smollm2-135m-instruct qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct; do
    .venv/bin/mlx-lm-server-models fetch "$model"
done
exec .venv/bin/python -m pytest "$@"
