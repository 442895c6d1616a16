#!/usr/bin/env bash
# Session-20 GPU call 1: transport tests on CUDA, then the float16 gradient-dot sweep.
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
python3 -m pytest -q -p no:cacheprovider tests/test_transport.py tests/test_gpu_transport.py tests/test_gradients.py 2>&1 | tail -4 | tee "$OUT/s20a_tests.log"
python3 bench/dev/s20_grad_sweep.py 2>&1 | grep -v Warn | tee "$OUT/s20_grad_sweep_h200.jsonl"
