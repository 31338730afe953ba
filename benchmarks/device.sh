#!/usr/bin/env bash
# The GPU pages in one command, sized for one GPU lease (8 minutes on an H200):
#
#   OUT=<empty folder> bash benchmarks/device.sh          # from the repository root
#
# 1. the language-model table: examples/lm_spikes.py --config gpu --only "$LM_ROWS" --npz
#    (lm_spikes_gpu.md, .png, .npz);
# 1b. the same model with the loss times 0.1 and 10 (--loss-scale; SCALE_ROWS, the static
#    sweep scaled with the loss): lm_spikes_gpu_loss_x0.1.md, lm_spikes_gpu_loss_x10.md;
# 1c. (PARTS=lm_lr, a second call) the same model at 3x its learning rate (LR_ROWS):
#    lm_spikes_gpu_lr0.03.md;
# 2. the whole training step: benchmarks/train_step.py at --size gpu (TRAIN_STEP_GPU.md);
# 3. the optimizer step: benchmarks/run.py --only traffic,steptime (RESULTS_GPU.md; the
#    smartclip section too when smartclip is importable: carry its wheel in .whl/).
# Each part runs under its own timeout, and each starts only with the seconds the parts
# after it need kept back, so a slow part cannot cost the others; all within DEADLINE
# seconds (600 by default). The default PARTS are the two language-model parts (about
# 270 + 260 s on an H200: 26 s a setting); the whole step and the optimizer step run in
# a second call, PARTS=train_step,run (about 240 s). The pages land in $OUT with one log of the three parts
# (device.log): six files. A summary of the parts (exit status, seconds) is printed last.
#
# Needs jax with a GPU, optax, flax, numpy, matplotlib and tqdm; clipjax is imported from
# this checkout (PYTHONPATH), nothing is fetched. PYTHON picks the interpreter (python3).
#
# Measured on one H200 (2026-11-26, 6 seeds): the LM table took 26 s a setting (2000
# steps, all seeds vmapped; the first one 44 s with the model's compile): 9 settings in
# 300 s. The whole-step page's default GPU rows took 179 s (each 24-layer unscanned step
# compiles in 20-22 s there; `agc` was left out by --budget). The optimizer-step part was
# not measured there (it failed on an import since fixed; about 60 s expected: some 120
# optimizer-only steps of a small tree). On the 2-core CPU at a reduced size: lm_spikes
# --config cpu --quick with 9 settings 40 s, train_step --size cpu --rounds 2 with 2 rows
# 130 s, run.py --quick --only traffic,steptime 69 s.
#
# The default LM rows are those the recommendation rests on; the other candidates of the
# GPU table (every feedback="clipped" clipper, adagc, agc, the fourth static clip) run in
# a second command of about 180 s on the same lease:
#
#   OUT=... PARTS=lm LM_ROWS=autoclip_fb,zscore_clip_fb,hist_clip_fb,adagc,agc,static_1 \
#       bash benchmarks/device.sh
#
# PARTS (default lm,train_step,run) picks the parts. A tree exported without its git
# history names its commit in CLIPJAX_COMMIT (benchmarks/common.py's page headers).
set -uo pipefail

# The recommended setting and the candidates it was chosen among, the static sweep (the
# reference), adamw alone, every feedback="clipped" clipper, zclip's and adagc's defaults.
LM_ROWS=${LM_ROWS:-none,static_0.25,static_0.5,static_1,static_2,recommended,skip_recommended,zclip_fb_cap1,zclip_fb_nocap}
# At loss x 0.1 and x 10: the sweep's best at x 1 (scaled), optax's clip at 1.0 (not scaled),
# the recommended setting alone and inside skip_on_spike, 0.3's absolute ceiling.
SCALE_ROWS=${SCALE_ROWS:-static_1,clip_1,recommended,skip_recommended,zclip_fb_cap1}
# At 3x the model's learning rate (PARTS=lm_lr, a call of its own): adamw alone, the
# static sweep, the recommended setting, 0.4's and zclip's defaults (SPEC 9.8).
LR_ROWS=${LR_ROWS:-none,static_0.25,static_0.5,static_1,recommended,zclip_fb_weight,zclip}
PARTS=${PARTS:-lm,lm_scales}
DEADLINE=${DEADLINE:-600}
LM_S=280 SCALES_S=280 LR_S=280 STEP_S=150 RUN_S=60

