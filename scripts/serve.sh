#!/usr/bin/env bash
# Set up, fetch the default local model (SmolLM2-135M-Instruct, float32) and serve it
# with speculative decoding: the default --spec-decode auto, prompt lookup plus the drafter
# the model comes with (its MTP layer, or --draft-model DIR). Extra arguments go to
# mlx-lm-server and win, e.g. `scripts/serve.sh --port 9000` or `scripts/serve.sh --spec-decode none`.
# MODEL=qwen2.5-coder-0.5b-instruct scripts/serve.sh serves another catalog model;
# SETUP=cuda scripts/serve.sh sets up for MLX's CUDA backend (NVIDIA GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh ${SETUP:-}
MODEL_DIR="$(.venv/bin/mlx-lm-server-models fetch "${MODEL:-smollm2-135m-instruct}" | tail -n 1)"
exec .venv/bin/mlx-lm-server --model "$MODEL_DIR" "$@"
