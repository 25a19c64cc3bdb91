"""Moving flat ``{dotted name: array}`` dicts in and out of NNX modules, with strict checks."""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from redrafter_jax.weights.naming import WeightsError


def _dotted(path) -> str:
  return ".".join(str(p) for p in path)


def flat_params(model: nnx.Module) -> dict[str, jax.Array]:
  """Every ``nnx.Param`` of ``model`` as ``{dotted path: array}``."""
  state = nnx.state(model, nnx.Param)
  return {_dotted(path): var.get_value() for path, var in nnx.to_flat_state(state)}


def load_into(abstract_model: nnx.Module, arrays: Mapping[str, np.ndarray], *, dtype,
              source: str, sharding=None) -> nnx.Module:
  """Fill a shape-only module (``nnx.eval_shape``) with ``arrays``; every name must match.

  Missing tensors, unexpected tensors and shape mismatches raise ``WeightsError`` naming them.
  Variables that already hold a concrete value (defaults such as the drafter's token ranking) may
  be omitted from ``arrays``. ``sharding`` (optional) maps a dotted name to a
  ``jax.sharding.Sharding`` for placement.
  """
  graphdef, state = nnx.split(abstract_model)
  flat = nnx.to_flat_state(state)
  expected = {_dotted(path): var for path, var in flat}
  has_default = {name for name, var in expected.items()
                 if not isinstance(var.get_value(), jax.ShapeDtypeStruct)}
  missing = sorted(set(expected) - set(arrays) - has_default)
  unexpected = sorted(set(arrays) - set(expected))
  if missing:
    raise WeightsError(f"{source}: missing tensor(s) {missing[:8]}{' ...' if len(missing) > 8 else ''}")
  if unexpected:
    raise WeightsError(
        f"{source}: unexpected tensor(s) {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
  leaves = []
  for path, var in flat:
    name = _dotted(path)
    value = arrays[name] if name in arrays else var.get_value()
    if tuple(value.shape) != tuple(var.shape):
      raise WeightsError(f"{source}: tensor {name!r} has shape {tuple(value.shape)}, the model "
                         f"config expects {tuple(var.shape)}")
    target_dtype = dtype if jnp.issubdtype(var.dtype, jnp.floating) else var.dtype
    array = jnp.asarray(np.asarray(value), dtype=target_dtype)
    if sharding is not None:
      array = jax.device_put(array, sharding(name))
    leaves.append((path, var.replace(value=array)))
  state = nnx.from_flat_state(leaves)
  return nnx.merge(graphdef, state)
