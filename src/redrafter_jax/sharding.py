"""The project's one sharding module: a device mesh with named axes and where every tensor lives.

Mesh axes:
  ``data``   batch rows are split over it (data parallelism; spans processes on a cluster)
  ``model``  tensor parallelism for the base LLM (Megatron style)

Base LLM: q/k/v and gate/up projections are column-parallel (output features split over
``model``), o/down projections row-parallel (input features split), in either weight layout
(``weight`` is (out, in), PyTorch's; ``kernel`` (in, out): ``models.linear``), so one attention
block and one MLP each need a single all-reduce. The embedding table and an untied ``lm_head``
are split over the vocabulary (vocab-parallel logits; the embedding gather becomes a masked
lookup plus all-reduce). Norm scales are replicated. A dimension that the axis does not divide
stays replicated, so any mesh is correct for any model (just less sharded).

The drafter is small and runs once per position on every data shard: it is replicated, and so
is its optimizer state.

Everything here works on multi-process (multi-host) meshes: placement goes through
``jax.device_put`` with global shardings, batches through ``make_array_from_process_local_data``.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from redrafter_jax.config import ConfigError

DATA, MODEL = "data", "model"

# (regex on the dotted parameter path, spec); the first match wins, no match means replicated.
# Projections as PyTorch stores them, ``weight`` [out, in] (``models.linear`` layout "oi").
_WEIGHT_RULES: tuple[tuple[str, P], ...] = (
    (r"lm_head\.weight$", P(MODEL, None)),
    (r"self_attn\.(q|k|v)_proj\.weight$", P(MODEL, None)),
    (r"self_attn\.o_proj\.weight$", P(None, MODEL)),
    (r"mlp\.(gate|up)_proj\.weight$", P(MODEL, None)),
    (r"mlp\.down_proj\.weight$", P(None, MODEL)),
)
LLAMA_RULES: tuple[tuple[str, P], ...] = (
    (r"embed_tokens\.embedding$", P(MODEL, None)),
    (r"self_attn\.(q|k|v)_proj\.bias$", P(MODEL)),
    *_WEIGHT_RULES,
    # The same matrices stored [in, out] (layout "io", the parameter ``kernel``): axes swapped.
    *((rule.replace(r"\.weight$", r"\.kernel$"), P(*reversed(spec)))
      for rule, spec in _WEIGHT_RULES),
)
REPLICATED_RULES: tuple[tuple[str, P], ...] = ()


def make_mesh(data: int = -1, model: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ``(data, model)`` mesh over ``devices`` (default: all, across processes); -1 = the rest.

  Devices are laid out in ``jax.devices()`` order (process by process), so consecutive ``data``
  rows belong to one process and ``model`` groups stay within a host where the sizes allow.
  """
  devices = list(jax.devices() if devices is None else devices)
  if model < 1 or len(devices) % model:
    raise ConfigError(f"mesh: model={model} must be >= 1 and divide the {len(devices)} devices")
  if data == -1:
    data = len(devices) // model
  if data < 1 or data * model > len(devices):
    raise ConfigError(f"mesh: data={data} x model={model} does not fit {len(devices)} devices")
  if jax.process_count() > 1 and data * model != len(devices):
    raise ConfigError(f"mesh: data x model = {data * model} must use all {len(devices)} devices "
                      "when running on several processes")
  grid = np.asarray(devices[:data * model], dtype=object).reshape(data, model)
  return Mesh(grid, (DATA, MODEL))


def path_name(path) -> str:
  """``layers.0.mlp.up_proj.weight`` from a pytree key path (an NNX Variable's own ``.value``
  key is not part of the parameter's name)."""
  parts = []
  for key in path:
    if isinstance(key, jax.tree_util.GetAttrKey):
      if key.name == "value":
        continue
      parts.append(key.name)
    elif isinstance(key, jax.tree_util.SequenceKey):
      parts.append(str(key.idx))
    else:
      parts.append(str(getattr(key, "key", key)))
  return ".".join(parts)


_STACKED = re.compile(r"(^|\.)layers\.(?!\d)")  # ``layers.mlp...``: no index, [L, ...]


