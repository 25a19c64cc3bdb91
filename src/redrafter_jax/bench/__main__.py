"""``python -m redrafter_jax.bench NAME [options]``: run the benchmark module ``bench/NAME.py``."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import redrafter_jax.bench as package
from redrafter_jax.hostmem import keep_freed_memory


def available() -> list[str]:
  return sorted(m.name for m in pkgutil.iter_modules(package.__path__)
                if not m.name.startswith("_"))


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  names = available()
  if not argv or argv[0] in ("-h", "--help"):
    print(f"usage: python -m redrafter_jax.bench {{{','.join(names)}}} [options]\n"
          f"{__doc__.strip()}\nRun a benchmark with --help for its options.")
    return 0 if argv else 2
  name = argv[0]
  keep_freed_memory()  # before any JAX call allocates (``hostmem``)
  if name not in names:
    print(f"error: unknown benchmark {name!r}; available: {', '.join(names)}", file=sys.stderr)
    return 2
  from redrafter_jax.errors import user_errors

  module = importlib.import_module(f"redrafter_jax.bench.{name}")
  try:
    return int(module.main(argv[1:]) or 0)
  except user_errors() as e:  # the user's to fix: one line, not a traceback
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
