"""The base LLM's projections: weights in one of two layouts, any weight dtype.

Layouts (``LAYOUTS``): ``oi`` stores a projection's weight ``[out, in]`` (PyTorch's layout, the
parameter ``weight``); ``io`` stores it ``[in, out]`` (Flax's, the parameter ``kernel``). The
math is the same; XLA:CPU runs them at different speeds (``preferred_layout``): with float32
weights a matmul over a few rows (a verified tree, a prefill) is faster ``[in, out]``, and one
row about as fast; with bfloat16 weights the ``[out, in]`` layout is the one its GEMM library
serves (below). ``to_layout`` converts a model; checkpoints keep PyTorch's layout on disk.

``project(x_xI, w, dtype)`` is ``x @ W^T`` accumulated in float32, then cast to ``dtype`` (the
activations' dtype). With float32 weights that is the plain float32 matmul. With bfloat16 weights
and float32 activations ("bf16 weights") every matmul reads half the bytes and takes XLA:CPU's
bf16 GEMM path, which on CPUs with AVX512-BF16/AMX makes a forward over a few new tokens cost
about what one token does, so a small verified tree costs about an AR step (the measurements:
results/README.md; ``python -m redrafter_jax.bench ar --forward-tokens``).
Facts of XLA:CPU and of rounding that shape this code:

- the ``[out, in]`` layout (contract the last axis of both operands) is served by the GEMM
  library for bf16 weights; ``[in, out]`` is slower there, and feeding a bf16 weight to a
  float32 dot makes XLA convert the whole weight to float32 on every call;
- a float32 input is fed as two bf16 rows, ``hi = bf16(x)`` and ``lo = bf16(x - hi)``, whose
  results are summed: x keeps ~16 of its 24 mantissa bits. Rounding x to bf16 alone turns the
  float32-level differences between two ways of computing the same activations (an AR step and
  a tree verify) into whole bf16 rounding steps, and greedy ReDrafter then left AR's path on
  real prompts (results/README.md); with the split it follows it;
- a low-precision matmul with a single row is lowered to a slow generic loop: a single bf16 row
  (bf16 activations) is duplicated to two and one result kept. A split float32 row is two rows
  already.

The split and the duplication are XLA:CPU workarounds, so they apply on CPU only (decided
statically, from the platform JAX runs on, when the function is traced). Elsewhere (GPU, TPU)
a projection is one dot: float32 activations with low-precision weights read the weights as
float32 (XLA fuses the conversion into the matmul; exact, like float32 weights), and
low-precision activations take the weights' dtype as they are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from redrafter_jax.models.invariant import project_invariant


LAYOUTS = ("oi", "io")
PARAM_NAME = {"oi": "weight", "io": "kernel"}  # the parameter that holds the matrix per layout


def on_cpu() -> bool:
  """Whether JAX computes on a CPU (static: read when a function is traced)."""
  return jax.default_backend() == "cpu"


def preferred_layout(param_dtype, *, cpu: bool | None = None) -> str:
  """The layout projections with ``param_dtype`` weights are stored in by default: ``io`` for
  float32 weights on a CPU (XLA:CPU's small-row matmuls are faster with the contraction on the
  weight's leading axis: results/README.md), ``oi`` otherwise (bfloat16 weights on a CPU, see
  above; GPUs and TPUs, whose compilers pick their own operand layouts)."""
  cpu = on_cpu() if cpu is None else cpu
  return "io" if cpu and jnp.dtype(param_dtype) == jnp.float32 else "oi"


BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})  # x86 (AVX512/AMX), Arm


def cpu_has_bf16_matmul(cpuinfo: str = "/proc/cpuinfo") -> bool:
  """Whether the CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16 on x86, BF16 on
  Arm: Linux lists them in ``/proc/cpuinfo``; False where that file is missing, e.g. macOS)."""
  try:
    with open(cpuinfo) as f:
      return any(line.split(":")[0].strip() in ("flags", "Features")
                 and not BF16_CPU_FLAGS.isdisjoint(line.split(":", 1)[-1].split())
                 for line in f)
  except OSError:
    return False


def preferred_param_dtype(*, cpu: bool | None = None, bf16: bool | None = None) -> str:
  """The LLM weight dtype (activations stay float32) that decodes fastest by default here.

  On a CPU with bf16 dot-product instructions, bfloat16 weights take XLA:CPU's bf16 GEMM path
  and read half the bytes: AR and ReDrafter both ran faster with them than with float32 weights
  (results/README.md, an AVX512-BF16 EPYC and an AMX Xeon). Without such instructions bf16 math
  is emulated, so float32. Off the CPU, bfloat16 (half the bytes read per step)."""
  cpu = on_cpu() if cpu is None else cpu
  if not cpu:
    return "bfloat16"
  return "bfloat16" if (cpu_has_bf16_matmul() if bf16 is None else bf16) else "float32"


def _check_layout(layout: str) -> None:
  if layout not in LAYOUTS:
    raise ValueError(f"unknown weight layout {layout!r}; choose one of {LAYOUTS}")


def project(x_xI: jax.Array, w: jax.Array, dtype, *, layout: str = "oi",
            cpu: bool | None = None) -> jax.Array:
  """``x_xI @ W^T`` for inputs of any leading shape: ``[..., I] -> [..., O]`` in ``dtype``, where
  ``w`` is ``W`` ``[O, I]`` (``layout`` "oi") or its transpose ``[I, O]`` ("io").

  ``cpu`` (default: ``on_cpu()``) turns on XLA:CPU's workarounds (see the module docstring).
  """
  _check_layout(layout)
  *lead, I = x_xI.shape
  x_rI = x_xI.reshape(-1, I)
  r = x_rI.shape[0]
  O = w.shape[0] if layout == "oi" else w.shape[1]
  dot = functools.partial(_dot, layout=layout)
  cpu = on_cpu() if cpu is None else cpu
  wider_x = jnp.finfo(x_rI.dtype).nmant > jnp.finfo(w.dtype).nmant
  if not cpu:
    y_rO = dot(x_rI, w.astype(x_rI.dtype)) if wider_x else dot(x_rI.astype(w.dtype), w)
  elif wider_x:
    # Float32 activations, low-precision weights: x = hi + lo, both in the weight's dtype, as
    # extra rows of one matmul (x keeps ~16 of its 24 mantissa bits, products are exact, sums
    # float32). Rounding x to bf16 alone would turn float32 noise into 2^-9 steps.
    hi_rI = x_rI.astype(w.dtype)
    lo_rI = (x_rI - hi_rI.astype(x_rI.dtype)).astype(w.dtype)
    y_hilo = dot(jnp.concatenate([hi_rI, lo_rI], axis=0), w)  # [2r, O]: hi rows, lo rows
    y_rO = y_hilo[:r] + y_hilo[r:]
  elif r == 1 and w.dtype != jnp.float32:
    y_rO = dot(jnp.concatenate([x_rI, x_rI], axis=0).astype(w.dtype), w)[:1]
  else:
    y_rO = dot(x_rI.astype(w.dtype), w)
  return y_rO.astype(dtype).reshape(*lead, O)


def _dot(x_rI, w, *, layout: str):
  contract = 1 if layout == "oi" else 0
  return jax.lax.dot_general(x_rI, w, (((1,), (contract,)), ((), ())),
                             preferred_element_type=jnp.float32)


class Dense(nnx.Module):
  """``y = x W^T + b``, ``W`` stored in ``layout`` (None: ``preferred_layout(param_dtype)``) as
  ``weight`` ``[out, in]`` or ``kernel`` ``[in, out]``, in ``param_dtype``; output in ``dtype``.
  ``invariant``: each row's result independent of the other rows
  (``invariant.project_invariant``)."""

  def __init__(self, in_features: int, out_features: int, *, use_bias: bool, dtype,
               param_dtype, rngs: nnx.Rngs, layout: str | None = None,
               invariant: bool = False):
    layout = preferred_layout(param_dtype) if layout is None else layout
    _check_layout(layout)
    if layout == "oi":
      init = nnx.initializers.lecun_normal(in_axis=1, out_axis=0)
      self.weight = nnx.Param(init(rngs.params(), (out_features, in_features), param_dtype))
    else:
      init = nnx.initializers.lecun_normal(in_axis=0, out_axis=1)
      self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), param_dtype))
    self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None
    self.dtype = dtype
    self.layout = layout
    self.invariant = invariant

  @property
  def matrix(self) -> nnx.Param:
    """The parameter holding ``W`` in this module's layout."""
    return getattr(self, PARAM_NAME[self.layout])

  def matrix_OI(self) -> jax.Array:
    """``W`` as ``[out, in]``, whatever the layout."""
    w = self.matrix[...]
    return w if self.layout == "oi" else w.T

  def __call__(self, x_xI: jax.Array) -> jax.Array:
    proj = project_invariant if self.invariant else project
    y = proj(x_xI, self.matrix[...], self.dtype, layout=self.layout)
    if self.bias is None:
      return y
    return y + self.bias[...].astype(self.dtype).reshape((1,) * (y.ndim - 1) + (-1,))


