"""What a generation request is, how it is checked, and the events it produces.

A request carries token ids (the HTTP layer tokenizes) and its own sampling settings; every
limit it must respect comes from the engine's configuration. Events flow back one way:
``Delta`` pieces of text, then exactly one ``Finished`` (or ``Failed``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 256  # characters per stop string (each is searched for at every step)
MAX_TEMPERATURE = 2.0  # OpenAI's range
MIN_TEMPERATURE = 1e-5  # a positive temperature below this would overflow float32 logits / T
INT32_MAX = (1 << 31) - 1  # top_k and max_tokens travel to the device as int32
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # int64 or uint64: what OpenAI clients send


class RequestError(ValueError):
  """A request the engine cannot serve as asked; ``param`` names the offending field."""

  def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
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
  """The request ended without a result. ``code``: ``internal_error`` (a fault while serving
  it) or ``shutting_down`` (the server stopped before it finished)."""

  message: str
  code: str = "internal_error"


Event = Delta | Finished | Failed


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def validate(request: GenerationRequest, *, vocab_size: int, max_context: int, reserved: int,
             max_tokens: int, default_max_tokens: int) -> int:
  """Check ``request`` against the server's limits; returns its effective max_tokens.

  ``max_context`` cache slots hold the prompt, the generated tokens and ``reserved`` scratch
  slots. Every number is checked against the range the device arrays hold (int32 top_k and
  limits, float32 temperature and top_p), so nothing that passes here can fail converting on
  the engine thread. Raises ``RequestError`` naming the field at fault and an OpenAI-style code.
  """
  n = len(request.prompt_ids)
  if n == 0:
    raise RequestError("the prompt is empty: it needs at least one token", "prompt",
                       "empty_prompt")
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
    if not _is_int(asked):
      raise RequestError(f"max_tokens must be an integer, got {asked!r}", "max_tokens",
                         "invalid_type")
    if asked < 1:
      raise RequestError(f"max_tokens must be >= 1, got {asked}", "max_tokens",
                         "integer_below_min_value")
    if asked > max_tokens:
      raise RequestError(f"max_tokens {asked} exceeds this server's limit of {max_tokens}",
                         "max_tokens", "integer_above_max_value")
    if asked > room:
      raise RequestError(
          f"the prompt ({n} tokens) plus max_tokens ({asked}) exceeds this server's context "
          f"of {max_context} tokens ({reserved} of them reserved)",
          "max_tokens" if room >= 1 else "prompt", "context_length_exceeded")
  _check_sampling(request)
  return asked


def _check_sampling(request: GenerationRequest) -> None:
  t, p, k, seed = request.temperature, request.top_p, request.top_k, request.seed
  if not (_is_number(t) and math.isfinite(t)):
    raise RequestError(f"temperature must be a number, got {t!r}", "temperature",
                       "invalid_type")
  if t < 0 or 0 < t < MIN_TEMPERATURE:
    raise RequestError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, "
                       f"{MAX_TEMPERATURE}], got {t!r}", "temperature", "decimal_below_min_value")
  if t > MAX_TEMPERATURE:
    raise RequestError(f"temperature must be <= {MAX_TEMPERATURE}, got {t!r}", "temperature",
                       "decimal_above_max_value")
  if not (_is_number(p) and math.isfinite(p)):
    raise RequestError(f"top_p must be a number, got {p!r}", "top_p", "invalid_type")
  if not 0 < p <= 1 or float(np.float32(p)) == 0.0:  # float32 0 would keep no token
    raise RequestError(f"top_p must be in (0, 1], got {p!r}", "top_p",
                       "decimal_above_max_value" if p > 1 else "decimal_below_min_value")
  if not _is_int(k):
    raise RequestError(f"top_k must be an integer, got {k!r}", "top_k", "invalid_type")
  if not 0 <= k <= INT32_MAX:
    raise RequestError(f"top_k must be in [0, {INT32_MAX}] (0 = off), got {k}", "top_k",
                       "integer_below_min_value" if k < 0 else "integer_above_max_value")
  if seed is not None and not _is_int(seed):
    raise RequestError(f"seed must be an integer, got {seed!r}", "seed", "invalid_type")
  if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
    raise RequestError(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {seed}", "seed",
                       "integer_below_min_value" if seed < 0 else "integer_above_max_value")
  stop = list(request.stop)
  if len(stop) > MAX_STOP_STRINGS:
    raise RequestError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}",
                       "stop", "array_above_max_length")
  if any(not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_LENGTH for s in stop):
    raise RequestError(f"each stop string must be non-empty text of at most {MAX_STOP_LENGTH} "
                       "characters", "stop")
