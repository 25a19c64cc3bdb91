"""A flash-style attention kernel for the verify forward, in ``jax.experimental.pallas``.

``attend_pallas(q_BTHE, k_BKSE, v_BKSE, mask_BTS) -> out_BTHE`` computes what the ``xla`` backend
does (softmax over the visible slots, float32 statistics) without materialising ``[T, S]`` scores:

- grid: (row b, kv head k, block of query rows). Grouped-query attention is native: the G query
  heads of kv head k and the T new tokens form ``Q = G * T`` query rows (``q = g * T + t``) that
  share one pass over k's ``[S, E]`` keys and values, read once per kv head, not once per head;
- the mask is any ``[B, T, S]`` visibility (a causal prefill, an AR step, a packed draft tree:
  each token sees the committed prefix and its ancestors), read block by block;
- block skipping: a row reads only the key/value blocks up to its last visible slot
  (``filled_B``), so its cost follows the row's length, not the cache's size;
- online softmax (FlashAttention-2): a running max and sum per query row, one rescale per block.

On a GPU it lowers through Triton (``interpret=False``); on CPU it runs in Pallas's interpret
mode, which is how the default test suite checks it against ``xla``. GPU-only modules are
imported lazily, so the CPU path never needs them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

_NEG_INF = -1e30
BLOCK_Q = 64  # query rows per program (padded up from G * T; Triton wants powers of two >= 16)
BLOCK_K = 128  # key/value slots per inner step


def _kv_block(size: int, block_k: int) -> int:
  """The largest power of two <= ``block_k`` dividing ``size`` (cache sizes are multiples of
  128, so this is ``block_k`` in practice; odd test sizes get smaller blocks)."""
  b = block_k
  while size % b:
    b //= 2
  return b


def _kernel(filled_ref, q_ref, k_ref, v_ref, mask_ref, o_ref, *, block_k: int, scale: float):
  """One (row, kv head, query block): stream the row's filled key/value blocks."""
  block_q, E = q_ref.shape
  q_QE = q_ref[...].astype(jnp.float32) * scale

  def body(j, carry):
    acc_QE, max_Q, sum_Q = carry
    slots = pl.ds(j * block_k, block_k)
    k_KE = k_ref[slots, :].astype(jnp.float32)
    v_KE = v_ref[slots, :].astype(jnp.float32)
    scores_QK = lax.dot_general(q_QE, k_KE, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
    scores_QK = jnp.where(mask_ref[:, slots] != 0, scores_QK, _NEG_INF)
    new_max_Q = jnp.maximum(max_Q, jnp.max(scores_QK, axis=1))
    rescale_Q = jnp.exp(max_Q - new_max_Q)
    p_QK = jnp.exp(scores_QK - new_max_Q[:, None])
    acc_QE = acc_QE * rescale_Q[:, None] + lax.dot_general(
        p_QK, v_KE, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return acc_QE, new_max_Q, sum_Q * rescale_Q + jnp.sum(p_QK, axis=1)

  init = (jnp.zeros((block_q, E), jnp.float32), jnp.full((block_q,), _NEG_INF, jnp.float32),
          jnp.zeros((block_q,), jnp.float32))
  num_blocks = (filled_ref[...] + block_k - 1) // block_k  # only the blocks the row has filled
  acc_QE, _, sum_Q = lax.fori_loop(0, num_blocks, body, init)
  o_ref[...] = (acc_QE / jnp.maximum(sum_Q, 1e-30)[:, None]).astype(o_ref.dtype)


def filled_slots(mask_BTS: jax.Array) -> jax.Array:
  """``filled_B``: one past the last slot any of a row's new tokens may see (0: none)."""
  S = mask_BTS.shape[-1]
  seen_BS = jnp.any(mask_BTS, axis=1)
  return jnp.max(jnp.where(seen_BS, jnp.arange(1, S + 1)[None, :], 0), axis=1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("interpret", "block_q", "block_k"))
def attend_pallas(q_BTHE: jax.Array, k_BKSE: jax.Array, v_BKSE: jax.Array, mask_BTS: jax.Array,
                  *, interpret: bool, block_q: int = BLOCK_Q, block_k: int = BLOCK_K
                  ) -> jax.Array:
  """Masked grouped-query attention over a ``[B, K, S, E]`` cache (see the module docstring)."""
  B, T, H, E = q_BTHE.shape
  _, K, S, _ = k_BKSE.shape
  G = H // K
  Q = G * T
  bq = max(16, min(block_q, pl.next_power_of_2(Q)))
  Qp = -(-Q // bq) * bq
  bk = _kv_block(S, block_k)
  q_BKQE = q_BTHE.reshape(B, T, K, G, E).transpose(0, 2, 3, 1, 4).reshape(B, K, Q, E)
  q_BKQE = jnp.pad(q_BKQE, ((0, 0), (0, 0), (0, Qp - Q), (0, 0)))
  mask_BQS = jnp.tile(mask_BTS, (1, G, 1)).astype(jnp.int8)  # row g * T + t is token t's mask
  mask_BQS = jnp.pad(mask_BQS, ((0, 0), (0, Qp - Q), (0, 0)))
  compiler_params = None
  if not interpret:
    from jax.experimental.pallas import triton as plgpu  # GPU only: imported when lowering there

    compiler_params = plgpu.CompilerParams(num_warps=4 if E <= 64 else 8, num_stages=2)
  out_BKQE = pl.pallas_call(
      functools.partial(_kernel, block_k=bk, scale=E ** -0.5),
      out_shape=jax.ShapeDtypeStruct((B, K, Qp, E), q_BTHE.dtype),
      grid=(B, K, Qp // bq),
      in_specs=[
          pl.BlockSpec((None,), lambda b, k, i: (b,)),
          pl.BlockSpec((None, None, bq, E), lambda b, k, i: (b, k, i, 0)),
          pl.BlockSpec((None, None, S, E), lambda b, k, i: (b, k, 0, 0)),
          pl.BlockSpec((None, None, S, E), lambda b, k, i: (b, k, 0, 0)),
          pl.BlockSpec((None, bq, S), lambda b, k, i: (b, i, 0)),
      ],
      out_specs=pl.BlockSpec((None, None, bq, E), lambda b, k, i: (b, k, i, 0)),
      interpret=interpret, compiler_params=compiler_params, name="tree_attention",
  )(filled_slots(mask_BTS), q_BKQE, k_BKSE, v_BKSE, mask_BQS)
  out_BKGTE = out_BKQE[:, :, :Q].reshape(B, K, G, T, E)
  return out_BKGTE.transpose(0, 3, 1, 2, 4).reshape(B, T, H, E)
