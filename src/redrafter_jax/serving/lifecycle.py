"""A server process's start and end: it listens before it is ready, and it shuts down
gracefully.

**Start** (``Startup``). ``serve`` binds its port and answers at once, while a background thread
loads the model and drafter, chooses the tree and runs the warm-up (``server.build``). Until
that is done this ASGI app stands in front: ``GET /health`` is 503 with ``{"status":
"starting", "stage": ..., "warmup": {"done": i, "total": n}, "elapsed_s": ...}``, every other
route 503 with ``Retry-After`` and the error code ``starting``. Then it hands each request to the
real app. A start-up that fails answers ``/health`` with ``"status": "failed"`` and the error
until the process exits (``serve`` stops the listener and reports the error as one line). Load
balancers, orchestrators' readiness probes and ``bench.loadtest`` already wait for ``/health``
200, so they need no change; a client sees a refusal it can retry instead of a closed port.

**End** (``GracefulServer``). uvicorn's own shutdown closes the listener, waits a fixed time for
connections and then cancels them (streams end mid-chunk), and re-raises the signal it caught,
so the process exits 143. ``GracefulServer`` instead, on SIGTERM or SIGINT: keeps the listener
open and lets the app answer new requests 503 while the requests in flight finish, for up to
``grace`` seconds (the app's ``drain``); ends whatever is left with a final event; then closes
the listener and the idle connections (uvicorn's own shutdown) and returns normally: exit
status 0.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
import types

import uvicorn
from starlette.responses import JSONResponse

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5
CLOSE_TIMEOUT_S = 5  # after the drain: for connections to finish writing their last bytes


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
      return  # lifespan is off (make_server); nothing else is served
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


class GracefulServer(uvicorn.Server):

  def __init__(self, config: uvicorn.Config, *, grace: float, announce: str | None = None):
    super().__init__(config)
    self.grace = grace
    self.announce = announce  # printed once the server accepts connections

  async def startup(self, sockets=None) -> None:
    await super().startup(sockets=sockets)
    if self.started and self.announce:
      print(self.announce, flush=True)

  async def shutdown(self, sockets=None) -> None:
    drain = getattr(self.config.app.state, "drain", None)
    if drain is not None:
      log.info("shutting down: no new requests; up to %.1f s for those in flight", self.grace)
      await drain(self.grace)
    await super().shutdown(sockets=sockets)

  @contextlib.contextmanager
  def capture_signals(self):
    """SIGINT/SIGTERM start the graceful shutdown; unlike uvicorn's, the signal is not raised
    again afterwards (the process ends with status 0 once shut down)."""
    if threading.current_thread() is not threading.main_thread():
      yield
      return
    handled = (signal.SIGINT, signal.SIGTERM)
    original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
    try:
      yield
    finally:
      for sig, handler in original.items():
        signal.signal(sig, handler)


def make_server(app, *, log_level: str, grace: float, announce: str | None = None
                ) -> GracefulServer:
  config = uvicorn.Config(app, log_level=log_level, access_log=log_level == "info",
                          timeout_graceful_shutdown=CLOSE_TIMEOUT_S, lifespan="off")
  return GracefulServer(config, grace=grace, announce=announce)
