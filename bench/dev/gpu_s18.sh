#!/usr/bin/env bash
# Session-18 probe on the GPU: the CUDA tests of what changed, compile experiments in fresh
# processes, then the breakdowns and the transport-gradient tile sweep (bench/dev/s18_probe.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-./out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
if [[ "${SKIP_TESTS:-0}" != "1" ]]; then
    python3 -m pytest -q -p no:cacheprovider ${S18_TESTS:-tests/test_plan_step.py tests/test_transport.py tests/test_transport_fixed_ref.py tests/test_launch.py tests/test_gpu_transport.py tests/test_gpu_solver.py tests/test_solve_graphs.py} 2>&1 | tail -15 | tee "$OUT/s18_tests.log"
fi
cd bench/dev
for mode in ${COMPILE_MODES:-first first_noplan first}; do
    TRITON_CACHE_DIR="$(mktemp -d)" python3 s18_probe.py --compile "$mode" 2>&1 | grep -v Warn | tee -a "$OUT/s18_compile.jsonl"
done
if [[ "${SKIP_BREAKDOWN:-0}" != "1" ]]; then
    python3 s18_probe.py --out "$OUT" 2>&1 | grep -v Warn
fi
