"""Static-shape KV cache with per-row lengths.

Layout: ``k``/``v`` are tuples with one array per layer, keys ``[X, E, S]`` and values
``[X, S, E]``, where ``X = K * B`` runs over (kv head, row) pairs, head-major (``x = k * B + b``);
``lengths_B`` counts the committed slots of each row. A forward over T new tokens writes their K/V
at slots ``lengths[b] .. lengths[b] + T - 1`` WITHOUT committing them; the caller then either
``advance``s (prefill, AR step) or ``commit``s an accepted tree path (a gather of at most A slots;
the cache is never cloned). Rows never need padding on the left: each row's prompt starts at
slot 0 and positions are per row. ``layer_BKSE`` gives the conventional ``[B, K, S, E]`` view.

Why this layout. Attention is two batched matmuls over ``X``, ``q[X, GT, E] @ k[X, E, S]`` and
``p[X, GT, S] @ v[X, S, E]``: each cache array is already the operand XLA wants (one batch
dimension, contracting dimension where the matmul reads it), so the cache is never transposed or
reshaped inside a step. That matters beyond the transpose itself: XLA:CPU duplicates an in-place
update that feeds a reshape, and then copies the whole buffer to keep both copies right: with the
earlier ``[B, K, S, E]`` layout an AR step made such copies of many cache layers, plus a transpose
of every K (``bench profile --mode ar`` shows them; README, "Layout"). Head-major ``X`` keeps a
split over kv heads (tensor parallel serving) a split of the leading axis. Each layer's array is
its own buffer so a layer's update is in place, where one stacked ``[layers, ...]`` array is
copied whole (README, "Layout").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
  k: tuple[jax.Array, ...]  # per layer [X, E, S], X = K * B head-major
  v: tuple[jax.Array, ...]  # per layer [X, S, E]
  lengths_B: jax.Array  # int32 [B], committed slots per row

  @property
  def size(self) -> int:
    return self.v[0].shape[1]

  @property
  def batch(self) -> int:
    return self.lengths_B.shape[0]

  @property
  def num_kv_heads(self) -> int:
    return self.v[0].shape[0] // self.batch

  @property
  def num_layers(self) -> int:
    return len(self.k)

  def layer(self, i: int) -> tuple[jax.Array, jax.Array]:
    """``(k_XES, v_XSE)`` of layer ``i``, as attention consumes them."""
    return self.k[i], self.v[i]

  def layer_BKSE(self, i: int) -> tuple[jax.Array, jax.Array]:
    """Layer ``i``'s keys and values in the conventional ``[B, K, S, E]`` layout (a copy)."""
    return as_BKSE(self.k[i], self.v[i], self.batch)


