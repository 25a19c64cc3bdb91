"""``redrafter-jax bench NAME [options]``: a benchmark, as ``python -m redrafter_jax.bench NAME``
runs it (every argument goes to it: ``redrafter-jax bench suite --help``)."""

HELP = "run a benchmark (suite, loadtest, invariant, ...); no NAME lists them"
PASSTHROUGH = True  # cli hands every argument to run() unparsed


def run(args) -> int:
  from redrafter_jax.bench.__main__ import main

  return main(list(args.options))
