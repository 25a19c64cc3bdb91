"""Attention over the committed context: what the drafter reads of its context beyond one vector.

The reference drafter sees its context only through the LLM's hidden state at the last committed
token. With ``DrafterConfig.context_attention`` A > 0 it also keeps a memory of every committed
position j: a key from ``[h_j, E(tok_j)]`` and a value from ``[h_j, E(tok_{j+1})]`` (``h``: its
context vector, ``E``: the LLM's input embedding; the value carries the token that followed j,
so a query that finds a position like the present one reads what came next there, as an
induction head does). At each draft step a query from ``[h, s]`` (s: the drafter's state after
reading the beam's newest token) attends over the memory in H heads of width A / H, and the
result, projected to the head's width, is added to the head's input (``Drafter.logits``).

The memory is the same in training and decoding: training builds it over every position of a
packed row, and a query at position t sees the positions j <= t of its own sequence
(``causal_visible``); decoding builds it at prefill over the prompt and appends each step's
committed positions, and a query sees the positions below the cache length. Positions after t
(the beam's own drafted tokens) are never in the memory, so verification, and with it exactness,
is unchanged.

Static shapes: the memory has the LLM cache's size; ``visible`` masks what is not committed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

NEG_INF = -1e30


@struct.dataclass
class ContextMemory:
  """Keys and values at each position of the context, and which positions a query may read."""

  keys_LSA: jax.Array
  values_LSA: jax.Array
  # bool, broadcastable to [L, M, S] for queries [L, M, A]: [L, 1, S] in decoding (every beam of
  # a row sees the same committed positions), [L, M, S] in training (causal per position).
  visible_LMS: jax.Array


def attend(query_LMA: jax.Array, memory: ContextMemory, heads: int) -> jax.Array:
  """Softmax attention of each query over the visible memory, in ``heads`` heads.

  Args:
    query_LMA: queries, ``M`` per leading row ``L`` (float).
    memory: ``ContextMemory`` with ``[L, S, A]`` keys and values (or ``[1, S, A]``: one memory
      that every row's queries read, each through its own ``visible`` row).
    heads: H; A is split into H heads of A / H.

  Returns:
    ``[L, M, A]`` float32: each head's weighted values, concatenated; zero for a query that sees
    no position.
  """
  L, M, A = query_LMA.shape
  Lk, S, _ = memory.keys_LSA.shape
  d = A // heads
  q_LMHd = query_LMA.astype(jnp.float32).reshape(L, M, heads, d)
  k_LSHd = memory.keys_LSA.astype(jnp.float32).reshape(Lk, S, heads, d)
  v_LSHd = memory.values_LSA.astype(jnp.float32).reshape(Lk, S, heads, d)
  shared = Lk == 1 and L > 1
  if shared:  # one memory for every row: no copy of it per row
    k_LSHd, v_LSHd = k_LSHd[0], v_LSHd[0]
  spec = "lmhd,shd->lhms" if shared else "lmhd,lshd->lhms"
  score_LHMS = jnp.einsum(spec, q_LMHd, k_LSHd) / jnp.sqrt(jnp.float32(d))
  visible_L1MS = jnp.broadcast_to(memory.visible_LMS, (L, M, S))[:, None]
  score_LHMS = jnp.where(visible_L1MS, score_LHMS, NEG_INF)
  weight_LHMS = jax.nn.softmax(score_LHMS, axis=-1) * visible_L1MS
  spec = "lhms,shd->lmhd" if shared else "lhms,lshd->lmhd"
  out_LMHd = jnp.einsum(spec, weight_LHMS, v_LSHd)
  return out_LMHd.reshape(L, M, A)


def causal_visible(query_pos_LM: jax.Array, segment_LS: jax.Array,
                   query_segment_LM: jax.Array) -> jax.Array:
  """``[L, M, S]``: the positions j <= the query's position in the query's (packed) sequence;
  segment 0 (padding) sees nothing."""
  S = segment_LS.shape[1]
  pos_11S = jnp.arange(S)[None, None, :]
  return ((pos_11S <= query_pos_LM[..., None])
          & (segment_LS[:, None, :] == query_segment_LM[..., None])
          & (query_segment_LM[..., None] > 0))


def committed_visible(length_L: jax.Array, size: int) -> jax.Array:
  """``[L, 1, S]``: the committed positions (below each row's cache length)."""
  return (jnp.arange(size)[None, None, :] < length_L[:, None, None])


@struct.dataclass
class MemoryCache:
  """Decoding's memory: keys and values at each of the cache's S positions (those below a row's
  cache length are committed; the others are scratch that a commit writes before they show)."""

  keys_BSA: jax.Array
  values_BSA: jax.Array

  @classmethod
  def zeros(cls, batch: int, size: int, width: int, dtype) -> "MemoryCache":
    z = jnp.zeros((batch, size, width), dtype)
    return cls(z, z)

  def write(self, start_B: jax.Array, keys_BNA: jax.Array, values_BNA: jax.Array,
            count_B: jax.Array) -> "MemoryCache":
    """Entries ``i < count`` of each row at positions ``start + i`` (past S: dropped)."""
    B, S, _ = self.keys_BSA.shape
    N = keys_BNA.shape[1]
    idx_BN = start_B[:, None] + jnp.arange(N)[None]
    idx_BN = jnp.where(jnp.arange(N)[None] < count_B[:, None], idx_BN, S)
    rows_B1 = jnp.arange(B)[:, None]
    put = lambda buf, new: buf.at[rows_B1, idx_BN].set(new.astype(buf.dtype), mode="drop")
    return MemoryCache(put(self.keys_BSA, keys_BNA), put(self.values_BSA, values_BNA))

  def read(self, length_B: jax.Array) -> ContextMemory:
    """What a draft step reads: the positions below each row's cache length."""
    return ContextMemory(self.keys_BSA, self.values_BSA,
                         committed_visible(length_B, self.keys_BSA.shape[1]))
