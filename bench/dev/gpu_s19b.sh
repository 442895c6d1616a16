#!/usr/bin/env bash
# Session-19 GPU call 2: CUDA tests of the fused prepare and its users, the host probe, the
# plan-kernel sweep at 10k.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-./out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_prepare_fused.py tests/test_plan_step.py tests/test_validation.py tests/test_solve_graphs.py tests/test_gpu_solver.py} 2>&1 | tail -8 | tee "$OUT/s19b_tests.log"
cd bench/dev
python3 s19_host.py --out "$OUT" 2>&1 | grep -v Warn | head -8
python3 s19_plan_sweep.py --out "$OUT" ${SWEEP_ARGS:-} 2>&1 | grep -v Warn > "$OUT/s19_plan_sweep.txt"; tail -3 "$OUT/s19_plan_sweep.txt"
