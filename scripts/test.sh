#!/usr/bin/env bash
# Set up everything the tests need (packages, OpenBLAS, real models) and run them.
#   scripts/test.sh              every test (what CI runs, as `scripts/test.sh -q`)
#   scripts/test.sh quick        the inner loop: the pure and tiny-model tiers,
#                                `-m "pure or tiny"` (under 3 minutes on 2 cores)
# Extra arguments go to pytest, after `quick` too: `scripts/test.sh --run-slow`,
# `scripts/test.sh -k server`, `scripts/test.sh quick -x`. `--quick` is `quick`.
# The tiers are the folders of tests/ (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=()
if [ "${1:-}" = quick ] || [ "${1:-}" = --quick ]; then
    shift
    tier=(-m "pure or tiny")
    # Collect only the two folders (the whole suite's collection costs each
    # worker seconds), unless a test path was given.
    paths=(tests/pure tests/tiny)
    for arg in "$@"; do
        if [ -e "${arg%%::*}" ]; then paths=(); fi
    done
    tier+=("${paths[@]}")
fi
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
cores="$(.venv/bin/python -c 'import os; print(len(os.sched_getaffinity(0)))')"
workers="${TEST_WORKERS:-$(.venv/bin/python -c '
import os, sys
gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
print(max(1, min(int(sys.argv[1]), int(gib // 8), 4)))' "$cores")}"
if [ "$workers" -gt 1 ]; then
    # OpenBLAS starts a thread per core in every process; with a worker per
    # core they contend, and its waiting threads spin in the kernel (2 workers
    # on 2 cores: a quarter of the suite's CPU time was system time, and the
    # same four test files took 164 s against 122 s with one thread each).
    export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-$(( cores / workers > 0 ? cores / workers : 1 ))}"
    exec .venv/bin/python -m pytest -n "$workers" --dist loadfile "${tier[@]}" "$@"
fi
exec .venv/bin/python -m pytest "${tier[@]}" "$@"
