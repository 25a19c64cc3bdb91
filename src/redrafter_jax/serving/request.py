"""What a generation request is, how it is checked, and the events it produces.

A request carries token ids (the HTTP layer tokenizes) and its own sampling settings; every
limit it must respect comes from the engine's configuration. Events flow back one way:
``Delta`` pieces of text, then exactly one ``Finished`` (or ``Failed``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

MAX_STOP_STRINGS = 4


class RequestError(ValueError):
  """A request the engine cannot serve as asked; ``param`` names the offending field."""

  def __init__(self, message: str, param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.param, self.code = param, code


class QueueFull(RuntimeError):
  """Every slot is busy and the waiting queue is at its limit."""


class EngineStopped(RuntimeError):
  """The engine is not running (stopped, or its loop died)."""


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
  prompt_ids: Sequence[int]
  max_tokens: int | None = None  # None: the server's default, cut to what fits
  temperature: float = 0.0  # 0 = greedy
  top_p: float = 1.0
  top_k: int = 0  # 0 = off
  seed: int | None = None  # None: a fresh random seed
  stop: Sequence[str] = ()  # stop strings (matched on the text, not included in it)


@dataclasses.dataclass(frozen=True)
class Delta:
  text: str
  token_ids: list[int]


@dataclasses.dataclass(frozen=True)
class Finished:
  """The last event of a request: its final text piece, why it ended, and its counts."""

  text: str
  token_ids: list[int]  # every generated token, a final stop token included
  finish_reason: str  # "stop" | "length" | "cancelled"
  usage: dict


@dataclasses.dataclass(frozen=True)
class Failed:
  message: str


Event = Delta | Finished | Failed


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def validate(request: GenerationRequest, *, vocab_size: int, max_context: int, reserved: int,
             max_tokens: int, default_max_tokens: int) -> int:
  """Check ``request`` against the server's limits; returns its effective max_tokens.

  ``max_context`` cache slots hold the prompt, the generated tokens and ``reserved`` scratch
  slots. Raises ``RequestError`` naming the field at fault.
  """
  n = len(request.prompt_ids)
  if n == 0:
    raise RequestError("the prompt is empty: it needs at least one token", "prompt")
  if any(not _is_int(t) or not 0 <= t < vocab_size for t in request.prompt_ids):
    raise RequestError(f"prompt token ids must be integers in [0, {vocab_size})", "prompt")
  room = max_context - reserved - n
  asked = request.max_tokens
  if asked is None:
    if room < 1:
      raise RequestError(f"the prompt has {n} tokens; this server's context is {max_context} "
                         f"tokens ({reserved} of them reserved), so nothing can be generated",
                         "prompt", "context_length_exceeded")
    asked = min(default_max_tokens, max_tokens, room)
  else:
    if not _is_int(asked) or asked < 1:
      raise RequestError(f"max_tokens must be an integer >= 1, got {asked!r}", "max_tokens")
    if asked > max_tokens:
      raise RequestError(f"max_tokens {asked} exceeds this server's limit of {max_tokens}",
                         "max_tokens")
    if asked > room:
      raise RequestError(
          f"the prompt ({n} tokens) plus max_tokens ({asked}) exceeds this server's context "
          f"of {max_context} tokens ({reserved} of them reserved)",
          "max_tokens" if room >= 1 else "prompt", "context_length_exceeded")
  t, p, k = request.temperature, request.top_p, request.top_k
  if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
    raise RequestError(f"temperature must be a number >= 0, got {t!r}", "temperature")
  if not (isinstance(p, (int, float)) and 0 < p <= 1):
    raise RequestError(f"top_p must be in (0, 1], got {p!r}", "top_p")
  if not _is_int(k) or k < 0:
    raise RequestError(f"top_k must be an integer >= 0, got {k!r}", "top_k")
  if request.seed is not None and not _is_int(request.seed):
    raise RequestError(f"seed must be an integer, got {request.seed!r}", "seed")
  stop = list(request.stop)
  if len(stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s for s in stop):
    raise RequestError(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings", "stop")
  return asked
