#!/usr/bin/env bash
# The HVP run on the GPU machine (streaming HVP; see bench/README.md and docs/hvp.md).
#
#   bash bench/gpu_hvp.sh                 # into ./out
#   OUT=/some/dir bash bench/gpu_hvp.sh
#
# Stages (each under its own time limit, the whole within about 9 minutes):
#   1. pytest -m gpu tests/test_gpu_hvp.py        -> $OUT/gpu_hvp_tests.log
#   2. bench case "hvp", ours (ieee, tf32)         -> $OUT/<gpu>.json, $OUT/bench_workers.log
#   3. bench case "hvp", flash-sinkhorn 0.4.1     -> the same files (its autotuning included)
#   4. examples/shuffled_regression.py, n = 40000 -> $OUT/shuffled_regression/{png,json,log}
#      (given what is left of the budget; it stops itself and still writes its outputs)
#   5. a short table
# Environment: OUT (default ./out), BUDGET_S (default 530), SKIP_TESTS=1, SKIP_PEER=1,
# EXAMPLE_ARGS (extra arguments for the example).
# Wheels for the packages the machine lacks (flash-sinkhorn, ...) are carried in .whl/ and
# installed into /tmp/site by bench/gpu_env.sh.
set -uo pipefail

cd "$(dirname "$0")/.."
BUDGET_S="${BUDGET_S:-530}"
SECONDS=0

source bench/gpu_env.sh

left() { echo $((BUDGET_S - SECONDS)); }

test_rc=skipped
if [[ "${SKIP_TESTS:-0}" != "1" ]]; then
    echo "=== gpu tests (tests/test_gpu_hvp.py) [$(left) s left]"
    timeout 150 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu_hvp.py \
        2>&1 | tee "$OUT/gpu_hvp_tests.log"
    test_rc=${PIPESTATUS[0]}
    echo "gpu tests exit code: $test_rc (124 = timed out)"
fi

echo "=== bench hvp: ours [$(left) s left]"
timeout 150 python3 bench/run.py --cases hvp --providers ours --out "$OUT" --item-timeout 120
bench_ours_rc=$?

peer_rc=skipped
if [[ "${SKIP_PEER:-0}" != "1" ]]; then
    echo "=== bench hvp: flash-sinkhorn 0.4.1 [$(left) s left]"
    timeout 200 python3 bench/run.py --cases hvp --providers flash-sinkhorn --out "$OUT" \
        --item-timeout 190
    peer_rc=$?
fi

# the loop gets --max-seconds; start-up (compilation), the final solves and the time-capped
# reference minimiser near W* (0.15 x the loop budget) come on top
ex_budget=$(( ($(left) - 40) * 100 / 118 ))
ex_rc=skipped
if (( ex_budget > 30 )); then
    echo "=== example: shuffled regression, n = 40000 [$(left) s left, loop budget ${ex_budget} s]"
    mkdir -p "$OUT/shuffled_regression"
    # shellcheck disable=SC2086  # EXAMPLE_ARGS is meant to split into words
    timeout $(( $(left) - 5 )) python3 examples/shuffled_regression.py --n 40000 \
        --out "$OUT/shuffled_regression" --max-seconds "$ex_budget" ${EXAMPLE_ARGS:-} \
        2>&1 | tee "$OUT/shuffled_regression/run.log"
    ex_rc=${PIPESTATUS[0]}
else
    echo "=== example skipped: only $(left) s left"
fi

echo "=== summary [${SECONDS} s elapsed]"
echo "gpu tests rc=$test_rc  bench ours rc=$bench_ours_rc  bench peer rc=$peer_rc  example rc=$ex_rc"
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
for path in sorted(glob.glob(os.path.join(out, "*.json"))):
    rows = [r for r in json.load(open(path)).get("rows", []) if r.get("case") == "hvp"]
    if not rows:
        continue
    print(f"{path}:")
    print(f"  {'method':26s} {'ms':>9s} {'first s':>8s} {'peak MB':>8s} {'CG its':>6s} "
          f"{'<A,HA>/<A,A>':>13s} {'rel err vs ref':>14s}")
    peer = [r for r in rows if r.get("provider") != "ours" and r.get("ms")]
    for r in rows:
        if r.get("error"):
            print(f"  {r['method']:26s} error: {r['error'][:90]}")
            continue
        print(f"  {r['method']:26s} {r['ms']:9.2f} {r.get('first_call_s') or 0:8.2f} "
              f"{r.get('peak_mb') or 0:8.1f} {r.get('cg_iters_run', '?'):>6} "
              f"{r.get('value', float('nan')):13.6e} {r.get('rel_err_ref', float('nan')):14.2e}")
    for r in rows:
        if r.get("provider") == "ours" and r.get("ms") and peer:
            print(f"  speed-up of {r['method']} over {peer[0]['method']}: "
                  f"{peer[0]['ms'] / r['ms']:.2f}x")
ex = os.path.join(out, "shuffled_regression", "shuffled_regression.json")
if os.path.exists(ex):
    s = json.load(open(ex))
    print(f"example n={s['n']} eps={s['eps']}: {s['steps']} steps ({s['stop_reason']}), "
          f"Newton from step {s['newton_started_at']} ({s['newton_steps']} Newton steps), "
          f"loss {s['initial_loss']:.4f} -> {s['final_loss']:.4f} (at W*: "
          f"{s['loss_at_W_true']:.4f}), |grad| {s['final_grad_norm']:.2e}, "
          f"lambda_min {s['final_lambda_min']}, ||W-W*||/||W*|| {s['param_rel_error']:.3f}, "
          f"{s['wall_s']:.0f} s")
    ref = s.get("reference_minimum_near_W_true")
    if ref:
        print(f"  minimiser near W*: loss {ref['loss']:.4f}, ||W_ref-W*||/||W*|| "
              f"{ref['rel_error_to_W_true']:.3f}; ||W-W_ref||/||W_ref|| {ref['final_rel_distance']:.3f}")
else:
    print("example: no summary written")
PY