def to_layout(model: nnx.Module, layout: str) -> nnx.Module:
  """Store every ``Dense`` of ``model`` in ``layout`` (in place; returns ``model``). A
  transposition of each matrix, once: the model computes the same function."""
  _check_layout(layout)
  for _, module in nnx.iter_modules(model):
    if isinstance(module, Dense) and module.layout != layout:
      w = module.matrix[...]
      delattr(module, PARAM_NAME[module.layout])
      setattr(module, PARAM_NAME[layout], nnx.Param(jnp.swapaxes(w, -1, -2)))
      module.layout = layout
  return model


class Embed(nnx.Module):
  """Token embedding ``[V, D]`` in ``param_dtype``; looked-up rows come out in ``dtype``. (Inside
  a loop, XLA:CPU converts a bf16 table to float32 once before the loop rather than the rows it
  reads: a one-time cost per decode call.)"""

  def __init__(self, num_embeddings: int, features: int, *, dtype, param_dtype,
               rngs: nnx.Rngs, invariant: bool = False):
    init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
    self.embedding = nnx.Param(init(rngs.params(), (num_embeddings, features), param_dtype))
    self.dtype = dtype
    self.invariant = invariant  # the tied output projection's rows independent of each other

  def __call__(self, tokens: jax.Array) -> jax.Array:
    return jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)

  def attend(self, x_xD: jax.Array) -> jax.Array:
    """Logits against the table (tied output projection), float32."""
    proj = project_invariant if self.invariant else project
    return proj(x_xD, self.embedding[...], jnp.float32)
