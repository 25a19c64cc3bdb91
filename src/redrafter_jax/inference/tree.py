"""Dynamic tree attention: de-duplicate beam prefixes and pack them into a static token budget.

``dedup_prefix(beams_BWL)[b, i, j] = k``: the smallest beam index whose first j+1 tokens equal
beam i's. Position (i, j) is a *unique node* when ``k == i``; otherwise it duplicates node
(k, j). All beams share g0, so column 0 collapses into one root.

Unique nodes are packed into N static slots, best first: by the drafter's log-probability of the
node's whole prefix (when given; ties and the no-score case go breadth-first: by depth, then beam
index). A prefix's score never exceeds its ancestors' (log-probs are <= 0), so a node's ancestors
always precede it: a budget cut keeps every kept node's whole path, and it keeps the nodes most
likely to be accepted (for the same budget, a deep node of the best beam beats a shallow node of
the worst). Padding slots are masked out. Children of one node keep a fixed order (the exact
sampler tries siblings in slot order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


def dedup_prefix(beams_BWL: jax.Array) -> jax.Array:
  """``prefix_BWL``: for each beam and depth, the first beam sharing that whole prefix."""
  eq_BWWL = beams_BWL[:, :, None, :] == beams_BWL[:, None, :, :]
  same_prefix_BWWL = jnp.cumprod(eq_BWWL.astype(jnp.int32), axis=-1).astype(bool)
  return jnp.argmax(same_prefix_BWWL, axis=2).astype(jnp.int32)


@struct.dataclass
class Tree:
  """A packed draft tree for each row.

  ``node_BWL[b, i, j]`` is the packed slot holding beam i's token at depth j (N if cut by the
  budget). Packed slot n holds ``tokens_BN[b, n]`` at ``depth_BN[b, n]`` with parent slot
  ``parent_BN`` (-1 for the root and padding); ``valid_BN`` marks real nodes and ``mask_BNN`` is
  the attention mask among new tokens (ancestors and self).
  """

  tokens_BN: jax.Array
  depth_BN: jax.Array
  parent_BN: jax.Array
  valid_BN: jax.Array
  mask_BNN: jax.Array
  node_BWL: jax.Array
  beam_len_BW: jax.Array  # leading columns of each beam that fit in the budget (>= 1)
  num_unique_B: jax.Array  # unique nodes before the budget cut (dedup statistics)

  @property
  def size(self) -> int:
    return self.tokens_BN.shape[1]


def pack(beams_BWL: jax.Array, budget: int, prefix_logp_BWL: jax.Array | None = None) -> Tree:
  """Build the packed tree of ``budget`` = N slots from the beams of each row.

  ``prefix_logp_BWL[b, i, j]`` (optional) is the drafter's log-probability of beam i's first j+1
  tokens (0 at the root); it decides which nodes a budget keeps. A negative token ends its beam
  there: it and the positions after it are no nodes (a beam shorter than L, such as a step-1
  alternative), as if the budget had cut them.
  """
  B, W, L = beams_BWL.shape
  N = budget
  prefix_BWL = dedup_prefix(beams_BWL)
  beam_W = jnp.arange(W)
  depth_L = jnp.arange(L)
  present_BWL = jnp.cumprod(beams_BWL >= 0, axis=2).astype(bool)
  unique_BWL = (prefix_BWL == beam_W[None, :, None]) & present_BWL
  # Best first; a stable sort over the (depth, beam)-flattened order breaks ties breadth-first.
  score_BWL = (jnp.zeros((B, W, L), jnp.float32) if prefix_logp_BWL is None
               else prefix_logp_BWL.astype(jnp.float32))
  key_BY = jnp.where(unique_BWL, -score_BWL, jnp.inf).transpose(0, 2, 1).reshape(B, L * W)
  order_BY = jnp.argsort(key_BY, axis=1, stable=True)
  slot_of_BY = jnp.argsort(order_BY, axis=1).astype(jnp.int32)  # inverse permutation
  num_unique_B = unique_BWL.sum(axis=(1, 2)).astype(jnp.int32)
  unique_BY = unique_BWL.transpose(0, 2, 1).reshape(B, L * W)
  kept_BY = unique_BY & (slot_of_BY < N)
  # Slot of every (beam, depth): the slot of its canonical node, or N when cut.
  canon_slot_BLW = jnp.where(kept_BY, slot_of_BY, N).reshape(B, L, W)
  node_BWL = jnp.take_along_axis(canon_slot_BLW, prefix_BWL.transpose(0, 2, 1), axis=2
                                 ).transpose(0, 2, 1)
  beam_len_BW = jnp.cumprod(node_BWL < N, axis=2).sum(axis=2).astype(jnp.int32)

  # Per slot: which (depth, beam) it holds.
  take = order_BY[:, :N]
  depth_BN = (take // W).astype(jnp.int32)
  beam_BN = (take % W).astype(jnp.int32)
  valid_BN = jnp.arange(N)[None, :] < jnp.minimum(num_unique_B, N)[:, None]
  rows = jnp.arange(B)[:, None]
  tokens_BN = jnp.where(valid_BN, beams_BWL[rows, beam_BN, depth_BN], 0)
  # Ancestors of slot n: the nodes of its beam at depths <= its depth.
  path_BNL = node_BWL[rows, beam_BN]  # [B, N, L]
  on_path_BNL = (depth_L[None, None, :] <= depth_BN[:, :, None]) & valid_BN[:, :, None]
  slot_N = jnp.arange(N)
  mask_BNN = ((path_BNL[:, :, :, None] == slot_N[None, None, None, :])
              & on_path_BNL[:, :, :, None]).any(axis=2)
  mask_BNN = mask_BNN | (~valid_BN[:, :, None] & (slot_N[None, None, :] == slot_N[None, :, None]))
  parent_BN = jnp.where(valid_BN & (depth_BN > 0),
                        jnp.take_along_axis(path_BNL, jnp.maximum(depth_BN - 1, 0)[:, :, None],
                                            axis=2)[:, :, 0], -1)
  depth_BN = jnp.where(valid_BN, depth_BN, 0)
  return Tree(tokens_BN=tokens_BN.astype(jnp.int32), depth_BN=depth_BN, parent_BN=parent_BN,
              valid_BN=valid_BN, mask_BNN=mask_BNN, node_BWL=node_BWL, beam_len_BW=beam_len_BW,
              num_unique_B=num_unique_B)


def unpack(tree: Tree, values_BNx: jax.Array, fill=0) -> jax.Array:
  """Per-slot values back to ``[B, W, L, ...]`` beam layout (``fill`` where cut by the budget)."""
  B, W, L = tree.node_BWL.shape
  idx_BWL = jnp.minimum(tree.node_BWL, tree.size - 1)
  rows = jnp.arange(B)[:, None, None]
  out = values_BNx[rows, idx_BWL]
  cut = (tree.node_BWL >= tree.size).reshape((B, W, L) + (1,) * (values_BNx.ndim - 2))
  return jnp.where(cut, fill, out)
