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
# The tests use about one core each (MLX's CPU kernels are single-threaded at
# these sizes): one worker per core, a test file per worker so that its
# fixtures load once, at most one worker per 8 GiB of memory (a worker peaks
# near 4.5 GB, and the tests it runs start servers and ranks of their own)
# and 4 in all. TEST_WORKERS=1 runs them in one process.
workers="${TEST_WORKERS:-$(.venv/bin/python -c '
import os
cores = len(os.sched_getaffinity(0))
gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
print(max(1, min(cores, int(gib // 8), 4)))')}"
if [ "$workers" -gt 1 ]; then
    exec .venv/bin/python -m pytest -n "$workers" --dist loadfile "$@"
fi
exec .venv/bin/python -m pytest "$@"
