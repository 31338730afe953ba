#!/usr/bin/env bash
# Bytes accessed, step time, the smartclip comparison and compile time by leaf count
# (benchmarks/compile.py) on the first jax device (the GPU, when jax sees one), written as one
# Markdown file.
#
#   bash benchmarks/device.sh [OUTFILE] [run.py options, e.g. --quick]
#
# OUTFILE defaults to $OUT/RESULTS_GPU.md (benchmarks/RESULTS_GPU.md when OUT is unset), the
# page committed beside benchmarks/RESULTS.md. Run it from a copy of the repository; clipjax is
# imported from there. Nothing is fetched from the
# network: wheels in .whl/ (e.g. smartclip's, a pure-Python wheel:
# `pip download --no-deps -d .whl smartclip==0.1.1`) are installed from there with --no-index;
# without smartclip its section is left out. The file's header names the device and jax
# platform that ran; where jax sees no GPU it says "no GPU used" and the figures are CPU ones.
# PYTHON picks the interpreter (default python3).
set -euo pipefail

out="${OUT:-benchmarks}/RESULTS_GPU.md"
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then out="$1"; shift; fi
out="$(realpath -m "$out")"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
mkdir -p "$(dirname "$out")"

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/clipjax-bench-site .whl/*.whl
    export PYTHONPATH="/tmp/clipjax-bench-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1

"$PY" -c 'import jax; d = jax.devices()[0]
print(f"== running on {d.device_kind} (jax platform {d.platform}, jax {jax.__version__})")'
sections=traffic,steptime,smartclip
if ! "$PY" -c 'import smartclip' 2>/dev/null; then
    sections=traffic,steptime
    echo "== smartclip is not importable (carry its wheel in .whl/): its section is left out"
fi
"$PY" benchmarks/run.py --only "$sections" --out "$out" "$@"
compile_args=()
for arg in "$@"; do
    if [ "$arg" = --quick ]; then compile_args+=(--quick); fi
done
echo "== compile time by leaf count (benchmarks/compile.py)"
{ echo; "$PY" benchmarks/compile.py --body ${compile_args[@]+"${compile_args[@]}"}; } >>"$out"
echo "== wrote $out"
