#!/usr/bin/env bash
# GPU session of the plan step (docs/performance.md entry 16): its tests and the soft-min tests
# on CUDA, the A/B probe, then the bench rows named by BENCH_CASES / BENCH_PROVIDERS / BENCH_ARGS
# (skipped when BENCH_CASES is empty).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-./out}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
if [[ "${SKIP_TESTS:-0}" != "1" ]]; then
    python3 -m pytest -q -p no:cacheprovider ${PLAN_TESTS:-tests/test_plan_step.py tests/test_kernels_lse.py tests/test_solve_graphs.py tests/test_gpu_solver.py} 2>&1 | tail -15 | tee "$OUT/plan_tests.log"
fi
if [[ "${SKIP_AB:-0}" != "1" ]]; then
    (cd bench/dev && python3 plan_ab.py --out "$OUT") 2>&1 | grep -v Warning
fi
if [[ -n "${BENCH_CASES:-}" ]]; then
    # shellcheck disable=SC2086
    python3 bench/run.py --cases "$BENCH_CASES" --providers "${BENCH_PROVIDERS:-ours}" \
        --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tail -30
fi
