#!/usr/bin/env bash
# Session-19 GPU call 3: CUDA tests of the fast launch and the fused prepare, host timings, then
# the 10k bench rows with flash-sinkhorn and the fresh-process first call.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-./out}"
mkdir -p "$OUT"
pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_launch.py tests/test_prepare_fused.py tests/test_plan_step.py tests/test_transport.py tests/test_solve_graphs.py tests/test_gpu_solver.py} 2>&1 | tail -6 | tee "$OUT/s19c_tests.log"
(cd bench/dev && python3 s19_prep_timing.py 2>&1 | grep -v Warn | tee "$OUT/s19_prep_timing.txt")
if [[ "${BENCH:-1}" == "1" ]]; then
python3 bench/run.py --cases fwd --providers ours,flash-sinkhorn --sizes 10000x64 --methods flashsinkhorn-sym-tf32,flash-sinkhorn-sym,flash-sinkhorn-alt --out "$OUT/fwd" --log /tmp/bw1.log 2>&1 | grep -v Warn | tail -6
python3 bench/run.py --cases fwdbwd --providers ours,flash-sinkhorn --sizes 10000x128 --methods flashsinkhorn-sym-tf32,flash-sinkhorn-sym,flash-sinkhorn-alt --out "$OUT/fwdbwd" --log /tmp/bw2.log 2>&1 | grep -v Warn | tail -6
python3 bench/run.py --cases firstcall --providers ours --out "$OUT/first" --log /tmp/bw3.log 2>&1 | grep -v Warn | tail -4
fi
