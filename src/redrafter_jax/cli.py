"""``redrafter-jax`` command line: one subcommand per module in ``redrafter_jax.commands``.

Each command module defines ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``. Errors
that are the user's (``errors.UserError`` and its subclasses: bad arguments, configs, weights,
unknown models; missing files) are printed as ONE line ``error: ...`` with exit status 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
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
}


def _available():
  out = {}
  for name, module in COMMANDS.items():
    try:
      out[name] = importlib.import_module(module)
    except ModuleNotFoundError as e:
      if e.name != module:  # the command exists but one of its dependencies is missing
        raise
  return out


def main(argv: list[str] | None = None) -> int:
  keep_freed_memory()  # before any JAX call allocates (``hostmem``)
  logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
  logging.getLogger("jax").setLevel(logging.WARNING)  # not its INFO notes on absent backends
  parser = argparse.ArgumentParser(prog="redrafter-jax", description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  modules = _available()
  for name, module in modules.items():
    p = sub.add_parser(name, help=module.HELP, description=module.HELP)
    module.add_arguments(p)
  args = parser.parse_args(argv)
  try:
    return int(modules[args.command].run(args) or 0)
  except user_errors() as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    return 130


if __name__ == "__main__":
  sys.exit(main())
