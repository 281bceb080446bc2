#!/usr/bin/env bash
# Issue 14, one GPU call: FS-B (on the FS weights, tau calibrated on training-like sequences) over every
# task and length of the table, as parallel `freesolo eval` processes (FS-B's torch selection leaves the
# GPU mostly idle: one process per (task, group of lengths)), and the FS-B recall study on the model's
# keys (benchmarks/fsb_recall.py --ckpt) meanwhile. Run from the repository root with .ckpt/ckpt_fs
# present (carried). $OUT receives fsb_cells.tar (one JSON per process, logs) and the recall study.
#   CKPT (.ckpt/ckpt_fs), MINUTES (7.0: eval deadline per process), N (50), TRAIN_LENGTH (1024)
set -u
OUT=${OUT:-/tmp/fsb_out}
W=/tmp/fsb_work
mkdir -p "$OUT" "$W"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
CKPT=${CKPT:-.ckpt/ckpt_fs}
MINUTES=${MINUTES:-7.0}
N=${N:-50}
L=${TRAIN_LENGTH:-1024}
# two groups of lengths per task with about equal FS-B cost (32x and 64x dominate)
GROUPS_OF_MULTIPLES=("32 1 2" "64 4 8 16")
pids=()
for task in s-niah-1 s-niah-2 s-niah-3 mk-niah mv-niah mq-niah vt; do
  for g in "${!GROUPS_OF_MULTIPLES[@]}"; do
    lengths=()
    for m in ${GROUPS_OF_MULTIPLES[$g]}; do lengths+=($((L * m))); done
    grid=(); [ "$task" = s-niah-1 ] && grid=(--grid)
    python3 -m freesolo.cli eval --ckpt "$CKPT" --attention fsb --task "$task" --lengths "${lengths[@]}" --n "$N" \
      "${grid[@]}" --minutes "$MINUTES" --quiet --out "$W/fsb_${task}_$g.json" > "$W/fsb_${task}_$g.log" 2>&1 &
    pids+=($!)
  done
done
timeout 450 python3 benchmarks/fsb_recall.py --ckpt "$CKPT" --threads 4 --out "$W/fsb_recall_model.json" > "$W/fsb_recall_model.log" 2>&1
echo "fsb_recall rc=$?"
for pid in "${pids[@]}"; do wait "$pid"; done
grep -h "acc=" "$W"/fsb_*.log
tail -n 3 "$W/fsb_recall_model.log"
tar -C "$W" -cf "$OUT/fsb_cells.tar" .
ls -la "$OUT"
