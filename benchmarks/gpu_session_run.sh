#!/usr/bin/env bash
# One H200 call that measures and checks what a session changed (run from the repository root with
# $OUT set). Every step has its own timeout so that a slow step cannot starve the rest; everything
# lands in $OUT/session.tar (the device returns at most 8 files) plus $OUT/summary.txt.
#   issue 13: 64k generation (FS-L vs dense, tokens/s, cache memory) and a converted tiny Llama trained under torch.compile
#   issue 9:  torch backend forward lines of gpu_attention.py and the CUDA L11/L12/torch tests
#   issues 10-12: CUDA tests of the Triton forward / backward / decode, backward and decode A/B benchmarks
set -u
OUT=${OUT:-/tmp/session_out}
W=/tmp/session_work
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=ci PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
step() {  # step NAME SECONDS COMMAND...: run with a timeout, log to $W/NAME.log, one summary line
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" >"$W/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0)) s: $(tail -n 1 "$W/$name.log")" | tee -a "$OUT/summary.txt"
}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/summary.txt"
step generate 100 python3 -m freesolo.models.bench generate --T 65536 --new 128 --backend triton --decode-kernel auto --cuda-graph --out "$W/model_generate_h200.json"
step convert_train 75 python3 -m freesolo.models.bench convert-train --steps 30 --backend triton --out "$W/model_convert_train_h200.json"
step torch_fwd 80 python3 benchmarks/gpu_attention.py --providers freesolo_fsl freesolo_fs freesolo_fsb sdpa_causal --lengths 4096 16384 65536 --shapes H16-D64 --budget-s 60 --out "$W" --tag _torch_l12
step cuda_tests 165 python3 -m pytest -q -n 14 -p no:benchmark -k "cuda or gpu" proofs_tests/test_row_independence.py proofs_tests/test_packed.py proofs_tests/test_torch_cuda.py proofs_tests/test_models.py proofs_tests/test_triton_backward.py proofs_tests/test_triton_decode.py proofs_tests/test_cache_gpu.py proofs_tests/test_cache_ragged.py proofs_tests/test_triton_attention.py proofs_tests/test_triton_backend.py proofs_tests/test_triton_selection.py
step bwd_bench 55 python3 benchmarks/triton_backward_bench.py --lengths 4096 16384 65536 --no-api --no-profile --rep 30 --out "$W/triton_backward_ab.json"
step decode_bench 55 python3 benchmarks/gpu_decode.py --batches 1 32 --contexts 4096 65536 1048576 --tiles single split --out "$W" --name gpu_decode_ab
tar -C "$W" -cf "$OUT/session.tar" .
ls -la "$OUT"
