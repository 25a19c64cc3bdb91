"""The OpenAI-compatible HTTP app (FastAPI) in front of an ``Engine``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream with server-sent
events when ``stream`` is true: ``data: {chunk}\\n\\n`` ... ``data: [DONE]\\n\\n``),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).

Handlers run on the event loop; reading a body is bounded (413 beyond ``max_body_bytes``), and
parsing, chat templating and tokenization run in worker threads (``body.ParsePool``), so a big
body never blocks ``/health`` or a stream. The engine runs in its own thread. Each prompt becomes one
engine request whose events come back through ``loop.call_soon_threadsafe`` into an asyncio
queue. A client that goes away cancels its requests (their slots free at the next step):
streaming responses notice through Starlette's disconnect handling, plain ones by polling.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
import weakref
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from redrafter_jax.serving import protocol
from redrafter_jax.serving.body import DEFAULT_MAX_BODY_BYTES, ParsePool, read_body
from redrafter_jax.serving.engine import Engine
from redrafter_jax.serving.protocol import APIError
from redrafter_jax.serving.request import (EngineStopped, Failed, Finished, GenerationRequest,
                                           QueueFull, RequestError)
from redrafter_jax.weights import tokenizer as tokenizer_lib

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5
REJECT_REASONS = {400: "bad_request", 401: "unauthorized", 404: "not_found",
                  405: "bad_request", 413: "too_large", 503: "unavailable"}


@dataclasses.dataclass(frozen=True)
class SamplingDefaults:
  """Used for fields a request leaves out (normally the preset's ``decode`` section)."""

  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0


class _ClientGone(Exception):
  pass


class _Run:
  """The engine requests behind one HTTP request (one per prompt) and their events."""

  def __init__(self, engine: Engine, requests: list[GenerationRequest]):
    loop = asyncio.get_running_loop()
    self.queue: asyncio.Queue = asyncio.Queue()
    self.handles = []
    try:
      for i, r in enumerate(requests):
        self.handles.append(engine.submit(r, functools.partial(self._put, loop, i)))
    except BaseException:
      self.cancel()
      raise

  def _put(self, loop, index, event) -> None:
    loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))

  def cancel(self) -> None:
    for h in self.handles:
      h.cancel()

  def abort(self, message: str) -> None:
    """End the run now (from the event loop): its reader sees ``Failed`` (shutting_down) next,
    and the engine frees its slots at its next step."""
    self.cancel()
    self.queue.put_nowait((0, Failed(message, "shutting_down")))

  async def events(self, request: Request | None) -> AsyncIterator[tuple[int, object]]:
    """Events until every request has ended; ``request`` given: poll for a disconnect."""
    remaining = len(self.handles)
    while remaining:
      try:
        index, event = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
      except asyncio.TimeoutError:
        if request is not None and await request.is_disconnected():
          raise _ClientGone() from None
        continue
      if isinstance(event, (Finished, Failed)):
        remaining -= 1
      yield index, event


@dataclasses.dataclass(frozen=True)
class _Prepared:
  """A parsed, tokenized request: its body and one engine request per prompt."""

  body: protocol.RequestBase
  requests: list[GenerationRequest]
  max_tokens_name: str = "max_tokens"  # the field the client used (chat has two names)


def _failure(event: Failed) -> APIError:
  """The error a failed engine request becomes: 503 if the server is stopping, else 500."""
  status = 503 if event.code == "shutting_down" else 500
  return APIError(status, event.message, type="server_error", code=event.code, refusal=False)


