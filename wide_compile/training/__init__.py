"""Router training: stage 1 (routers only, base frozen, KD + LM + capacity loss) and stage 2 (LoRA).

Entry point: `python -m wide_compile.training {recipe,stage1,stage2,tokenize,convert,answers,lora-rank} ...` or `train_main(argv)`;
`recipe` runs both stages of one capacity, resumably (training/recipe.py). Each runs unchanged under
`torchrun --nproc-per-node N` (training/distributed.py: FSDP2).
"""
from __future__ import annotations

from .stage1 import Stage1Config, calibrate_offset_, deterministic_capacity, kd_loss, train_stage1
from .stage2 import Stage2Config, load_lora_merged, save_lora, train_stage2

__all__ = ["Stage1Config", "Stage2Config", "train_stage1", "train_stage2", "kd_loss", "calibrate_offset_",
           "deterministic_capacity", "load_lora_merged", "save_lora", "train_main"]


def train_main(argv=None) -> int:
    """`wide train` front end: train_main(["stage1", "--capacity", "0.5", "--out", "runs/c50"])."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    cmds = {"recipe": "recipe", "stage1": "stage1", "stage2": "stage2", "tokenize": "data", "convert": "convert",
            "answers": "dense_answers", "lora-rank": "lora_rank"}
    if not argv or argv[0] not in cmds:
        print("usage: python -m wide_compile.training {recipe,stage1,stage2,tokenize,convert,answers,lora-rank} [options] (--help for each)")
        return 2
    import importlib

    mod = importlib.import_module(f".{cmds[argv[0]]}", __name__)
    return mod.main(argv[1:]) or 0
