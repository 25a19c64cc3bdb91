"""``redrafter-jax`` command line: one subcommand per module in ``redrafter_jax.commands``.

Each command module defines ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``; a
pass-through one (``PASSTHROUGH = True``: bench, loadtest) has no parser of its own and hands its
arguments to the benchmark it runs. Errors
that are the user's (``errors.UserError`` and its subclasses: bad arguments, configs, weights,
unknown models; missing files) are printed as ONE line ``error: ...`` with exit status 2;
anything else is a bug and keeps its traceback.

A command whose module needs a package that is not installed (``fastapi`` for ``serve`` on a
machine set up for inference only) stays listed, and invoking it prints one line naming the
package and how to install it; the other commands work as usual.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import logging
import pathlib
import sys

from redrafter_jax.errors import user_errors
from redrafter_jax.hostmem import keep_freed_memory

COMMANDS = {
    "fetch": "redrafter_jax.commands.fetch",
    "generate": "redrafter_jax.commands.generate",
    "demo": "redrafter_jax.commands.demo",
    "export": "redrafter_jax.commands.export",
    "import": "redrafter_jax.commands.import_drafter",
    "prompt-mix": "redrafter_jax.commands.prompt_mix",
    "self-prompts": "redrafter_jax.commands.self_prompts",
    "distill-data": "redrafter_jax.commands.distill_data",
    "features": "redrafter_jax.commands.features",
    "train": "redrafter_jax.commands.train",
    "ablate": "redrafter_jax.commands.ablate",
    "serve": "redrafter_jax.commands.serve",
    "tune-tree": "redrafter_jax.commands.tune_tree",
    "lease": "redrafter_jax.commands.lease",
    "bench": "redrafter_jax.commands.bench",
    "loadtest": "redrafter_jax.commands.loadtest",
}


# Packages some commands need that a machine may lack, and the extra that installs each (None:
# a core dependency, installed by its own name).
OPTIONAL_PACKAGES = {
    "fastapi": "serve", "uvicorn": "serve", "starlette": "serve", "prometheus_client": "serve",
    "mlx": "mlx", "grain": None, "gguf": None,
}


class Unavailable:
  """Stands in for a command module that could not be imported for want of ``package``: listed
  with its help, it takes any arguments, and running it fails as the import did."""

  def __init__(self, module: str, package: str):
    self.package = package
    self.HELP = f"{_static_help(module)} [needs {package}, not installed]"

  def run(self, args) -> int:
    raise ModuleNotFoundError(f"No module named {self.package!r}", name=self.package)


def _static_help(module: str) -> str:
  """A command module's ``HELP``, read from its source without running it."""
  spec = importlib.util.find_spec(module)
  try:
    tree = ast.parse(pathlib.Path(spec.origin).read_text())
  except (AttributeError, TypeError, OSError, SyntaxError):
    return module
  for node in tree.body:
    if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "HELP" for t in node.targets)
        and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
      return node.value.value
  return module


def missing_package(error: ModuleNotFoundError) -> str | None:
  """The top-level package whose absence raised ``error``; None for one of our own modules (a
  missing one is a bug, not an installation to fix)."""
  package = (error.name or "").split(".")[0]
  return package if package and package != "redrafter_jax" else None


def missing_package_message(command: str, package: str) -> str:
  """The one line printed when ``command`` cannot run for want of ``package``."""
  extra = OPTIONAL_PACKAGES.get(package)
  hint = f"pip install 'redrafter_jax[{extra}]'" if extra else f"pip install {package}"
  return f"{command!r} needs the package {package!r}, which is not installed ({hint})"


def _available():
  """Every command's module, or an ``Unavailable`` in its place when a package it imports is
  missing (one absent optional package must not take the whole command line down)."""
  out = {}
  for name, module in COMMANDS.items():
    try:
      out[name] = importlib.import_module(module)
    except ModuleNotFoundError as e:
      if e.name == module:  # the command itself is not shipped: leave it out
        continue
      package = missing_package(e)
      if package is None:
        raise
      out[name] = Unavailable(module, package)
  return out


def main(argv: list[str] | None = None) -> int:
  keep_freed_memory()  # before any JAX call allocates (``hostmem``)
  logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
  logging.getLogger("jax").setLevel(logging.WARNING)  # not its INFO notes on absent backends
  parser = argparse.ArgumentParser(prog="redrafter-jax", description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  modules = _available()
  for name, module in modules.items():
    if isinstance(module, Unavailable):  # no parser to run: ``--help`` too gives the error
      sub.add_parser(name, help=module.HELP, add_help=False, prefix_chars="\0").add_argument(
          "args", nargs="*")
      continue
    if getattr(module, "PASSTHROUGH", False):  # its own parser reads the arguments (bench)
      sub.add_parser(name, help=module.HELP, add_help=False, prefix_chars="\0").add_argument(
          "options", nargs="*")
      continue
    p = sub.add_parser(name, help=module.HELP, description=module.HELP)
    module.add_arguments(p)
  args = parser.parse_args(argv)
  try:
    return int(modules[args.command].run(args) or 0)
  except user_errors() as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except ModuleNotFoundError as e:
    # Also raised when a command imports an optional package only as it runs; any other missing
    # module keeps its traceback.
    package = missing_package(e)
    if package not in OPTIONAL_PACKAGES and not isinstance(modules[args.command], Unavailable):
      raise
    print(f"error: {missing_package_message(args.command, package)}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    return 130


if __name__ == "__main__":
  sys.exit(main())
