"""The help formatter of every `wide` command and benchmark script: descriptions as written, and each
option's help ends with its default."""
from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends "(default: X)" to each option's help, except where the default is unset (None, or False for a
    flag: the help says in words what unset means) or the help already states it."""

    def _get_help_string(self, action):
        h = action.help or ""
        d = action.default
        if d is None or d is False or d is argparse.SUPPRESS or "default" in h:
            return h
        return h + (" " if h else "") + "(default: %(default)s)"
