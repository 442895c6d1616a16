#!/usr/bin/env bash
# Session-21 GPU call 1: what is live at the fwd+bwd memory peak (bench/dev/s21_mem.py), then
# the whole gpu-marked suite on the tree with the in-place merge (never run whole on CUDA).
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
timeout 120 python3 bench/dev/s21_mem.py --out "$OUT" 2>&1 | grep -v Warn | tee "$OUT/s21_mem.txt"
git log --oneline -1 > "$OUT/gpu_tests_s21a.log" 2>/dev/null || true
timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests --ignore=tests/mhc 2>&1 | tail -25 | tee -a "$OUT/gpu_tests_s21a.log"
