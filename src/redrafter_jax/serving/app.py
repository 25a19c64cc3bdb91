"""The OpenAI-compatible HTTP app (FastAPI) in front of an ``Engine``: its routes, error
handlers and access controls.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream with server-sent
events when ``stream`` is true: ``data: {chunk}\\n\\n`` ... ``data: [DONE]\\n\\n``),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). Each route is one small
function that reads the app's ``Completions`` service (``completions.py``: bodies, parsing,
the engine, streams) from ``app.state``.

Access (``protect``):

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
import logging
from typing import Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware

from redrafter_jax.serving.completions import (DEFAULT_MAX_BODY_BYTES, Completions,
                                               SamplingDefaults)
from redrafter_jax.serving.engine import Engine
from redrafter_jax.serving.protocol import APIError

log = logging.getLogger(__name__)

PROTECTED_PREFIX = "/v1"
REJECT_REASONS = {400: "bad_request", 401: "unauthorized", 404: "not_found",
                  405: "bad_request", 413: "too_large", 503: "unavailable"}


def create_app(engine: Engine, tokenizer, *, model_name: str,
               defaults: SamplingDefaults = SamplingDefaults(),
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
  """The app serving ``engine`` as the model ``model_name``; ``app.state.drain`` is the
  graceful shutdown's (``lifecycle.GracefulServer`` calls it)."""
  app = FastAPI(title="redrafter_jax", description="ReDrafter speculative decoding, "
                "OpenAI-compatible", docs_url=None, redoc_url=None)
  service = app.state.service = Completions(engine, tokenizer, model_name=model_name,
                                            defaults=defaults, max_body_bytes=max_body_bytes)
  app.state.drain = service.drain
  app.add_exception_handler(APIError, api_error)
  app.add_exception_handler(StarletteHTTPException, http_error)
  app.add_exception_handler(Exception, internal_error)
  app.add_api_route("/health", health, methods=["GET"])
  app.add_api_route("/metrics", metrics, methods=["GET"])
  app.add_api_route("/v1/models", models, methods=["GET"])
  app.add_api_route("/v1/models/{name:path}", model, methods=["GET"])
  app.add_api_route("/v1/completions", completions, methods=["POST"])
  app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
  return app


def _service(request: Request) -> Completions:
  return request.app.state.service


def _reject(request: Request, status: int) -> None:
  """Count a refused request (429s are counted by the engine, which raises them)."""
  if status in REJECT_REASONS:
    _service(request).engine.metrics.rejected.labels(reason=REJECT_REASONS[status]).inc()


# ---- routes


async def health(request: Request):
  service = _service(request)
  engine = service.engine
  status = "draining" if service.draining else "ok" if engine.alive else "down"
  body = {"status": status, "mode": engine.mode,
          "slots": engine.config.slots, "active_slots": engine.active_slots(),
          "queue_length": engine.queue_length()}
  compiling = engine.compile_progress()
  if compiling["total"]:  # a covering warm-up: the rest of the programs compile meanwhile
    body["compiling"] = compiling
  return JSONResponse(body, status_code=200 if status == "ok" else 503)


async def metrics(request: Request):
  m = _service(request).engine.metrics
  return Response(m.render(), media_type=m.content_type)


async def models(request: Request):
  return {"object": "list", "data": [_service(request).model_card()]}


async def model(request: Request, name: str):
  service = _service(request)
  if name != service.model_name:
    raise service.unknown_model(name, 404)  # GET of a resource that does not exist
  return service.model_card()


async def completions(request: Request):
  return await _service(request).complete(request, chat=False)


async def chat_completions(request: Request):
  return await _service(request).complete(request, chat=True)


# ---- errors: every one in OpenAI's shape


async def api_error(request: Request, e: APIError):
  if e.refusal:
    _reject(request, e.status)
  headers = {"Retry-After": "1"} if e.status in (429, 503) else None
  return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def http_error(request: Request, e: StarletteHTTPException):
  code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "invalid_request")
  _reject(request, e.status_code)
  err = APIError(e.status_code, str(e.detail), code=code)
  return JSONResponse(err.body(), status_code=e.status_code, headers=e.headers)


async def internal_error(request: Request, e: Exception):
  log.exception("unhandled error")
  err = APIError(500, f"internal error: {type(e).__name__}", type="server_error",
                 code="internal_error")
  return JSONResponse(err.body(), status_code=500)


# ---- access


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
