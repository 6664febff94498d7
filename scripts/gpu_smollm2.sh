#!/usr/bin/env bash
# The accuracy pipeline (python -m wide_compile.eval pipeline) on the GPU machine; its results files are in
# benchmarks/results (accuracy-smollm2.json names each run's command and date). scripts/gpu_calls.sh's
# `train` step calls it after setup1/setup2. Expects, under $WCACHE (/root/wcache):
#   SmolLM2-135M-Instruct.Q4_1.gguf    (joined from the carried parts; its sha256 is models/smollm2.py GGUF_SHA256)
#   site/                              (pip --target install of the carried wheels: lm_eval, datasets, ...)
#   train_tokens_6m.npz                (python -m wide_compile.training tokenize --out ... ; first 6M tokens)
#   eval/wikitext-2/wiki.test.raw, eval/tasks/  (python -m wide_compile.eval prepare --limit 500 ...)
# Extra arguments go to `python -m wide_compile.eval pipeline` (e.g. --deadline 430 --s1-steps 350).
set -euo pipefail
C=${WCACHE:-/root/wcache}
export PYTHONPATH=$C/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export WIDE_SMOLLM2_GGUF=$C/SmolLM2-135M-Instruct.Q4_1.gguf WIDE_CACHE_DIR=$C/hf
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m wide_compile.eval pipeline --data "$C/eval" --tasks-dir "$C/eval/tasks" \
  --tokens "$C/train_tokens_6m.npz" --out "${OUT:-out}" --work "$C/work" "$@"
