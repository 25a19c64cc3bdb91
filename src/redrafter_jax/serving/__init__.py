"""Serving: a continuous-batching ReDrafter engine behind an OpenAI-compatible HTTP API.

Modules: ``engine`` (slots, queue, the engine thread), ``policy`` (which step mode runs),
``batch`` and ``placement`` (the device side), ``request`` and ``textstream`` (a request and its
text), ``protocol``, ``completions`` and ``app`` (the HTTP side), ``metrics``, ``lifecycle``
(listening before ready, graceful shutdown) and ``server`` (assembly from a preset and its
``ServeConfig``); the load test is a benchmark (``bench.loadtest``). Names
load on first use, so importing one does not pull in the HTTP server or the engine.
"""

import importlib

_EXPORTS = {
    "Delta": "request", "EngineStopped": "request", "Failed": "request", "Finished": "request",
    "GenerationRequest": "request", "QueueFull": "request", "RequestError": "request",
    "Engine": "engine", "EngineConfig": "engine", "SamplingDefaults": "completions",
    "create_app": "app",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
