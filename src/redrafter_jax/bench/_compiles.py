"""What JAX compiled, from its own monitoring events: how many programs and how many seconds.

A helper of the benchmarks (the leading underscore keeps it out of the benchmark list): a
timing that must exclude compiles checks the count; a table of compile times sums the seconds
JAX spent tracing, lowering and compiling (nothing else is counted).
"""

from __future__ import annotations

import contextlib
import functools

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration", BACKEND_COMPILE)
_TOTAL = {"programs": 0, "seconds": 0.0}


@functools.cache
def _watch() -> None:
  import jax

  def on_event(name, secs, **kwargs):
    if name == BACKEND_COMPILE:
      _TOTAL["programs"] += 1
    if name in COMPILE_EVENTS:
      _TOTAL["seconds"] += secs

  jax.monitoring.register_event_duration_secs_listener(on_event)


def programs_compiled() -> int:
  """Programs compiled by the backend since the watch began (the first call begins it)."""
  _watch()
  return _TOTAL["programs"]


@contextlib.contextmanager
def compile_seconds():
  """Yields a one-item list that holds, on exit, the seconds JAX spent compiling inside."""
  _watch()
  out, before = [0.0], _TOTAL["seconds"]
  try:
    yield out
  finally:
    out[0] = _TOTAL["seconds"] - before
