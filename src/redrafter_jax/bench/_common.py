"""What the benchmarks share: loading the models they time (``load``: every benchmark loads
through it), their drafter and draft-vocabulary arguments, and writing a report."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any


@dataclasses.dataclass(frozen=True)
class Models:
  """What a benchmark runs: the LLM, its config, the drafter (None when none was asked for) and
  the tokenizer (None when not asked for)."""

  llm: Any
  cfg: Any
  drafter: Any = None
  tokenizer: Any = None


def _dtype_name(value) -> str | None:
  """A dtype given as a name, "auto" or a JAX/NumPy dtype, as its name (None stays None)."""
  if value is None or isinstance(value, str):
    return value
  import jax.numpy as jnp

  return jnp.dtype(value).name


def load(model: str, *, dtype="float32", param_dtype=None, invariant: bool = False,
         backend: str = "xla", drafter: str | None = None, exit_dim: int = 256,
         tokenizer: bool = True) -> Models:
  """The models a benchmark times: the base LLM for ``model`` (a known name, a path or
  ``random:<spec>``, ``weights.base_model``) with ``dtype`` activations and ``param_dtype``
  weights (None: ``dtype``; "auto": the platform's faster one), in the invariant mode if asked,
  on attention ``backend``; the drafter ``drafter`` names (``load_drafter_arg``: a folder,
  ``shipped`` or ``random``), computing in ``dtype``; and the model's tokenizer."""
  import jax.numpy as jnp

  from redrafter_jax.weights.base_model import load_base_model, load_base_tokenizer

  dtype = _dtype_name(dtype)
  llm, cfg = load_base_model(model, dtype=dtype, param_dtype=_dtype_name(param_dtype),
                             invariant=invariant, backend=backend)
  return Models(llm, cfg,
                None if drafter is None else load_drafter_arg(drafter, cfg, exit_dim,
                                                              dtype=jnp.dtype(dtype)),
                load_base_tokenizer(model) if tokenizer else None)


def load_drafter_arg(spec: str, llm_cfg, exit_dim: int, dtype=None):
  """``--drafter``: a folder, ``shipped`` (the one in checkpoints/) or ``random`` (a fresh
  drafter of ``exit_dim`` for ``llm_cfg``, for timing without a trained one)."""
  import jax.numpy as jnp
  from flax import nnx

  from redrafter_jax.config import DrafterConfig
  from redrafter_jax.models.drafter import Drafter

  dtype = jnp.float32 if dtype is None else dtype
  if spec == "random":
    return Drafter(DrafterConfig(vocab_size=llm_cfg.vocab_size, hidden_size=llm_cfg.hidden_size,
                                 exit_dim=exit_dim), dtype=dtype, rngs=nnx.Rngs(0))
  from redrafter_jax.weights.drafter_io import load_drafter
  from redrafter_jax.weights.shipped import resolve_drafter

  return load_drafter(resolve_drafter(spec), dtype=dtype)


def draft_vocab_arg(spec: str, value: int | None) -> int:
  """``--draft-vocab``, defaulting to the drafter's recommended size (its decode.json), else all."""
  if spec == "random":
    return value or 0
  from redrafter_jax.weights.shipped import draft_vocab_for, resolve_drafter

  return draft_vocab_for(resolve_drafter(spec), value)


def load_models(args, *, exit_dim: int = 256) -> Models:
  """``load`` for the usual arguments: ``args.model`` with ``args.param_dtype`` weights and the
  drafter ``args.drafter``; ``args.draft_vocab`` is resolved in place."""
  models = load(args.model, param_dtype=args.param_dtype, drafter=args.drafter,
                exit_dim=exit_dim)
  args.draft_vocab = draft_vocab_arg(args.drafter, args.draft_vocab)
  return models


def emit(report: str, out: pathlib.Path | None) -> None:
  """Print a report, and write it to ``out`` too when given."""
  print(report)
  if out:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
