#!/usr/bin/env bash
# flashsinkhorn.distributed on a two-GPU machine, in one call (see docs/distributed.md).
#
#   bash bench/gpu_distributed.sh            # everything into ./out
#   OUT=/some/dir bash bench/gpu_distributed.sh
#
# Steps: NCCL correctness check (sharded vs one GPU, both modes and schedules, gradients);
# n = m = 1M, d = 64, 10 iterations (tol=None, fp32) on one GPU, then on two (gather, ring);
# n = m = 2M on two GPUs (gather, then ring while time remains); the CPU/gloo test file while
# time remains; the table last. Output: $OUT/distributed.json, $OUT/distributed.log,
# $OUT/tests.log.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-./out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Never NVLink multicast (the machine's GPUs are shared): keep these off in every process.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=4
J="$OUT/distributed.json"
LOG="$OUT/distributed.log"
rm -f "$J"
NGPU="${NGPU:-2}"
RUN="python3 -m torch.distributed.run --standalone --nproc-per-node=$NGPU"
B=bench/bench_distributed.py

{
echo "=== versions"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'

echo "=== NCCL check (t=${SECONDS}s)"
timeout 150 $RUN $B --check --check-n 20000 --out "$J"

echo "=== 1M x 1M, d=64, 10 its, one GPU (t=${SECONDS}s)"
timeout 120 python3 $B --single --points 1000000 --out "$J"

echo "=== 1M x 1M, d=64, 10 its, $NGPU GPUs (t=${SECONDS}s)"
timeout 150 $RUN $B --points 1000000 --modes gather,ring --out "$J"

echo "=== 2M x 2M, d=64, 10 its, $NGPU GPUs, gather (t=${SECONDS}s)"
timeout 180 $RUN $B --points 2000000 --modes gather --out "$J"

if (( SECONDS < ${RING2M_BEFORE:-380} )); then
    echo "=== 2M x 2M, ring (t=${SECONDS}s)"
    timeout $(( 500 - SECONDS )) $RUN $B --points 2000000 --modes ring --out "$J"
else
    echo "=== 2M ring skipped: ${SECONDS}s used"
fi

if (( SECONDS < ${TESTS_BEFORE:-380} )); then
    echo "=== tests/test_distributed.py (gloo, CPU processes) (t=${SECONDS}s)"
    timeout $(( 505 - SECONDS )) python3 -m pytest -p no:cacheprovider -q tests/test_distributed.py 2>&1 \
        | tee "$OUT/tests.log" | tail -3
else
    echo "=== tests skipped: ${SECONDS}s used"
fi
echo "=== done in ${SECONDS}s"
} 2>&1 | tee "$LOG"

python3 $B --table "$J"
