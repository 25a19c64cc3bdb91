"""``redrafter-jax loadtest [options]``: the serving load test (``bench.loadtest``; its options:
``redrafter-jax loadtest --help``)."""

HELP = "load-test an OpenAI-compatible server, or ReDrafter vs AR side by side (--compare)"
PASSTHROUGH = True  # cli hands every argument to run() unparsed


def run(args) -> int:
  from redrafter_jax.bench.__main__ import main

  return main(["loadtest", *args.options])
