#!/usr/bin/env bash
# Session-20 GPU call 5 (last): the in-place merge on CUDA (guarded against a hang), the two
# issue-9 rows it touches with flash-sinkhorn in the same run, then the transport and HVP
# tests on CUDA.
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_transport.py -k "inplace_merge or ot_cost or batched" 2>&1 | tail -3 | tee "$OUT/s20e_merge_tests.log"
M="flashsinkhorn-sym-tf32,flash-sinkhorn-sym,flash-sinkhorn-alt"
timeout 150 python3 bench/run.py --cases fwdbwd --providers ours,flash-sinkhorn --sizes 10000x128 --methods $M --out "$OUT/fwdbwd" --log /tmp/b2.log 2>&1 | grep -v Warn | tail -4
timeout 120 python3 bench/run.py --cases fwd --providers ours,flash-sinkhorn --sizes 10000x64 --methods $M --out "$OUT/fwd" --log /tmp/b1.log 2>&1 | grep -v Warn | tail -4
timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/test_transport.py tests/test_gpu_hvp.py tests/test_split_operands.py 2>&1 | tail -3 | tee "$OUT/s20e_cuda_tests.log"
