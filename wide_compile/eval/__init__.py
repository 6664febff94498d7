"""Evaluation: quality of WIDE against dense (perplexity ratio, NLL by position, generation agreement,
zero-shot retention), lm-eval zero-shot tasks on local data, baselines, reports.

Entry point: `wide eval <command> ...` (also `python -m wide_compile.eval`) or `eval_main(argv)`;
`wide eval --help` lists every command with its options.
"""
from __future__ import annotations


def eval_main(argv=None) -> int:
    """`wide eval` front end."""
    import sys

    from . import cli
    from .records import DataNotFound

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(cli.full_help())
        return 0 if argv else 2
    if argv[0] not in cli.COMMANDS:
        print(f"wide eval: unknown command {argv[0]!r}; choose from {', '.join(cli.COMMANDS)} "
              "(wide eval --help lists their options)", file=sys.stderr)
        return 2
    try:
        return cli.COMMANDS[argv[0]][1](argv[1:]) or 0
    except DataNotFound as e:
        print(f"wide eval {argv[0]}: error: {e}", file=sys.stderr)
        return 2


__all__ = ["eval_main"]
