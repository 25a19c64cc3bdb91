"""What the benchmarks share: their drafter and draft-vocabulary arguments, loading the models
they time, and writing a report."""

from __future__ import annotations

import pathlib


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


def load_models(args, *, exit_dim: int = 256):
  """The base model (``args.model`` with ``args.param_dtype`` weights), its config and the
  drafter (``args.drafter``); ``args.draft_vocab`` is resolved in place."""
  from redrafter_jax.weights.base_model import load_base_model

  llm, cfg = load_base_model(args.model, param_dtype=args.param_dtype)
  drafter = load_drafter_arg(args.drafter, cfg, exit_dim=exit_dim)
  args.draft_vocab = draft_vocab_arg(args.drafter, args.draft_vocab)
  return llm, cfg, drafter


def emit(report: str, out: pathlib.Path | None) -> None:
  """Print a report, and write it to ``out`` too when given."""
  print(report)
  if out:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