def _sse(obj) -> str:
  return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def create_app(engine: Engine, tokenizer, *, model_name: str,
               defaults: SamplingDefaults = SamplingDefaults(),
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
  app = FastAPI(title="redrafter_jax", description="ReDrafter speculative decoding, "
                "OpenAI-compatible", docs_url=None, redoc_url=None)
  started = int(time.time())
  parse_pool = app.state.parse_pool = ParsePool()
  runs: weakref.WeakSet[_Run] = weakref.WeakSet()  # in flight (weak: a stream never started
                                                   # is forgotten with its response)
  state = {"draining": False}

  async def drain(grace: float) -> None:
    """Stop admitting (503), let runs in flight finish for up to ``grace`` seconds, then end
    the rest with a final error event (streams) or a 503 (plain requests)."""
    state["draining"] = True
    deadline = time.monotonic() + grace
    while runs and time.monotonic() < deadline:
      await asyncio.sleep(0.05)
    if runs:
      log.warning("shutdown grace of %.1f s is over: ending %d request(s) in flight", grace,
                  len(runs))
      for run in list(runs):
        run.abort("the server is shutting down")
    deadline = time.monotonic() + 5.0  # their handlers write the last event and return
    while runs and time.monotonic() < deadline:
      await asyncio.sleep(0.05)

  app.state.drain = drain

  def reject(status: int) -> None:
    """Count a refused request (429s are counted by the engine, which raises them)."""
    if status in REJECT_REASONS:
      engine.metrics.rejected.labels(reason=REJECT_REASONS[status]).inc()

  @app.exception_handler(APIError)
  async def _api_error(_, e: APIError):
    if e.refusal:
      reject(e.status)
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)

  @app.exception_handler(StarletteHTTPException)
  async def _http_error(_, e: StarletteHTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "invalid_request")
    reject(e.status_code)
    err = APIError(e.status_code, str(e.detail), code=code)
    return JSONResponse(err.body(), status_code=e.status_code, headers=e.headers)

  @app.exception_handler(Exception)
  async def _internal(_, e: Exception):
    log.exception("unhandled error")
    err = APIError(500, f"internal error: {type(e).__name__}", type="server_error",
                   code="internal_error")
    return JSONResponse(err.body(), status_code=500)

  @app.get("/health")
  async def health():
    status = "draining" if state["draining"] else "ok" if engine.alive else "down"
    body = {"status": status, "mode": engine.mode,
            "slots": engine.config.slots, "active_slots": engine.active_slots(),
            "queue_length": engine.queue_length()}
    return JSONResponse(body, status_code=200 if status == "ok" else 503)

  @app.get("/metrics")
  async def metrics():
    return Response(engine.metrics.render(), media_type=engine.metrics.content_type)

  def model_card() -> dict:
    return {"id": model_name, "object": "model", "created": started, "owned_by": "redrafter_jax"}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [model_card()]}

  @app.get("/v1/models/{name:path}")
  async def model(name: str):
    if name != model_name:
      raise _unknown_model(name, 404)  # GET of a resource that does not exist
    return model_card()

  def _unknown_model(name: str, status: int = 404) -> APIError:
    return APIError(status, f"the model '{name}' does not exist; this server serves "
                    f"'{model_name}'", param="model", code="model_not_found")

  def check_model(body: protocol.RequestBase) -> None:
    if body.model != model_name:
      raise _unknown_model(body.model)

  def requests_for(body: protocol.RequestBase, prompts: list[list[int]], max_tokens
                   ) -> list[GenerationRequest]:
    pick = lambda v, d: d if v is None else v
    temperature = pick(body.temperature, defaults.temperature)
    top_p, top_k = pick(body.top_p, defaults.top_p), pick(body.top_k, defaults.top_k)
    top_k = max(top_k, 0)  # -1 is vLLM's "off"
    return [GenerationRequest(prompt_ids=p, max_tokens=max_tokens, temperature=temperature,
                              top_p=top_p, top_k=top_k, seed=body.seed,
                              stop=tuple(body.stop_list())) for p in prompts]

  def check_admitting() -> None:
    if state["draining"]:
      raise APIError(503, "the server is shutting down; retry on another instance",
                     type="server_error", code="shutting_down")

  def start(prepared: _Prepared) -> _Run:
    check_admitting()
    requests, capacity = prepared.requests, engine.config.slots + engine.config.max_queue
    if len(requests) > capacity:
      raise APIError(400, f"{len(requests)} prompts in one request; this server holds at most "
                     f"{capacity} requests at once (slots + queue): send fewer prompts per "
                     "request", param="prompt", code="too_many_prompts")
    try:
      for r in requests:  # every prompt is checked before any is queued
        engine.check(r)
      run = _Run(engine, requests)
      runs.add(run)
      return run
    except RequestError as e:
      param, message = e.param, str(e)
      if param == "max_tokens" and prepared.max_tokens_name != param:
        param, message = prepared.max_tokens_name, message.replace(param, prepared.max_tokens_name)
      raise APIError(400, message, param=param, code=e.code) from None
    except QueueFull as e:
      raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
    except EngineStopped as e:
      raise APIError(503, str(e), type="server_error", code="engine_down") from None

  async def respond(request: Request, body: protocol.RequestBase, run: _Run, chat: bool):
    rid = protocol.new_id("chatcmpl" if chat else "cmpl")
    created = protocol.now()
    if body.stream:
      include_usage = bool(body.stream_options and body.stream_options.include_usage)
      return StreamingResponse(
          _stream(run, rid, created, chat, include_usage), media_type="text/event-stream",
          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    n = len(run.handles)
    texts, reasons, usages = [[] for _ in range(n)], [None] * n, [None] * n
    try:
      async for i, event in run.events(request):
        if isinstance(event, Failed):
          raise _failure(event)
        texts[i].append(event.text)
        if isinstance(event, Finished):
          reasons[i], usages[i] = event.finish_reason, event.usage
    except _ClientGone:
      log.info("%s: client disconnected; cancelled", rid)
      return Response(status_code=499)
    finally:
      run.cancel()  # no-op for requests that finished
      runs.discard(run)
    choices = [("".join(t), r) for t, r in zip(texts, reasons)]
    build = protocol.chat_completion if chat else protocol.completion
    return build(rid, created, model_name, choices, protocol.merge_usage(usages))

  async def _stream(run: _Run, rid: str, created: int, chat: bool, include_usage: bool):
    usages = []
    try:
      if chat:
        for i in range(len(run.handles)):
          yield _sse(protocol.chat_chunk(rid, created, model_name, i,
                                         {"role": "assistant", "content": ""}, None))
      async for i, event in run.events(None):
        if isinstance(event, Failed):
          yield _sse(_failure(event).body())
          break
        reason = event.finish_reason if isinstance(event, Finished) else None
        if chat:
          if event.text:
            yield _sse(protocol.chat_chunk(rid, created, model_name, i,
                                           {"content": event.text}, None))
          if reason is not None:
            yield _sse(protocol.chat_chunk(rid, created, model_name, i, {}, reason))
        elif event.text or reason is not None:
          yield _sse(protocol.completion_chunk(rid, created, model_name, i, event.text, reason))
        if isinstance(event, Finished):
          usages.append(event.usage)
      else:
        if include_usage:
          obj = "chat.completion.chunk" if chat else "text_completion"
          yield _sse(protocol.usage_chunk(rid, created, model_name, obj,
                                          protocol.merge_usage(usages)))
      yield "data: [DONE]\n\n"
    finally:  # also on disconnect (the generator is cancelled): free the slots
      run.cancel()
      runs.discard(run)

  def encode(param: str, fn, *args, **kwargs) -> list[int]:
    """Token ids, or a 400: text the tokenizer or chat template cannot take is the client's."""
    try:
      return parse_pool.tokenize(fn, *args, **kwargs)
    except Exception as e:
      what = "the chat template cannot format these messages" if param == "messages" else \
          "the prompt cannot be tokenized"
      raise APIError(400, f"{what}: {type(e).__name__}: {e}", param=param,
                     code="invalid_value") from None

  def prepare_completion(raw: bytes) -> _Prepared:
    body = protocol.parse(protocol.CompletionRequest, raw)
    check_model(body)
    prompts = []
    for p in body.prompts():
      if isinstance(p, str):
        if not p:
          raise APIError(400, "the prompt is empty", param="prompt", code="empty_prompt")
        p = encode("prompt", tokenizer_lib.encode, tokenizer, p, chat=False)
      prompts.append(p)
    if not prompts:
      raise APIError(400, "no prompt given", param="prompt", code="empty_prompt")
    return _Prepared(body, requests_for(body, prompts, body.max_tokens))

  def prepare_chat(raw: bytes) -> _Prepared:
    body = protocol.parse(protocol.ChatCompletionRequest, raw)
    check_model(body)
    if not body.messages:
      raise APIError(400, "messages is empty", param="messages", code="empty_prompt")
    messages = [m.as_template_message() for m in body.messages]
    ids = encode("messages", tokenizer_lib.encode_messages, tokenizer, messages)
    name = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    max_tokens = body.max_tokens if body.max_completion_tokens is None \
        else body.max_completion_tokens
    return _Prepared(body, requests_for(body, [ids], max_tokens), name)

  @app.post("/v1/completions")
  async def completions(request: Request):
    check_admitting()
    raw = await read_body(request, max_body_bytes)
    prepared = await parse_pool.run(prepare_completion, raw)
    return await respond(request, prepared.body, start(prepared), chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    check_admitting()
    raw = await read_body(request, max_body_bytes)
    prepared = await parse_pool.run(prepare_chat, raw)
    return await respond(request, prepared.body, start(prepared), chat=True)

  return app
