#!/usr/bin/env bash
# The first checks of BENCHMARKS.md's "Not measured on a GPU" list as one bounded device call,
# so that a session lent a GPU spends its minutes measuring, not preparing. After
# ../shared/gpu/pack.sh smollm2-135m-instruct and its copy calls, the last call is:
#   source /tmp/gpu/remote.sh && bash scripts/bench/gpu_first.sh 540
# (the argument: seconds for all of it; keep it under the call's timeout_s). In order:
#   1. start-up on a fresh machine: the default server's first three code-edit waves at 8
#      clients with no warm-up, then none's (compiled kernels outlive a process, so only the
#      first process of a machine shows the cold start);
#   2. the matrix's GPU cells: chat and code edit at 4 and 16 clients, default against none,
#      rounds alternating, every step's decision logged (bench_out/bench_matrix_default.log).
# Each part gets its share of the budget; a part cut short keeps what bench_matrix wrote
# after each round (*.partial.json; the first waves only print to their log). Everything
# comes back under $OUT. On a CPU (a smoke test, both parts cut short):
#   MODEL=models/smollm2-135m-instruct OUT=/tmp/g PYTHON=.venv/bin/python bash scripts/bench/gpu_first.sh 150
set -uo pipefail
budget=${1:-540}
model=${MODEL:-${GPU_MODELS:-models}/smollm2-135m-instruct-4bit}
out=${OUT:-bench_out/gpu_first}
py=${PYTHON:-python3}
mkdir -p "$out"
t0=$(date +%s)
left() { echo $(( budget - ($(date +%s) - t0) )); }
stop_servers() { pkill -f "[m]lx_lm_server[.]server --model" || true; pkill -f "[m]lx-lm-server --model" || true; }
run_part() {  # NAME SECONDS ARGS...: one bench_matrix run, bounded, its log beside its JSON
  local name=$1 secs=$2; shift 2
  (( secs > 20 )) || { echo "$name: skipped, $secs s left" | tee -a "$out/summary.txt"; return; }
  echo "$(date +%T) $name: up to $secs s" | tee -a "$out/summary.txt"
  timeout -k 10 "$secs" "$py" scripts/bench/bench_matrix.py --model "$model" --per-client 1 \
    --max-tokens 96 --out "$out/$name.json" "$@" > "$out/$name.log" 2>&1
  local rc=$?  # 124: cut by its share of the budget
  echo "$(date +%T) $name: exit $rc" | tee -a "$out/summary.txt"
  stop_servers
}
"$py" -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())" | tee "$out/summary.txt"
stop_servers
run_part first_waves $(( budget * 35 / 100 )) --servers default none --rounds 0 \
  --first-waves 3 --first-wave-workload code-edit --first-wave-clients 8
run_part matrix $(( $(left) - 15 )) --workloads chat code-edit --clients 4 16 --rounds 3 \
  --servers default none --server-log-level debug --markdown "$out/matrix.md"
[[ -f bench_out/bench_matrix_default.log ]] && gzip -c bench_out/bench_matrix_default.log > "$out/default_steps.log.gz"
grep -h "first waves\|c=4\|c=16" "$out"/*.log | tail -n 40
cat "$out/matrix.md" 2>/dev/null | head -n 30
