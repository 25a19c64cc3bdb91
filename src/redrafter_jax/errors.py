"""The one base class of every error that is the user's to fix, at the bottom of the package.

Each layer raises its own subclass (``ConfigError``, ``WeightsError``, ``GenerateError``, ...);
the command line, the benchmarks and the server catch ``UserError`` and print it as one line
(exit status 2 on the command line) instead of a traceback. Living here, below every other
module, it can be imported by any of them without an import running back up the layers.
"""

from __future__ import annotations


class UserError(Exception):
  """An error caused by the user's input (arguments, configuration, files, weights)."""


def user_errors() -> tuple[type[BaseException], ...]:
  """Exception types that are the user's fault: ``UserError`` and missing or clashing paths."""
  return (UserError, FileNotFoundError, FileExistsError, NotADirectoryError)
