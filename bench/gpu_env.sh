# Sourced by the bench/gpu*.sh scripts from the repository root: installs the wheels carried in
# the git-ignored .whl/ folder (peers the GPU machine lacks, which has no network) into
# /tmp/site and puts it and the repository on PYTHONPATH.
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "warning: no wheels in .whl/ (peers may be missing)" >&2
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
