"""The help formatter of every `wide eval` parser: each option shows its default, even without a help text."""
from __future__ import annotations

import argparse


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _format_action(self, action):
        if action.help is None and action.option_strings:
            action.help = "(default: %(default)s)"  # argparse adds defaults only to a help text
        return super()._format_action(action)
