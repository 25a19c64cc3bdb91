"""Reading a request body under a size limit, and the worker threads that parse bodies.

A body over the limit is refused with 413 as soon as that is known: from ``Content-Length``
before reading anything, or while streaming a chunked body, so the server never holds more
than the limit for one request. Parsing, chat templating and tokenization are CPU work that
grows with the body; they run in ``ParsePool``'s threads so a large body never blocks the event
loop (``/health``, other streams). Tokenizer calls are serialized by a lock: a ``transformers``
fast tokenizer is not documented as safe to call from several threads at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Callable, TypeVar

from starlette.requests import Request

from redrafter_jax.serving.protocol import APIError

DEFAULT_MAX_BODY_BYTES = 1 << 20
T = TypeVar("T")


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
  """Worker threads for request parsing and tokenization (off the event loop)."""

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
