"""The base LLM and its tokenizer from a model spec, for every command and the server.

A spec is a known name (``smollm2-135m``), a GGUF file or HF folder, or ``random:<spec>``: a
randomly initialised Llama for tests, where ``<spec>`` is ``tiny`` or a JSON object of
``LlamaConfig`` fields overriding ``tiny``'s, plus optional ``"seed"`` and ``"tokenizer"``:
``"bytes"`` (the default: ``tokenizer.ByteTokenizer``, UTF-8 bytes with a minimal chat template,
needs no download, fits ``tiny``'s vocabulary of 512) or a model name/path whose tokenizer to
use, e.g. ``random:{"vocab_size": 49152, "tokenizer": "smollm2-135m"}``.
"""

from __future__ import annotations

import json
from typing import Any

import jax.numpy as jnp
from flax import nnx

from redrafter_jax.config import ConfigError, LlamaConfig
from redrafter_jax.models.llama import Llama, stack_layers
from redrafter_jax.weights.llama_weights import load_llama, resolve_source
from redrafter_jax.weights.param_dtype import weights_dtype
from redrafter_jax.weights.tokenizer import ByteTokenizer, load_tokenizer

RANDOM_PREFIX = "random:"
RANDOM_MODELS = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True,
                 max_position_embeddings=4096),
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _random_spec(spec: str) -> tuple[LlamaConfig, int, str]:
  body = spec[len(RANDOM_PREFIX):].strip()
  if body in RANDOM_MODELS:
    fields: dict[str, Any] = {}
  else:
    try:
      fields = json.loads(body)
    except json.JSONDecodeError as e:
      raise ConfigError(f"model {spec!r}: after 'random:' expected one of {list(RANDOM_MODELS)} "
                        f"or a JSON object of LlamaConfig fields ({e})") from e
    if not isinstance(fields, dict):
      raise ConfigError(f"model {spec!r}: the JSON after 'random:' must be an object")
    body = "tiny"
  fields = dict(fields)
  seed = int(fields.pop("seed", 0))
  tokenizer = str(fields.pop("tokenizer", "bytes"))
  cfg = LlamaConfig.from_dict({**RANDOM_MODELS[body], **fields})
  return cfg, seed, tokenizer


def is_random(spec: str) -> bool:
  return str(spec).startswith(RANDOM_PREFIX)


def load_base_model(spec: str, *, dtype: str = "float32", param_dtype: str | None = None,
                    sharding=None, scan_layers: bool = False, invariant: bool = False,
                    backend: str = "xla") -> tuple[Llama, LlamaConfig]:
  """The base LLM for a model spec (known name, path, or ``random:<spec>``), with activations
  in ``dtype`` and weights in ``param_dtype`` (None: ``dtype``; "auto": the platform's faster
  one; ``weights.param_dtype.weights_dtype``); ``sharding``, ``scan_layers``, ``invariant`` and the
  attention ``backend`` as for ``load_llama``."""
  param_dtype = weights_dtype(param_dtype, dtype=dtype)
  for name, value in (("dtype", dtype), ("param_dtype", param_dtype)):
    if value not in DTYPES:
      raise ConfigError(f"{name} must be one of {list(DTYPES)}, got {value!r}")
  kinds = dict(dtype=DTYPES[dtype], param_dtype=DTYPES[param_dtype])
  if is_random(spec):
    cfg, seed, _ = _random_spec(spec)
    model = Llama(cfg, **kinds, backend=backend, invariant=invariant, rngs=nnx.Rngs(seed))
    return (stack_layers(model) if scan_layers else model), cfg
  return load_llama(spec, **kinds, sharding=sharding, scan_layers=scan_layers,
                    invariant=invariant, backend=backend)


def load_base_tokenizer(spec: str):
  """The tokenizer that belongs to a model spec (for ``random:`` specs, the one it names)."""
  if is_random(spec):
    cfg, _, name = _random_spec(spec)
    if name == "bytes":
      if cfg.vocab_size < ByteTokenizer.vocab_size:
        raise ConfigError(f"model {spec!r}: the bytes tokenizer needs vocab_size >= "
                          f"{ByteTokenizer.vocab_size}, got {cfg.vocab_size}")
      return ByteTokenizer()
    spec = name
  return load_tokenizer(resolve_source(spec))
