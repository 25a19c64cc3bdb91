"""``redrafter-jax fetch NAME``: download a known base model into the cache."""

from redrafter_jax.weights import fetch

HELP = "download a known base model (e.g. smollm2-135m) into the local cache"


def add_arguments(p):
  from redrafter_jax.commands import show_defaults

  show_defaults(p)
  p.add_argument("name", choices=sorted(fetch.KNOWN_MODELS), help="model name")
  p.add_argument("--force", action="store_true", help="download again even if cached")


def run(args) -> int:
  path = fetch.fetch(args.name, force=args.force)
  print(path)
  return 0
