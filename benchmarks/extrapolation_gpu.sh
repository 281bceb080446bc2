#!/usr/bin/env bash
# Issue 14 in one GPU call (about 8.5 minutes on one H200): train dense RoPE, FS, and FS-L (continued from FS),
# evaluate S-NIAH-1 at 1x..64x the training length for dense / FS / FS-B (on the FS weights) / FS-L first,
# then the other tasks until the deadline; write the table, the plots and the checkpoints under $OUT.
#
#   bash benchmarks/extrapolation_gpu.sh                  # from the repository root
#   TOTAL_MINUTES=8.5 MODELS="dense:1.8 fs:2.6 fsl:0.6" BACKEND=auto bash benchmarks/extrapolation_gpu.sh
#
# $OUT receives 8 files: log.txt, extrapolation.json, extrapolation.md, extrapolation_accuracy.png,
# extrapolation_depth.png, ckpt_dense.tar, ckpt_fs.tar, ckpt_fsl.tar (each checkpoint ~9 MB: bf16 weights,
# config.json, task.json, train_log.json). Commit them under benchmarks/results/ (checkpoints untarred into
# benchmarks/results/checkpoints/).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/extrapolation_out}
WORK=${WORK:-/tmp/extrapolation_work}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
TOTAL_MINUTES=${TOTAL_MINUTES:-8.3}
MODELS=${MODELS:-"dense:1.8 fs:2.6 fsl:0.6"}
BACKEND=${BACKEND:-auto}
N=${N:-50}
{
  python3 -c "import torch, triton, freesolo; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), 'backends', freesolo.available_backends())"
  # shellcheck disable=SC2086
  python3 benchmarks/extrapolation.py oneshot --out "$WORK" --total-minutes "$TOTAL_MINUTES" --n "$N" --backend "$BACKEND" --models $MODELS
  python3 benchmarks/extrapolation.py report --results "$WORK/extrapolation.json" --out-dir "$OUT"
} 2>&1 | tee "$OUT/log.txt"
cp "$WORK/extrapolation.json" "$OUT/" 2>/dev/null
for c in "$WORK"/ckpt_*; do
  [ -d "$c" ] && tar -C "$WORK" -cf "$OUT/$(basename "$c").tar" "$(basename "$c")"
done
ls -la "$OUT"
