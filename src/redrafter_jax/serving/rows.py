"""A sub-batch of a ``SlotBatch``: the rows a step runs on, taken out and put back.

A step's cost grows with its rows: the LLM's matmuls and attention run over every row handed to
them, decoding or not. The engine therefore runs each step on a power-of-two bucket of rows
(the active slots, padded with free ones) rather than on all slots: ``take`` gathers those rows
into a batch of their own (static size b), the step runs on it, ``put`` scatters them back.
Only the gathered rows' cache is read and copied, so a step with one active request costs about
what a batch-1 step costs, plus copying that row's cache in and out.

The KV cache's layout is the models' business (``models/kv_cache.py``: ``[K * B, ...]``, kv head
major, today); ``_cache_rows`` / ``_put_cache_rows`` are the one place here that knows it.
Every other leaf of the batch has its row axis first, except the output's scalar step counter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

def _cache_index(idx_b: jax.Array, X: int, B: int) -> jax.Array:
  """Rows of ``[K * B, ...]`` holding slots ``idx_b``, kv head major: ``k * b + i``."""
  K = X // B
  return (jnp.arange(K)[:, None] * B + idx_b[None, :]).reshape(-1)


def _cache_rows(x_Xx: jax.Array, idx_b: jax.Array, B: int) -> jax.Array:
  return x_Xx[_cache_index(idx_b, x_Xx.shape[0], B)]


def _put_cache_rows(x_Xx: jax.Array, idx_b: jax.Array, rows_Xx: jax.Array, B: int) -> jax.Array:
  # A scatter on the donated buffer as it is (no reshape: XLA:CPU copies a whole buffer whose
  # in-place update feeds a reshape), so only the b rows are written.
  return x_Xx.at[_cache_index(idx_b, x_Xx.shape[0], B)].set(rows_Xx)


def _is_row_leaf(x) -> bool:
  return hasattr(x, "ndim") and x.ndim >= 1


def take(batch, idx_b: jax.Array):
  """The rows ``idx_b`` (distinct slot numbers) of ``batch``, as a batch of ``len(idx_b)``."""
  cache = batch.state.cache
  B = cache.lengths_B.shape[0]
  sub_cache = cache.replace(k=tuple(_cache_rows(k, idx_b, B) for k in cache.k),
                            v=tuple(_cache_rows(v, idx_b, B) for v in cache.v),
                            lengths_B=cache.lengths_B[idx_b])
  rest = jax.tree.map(lambda x: x[idx_b] if _is_row_leaf(x) else x,
                      batch.replace(state=batch.state.replace(cache=None)))
  return rest.replace(state=rest.state.replace(cache=sub_cache))


def put(batch, idx_b: jax.Array, sub):
  """``batch`` with rows ``idx_b`` replaced by the rows of ``sub`` (scalars taken from ``sub``)."""
  cache, sub_cache = batch.state.cache, sub.state.cache
  B = cache.lengths_B.shape[0]
  new_cache = cache.replace(
      k=tuple(_put_cache_rows(k, idx_b, s, B) for k, s in zip(cache.k, sub_cache.k)),
      v=tuple(_put_cache_rows(v, idx_b, s, B) for v, s in zip(cache.v, sub_cache.v)),
      lengths_B=cache.lengths_B.at[idx_b].set(sub_cache.lengths_B))
  strip = lambda b: b.replace(state=b.state.replace(cache=None))
  rest = jax.tree.map(lambda full, part: full.at[idx_b].set(part) if _is_row_leaf(full) else part,
                      strip(batch), strip(sub))
  return rest.replace(state=rest.state.replace(cache=new_cache))
