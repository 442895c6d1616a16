#!/usr/bin/env bash
# flashsinkhorn.distributed scaling suite on a multi-GPU machine, in one call
# (see docs/distributed.md and bench/bench_distributed.py).
#
#   NGPU=4 bash bench/gpu_distributed.sh          # 1, 2 and 4 GPUs into ./out
#   OUT=/some/dir NGPU=2 bash bench/gpu_distributed.sh
#
# Steps: the suite on one GPU (no torchrun) and on two at the same time (GPU 0, and GPUs
# 2 and 3 when NGPU > 2; one after the other otherwise), then on NGPU (each part: fixed
# iterations at 10⁶·√W and 2·10⁶ points, 4·10⁶ on one GPU and from 4 on; to tol 1e-3 with
# the default at 2·10⁶; the divergence and its gradient from 4 on); the NCCL correctness
# check while time remains (CHECK_BEFORE seconds); the table last.
# Output: $OUT/distributed.json, $OUT/distributed.log.
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
NGPU="${NGPU:-4}"
B=bench/bench_distributed.py
# a command, not a function: timeout runs it
RUN=(python3 -m torch.distributed.run --standalone)

{
echo "=== versions"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'

echo "=== suite, 1 GPU and 2 GPUs (t=${SECONDS}s)"
if (( NGPU > 2 )); then
    CUDA_VISIBLE_DEVICES=0 timeout 330 python3 $B --suite --out "$OUT/one.json" &
    CUDA_VISIBLE_DEVICES=2,3 timeout 330 "${RUN[@]}" --nproc-per-node=2 --master-port=29611 \
        $B --suite --out "$OUT/two.json"
    wait
    python3 - "$J" "$OUT/one.json" "$OUT/two.json" <<'PY'
import json, os, sys
rows = [r for f in sys.argv[2:] if os.path.exists(f) for r in json.load(open(f))]
json.dump(rows, open(sys.argv[1], "w"), indent=1)
for f in sys.argv[2:]:
    if os.path.exists(f):
        os.remove(f)
PY
else
    CUDA_VISIBLE_DEVICES=0 timeout 330 python3 $B --suite --out "$J"
fi
echo "=== suite, $NGPU GPUs (t=${SECONDS}s)"
timeout 400 "${RUN[@]}" --nproc-per-node="$NGPU" $B --suite --out "$J"
if (( SECONDS < ${CHECK_BEFORE:-420} )); then
    echo "=== NCCL check, $NGPU GPUs (t=${SECONDS}s)"
    timeout 120 "${RUN[@]}" --nproc-per-node="$NGPU" $B --check --check-n 40000 --out "$J"
fi
echo "=== done in ${SECONDS}s"
} 2>&1 | tee "$LOG"

python3 $B --table "$J"
