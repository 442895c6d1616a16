# Sourced by the bench/gpu*.sh scripts after they cd to the repository root: the output
# folder (OUT, default ./out), unbuffered Python output, the wheels carried in the
# git-ignored .whl/ folder (peers the GPU machine lacks; it has no network) installed into
# /tmp/site and put on PYTHONPATH with the repository, and the versions of what will run.
OUT="${OUT:-./out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

# A Triton wheel in .whl/ is not among them: bench/gpu.sh runs the gpu tests with it separately,
# after the run with the machine's own Triton.
PEER_WHEELS=()
for whl in .whl/*.whl; do
    [[ -e "$whl" && "$(basename "$whl")" != triton-* ]] && PEER_WHEELS+=("$whl")
done
if ((${#PEER_WHEELS[@]})); then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "${PEER_WHEELS[@]}"
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "warning: no wheels in .whl/ (peers may be missing)" >&2
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

echo "=== versions"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 - <<'PY'
import importlib
for name in ("torch", "triton", "numpy", "scipy", "jax", "geomloss", "flash_sinkhorn", "ott",
             "flashsinkhorn"):
    try:
        mod = importlib.import_module(name)
        print(f"{name:15s} {getattr(mod, '__version__', '?')}")
    except Exception as exc:  # report and go on
        print(f"{name:15s} NOT AVAILABLE ({type(exc).__name__}: {exc})")
import torch
if torch.cuda.is_available():
    print("cuda device    ", torch.cuda.get_device_name(0), "| torch.version.cuda", torch.version.cuda)
PY
