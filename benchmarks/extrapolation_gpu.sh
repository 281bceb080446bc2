#!/usr/bin/env bash
# Issue 14 in one GPU call (about 8.5 minutes on one H200), from the repository root:
#
#   bash benchmarks/extrapolation_gpu.sh                 # oneshot: dense + FS + FS-L (from FS), then evaluation
#   MODE=model WHICH=fs bash benchmarks/extrapolation_gpu.sh     # one model, longer training, every task
#   MODE=model WHICH=fsl ...   # continues from $WORK/ckpt_fs or benchmarks/results/checkpoints/ckpt_fs
#   MODE=model WHICH=window ... / WHICH=dense ...
#   MODE=parallel JOBS="dense:6.5 window:6.5 fs:6.5 fs_lr1=fs:6.5" EXTRA_fs_lr1="--lr 1e-3" bash benchmarks/extrapolation_gpu.sh
#       several `model` runs at once on the one GPU (small models leave it mostly idle). A job is
#       [name=]which:minutes (train, then evaluate) or [name=]which:eval (evaluate .ckpt/ckpt_<name>); name
#       (default: which) names the work folder $WORK/<name> and the checkpoint ckpt_<name>; EXTRA_<name>
#       holds more `freesolo train` flags. fsl continues from the fs job of the same call (it starts when
#       that checkpoint is saved), else from .ckpt/ckpt_fs. CONTINUE=1: a training job continues from
#       .ckpt/ckpt_<name> when it exists (more steps for an earlier call's model). An earlier
#       call's .ckpt/extrapolation_<name>.json is copied in for an eval job: its cells are not measured again.
#       .ckpt is git-ignored: name it in `carry`.
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
REST=(--n "${N:-50}" --n-fsb "${N_FSB:-20}" --backend "$BACKEND" --train-length "$TRAIN_LENGTH")
ARGS=(--total-minutes "$TOTAL_MINUTES" "${REST[@]}")
COMMON=(--out "$WORK" "${ARGS[@]}")
{
  python3 -c "import torch, triton, freesolo; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), 'backends', freesolo.available_backends())"
  if [ "$MODE" = parallel ]; then
    pids=()
    names=()
    for job in ${JOBS:?set JOBS=\"[name=]which:minutes|eval ...\"}; do
      spec=${job#*=}; name=${job%%=*}; [ "$name" = "$job" ] && name=${spec%%:*}
      which=${spec%%:*}; what=${spec#*:}
      names+=("$name")
      mkdir -p "$WORK/$name"
      # an evaluation job resumes an earlier call's results (a training job makes new weights: fresh results)
      [ "$what" = eval ] && [ -f ".ckpt/extrapolation_$name.json" ] && cp ".ckpt/extrapolation_$name.json" "$WORK/$name/extrapolation.json"
      extra=(--name "ckpt_$name")
      if [ "$what" = eval ]; then extra+=(--ckpt ".ckpt/ckpt_$name"); else extra+=(--train-minutes "$what"); fi
      wait_for=""
      if [ "$which" = fsl ] && [ "$what" != eval ]; then
        case " $JOBS " in
          *" fs:"[0-9]*) wait_for="$WORK/fs/ckpt_fs/task.json"; extra+=(--init-from "$WORK/fs/ckpt_fs") ;;
          *) [ -d .ckpt/ckpt_fs ] && extra+=(--init-from .ckpt/ckpt_fs) ;;
        esac
      elif [ "${CONTINUE:-0}" = 1 ] && [ "$what" != eval ] && [ -d ".ckpt/ckpt_$name" ]; then
        extra+=(--init-from ".ckpt/ckpt_$name")
      fi
      var="EXTRA_$name"
      # shellcheck disable=SC2206
      more=(${!var:-})
      [ ${#more[@]} -gt 0 ] && extra+=(--train-extra "${more[@]}")
      if [ -n "$wait_for" ]; then  # start when the checkpoint it continues from is saved; same overall deadline
        (t0=$SECONDS; while [ ! -f "$wait_for" ] && [ $((SECONDS - t0)) -lt 900 ]; do sleep 3; done
         left=$(python3 -c "print(max(0.5, $TOTAL_MINUTES - ($SECONDS - $t0) / 60))")
         python3 benchmarks/extrapolation.py model --which "$which" --out "$WORK/$name" --total-minutes "$left" "${REST[@]}" "${extra[@]}") > "$WORK/$name/log.txt" 2>&1 &
      else
        python3 benchmarks/extrapolation.py model --which "$which" --out "$WORK/$name" "${ARGS[@]}" "${extra[@]}" > "$WORK/$name/log.txt" 2>&1 &
      fi
      pids+=($!)
    done
    # SIDE: a command run meanwhile (e.g. GPU correctness tests, whose timing does not matter); its log in results.tar
    if [ -n "${SIDE:-}" ]; then bash -c "$SIDE" > "$WORK/side.log" 2>&1; echo "=== side (rc $?)"; tail -n 5 "$WORK/side.log"; fi
    for pid in "${pids[@]}"; do wait "$pid"; done
    exit_results=()
    for name in "${names[@]}"; do
      echo "=== $name"; cat "$WORK/$name/log.txt"
      cp "$WORK/$name/extrapolation.json" "$WORK/extrapolation_$name.json" 2>/dev/null
      exit_results+=("$WORK/$name/extrapolation.json")
    done
    # one file for the small outputs (the device returns at most 8 files): per-job JSON, side log, train logs
    (cd "$WORK" && tar -cf "$OUT/results.tar" extrapolation_*.json side.log side_out */log.txt */ckpt_*/train_log.json 2>/dev/null)
    python3 benchmarks/extrapolation.py report --results "${exit_results[@]}" --merged "$WORK/extrapolation.json" --out-dir "$WORK/report"
  elif [ "$MODE" = model ]; then
    python3 benchmarks/extrapolation.py model --which "${WHICH:?set WHICH=dense|window|fs|fsl}" --train-minutes "$TRAIN_MINUTES" "${COMMON[@]}"
  else
    # shellcheck disable=SC2086
    python3 benchmarks/extrapolation.py oneshot "${COMMON[@]}" --models $MODELS
  fi
  [ "$MODE" = parallel ] || python3 benchmarks/extrapolation.py report --results "$WORK/extrapolation.json" --out-dir "$WORK/report"
} 2>&1 | tee "$OUT/log.txt"
[ "$MODE" = parallel ] || cp "$WORK/extrapolation.json" "$OUT/" 2>/dev/null
for c in "$WORK"/ckpt_* "$WORK"/*/ckpt_*; do
  [ -d "$c" ] && tar -C "$(dirname "$c")" -cf "$OUT/$(basename "$c").tar" "$(basename "$c")"
done
ls -la "$OUT"
