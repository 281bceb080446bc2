#!/usr/bin/env bash
# Issue 14, one GPU call: FS-B (on the FS weights, tau calibrated on training-like sequences) over the
# tasks at the lengths MULTIPLES (x the training length, evaluated shortest first), one `freesolo eval`
# process per task (each writes its JSON after every cell), and optionally (RECALL=1) the FS-B recall
# study on the model's keys (benchmarks/fsb_recall.py --ckpt) meanwhile. Run from the repository root with
# .ckpt/ckpt_fs present (carried). $OUT receives fsb_cells.tar (one JSON and log per task, the study).
#   CKPT (.ckpt/ckpt_fs), MULTIPLES ("1 2 4 8 16"), MINUTES (7.0: eval deadline per process), N (50),
#   TRAIN_LENGTH (1024), RECALL (0)
# Measured 2026-12-01 (H200): FS-B's torch selection costs ~0.4 s per sample up to 8k and ~4 s at
# 32k-64k, and the processes are GPU-bound (14 at once were ~6x slower each): the 32x and 64x cells
# at n = 50 take a call of their own (MULTIPLES=32, then 64).
set -u
OUT=${OUT:-/tmp/fsb_out}
W=/tmp/fsb_work
mkdir -p "$OUT" "$W"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
CKPT=${CKPT:-.ckpt/ckpt_fs}
MINUTES=${MINUTES:-7.0}
N=${N:-50}
L=${TRAIN_LENGTH:-1024}
MULTIPLES=${MULTIPLES:-"1 2 4 8 16"}
lengths=()
for m in $(echo $MULTIPLES | tr ' ' '\n' | sort -n); do lengths+=($((L * m))); done
pids=()
for task in s-niah-1 s-niah-2 s-niah-3 mk-niah mv-niah mq-niah vt; do
  grid=(); [ "$task" = s-niah-1 ] && grid=(--grid)
  python3 -m freesolo.cli eval --ckpt "$CKPT" --attention fsb --task "$task" --lengths "${lengths[@]}" --n "$N" \
    "${grid[@]}" --minutes "$MINUTES" --quiet --out "$W/fsb_$task.json" > "$W/fsb_$task.log" 2>&1 &
  pids+=($!)
done
if [ "${RECALL:-0}" = 1 ]; then
  timeout 450 python3 benchmarks/fsb_recall.py --ckpt "$CKPT" --threads 4 --out "$W/fsb_recall_model.json" > "$W/fsb_recall_model.log" 2>&1
  echo "fsb_recall rc=$?"
fi
for pid in "${pids[@]}"; do wait "$pid"; done
grep -h "acc=" "$W"/fsb_*.log
[ -f "$W/fsb_recall_model.log" ] && tail -n 3 "$W/fsb_recall_model.log"
tar -C "$W" -cf "$OUT/fsb_cells.tar" .
ls -la "$OUT"
