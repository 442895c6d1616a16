#!/usr/bin/env bash
# Session-20 GPU call 4: the two unmet issue-9 rows (with flash-sinkhorn, same run), then the
# gpu-marked suite, then the device-fixture tests of the changed modules on CUDA.
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
M="flashsinkhorn-sym-tf32,flash-sinkhorn-sym,flash-sinkhorn-alt"
python3 bench/run.py --cases fwd --providers ours,flash-sinkhorn --sizes 10000x64 --methods $M --out "$OUT/fwd" --log /tmp/b1.log 2>&1 | grep -v Warn | tail -5
python3 bench/run.py --cases fwdbwd --providers ours,flash-sinkhorn --sizes 10000x128 --methods $M --out "$OUT/fwdbwd" --log /tmp/b2.log 2>&1 | grep -v Warn | tail -5
python3 -m pytest -q -p no:cacheprovider -m gpu tests --ignore=tests/mhc 2>&1 | tail -4 | tee "$OUT/s20_gpu_suite.log"
python3 -m pytest -q -p no:cacheprovider tests/test_transport.py tests/test_plan_step.py tests/test_prepare_fused.py tests/test_gradients.py 2>&1 | tail -3 | tee "$OUT/s20_cuda_unit.log"
