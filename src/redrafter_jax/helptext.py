"""Help texts that show each option's default, for the command line's subcommands and the
benchmarks alike: a user reading ``--help`` should not have to open the code to learn what an
option does when left out."""

from __future__ import annotations

import argparse


class DefaultsFormatter(argparse.HelpFormatter):
  """Help that ends each option's text with its default ("(default: 128)"), unless the text
  already speaks of its default or there is none to show (None, False, an empty list)."""

  def _get_help_string(self, action):
    text = action.help or ""
    default = action.default
    empty = isinstance(default, (list, tuple, str)) and not default
    if ("default" in text or not action.option_strings or default is None or default is False
        or default is argparse.SUPPRESS or empty):
      return text
    return f"{text} (default: %(default)s)"


class RawDescriptionDefaultsFormatter(DefaultsFormatter, argparse.RawDescriptionHelpFormatter):
  """``DefaultsFormatter`` that keeps the description's and epilog's line breaks."""


def show_defaults(parser: argparse.ArgumentParser) -> None:
  """Make ``parser``'s ``--help`` show the options' defaults, keeping a raw description raw."""
  raw = issubclass(parser.formatter_class, argparse.RawDescriptionHelpFormatter)
  parser.formatter_class = RawDescriptionDefaultsFormatter if raw else DefaultsFormatter
