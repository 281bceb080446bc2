#!/usr/bin/env bash
# One H200 call that measures and checks what a session changed (run from the repository root with
# $OUT set). Every step has its own timeout so that a slow step cannot starve the rest; everything
# lands in $OUT/session.tar (the device returns at most 8 files) plus $OUT/summary.txt.
# STEPS picks the steps (default: "s33a_tests s33a_probe";
# pass timeout_s 600, read summary.txt):
#   tests_split  CUDA tests of the Triton forward / backward / API / L11-L12 with the split long kernel
#                (FREESOLO_TRITON_LONG_BLOCK=64 FREESOLO_TRITON_MAXNREG=128: the proposed 16-bit default)
#   sanitize     compute-sanitizer memcheck and racecheck of every Triton kernel (benchmarks/sanitize_triton.py)
#   bwd_split    fwd+bwd A/B of the backward bench with the split forward (issue 11's ratios)
#   train_step   one training step, FS-L (Triton, split forward) vs SDPA vs FlexAttention SWA-512 (issue 11)
#   tests_torch  issue 9: CUDA tests of the torch backend (L11 / L12 with every readout layout, FREESOLO_TORCH_READOUT)
#   tests_decode issue 12: the fused decode's CUDA tests, the paper-size Triton boundary cases included (fixed on
#                the CPU in 2e35fb3: a strict xfail that XPASSes confirms the fix; then drop the xfail and the refusal)
#   fsb_probe    issue 14: where FS-B evaluation time goes (benchmarks/fsb_eval_probe.py)
#   fsb_debug    issue 12: benchmarks/fsb_search_debug.py (small cases at 4 / 2 / 1 warps, TRITON_DEBUG, per-level trace)
#   sanitize_fsb memcheck + racecheck of the FS-B search and the decode kernels only (the FS-L boundary fix included)
#   tests_fsb    issue 12: the Triton FS-B search's tests on CUDA (proofs_tests/test_triton_fsb_search.py)
#   fsb_bench    issue 12: FS-B selection, torch search vs Triton search, same run (benchmarks/fsb_search_bench.py)
#   bwd_64k      issue 11: fwd+bwd at 64k only (the 60 s bwd_split step could not reach it), API timing included
#   torch_ab     issue 9: the torch readout formulations (benchmarks/torch_readout_ab.py)
#   l12_ab       issue 9: the torch backend before the L12 fix (.ab/pre_l12, carried) against HEAD, same run
#   fsb_long     issue 12: the Triton FS-B search alone at 256k and 1M
#   fsb_prefill  issue 12: triton_fsb (Triton search) against triton_fs, forward, 64k ... 1M (gpu_attention.py)
#   tests_fsbd   issue 12: CUDA tests touched by the Triton FS-B decode search (FS-B search, models, caches, decode)
#   fsb_decode   issue 12: FS-B decode step, torch search vs Triton search vs SDPA, 4k ... 1M (fsb_decode_bench.py)
#   decode_tiles issue 12: FS-L fused decode at B 1 / 32 over DecodeTiles variants (occupancy at B 32), gpu_decode.py
#   tests_s21    issue 12: CUDA tests of the fused FS-B step and its CUDA graph (search, decode, caches, models)
#   decode_tiles2 issue 12: FS-L and FS fused decode at 4k / 1M, B 1 / 32, the low-warp split variants
#   fsb_decode3  issue 12: FS-B decode, torch step vs fused step (eager, CUDA graph) vs SDPA at 4k / 64k / 1M
#   fwd_sweep    issue 10: window-kernel tile sweep of the FS-L forward at 64k (triton_forward_ab.py --sweep-only)
#   bwd_sweep    issue 11: backward tile sweep at 64k (local and long kernels; triton_backward_bench.py --sweep)
#   fsb_decode4  issue 12: fsb_decode_bench at 64k / 1M with the search launch alone at 1 / 2 / 4 warps
#   bwd_bars     issue 11: fwd+bwd at 4k / 64k with SDPA, Flex and the API (the bars), s21 tiles
#   fla_install  the fla-core wheel carried in .whl (fla_nsa provider)
#   attention    issues 10 / 11: gpu_attention.py fwd and fwd+bwd, triton_fsl / triton_fs vs SDPA, Flex SWA, fla NSA
#   fsb_prefill2 issue 12: the Triton FS-B search (sorted beam selection) alone at 64k / 256k / 1M
#   decode_full  issue 12: gpu_decode.py with the s21 default tiles against the single kernel, 4k ... 1M, B 1 / 32
#   memcheck_fsb compute-sanitizer memcheck of the FS-B search (sorted selection) and the decode kernels
#   profile_fwd  issues 10 / 11: per-kernel GPU time of the triton FS-L forward and fwd+bwd at 4k and 64k
#   tests_s22    issue 12: CUDA tests of the sync-free FS-B carries (Triton tree builder; decode, caches, models; build kernel)
#   sanitize_s22 memcheck + racecheck of the FS-B tree builder and the decode path (FS-B carries included)
#   fsb_decode5  issue 12: fsb_decode_bench at 64k / 1M with the sync-free, one-launch-per-slot forest carries
#   fsb_decode6  issue 12: fsb_decode_bench at 1M, the builder's kernels compiled at the cache's allocation
#   boundary_probe issue 12: an FS-B block boundary in a CUDA-graph decode loop, isolated vs pipelined (fsb_boundary_probe.py)
#   tests_l10    issue 12: the CUDA L10 test of the GPU-grown FS-B forests (+ the FS-B fused decode / graph tests)
#   racecheck_build compute-sanitizer racecheck of the FS-B tree builder
#   tests_s22b   the CUDA tests of the sync-free FS-B boundaries only (builder, decode, CUDA graph, caches)
#   attn_nf      issues 10 / 11: triton FS-L / FS (check_finite=False) vs SDPA and Flex SWA-512, fwd and fwd+bwd, 4k / 64k
#   score_sweep  issue 10: ScoreTiles variants of the scoring + top-K kernel (benchmarks/score_tiles_sweep.py)
#   memcheck_build  compute-sanitizer memcheck of the FS-B tree builder
#   tests_sel    issue 10: CUDA tests of the Triton forward (the early-exit scoring + top-K kernel, s22)
#   racecheck_score compute-sanitizer racecheck of the forward kernels (scoring + top-K included)
#   host_probe   issues 10 / 11: host time per layer of a 4k triton FS-L forward (benchmarks/host_overhead_probe.py)
#   fsb_decode7  issue 12: FS-B decode at 1M, 400 steps (3 boundaries in the CUDA-graph phase), wall clock per step
#   attention_s23 issues 10 / 11: gpu_attention fwd and fwd+bwd at 4k / 16k / 64k, triton FS-L / FS (per-chunk FS-L
#                candidate kernel, scan step 32) vs SDPA, Flex SWA-512 and fla NSA (needs fla_install first)
#   score_1m     issue 10: the score / candidate sweep at 64k and 1M, scan steps 32 and 64
#   tests_fwd    CUDA tests of L11 / L12 and the models (the new candidate kernel inside the triton backend)
#   sanitize_fwd memcheck + racecheck of the forward / backward kernels (the new candidate kernel included)
#   attention_128k issue 10: the forward at 128k (triton FS-L / FS, SDPA, Flex SWA-512, fla NSA; peak memory)
#   attn_s23b    issues 10 / 11: triton FS-L / FS vs SDPA and Flex SWA-512, fwd and fwd+bwd, 4k / 16k / 64k, after the
#                host-time cuts (plain-Python next_pow2 / cdiv, cached config string, eager autograd.Function path)
#   flex_fsl     issue 10: triton FS-L vs FS-L written with FlexAttention over the torch backend's selection, and SDPA,
#                forward at 16k / 64k, same run
#   tests_into_out issue 10: the CUDA tests of the Triton forward / backward / API / L11-L12 / models with
#                FREESOLO_TRITON_LONG_INTO_OUT=1 (the long term written into o: opt-in since s23, not yet run on a GPU)
#   into_out_ab  issue 10: triton FS-L forward at 64k / 128k with and without FREESOLO_TRITON_LONG_INTO_OUT=1 (time and
#                peak memory, SDPA in both runs)
#   tests_s24    the CUDA tests of the Triton forward / backward / selection / API / L11-L12 / models with the s24
#                defaults (long term into o, rotated keys per chunk of query tiles, int32 selections, erf skip)
#   score_s24    issue 10: ScoreTiles with / without erf_skip and count_rounds at FS-L 64k, FS 16k / 64k
#   attn_s24     issues 10 / 11: triton FS-L / FS vs SDPA and Flex SWA-512, fwd at 4k ... 128k (peak memory),
#                fwd+bwd at 4k / 16k / 64k
#   sweep_s24    issue 10: score kernel tiles (block_m 32 / 64, block_n 16 / 32, warps 2 ... 8) at FS-L / FS 64k,
#                and the long kernel's rows / warps with the long term written into o (triton_forward_ab --sweep-only)
#   attn_final   issues 10 / 11: the s24 final figures, same run: triton FS-L / FS, SDPA, Flex SWA-512 and fla NSA,
#                fwd at 4k ... 128k (peak memory), fwd+bwd at 4k / 16k / 64k (needs fla_install first)
#   score_f32    issue 10: the scoring kernel's top-K on fp32 scores + cells (ScoreTiles.fp32_keys) against the int64
#                keys, FS-L 64k, FS 16k / 64k (every variant's selection must equal the default's)
#   attn_f32     issues 10 / 11: triton FS-L / FS vs SDPA and Flex SWA-512, fwd at 4k ... 128k, same run
#   tests_f32    CUDA tests of the Triton selection and L11 / L12 (the fp32_keys scoring kernel), then memcheck of
#                the forward / backward kernels
#   graph4k      issues 10 / 11 (s25): the GPU time without the per-call host work: triton FS-L and SDPA eager and
#                captured in a CUDA graph (`*_graph` providers, written in s24, never run on a GPU), fwd and fwd+bwd at
#                4k / 16k, + the CUDA test of a training step without host syncs, captured in a graph
#   gate         issue 10 (s25): the scoring kernel's row-maximum gate (ScoreTiles.row_max_gate, on by default with
#                count_rounds): CUDA tests of the selection / L12 / backend, the score sweep at FS-L 64k and FS 16k / 64k
#                (gate on / off, block_n 16 / 32 / 64), the API forward at 16k / 64k (FS-L / FS, SDPA, Flex SWA-512)
#   chunks       issue 10 (s25): the scoring kernel's chunk helper (FS: unmasked full chunks read through a
#                loop-invariant int32 offset tile, int32 offsets inside a head's statistics) and num_stages:
#                CUDA tests of the selection / L12 / backend / attention, the score sweep, the API forward at
#                16k / 64k / 128k (FS-L / FS, SDPA, Flex SWA-512)
#   final25      issues 10 / 11 (s25): the new scoring defaults (one stage, FS without the gate): CUDA tests of the
#                selection / L12 / backend / attention / backward / packed / models, the score sweep, the same-run
#                figures (fwd 4k ... 128k with fla NSA and peak memory, fwd+bwd 4k / 16k / 64k; needs fla_install),
#                memcheck + racecheck of the forward / backward kernels
#   last25       issues 10 / 11 / 12 (s25): FS-L scoring 32 candidates per step: CUDA tests of the selection / L12 /
#                backend / attention / models; fwd at 64k / 128k (FS-L, SDPA, Flex SWA-512); the CUDA-graph
#                figures at 4k / 16k (fwd, fwd+bwd); triton_fs vs triton_fsb forward at 256k / 1M (issue 12's ratio)
#   wfirst       issue 10 (s26's first call): the opt-in window-first forward (AttentionTiles.window_first,
#                FREESOLO_TRITON_WINDOW_FIRST=1: the window kernel first, the selection + unions on a side stream
#                beside it, then the long kernel adds its term; written in s25, never run on a GPU): the CUDA tests of
#                the backend (window-first vs default, the graph-captured training step with and without it) and of
#                the forward / L12 with it on; the API forward at 16k / 64k / 128k with and without it (SDPA / Flex
#                in both runs); the per-kernel profile with it on
#   realkeys     issue 10 (s26): triton FS-L on a trained model's own q / k / v (ckpt_fsl reading a 64k S-NIAH-1 sample)
#                vs iid inputs of the same shape, with SDPA and Flex SWA-512 on the same tensors, and the mean
#                64-query union per layer (benchmarks/real_keys_bench.py, written in s25, dry-run only)
#   overlap      issue 10 (s26): the side stream at high priority and the long kernel over aligned pairs of cells
#                (AttentionTiles.long_group = 2): the CUDA tests of the forward (pairs vs the oracle / torch backend,
#                the union kernel with groups) and the backend; benchmarks/forward_overlap_ab.py (split / window-first
#                at priority -1 and 0 / pairs / both; API, CUDA graph and host time; SDPA / Flex in the same run)
#   final26      issues 10 / 11 (s26, window-first forward as the default): the CUDA tests of the selection / L12 /
#                backend / attention / backward / packed / models; the same-run figures with fla NSA (fwd 4k ... 128k,
#                fwd+bwd 4k / 16k / 64k; needs fla_install), the CUDA-graph figures at 4k / 16k; memcheck + racecheck
#                of the forward / backward kernels (the side stream included)
#   wf_noise     issue 10 (s26): is the FS-L API time at 4k / 16k (host-bound) higher with the window-first default?
#                final26's first process measured 1.15 ms at 4k and 16k, a later one 0.57 / 0.62: six processes
#                alternating FREESOLO_TRITON_WINDOW_FIRST=1 / 0, each timing triton_fsl fwd at 4k / 16k (and SDPA),
#                then the host-overhead probe at 4k with each setting
#   bimodal      issue 10 (s26): benchmarks/host_bimodal_probe.py in six processes (do_bench, host and synced time per
#                call, allocator mallocs / frees / syncs and garbage collections during the timed calls)
#   devguard     s26: the entry points run under `backend.on_device_of` (the tensors' CUDA device current while
#                Triton launches): the CUDA tests of the backend and the fused decode (CUDA graphs included)
#   sorted       issue 10 (s27): the long tiles sorted by selection (AttentionTiles.sorted_long, the new default):
#                the CUDA tests of the forward / backend / L12 / packed; forward_overlap_ab.py wfirst vs sorted (API,
#                graph, host, long kernel alone, unions + order) at 4k ... 128k and FS 64k; the API forward and its
#                peak memory at 64k / 128k with SDPA / Flex in the same run
#   chunks27     issue 10 (s27): the order's chunk (2048 / 4096 / 8192 positions) A/B through the API at 16k / 64k /
#                128k; the API forward at 16k / 32k / 64k with SDPA / Flex / fla NSA (fla_install first); the per-kernel
#                profile at 64k
#   final27      issues 10 / 11 (s27, sorted long tiles as the default from 32k): the CUDA tests of the selection / L12 /
#                backend / attention / backward / packed / models; the same-run figures with fla NSA (fwd 4k ... 128k,
#                fwd+bwd 4k / 16k / 64k; needs fla_install); memcheck + racecheck of the forward / backward kernels
#                (sorted long tiles included)
#   lb27         issue 10 (s27): the order decoded in one kernel; sorted long tiles of 64 / 32 / 16 queries
#                (forward_overlap_ab.py, 64k / 128k) and the API forward at 64k / 128k with
#                FREESOLO_TRITON_LONG_BLOCK=64 / 32 (SDPA / Flex in each run); the CUDA tests of the forward / backend /
#                L12 with long_block 32; memcheck of the forward / backward kernels (the order decode included)
#   ab28_*       issue 10 (s28 call1, commit 272bdfb): the CUDA tests of the selection / attention / backend / L12 /
#                packed sequences with FREESOLO_TRITON_LONG_BOUND=1 FREESOLO_TRITON_FSL_TAIL=1 (then opt-in); the scoring
#                tiles with and without the FS-L tail chunk (score_tiles_sweep.py, 16k / 64k / 128k); the forward with
#                the long kernel's fixed logit bound off / on (forward_overlap_ab.py sorted_online / sorted_bound in
#                272bdfb; slower, removed after that call, so ab28_fwd no longer runs)
#   final28      issue 10 / 11 (s28, the FS-L tail chunk as the default): the CUDA tests of the selection / L12 / backend /
#                attention / backward / packed / models; same-run figures with fla NSA (fwd 4k ... 128k, fwd+bwd 4k / 16k /
#                64k; needs fla_install), the forward with FREESOLO_TRITON_FSL_TAIL=0 (the s27 tiles) in the same call,
#                the GPU time in a CUDA graph (forward_overlap_ab.py sorted); memcheck + racecheck of the forward / backward
#   final28b     issue 10 (s28 third call: no statistics stored in a forward without gradients, the rotated keys in fewer,
#                larger chunks): the CUDA tests of the selection / L12 / backend / attention / packed / models; the same-run
#                forward figures with fla NSA (4k ... 128k, peak memory); the GPU time in a CUDA graph (forward_overlap_ab.py
#                sorted, 64k / 128k); host time per stage at 16k / 64k (host_overhead_probe.py)
#   probe28      issue 10 (s28): the long kernel's bounded softmax loop alone vs the online long kernel
#                (long_bound_probe.py, 64k / 128k); host time per stage of the FS-L forward at 4k / 16k (host_overhead_probe.py)
#   fsb_long2    issue 12: the Triton FS-B search alone at 256k and 1M (sorted beam selection), last in the s22 call
#   s29a         s29's first call: the CUDA tests of the selection / L12 / backend / attention / backward / packed /
#                models at 7991462 (the no-statistics forward's runtime-flag stores into the fp32 placeholder, never run
#                on a GPU), memcheck + racecheck of the forward / backward kernels, and where the host time of a 4k /
#                16k call goes (benchmarks/launch_host_probe.py: Triton's launch path against a direct launch)
#   s29b         s29's second call: the CUDA tests of the backend (the fast launch path `_common.launch` against
#                JITFunction.run, bitwise) / attention / L12; launch_host_probe.py --ab (fast launch off / on, same
#                process) and --torch-profile (aten ops and CUDA runtime calls: the host work outside the launches)
#   s29c         s29's third call (the fast launch path engaged: triton 3.6's launch hooks are empty HookChains, not
#                None; the backward's cell plan in Triton kernels, `cell_plan`): the CUDA tests (+ cell_plan's) of the selection / L12 / backend / attention / backward / packed / models;
#                launch_host_probe.py --ab --torch-profile at 4k / 16k; the same-run figures (fwd 4k ... 128k with fla
#                NSA and peak memory, fwd+bwd 4k / 16k / 64k; needs fla_install)
#   s29d         s29's fourth call (the code of call3): memcheck + racecheck of the forward / backward kernels (the
#                backward's cell-plan kernels included); one training step (train_step.py, 4k / 16k / 64k); the GPU
#                time in a CUDA graph (triton_fsl_graph / sdpa_causal_graph, fwd and fwd+bwd, 4k / 16k)
#   s29e         s29's last call (no slices when one rotation chunk holds the sequence; cached RoPE table views): the
#                CUDA tests of the attention / backend / L12; the same-run figures fwd and fwd+bwd at 4k / 16k / 64k
#                (triton_fsl, SDPA, Flex SWA-512, fla NSA; needs fla_install)
#   s30a_prof    s30's first call: per-kernel GPU time of the FS-L forward and fwd+bwd at 4k / 16k / 64k
#                (profile_triton.py, check_finite=False); where a 4k call's host time goes (launch_host_probe.py: launch
#                replay, cProfile by cumulative and by own time)
#   s30a_tests   s30's first call: the CUDA tests of the backward (the cell plan's shared binary search) / backend /
#                attention / decode (the decode and FS-B kernels through `_common.launch`: fast launch vs
#                JITFunction.run, bitwise) / FS-B search and tree builder / caches / models
#   s30b_tests   s30's second call: the CUDA tests of the backend (a CUDA graph replayed after a longer call
#                replaced the cached RoPE tables: the captured tables are kept alive)
#   s30b_host    issues 10 / 11: host time of a 4k FS-L call, fast launch off / on (launch_host_probe.py --ab; the
#                launch cache keyed by the kernel's id, the launcher's C function called directly)
#   s30b_compiled issues 10 / 11: triton FS-L eager / CUDA graph / torch.compile(mode="reduce-overhead") against SDPA
#                eager / reduce-overhead and Flex SWA-512, fwd and fwd+bwd at 4k / 16k / 64k (gpu_attention.py)
#   s30b_memcheck compute-sanitizer memcheck of the forward / backward kernels (the cell plan's shared binary search)
#   s30c_tests   s30's third call: the CUDA test of torch.compile(mode="reduce-overhead") over the triton backend
#                (CUDA-graph trees, no cudagraph skip, outputs and gradients equal to eager bit for bit)
#   s30c_train   issue 11: one training step at 4k / 16k, eager and under torch.compile(mode="reduce-overhead"), FS-L
#                (Triton) vs SDPA vs Flex SWA-512 (train_step.py, the *_compiled providers)
#   s30d_tests   s30's last call: the CUDA tests of the selection / L12 / backend / attention / backward / packed /
#                models / decode / FS-B search at the session's HEAD (the launcher's C function, cached backward tiles)
#   s30d_final   issues 10 / 11: the same-run figures at HEAD: triton FS-L / FS / FS-L compiled (reduce-overhead) vs SDPA,
#                Flex SWA-512 and fla NSA, fwd and fwd+bwd at 4k / 16k / 64k / 128k, peak memory (needs fla_install)
#   s30e_decode  issue 12 at the s30 HEAD (decode kernels through `_common.launch`): FS-L / FS fused decode (CUDA graph)
#                vs SDPA over the full cache at 4k / 64k / 256k / 1M, B 1 / 32 (gpu_decode.py, default tiles)
#   s30e_fsb     issue 12: triton_fsb (Triton search) vs triton_fs forward at 256k / 1M (gpu_attention.py)
#   s30f_rope    issues 10 / 11: tile sweep of the RoPE kernel (rows per program x warps, bitwise vs the default;
#                benchmarks/rope_sweep.py)
#   s30g_tests   s30's last call: the fast-launch / CUDA-graph / reduce-overhead CUDA tests of the backend and decode
#                (the record_jit_runs helper, torch._C through a plain import)
#   s30g_memcheck memcheck of the decode, FS-B search and tree-builder kernels (now launched through `_common.launch`)
#   s30g_racecheck racecheck of the forward / backward kernels (the cell plan's shared binary search)
#   s31a_host    issues 10 / 11: where a short FS-L call's host time goes: per call with the GPU idle at its start,
#                queued, and without the Triton launches (launch_host_probe.py --idle), 4k / 16k
#   s31a_attn    issue 10: triton FS-L vs fla NSA and SDPA, forward at 4k / 16k, same run (needs fla_install)
#   s31b_tests   the CUDA tests of the selection / L12 / backend (new: the selection overlap changes no bit) / attention /
#                backward / packed / models / decode / FS-B search (the s31 kernel refactors and the overlap threshold)
#   s31b_ab      the refactored backward / decode kernels against 5e9d696's, bitwise (kernel_refactor_ab.py; .ab carried)
#   s31b_overlap issues 10 / 11: the side stream at every length vs from OVERLAP_MIN_T (forward_overlap_ab.py), and the
#                host time per call with the GPU idle (launch_host_probe.py --idle) at the s31 default
#   s31b_attn    issues 10 / 11: triton FS-L / FS vs SDPA, Flex SWA-512 and fla NSA, fwd and fwd+bwd, 4k ... 128k, same run
#   s31c_tests   the CUDA tests of the attention / backend / L12 / packed / models (the one-chunk rotation rule)
#   s31c_ab      the FS-B fused decode step's refactored kernels against 5e9d696's, bitwise (cut off in call2)
#   s31c_overlap s30's forward (side stream everywhere, keys always chunked) vs s31's, 4k / 16k; the per-kernel profile at 16k
#   s31c_attn    as s31b_attn at the s31 HEAD
#   s31d_tests   the CUDA tests of the selection / backward / decode / FS-B search / caches at the s31 HEAD
#   s31e_memcheck memcheck of the forward / backward and decode kernels (the s31 refactors, the one-chunk rotation)
#   s31e_racecheck racecheck of the same kernels
#   s32a_race_decode racecheck of the decode kernels alone (as s31e: cuDNN's SDPA in the torch prefill included)
#   s32a_race_nocudnn the same with cuDNN's SDPA off (FREESOLO_SANITIZE_CUDNN=0): freesolo's kernels only
#   s32a_race_fwd racecheck of the forward / backward kernels alone
#   s32b_race_build racecheck of the FS-B tree builder on the decode's small trees (D 32, h 0 ... 4), per hazard
#                (--racecheck-report hazard: the two writes' values), 4 warps then 1 warp
#   s32b_repeat  the same builds repeated 200 times without a sanitizer: bitwise equal?
#   s32c_race_fsb racecheck (per hazard, cuDNN's SDPA off) of the FS-B decode alone, every tree build traced
#   s32c_repeat  the FS-B decode from the same inputs 20 times: outputs and cache state bitwise equal?
#   s32d_race    the tree builder without FP fusion: racecheck (per hazard, cuDNN's SDPA off) of the FS-B decode
#                alone, then of the decode / FS-B search / builder parts
#   s32d_tests   the CUDA tests of the tree builder, FS-B search, decode, caches and models (the builder without FP fusion)
#   s32d_repeat  repeated builds and FS-B decodes, bitwise
#   s32e_ab      the backward kernels with the shared rotation helpers against 7e4b0ed's (kernel_refactor_ab.py; .ab carried)
#   s32e_tests   the CUDA tests of the backward / backend / L12 / packed (the refactored backward kernels)
#   s32e_prof    per-kernel GPU time of FS-L fwd and fwd+bwd at 4k / 16k / 64k (no grad accumulation)
#   s32f_fsb_decode issue 12: FS-B decode at 1M, 400 steps in a CUDA graph (the tree builder without FP fusion)
#   s33a_tests   issues 10 / 11: the CUDA-graph cache's tests, then the backend / models / packed / L12 CUDA tests with the cache on
#   s33a_probe   issues 10 / 11: graph_cache_probe.py (FS-L 4k / 16k, cache on / off: ms, host us, memory, bits)
#   s33b_tests   the CUDA-graph cache's tests (counters reset by clear(), one foreach copy per direction, backward limit)
#   s33b_probe   graph_cache_probe.py with kernel profiles and idle host time; 16k with the backward graphed (FREESOLO_TRITON_GRAPHS=32768)
#   s33c_probe   graph_cache_probe.py at 4k with cProfile of the graphed calls (GPU idle at each start)
#   s33d_tests   graph-cache tests, backward / backend CUDA tests (dbeta skipped when beta needs no grad), backend / models / packed / L12 with the cache on
#   s33d_attn    gpu_attention.py at 4k / 8k / 16k after the dbeta skip (cache on / off, graph, SDPA, Flex)
#   s33e_tests   the graph cache with `copy_pairs` (one Triton launch for a call's copies in / out): its tests, backend / models CUDA tests with the cache on
#   s33e_probe   graph_cache_probe.py 4k / 8k: eager, graphs (copy_pairs), graphs_foreach (torch._foreach_copy_), same process
#   s33e_attn    gpu_attention.py 4k / 8k with copy_pairs (FS-L, FS, cache off, SDPA, Flex)
#   s33f_final   the session's HEAD (foreach copies, dbeta skip): the cache's tests, gpu_attention.py 4k ... 64k same run
#   s33g_modes   issue 11's 4k bar by backward long mode with the graph cache: cell (default), gather (deterministic), atomics (FREESOLO_DETERMINISTIC=0)
#   s33h_gpu_modes GPU time (one user CUDA graph of fwd+bwd) per backward mode: deterministic cell, cell / union / gather with atomics
#   s33i_tests   the graph cache's tests at the final HEAD (inference mode in the key; the gather backward stays eager)
#   s33a_attn    issues 10 / 11: gpu_attention.py, triton_fsl / triton_fs with and without the cache vs SDPA, Flex, 4k / 16k / 64k
#   s34a_tests   bound backward graphs (read the forward graph's buffers), int16 sort keys of the cell plan: the cache's tests, backward CUDA / cell-plan tests, backend / models / packed / L12 with the cache on
#   s34a_probe   graph_cache_probe.py 4k / 8k with kernel profiles (bound backward, int16 keys)
#   s34a_attn    gpu_attention.py 4k / 8k / 16k, fwd and fwd+bwd (FS-L, FS, cache off, one user graph, SDPA, Flex), same run
#   s34b_tests   lent statistics (copied only before the forward graph's next replay), constant beta, one memcpy per copy: the cache's tests, backend / models / packed / L12 with the cache on
#   s34b_memcheck memcheck of the forward / backward kernels (int16 keys of the cell plan)
#   s34b_probe   graph_cache_probe.py 4k / 8k with kernel profiles and cProfile
#   s34b_attn    gpu_attention.py 4k / 8k / 16k, fwd and fwd+bwd, same run
#   s34b_train   train_step.py 4k / 8k / 16k (4 layers of one shape: stale bindings refreshed) with the cache
#   s34c_tests   the session's HEAD: the cache's tests, backward CUDA / cell-plan tests
#   s34c_final   the session's HEAD: gpu_attention.py 4k / 8k / 16k / 64k fwd and fwd+bwd with fla_nsa (run fla_install first), same run
#   s34d_long_block the long kernel's query tile (FREESOLO_TRITON_LONG_BLOCK 16 / 32 / 64 default / 128) at 4k / 16k / 64k, fwd (API and one user graph), one process each
#   s34e_tests   the cache's tests (two streams replaying one graph), racecheck of the forward / backward kernels (int16 plan keys)
#   s35a_tma     issue 10: the window and long kernels with TMA tile loads against the production kernels, 4k / 16k / 64k (benchmarks/tma_ab.py)
#   s37a         issue 10: the s36 per-block FS-L candidate kernel (FREESOLO_TRITON_FSL_CAND=blocks, removed after this A/B: CUDA tests of selection / L12, profiles and gpu_attention fwd at 4k / 16k / 64k, chunks vs blocks), then s35a_tma's A/B
#   s37b_long    issue 10: the long readout alone: production kernel at other stages / without the hand prefetch, TMA variants (tma_ab.py --long-only)
#   s37c_tests   issue 10: the TMA long kernel (AttentionTiles.long_tma, FREESOLO_TRITON_LONG_TMA=1): CUDA tests of the forward / backend / L12 / packed / models / graph cache
#   s37c_ab      issue 10: long kernel A/B (pointer variants vs TMA, tma_ab.py with FREESOLO_TRITON_LONG_TMA=0), kernel profile, gpu_attention fwd 4k / 16k / 64k with TMA on / off, same call
#   s37d_attn    issue 10: gpu_attention fwd 4k / 16k / 64k with FREESOLO_TRITON_LONG_TMA=1 / 0, same call (s37c_ab trimmed to a short lease)
#   s37d_long    issue 10: the long kernel A/B (pointer variants vs TMA; tma_ab.py --long-only with the pointer kernel as production)
#   s37e_tests   s37c_tests on fewer files (forward / backend / graph cache / L12 with FREESOLO_TRITON_LONG_TMA=1), for a lease of ~4 minutes
#   s37e_attn    gpu_attention fwd 4k / 64k, FS-L with TMA on / off, SDPA, Flex SWA-512
#   s38a_san     issue 10: compute-sanitizer memcheck + racecheck of the forward / backward kernels with the TMA long readout (FREESOLO_TRITON_LONG_TMA=1)
#   s38a_lb      issue 10: FS-L fwd 4k / 64k through the API, TMA on, long tiles of 32 vs 64 queries (FREESOLO_TRITON_LONG_BLOCK)
#   s38b_tests   issue 10: CUDA tests of the forward / backend / L11-L12 / packed / models / graph cache at the default tiles (the TMA long readout on by default)
#   s38b_attn    issues 10: gpu_attention fwd 4k ... 128k, triton FS-L / FS vs SDPA, Flex SWA-512, fla NSA (needs fla_install), default tiles
#   s39a_tests   s38b_tests with a 540 s limit and the 25 slowest tests listed (a cold machine compiles every kernel)
#   s39b_fsb     issue 12: FS-B prefill selection split into forests / search / search + rerank, the rerank on bf16 vs float32 keys, the tile rerank (64k, 256k, 1M)
#   s39b_tests   s39a_tests + the FS-B search CUDA tests, 400 s
#   s39c_fsb     s39b_fsb with the tile rerank in 4 cells per step and the tile shapes 32x1 / 32x2 / 64x4 / 16x4 timed alone
#   s39d_tests   the CUDA tests of the forward / backend / graph cache / L12 at the default tiles (TMA long readout on) + the FS-B tile rerank tests, 330 s
#   s39e_tests   s39d_tests with the tile rerank the default, every FS-B search test, -rA (each test named), 345 s
#   s40a_fsb     (ran in s40 call2: the opt-in 4 / 8 / 16 / 32-query search, removed in s40; the step is gone)
#   s40b_tests   s39e_tests' CUDA tests without the CPU-only ones, -v (each finished test named in the log, so a
#                step killed at its limit still says which tests never finished), 290 s
#   s40b_ncu     issue 12: Nsight Compute of one _fsb_search_kernel launch at 64k (speed of light, memory, warp
#                states, scheduler, occupancy, instructions), --clock-control none
#   s40c_fsb     issue 12: the s40 one-query search (int32 frontier fields; node rows in chunks of 64 / 16 / 8 / 4
#                dims) against the s39 kernel (.ab/pre_s40: `git archive` of the s39 freesolo and benchmarks, carried)
#                same run, 64k / 256k / 1M (in call6 also the 4-query search, removed since)
#   s40c_tests   the CUDA tests of the FS-B search, decode, caches and models (the search's level step changed)
#   s40d_tests   the FS-B search's CUDA tests after the 4-query search's removal (the dim-chunk near-tie test)
#   s41a_fsb     issue 12 (branch s41-search-root): the root's key with all of D at once, and the search at maxnreg
#                88 / 80 / 72, against main (.ab/pre_s41:
#                `git archive main freesolo benchmarks` without benchmarks/results, carried), same run, 64k / 256k / 1M
#   s41a_tests   the FS-B search / decode CUDA tests on the branch
#   s41b_forest  issue 12: where the FS-B prefill forests spend their time (fsb_forest_phases.py, 256k / 1M)
#   s41c_tests   issue 12: the Triton forests' CUDA tests, then the FS-B search / decode / caches / models CUDA tests
#                (SEARCH_MAXNREG 72, the Triton forests by default)
#   s41c_fsb     issue 12: the forests' phases with the Triton builder; fsb_prefill_split with the Triton forests
#                against the torch ones (64k / 256k / 1M); triton_fsb vs triton_fs forward at 256k / 1M
#   s41d_probe   issue 12: fsb_dimchunk_probe.py with the Triton and the torch forests (the s41 call4 test failure)
#   s41e_fsb     issue 12: the search skipping the keys of levels that keep all their candidates (7fbaf4c, reverted
#                after this A/B: no gain at 1M), against 58acc8a (.ab/pre_s41b, carried), 64k / 256k / 1M;
#                triton_fsb vs triton_fs forward at 256k / 1M
#   s41e_tests   the FS-B forests / search / decode / caches / models CUDA tests
#   s44_time     (ran at 66066fc, branch s44-pair-layout: main no longer has the pair layout or the *_rows / *_sum1
#                providers) issue 12: the FS-B search on the pair tables (`fsb_search.search_tables`) against the
#                row tables (FREESOLO_TRITON_FSB_SEARCH_LAYOUT=rows), same process: search / select at 256k and 1M
#                (select_rows must equal select bit for bit; *_sum1: SEARCH_SUM_ONCE), then triton_fsb / triton_fs
#                forward at 1M
#   s44_tests    the FS-B search CUDA tests (the pair layout's bitwise test among them)
#   s44_tile     (ran at 63a067a, branch s44-tile-search: main has no tile search) issue 12: the tile search
#                (`fsb_tile_search`, default) against the one-query search (FREESOLO_TRITON_FSB_SEARCH_MODE=query), same process, search / select at 256k and 1M, then the FS-B
#                search CUDA tests (tile vs one-query near-ties among them)
#   s44_inter    (ran at 2d07f53, branch s44-interleave: main searches the forests one after the other) issue 12:
#                the two forests' levels interleaved in the one-query search (`_search_two_forests`, SEARCH_INTERLEAVE) against one after the other, same process: search / select at 256k and 1M
#                (select_seq must equal select bit for bit), then the FS-B search CUDA tests
#   s43_gqa_fs   issue 10: re-measure of the GQA-Hq32-Hkv8-D128 FS forward (s43 call2: 49.5 ms at 64k against 34.7
#                at 128k): per-kernel profile at 64k / 128k, then triton_fs / SDPA at 32k / 64k / 96k / 128k, rep 300 ms
#   s42_same / s42_time / s42_tests   issue 12, branch s42-search-trims (int32 row offsets in a kv head's table, D a
#                constexpr, erf skipped where every x >= ERF_ONE, the root's key only at levels with a root) against
#                .ab/pre_s42 (main's kernel, carried), one step each so a call cut at its limit keeps what ran: the
#                selections and beams at 256k bitwise, the search of both at 1M, the FS-B search CUDA tests
#   s42_h16      issues 10 / 12: the same-run table on the current code, H16-D64, 4k ... 128k, forward: triton
#                FS-L / FS / FS-B, SDPA, fla NSA (fla_install first), Flex SWA-512 (issue 10's bars printed)
#   s42_flexfsl  the forward of flex_fsl (FS-L through FlexAttention over the torch selection) at 16k / 64k
#   s42_long     the forward at 512k / 1M: triton FS-L / FS, Flex SWA-512
#   s42_gqa      as s42_h16, forward only, shape GQA-Hq32-Hkv8-D128
#   s41f         issue 12 (branch s42-joined-tables): the joined node table (no concatenation): the CUDA tests, phases at
#                1M, triton_fsb vs triton_fs forward at 1M (peak memory)
#   s41e_same    the selections and found beams of 58acc8a and HEAD at 256k (H 16, D 64, bf16), bitwise (its
#                .pt files, 2.4 GB, are deleted after the comparison: in call7 they filled the tar, which did not come back)
#   s39b_tile    the FS-B search CUDA tests with the tile rerank (FREESOLO_TRITON_FSB_RERANK=tile)
#   s33a_train   issue 11: train_step.py eager providers at 4k / 16k (the FS-L model's attention from the cache)
#   s45_prio     issue 10: the selection side stream at priority 0 vs the device's highest
#                (benchmarks/switch_ab.py, then named side_priority_ab.py: FS-L / FS through the API and in one user
#                graph, 4k ... 64k, SDPA)
#   s45_tests    the CUDA tests of the side stream (its priority, overlap), the graph cache and the backend
#   (s45_tl, s45_h16 and s45_bwd were written in s45 and never ran: no machine would start)
#   s45_tl       issue 10: timeline of the FS-L / FS forward's kernels in one CUDA-graph replay (forward_timeline.py),
#                4k / 64k, side stream at priority 0 and the highest
#   s45_h16      issue 10: the same-run H16-D64 forward table on the current code (as s42_h16 + s42_flexfsl, one run
#                each; fla_install first): triton FS-L / FS / FS-B, SDPA, fla NSA, Flex SWA-512 at 4k ... 128k, flex_fsl
#                at 16k / 64k; then --merge --supersede into results/gpu_attention.json
#   s45_bwd      issue 11 guard: FS-L fwd+bwd through the API against SDPA at 4k / 16k (the graphed backward)
#   s46_tests    the CUDA tests of the short-sequence FS-L candidate kernel (FREESOLO_TRITON_FSL_DIRECT_MAX_CELLS) and
#                the selection; the backend, L12, forward and graph-cache CUDA tests with that kernel up to 1024 cells
#   s46_direct   issue 10: FS-L candidates by the pool scan vs the direct sort (and the sort with the side stream at the
#                highest priority), API / user graph / select_cells, 4k ... 32k, SDPA same run (switch_ab.py)
#   s46_min      the smallest A/B of the direct candidates: 4k / 8k (API, graph, select_cells), timelines at 4k
#   s46_quick    s46_direct + s46_tl + the direct kernel's CUDA tests cut to ~4 minutes (4k / 8k / 16k; the timeline at 4k)
#   s46_sanitize memcheck + racecheck of the direct FS-L candidate kernel (sanitize_triton.py fsl_direct, ~1 min)
#   s48_min      issue 10's 4k bar at the s47 defaults: the side stream at the highest priority, the candidate sort
#                up to 1024 cells (32k), the long tiles sorted by selection at every length (and with the priority),
#                the tile unions written by the scoring kernel (FREESOLO_TRITON_FUSED_UNIONS=1, alone and with the
#                priority), against the defaults; 4k / 8k / 16k / 32k FS-L, 4k FS, 4k fwd+bwd (switch_ab.py, ~5 min)
#   s48_fused    base / fused unions (FREESOLO_TRITON_FUSED_UNIONS=1) at 4k / 8k / 16k FS-L, 4k FS, 4k fwd+bwd
#   s49_tiles    the tile-switch test on CUDA (a long-kernel launch capped at 64 registers: the same bits)
#   s49_graph    the graph cache's size limit: FS-L / FS API forward (+ fwd+bwd) at 16k / 32k, base (eager past 8k
#                tokens) against FREESOLO_TRITON_GRAPHS=2^25 with direct graphs and with copies in (~2 min)
#   s49_gtests   the graph-cache tests (CUDA ones incl.: forwards past the copy limit on graphs of their inputs)
#   s49_gab      FREESOLO_TRITON_GRAPH_DIRECT_MAX: 2^24 (the candidate default) against 0 (the default), FS-L / FS fwd at
#                8k / 16k / 32k (~1 min)
#   s49_lb       long tiles of 32 queries (FREESOLO_TRITON_LONG_BLOCK=32) against 64 at 4k / 8k FS-L, 4k FS (~1 min)
#   s49_t16      issue 10's same-run table at 4k / 16k only (FS-L / FS / SDPA / fla NSA / Flex SWA-512; carry .whl with fla_install)
#   s49_gprobe   graph_cache_probe.py at 8k / 16k: ms, host us, memory the cache holds (with
#                FREESOLO_TRITON_GRAPH_DIRECT_MAX=2^24: direct graphs past 8k), bits
#   s50_gqa      issue 10's same-run table for GQA-Hq32-Hkv8-D128 on the current code (FS-L / FS / FS-B / SDPA / fla NSA /
#                Flex SWA-512 at 4k-128k, flex_fsl at 64k; carry .whl with fla_install; ~3 min)
#   s50_bwd      forward + backward, H16-D64, at 4k / 16k / 64k: triton FS-L / FS, SDPA causal, Flex SWA-512 (~2 min)
#   s50_tests    the backend / L12 / attention / models CUDA tests with the graph cache on at its defaults
#                (FREESOLO_TRITON_GRAPHS= ; conftest turns it off otherwise), then with FREESOLO_TRITON_GRAPHS=1, so that
#                every forward without gradients up to 2^24 query elements takes the graphs on its inputs only
#   s50_long     the forward at 512k / 1M on the current code: triton FS-L / FS, Flex SWA-512 (as s42_long; ~30 s)
#   s50_lub      long_union_bound.py: the long kernel alone on the real FS-L selection and on one where every query of a
#                64-query tile shares its first query's cells (unions <= 4 cells), and the window kernel, at 4k / 16k / 64k
#   s50_gqa_prof per-kernel GPU time of the FS-L forward, GQA-Hq32-Hkv8-D128 at 4k / 64k (profile_triton.py; ~1 min)
#   s50_wt       FREESOLO_TRITON_WINDOW_TILES A/B: the window kernel's tile, FS-L fwd at 4k / 64k, GQA-Hq32-Hkv8-D128
#                (base 64x32x8x2, cap 128) and H16-D64 (base 64x64x4x2, cap 128), also without the cap (~3 min)
#   s51_info    `freesolo info` on the device (issue 10's acceptance: triton listed as available) and `freesolo decode
#               --graph` of FS-L / FS / FS-B at 64k (issue 12's acceptance: the fused path, per-token latency, cache memory)
#   s51_long    issue 10 deliverable 4: the T = 128k (bf16 / fp16 / fp32) and T = 2^20 forward tests against the torch
#               backend (proofs_tests/test_triton_long_gpu.py) and the 1M selection test
#   s51_san     compute-sanitizer memcheck + racecheck of the forward + backward at D 128 (the s51 window tile)
#   s51_fsbd32  issue 12: FS-B decode at B 32 (fused step, CUDA graph) vs SDPA at 4k / 64k (fsb_decode_bench.py --batch)
#   s51_dt1 / s51_dt2  issue 12: the decode / cache CUDA tests, then the FS-B search / forests / builder tests, on the
#               current code (two steps, so that a call cut short keeps the first; never ran: no device time left)
#   s51_retest  s51_tests' backward / models CUDA tests in one process (at -n 16 the long ones ran out of GPU memory)
#   s51_tests   the CUDA tests at the D 128 window tile as the default (64x64x4x2, no cap): attention / backend / L12 /
#               backward / models / graph cache
#   s50_wtests  the attention / backend / L12 CUDA tests with the D 128 candidate window tile (64x64x4x2, no register
#               cap; it applies to every D in this run, which covers D 64 as well)
#   s48_lreg     the long kernel's register cap (FREESOLO_TRITON_LONG_MAXNREG 96 / 80 / 72): ptxas registers, spills and
#                programs per SM (long_kernel_regs.py), A/B at 4k / 16k / 64k FS-L, 4k FS (~2 min)
#   s48_tests    the fused unions' tests (CUDA ones incl.), backend / L12 / attention / models / graph-cache CUDA tests
#                with FREESOLO_TRITON_FUSED_UNIONS=1
#   s48_sanitize memcheck + racecheck of the fused unions (sanitize_triton.py fused_unions: forward + backward, select_cells)
#   s48_tl       4k FS-L timelines of one graph replay: priority 0 / highest, with and without the fused unions; sorted tiles
#   s47_min      issue 10's 4k bar, both untested switches at once: base / direct FS-L candidates / cached graphs on the
#                caller's inputs (FREESOLO_TRITON_GRAPH_DIRECT) / both, 4k / 8k FS-L and 4k FS forward (API, user graph,
#                select_cells, same bits); the graph-cache tests (CUDA ones incl.), the direct kernel's tests, 4k timelines
#   s46_tl       issue 10: timelines of one graph replay at 4k / 16k, the scan (priority 0 and highest) and the direct sort
set -u
OUT=${OUT:-/tmp/session_out}
W=/tmp/session_work
rm -rf "$W"  # a warm machine keeps /tmp: start empty
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=ci PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
STEPS=${STEPS:-"s33a_tests s33a_probe"}
SPLIT=(env FREESOLO_TRITON_LONG_BLOCK=64 FREESOLO_TRITON_MAXNREG=128)
step() {  # step NAME SECONDS COMMAND...: run with a timeout, log to $W/NAME.log, one summary line
  local name=$1 secs=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  timeout "$secs" "$@" >"$W/$name.log" 2>&1
  local rc=$?
  local outcome; outcome=$(grep -E "^[0-9]+ (passed|failed)|^(=+ )?[0-9]+ (passed|failed)" "$W/$name.log" | tr '\n' ' ')
  echo "$name rc=$rc $((SECONDS - t0)) s: ${outcome:-$(tail -n 1 "$W/$name.log")}" | tee -a "$OUT/summary.txt"
  # after every step: a call killed at its limit keeps what ran. Files over 256 MB stay out (s41 call7: two 1.2 GB
  # tensors made the tar too large to come back, and every log with it)
  (cd "$W" && find . -type f -size -256M -print0) | tar -C "$W" --null -T - -cf "$OUT/session.tar"
}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/summary.txt"
step tests_split 200 "${SPLIT[@]}" python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k "cuda or gpu" proofs_tests/test_triton_attention.py proofs_tests/test_triton_backend.py proofs_tests/test_triton_backward.py proofs_tests/test_row_independence.py proofs_tests/test_packed.py proofs_tests/test_models.py
step tests_torch 120 python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k "cuda or gpu" proofs_tests/test_row_independence.py proofs_tests/test_packed.py proofs_tests/test_torch_cuda.py proofs_tests/test_torch_backend.py
step tests_decode 100 python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k "cuda or gpu" proofs_tests/test_triton_decode.py proofs_tests/test_cache_gpu.py proofs_tests/test_cache_ragged.py
step sanitize 240 bash -c "compute-sanitizer --tool memcheck python3 benchmarks/sanitize_triton.py && compute-sanitizer --tool racecheck python3 benchmarks/sanitize_triton.py"
step sanitize_fsb 200 bash -c "compute-sanitizer --tool memcheck python3 benchmarks/sanitize_triton.py fsb_search decode && compute-sanitizer --tool racecheck python3 benchmarks/sanitize_triton.py fsb_search decode"
step fsb_debug 120 python3 benchmarks/fsb_search_debug.py
step tests_fsb 150 env TRITON_DEBUG=1 python3 -m pytest -q -n ${NPROC:-8} -p no:benchmark proofs_tests/test_triton_fsb_search.py
step fsb_bench 180 python3 benchmarks/fsb_search_bench.py --lengths 4096 16384 65536 ${FSB_BENCH_ARGS:-} --out "$W/fsb_search.json"
step l12_ab 170 python3 benchmarks/torch_l12_ab.py --pre .ab/pre_l12 ${L12_AB_ARGS:-} --out "$W/torch_l12_ab.json"
step bwd_64k 100 "${SPLIT[@]}" python3 benchmarks/triton_backward_bench.py --lengths 65536 --no-profile --rep 30 --out "$W/triton_backward_64k.json"
step fsb_long 90 python3 benchmarks/fsb_search_bench.py --providers triton --lengths 262144 1048576 --out "$W/fsb_search_long.json"
step fsb_prefill 150 env FREESOLO_TRITON_FSB_SEARCH=triton "${SPLIT[@]}" python3 benchmarks/gpu_attention.py --providers triton_fsb triton_fs --shapes H16-D64 --modes fwd --lengths 65536 131072 262144 524288 1048576 --budget-s 130 --out "$W" --tag _fsb_prefill
step tests_fsbd 150 bash -c "python3 -m pytest -q -n ${NPROC:-8} -p no:benchmark proofs_tests/test_triton_fsb_search.py; python3 -m pytest -q -n ${NPROC:-8} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_models.py proofs_tests/test_cache_gpu.py proofs_tests/test_triton_decode.py"
step fsb_decode 200 python3 benchmarks/fsb_decode_bench.py --out "$W/fsb_decode.json"
step decode_tiles 200 python3 benchmarks/gpu_decode.py --contexts 4096 65536 --batches 1 32 --no-fs --tiles single single_w4 single64_w4 single64_w2 single32_w2 split split64 split64_w2 split128_w4 --out "$W" --name gpu_decode_tiles
step profile_fwd 90 python3 benchmarks/profile_triton.py --T 4096 65536
step tests_s21 200 bash -c "python3 -m pytest -q -n ${NPROC:-8} -p no:benchmark proofs_tests/test_triton_fsb_search.py; python3 -m pytest -q -n ${NPROC:-8} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_models.py proofs_tests/test_cache_gpu.py proofs_tests/test_triton_decode.py proofs_tests/test_cache_ragged.py"
step tests_s22 240 bash -c "python3 -m pytest -q -n ${NPROC:-8} -p no:benchmark proofs_tests/test_triton_fsb_build.py; python3 -m pytest -q -n ${NPROC:-8} -p no:benchmark -k 'cuda or gpu or fsb' proofs_tests/test_models.py proofs_tests/test_cache_gpu.py proofs_tests/test_triton_decode.py proofs_tests/test_cache_ragged.py proofs_tests/test_cache.py"
step sanitize_s22 150 bash -c "compute-sanitizer --tool memcheck python3 benchmarks/sanitize_triton.py fsb_build decode && compute-sanitizer --tool racecheck python3 benchmarks/sanitize_triton.py fsb_build"
step fsb_decode5 110 python3 benchmarks/fsb_decode_bench.py --contexts 65536 1048576 --out "$W/fsb_decode5.json"
step fsb_decode6 150 python3 benchmarks/fsb_decode_bench.py --contexts 1048576 --out "$W/fsb_decode6.json"
step boundary_probe 95 python3 benchmarks/fsb_boundary_probe.py --T 65536 --out "$W/fsb_boundary_probe.json"
step host_probe 60 python3 benchmarks/host_overhead_probe.py --T 4096 65536 --out "$W/host_overhead.json"
step tests_l10 120 python3 -m pytest -q -p no:benchmark -k "fsb_streaming_forests or fsb_fused_decode or graph_fused" proofs_tests/test_cache_gpu.py proofs_tests/test_triton_decode.py
step racecheck_build 90 compute-sanitizer --tool racecheck python3 benchmarks/sanitize_triton.py fsb_build
step tests_s22b 170 bash -c "python3 -m pytest -q -n ${NPROC:-8} -p no:benchmark proofs_tests/test_triton_fsb_build.py; python3 -m pytest -q -n ${NPROC:-8} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_decode.py proofs_tests/test_cache_gpu.py proofs_tests/test_models.py"
step attn_nf 150 python3 benchmarks/gpu_attention.py --providers triton_fsl sdpa_causal flex_swa512 triton_fs --shapes H16-D64 --modes fwd fwd+bwd --lengths 4096 65536 --budget-s 120 --rep-ms 30 --out "$W" --tag _s22
step score_sweep 60 python3 benchmarks/score_tiles_sweep.py --out "$W/score_tiles.json"
step memcheck_build 60 compute-sanitizer --tool memcheck python3 benchmarks/sanitize_triton.py fsb_build
step tests_sel 150 python3 -m pytest -q -n ${NPROC:-8} -p no:benchmark -k "cuda or gpu" proofs_tests/test_triton_attention.py proofs_tests/test_triton_backend.py
step racecheck_score 120 compute-sanitizer --tool racecheck python3 benchmarks/sanitize_triton.py forward_backward
step fsb_decode7 150 python3 benchmarks/fsb_decode_bench.py --contexts 1048576 --steps 400 --out "$W/fsb_decode7.json"
step fla_install 60 python3 -m pip install --no-deps --no-index .whl/fla_core-0.6.0-py3-none-any.whl
step attn_final 260 bash -c "python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs sdpa_causal flex_swa512 fla_nsa --shapes H16-D64 --modes fwd --lengths 4096 16384 65536 131072 --budget-s 140 --rep-ms 30 --out $W --tag _s24_final_fwd && python3 benchmarks/gpu_attention.py --providers triton_fsl sdpa_causal flex_swa512 fla_nsa --shapes H16-D64 --modes fwd+bwd --lengths 4096 16384 65536 --budget-s 100 --rep-ms 30 --out $W --tag _s24_final_bwd"
step attention_s23 200 python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs sdpa_causal flex_swa512 fla_nsa --shapes H16-D64 --modes fwd fwd+bwd --lengths 4096 16384 65536 --budget-s 180 --rep-ms 30 --out "$W" --tag _s23
step attention_128k 150 python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs sdpa_causal flex_swa512 fla_nsa --shapes H16-D64 --modes fwd --lengths 131072 --budget-s 130 --rep-ms 30 --out "$W" --tag _s23_128k
step attn_s23b 150 python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs sdpa_causal flex_swa512 --shapes H16-D64 --modes fwd fwd+bwd --lengths 4096 16384 65536 --budget-s 130 --rep-ms 30 --out "$W" --tag _s23b
step flex_fsl 150 python3 benchmarks/gpu_attention.py --providers triton_fsl flex_fsl sdpa_causal --shapes H16-D64 --modes fwd --lengths 16384 65536 --budget-s 130 --rep-ms 30 --out "$W" --tag _s23_flex_fsl
step tests_into_out 200 env FREESOLO_TRITON_LONG_INTO_OUT=1 python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k "cuda or gpu" proofs_tests/test_triton_attention.py proofs_tests/test_triton_backend.py proofs_tests/test_triton_backward.py proofs_tests/test_row_independence.py proofs_tests/test_packed.py proofs_tests/test_models.py
step into_out_ab 150 bash -c "python3 benchmarks/gpu_attention.py --providers triton_fsl sdpa_causal --shapes H16-D64 --modes fwd --lengths 65536 131072 --budget-s 60 --rep-ms 30 --out $W --tag _buffer && FREESOLO_TRITON_LONG_INTO_OUT=1 python3 benchmarks/gpu_attention.py --providers triton_fsl sdpa_causal --shapes H16-D64 --modes fwd --lengths 65536 131072 --budget-s 60 --rep-ms 30 --out $W --tag _into_out"
step score_1m 100 python3 benchmarks/score_tiles_sweep.py --cases fsl:65536 fsl:1048576 --chunks 32 64 --out "$W/score_tiles_1m.json"
step tests_fwd 150 python3 -m pytest -q -n ${NPROC:-8} -p no:benchmark -k "cuda or gpu" proofs_tests/test_row_independence.py proofs_tests/test_packed.py proofs_tests/test_models.py proofs_tests/test_triton_selection.py
step sanitize_fwd 200 bash -c "compute-sanitizer --tool memcheck python3 benchmarks/sanitize_triton.py forward_backward && compute-sanitizer --tool racecheck python3 benchmarks/sanitize_triton.py forward_backward"
step tests_s24 260 python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k "cuda or gpu" proofs_tests/test_triton_attention.py proofs_tests/test_triton_backend.py proofs_tests/test_triton_backward.py proofs_tests/test_triton_selection.py proofs_tests/test_row_independence.py proofs_tests/test_packed.py proofs_tests/test_models.py
step score_s24 120 python3 benchmarks/score_tiles_sweep.py --cases fsl:65536 fs:16384 fs:65536 --chunks --out "$W/score_tiles_s24.json"
step attn_s24 240 bash -c "python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs sdpa_causal flex_swa512 --shapes H16-D64 --modes fwd --lengths 4096 16384 65536 131072 --budget-s 110 --rep-ms 30 --out $W --tag _s24_fwd && python3 benchmarks/gpu_attention.py --providers triton_fsl sdpa_causal flex_swa512 --shapes H16-D64 --modes fwd+bwd --lengths 4096 16384 65536 --budget-s 90 --rep-ms 30 --out $W --tag _s24_bwd"
step sweep_s24 240 bash -c "python3 benchmarks/score_tiles_sweep.py --cases fsl:65536 fs:65536 --chunks --out $W/score_tiles_s24b.json && python3 benchmarks/triton_forward_ab.py --sweep-only --sweep-names long64w4+maxnreg128 long64w4-into long64w2-into long32w2-into long32w4-into long16w1-into long16w2-into long64w4-into-noprefetch --out $W/triton_forward_sweep_s24.json"
step score_f32 120 python3 benchmarks/score_tiles_sweep.py --cases fsl:65536 fs:16384 fs:65536 --chunks --out "$W/score_tiles_f32.json"
step attn_f32 150 python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs sdpa_causal flex_swa512 --shapes H16-D64 --modes fwd --lengths 4096 16384 65536 131072 --budget-s 120 --rep-ms 30 --out "$W" --tag _s24_f32
step tests_f32 150 bash -c "python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_selection.py proofs_tests/test_row_independence.py proofs_tests/test_triton_backend.py && compute-sanitizer --tool memcheck python3 benchmarks/sanitize_triton.py forward_backward"
step gate 330 bash -c "python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_selection.py proofs_tests/test_row_independence.py proofs_tests/test_triton_backend.py proofs_tests/test_triton_attention.py; python3 benchmarks/score_tiles_sweep.py --cases fsl:65536 fs:16384 fs:65536 --chunks --out $W/score_tiles_gate.json; python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs sdpa_causal flex_swa512 --shapes H16-D64 --modes fwd --lengths 16384 65536 --budget-s 60 --rep-ms 30 --out $W --tag _gate"
step chunks 330 bash -c "python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_selection.py proofs_tests/test_row_independence.py proofs_tests/test_triton_backend.py proofs_tests/test_triton_attention.py; python3 benchmarks/score_tiles_sweep.py --cases fsl:65536 fs:16384 fs:65536 --chunks --out $W/score_tiles_chunks.json; python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs sdpa_causal flex_swa512 --shapes H16-D64 --modes fwd --lengths 16384 65536 131072 --budget-s 80 --rep-ms 30 --out $W --tag _chunks"
step final25 560 bash -c "python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_selection.py proofs_tests/test_row_independence.py proofs_tests/test_triton_backend.py proofs_tests/test_triton_attention.py proofs_tests/test_triton_backward.py proofs_tests/test_packed.py proofs_tests/test_models.py; python3 benchmarks/score_tiles_sweep.py --cases fsl:65536 fs:16384 fs:65536 --chunks --out $W/score_tiles_final.json; python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs sdpa_causal flex_swa512 fla_nsa --shapes H16-D64 --modes fwd --lengths 4096 16384 65536 131072 --budget-s 140 --rep-ms 30 --out $W --tag _s25_final_fwd; python3 benchmarks/gpu_attention.py --providers triton_fsl sdpa_causal flex_swa512 fla_nsa --shapes H16-D64 --modes fwd+bwd --lengths 4096 16384 65536 --budget-s 100 --rep-ms 30 --out $W --tag _s25_final_bwd; compute-sanitizer --tool memcheck python3 benchmarks/sanitize_triton.py forward_backward && compute-sanitizer --tool racecheck python3 benchmarks/sanitize_triton.py forward_backward"
step last25 400 bash -c "python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_selection.py proofs_tests/test_row_independence.py proofs_tests/test_triton_backend.py proofs_tests/test_triton_attention.py proofs_tests/test_models.py; python3 benchmarks/gpu_attention.py --providers triton_fsl sdpa_causal flex_swa512 --shapes H16-D64 --modes fwd --lengths 65536 131072 --budget-s 40 --rep-ms 30 --out $W --tag _s25_n32; python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fsl_graph sdpa_causal sdpa_causal_graph flex_swa512 --shapes H16-D64 --modes fwd fwd+bwd --lengths 4096 16384 --budget-s 90 --rep-ms 30 --out $W --tag _s25_graph; python3 benchmarks/gpu_attention.py --providers triton_fs triton_fsb --shapes H16-D64 --modes fwd --lengths 262144 1048576 --budget-s 90 --rep-ms 30 --out $W --tag _s25_1m"
step wfirst 560 bash -c "python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_backend.py; env FREESOLO_TRITON_WINDOW_FIRST=1 python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_attention.py proofs_tests/test_row_independence.py proofs_tests/test_triton_backward.py proofs_tests/test_models.py; python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs sdpa_causal flex_swa512 --shapes H16-D64 --modes fwd --lengths 16384 65536 131072 --budget-s 60 --rep-ms 30 --out $W --tag _default; FREESOLO_TRITON_WINDOW_FIRST=1 python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs sdpa_causal flex_swa512 --shapes H16-D64 --modes fwd --lengths 16384 65536 131072 --budget-s 60 --rep-ms 30 --out $W --tag _wfirst; FREESOLO_TRITON_WINDOW_FIRST=1 python3 benchmarks/profile_triton.py --T 65536"
step overlap 480 bash -c "python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_attention.py proofs_tests/test_triton_backend.py; python3 benchmarks/forward_overlap_ab.py --out $W/forward_overlap_ab.json"
step final26 520 bash -c "python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_selection.py proofs_tests/test_row_independence.py proofs_tests/test_triton_backend.py proofs_tests/test_triton_attention.py proofs_tests/test_triton_backward.py proofs_tests/test_packed.py proofs_tests/test_models.py; python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs sdpa_causal flex_swa512 fla_nsa --shapes H16-D64 --modes fwd --lengths 4096 16384 65536 131072 --budget-s 140 --rep-ms 30 --out $W --tag _s26_final_fwd; python3 benchmarks/gpu_attention.py --providers triton_fsl sdpa_causal flex_swa512 fla_nsa --shapes H16-D64 --modes fwd+bwd --lengths 4096 16384 65536 --budget-s 100 --rep-ms 30 --out $W --tag _s26_final_bwd; python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fsl_graph sdpa_causal sdpa_causal_graph --shapes H16-D64 --modes fwd fwd+bwd --lengths 4096 16384 --budget-s 60 --rep-ms 30 --out $W --tag _s26_graph; compute-sanitizer --tool memcheck python3 benchmarks/sanitize_triton.py forward_backward && compute-sanitizer --tool racecheck python3 benchmarks/sanitize_triton.py forward_backward"
step wf_noise 300 bash -c "for r in 1 2 3; do for wf in 1 0; do FREESOLO_TRITON_WINDOW_FIRST=\$wf python3 benchmarks/gpu_attention.py --providers triton_fsl sdpa_causal --shapes H16-D64 --modes fwd --lengths 4096 16384 --budget-s 30 --rep-ms 30 --out $W --tag _noise_wf\${wf}_r\$r | grep -E 'T= |commit'; done; done; for wf in 1 0; do FREESOLO_TRITON_WINDOW_FIRST=\$wf python3 benchmarks/host_overhead_probe.py --T 4096 --out $W/host_overhead_wf\$wf.json | tail -25; done"
step bimodal 200 bash -c "for i in 1 2 3 4 5 6; do python3 benchmarks/host_bimodal_probe.py --out $W/bimodal_\$i.json; done"
step sorted 500 bash -c "python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_attention.py proofs_tests/test_triton_backend.py proofs_tests/test_row_independence.py proofs_tests/test_packed.py; python3 benchmarks/forward_overlap_ab.py --out $W/forward_sorted_ab.json; python3 benchmarks/gpu_attention.py --providers triton_fsl sdpa_causal flex_swa512 --shapes H16-D64 --modes fwd --lengths 65536 131072 --budget-s 60 --rep-ms 30 --out $W --tag _sorted"
step chunks27 420 bash -c "python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_attention.py; python3 benchmarks/forward_overlap_ab.py --lengths 16384 65536 131072 --configs wfirst sorted sorted2k sorted8k --out $W/forward_chunks_ab.json; python3 benchmarks/gpu_attention.py --providers triton_fsl sdpa_causal flex_swa512 fla_nsa --shapes H16-D64 --modes fwd --lengths 16384 32768 65536 --budget-s 80 --rep-ms 30 --out $W --tag _chunks27; python3 benchmarks/profile_triton.py --T 65536"
step final27 560 bash -c "python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_selection.py proofs_tests/test_row_independence.py proofs_tests/test_triton_backend.py proofs_tests/test_triton_attention.py proofs_tests/test_triton_backward.py proofs_tests/test_packed.py proofs_tests/test_models.py; python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs sdpa_causal flex_swa512 fla_nsa --shapes H16-D64 --modes fwd --lengths 4096 16384 65536 131072 --budget-s 140 --rep-ms 30 --out $W --tag _s27_final_fwd; python3 benchmarks/gpu_attention.py --providers triton_fsl sdpa_causal flex_swa512 fla_nsa --shapes H16-D64 --modes fwd+bwd --lengths 4096 16384 65536 --budget-s 100 --rep-ms 30 --out $W --tag _s27_final_bwd; compute-sanitizer --tool memcheck python3 benchmarks/sanitize_triton.py forward_backward && compute-sanitizer --tool racecheck python3 benchmarks/sanitize_triton.py forward_backward"
step lb27 330 bash -c "python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'sorted or order' proofs_tests/test_triton_attention.py; FREESOLO_TRITON_LONG_BLOCK=32 python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_attention.py proofs_tests/test_triton_backend.py proofs_tests/test_row_independence.py; python3 benchmarks/forward_overlap_ab.py --lengths 65536 131072 --fs-lengths --configs sorted sorted_lb32 sorted_lb32w2 sorted_lb16w1 --out $W/forward_lb_ab.json; python3 benchmarks/gpu_attention.py --providers triton_fsl sdpa_causal flex_swa512 --shapes H16-D64 --modes fwd --lengths 65536 131072 --budget-s 40 --rep-ms 30 --out $W --tag _lb64; FREESOLO_TRITON_LONG_BLOCK=32 python3 benchmarks/gpu_attention.py --providers triton_fsl sdpa_causal flex_swa512 --shapes H16-D64 --modes fwd --lengths 65536 131072 --budget-s 40 --rep-ms 30 --out $W --tag _lb32; compute-sanitizer --tool memcheck python3 benchmarks/sanitize_triton.py forward_backward"
step ab28_tests 230 env FREESOLO_TRITON_LONG_BOUND=1 FREESOLO_TRITON_FSL_TAIL=1 python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k "cuda or gpu or bound or tail" proofs_tests/test_triton_selection.py proofs_tests/test_triton_attention.py proofs_tests/test_triton_backend.py proofs_tests/test_row_independence.py proofs_tests/test_packed.py
step ab28_score 80 python3 benchmarks/score_tiles_sweep.py --cases fsl:16384 fsl:65536 fsl:131072 --chunks --out "$W/score_tiles_s28.json"
step final28 560 bash -c "python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu or tail' proofs_tests/test_triton_selection.py proofs_tests/test_row_independence.py proofs_tests/test_triton_backend.py proofs_tests/test_triton_attention.py proofs_tests/test_triton_backward.py proofs_tests/test_packed.py proofs_tests/test_models.py; python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs sdpa_causal flex_swa512 fla_nsa --shapes H16-D64 --modes fwd --lengths 4096 16384 65536 131072 --budget-s 140 --rep-ms 30 --out $W --tag _s28_final_fwd; FREESOLO_TRITON_FSL_TAIL=0 python3 benchmarks/gpu_attention.py --providers triton_fsl sdpa_causal flex_swa512 --shapes H16-D64 --modes fwd --lengths 16384 65536 131072 --budget-s 50 --rep-ms 30 --out $W --tag _s28_notail_fwd; python3 benchmarks/gpu_attention.py --providers triton_fsl sdpa_causal flex_swa512 fla_nsa --shapes H16-D64 --modes fwd+bwd --lengths 4096 16384 65536 --budget-s 100 --rep-ms 30 --out $W --tag _s28_final_bwd; python3 benchmarks/forward_overlap_ab.py --lengths 65536 131072 --fs-lengths --configs sorted --out $W/forward_s28.json; compute-sanitizer --tool memcheck python3 benchmarks/sanitize_triton.py forward_backward && compute-sanitizer --tool racecheck python3 benchmarks/sanitize_triton.py forward_backward"
step s30g_tests 70 python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k "fast_launch or graph_replay or reduce_overhead" proofs_tests/test_triton_backend.py proofs_tests/test_triton_decode.py
step s30g_memcheck 90 compute-sanitizer --tool memcheck python3 benchmarks/sanitize_triton.py decode fsb_search fsb_build
step s30g_racecheck 110 compute-sanitizer --tool racecheck python3 benchmarks/sanitize_triton.py forward_backward
step s31a_host 150 python3 benchmarks/launch_host_probe.py --T 4096 16384 --idle --out "$W/launch_host_s31a.json"
step s31a_attn 100 python3 benchmarks/gpu_attention.py --providers triton_fsl fla_nsa sdpa_causal flex_swa512 --shapes H16-D64 --modes fwd --lengths 4096 16384 --budget-s 70 --rep-ms 30 --out "$W" --tag _s31a
step s31b_tests 200 python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k "cuda or gpu or cell_plan or without_saved" proofs_tests/test_triton_selection.py proofs_tests/test_row_independence.py proofs_tests/test_triton_backend.py proofs_tests/test_triton_attention.py proofs_tests/test_triton_backward.py proofs_tests/test_packed.py proofs_tests/test_models.py proofs_tests/test_triton_decode.py proofs_tests/test_triton_fsb_search.py
step s31b_ab 120 python3 benchmarks/kernel_refactor_ab.py --old attention_bwd=.ab/attention_bwd.py decode=.ab/decode.py
step s31c_tests 150 python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k "cuda or gpu or without_saved or rotation" proofs_tests/test_row_independence.py proofs_tests/test_triton_backend.py proofs_tests/test_triton_attention.py proofs_tests/test_packed.py proofs_tests/test_models.py
step s31c_ab 90 python3 benchmarks/kernel_refactor_ab.py --only "decode fsb" --old decode=.ab/decode.py
step s31c_overlap 120 bash -c "python3 benchmarks/forward_overlap_ab.py --lengths 4096 16384 --fs-lengths --configs s30 sorted --out $W/forward_overlap_s31c.json && python3 benchmarks/profile_triton.py --T 16384 --out $W/profile_s31c.json"
step s31c_attn 330 python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs sdpa_causal flex_swa512 fla_nsa --shapes H16-D64 --modes fwd fwd+bwd --lengths 4096 16384 65536 131072 --budget-s 290 --rep-ms 30 --out "$W" --tag _s31c
step s31d_tests 200 python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k "cuda or gpu or cell_plan" proofs_tests/test_triton_selection.py proofs_tests/test_triton_backward.py proofs_tests/test_triton_decode.py proofs_tests/test_triton_fsb_search.py proofs_tests/test_cache_gpu.py proofs_tests/test_cache_ragged.py
step s31e_memcheck 150 compute-sanitizer --tool memcheck python3 benchmarks/sanitize_triton.py forward_backward decode
step s31e_racecheck 200 compute-sanitizer --tool racecheck python3 benchmarks/sanitize_triton.py forward_backward decode
step s32a_race_decode 150 compute-sanitizer --tool racecheck python3 benchmarks/sanitize_triton.py decode
step s32a_race_nocudnn 150 env FREESOLO_SANITIZE_CUDNN=0 compute-sanitizer --tool racecheck python3 benchmarks/sanitize_triton.py decode
step s32a_race_fwd 150 compute-sanitizer --tool racecheck python3 benchmarks/sanitize_triton.py forward_backward
step s32b_race_build 150 compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 60 python3 benchmarks/sanitize_triton.py fsb_build_small
step s32b_repeat 120 python3 benchmarks/sanitize_triton.py fsb_build_repeat
step s32c_race_fsb 150 env FREESOLO_SANITIZE_CUDNN=0 compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 40 python3 benchmarks/sanitize_triton.py decode_fsb
step s32c_repeat 150 python3 benchmarks/sanitize_triton.py decode_fsb_repeat
step s32d_race 240 env FREESOLO_SANITIZE_CUDNN=0 bash -c "compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 40 python3 benchmarks/sanitize_triton.py decode_fsb; compute-sanitizer --tool racecheck python3 benchmarks/sanitize_triton.py decode fsb_search fsb_build fsb_build_small"
step s32d_tests 240 bash -c "python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark proofs_tests/test_triton_fsb_build.py; python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_fsb_search.py proofs_tests/test_triton_decode.py proofs_tests/test_cache_gpu.py proofs_tests/test_cache_ragged.py proofs_tests/test_models.py"
step s32d_repeat 90 python3 benchmarks/sanitize_triton.py fsb_build_repeat decode_fsb_repeat
step s32e_ab 150 python3 benchmarks/kernel_refactor_ab.py --old attention_bwd=.ab/attention_bwd.py
step s32e_tests 240 python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k "cuda or gpu or cell_plan or without_saved" proofs_tests/test_triton_backward.py proofs_tests/test_triton_backend.py proofs_tests/test_row_independence.py proofs_tests/test_packed.py
step s32e_prof 120 python3 benchmarks/profile_triton.py --T 4096 16384 65536 --out $W/profile_s32e.json
step s32f_fsb_decode 200 python3 benchmarks/fsb_decode_bench.py --contexts 1048576 --steps 400 --out "$W/fsb_decode_s32.json"
step s33a_tests 300 bash -c "python3 -m pytest -q -p no:benchmark proofs_tests/test_triton_graphs.py; FREESOLO_TRITON_GRAPHS= python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_backend.py proofs_tests/test_models.py proofs_tests/test_packed.py proofs_tests/test_row_independence.py"
step s33a_probe 120 python3 benchmarks/graph_cache_probe.py --out "$W/graph_cache_s33a.json"
step s33b_tests 120 python3 -m pytest -q -p no:benchmark proofs_tests/test_triton_graphs.py
step s33c_probe 120 python3 benchmarks/graph_cache_probe.py --profile --lengths 4096 --out $W/graph_cache_s33c.json
step s33b_probe 200 bash -c "python3 benchmarks/graph_cache_probe.py --profile --out $W/graph_cache_s33b.json && python3 benchmarks/graph_cache_probe.py --lengths 16384 --graphs-env 32768 --out $W/graph_cache_s33b_32k.json"
step s33d_tests 260 bash -c "python3 -m pytest -q -p no:benchmark proofs_tests/test_triton_graphs.py; python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu or beta_grad' proofs_tests/test_triton_backward.py proofs_tests/test_triton_backend.py; FREESOLO_TRITON_GRAPHS= python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_backend.py proofs_tests/test_models.py proofs_tests/test_packed.py proofs_tests/test_row_independence.py"
step s33d_attn 150 python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs triton_fsl_eager triton_fs_eager triton_fsl_graph sdpa_causal flex_swa512 --shapes H16-D64 --modes fwd fwd+bwd --lengths 4096 8192 16384 --budget-s 120 --rep-ms 30 --out "$W" --tag _s33d
step s33e_tests 150 bash -c "python3 -m pytest -q -p no:benchmark proofs_tests/test_triton_graphs.py; FREESOLO_TRITON_GRAPHS= python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_backend.py proofs_tests/test_models.py"
step s33e_probe 150 python3 benchmarks/graph_cache_probe.py --lengths 4096 8192 --profile --out "$W/graph_cache_s33e.json"
step s33e_attn 120 python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs triton_fsl_eager sdpa_causal flex_swa512 --shapes H16-D64 --modes fwd fwd+bwd --lengths 4096 8192 --budget-s 100 --rep-ms 30 --out "$W" --tag _s33e
step s33f_final 330 bash -c "python3 -m pytest -q -p no:benchmark proofs_tests/test_triton_graphs.py; python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs triton_fsl_eager sdpa_causal flex_swa512 --shapes H16-D64 --modes fwd fwd+bwd --lengths 4096 8192 16384 65536 --budget-s 200 --rep-ms 30 --out $W --tag _s33f"
step s33g_modes 240 bash -c "for m in cell gather; do FREESOLO_TRITON_BWD_LONG=\$m python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs triton_fsl_eager sdpa_causal --shapes H16-D64 --modes fwd+bwd --lengths 4096 8192 --budget-s 60 --rep-ms 30 --out $W --tag _s33g_\$m; done; FREESOLO_DETERMINISTIC=0 python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs triton_fsl_eager sdpa_causal --shapes H16-D64 --modes fwd+bwd --lengths 4096 8192 --budget-s 60 --rep-ms 30 --out $W --tag _s33g_atomic"
step s33h_gpu_modes 200 bash -c "for e in FREESOLO_DETERMINISTIC=1 FREESOLO_DETERMINISTIC=0 'FREESOLO_DETERMINISTIC=0 FREESOLO_TRITON_BWD_LONG=union' 'FREESOLO_DETERMINISTIC=0 FREESOLO_TRITON_BWD_LONG=gather'; do tag=\$(echo \$e | tr ' =' '__'); env \$e python3 benchmarks/gpu_attention.py --providers triton_fsl_graph triton_fsl sdpa_causal --shapes H16-D64 --modes fwd+bwd --lengths 4096 8192 --budget-s 40 --rep-ms 30 --out $W --tag _s33h_\$tag; done"
step s33i_tests 120 python3 -m pytest -q -p no:benchmark proofs_tests/test_triton_graphs.py
step s34a_tests 330 bash -c "python3 -m pytest -q -p no:benchmark proofs_tests/test_triton_graphs.py; python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu or cell_plan' proofs_tests/test_triton_backward.py; FREESOLO_TRITON_GRAPHS= python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_backend.py proofs_tests/test_models.py proofs_tests/test_packed.py proofs_tests/test_row_independence.py"
step s34a_probe 150 python3 benchmarks/graph_cache_probe.py --profile --lengths 4096 8192 --out "$W/graph_cache_s34a.json"
step s34a_attn 200 python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs triton_fsl_eager triton_fsl_graph sdpa_causal flex_swa512 --shapes H16-D64 --modes fwd fwd+bwd --lengths 4096 8192 16384 --budget-s 160 --rep-ms 30 --out "$W" --tag _s34a
step s34b_tests 300 bash -c "python3 -m pytest -q -p no:benchmark proofs_tests/test_triton_graphs.py; FREESOLO_TRITON_GRAPHS= python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_backend.py proofs_tests/test_models.py proofs_tests/test_packed.py proofs_tests/test_row_independence.py"
step s34b_memcheck 150 compute-sanitizer --tool memcheck python3 benchmarks/sanitize_triton.py forward_backward
step s34b_probe 150 python3 benchmarks/graph_cache_probe.py --profile --lengths 4096 8192 --out "$W/graph_cache_s34b.json"
step s34b_attn 200 python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs triton_fsl_eager triton_fsl_graph sdpa_causal flex_swa512 --shapes H16-D64 --modes fwd fwd+bwd --lengths 4096 8192 16384 --budget-s 160 --rep-ms 30 --out "$W" --tag _s34b
step s34b_train 150 python3 benchmarks/train_step.py --lengths 4096 8192 16384 --providers freesolo_fsl_triton sdpa_causal flex_swa512 --out "$W"
step s34c_tests 200 bash -c "python3 -m pytest -q -p no:benchmark proofs_tests/test_triton_graphs.py; python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu or cell_plan' proofs_tests/test_triton_backward.py"
step s34c_final 330 python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs triton_fsl_graph sdpa_causal flex_swa512 fla_nsa --shapes H16-D64 --modes fwd fwd+bwd --lengths 4096 8192 16384 65536 --budget-s 290 --rep-ms 30 --out "$W" --tag _s34c
step s34d_long_block 300 bash -c "for b in 16 32 64 128; do FREESOLO_TRITON_LONG_BLOCK=\$b python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fsl_graph sdpa_causal --shapes H16-D64 --modes fwd --lengths 4096 16384 65536 --budget-s 60 --rep-ms 30 --out $W --tag _s34d_lb\$b; done"
step s34e_tests 240 bash -c "python3 -m pytest -q -p no:benchmark proofs_tests/test_triton_graphs.py; compute-sanitizer --tool racecheck python3 benchmarks/sanitize_triton.py forward_backward"
step s35a_tma 240 python3 benchmarks/tma_ab.py --out "$W/tma_ab_s35a.json"
step s37a_tests 150 env FREESOLO_TRITON_FSL_CAND=blocks python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k "cuda or gpu" proofs_tests/test_triton_selection.py proofs_tests/test_row_independence.py
step s37a_ab 300 bash -c "for m in chunks blocks; do FREESOLO_TRITON_FSL_CAND=\$m python3 benchmarks/profile_triton.py --T 4096 65536 --out $W/profile_s37a_\$m.json; FREESOLO_TRITON_FSL_CAND=\$m python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fsl_graph sdpa_causal --shapes H16-D64 --modes fwd --lengths 4096 16384 65536 --budget-s 50 --rep-ms 30 --out $W --tag _s37a_\$m; done"
step s37a_tma 200 python3 benchmarks/tma_ab.py --out "$W/tma_ab_s37a.json"
step s37b_long 200 python3 benchmarks/tma_ab.py --long-only --out "$W/tma_ab_s37b.json"
step s37c_tests 240 env FREESOLO_TRITON_LONG_TMA=1 python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k "cuda or gpu or tma" proofs_tests/test_triton_attention.py proofs_tests/test_triton_backend.py proofs_tests/test_row_independence.py proofs_tests/test_packed.py proofs_tests/test_models.py proofs_tests/test_triton_graphs.py
step s37c_ab 330 bash -c "FREESOLO_TRITON_LONG_TMA=0 python3 benchmarks/tma_ab.py --long-only --out $W/tma_ab_s37c.json; python3 benchmarks/profile_triton.py --T 4096 65536 --out $W/profile_s37c.json; for t in 1 0; do FREESOLO_TRITON_LONG_TMA=\$t python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs triton_fsl_graph sdpa_causal flex_swa512 --shapes H16-D64 --modes fwd --lengths 4096 16384 65536 --budget-s 70 --rep-ms 30 --out $W --tag _s37c_tma\$t; done"
step s37d_attn 200 bash -c "for t in 1 0; do FREESOLO_TRITON_LONG_TMA=\$t python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fsl_graph sdpa_causal flex_swa512 --shapes H16-D64 --modes fwd --lengths 4096 16384 65536 --budget-s 45 --rep-ms 30 --out $W --tag _s37d_tma\$t; done"
step s37d_long 100 env FREESOLO_TRITON_LONG_TMA=0 python3 benchmarks/tma_ab.py --long-only --out "$W/tma_ab_s37d.json"
step s37e_tests 150 env FREESOLO_TRITON_LONG_TMA=1 python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k "cuda or gpu or tma" proofs_tests/test_triton_attention.py proofs_tests/test_triton_backend.py proofs_tests/test_triton_graphs.py proofs_tests/test_row_independence.py
step s37e_attn 110 bash -c "for t in 1 0; do FREESOLO_TRITON_LONG_TMA=\$t python3 benchmarks/gpu_attention.py --providers triton_fsl sdpa_causal flex_swa512 --shapes H16-D64 --modes fwd --lengths 4096 65536 --budget-s 30 --rep-ms 30 --out $W --tag _s37e_tma\$t; done"
step s38a_san 200 bash -c "FREESOLO_TRITON_LONG_TMA=1 compute-sanitizer --tool memcheck python3 benchmarks/sanitize_triton.py forward_backward && FREESOLO_TRITON_LONG_TMA=1 compute-sanitizer --tool racecheck python3 benchmarks/sanitize_triton.py forward_backward"
step s38a_lb 100 bash -c "for lb in 32 64; do FREESOLO_TRITON_LONG_TMA=1 FREESOLO_TRITON_LONG_BLOCK=\$lb python3 benchmarks/gpu_attention.py --providers triton_fsl sdpa_causal --shapes H16-D64 --modes fwd --lengths 4096 65536 --budget-s 40 --rep-ms 30 --out $W --tag _s38a_lb\$lb; done"
step s38b_tests 240 python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k "cuda or gpu or tma" proofs_tests/test_triton_attention.py proofs_tests/test_triton_backend.py proofs_tests/test_row_independence.py proofs_tests/test_packed.py proofs_tests/test_models.py proofs_tests/test_triton_graphs.py proofs_tests/test_triton_backward.py
step s38b_attn 240 python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs sdpa_causal flex_swa512 fla_nsa --shapes H16-D64 --modes fwd --lengths 4096 16384 65536 131072 --budget-s 200 --rep-ms 30 --out "$W" --tag _s38b
step s39a_tests 540 python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark --durations=25 -k "cuda or gpu or tma" proofs_tests/test_triton_attention.py proofs_tests/test_triton_backend.py proofs_tests/test_row_independence.py proofs_tests/test_packed.py proofs_tests/test_models.py proofs_tests/test_triton_graphs.py proofs_tests/test_triton_backward.py
step s39b_fsb 150 python3 benchmarks/fsb_prefill_split.py --lengths 65536 262144 1048576 --out "$W/fsb_prefill_split.json"
step s39c_fsb 200 python3 benchmarks/fsb_prefill_split.py --lengths 65536 262144 1048576 --providers forests search select select_tile unions tile_only --tile-shapes 32x1 32x2 64x4 16x4 --out "$W/fsb_prefill_split.json"
step s39d_tests 330 python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark --durations=15 -k "cuda or gpu or tma or tile_rerank or rerank_mode" proofs_tests/test_triton_attention.py proofs_tests/test_triton_backend.py proofs_tests/test_triton_graphs.py proofs_tests/test_row_independence.py proofs_tests/test_triton_fsb_search.py
step s39e_tests 345 python3 -m pytest -q -n ${NPROC:-16} -p no:benchmark -rA --durations=15 proofs_tests/test_triton_fsb_search.py proofs_tests/test_triton_attention.py proofs_tests/test_triton_backend.py proofs_tests/test_triton_graphs.py proofs_tests/test_row_independence.py -k "cuda or gpu or tma or fsb_search"
step s41a_fsb 200 bash -c "python3 .ab/pre_s41/benchmarks/fsb_prefill_split.py --lengths 65536 262144 1048576 --providers forests search select --out $W/fsb_prefill_main.json && python3 benchmarks/fsb_prefill_split.py --lengths 65536 262144 1048576 --providers search select --maxnregs 88 80 72 --out $W/fsb_prefill_root.json"
step s41a_tests 200 python3 -m pytest -v -n ${NPROC:-16} -p no:benchmark --durations=20 proofs_tests/test_triton_fsb_search.py proofs_tests/test_triton_decode.py proofs_tests/test_cache_gpu.py proofs_tests/test_models.py -k "(cuda or gpu or fsb) and not cpu"
step s41b_forest 150 python3 benchmarks/fsb_forest_phases.py --lengths 262144 1048576 --out $W/fsb_forest_phases.json
step s41c_tests 240 python3 -m pytest -v -n ${NPROC:-16} -p no:benchmark --durations=20 proofs_tests/test_triton_fsb_forests.py proofs_tests/test_triton_fsb_search.py proofs_tests/test_triton_decode.py proofs_tests/test_cache_gpu.py proofs_tests/test_models.py -k "(cuda or gpu or fsb or forests) and not cpu"
step s41c_fsb 300 bash -c "python3 benchmarks/fsb_forest_phases.py --lengths 262144 1048576 --out $W/fsb_forest_phases.json; python3 benchmarks/fsb_prefill_split.py --lengths 65536 262144 1048576 --providers forests forests_torch search select select_forests_torch --out $W/fsb_prefill_s41.json; python3 benchmarks/gpu_attention.py --providers triton_fsb triton_fs --shapes H16-D64 --modes fwd --lengths 262144 1048576 --budget-s 140 --out $W --tag _fsb_s41"
step s41d_probe 150 bash -c "python3 benchmarks/fsb_dimchunk_probe.py; FREESOLO_TRITON_FSB_FORESTS=torch python3 benchmarks/fsb_dimchunk_probe.py"
step s41e_tests 200 python3 -m pytest -v -n ${NPROC:-16} -p no:benchmark --durations=20 proofs_tests/test_triton_fsb_forests.py proofs_tests/test_triton_fsb_search.py proofs_tests/test_triton_decode.py proofs_tests/test_cache_gpu.py proofs_tests/test_models.py -k "(cuda or gpu or fsb or forests) and not cpu"
step s45_prio 300 python3 benchmarks/switch_ab.py --out $W/side_priority_ab.json
step s45_tests 300 bash -c "python3 -m pytest -q -p no:benchmark proofs_tests/test_triton_graphs.py; python3 -m pytest -q -n ${NPROC:-16} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_backend.py"
step s45_tl 200 python3 benchmarks/forward_timeline.py --lengths 4096 16384 65536 --variants fsl fs --out $W/forward_timeline.json
step s48_min 420 python3 benchmarks/switch_ab.py --arm base: --arm high:FREESOLO_TRITON_SIDE_PRIORITY=-100 --arm sort1024:FREESOLO_TRITON_FSL_DIRECT_MAX_CELLS=1024 --arm sorted:FREESOLO_TRITON_SORTED_LONG_MIN_T=0 --arm fused:FREESOLO_TRITON_FUSED_UNIONS=1 --arm high_fused:FREESOLO_TRITON_SIDE_PRIORITY=-100,FREESOLO_TRITON_FUSED_UNIONS=1 --lengths 4096 8192 16384 32768 --fs-lengths 4096 --bwd-lengths 4096 --rep 50 --rounds 3 --out $W/s48_ab.json
step s48_fused 200 python3 benchmarks/switch_ab.py --arm base: --arm fused:FREESOLO_TRITON_FUSED_UNIONS=1 --lengths 4096 8192 16384 --fs-lengths 4096 --bwd-lengths 4096 --rep 50 --rounds 3 --out $W/s48_fused_ab.json
step s49_tiles 120 python3 -m pytest -q -p no:benchmark -k tiles_switches proofs_tests/test_triton_attention.py
step s49_graph 200 python3 benchmarks/switch_ab.py --arm base: --arm g32:FREESOLO_TRITON_GRAPHS=33554432 --arm g32copy:FREESOLO_TRITON_GRAPHS=33554432,FREESOLO_TRITON_GRAPH_DIRECT=0 --lengths 16384 32768 --fs-lengths 16384 --bwd-lengths 16384 --rep 50 --rounds 3 --out $W/s49_graph_ab.json
step s49_gtests 200 python3 -m pytest -q -p no:benchmark proofs_tests/test_triton_graphs.py
step s49_gab 150 python3 benchmarks/switch_ab.py --arm base: --arm direct16k:FREESOLO_TRITON_GRAPH_DIRECT_MAX=16777216 --lengths 8192 16384 32768 --fs-lengths 16384 --bwd-lengths --rep 50 --rounds 3 --out $W/s49_gab.json
step s49_lb 120 python3 benchmarks/switch_ab.py --arm base: --arm lb32:FREESOLO_TRITON_LONG_BLOCK=32 --lengths 4096 8192 --fs-lengths 4096 --bwd-lengths --rep 50 --rounds 3 --out $W/s49_lb.json
step s49_t16 150 python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs sdpa_causal fla_nsa flex_swa512 --shapes H16-D64 --modes fwd --lengths 4096 16384 --budget-s 120 --rep-ms 30 --out $W --tag _s49_t16
step s49_gprobe 120 env FREESOLO_TRITON_GRAPH_DIRECT_MAX=16777216 python3 benchmarks/graph_cache_probe.py --lengths 8192 16384 --out $W/graph_cache_s49.json
step s50_gqa 260 bash -c "python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs triton_fsb sdpa_causal fla_nsa flex_swa512 --shapes GQA-Hq32-Hkv8-D128 --modes fwd --lengths 4096 16384 65536 131072 --budget-s 180 --rep-ms 30 --out $W --tag _s50_gqa; python3 benchmarks/gpu_attention.py --providers flex_fsl --shapes GQA-Hq32-Hkv8-D128 --modes fwd --lengths 65536 --budget-s 50 --rep-ms 30 --out $W --tag _s50_gqa_flexfsl"
step s50_bwd 180 python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs sdpa_causal flex_swa512 --shapes H16-D64 --modes fwd+bwd --lengths 4096 16384 65536 --budget-s 150 --rep-ms 30 --out $W --tag _s50_bwd
step s50_tests 420 bash -c "for g in '' 1; do echo FREESOLO_TRITON_GRAPHS=\$g; FREESOLO_TRITON_GRAPHS=\$g python3 -m pytest -q -n ${NPROC:-16} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_backend.py proofs_tests/test_row_independence.py proofs_tests/test_triton_attention.py proofs_tests/test_models.py; done"
step s50_long 120 python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs flex_swa512 --shapes H16-D64 --modes fwd --lengths 524288 1048576 --budget-s 70 --rep-ms 30 --out $W --tag _s50_long
step s50_lub 150 python3 benchmarks/long_union_bound.py --lengths 4096 16384 65536 --out $W/long_union_bound.json
step s50_gqa_prof 150 python3 benchmarks/profile_triton.py --variant fsl --H 32 --Hkv 8 --D 128 --T 4096 65536 --modes fwd --out $W/profile_fsl_gqa.json
step s50_wt 330 bash -c "python3 benchmarks/switch_ab.py --shape GQA-Hq32-Hkv8-D128 --arm base: --arm nocap:FREESOLO_TRITON_MAXNREG=0 --arm m64n64w4:FREESOLO_TRITON_WINDOW_TILES=64x64x4x2 --arm m64n64w8:FREESOLO_TRITON_WINDOW_TILES=64x64x8x2 --arm m128n64w8:FREESOLO_TRITON_WINDOW_TILES=128x64x8x2 --arm m64n64w4nocap:FREESOLO_TRITON_WINDOW_TILES=64x64x4x2,FREESOLO_TRITON_MAXNREG=0 --arm m128n64w8nocap:FREESOLO_TRITON_WINDOW_TILES=128x64x8x2,FREESOLO_TRITON_MAXNREG=0 --lengths 4096 65536 --fs-lengths --bwd-lengths --rep 50 --rounds 3 --out $W/s50_wt_gqa.json; python3 benchmarks/switch_ab.py --arm base: --arm nocap:FREESOLO_TRITON_MAXNREG=0 --arm m128n64w8:FREESOLO_TRITON_WINDOW_TILES=128x64x8x2 --arm m64n32w4:FREESOLO_TRITON_WINDOW_TILES=64x32x4x2 --lengths 4096 65536 --fs-lengths --bwd-lengths --rep 50 --rounds 3 --out $W/s50_wt_h16.json"
step s51_info 150 bash -c "python3 -m freesolo.cli info; for v in fsl fs fsb; do python3 -m freesolo.cli decode --variant \$v --context 65536 --steps 256 --graph --quiet; done"
step s51_long 480 python3 -m pytest -q -p no:benchmark -rA proofs_tests/test_triton_long_gpu.py proofs_tests/test_triton_selection.py -k "1m or 128k"
step s51_san 200 bash -c "compute-sanitizer --tool memcheck python3 benchmarks/sanitize_triton.py d128 && compute-sanitizer --tool racecheck python3 benchmarks/sanitize_triton.py d128"
step s51_fsbd32 300 python3 benchmarks/fsb_decode_bench.py --batch 32 --kernels triton --contexts 4096 65536 --steps 256 --out $W/fsb_decode_b32.json
step s51_dt1 150 python3 -m pytest -q -n 8 -p no:benchmark -k "cuda or gpu" proofs_tests/test_triton_decode.py proofs_tests/test_cache_gpu.py proofs_tests/test_cache_ragged.py proofs_tests/test_cache.py
step s51_dt2 150 python3 -m pytest -q -n 8 -p no:benchmark proofs_tests/test_triton_fsb_search.py proofs_tests/test_triton_fsb_forests.py proofs_tests/test_triton_fsb_build.py
step s51_retest 200 python3 -m pytest -q -p no:benchmark -k "cuda or gpu" proofs_tests/test_triton_backward.py proofs_tests/test_models.py
step s51_tests 330 bash -c "python3 -m pytest -q -n ${NPROC:-16} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_attention.py proofs_tests/test_triton_backend.py proofs_tests/test_row_independence.py proofs_tests/test_triton_backward.py proofs_tests/test_models.py; python3 -m pytest -q -p no:benchmark proofs_tests/test_triton_graphs.py"
step s50_wtests 150 env FREESOLO_TRITON_WINDOW_TILES=64x64x4x2 FREESOLO_TRITON_MAXNREG=0 python3 -m pytest -q -n ${NPROC:-16} -p no:benchmark -k "cuda or gpu" proofs_tests/test_triton_attention.py proofs_tests/test_triton_backend.py proofs_tests/test_row_independence.py
step s48_lreg 240 bash -c "python3 benchmarks/long_kernel_regs.py --caps 0 128 96 80 72 --out $W/long_kernel_regs.json; python3 benchmarks/switch_ab.py --arm base: --arm lreg96:FREESOLO_TRITON_LONG_MAXNREG=96 --arm lreg80:FREESOLO_TRITON_LONG_MAXNREG=80 --arm lreg72:FREESOLO_TRITON_LONG_MAXNREG=72 --lengths 4096 16384 65536 --fs-lengths 4096 --bwd-lengths --rep 50 --rounds 3 --out $W/s48_lreg_ab.json"
step s48_tests 300 bash -c "python3 -m pytest -q -n ${NPROC:-16} -p no:benchmark -k 'cuda or gpu or fused' proofs_tests/test_triton_selection.py; FREESOLO_TRITON_FUSED_UNIONS=1 python3 -m pytest -q -n ${NPROC:-16} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_backend.py proofs_tests/test_row_independence.py proofs_tests/test_triton_attention.py proofs_tests/test_models.py; FREESOLO_TRITON_FUSED_UNIONS=1 python3 -m pytest -q -p no:benchmark proofs_tests/test_triton_graphs.py"
step s48_sanitize 200 bash -c "compute-sanitizer --tool memcheck python3 benchmarks/sanitize_triton.py fused_unions && compute-sanitizer --tool racecheck python3 benchmarks/sanitize_triton.py fused_unions"
step s48_tl 200 bash -c "python3 benchmarks/forward_timeline.py --lengths 4096 --variants fsl --priorities 0 -100 --replays 3 --out $W/forward_timeline_s48.json; FREESOLO_TRITON_FUSED_UNIONS=1 python3 benchmarks/forward_timeline.py --lengths 4096 --variants fsl --priorities 0 -100 --replays 3 --out $W/forward_timeline_s48_fused.json; FREESOLO_TRITON_SORTED_LONG_MIN_T=0 python3 benchmarks/forward_timeline.py --lengths 4096 --variants fsl --priorities -100 --replays 3 --out $W/forward_timeline_s48_sorted.json"
step s47_min 300 bash -c "python3 benchmarks/switch_ab.py --arm base: --arm cand:FREESOLO_TRITON_FSL_DIRECT_MAX_CELLS=1024 --arm gdirect:FREESOLO_TRITON_GRAPH_DIRECT=1 --arm both:FREESOLO_TRITON_FSL_DIRECT_MAX_CELLS=1024,FREESOLO_TRITON_GRAPH_DIRECT=1 --lengths 4096 8192 --fs-lengths 4096 --bwd-lengths --select --rep 60 --out $W/s47_ab.json; python3 -m pytest -q -p no:benchmark proofs_tests/test_triton_graphs.py; python3 -m pytest -q -n 8 -p no:benchmark -k direct proofs_tests/test_triton_selection.py; python3 benchmarks/forward_timeline.py --lengths 4096 --variants fsl --priorities 0 --replays 3 --out $W/forward_timeline.json; FREESOLO_TRITON_FSL_DIRECT_MAX_CELLS=1024 python3 benchmarks/forward_timeline.py --lengths 4096 --variants fsl --priorities 0 --replays 3 --out $W/forward_timeline_direct.json"
step s46_min 200 bash -c "python3 benchmarks/switch_ab.py --arm scan: --arm direct:FREESOLO_TRITON_FSL_DIRECT_MAX_CELLS=1024 --lengths 4096 8192 --fs-lengths --bwd-lengths --select --rep 60 --out $W/fsl_direct_ab.json; python3 benchmarks/forward_timeline.py --lengths 4096 --variants fsl --priorities 0 --replays 3 --out $W/forward_timeline.json; FREESOLO_TRITON_FSL_DIRECT_MAX_CELLS=1024 python3 benchmarks/forward_timeline.py --lengths 4096 --variants fsl --priorities 0 --replays 3 --out $W/forward_timeline_direct.json"
step s46_quick 280 bash -c "python3 benchmarks/switch_ab.py --arm scan: --arm direct:FREESOLO_TRITON_FSL_DIRECT_MAX_CELLS=1024 --lengths 4096 8192 16384 --fs-lengths --bwd-lengths --select --out $W/fsl_direct_ab.json; python3 benchmarks/forward_timeline.py --lengths 4096 --variants fsl --priorities 0 --replays 3 --out $W/forward_timeline.json; FREESOLO_TRITON_FSL_DIRECT_MAX_CELLS=1024 python3 benchmarks/forward_timeline.py --lengths 4096 --variants fsl --priorities 0 --replays 3 --out $W/forward_timeline_direct.json; python3 -m pytest -q -n 8 -p no:benchmark -k direct proofs_tests/test_triton_selection.py"
step s46_direct 300 python3 benchmarks/switch_ab.py --arm scan: --arm direct:FREESOLO_TRITON_FSL_DIRECT_MAX_CELLS=1024 --arm direct_high:FREESOLO_TRITON_FSL_DIRECT_MAX_CELLS=1024,FREESOLO_TRITON_SIDE_PRIORITY=-100 --lengths 4096 8192 16384 32768 --fs-lengths --bwd-lengths 4096 --select --out $W/fsl_direct_ab.json
step s46_tl 200 bash -c "python3 benchmarks/forward_timeline.py --lengths 4096 16384 --variants fsl --out $W/forward_timeline.json; FREESOLO_TRITON_FSL_DIRECT_MAX_CELLS=1024 python3 benchmarks/forward_timeline.py --lengths 4096 16384 --variants fsl --out $W/forward_timeline_direct.json"
step s46_tests 300 bash -c "python3 -m pytest -q -n ${NPROC:-16} -p no:benchmark -k 'cuda or gpu or direct' proofs_tests/test_triton_selection.py; FREESOLO_TRITON_FSL_DIRECT_MAX_CELLS=1024 python3 -m pytest -q -n ${NPROC:-16} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_backend.py proofs_tests/test_row_independence.py proofs_tests/test_triton_attention.py; FREESOLO_TRITON_FSL_DIRECT_MAX_CELLS=1024 python3 -m pytest -q -p no:benchmark proofs_tests/test_triton_graphs.py"
step s46_sanitize 150 bash -c "compute-sanitizer --tool memcheck python3 benchmarks/sanitize_triton.py fsl_direct && compute-sanitizer --tool racecheck python3 benchmarks/sanitize_triton.py fsl_direct"
step s45_h16 240 bash -c "python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs triton_fsb sdpa_causal fla_nsa flex_swa512 --shapes H16-D64 --modes fwd --lengths 4096 16384 65536 131072 --budget-s 170 --rep-ms 30 --out $W --tag _s45_h16; python3 benchmarks/gpu_attention.py --providers flex_fsl --shapes H16-D64 --modes fwd --lengths 16384 65536 --budget-s 50 --rep-ms 30 --out $W --tag _s45_flexfsl"
step s45_bwd 120 python3 benchmarks/gpu_attention.py --providers triton_fsl sdpa_causal --shapes H16-D64 --modes fwd+bwd --lengths 4096 16384 --budget-s 80 --rep-ms 30 --out $W --tag _s45_bwd
step s44_inter 330 bash -c "python3 benchmarks/fsb_prefill_split.py --lengths 262144 1048576 --providers search search_seq select select_seq --rep 50 --audit 0 --out $W/fsb_prefill_s44_inter.json; python3 -m pytest -q -n ${NPROC:-16} -p no:benchmark proofs_tests/test_triton_fsb_search.py -k 'cuda or gpu'"
step s44_tile 330 bash -c "python3 benchmarks/fsb_prefill_split.py --lengths 262144 1048576 --providers search search_query select select_query --rep 50 --audit 4 --out $W/fsb_prefill_s44_tile.json; python3 -m pytest -q -n ${NPROC:-16} -p no:benchmark proofs_tests/test_triton_fsb_search.py -k 'cuda or gpu'"
step s44_time 300 bash -c "python3 benchmarks/fsb_prefill_split.py --lengths 262144 1048576 --providers search search_rows search_sum1 select select_rows select_sum1 --rep 50 --audit 0 --out $W/fsb_prefill_s44.json; python3 benchmarks/gpu_attention.py --providers triton_fsb triton_fs --shapes H16-D64 --modes fwd --lengths 1048576 --budget-s 100 --out $W --tag _fsb_s44"
step s44_tests 200 python3 -m pytest -q -n ${NPROC:-16} -p no:benchmark --durations=10 proofs_tests/test_triton_fsb_search.py -k "cuda or gpu or pair"
step s43_gqa_fs 330 bash -c "python3 benchmarks/profile_triton.py --variant fs --H 32 --Hkv 8 --D 128 --T 65536 131072 --modes fwd --out $W/profile_fs_gqa.json; python3 benchmarks/gpu_attention.py --providers triton_fs sdpa_causal --shapes GQA-Hq32-Hkv8-D128 --modes fwd --lengths 32768 65536 98304 131072 --budget-s 150 --rep-ms 300 --out $W --tag _s43_gqa_fs"
step s42_same 80 python3 benchmarks/fsb_same_selections.py --roots .ab/pre_s42 . --T 262144
step s42_time 80 bash -c "python3 .ab/pre_s42/benchmarks/fsb_prefill_split.py --lengths 1048576 --providers search --rep 50 --audit 0 --out $W/fsb_prefill_pre_s42.json && python3 benchmarks/fsb_prefill_split.py --lengths 1048576 --providers search --rep 50 --audit 0 --out $W/fsb_prefill_s42.json"
step s42_tests 120 python3 -m pytest -q -n ${NPROC:-16} -p no:benchmark proofs_tests/test_triton_fsb_search.py -k "cuda or gpu"
step s42_h16 170 python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs triton_fsb sdpa_causal fla_nsa flex_swa512 --shapes H16-D64 --modes fwd --budget-s 140 --rep-ms 30 --out $W --tag _s42_h16
step s42_flexfsl 80 python3 benchmarks/gpu_attention.py --providers flex_fsl --shapes H16-D64 --modes fwd --lengths 16384 65536 --budget-s 50 --rep-ms 30 --out $W --tag _s42_flexfsl
step s42_long 120 python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs flex_swa512 --shapes H16-D64 --modes fwd --lengths 524288 1048576 --budget-s 70 --rep-ms 30 --out $W --tag _s42_long
step s42_gqa 150 python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs triton_fsb sdpa_causal fla_nsa flex_swa512 --shapes GQA-Hq32-Hkv8-D128 --modes fwd --budget-s 120 --rep-ms 30 --out $W --tag _s42_gqa
step s41f 300 bash -c "python3 -m pytest -q -n ${NPROC:-16} -p no:benchmark proofs_tests/test_triton_fsb_forests.py proofs_tests/test_triton_fsb_search.py proofs_tests/test_triton_decode.py proofs_tests/test_cache_gpu.py proofs_tests/test_models.py -k '(cuda or gpu or fsb or forests) and not cpu'; python3 benchmarks/fsb_forest_phases.py --lengths 1048576 --out $W/fsb_forest_phases_s41f.json; python3 benchmarks/gpu_attention.py --providers triton_fsb triton_fs --shapes H16-D64 --modes fwd --lengths 1048576 --budget-s 100 --out $W --tag _fsb_s41f"
step s41e_same 120 bash -c "for pair in pre:.ab/pre_s41b head:.; do (cd \${pair#*:} && python3 -c \"import sys, torch; import freesolo; print(freesolo.__file__); from freesolo import FreeSoloConfig; from freesolo.backends.triton.fsb_search import fsb_select_cells; torch.manual_seed(0); q = torch.randn(1, 262144, 16, 64, device='cuda', dtype=torch.bfloat16); k = torch.randn(1, 262144, 16, 64, device='cuda', dtype=torch.bfloat16); cfg = FreeSoloConfig(variant='fsb', tau=8.0 * 1.4); idx, found = fsb_select_cells(q, k, cfg, return_found=True); torch.save((idx.cpu(), found.cpu()), sys.argv[1])\" $W/sel_\${pair%%:*}.pt); done; python3 -c \"import torch; a = torch.load('$W/sel_pre.pt'); b = torch.load('$W/sel_head.pt'); print('selections bitwise equal:', torch.equal(a[0], b[0]), '| found beams bitwise equal:', torch.equal(a[1], b[1]), '| selected:', int((a[0] >= 0).sum()))\"; rm -f $W/sel_pre.pt $W/sel_head.pt"
step s41e_fsb 240 bash -c "python3 .ab/pre_s41b/benchmarks/fsb_prefill_split.py --lengths 65536 262144 1048576 --providers search select --audit 0 --out $W/fsb_prefill_pre_keepall.json && python3 benchmarks/fsb_prefill_split.py --lengths 65536 262144 1048576 --providers search select --audit 0 --out $W/fsb_prefill_keepall.json; python3 benchmarks/gpu_attention.py --providers triton_fsb triton_fs --shapes H16-D64 --modes fwd --lengths 262144 1048576 --budget-s 140 --out $W --tag _fsb_s41e"
step s40b_tests 290 python3 -m pytest -v -n ${NPROC:-16} -p no:benchmark --durations=30 proofs_tests/test_triton_fsb_search.py proofs_tests/test_triton_attention.py proofs_tests/test_triton_backend.py proofs_tests/test_triton_graphs.py proofs_tests/test_row_independence.py -k "(cuda or gpu or tma or fsb_search) and not cpu and not numba"
step s40b_ncu 150 ncu --clock-control none --kernel-name regex:_fsb_search_kernel --launch-skip 2 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section InstructionStats --section ComputeWorkloadAnalysis python3 benchmarks/fsb_prefill_split.py --lengths 65536 --providers search --rep 20 --audit 0
step s40c_fsb 200 bash -c "python3 .ab/pre_s40/benchmarks/fsb_prefill_split.py --lengths 65536 262144 1048576 --providers search select --out $W/fsb_prefill_pre_s40.json && python3 benchmarks/fsb_prefill_split.py --lengths 65536 262144 1048576 --providers forests search select --dim-chunks 64 8 4 --out $W/fsb_prefill_s40.json"
step s40d_tests 150 python3 -m pytest -v -n ${NPROC:-16} -p no:benchmark --durations=10 proofs_tests/test_triton_fsb_search.py -k "cuda or dim_chunk or tile_rerank or rerank_mode"
step s40c_tests 200 python3 -m pytest -v -n ${NPROC:-16} -p no:benchmark --durations=20 proofs_tests/test_triton_fsb_search.py proofs_tests/test_triton_decode.py proofs_tests/test_cache_gpu.py proofs_tests/test_models.py -k "(cuda or gpu or fsb) and not cpu"
step s39b_tests 400 python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark --durations=25 -k "cuda or gpu or tma or fsb" proofs_tests/test_triton_attention.py proofs_tests/test_triton_backend.py proofs_tests/test_row_independence.py proofs_tests/test_packed.py proofs_tests/test_models.py proofs_tests/test_triton_graphs.py proofs_tests/test_triton_backward.py proofs_tests/test_triton_fsb_search.py
step s39b_tile 150 env FREESOLO_TRITON_FSB_RERANK=tile python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark proofs_tests/test_triton_fsb_search.py
step s33a_attn 330 python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fsl_eager triton_fs triton_fs_eager triton_fsl_graph sdpa_causal flex_swa512 --shapes H16-D64 --modes fwd fwd+bwd --lengths 4096 8192 16384 65536 --budget-s 290 --rep-ms 30 --out "$W" --tag _s33a
step s33a_train 200 python3 benchmarks/train_step.py --lengths 4096 8192 16384 --providers freesolo_fsl_triton sdpa_causal flex_swa512 --out "$W"
step s31b_attn 330 python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs sdpa_causal flex_swa512 fla_nsa --shapes H16-D64 --modes fwd fwd+bwd --lengths 4096 16384 65536 131072 --budget-s 290 --rep-ms 30 --out "$W" --tag _s31b
step s31b_overlap 150 bash -c "python3 benchmarks/forward_overlap_ab.py --lengths 4096 16384 65536 --fs-lengths --configs overlap sorted --out $W/forward_overlap_s31b.json && python3 benchmarks/launch_host_probe.py --T 4096 16384 --idle --no-replay --out $W/launch_host_s31b.json"
step s30f_rope 90 python3 benchmarks/rope_sweep.py --out "$W/rope_sweep.json"
step s30e_decode 220 python3 benchmarks/gpu_decode.py --contexts 4096 65536 262144 1048576 --batches 1 32 --tiles default --out "$W" --name gpu_decode_s30
step s30e_fsb 160 python3 benchmarks/gpu_attention.py --providers triton_fsb triton_fs --shapes H16-D64 --modes fwd --lengths 262144 1048576 --budget-s 140 --out "$W" --tag _fsb_s30
step s30d_tests 200 python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k "cuda or gpu or cell_plan or without_saved" proofs_tests/test_triton_selection.py proofs_tests/test_row_independence.py proofs_tests/test_triton_backend.py proofs_tests/test_triton_attention.py proofs_tests/test_triton_backward.py proofs_tests/test_packed.py proofs_tests/test_models.py proofs_tests/test_triton_decode.py proofs_tests/test_triton_fsb_search.py
step s30d_final 330 python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs triton_fsl_compiled sdpa_causal flex_swa512 fla_nsa --shapes H16-D64 --modes fwd fwd+bwd --lengths 4096 16384 65536 131072 --budget-s 290 --rep-ms 30 --out $W --tag _s30d
step s30c_tests 150 python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k "reduce_overhead or graph_replay or fast_launch" proofs_tests/test_triton_backend.py
step s30c_train 420 python3 benchmarks/train_step.py --lengths 4096 16384 --out $W
step s30b_tests 90 python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k "cuda or gpu" proofs_tests/test_triton_backend.py proofs_tests/test_triton_decode.py
step s30b_host 60 python3 benchmarks/launch_host_probe.py --T 4096 16384 --calls 100 --ab --no-replay --out $W/launch_host_s30b.json
step s30b_compiled 300 python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fsl_graph triton_fsl_compiled sdpa_causal sdpa_causal_compiled flex_swa512 --shapes H16-D64 --modes fwd fwd+bwd --lengths 4096 16384 65536 --budget-s 270 --rep-ms 30 --out $W --tag _s30b
step s30b_memcheck 150 compute-sanitizer --tool memcheck python3 benchmarks/sanitize_triton.py forward_backward
step s30a_prof 200 bash -c "python3 benchmarks/profile_triton.py --T 4096 16384 65536 --out $W/profile_s30a.json; python3 benchmarks/launch_host_probe.py --T 4096 --calls 100 --out $W/launch_host_s30a.json"
step s30a_tests 380 python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k "cuda or gpu or cell_plan" proofs_tests/test_triton_backward.py proofs_tests/test_triton_backend.py proofs_tests/test_triton_attention.py proofs_tests/test_triton_decode.py proofs_tests/test_triton_fsb_search.py proofs_tests/test_triton_fsb_build.py proofs_tests/test_cache_gpu.py proofs_tests/test_cache_ragged.py proofs_tests/test_models.py
step s29e 300 bash -c "python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_attention.py proofs_tests/test_triton_backend.py proofs_tests/test_row_independence.py; python3 benchmarks/gpu_attention.py --providers triton_fsl sdpa_causal flex_swa512 fla_nsa --shapes H16-D64 --modes fwd fwd+bwd --lengths 4096 16384 65536 --budget-s 100 --rep-ms 30 --out $W --tag _s29e"
step s29d 480 bash -c "compute-sanitizer --tool memcheck python3 benchmarks/sanitize_triton.py forward_backward; compute-sanitizer --tool racecheck python3 benchmarks/sanitize_triton.py forward_backward; python3 benchmarks/train_step.py --lengths 4096 16384 65536 --out $W; python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fsl_graph sdpa_causal sdpa_causal_graph flex_swa512 --shapes H16-D64 --modes fwd fwd+bwd --lengths 4096 16384 --budget-s 100 --rep-ms 30 --out $W --tag _s29d_graph"
step s29c 560 bash -c "python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu or cell_plan' proofs_tests/test_triton_selection.py proofs_tests/test_row_independence.py proofs_tests/test_triton_backend.py proofs_tests/test_triton_attention.py proofs_tests/test_triton_backward.py proofs_tests/test_packed.py proofs_tests/test_models.py; python3 benchmarks/launch_host_probe.py --T 4096 16384 --calls 100 --ab --torch-profile --no-replay --out $W/launch_host_s29c.json; python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs sdpa_causal flex_swa512 fla_nsa --shapes H16-D64 --modes fwd --lengths 4096 16384 65536 131072 --budget-s 140 --rep-ms 30 --out $W --tag _s29c_fwd; python3 benchmarks/gpu_attention.py --providers triton_fsl sdpa_causal flex_swa512 fla_nsa --shapes H16-D64 --modes fwd+bwd --lengths 4096 16384 65536 --budget-s 100 --rep-ms 30 --out $W --tag _s29c_bwd"
step s29b 400 bash -c "python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu' proofs_tests/test_triton_backend.py proofs_tests/test_triton_attention.py proofs_tests/test_row_independence.py; python3 benchmarks/launch_host_probe.py --T 4096 16384 65536 --calls 100 --ab --torch-profile --no-replay --out $W/launch_host_s29b.json"
step s29a 560 bash -c "python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu or without_saved' proofs_tests/test_triton_selection.py proofs_tests/test_row_independence.py proofs_tests/test_triton_backend.py proofs_tests/test_triton_attention.py proofs_tests/test_triton_backward.py proofs_tests/test_packed.py proofs_tests/test_models.py; python3 benchmarks/launch_host_probe.py --T 4096 16384 --calls 100 --out $W/launch_host_s29a.json; compute-sanitizer --tool memcheck python3 benchmarks/sanitize_triton.py forward_backward && compute-sanitizer --tool racecheck python3 benchmarks/sanitize_triton.py forward_backward"
step final28b 430 bash -c "python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k 'cuda or gpu or without_saved' proofs_tests/test_triton_selection.py proofs_tests/test_row_independence.py proofs_tests/test_triton_backend.py proofs_tests/test_triton_attention.py proofs_tests/test_packed.py proofs_tests/test_models.py; python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs sdpa_causal flex_swa512 fla_nsa --shapes H16-D64 --modes fwd --lengths 4096 16384 65536 131072 --budget-s 140 --rep-ms 30 --out $W --tag _s28b_fwd; python3 benchmarks/forward_overlap_ab.py --lengths 65536 131072 --fs-lengths --configs sorted --out $W/forward_s28b.json; python3 benchmarks/host_overhead_probe.py --T 16384 65536 --calls 100 --out $W/host_overhead_s28b.json"
step probe28 120 bash -c "python3 benchmarks/long_bound_probe.py --out $W/long_bound_probe.json; python3 benchmarks/host_overhead_probe.py --T 4096 16384 --out $W/host_overhead_s28.json"
step devguard 130 python3 -m pytest -q -n ${NPROC:-14} -p no:benchmark -k "cuda or gpu" proofs_tests/test_triton_backend.py proofs_tests/test_triton_decode.py
step realkeys 150 python3 benchmarks/real_keys_bench.py --length 65536 --out "$W/real_keys.json"
step graph4k 200 bash -c "python3 -m pytest -q -p no:benchmark -k 'graph' proofs_tests/test_triton_backend.py; python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fsl_graph sdpa_causal sdpa_causal_graph flex_swa512 --shapes H16-D64 --modes fwd fwd+bwd --lengths 4096 16384 --budget-s 120 --rep-ms 30 --out $W --tag _graph"
step fsb_long2 90 python3 benchmarks/fsb_search_bench.py --providers triton --lengths 262144 1048576 --out "$W/fsb_search_long.json"
step decode_tiles2 200 python3 benchmarks/gpu_decode.py --contexts 4096 1048576 --batches 1 32 --tiles single single_w4 split split64_w2 split64_w1 split32_w2 split32_w1 --out "$W" --name gpu_decode_tiles2
step fsb_decode3 240 python3 benchmarks/fsb_decode_bench.py --contexts 4096 65536 1048576 --out "$W/fsb_decode.json"
step fwd_sweep 200 python3 benchmarks/triton_forward_ab.py --sweep-only --out "$W/triton_forward_sweep.json"
step bwd_sweep 300 python3 benchmarks/triton_backward_bench.py --lengths 65536 --sweep-only --rep 30 --out "$W/triton_backward_sweep.json"
step fsb_decode4 120 python3 benchmarks/fsb_decode_bench.py --contexts 65536 1048576 --out "$W/fsb_decode4.json"
step bwd_bars 220 python3 benchmarks/triton_backward_bench.py --lengths 4096 65536 --no-profile --rep 30 --out "$W/triton_backward_bars.json"
step attention 260 python3 benchmarks/gpu_attention.py --providers triton_fsl triton_fs sdpa_causal flex_swa512 fla_nsa --shapes H16-D64 --modes fwd fwd+bwd --lengths 4096 16384 65536 --budget-s 190 --rep-ms 30 --out "$W" --tag _s21_nsa
step fsb_prefill2 120 python3 benchmarks/fsb_search_bench.py --providers triton --lengths 65536 262144 1048576 --out "$W/fsb_search_sort.json"
step decode_full 140 python3 benchmarks/gpu_decode.py --contexts 4096 65536 1048576 --tiles default single --out "$W" --name gpu_decode_s21
step memcheck_fsb 120 compute-sanitizer --tool memcheck python3 benchmarks/sanitize_triton.py fsb_search decode
step fsb_probe 45 python3 benchmarks/fsb_eval_probe.py --lengths 4096 32768
step torch_ab 160 python3 benchmarks/torch_readout_ab.py --out "$W/torch_readout_ab.json"
step bwd_split 60 "${SPLIT[@]}" python3 benchmarks/triton_backward_bench.py --lengths 4096 16384 65536 --no-api --no-profile --rep 30 --out "$W/triton_backward_split.json"
step train_step 90 "${SPLIT[@]}" python3 benchmarks/train_step.py --lengths 4096 16384 65536 --out "$W"
(cd "$W" && find . -type f -size -256M -print0) | tar -C "$W" --null -T - -cf "$OUT/session.tar"
ls -la "$OUT"
