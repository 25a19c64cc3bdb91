"""The invariant mode's arithmetic: every row's result independent of the rest of its forward.

``Llama(..., invariant=True)`` routes its projections through ``project_invariant`` and its
attention through ``attend_invariant``. Together they make the logits of a token at position
``p`` a function of that token and its ancestors alone: the same bits whether it is computed
in a prefill of any padded length, in an AR step at any batch size, or as a node of a packed
draft tree of any shape, at any cache size or context bucket. Greedy decoding then gives the
same tokens token for token in every one of those settings, in bfloat16 activations too, with
no tie exception (``Llama``'s docstring states what each mode guarantees).

Why the default mode is not invariant. A dot's kernel, and with it the order in which it sums
its products, is chosen from its shape: on XLA:CPU a matmul with one or two rows takes other
paths than one with three or more (the rows of a single-row and a many-row product differ in
their last bits), and a reduction over a long axis is blocked by its length. In float32 those
differences are below the logits' rounding almost always; in bfloat16 they decide near-ties.

What this module does instead (``bench invariant`` and ``tests/test_invariant.py`` check it):

- projections: on a CPU, a matmul of at least ``MIN_ROWS`` rows gives each row the same bits
  whatever the row count (checked for every SmolLM2 projection shape, 3 to 1024 rows, bfloat16
  and float32), so fewer rows are padded up to ``MIN_ROWS``. Elsewhere (GPU libraries choose
  kernels, split-K included, from the whole shape) the rows go through ``lax.map`` over tiles
  of ``TILE`` rows: every tile is the same matmul.
- attention: scores are one row-and-column-invariant product (at least ``MIN_ROWS`` query
  rows); softmax's max is exact in any order; its sum and the product with the values are
  computed per chunk of ``CHUNK`` slots and folded chunk by chunk in slot order, so slots past
  a token's position (exact zeros) change nothing, whatever the width the forward reads.
- reductions: a sum's order on XLA:CPU depends on the whole array's shape (a row's sum of 64
  or 576 values changes with the number of rows), so the softmax's chunk sums and the RMS
  norm's mean use ``fixed_sum``, a fixed tree of elementwise adds.
- compilation: XLA may keep an elementwise chain's intermediates in float32 where the program
  says bfloat16 ("excess precision"), and whether it does depends on how it fuses the program,
  which depends on the shapes: a prefill and an AR step of the same token then part in the last
  bits a few layers in. The invariant mode's programs are compiled with ``COMPILER_OPTIONS``,
  which makes every bfloat16 operation round as written (``inference.runtime.mode_jit`` and the
  server's programs pass them). They also keep XLA:CPU from handing reductions and their
  elementwise inputs to YNNPACK (only single dots go there): whether it does depends on the
  shapes, and YNNPACK's exp is not XLA's, so the softmax of one AR row at batch 1 differed in
  the last bits from the same row at batch 2 (the 40-prompt run of 2026-11-27 found 7 of 40
  prompts parting that way).
- a tree token sees its keys in VIRTUAL slots (``VirtualKeys``): positions before the row's
  committed length are the cache's slots, positions from it on are the token's ancestors at
  their depth, which is exactly what an AR step at that position reads. Its scores are a
  gather of the shared scores (a score depends only on its query and key), its committed
  chunks' products are shared, and only the chunks from the one holding the committed length
  on are multiplied per token (``tail``: a few chunks).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

MIN_ROWS = 4  # a CPU matmul of >= 3 rows is row-invariant; pad fewer rows up to this
TILE = 16  # rows per matmul off the CPU (lax.map over tiles)
CHUNK = 64  # slots per partial sum in attention
_NEG_INF = -1e30
# XLA options of the invariant mode's programs: every bfloat16 operation rounds as written,
# whatever the fusion (module docstring).
COMPILER_OPTIONS = {"xla_allow_excess_precision": False,
                    "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


def compiler_options(invariant: bool) -> dict | None:
  """The XLA options for a program of a model in that mode (None: XLA's defaults)."""
  return dict(COMPILER_OPTIONS) if invariant else None


def _on_cpu() -> bool:
  return jax.default_backend() == "cpu"


def _dot(x_rI, w, layout: str):
  contract = 1 if layout == "oi" else 0
  return jax.lax.dot_general(x_rI, w, (((1,), (contract,)), ((), ())),
                             preferred_element_type=jnp.float32)


def project_invariant(x_xI: jax.Array, w: jax.Array, dtype, *, layout: str = "oi",
                      cpu: bool | None = None) -> jax.Array:
  """``x @ W^T`` (as ``linear.project``, float32 accumulation) whose every row is the same bits
  whatever the other rows: at least ``MIN_ROWS`` rows in one matmul on a CPU, fixed tiles of
  ``TILE`` rows elsewhere. Float32 inputs with narrower weights keep ``linear.project``'s
  hi/lo split on a CPU (both halves are rows of the same matmul)."""
  *lead, I = x_xI.shape
  x_rI = x_xI.reshape(-1, I)
  r = x_rI.shape[0]
  wider_x = jnp.finfo(x_rI.dtype).nmant > jnp.finfo(w.dtype).nmant
  cpu = _on_cpu() if cpu is None else cpu
  if cpu:
    x_rI = _pad_rows(x_rI, 0, MIN_ROWS)
    if wider_x:
      hi_rI = x_rI.astype(w.dtype)
      lo_rI = (x_rI - hi_rI.astype(x_rI.dtype)).astype(w.dtype)
      y = _dot(jnp.concatenate([hi_rI, lo_rI], axis=0), w, layout)
      y_rO = (y[:x_rI.shape[0]] + y[x_rI.shape[0]:])[:r]
    else:
      y_rO = _dot(x_rI.astype(w.dtype), w, layout)[:r]
  else:
    x_rI, w = (x_rI, w.astype(x_rI.dtype)) if wider_x else (x_rI.astype(w.dtype), w)
    n = -(-r // TILE)
    x_nTI = _pad_rows(x_rI, 0, n * TILE).reshape(n, TILE, I)
    y_rO = jax.lax.map(lambda x_TI: _dot(x_TI, w, layout), x_nTI).reshape(n * TILE, -1)[:r]
  return y_rO.astype(dtype).reshape(*lead, y_rO.shape[-1])


@struct.dataclass
class VirtualKeys:
  """Where each new token's keys sit, in the positions an AR step would read them.

  ``src_BTS[b, t, j]``: the cache slot holding the key at position ``j`` for new token t
  (``j`` itself below the row's committed length ``lengths_B[b]``; from it on, the slot of
  the token's ancestor at depth ``j - length``). ``span``: the most new tokens on one path
  (static), which bounds how far past the committed length a token's keys reach.
  """

  src_BTS: jax.Array
  lengths_B: jax.Array
  span: int = struct.field(pytree_node=False, default=1)


def tree_keys(lengths_B: jax.Array, depth_BN: jax.Array, mask_BNN: jax.Array, width: int
              ) -> tuple[VirtualKeys, jax.Array]:
  """Virtual keys and their mask ``[B, N, width]`` for a packed tree whose tokens sit at slots
  ``lengths + n`` (``mask_BNN``: ancestors and self; ``depth_BN``: depth of each token)."""
  B, N = depth_BN.shape
  # the ancestor of token n at depth d: the token on its path (mask) with that depth
  anc_BND = jnp.argmax(mask_BNN[:, :, None, :]
                       & (depth_BN[:, None, None, :] == jnp.arange(N)[None, None, :, None]),
                       axis=-1).astype(jnp.int32)
  j_S = jnp.arange(width, dtype=jnp.int32)
  rel_BS = j_S[None, :] - lengths_B[:, None]
  rel_BNS = jnp.broadcast_to(rel_BS[:, None, :], (B, N, width))
  anc_BNS = jnp.take_along_axis(anc_BND, jnp.clip(rel_BNS, 0, N - 1), axis=2)
  src_BNS = jnp.where(rel_BNS < 0, j_S[None, None, :],
                      jnp.minimum(lengths_B[:, None, None] + anc_BNS, width - 1))
  mask_BNS = rel_BNS <= depth_BN[:, :, None]
  return VirtualKeys(src_BTS=src_BNS, lengths_B=lengths_B, span=N), mask_BNS


def fixed_sum(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
  """Sum over ``axis`` in one fixed order whatever the other axes' sizes: pad it with zeros to a
  power of two, then add its halves elementwise until one is left (a reduction's order depends
  on the whole shape on XLA:CPU: a row's mean over 576 values changes with the row count)."""
  x = jnp.moveaxis(x, axis, -1)
  n = x.shape[-1]
  x = _pad_rows(x, x.ndim - 1, 1 << max(n - 1, 0).bit_length())
  while x.shape[-1] > 1:
    h = x.shape[-1] // 2
    x = x[..., :h] + x[..., h:]
  x = x[..., 0]
  return jnp.expand_dims(x, axis) if keepdims else x


def _pad_rows(x, axis: int, rows: int):
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, max(rows - x.shape[axis], 0))
  return jnp.pad(x, pad)


def _chunks(x, axis: int):
  """``x`` with its ``axis`` (slots) padded to a multiple of ``CHUNK`` and split into
  ``[..., n, CHUNK, ...]``."""
  S = x.shape[axis]
  n = -(-S // CHUNK)
  x = _pad_rows(x, axis, n * CHUNK)
  return x.reshape(x.shape[:axis] + (n, CHUNK) + x.shape[axis + 1:])


def _fold(parts, axis: int):
  """Sum along ``axis`` one part at a time, in order (a fixed order for every width)."""
  acc = jax.lax.index_in_dim(parts, 0, axis, keepdims=False)
  for i in range(1, parts.shape[axis]):
    acc = acc + jax.lax.index_in_dim(parts, i, axis, keepdims=False)
  return acc


def _products(p_XQS, v_XSE):
  """Per-chunk ``p @ v`` partial sums ``[X, n, Q, E]`` (float32), at least MIN_ROWS rows."""
  Q = p_XQS.shape[1]
  p_XQnc = _chunks(_pad_rows(p_XQS, 1, MIN_ROWS), 2)
  v_XnCE = _chunks(v_XSE, 1)
  out = jnp.einsum("xqnc,xnce->xnqe", p_XQnc, v_XnCE, preferred_element_type=jnp.float32)
  return out[:, :, :Q]


def attend_invariant(q_BTHE, k_XES, v_XSE, mask_BTS, virtual: VirtualKeys | None = None):
  """Masked grouped-query attention on the ``XES`` layout whose every query's output depends
  only on its own keys and values, in position order (module docstring). ``virtual``: where a
  tree's tokens find their keys (None: at their positions, as in a prefill or an AR step)."""
  B, T, H, E = q_BTHE.shape
  X, _, S = k_XES.shape
  K = X // B
  G = H // K
  q_XQE = q_BTHE.reshape(B, T, K, G, E).transpose(2, 0, 3, 1, 4).reshape(X, G * T, E)
  scores_XQS = jnp.einsum("xqe,xes->xqs", _pad_rows(q_XQE, 1, MIN_ROWS), k_XES,
                          preferred_element_type=jnp.float32)[:, :G * T] * (E ** -0.5)
  scores_KBGTS = scores_XQS.reshape(K, B, G, T, S)
  if virtual is not None:
    src_KBGTS = jnp.broadcast_to(virtual.src_BTS[None, :, None], scores_KBGTS.shape)
    scores_KBGTS = jnp.take_along_axis(scores_KBGTS, src_KBGTS, axis=-1)
  scores_KBGTS = jnp.where(mask_BTS[None, :, None], scores_KBGTS, _NEG_INF)
  top_KBGT1 = jnp.max(scores_KBGTS, axis=-1, keepdims=True)
  e_KBGTS = jnp.where(mask_BTS[None, :, None], jnp.exp(scores_KBGTS - top_KBGT1), 0.0)
  total_KBGT1 = _fold(fixed_sum(_chunks(e_KBGTS, 4)), 4)[..., None]
  probs_KBGTS = (e_KBGTS / total_KBGT1).astype(v_XSE.dtype)
  if virtual is None:
    out_XQE = _fold(_products(probs_KBGTS.reshape(X, G * T, S), v_XSE), 1)
    return out_XQE.reshape(K, B, G, T, E).transpose(1, 3, 0, 2, 4).reshape(B, T, H, E).astype(
        q_BTHE.dtype)
  # A tree: chunks wholly below the chunk holding the committed length are the cache's own and
  # shared by every token; from that chunk on, each token reads its own virtual slots.
  start_B = virtual.lengths_B // CHUNK * CHUNK
  j_S = jnp.arange(S)
  shared_KBGTS = jnp.where((j_S[None, :] < start_B[:, None])[None, :, None, None],
                           probs_KBGTS, 0)
  head = _products(shared_KBGTS.reshape(X, G * T, S), v_XSE)  # [X, n, GT, E]
  n_tail = -(-(CHUNK - 1 + virtual.span) // CHUNK)
  W = n_tail * CHUNK
  jw_BW = start_B[:, None] + jnp.arange(W)[None, :]
  inside_BW = jw_BW < S
  jw_BTW = jnp.broadcast_to(jnp.minimum(jw_BW, S - 1)[:, None, :], (B, T, W))
  src_BTW = jnp.take_along_axis(virtual.src_BTS, jw_BTW, axis=2)
  p_KBGTW = jnp.take_along_axis(
      probs_KBGTS, jnp.broadcast_to(jw_BTW[None, :, None], (K, B, G, T, W)), axis=-1)
  p_KBGTW = jnp.where(inside_BW[None, :, None, None, :], p_KBGTW, 0)
  v_KBSE = v_XSE.reshape(K, B, S, E)
  v_KBTWE = jax.vmap(lambda v_BSE: jax.vmap(lambda v_SE, s_TW: v_SE[s_TW])(v_BSE, src_BTW))(
      v_KBSE)
  p_KBTGnc = _pad_rows(p_KBGTW.transpose(0, 1, 3, 2, 4), 3, MIN_ROWS).reshape(
      K, B, T, max(G, MIN_ROWS), n_tail, CHUNK)
  v_KBTnCE = v_KBTWE.reshape(K, B, T, n_tail, CHUNK, E)
  tail = jnp.einsum("kbtgnc,kbtnce->kbtnge", p_KBTGnc, v_KBTnCE,
                    preferred_element_type=jnp.float32)[:, :, :, :, :G]  # [K, B, T, n, G, E]
  head_KBTnGE = head.reshape(K, B, -1, G, T, E).transpose(0, 1, 4, 2, 3, 5)
  out_KBTGE = _fold(jnp.concatenate([head_KBTnGE, tail], axis=3), 3)
  return out_KBTGE.transpose(1, 2, 0, 3, 4).reshape(B, T, H, E).astype(q_BTHE.dtype)
