#!/usr/bin/env bash
# Session 22, GPU call 4: OTT-JAX 0.6.0 on the H200. The jax 0.10.2 / jaxlib / cuda13 plugin
# site-packages arrive as one xz tarball in three parts (.jax1-3, carried by calls 2-4 on
# the same warm machine). CUDA libraries: torch's nvidia cu13 packages; ptxas and libdevice:
# Triton's bundled copies. Then the d = 512 / 1024 forward rows with OTT dense, flash-sinkhorn
# sym and ours in the same run.
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
mkdir -p /tmp/jaxsite /tmp/cudadir/bin /tmp/cudadir/nvvm/libdevice
ls -la .jax1 .jax2 .jax3 2>&1 | grep " p$"
cat .jax1/p .jax2/p .jax3/p | xz -d -T0 | tar -x -C /tmp/jaxsite && echo "jax site unpacked: $(du -sh /tmp/jaxsite | cut -f1)"
TB=$(python3 -c "import triton, os; print(os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia'))")
ln -sf "$TB/bin/ptxas" /tmp/cudadir/bin/ptxas
ln -sf "$TB/lib/libdevice.10.bc" /tmp/cudadir/nvvm/libdevice/libdevice.10.bc
ls -la /tmp/cudadir/bin /tmp/cudadir/nvvm/libdevice
export PYTHONPATH="/tmp/site:/tmp/jaxsite:$PWD" PATH="/tmp/cudadir/bin:$PATH"
export XLA_FLAGS="--xla_gpu_cuda_data_dir=/tmp/cudadir" XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 120 python3 - <<'PY' 2>&1 | grep -v Warn | tail -15 | tee "$OUT/s22d_jax_smoke.txt"
import jax, jax.numpy as jnp
print("jax", jax.__version__, jax.devices())
x = jnp.ones((1000, 512)); print("matmul", float((x @ x.T).sum()), "exp", float(jnp.exp(x).sum()))
import ott
from ott.geometry import pointcloud
from ott.problems.linear import linear_problem
from ott.solvers.linear import sinkhorn
geom = pointcloud.PointCloud(jax.random.uniform(jax.random.PRNGKey(0), (500, 16)), jax.random.uniform(jax.random.PRNGKey(1), (400, 16)), epsilon=0.1)
out = sinkhorn.Sinkhorn(max_iterations=10, min_iterations=10)(linear_problem.LinearProblem(geom))
print("ott", ott.__version__, "reg_ot_cost", float(out.reg_ot_cost))
PY
M="flashsinkhorn-sym-tf32,flashsinkhorn-alt-tf32,ott-dense,flash-sinkhorn-sym"
timeout 200 python3 bench/run.py --cases fwd --providers ours,ott,flash-sinkhorn --sizes 10000x512 --methods $M --out "$OUT/fwd512" --log /tmp/b1.log 2>&1 | grep -v Warn | tail -8
timeout 200 python3 bench/run.py --cases fwd --providers ours,ott,flash-sinkhorn --sizes 20000x1024 --methods $M --out "$OUT/fwd1024" --log /tmp/b2.log 2>&1 | grep -v Warn | tail -8