def spec_for(name: str, shape: Sequence[int], mesh: Mesh,
             rules: Sequence[tuple[str, P]] = LLAMA_RULES) -> P:
  """The partition spec of parameter ``name``; axes that do not divide a dimension are dropped.
  Layers stacked for a scan (``llama.stack_layers``: a name without a layer index) keep their
  leading layer axis whole and split the rest by the same rules."""
  for pattern, spec in rules:
    if re.search(pattern, name):
      if _STACKED.search(name):
        spec = P(None, *spec)
      fitted = []
      for dim, axis in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        fitted.append(axis if axis is None or dim % mesh.shape[axis] == 0 else None)
      return P(*fitted)
  return P()


def state_shardings(state: Any, mesh: Mesh, rules: Sequence[tuple[str, P]] = LLAMA_RULES) -> Any:
  """A pytree like ``state`` (an ``nnx.State`` or any pytree) of ``NamedSharding``s."""
  def one(path, leaf):
    return NamedSharding(mesh, spec_for(path_name(path), np.shape(leaf), mesh, rules))

  return jax.tree_util.tree_map_with_path(one, state)


def place(tree: Any, shardings: Any) -> Any:
  """Put every array of ``tree`` on the mesh (works across processes: values must agree)."""
  return jax.tree.map(lambda x, s: jax.device_put(x, s), tree, shardings)


def shard_module(module: nnx.Module, mesh: Mesh,
                 rules: Sequence[tuple[str, P]] = LLAMA_RULES) -> nnx.Module:
  """Place an NNX module's state on ``mesh`` by ``rules`` (in place; also returned)."""
  state = nnx.state(module)
  nnx.update(module, place(state, state_shardings(state, mesh, rules)))
  return module


def param_sharding(mesh: Mesh, shapes: Mapping[str, Sequence[int]],
                   rules: Sequence[tuple[str, P]] = LLAMA_RULES) -> Callable[[str], NamedSharding]:
  """``name -> NamedSharding`` for loaders that place tensors one by one (``load_llama``)."""
  return lambda name: NamedSharding(mesh, spec_for(name, shapes[name], mesh, rules))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis split over ``data``, the rest replicated."""
  return NamedSharding(mesh, P(DATA))


def process_rows(mesh: Mesh, global_batch: int) -> tuple[int, int]:
  """Rows ``[start, stop)`` of a global batch that this process's devices hold.

  With the ``data`` axis laid out process by process this is one contiguous block; processes
  that share ``data`` indices (a ``model`` axis spanning hosts) get the same block.
  """
  data = mesh.shape[DATA]
  if global_batch % data:
    raise ConfigError(f"global batch {global_batch} is not divisible by the data axis ({data})")
  me = jax.process_index()
  idx = sorted({i for (i, _), d in np.ndenumerate(mesh.devices) if d.process_index == me})
  if not idx or idx != list(range(idx[0], idx[-1] + 1)):
    raise ConfigError(f"process {me} holds data shards {idx}: expected a contiguous block")
  per = global_batch // data
  return idx[0] * per, (idx[-1] + 1) * per


def shard_batch(local: Mapping[str, np.ndarray], mesh: Mesh, global_batch: int
                ) -> dict[str, jax.Array]:
  """Global arrays split over ``data`` from this process's rows (``process_rows``)."""
  sharding = batch_sharding(mesh)
  return {name: jax.make_array_from_process_local_data(sharding, x, (global_batch,) + x.shape[1:])
          for name, x in local.items()}


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, *, auto: bool = False) -> None:
  """Join a multi-process run before any other JAX call (no-op without arguments or ``auto``).

  Explicit: ``coordinator="host:port"`` plus ``num_processes`` and ``process_id``. ``auto``:
  JAX detects the cluster (SLURM, Open MPI, Kubernetes/GKE, Cloud TPU). On CPU, cross-process
  collectives go through gloo.
  """
  if coordinator is None and not auto:
    return
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                             process_id=process_id)


def local_value(x: jax.Array) -> np.ndarray:
  """A host copy of a replicated (possibly multi-process) array."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(x.addressable_data(0))
  return np.asarray(x)
