#!/usr/bin/env bash
# mHC on a GPU machine: the whole tests/mhc suite on CUDA (gpu-marked tests included), then the
# benchmarks. Output (logs and JSON) goes to $OUT (default ./out); merge the JSON into
# bench/results/ by hand. STAGES (default "tests projection layer train") picks the parts, so
# that a run with a time limit can be split: e.g. STAGES=tests, then STAGES="projection layer",
# then STAGES=train.
# The unrolled backward kernels take ~20 s of CPU each to compile, so the test files run as
# parallel pytest processes; the benchmarks run alone afterwards.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
command -v $PY >/dev/null || PY=python
# pytest may be missing on the GPU machine: use a carried copy (build/mhc_pydeps) if present.
if ! $PY -c "import pytest" 2>/dev/null && [ -d build/mhc_pydeps ]; then
  export PYTHONPATH=$PYTHONPATH:$PWD/build/mhc_pydeps
fi
nvidia-smi -L | tee "$OUT/mhc_gpu_info.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.limit --format=csv | tee -a "$OUT/mhc_gpu_info.txt"
$PY -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a "$OUT/mhc_gpu_info.txt"
STAGES=${STAGES:-tests projection layer train}
has() { case " $STAGES " in *" $1 "*) return 0 ;; esac; return 1; }
T1=${MHC_TEST_TIMEOUT:-400}
TMP=$(mktemp -d)
pyt() { timeout "$T1" $PY -m pytest -q -p no:cacheprovider -rfE "$@"; }
# test groups run as separate processes (compile-bound); node ids keep each group small
G=tests/mhc/test_sinkhorn.py
OPT=$G::test_triton_small_path_generator_options
group() {
  case $1 in
    0) pyt tests/mhc/test_layer.py ;;
    1) pyt "$OPT[opts0]" "$OPT[opts1]" ;;
    2) pyt "$OPT[opts2]" "$OPT[opts3]" ;;
    3) pyt "$OPT[opts4]" "$OPT[opts5]" ;;
    4) pyt "$OPT[opts6]" "$OPT[opts7]" ;;
    5) pyt "$OPT[opts8]" "$OPT[opts9]" "$OPT[opts10]" ;;
    6) pyt $G -k "small_path and not generator" ;;
    7) pyt $G -k "not small_path" ;;
    8) pyt "$OPT[opts11]" "$OPT[opts12]" "$OPT[opts13]" ;;
    9) pyt tests/mhc/test_layer_ops.py tests/mhc/test_host_path.py ;;
    10) pyt tests/mhc/test_interface.py tests/mhc/test_arguments.py tests/mhc/test_package.py tests/mhc/test_no_triton.py ;;
  esac
}
NG=11
if has tests; then
pids=()
for k in $(seq 0 $((NG - 1))); do
  group "$k" >"$TMP/t$k" 2>&1 &
  pids+=($!)
done
rcs=""
for p in "${pids[@]}"; do rc=0; wait "$p" || rc=$?; rcs="$rcs $rc"; done
{ for k in $(seq 0 $((NG - 1))); do echo "=== group $k"; cat "$TMP/t$k"; done; echo "pytest rc:$rcs"; } >"$OUT/mhc_gpu_tests.txt"
grep -E "passed|failed|error|rc:|^===" "$OUT/mhc_gpu_tests.txt"
fi
TB=${MHC_BENCH_TIMEOUT:-590}
has projection && timeout "$TB" $PY bench/bench_mhc.py --only projection --out "$OUT" 2>&1 | tee "$OUT/mhc_bench_projection.txt"
has layer && timeout "$TB" $PY bench/bench_mhc.py --only layer --out "$OUT" 2>&1 | tee "$OUT/mhc_bench_layer.txt"
has train && timeout "$TB" $PY bench/bench_mhc_train.py --out "$OUT" 2>&1 | tee "$OUT/mhc_bench_train.txt"
true
