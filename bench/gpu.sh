#!/usr/bin/env bash
# The one script run on the GPU machine (see bench/README.md).
#
#   bash bench/gpu.sh                       # gpu tests + full bench into ./out
#   OUT=/some/dir BENCH_CASES=fwd bash bench/gpu.sh
#
# Environment:
#   OUT              output folder (default ./out): gpu_tests.log (gpu_tests_triton.log with a
#                    carried .whl/triton-*.whl), <gpu>.json, bench_workers.log
#   BENCH_CASES      comma list of cases (default fwd,fwdbwd,batched,firstcall)
#   BENCH_PROVIDERS  comma list of providers (default ours,flash-sinkhorn,geomloss,ott)
#   BENCH_ARGS       extra arguments for bench/run.py (e.g. "--quick" or "--precisions tf32,ieee")
#   SKIP_TESTS=1     skip the gpu-marked tests
#   SKIP_BENCH=1     the tests only
# Wheels for the packages the machine lacks (geomloss, flash-sinkhorn, ott-jax, jaxopt) are
# carried in .whl/ and installed into /tmp/site by bench/gpu_env.sh. NVIDIA/NCCL environment
# is left alone.
set -euo pipefail

cd "$(dirname "$0")/.."
source bench/gpu_env.sh

if [[ "${SKIP_TESTS:-0}" != "1" ]]; then
    echo "=== gpu tests"
    set +e
    python3 -m pytest -q -m gpu tests 2>&1 | tee "$OUT/gpu_tests.log"
    rc=${PIPESTATUS[0]}
    set -e
    echo "gpu tests exit code: $rc (5 = no gpu tests collected)"
    # A newer Triton carried as .whl/triton-*.whl (for the machine's Python): the same tests
    # with it ahead of the machine's Triton on the path, the machine's torch unchanged.
    if compgen -G ".whl/triton-*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site-triton .whl/triton-*.whl
        echo "=== gpu tests with $(PYTHONPATH="/tmp/site-triton:$PYTHONPATH" python3 -c \
            'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"
        set +e
        PYTHONPATH="/tmp/site-triton:$PYTHONPATH" python3 -m pytest -q -m gpu tests 2>&1 \
            | tee "$OUT/gpu_tests_triton.log"
        rc=${PIPESTATUS[0]}
        set -e
        echo "gpu tests (carried Triton) exit code: $rc"
    fi
fi

if [[ "${SKIP_BENCH:-0}" == "1" ]]; then
    exit 0
fi

echo "=== bench"
# shellcheck disable=SC2086  # BENCH_ARGS is meant to split into words
python3 bench/run.py \
    --cases "${BENCH_CASES:-fwd,fwdbwd,batched,firstcall}" \
    --providers "${BENCH_PROVIDERS:-ours,flash-sinkhorn,geomloss,ott}" \
    --out "$OUT" ${BENCH_ARGS:-}

echo "=== summary"
python3 bench/run.py --show "$OUT"/*.json || true
