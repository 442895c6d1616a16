#!/usr/bin/env bash
# Session 23, call 5: the mHC test groups that hit gpu_mhc.sh's 200 s timeout in call 4 (compile
# bound: five unrolled kernels per generator-option test), with a longer limit, then the
# projection benchmark with the new default first in BWD_CANDS (call 4's bench listed only the
# old candidates; its layer rows already ran the new default).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
OPT=tests/mhc/test_sinkhorn.py::test_triton_small_path_generator_options
pyt() { timeout 420 python3 -m pytest -q -p no:cacheprovider -rfE "$@"; }
pyt "$OPT[opts0]" >"$OUT/t1.txt" 2>&1 &
pyt "$OPT[opts1]" >"$OUT/t2.txt" 2>&1 &
pyt "$OPT[opts6]" >"$OUT/t3.txt" 2>&1 &
pyt "$OPT[opts7]" >"$OUT/t4.txt" 2>&1 &
pyt "$OPT[opts8]" >"$OUT/t5.txt" 2>&1 &
pyt "$OPT[opts9]" >"$OUT/t6.txt" 2>&1 &
pyt "$OPT[opts10]" >"$OUT/t7.txt" 2>&1 &
for i in 0 1 2; do timeout 300 python3 bench/bench_mhc.py --precompile $i/3 >/dev/null 2>&1 & done
wait
for k in 1 2 3 4 5 6 7; do tail -1 "$OUT/t$k.txt"; done
timeout 200 python3 bench/bench_mhc.py --skip-layer --out "$OUT" 2>&1 | grep -E "mhc_(fwd|bwd)" | tail -30
