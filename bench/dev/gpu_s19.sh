#!/usr/bin/env bash
# Session-19 GPU call: the CUDA tests of what changed, then the 10k timeline probe
# (bench/dev/s19_probe.py) and any extra commands given in S19_EXTRA.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-./out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [[ "${SKIP_TESTS:-0}" != "1" ]]; then
    python3 -m pytest -q -p no:cacheprovider ${S19_TESTS:-tests/test_plan_step.py tests/test_transport.py tests/test_launch.py} 2>&1 | tail -8 | tee "$OUT/s19_tests.log"
fi
if [[ "${SKIP_PROBE:-0}" != "1" ]]; then
    (cd bench/dev && python3 s19_probe.py --out "$OUT" 2>&1 | grep -v Warn | tee "$OUT/s19_probe.txt")
fi
if [[ -n "${S19_EXTRA:-}" ]]; then
    eval "$S19_EXTRA"
fi
