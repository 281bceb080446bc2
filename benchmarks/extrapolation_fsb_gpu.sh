#!/usr/bin/env bash
# Issue 14, one GPU call: FS-B (on the FS weights, tau calibrated on training-like sequences) over the
# tasks at the lengths MULTIPLES (x the training length, evaluated shortest first), one `freesolo eval`
# process per task (each writes its JSON after every cell), and optionally (RECALL=1) the FS-B recall
# study on the model's keys (benchmarks/fsb_recall.py --ckpt) meanwhile. Run from the repository root with
# the committed checkpoint (or CKPT carried). $OUT receives fsb_cells.tar (one JSON and log per task, the study).
#   CKPT (benchmarks/results/checkpoints/ckpt_fs), MULTIPLES ("2 4 8 16 32 64"), MINUTES (8.0: eval deadline per process), N (50),
#   TRAIN_LENGTH (1024), RECALL (0), SELECTION_CHUNK (16384: `freesolo eval --selection-chunk`, the
#   torch selection's chunk = min(length, it): FS-B's search is launch-bound, long chunks cut its launches),
#   CELLS ("task@length+first ...": instead of MULTIPLES, continue cells cut short at sample `first`;
#   the report pools them with the earlier records: `extend_records`). The environment passes through:
#   FREESOLO_TRITON_FSB_SEARCH=triton runs the Triton FS-B search instead of the torch one (once
#   proofs_tests/test_triton_fsb_search.py has passed on the GPU).
# Measured 2026-12-01 (H200): FS-B's torch selection costs ~0.4 s per sample up to 8k and ~4 s at
# 32k-64k, and the processes are GPU-bound (14 at once were ~6x slower each): the 32x and 64x cells
# at n = 50 take a call of their own (MULTIPLES=32, then 64). Then (same day) the two forests were
# searched in one pass and the selection chunk made as long as the sequence (SELECTION_CHUNK): the
# search's launches per 32k-64k forward fell ~5x.
set -u
OUT=${OUT:-/tmp/fsb_out}
W=/tmp/fsb_work
mkdir -p "$OUT" "$W"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
CKPT=${CKPT:-benchmarks/results/checkpoints/ckpt_fs}
MINUTES=${MINUTES:-8.0}
N=${N:-50}
L=${TRAIN_LENGTH:-1024}
MULTIPLES=${MULTIPLES:-"2 4 8 16 32 64"}
CHUNK=${SELECTION_CHUNK:-16384}
lengths=()
for m in $(echo $MULTIPLES | tr ' ' '\n' | sort -n); do lengths+=($((L * m))); done
if [ "${PROBE:-1}" = 1 ]; then  # one process alone first: seconds per FS-B forward, and where they go
  timeout 90 python3 benchmarks/fsb_eval_probe.py --ckpt "$CKPT" --lengths 4096 32768 65536 --selection-chunk "$CHUNK" > "$W/fsb_probe.log" 2>&1
  echo "fsb_probe rc=$?"; grep "one forward" "$W/fsb_probe.log"
fi
END=$((SECONDS + ${MINUTES%.*} * 60))  # one deadline for every eval of this call
pids=()
for task in s-niah-1 s-niah-2 s-niah-3 mk-niah mv-niah mq-niah vt; do
  grid=(); [ "$task" = s-niah-1 ] && grid=(--grid)
  if [ -z "${CELLS:-}" ]; then
    python3 -m freesolo.cli eval --ckpt "$CKPT" --attention fsb --task "$task" --lengths "${lengths[@]}" --n "$N" \
      "${grid[@]}" --minutes "$MINUTES" --selection-chunk "$CHUNK" --quiet --out "$W/fsb_$task.json" > "$W/fsb_$task.log" 2>&1 &
  else  # CELLS="task@length+first ...": continue cut cells (`freesolo eval --first`), in the given order, one JSON each
    (
      for cell in $CELLS; do
        [ "${cell%%@*}" = "$task" ] || continue
        rest=${cell#*@}; length=${rest%%+*}; first=${rest#*+}
        left=$((END - SECONDS)); [ "$left" -gt 5 ] || { echo "skipped $cell: past the deadline"; continue; }
        python3 -m freesolo.cli eval --ckpt "$CKPT" --attention fsb --task "$task" --lengths "$length" --n "$N" --first "$first" \
          "${grid[@]}" --minutes "$(python3 -c "print($left / 60)")" --selection-chunk "$CHUNK" --quiet --out "$W/fsb_${task}_${length}_from$first.json"
      done
    ) > "$W/fsb_$task.log" 2>&1 &
  fi
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
