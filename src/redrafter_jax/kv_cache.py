"""Static-shape KV cache with per-row lengths.

Layout: ``k``/``v`` are tuples with one ``[B, K, S, E]`` array per layer; ``lengths_B`` counts the
committed slots of each row. A forward over T new tokens writes their K/V at slots
``lengths[b] .. lengths[b] + T - 1`` WITHOUT committing them; the caller then either
``advance``s (prefill, AR step) or ``commit``s an accepted tree path (a gather of at most A slots;
the cache is never cloned). Rows never need padding on the left: each row's prompt starts at
slot 0 and positions are per row.

Why per-layer ``[B, K, S, E]`` (rather than one ``[layers, B, S, K, E]`` array): attention is then
a batched matmul over (b, k) with contiguous ``[S, E]`` blocks, with no transpose of the cache,
and each layer's update is in place on its own buffer, with no slice copies. Measured on the
2-core CPU at B=32, S=512: attention over 30 layers 99 ms vs 415 ms, update + attention 197 ms vs
2.2 s for the stacked ``[layers, B, S, K, E]`` layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
  k: tuple[jax.Array, ...]  # per layer [B, K, S, E]
  v: tuple[jax.Array, ...]  # per layer [B, K, S, E]
  lengths_B: jax.Array  # int32 [B], committed slots per row

  @property
  def size(self) -> int:
    return self.k[0].shape[2]

  @property
  def batch(self) -> int:
    return self.k[0].shape[0]

  @property
  def num_layers(self) -> int:
    return len(self.k)

  def layer(self, i: int) -> tuple[jax.Array, jax.Array]:
    """``(k_BKSE, v_BKSE)`` of layer ``i``."""
    return self.k[i], self.v[i]


def init(num_layers: int, batch: int, size: int, num_kv_heads: int, head_dim: int,
         dtype=jnp.float32) -> KVCache:
  shape = (batch, num_kv_heads, size, head_dim)
  return KVCache(k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                 v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                 lengths_B=jnp.zeros((batch,), jnp.int32))


def write_layer(cache: KVCache, layer: int, k_BTKE: jax.Array, v_BTKE: jax.Array) -> KVCache:
  """Write one layer's new K/V at each row's first uncommitted slot (no commit).

  A scatter with explicit (row, slot) indices, in place on the layer's buffer. Slots past the
  cache's end are dropped (never clamped back onto committed slots).
  """
  B, T = k_BTKE.shape[:2]
  rows_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  slots_BT = cache.lengths_B[:, None] + jnp.arange(T)

  def put(layers, x_BTKE):
    c_BKSE = layers[layer]
    # Advanced indices on axes 0 and 2 (around a slice) address [B, T, K, E] blocks.
    c_BKSE = c_BKSE.at[rows_BT, :, slots_BT].set(x_BTKE.astype(c_BKSE.dtype), mode="drop")
    return layers[:layer] + (c_BKSE,) + layers[layer + 1:]

  return cache.replace(k=put(cache.k, k_BTKE), v=put(cache.v, v_BTKE))


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
  rows_BA = jnp.broadcast_to(jnp.arange(B)[:, None], (B, A))
  src_BA = cache.lengths_B[:, None] + path_BA
  dst_BA = cache.lengths_B[:, None] + jnp.arange(A)

  def move(c_BKSE):
    return c_BKSE.at[rows_BA, :, dst_BA].set(c_BKSE[rows_BA, :, src_BA], mode="drop")

  return cache.replace(k=tuple(move(c) for c in cache.k), v=tuple(move(c) for c in cache.v),
                       lengths_B=cache.lengths_B + num_B.astype(jnp.int32))
