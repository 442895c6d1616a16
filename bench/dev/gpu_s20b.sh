#!/usr/bin/env bash
# Session-20 GPU call 2: CUDA tests of the changed modules, then the s20 probe.
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
python3 bench/dev/s20_probe.py 2>&1 | grep -v Warn | tee "$OUT/s20_probe_h200.jsonl"
python3 -m pytest -q -p no:cacheprovider -x tests/test_prepare_fused.py tests/test_plan_step.py tests/test_solve_graphs.py tests/test_launch.py tests/test_transport.py 2>&1 | tail -5 | tee "$OUT/s20b_tests.log"
