"""Who may use the server: an API key, browser origins (CORS) and accepted Host names.

* ``api_key``: every ``/v1`` route needs ``Authorization: Bearer KEY`` (what OpenAI and vLLM
  clients send), else 401 ``invalid_api_key``. ``/health`` and ``/metrics`` stay open, as in
  vLLM, for load balancers and scrapers (they reveal load, not content).
* ``cors_origins``: browser pages from these origins may call the API (preflight answered
  before the key check, as browsers send no credentials on it). None: no CORS headers.
* ``allowed_hosts``: requests whose ``Host`` header names another host get 400 (a guard
  against DNS rebinding when serving on a private address). None: any Host is accepted.
"""

from __future__ import annotations

import hmac
import json
from typing import Callable, Sequence

from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware

from redrafter_jax.serving.protocol import APIError

PROTECTED_PREFIX = "/v1"


class BearerAuth:
  """ASGI middleware: ``/v1`` requests must carry the API key as a Bearer token."""

  def __init__(self, app, key: str, on_reject: Callable[[], None] = lambda: None):
    self.app, self._key, self._on_reject = app, key.encode(), on_reject

  def _authorized(self, headers) -> bool:
    value = next((v for k, v in headers if k == b"authorization"), b"")
    scheme, _, token = value.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)

  async def __call__(self, scope, receive, send):
    if (scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIX)
        and not self._authorized(scope["headers"])):
      self._on_reject()
      err = APIError(401, "missing or incorrect API key: send 'Authorization: Bearer KEY'",
                     code="invalid_api_key")
      body = json.dumps(err.body()).encode()
      await send({"type": "http.response.start", "status": 401, "headers": [
          (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
          (b"www-authenticate", b"Bearer")]})
      await send({"type": "http.response.body", "body": body})
      return
    await self.app(scope, receive, send)


def protect(app, *, api_key: str | None = None, cors_origins: Sequence[str] = (),
            allowed_hosts: Sequence[str] = (), on_reject: Callable[[], None] = lambda: None):
  """Add the access controls asked for to ``app`` (outermost first: Host, CORS, key)."""
  if api_key:
    app.add_middleware(BearerAuth, key=api_key, on_reject=on_reject)
  if cors_origins:
    app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins),
                       allow_methods=["GET", "POST"],
                       allow_headers=["Authorization", "Content-Type"], max_age=600)
  if allowed_hosts:
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))
  return app
