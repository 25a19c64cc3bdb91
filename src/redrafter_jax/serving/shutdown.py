"""uvicorn with a graceful shutdown that the server controls.

uvicorn's own shutdown closes the listener, waits a fixed time for connections and then cancels
them (streams end mid-chunk), and re-raises the signal it caught, so the process exits 143.
``GracefulServer`` instead, on SIGTERM or SIGINT: keeps the listener open and lets the app
answer new requests 503 while the requests in flight finish, for up to ``grace`` seconds
(the app's ``drain``); ends whatever is left with a final event; then closes the listener and
the idle connections (uvicorn's own shutdown) and returns normally: exit status 0.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

import uvicorn

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5  # after the drain: for connections to finish writing their last bytes


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
