#!/usr/bin/env bash
# One GPU call for the cost, label and OTDD work (see bench/README.md):
#   1. every gpu-marked test outside tests/mhc (mHC has bench/gpu_mhc.sh) -> $OUT/gpu_tests.log
#   2. fwd at 10k x 10k, d = 64: squared Euclidean and every other cost   -> $OUT/<gpu>.json
#   3. bench/bench_otdd.py (memory, time against a tensorized reference, W builder)
#   4. bench/dev/transport_probe.py (transport passes and the HVP per precision)
#   5. bench/dev/hvp_fp32_probe.py (fp32 HVP accuracy: damped vs mean-free Schur solve)
#   6. bench case hvp, ours only; bench case fwdbwd at 10k, d = 128, ours only
#   7. hvptests: tests/test_gpu_hvp.py, then tests/test_split_operands.py and
#      tests/test_transport.py on CUDA; hvpprofile: bench/dev/hvp_profile.py
#   8. a short table
# Environment: OUT (default ./out), STAGES (default "tests,fwd,otdd,probe"; also "hvpprobe",
# "hvpbench", "fwdbwd", "hvptests", "hvpprofile").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./out}"
STAGES="${STAGES:-tests,fwd,otdd,probe}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SECONDS=0
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
has() { [[ ",$STAGES," == *",$1,"* ]]; }
rc_tests=skipped; rc_fwd=skipped; rc_otdd=skipped; rc_probe=skipped; rc_hp=skipped; rc_hb=skipped
rc_fb=skipped; rc_ht=skipped; rc_hf=skipped
if has hvptests; then
    echo "=== hvp + split-operand tests on CUDA [${SECONDS} s]"
    timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_gpu_hvp.py \
        2>&1 | tee "$OUT/hvp_tests.log" | tail -8
    rc_ht=${PIPESTATUS[0]}
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_split_operands.py \
        tests/test_transport.py 2>&1 | tee -a "$OUT/hvp_tests.log" | tail -8
    rc_ht="$rc_ht/${PIPESTATUS[0]}"
fi
if has hvpprofile; then
    echo "=== hvp profile [${SECONDS} s]"
    timeout 200 python3 bench/dev/hvp_profile.py --out "$OUT" 2>&1 | tee "$OUT/hvp_profile.log"
    rc_hf=${PIPESTATUS[0]}
fi
if has tests; then
    echo "=== gpu tests [${SECONDS} s]"
    timeout 330 python3 -m pytest -q -m gpu tests --ignore=tests/mhc -p no:cacheprovider -rfE \
        2>&1 | tee "$OUT/gpu_tests.log" | tail -40
    rc_tests=${PIPESTATUS[0]}
fi
if has fwd; then
    echo "=== fwd, other costs [${SECONDS} s]"
    m=flashsinkhorn-sym-tf32
    for c in euclidean cosine mahalanobis labels; do m="$m,flashsinkhorn-cost-$c-tf32"; done
    timeout 120 python3 bench/run.py --cases fwd --providers ours --sizes 10000x64 \
        --methods "$m" --out "$OUT" > "$OUT/fwd_costs.log" 2>&1
    rc_fwd=$?
    tail -12 "$OUT/fwd_costs.log"
fi
if has otdd; then
    echo "=== otdd [${SECONDS} s]"
    timeout 170 python3 bench/bench_otdd.py --out "$OUT" 2>&1 | tail -25
    rc_otdd=${PIPESTATUS[0]}
fi
if has probe; then
    echo "=== transport probe [${SECONDS} s]"
    timeout 150 python3 bench/dev/transport_probe.py --out "$OUT" 2>&1 | tail -20
    rc_probe=${PIPESTATUS[0]}
fi
if has hvpprobe; then
    echo "=== fp32 HVP probe [${SECONDS} s]"
    timeout 120 python3 bench/dev/hvp_fp32_probe.py --out "$OUT" 2>&1 | tail -16
    rc_hp=${PIPESTATUS[0]}
fi
if has hvpbench; then
    echo "=== bench hvp, ours [${SECONDS} s]"
    timeout 120 python3 bench/run.py --cases hvp --providers ours --out "$OUT" --item-timeout 100 \
        > "$OUT/hvp_bench.log" 2>&1
    rc_hb=$?
    tail -6 "$OUT/hvp_bench.log"
fi
if has fwdbwd; then
    echo "=== bench fwdbwd 10k d=128, ours [${SECONDS} s]"
    timeout 90 python3 bench/run.py --cases fwdbwd --providers ours --sizes 10000x128 \
        --out "$OUT" > "$OUT/fwdbwd_bench.log" 2>&1
    rc_fb=$?
    tail -6 "$OUT/fwdbwd_bench.log"
fi
echo "=== [${SECONDS} s] tests rc=$rc_tests fwd rc=$rc_fwd otdd rc=$rc_otdd probe rc=$rc_probe" \
    "hvpprobe rc=$rc_hp hvpbench rc=$rc_hb fwdbwd rc=$rc_fb hvptests rc=$rc_ht" \
    "hvpprofile rc=$rc_hf"
tail -3 "$OUT/gpu_tests.log" 2>/dev/null || true
