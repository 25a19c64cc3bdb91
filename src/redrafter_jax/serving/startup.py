"""A server that listens before it is ready: ``/health`` answers 503 with the start-up's progress.

``serve`` binds its port and answers at once, while a background thread loads the model and
drafter, chooses the tree and runs the warm-up (``server.build``). Until that is done this ASGI
app stands in front: ``GET /health`` is 503 with ``{"status": "starting", "stage": ...,
"warmup": {"done": i, "total": n}, "elapsed_s": ...}``, every other route 503 with
``Retry-After`` and the error code ``starting``. Then it hands each request to the real app.
A start-up that fails answers ``/health`` with ``"status": "failed"`` and the error until the
process exits (``serve`` stops the listener and reports the error as one line).

Load balancers, orchestrators' readiness probes and ``bench.loadtest`` already wait for ``/health``
200, so they need no change; a client sees a refusal it can retry instead of a closed port.
"""

from __future__ import annotations

import logging
import threading
import time
import types

from starlette.responses import JSONResponse

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5


class Startup:
  """The start-up's progress (thread-safe: the build thread writes, the event loop reads) and the
  ASGI app in front of the real one."""

  def __init__(self):
    self._lock = threading.Lock()
    self._t0 = time.monotonic()
    self._stage = "starting"
    self._done = self._total = 0
    self._error: str | None = None
    self._app = None

  # ---- written by the build thread

  def stage(self, name: str) -> None:
    with self._lock:
      self._stage = name
    log.info("start-up: %s (%.1f s in)", name, time.monotonic() - self._t0)

  def warmup(self, done: int, total: int, what: str, seconds: float) -> None:
    """One warm-up program ran (compiled, or loaded from the compilation cache; the engine logs
    it)."""
    with self._lock:
      self._done, self._total = done, total

  def ready(self, app) -> None:
    with self._lock:
      self._app, self._stage = app, "ready"
    log.info("ready in %.1f s", time.monotonic() - self._t0)

  def fail(self, error: BaseException) -> None:
    with self._lock:
      self._stage, self._error = "failed", f"{type(error).__name__}: {error}"

  # ---- read by the event loop

  def snapshot(self) -> dict:
    with self._lock:
      out = {"status": "failed" if self._error else "starting", "stage": self._stage,
             "elapsed_s": round(time.monotonic() - self._t0, 1)}
      if self._total:
        out["warmup"] = {"done": self._done, "total": self._total}
      if self._error:
        out["error"] = self._error
      return out

  @property
  def state(self):
    """The real app's ``state`` once ready (its ``drain`` for a graceful shutdown), else an
    empty namespace: nothing is in flight while starting."""
    app = self._app
    return app.state if app is not None else types.SimpleNamespace()

  async def __call__(self, scope, receive, send):
    app = self._app
    if app is not None:
      return await app(scope, receive, send)
    if scope["type"] != "http":
      return  # lifespan is off (shutdown.make_server); nothing else is served
    progress = self.snapshot()
    if scope["path"] == "/health":
      response = JSONResponse(progress, status_code=503,
                              headers={"Retry-After": str(RETRY_AFTER_S)})
    else:
      message = (f"the server is starting ({progress['stage']}, {progress['elapsed_s']} s in); "
                 "retry when GET /health answers 200" if progress["status"] == "starting"
                 else f"the server failed to start: {progress.get('error')}")
      response = JSONResponse(
          {"error": {"message": message, "type": "server_error", "param": None,
                     "code": "starting" if progress["status"] == "starting" else "start_failed"}},
          status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
    await response(scope, receive, send)
