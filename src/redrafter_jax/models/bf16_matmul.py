"""A dense layer's matmul in bfloat16 with float32 accumulation, forward and backward.

``bf16_dot_general`` is a drop-in ``dot_general`` for ``nnx.Linear`` (``x @ w``: ``x``'s last
axis against ``w``'s first). It rounds both operands to bfloat16, multiplies them with float32
accumulation, and returns the operands' own dtype; its gradients are the same kind of matmul
(the output's cotangent rounded to bfloat16, float32 accumulation), returned in the operands'
dtypes. Parameters, optimizer state, softmax and loss stay in float32: this is mixed-precision
training as the field does it, for the drafter (``train.matmul_dtype``), whose step is almost all
matmul (its vocabulary head, ``[rows, C] @ [C, V]``, forward, recomputed and backward).

Why a custom gradient: on XLA:CPU the bf16 GEMM path (AMX / AVX512-BF16) serves a dot whose
operands are row-major with the contraction on the left operand's last axis and the right
operand's first (``[M, K] @ [K, N]``), with a float32 result. The gradients ``g @ w^T`` and
``x^T @ g`` reach XLA as transposed contractions, which it fuses into the dot as a layout change
and then runs on a slow path (no faster than float32). So on a CPU the backward pass writes each
transposed operand out row-major first (a flatten behind an optimisation barrier, which XLA
cannot turn into a layout change) and multiplies in the served form. Off the CPU (GPU, TPU) the
transposed contractions go to the vendor GEMM as they are. ``python -m redrafter_jax.bench
train_step`` times a training step both ways.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from redrafter_jax.models.linear import on_cpu


def _row_major_transpose(a_MN: jax.Array) -> jax.Array:
  """``a.T`` written out as a row-major array (``[N, M]``), not as a layout change."""
  M, N = a_MN.shape
  if not on_cpu():
    return a_MN.T
  return jax.lax.optimization_barrier(a_MN.T.reshape(-1)).reshape(N, M)


def _mm(a_MK: jax.Array, b_KN: jax.Array) -> jax.Array:
  return jnp.dot(a_MK.astype(jnp.bfloat16), b_KN.astype(jnp.bfloat16),
                 preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul(x_xK, w_KN, x_dtype, w_dtype):
  return _matmul_fwd(x_xK, w_KN, x_dtype, w_dtype)[0]


def _matmul_fwd(x_xK, w_KN, x_dtype, w_dtype):
  x_MK = x_xK.reshape(-1, x_xK.shape[-1]).astype(jnp.bfloat16)
  w_KN = w_KN.astype(jnp.bfloat16)
  y_MN = _mm(x_MK, w_KN)
  return y_MN.reshape(*x_xK.shape[:-1], w_KN.shape[1]), (x_MK, w_KN)


def _matmul_bwd(x_dtype, w_dtype, residuals, g_xN):
  x_MK, w_KN = residuals
  g_MN = g_xN.reshape(-1, g_xN.shape[-1]).astype(jnp.bfloat16)
  dx_MK = _mm(g_MN, _row_major_transpose(w_KN))
  dw_KN = _mm(_row_major_transpose(x_MK), g_MN)
  return dx_MK.reshape(*g_xN.shape[:-1], x_MK.shape[1]).astype(x_dtype), dw_KN.astype(w_dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def bf16_dot_general(x, w, dimension_numbers, precision=None, preferred_element_type=None,
                     **unused):
  """``jax.lax.dot_general`` for a dense layer (``x [..., K] @ w [K, N]``), computed in bfloat16
  with float32 accumulation (module docstring). Returns ``preferred_element_type``, else the
  operands' common dtype. Any other contraction is refused."""
  (contract_x, contract_w), (batch_x, batch_w) = dimension_numbers
  if (w.ndim != 2 or tuple(contract_x) != (x.ndim - 1,) or tuple(contract_w) != (0,)
      or tuple(batch_x) or tuple(batch_w)):
    raise ValueError(f"bf16_dot_general computes x[..., K] @ w[K, N] only, got shapes "
                     f"{x.shape} and {w.shape} with dimension numbers {dimension_numbers}")
  out = _matmul(x, w, jnp.dtype(x.dtype), jnp.dtype(w.dtype))
  return out.astype(preferred_element_type or jnp.result_type(x, w))