if [ ! -f benchmarks/device.sh ] || [ ! -d clipjax ]; then
    echo "device.sh: run it from the repository root (bash benchmarks/device.sh)" >&2
    exit 2
fi
: "${OUT:?device.sh: set OUT to the folder the pages go to}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/clipjax-bench-site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/clipjax-bench-site"
fi
sections=traffic,steptime
if "$PY" -c 'import smartclip' 2>/dev/null; then sections=$sections,smartclip; fi

logs=$(mktemp -d)
summary=()

# part NAME SECONDS COMMAND...: runs COMMAND under a timeout of SECONDS, its output in the
# log; its exit status (124: timed out) and seconds go to the summary.
part() {
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    case ",$PARTS," in *",$name,"*) ;; *) return ;; esac
    if [ "$limit" -lt 20 ]; then
        summary+=("$(printf '%-10s %6s %5s  %s' "$name" skipped 0 "no time left")")
        return
    fi
    echo "== $name (timeout ${limit} s): ${*:1:3} ..."
    timeout --kill-after=10 "$limit" "$@" >"$logs/$name.log" 2>&1
    rc=$?
    tail -n 4 "$logs/$name.log"
    summary+=("$(printf '%-10s %6s %5s  %s' "$name" "$rc" $((SECONDS - t0)) "limit $limit s")")
}
left() { echo $((DEADLINE - SECONDS - $1)); }
smaller() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }

"$PY" -c 'import jax; d = jax.devices()[0]
print(f"== {d.device_kind} (jax platform {d.platform}, jax {jax.__version__})")'

# The time the parts after one keep back: only those that run.
after() {
    local total=0 name
    for name in "$@"; do
        case ",$PARTS," in *",${name%%:*},"*) total=$((total + ${name##*:})) ;; esac
    done
    echo "$total"
}
part lm "$(smaller $LM_S "$(left "$(after lm_scales:$SCALES_S lm_lr:$LR_S train_step:$STEP_S run:$RUN_S)")")" \
    "$PY" examples/lm_spikes.py --config gpu --only "$LM_ROWS" --npz --out "$OUT"
part lm_scales "$(smaller $SCALES_S "$(left "$(after lm_lr:$LR_S train_step:$STEP_S run:$RUN_S)")")" \
    bash -c 'for k in 0.1 10; do "$0" examples/lm_spikes.py --config gpu --only "$1" \
        --loss-scale "$k" --out "$2" || exit; done' "$PY" "$SCALE_ROWS" "$OUT"
part lm_lr "$(smaller $LR_S "$(left "$(after train_step:$STEP_S run:$RUN_S)")")" \
    "$PY" examples/lm_spikes.py --config gpu --only "$LR_ROWS" --lr 3e-2 --out "$OUT"
limit=$(smaller $STEP_S "$(left "$(after run:$RUN_S)")")
part train_step "$limit" \
    "$PY" benchmarks/train_step.py --out "$OUT" --budget $((limit > 90 ? limit - 45 : limit / 2))
part run "$(smaller $RUN_S "$(left 0)")" \
    "$PY" benchmarks/run.py --only "$sections" --quick --out "$OUT/RESULTS_GPU.md"

for name in lm lm_scales lm_lr train_step run; do
    if [ -f "$logs/$name.log" ]; then
        { echo "===== $name"; cat "$logs/$name.log"; } >>"$OUT/device.log"
    fi
done
rm -rf "$logs"
echo
echo "part       status  secs"
printf '%s\n' "${summary[@]}"
echo "(status 124: timed out; total $SECONDS s of $DEADLINE)"
ls "$OUT"
