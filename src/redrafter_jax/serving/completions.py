"""The completions service behind the HTTP routes: from a request's bytes to its response.

``Completions`` reads a body under a size limit (413 as soon as it is known to be too big: from
``Content-Length`` before reading anything, or while a chunked body streams in, so the server
never holds more than the limit for one request), parses and tokenizes it in worker threads
(``ParsePool``: that CPU work grows with the body and must not block the event loop, which
serves ``/health`` and other streams), checks every prompt, submits one engine request per
prompt and answers with the whole completion or a stream of server-sent events. Each engine
request's events come back through ``loop.call_soon_threadsafe`` into an asyncio queue
(``_Run``). A client that goes away cancels its requests (their slots free at the next step):
streams notice through Starlette's disconnect handling, plain requests by polling. ``drain``
is the graceful shutdown's half on this side: refuse new requests, give those in flight a
grace period, end the rest.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import logging
import threading
import time
import weakref
from typing import AsyncIterator, Callable, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from redrafter_jax.config import ServeConfig
from redrafter_jax.serving import protocol
from redrafter_jax.serving.engine import Engine
from redrafter_jax.serving.protocol import APIError
from redrafter_jax.serving.request import (EngineStopped, Failed, Finished, GenerationRequest,
                                           QueueFull, RequestError)
from redrafter_jax.weights import tokenizer as tokenizer_lib

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = ServeConfig.max_body_bytes  # one default, the server settings'
DISCONNECT_POLL_S = 0.5
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class SamplingDefaults:
  """Used for fields a request leaves out (normally the preset's ``decode`` section)."""

  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0


def _too_large(limit: int) -> APIError:
  return APIError(413, f"the request body is larger than this server's limit of {limit} bytes",
                  code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
  """The whole body, or ``APIError`` 413 once it exceeds ``limit`` bytes."""
  declared = request.headers.get("content-length")
  if declared is not None:
    if not declared.strip().isdigit():
      raise APIError(400, "the Content-Length header is not a number", code="invalid_request")
    if int(declared) > limit:
      raise _too_large(limit)
  chunks, size = [], 0
  async for chunk in request.stream():
    size += len(chunk)
    if size > limit:
      raise _too_large(limit)
    chunks.append(chunk)
  return b"".join(chunks)


class ParsePool:
  """Worker threads for request parsing and tokenization (off the event loop). Tokenizer calls
  hold a lock: a ``transformers`` fast tokenizer is not documented as safe to call from several
  threads at once."""

  def __init__(self, workers: int = 4):
    self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="redrafter-parse")
    self.tokenizer_lock = threading.Lock()

  async def run(self, fn: Callable[..., T], *args) -> T:
    return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

  def tokenize(self, fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` holding the tokenizer lock (call from a worker thread)."""
    with self.tokenizer_lock:
      return fn(*args, **kwargs)

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)


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


class Completions:
  """``/v1/completions`` and ``/v1/chat/completions`` on ``engine`` for the model
  ``model_name``, and the graceful shutdown's ``drain``."""

  def __init__(self, engine: Engine, tokenizer, *, model_name: str,
               defaults: SamplingDefaults = SamplingDefaults(),
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
    self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
    self.defaults, self.max_body_bytes = defaults, max_body_bytes
    self.created = int(time.time())
    self.parse_pool = ParsePool()
    # In flight (weak: a stream never started is forgotten with its response).
    self.runs: weakref.WeakSet[_Run] = weakref.WeakSet()
    self.draining = False

  # ---- the routes' work

  async def complete(self, request: Request, *, chat: bool):
    """One completion request, from its bytes to its response (or stream)."""
    self.check_admitting()
    raw = await read_body(request, self.max_body_bytes)
    prepare = self.prepare_chat if chat else self.prepare_completion
    prepared = await self.parse_pool.run(prepare, raw)
    return await self.respond(request, prepared.body, self.start(prepared), chat=chat)

  def model_card(self) -> dict:
    return {"id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "redrafter_jax"}

  def unknown_model(self, name: str, status: int = 404) -> APIError:
    return APIError(status, f"the model '{name}' does not exist; this server serves "
                    f"'{self.model_name}'", param="model", code="model_not_found")

  async def drain(self, grace: float) -> None:
    """Stop admitting (503), let runs in flight finish for up to ``grace`` seconds, then end
    the rest with a final error event (streams) or a 503 (plain requests)."""
    self.draining = True
    deadline = time.monotonic() + grace
    while self.runs and time.monotonic() < deadline:
      await asyncio.sleep(0.05)
    if self.runs:
      log.warning("shutdown grace of %.1f s is over: ending %d request(s) in flight", grace,
                  len(self.runs))
      for run in list(self.runs):
        run.abort("the server is shutting down")
    deadline = time.monotonic() + 5.0  # their handlers write the last event and return
    while self.runs and time.monotonic() < deadline:
      await asyncio.sleep(0.05)

  # ---- parsing (in a ParsePool thread)

  def prepare_completion(self, raw: bytes) -> _Prepared:
    body = protocol.parse(protocol.CompletionRequest, raw)
    self.check_model(body)
    prompts = []
    for p in body.prompts():
      if isinstance(p, str):
        if not p:
          raise APIError(400, "the prompt is empty", param="prompt", code="empty_prompt")
        p = self.encode("prompt", tokenizer_lib.encode, self.tokenizer, p, chat=False)
      prompts.append(p)
    if not prompts:
      raise APIError(400, "no prompt given", param="prompt", code="empty_prompt")
    return _Prepared(body, self.requests_for(body, prompts, body.max_tokens))

  def prepare_chat(self, raw: bytes) -> _Prepared:
    body = protocol.parse(protocol.ChatCompletionRequest, raw)
    self.check_model(body)
    if not body.messages:
      raise APIError(400, "messages is empty", param="messages", code="empty_prompt")
    messages = [m.as_template_message() for m in body.messages]
    ids = self.encode("messages", tokenizer_lib.encode_messages, self.tokenizer, messages)
    name = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    max_tokens = body.max_tokens if body.max_completion_tokens is None \
        else body.max_completion_tokens
    return _Prepared(body, self.requests_for(body, [ids], max_tokens), name)

  def check_model(self, body: protocol.RequestBase) -> None:
    if body.model != self.model_name:
      raise self.unknown_model(body.model)

  def encode(self, param: str, fn, *args, **kwargs) -> list[int]:
    """Token ids, or a 400: text the tokenizer or chat template cannot take is the client's."""
    try:
      return self.parse_pool.tokenize(fn, *args, **kwargs)
    except Exception as e:
      what = "the chat template cannot format these messages" if param == "messages" else \
          "the prompt cannot be tokenized"
      raise APIError(400, f"{what}: {type(e).__name__}: {e}", param=param,
                     code="invalid_value") from None

  def requests_for(self, body: protocol.RequestBase, prompts: list[list[int]], max_tokens
                   ) -> list[GenerationRequest]:
    pick = lambda v, d: d if v is None else v
    temperature = pick(body.temperature, self.defaults.temperature)
    top_p, top_k = pick(body.top_p, self.defaults.top_p), pick(body.top_k, self.defaults.top_k)
    top_k = max(top_k, 0)  # -1 is vLLM's "off"
    return [GenerationRequest(prompt_ids=p, max_tokens=max_tokens, temperature=temperature,
                              top_p=top_p, top_k=top_k, seed=body.seed,
                              stop=tuple(body.stop_list())) for p in prompts]

  # ---- running on the engine (on the event loop)

  def check_admitting(self) -> None:
    if self.draining:
      raise APIError(503, "the server is shutting down; retry on another instance",
                     type="server_error", code="shutting_down")

  def start(self, prepared: _Prepared) -> _Run:
    self.check_admitting()
    engine = self.engine
    requests, capacity = prepared.requests, engine.config.slots + engine.config.max_queue
    if len(requests) > capacity:
      raise APIError(400, f"{len(requests)} prompts in one request; this server holds at most "
                     f"{capacity} requests at once (slots + queue): send fewer prompts per "
                     "request", param="prompt", code="too_many_prompts")
    try:
      for r in requests:  # every prompt is checked before any is queued
        engine.check(r)
      run = _Run(engine, requests)
      self.runs.add(run)
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

  async def respond(self, request: Request, body: protocol.RequestBase, run: _Run, chat: bool):
    rid = protocol.new_id("chatcmpl" if chat else "cmpl")
    created = protocol.now()
    if body.stream:
      include_usage = bool(body.stream_options and body.stream_options.include_usage)
      return StreamingResponse(
          self.stream(run, rid, created, chat, include_usage), media_type="text/event-stream",
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
      self.runs.discard(run)
    choices = [("".join(t), r) for t, r in zip(texts, reasons)]
    build = protocol.chat_completion if chat else protocol.completion
    return build(rid, created, self.model_name, choices, protocol.merge_usage(usages))

  async def stream(self, run: _Run, rid: str, created: int, chat: bool, include_usage: bool):
    model, usages = self.model_name, []
    try:
      if chat:
        for i in range(len(run.handles)):
          yield _sse(protocol.chat_chunk(rid, created, model, i,
                                         {"role": "assistant", "content": ""}, None))
      async for i, event in run.events(None):
        if isinstance(event, Failed):
          yield _sse(_failure(event).body())
          break
        reason = event.finish_reason if isinstance(event, Finished) else None
        if chat:
          if event.text:
            yield _sse(protocol.chat_chunk(rid, created, model, i, {"content": event.text},
                                           None))
          if reason is not None:
            yield _sse(protocol.chat_chunk(rid, created, model, i, {}, reason))
        elif event.text or reason is not None:
          yield _sse(protocol.completion_chunk(rid, created, model, i, event.text, reason))
        if isinstance(event, Finished):
          usages.append(event.usage)
      else:
        if include_usage:
          obj = "chat.completion.chunk" if chat else "text_completion"
          yield _sse(protocol.usage_chunk(rid, created, model, obj,
                                          protocol.merge_usage(usages)))
      yield "data: [DONE]\n\n"
    finally:  # also on disconnect (the generator is cancelled): free the slots
      run.cancel()
      self.runs.discard(run)
