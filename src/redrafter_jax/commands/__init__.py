"""The ``redrafter-jax`` subcommands, one module each (``cli.COMMANDS``): ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``; a ``PASSTHROUGH`` one (``bench``,
``loadtest``) has no parser of its own: ``run`` gets every argument as ``args.options``."""

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


def show_defaults(parser: argparse.ArgumentParser) -> None:
  """Make ``parser``'s ``--help`` show the options' defaults (``DefaultsFormatter``)."""
  parser.formatter_class = DefaultsFormatter
