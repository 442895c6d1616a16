# Shared preamble of the bench/dev/gpu_*.sh device-call scripts (sourced, not run): the repo
# root as working directory, $OUT, the carried wheels (.whl: flash-sinkhorn, geomloss) and the
# Python path. Wheels that are missing only leave those peers out.
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-./out}"
mkdir -p "$OUT"
pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
