"""Run by tests/test_training_distributed.py under `torchrun --nproc-per-node 2` (CPU, gloo): the training
commands exactly as `wide train` runs them, in one launch (one interpreter start per rank).

    worker.py <stage1 out> <stage2 out> <stage-1 flags as JSON> <stage-2 flags as JSON>

Stage 1 from scratch; stage 2 resumes the checkpoint in <stage2 out> (written by one process), pauses after
one step (a checkpoint of sharded adapter / optimizer state) and resumes again to the end."""
import json
import sys

from wide_compile.training import train_main


def run(argv, expect):
    rc = train_main(argv)
    if rc != expect:
        raise SystemExit(f"{argv[0]} returned {rc}, expected {expect}")


if __name__ == "__main__":
    s1_out, s2_out, s1_flags, s2_flags = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    run(["stage1", "--out", s1_out, *s1_flags], 0)
    run(["stage2", "--out", s2_out, *s2_flags, "--stop-after-steps", "1"], 75)
    run(["stage2", "--out", s2_out, *s2_flags], 0)
