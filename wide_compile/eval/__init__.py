"""Evaluation: WikiText-2 perplexity, lm-eval zero-shot tasks on local data, baselines, reports.

Entry point: `python -m wide_compile.eval {pipeline,prepare,ppl,tasks,report,merge} ...` or `eval_main(argv)`.
"""
from __future__ import annotations


def eval_main(argv=None) -> int:
    """`wide eval` front end."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    cmds = ("pipeline", "prepare", "ppl", "tasks", "report", "merge")
    if not argv or argv[0] not in cmds:
        print(f"usage: python -m wide_compile.eval {{{','.join(cmds)}}} [options] (--help for each)")
        return 2
    from . import cli

    return getattr(cli, argv[0])(argv[1:]) or 0


__all__ = ["eval_main"]
