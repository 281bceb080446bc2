#!/usr/bin/env bash
# Issue 14 in one GPU call (about 8.5 minutes on one H200), from the repository root:
#
#   bash benchmarks/extrapolation_gpu.sh                 # oneshot: dense + FS + FS-L (from FS), then evaluation
#   MODE=model WHICH=fs bash benchmarks/extrapolation_gpu.sh     # one model, longer training, every task
#   MODE=model WHICH=fsl ...   # continues from $WORK/ckpt_fs or benchmarks/results/checkpoints/ckpt_fs
#   MODE=model WHICH=window ... / WHICH=dense ...
#
# oneshot trains dense RoPE, FS, and FS-L (continued from FS), then evaluates S-NIAH-1 at 1x..64x the
# training length for every model, FS-B on the FS weights (tau calibrated on training-like sequences),
# the other tasks, until the deadline. Knobs: TOTAL_MINUTES (8.3), MODELS ("dense:1.5 fs:3.0 fsl:0.6",
# which:minutes of training; "dense:1.3 window:0.6 fs:3.0 fsl:0.7"), TRAIN_MINUTES (model mode, 4.5), N (50), N_FSB (20), BACKEND (auto: triton on
# CUDA where it runs the variant, else torch), TRAIN_LENGTH (1024).
#
# $OUT receives (the device returns at most 8 files): log.txt, extrapolation.json and one ckpt_<model>.tar per
# trained model (~9 MB each: bf16 weights, config.json, task.json, train_log.json); the markdown and the plots
# are printed / written under $WORK and rebuilt here from the JSON. Untar the checkpoints into
# benchmarks/results/checkpoints/ and merge the JSON files with
#   python benchmarks/extrapolation.py report --results A.json B.json --merged benchmarks/results/extrapolation.json --out-dir benchmarks/results
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/extrapolation_out}
WORK=${WORK:-/tmp/extrapolation_work}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
MODE=${MODE:-oneshot}
TOTAL_MINUTES=${TOTAL_MINUTES:-8.3}
MODELS=${MODELS:-"dense:1.3 window:0.6 fs:3.0 fsl:0.7"}
TRAIN_MINUTES=${TRAIN_MINUTES:-4.5}
BACKEND=${BACKEND:-auto}
TRAIN_LENGTH=${TRAIN_LENGTH:-1024}
COMMON=(--out "$WORK" --total-minutes "$TOTAL_MINUTES" --n "${N:-50}" --n-fsb "${N_FSB:-20}" --backend "$BACKEND" --train-length "$TRAIN_LENGTH")
{
  python3 -c "import torch, triton, freesolo; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), 'backends', freesolo.available_backends())"
  if [ "$MODE" = model ]; then
    python3 benchmarks/extrapolation.py model --which "${WHICH:?set WHICH=dense|window|fs|fsl}" --train-minutes "$TRAIN_MINUTES" "${COMMON[@]}"
  else
    # shellcheck disable=SC2086
    python3 benchmarks/extrapolation.py oneshot "${COMMON[@]}" --models $MODELS
  fi
  python3 benchmarks/extrapolation.py report --results "$WORK/extrapolation.json" --out-dir "$WORK/report"
} 2>&1 | tee "$OUT/log.txt"
cp "$WORK/extrapolation.json" "$OUT/" 2>/dev/null
for c in "$WORK"/ckpt_*; do
  [ -d "$c" ] && tar -C "$WORK" -cf "$OUT/$(basename "$c").tar" "$(basename "$c")"
done
ls -la "$OUT"
