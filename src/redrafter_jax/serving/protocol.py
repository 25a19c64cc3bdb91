"""The OpenAI wire format: request models (strictly typed), errors, and response bodies.

Requests are validated with pydantic in strict mode (a string where a number belongs is an
error, not a conversion; NaN and infinities are refused) and every number is range-checked to
what the engine's arrays hold; any problem becomes an ``APIError`` whose body has OpenAI's shape
``{"error": {"message", "type", "param", "code"}}`` with one of OpenAI's codes
(``invalid_type``, ``integer_above_max_value``, ``missing_required_parameter``, ...). The
engine checks every request again (``request.validate``): this layer gives the better message. Fields of the OpenAI API this server does
not implement are accepted at their neutral values and refused otherwise, so a client never
silently gets something other than what it asked for. Unknown fields are ignored, as OpenAI
clients send a few newer ones.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from redrafter_jax.serving.request import INT32_MAX, MAX_TEMPERATURE, SEED_RANGE

FIELD_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists",
    "stop": "a string or a list of strings",
    "messages": "a list of {role, content} objects",
}


class APIError(Exception):
  """An error response: HTTP status plus OpenAI's error object. ``refusal``: the request was
  turned away before any generation (counted in the ``rejected`` metric)."""

  def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
               param: str | None = None, code: str | None = None, refusal: bool = True):
    super().__init__(message)
    self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
    self.refusal = refusal

  def body(self) -> dict[str, Any]:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


class _Strict(BaseModel):
  model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


Count = Field(None, ge=1, le=INT32_MAX)  # max_tokens and its newer name


class StreamOptions(_Strict):
  include_usage: bool = False


class RequestBase(_Strict):
  """Fields shared by completions and chat completions."""

  model: str
  max_tokens: int | None = Count
  temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)  # None: the preset's
  top_p: float | None = Field(None, gt=0, le=1)
  top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # an extension (vLLM's): 0 or -1 = off
  seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
  stop: str | list[str] | None = None
  stream: bool = False
  stream_options: StreamOptions | None = None
  n: int = 1
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logit_bias: dict[str, float] | None = None
  user: str | None = None

  def unsupported(self) -> list[tuple[str, str]]:
    """(field, reason) for each field set to something this server does not do."""
    out = []
    if self.n != 1:
      out.append(("n", "only n=1 is supported (send several requests instead)"))
    if self.presence_penalty or self.frequency_penalty:
      out.append(("presence_penalty" if self.presence_penalty else "frequency_penalty",
                  "presence/frequency penalties are not supported"))
    if self.logit_bias:
      out.append(("logit_bias", "logit_bias is not supported"))
    return out

  def stop_list(self) -> list[str]:
    return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop


class CompletionRequest(RequestBase):
  prompt: str | list[str] | list[int] | list[list[int]]
  echo: bool = False
  logprobs: int | None = None
  best_of: int | None = None
  suffix: str | None = None

  def unsupported(self) -> list[tuple[str, str]]:
    out = super().unsupported()
    if self.echo:
      out.append(("echo", "echo is not supported"))
    if self.logprobs is not None:
      out.append(("logprobs", "logprobs are not supported"))
    if self.best_of not in (None, 1):
      out.append(("best_of", "only best_of=1 is supported"))
    if self.suffix:
      out.append(("suffix", "suffix is not supported"))
    return out

  def prompts(self) -> list[str | list[int]]:
    """The prompt(s): a string, or a list of token ids, each one choice."""
    p = self.prompt
    if isinstance(p, str):
      return [p]
    if p and all(isinstance(x, int) for x in p):
      return [p]
    return list(p)


class TextPart(_Strict):
  type: Literal["text"]
  text: str


class ChatMessage(_Strict):
  role: Literal["system", "developer", "user", "assistant", "tool"]
  content: str | list[TextPart] | None = None

  def as_template_message(self) -> dict[str, str]:
    content = self.content
    if isinstance(content, list):
      content = "".join(part.text for part in content)
    role = "system" if self.role == "developer" else self.role
    return {"role": role, "content": content or ""}


class ChatCompletionRequest(RequestBase):
  messages: list[ChatMessage]
  max_completion_tokens: int | None = Count  # the newer name of max_tokens
  logprobs: bool = False
  tools: list[Any] | None = None
  response_format: dict[str, Any] | None = None

  def unsupported(self) -> list[tuple[str, str]]:
    out = super().unsupported()
    if self.logprobs:
      out.append(("logprobs", "logprobs are not supported"))
    if self.tools:
      out.append(("tools", "tool calling is not supported"))
    if self.response_format and self.response_format.get("type", "text") != "text":
      out.append(("response_format", "only response_format type 'text' is supported"))
    return out


def parse(model: type[RequestBase], raw: bytes) -> RequestBase:
  """Validate a JSON body; raises ``APIError`` (400) naming the first offending field."""
  if not raw.strip():
    raise APIError(400, "the request body is empty: expected a JSON object", code="invalid_json")
  try:
    request = model.model_validate_json(raw)
  except ValidationError as e:
    raise _validation_error(e) from None
  for param, reason in request.unsupported():
    raise APIError(400, reason, param=param, code="unsupported_parameter")
  return request


_RANGE_CODES = {  # pydantic error type -> OpenAI's code, by the kind of number
    ("greater_than_equal", True): "integer_below_min_value",
    ("greater_than", True): "integer_below_min_value",
    ("less_than_equal", True): "integer_above_max_value",
    ("less_than", True): "integer_above_max_value",
    ("greater_than_equal", False): "decimal_below_min_value",
    ("greater_than", False): "decimal_below_min_value",
    ("less_than_equal", False): "decimal_above_max_value",
    ("less_than", False): "decimal_above_max_value",
}


def _where(loc) -> str:
  """``('messages', 0, 'role')`` -> ``messages[0].role``."""
  out = ""
  for part in loc:
    out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
  return out


def _shown(value) -> str:
  text = repr(value)
  return text if len(text) <= 40 else text[:37] + "..."


def _validation_error(e: ValidationError) -> APIError:
  errors = e.errors(include_url=False)
  first = errors[0]
  if first["type"] == "json_invalid":
    return APIError(400, f"the request body is not valid JSON: {first['msg']}",
                    code="invalid_json")
  if not first["loc"]:
    return APIError(400, "the request body must be a JSON object", code="invalid_json")
  param, where = str(first["loc"][0]), _where(first["loc"])
  if first["type"] == "missing":
    return APIError(400, f"'{where}' is required", param=param,
                    code="missing_required_parameter")
  same_field = [err for err in errors if err["loc"] and err["loc"][0] == first["loc"][0]]
  if len(same_field) > 1 and param in FIELD_HINTS:  # a union: pydantic reports every branch
    return APIError(400, f"'{param}' must be {FIELD_HINTS[param]}", param=param,
                    code="invalid_type")
  is_int = isinstance(first.get("input"), int)
  code = _RANGE_CODES.get((first["type"], is_int))
  if code is None:
    code = "invalid_type" if first["type"].endswith("_type") else "invalid_value"
  return APIError(400, f"'{where}': {first['msg']}, got {_shown(first.get('input'))}",
                  param=param, code=code)


# ---------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
  return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
  return int(time.time())


def merge_usage(usages: list[dict]) -> dict:
  """One ``usage`` for several choices (speculative counters summed)."""
  out = {k: sum(u.get(k, 0) for u in usages)
         for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
  specs = [u["speculative"] for u in usages if "speculative" in u]
  if specs:
    steps = sum(s["steps"] for s in specs)
    accepted = sum(s["accepted_tokens"] for s in specs)
    out["speculative"] = dict(mode=specs[0]["mode"], steps=steps, accepted_tokens=accepted,
                              tokens_per_step=(accepted + steps) / max(steps, 1))
  return out


def _envelope(rid: str, obj: str, created: int, model: str, choices: list, **extra) -> dict:
  """The fields every OpenAI completion object and stream chunk shares."""
  return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
          **extra}


def completion(rid: str, created: int, model: str, choices: list[tuple[str, str]],
               usage: dict) -> dict:
  return _envelope(rid, "text_completion", created, model,
                   [{"index": i, "text": text, "logprobs": None, "finish_reason": reason}
                    for i, (text, reason) in enumerate(choices)], usage=usage)


def completion_chunk(rid: str, created: int, model: str, index: int, text: str,
                     finish_reason: str | None) -> dict:
  return _envelope(rid, "text_completion", created, model,
                   [{"index": index, "text": text, "logprobs": None,
                     "finish_reason": finish_reason}])


def chat_completion(rid: str, created: int, model: str, choices: list[tuple[str, str]],
                    usage: dict) -> dict:
  return _envelope(rid, "chat.completion", created, model,
                   [{"index": i, "message": {"role": "assistant", "content": text},
                     "logprobs": None, "finish_reason": reason}
                    for i, (text, reason) in enumerate(choices)], usage=usage)


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict,
               finish_reason: str | None) -> dict:
  return _envelope(rid, "chat.completion.chunk", created, model,
                   [{"index": index, "delta": delta, "logprobs": None,
                     "finish_reason": finish_reason}])


def usage_chunk(rid: str, created: int, model: str, obj: str, usage: dict) -> dict:
  return _envelope(rid, obj, created, model, [], usage=usage)
