"""The LLM's weight dtype: one resolution for every entry point (the library's loaders, the
CLI, the server, the benchmarks).

The LLM computes in its activation ``dtype`` and may hold its weights narrower: bfloat16 weights
under float32 activations read half the bytes per step and take XLA:CPU's bf16 GEMM path on CPUs
with bf16 instructions (``models/linear.py``). A drafter is measured with one weight dtype and
its decode settings pay only with it. So, first one found wins:

1. the dtype asked for: "float32" or "bfloat16", or "auto", the platform's faster one
   (``models.linear.preferred_param_dtype``) under float32 activations and the activations'
   own under narrower ones;
2. with a drafter folder: the dtype its settings were measured with (its ``decode.json``
   ``param_dtype``, "auto" resolved as in 1), float32 when it records none;
3. the activations' dtype.
"""

from __future__ import annotations

import pathlib

from redrafter_jax.config import ConfigError
from redrafter_jax.models import linear
from redrafter_jax.weights.shipped import decode_defaults

PARAM_DTYPES = ("float32", "bfloat16", "auto")


def weights_dtype(requested: str | None = None, *, dtype: str = "float32",
                  drafter: str | pathlib.Path | None = None) -> str:
  """The LLM's weight dtype, "float32" or "bfloat16" (module docstring).

  Args:
    requested: "float32", "bfloat16", "auto", or None (not asked).
    dtype: the LLM's activation dtype.
    drafter: a drafter folder whose recorded ``param_dtype`` applies when none is asked.

  Returns:
    "float32" or "bfloat16".

  Raises:
    ConfigError: a requested or recorded value that is none of ``PARAM_DTYPES``.
  """
  if requested is not None:
    value, source = requested, "param_dtype"
  elif drafter is not None:
    value = decode_defaults(drafter).get("param_dtype", "float32")
    source = f"{pathlib.Path(drafter) / 'decode.json'}: param_dtype"
  else:
    return dtype
  if value not in PARAM_DTYPES:
    raise ConfigError(f"{source} must be one of {PARAM_DTYPES}, got {value!r}")
  if value == "auto":
    return linear.preferred_param_dtype() if dtype == "float32" else dtype
  return value
