"""The ``redrafter-jax`` subcommands, one module each (``cli.COMMANDS``): ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``; a ``PASSTHROUGH`` one (``bench``,
``loadtest``) has no parser of its own: ``run`` gets every argument as ``args.options``."""

from redrafter_jax.helptext import show_defaults

__all__ = ["show_defaults"]
