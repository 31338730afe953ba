#!/usr/bin/env bash
# The benchmark suite on a GPU: the same benchmarks/run.py, GPU figures into $OUT.
#
#   bash benchmarks/device.sh [run.py options, e.g. --quick or --only traffic,steptime]
#
# Writes $OUT/RESULTS-gpu.md, $OUT/results-gpu.png and $OUT/results-gpu.json
# (OUT defaults to benchmarks/gpu-out). It installs nothing from the network:
# the GPU machine cannot reach a package index.
#
# What it needs there:
# * a Python with jax (CUDA build), optax, chex, numpy and matplotlib. The
#   workplace's GPU image has them (`python3`); PYTHON=... picks another one.
# * clipjax itself: nothing to install, it is imported from this checkout.
# * smartclip, for the smartclip section only (the rest runs without it). It is
#   a pure-Python wheel: fetch it on a machine with the index and carry it in
#   .whl/ (ignored by git), which this script installs with --no-index:
#
#       python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#           -d .whl smartclip==0.1.1
#
#   Any other missing package travels the same way (manylinux x86_64 wheels for
#   the GPU machine's Python; add --platform manylinux_2_28_x86_64 etc. for
#   compiled ones, and --no-deps means each dependency must be named too).
#
# With the workplace's device tool:  run(command="bash benchmarks/device.sh", carry=[".whl"])
# (one command may run 10 minutes: add --quick, or split with --only, if the
# full suite does not fit).
#
# Environment: OUT (output folder), PYTHON (interpreter), MAX_COMPILE_LEAVES
# (largest leaf count compiled in the scaling sweep, default 1000), ALLOW_CPU=1
# (run even when jax sees no GPU).
set -euo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/gpu-out}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"

if compgen -G ".whl/*.whl" >/dev/null; then
    echo "== installing carried wheels from .whl/ (no index)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/clipjax-bench-site .whl/*.whl
    export PYTHONPATH="/tmp/clipjax-bench-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Allocate on demand, so the scaling sweep can read how much memory is free.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONUNBUFFERED=1

backend="$("$PY" -c 'import jax; print(jax.default_backend())' 2>/dev/null || echo none)"
echo "== jax backend: $backend"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if [ "$backend" != "gpu" ] && [ "$backend" != "cuda" ] && [ "${ALLOW_CPU:-0}" != "1" ]; then
    echo "no GPU visible to jax (backend: $backend); set ALLOW_CPU=1 to run on the CPU anyway" >&2
    exit 2
fi
"$PY" -c 'import smartclip' 2>/dev/null || echo "== smartclip is not installed: its section will say so (carry .whl/, see above)"

"$PY" benchmarks/run.py \
    --out "$OUT/RESULTS-gpu.md" \
    --json "$OUT/results-gpu.json" \
    --max-compile-leaves "${MAX_COMPILE_LEAVES:-1000}" \
    "$@"