def as_BKSE(k_XES: jax.Array, v_XSE: jax.Array, batch: int) -> tuple[jax.Array, jax.Array]:
  """Keys and values in the cache's layout (``X = K * B``, head-major) as ``[B, K, S, E]``."""
  X, E, S = k_XES.shape
  k_KBES = k_XES.reshape(X // batch, batch, E, S)
  v_KBSE = v_XSE.reshape(X // batch, batch, S, E)
  return k_KBES.transpose(1, 0, 3, 2), v_KBSE.transpose(1, 0, 2, 3)


def init(num_layers: int, batch: int, size: int, num_kv_heads: int, head_dim: int,
         dtype=jnp.float32) -> KVCache:
  X = num_kv_heads * batch
  return KVCache(k=tuple(jnp.zeros((X, head_dim, size), dtype) for _ in range(num_layers)),
                 v=tuple(jnp.zeros((X, size, head_dim), dtype) for _ in range(num_layers)),
                 lengths_B=jnp.zeros((batch,), jnp.int32))


def _heads(B: int, T: int, K: int) -> jax.Array:
  """``x_BTK``: the ``X`` index of (row b, kv head k), repeated over T."""
  x_BK = jnp.arange(K)[None, :] * B + jnp.arange(B)[:, None]
  return jnp.broadcast_to(x_BK[:, None, :], (B, T, K))


def _per_head(x_BT: jax.Array, K: int) -> jax.Array:
  """``x_BTK``: a per-row, per-token index repeated for each of the K kv heads."""
  return jnp.broadcast_to(x_BT[:, :, None], (*x_BT.shape, K))


def write_layer(cache: KVCache, layer: int, k_BTKE: jax.Array, v_BTKE: jax.Array) -> KVCache:
  """Write one layer's new K/V at each row's first uncommitted slot (no commit).

  A scatter with explicit (head-row, slot) indices, in place on the layer's buffers. Slots past
  the cache's end are dropped (never clamped back onto committed slots).
  """
  B, T, K, _ = k_BTKE.shape
  x_BTK = _heads(B, T, K)
  slots_BTK = _per_head(cache.lengths_B[:, None] + jnp.arange(T)[None, :], K)
  k_XES, v_XSE = cache.layer(layer)
  # Advanced indices (on axes 0 and 2 of k, around a slice; 0 and 1 of v) address [B, T, K, E].
  k_XES = k_XES.at[x_BTK, :, slots_BTK].set(k_BTKE.astype(k_XES.dtype), mode="drop")
  v_XSE = v_XSE.at[x_BTK, slots_BTK].set(v_BTKE.astype(v_XSE.dtype), mode="drop")
  put = lambda layers, c: layers[:layer] + (c,) + layers[layer + 1:]
  return cache.replace(k=put(cache.k, k_XES), v=put(cache.v, v_XSE))


def visible_mask(lengths_B: jax.Array, mask_BTT: jax.Array, size: int) -> jax.Array:
  """``mask_BTS``: a new token sees every committed slot and the new tokens ``mask_BTT`` allows.

  New token t of row b lives at slot ``lengths[b] + t``.
  """
  slots_S = jnp.arange(size)
  rel_BS = slots_S[None, :] - lengths_B[:, None]  # slot index relative to the first new token
  T = mask_BTT.shape[-1]
  committed_BS = rel_BS < 0
  in_new_BS = (rel_BS >= 0) & (rel_BS < T)
  new_BTS = jax.vmap(lambda m_TT, r_S: m_TT[:, r_S])(mask_BTT, jnp.clip(rel_BS, 0, T - 1))
  return committed_BS[:, None, :] | (in_new_BS[:, None, :] & new_BTS)


def causal_mask(valid_BT: jax.Array) -> jax.Array:
  """``mask_BTT`` for a causal chunk of new tokens; invalid (padding) keys are hidden."""
  T = valid_BT.shape[1]
  tril_TT = jnp.tril(jnp.ones((T, T), bool))
  return tril_TT[None] & valid_BT[:, None, :]


def advance(cache: KVCache, num_B: jax.Array) -> KVCache:
  """Commit the first ``num_B`` freshly written slots of each row (they are already in place)."""
  return cache.replace(lengths_B=cache.lengths_B + num_B.astype(jnp.int32))


def commit(cache: KVCache, path_BA: jax.Array, num_B: jax.Array) -> KVCache:
  """Commit an accepted tree path.

  ``path_BA[b, a]`` is the index (among the T new tokens of the last forward) of the a-th token
  on row b's accepted path; the first ``num_B[b]`` are committed. Their K/V move from slot
  ``len + path[a]`` to ``len + a``: one gather and one in-place scatter of A slots per row and
  layer (all A are moved; those past ``num_B`` stay uncommitted scratch).
  """
  B, A = path_BA.shape
  K = cache.num_kv_heads
  x_BAK = _heads(B, A, K)
  src_BAK = _per_head(cache.lengths_B[:, None] + path_BA, K)
  dst_BAK = _per_head(cache.lengths_B[:, None] + jnp.arange(A)[None, :], K)

  def move_k(k_XES):
    return k_XES.at[x_BAK, :, dst_BAK].set(k_XES[x_BAK, :, src_BAK], mode="drop")

  def move_v(v_XSE):
    return v_XSE.at[x_BAK, dst_BAK].set(v_XSE[x_BAK, src_BAK], mode="drop")

  return cache.replace(k=tuple(move_k(c) for c in cache.k), v=tuple(move_v(c) for c in cache.v),
                       lengths_B=cache.lengths_B + num_B.astype(jnp.int32))
