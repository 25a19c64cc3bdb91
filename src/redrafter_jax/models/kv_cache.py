"""Static-shape KV cache with per-row lengths, in the layout its attention backend reads best.

``k``/``v`` are tuples with one array per layer; ``lengths_B`` counts the committed slots of each
row. A forward over T new tokens writes their K/V at slots ``lengths[b] .. lengths[b] + T - 1``
WITHOUT committing them; the caller then either ``advance``s (prefill, AR step) or ``commit``s an
accepted tree path (a gather of at most A slots; the cache is never cloned). Rows never need
padding on the left: each row's prompt starts at slot 0 and positions are per row.
``layer_BKSE`` gives the conventional ``[B, K, S, E]`` view of any layout.

Layouts (``LAYOUTS``; the attention backend picks one, ``attention.LAYOUT``):

  ``XES``   keys ``[X, E, S]``, values ``[X, S, E]``, ``X = K * B`` head-major (``x = k * B + b``):
            the ``xla`` backend's, tuned for XLA:CPU (below).
  ``BSKE``  keys and values ``[B, S, K, E]``: what ``jax.nn.dot_product_attention`` (cuDNN) takes
            as it is, so a GPU step never transposes the cache.
  ``BKSE``  keys and values ``[B, K, S, E]``: each (row, kv head) a contiguous ``[S, E]`` block,
            the tiles the Pallas kernel streams.

Why ``XES`` on XLA:CPU. Attention is two batched matmuls over ``X``, ``q[X, GT, E] @ k[X, E, S]``
and ``p[X, GT, S] @ v[X, S, E]``: each cache array is already the operand XLA wants (one batch
dimension, contracting dimension where the matmul reads it), so the cache is never transposed or
reshaped inside a step. That matters beyond the transpose itself: XLA:CPU duplicates an in-place
update that feeds a reshape, and then copies the whole buffer to keep both copies right: with the
earlier ``[B, K, S, E]`` layout an AR step made such copies of many cache layers, plus a transpose
of every K (``bench profile --mode ar`` shows them; docs/design.md). Head-major ``X`` keeps a
split over kv heads (tensor parallel serving) a split of the leading axis. Each layer's array is
its own buffer so a layer's update is in place, where one stacked ``[layers, ...]`` array is
copied whole (docs/design.md).

Stacked (``stacked=True``): ``k``/``v`` each hold ONE array ``[L, ...]`` (the layout's shape with
a leading layer axis), which is what a model that scans over its layers carries through the scan
(``llama.stack_layers``): layer ``i`` may then be a traced index. Every function below takes
both forms and gives the same values.

Attention cost follows the used length: ``layer(i, width)`` is the first ``width`` slots of a
layer, and a forward whose mask is ``[B, T, width]`` reads only those (``context_bucket`` picks
``width`` from a few powers of two, given the longest row).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from redrafter_jax.errors import UserError

LAYOUTS = ("XES", "BSKE", "BKSE")
_SLOT_AXIS = {"XES": 1, "BSKE": 1, "BKSE": 2}  # the slot axis of the VALUES array
# The axis a split over kv heads (tensor-parallel serving) cuts; XES's leading K * B axis is
# head-major, so cutting it in equal parts cuts whole kv heads.
HEAD_AXIS = {"XES": 0, "BSKE": 2, "BKSE": 1}
BUCKET_MIN = 256  # the smallest context bucket (``context_bucket``)


class CacheError(UserError, ValueError):
  """A cache layout is unknown, or a cache does not fit the forward it is given to."""


def check_layout(layout: str) -> None:
  if layout not in LAYOUTS:
    raise CacheError(f"unknown KV-cache layout {layout!r}; choose one of {LAYOUTS}")


@struct.dataclass
class KVCache:
  k: tuple[jax.Array, ...]  # per layer, in ``layout`` (XES: [X, E, S]; BSKE / BKSE: 4-d)
  v: tuple[jax.Array, ...]  # per layer, in ``layout`` (XES: [X, S, E])
  lengths_B: jax.Array  # int32 [B], committed slots per row
  layout: str = struct.field(pytree_node=False, default="XES")
  stacked: bool = struct.field(pytree_node=False, default=False)  # k/v: one [L, ...] array each

  @property
  def _lead(self) -> int:
    """Axes before the layout's own: 1 (the layer axis) when stacked."""
    return int(self.stacked)

  @property
  def size(self) -> int:
    return self.v[0].shape[self._lead + _SLOT_AXIS[self.layout]]

  @property
  def batch(self) -> int:
    return self.lengths_B.shape[0]

  @property
  def num_kv_heads(self) -> int:
    shape = self.v[0].shape[self._lead:]
    return {"XES": lambda: shape[0] // self.batch, "BSKE": lambda: shape[2],
            "BKSE": lambda: shape[1]}[self.layout]()

  @property
  def num_layers(self) -> int:
    return self.k[0].shape[0] if self.stacked else len(self.k)

  @property
  def head_axis(self) -> int:
    """The axis of a k/v array that a split over kv heads cuts (``HEAD_AXIS``, after the layer
    axis when stacked)."""
    return self._lead + HEAD_AXIS[self.layout]

  def layer(self, i, width: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Layer ``i``'s ``(k, v)`` as attention consumes them: the first ``width`` slots (all when
    None). A slice of the slot axis: its cost follows ``width``, not the cache's size. When
    stacked, ``i`` may be traced (a scan over layers)."""
    if self.stacked:
      k = jax.lax.dynamic_index_in_dim(self.k[0], i, 0, keepdims=False)
      v = jax.lax.dynamic_index_in_dim(self.v[0], i, 0, keepdims=False)
    else:
      k, v = self.k[i], self.v[i]
    if width is None or width == self.size:
      return k, v
    if not 0 < width <= self.size:
      raise CacheError(f"a forward reads {width} slots of a cache of {self.size}")
    k_axis = {"XES": 2, "BSKE": 1, "BKSE": 2}[self.layout]
    v_axis = _SLOT_AXIS[self.layout]
    return (jax.lax.slice_in_dim(k, 0, width, axis=k_axis),
            jax.lax.slice_in_dim(v, 0, width, axis=v_axis))

  def layer_BKSE(self, i: int) -> tuple[jax.Array, jax.Array]:
    """Layer ``i``'s keys and values in the conventional ``[B, K, S, E]`` layout (a copy)."""
    return to_BKSE(*self.layer(i), self.batch, self.layout)


def _each_layer(cache: KVCache, fn, *arrays):
  """``fn(k, v, *rest) -> (k, v)`` applied to every layer: ``arrays`` are k/v tuples (of
  ``cache``, or of a cache of the same form); returns the new ``(k, v)`` tuples. A stacked
  cache maps ``fn`` over its layer axis (one batched op per array, in place as before)."""
  if cache.stacked:
    k, v = jax.vmap(fn)(*(a[0] for a in arrays))
    return (k,), (v,)
  out = [fn(*layer) for layer in zip(*arrays)]
  return tuple(o[0] for o in out), tuple(o[1] for o in out)


def to_BKSE(k, v, batch: int, layout: str) -> tuple[jax.Array, jax.Array]:
  """One layer's keys and values in ``layout`` as ``[B, K, S, E]``."""
  if layout == "XES":
    return as_BKSE(k, v, batch)
  if layout == "BSKE":
    return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  return k, v


def from_BTKE(k_BTKE: jax.Array, v_BTKE: jax.Array, layout: str) -> tuple[jax.Array, jax.Array]:
  """New keys and values ``[B, T, K, E]`` as one layer in ``layout`` with ``S = T`` (attention
  among the T tokens alone, as training runs it)."""
  B, T, K, E = k_BTKE.shape
  if layout == "XES":
    return (k_BTKE.transpose(2, 0, 3, 1).reshape(K * B, E, T),
            v_BTKE.transpose(2, 0, 1, 3).reshape(K * B, T, E))
  if layout == "BSKE":
    return k_BTKE, v_BTKE
  return k_BTKE.transpose(0, 2, 1, 3), v_BTKE.transpose(0, 2, 1, 3)


def as_BKSE(k_XES: jax.Array, v_XSE: jax.Array, batch: int) -> tuple[jax.Array, jax.Array]:
  """Keys and values in the ``XES`` layout (``X = K * B``, head-major) as ``[B, K, S, E]``."""
  X, E, S = k_XES.shape
  k_KBES = k_XES.reshape(X // batch, batch, E, S)
  v_KBSE = v_XSE.reshape(X // batch, batch, S, E)
  return k_KBES.transpose(1, 0, 3, 2), v_KBSE.transpose(1, 0, 2, 3)


def init(num_layers: int, batch: int, size: int, num_kv_heads: int, head_dim: int,
         dtype=jnp.float32, layout: str = "XES", stacked: bool = False) -> KVCache:
  check_layout(layout)
  B, S, K, E = batch, size, num_kv_heads, head_dim
  shape_k, shape_v = {"XES": ((K * B, E, S), (K * B, S, E)), "BSKE": ((B, S, K, E),) * 2,
                      "BKSE": ((B, K, S, E),) * 2}[layout]
  if stacked:
    k = (jnp.zeros((num_layers, *shape_k), dtype),)
    v = (jnp.zeros((num_layers, *shape_v), dtype),)
  else:
    k = tuple(jnp.zeros(shape_k, dtype) for _ in range(num_layers))
    v = tuple(jnp.zeros(shape_v, dtype) for _ in range(num_layers))
  return KVCache(k=k, v=v, lengths_B=jnp.zeros((batch,), jnp.int32), layout=layout,
                 stacked=stacked)


def _heads(B: int, T: int, K: int, rows_B: jax.Array | None = None,
           batch: int | None = None) -> jax.Array:
  """``x_BTK``: the ``X`` index of (row ``rows_B[b]`` of a ``batch``-row cache, kv head k),
  repeated over T (default: rows 0..B-1 of a B-row cache)."""
  rows_B = jnp.arange(B) if rows_B is None else rows_B
  x_BK = jnp.arange(K)[None, :] * (B if batch is None else batch) + rows_B[:, None]
  return jnp.broadcast_to(x_BK[:, None, :], (B, T, K))


def _per_head(x_BT: jax.Array, K: int) -> jax.Array:
  """``x_BTK``: a per-row, per-token index repeated for each of the K kv heads."""
  return jnp.broadcast_to(x_BT[:, :, None], (*x_BT.shape, K))


def _put(cache: KVCache, k_BTKE, v_BTKE, slots_BT, k, v, *, mode="drop", rows_B=None,
         layer=None):
  """``(k, v)`` of one layer with ``[B, T, K, E]`` values set at slots ``slots_BT`` of each row
  (of rows ``rows_B`` of ``cache``; default: rows 0..B-1). With ``layer`` (an index, may be
  traced), ``k``/``v`` are stacked ``[L, ...]`` arrays and layer ``layer`` of them is written.

  Advanced indices address exactly ``[B, T, K, E]`` in every layout: XES indexes axes 0 and 2
  of k around a slice (0 and 1 of v); BSKE axes 0 and 1; BKSE axes 0 and 2 around the heads'
  slice, which NumPy's rules move to the front (a layer index in front changes none of this).
  """
  B, T, K, _ = k_BTKE.shape
  at = (lambda *index: index) if layer is None else (lambda *index: (layer, *index))
  if cache.layout == "XES":
    x_BTK, s_BTK = _heads(B, T, K, rows_B, cache.batch), _per_head(slots_BT, K)
    return (k.at[at(x_BTK, slice(None), s_BTK)].set(k_BTKE.astype(k.dtype), mode=mode),
            v.at[at(x_BTK, s_BTK)].set(v_BTKE.astype(v.dtype), mode=mode))
  b_BT = jnp.broadcast_to((jnp.arange(B) if rows_B is None else rows_B)[:, None], (B, T))
  if cache.layout == "BSKE":
    return (k.at[at(b_BT, slots_BT)].set(k_BTKE.astype(k.dtype), mode=mode),
            v.at[at(b_BT, slots_BT)].set(v_BTKE.astype(v.dtype), mode=mode))
  return (k.at[at(b_BT, slice(None), slots_BT)].set(k_BTKE.astype(k.dtype), mode=mode),
          v.at[at(b_BT, slice(None), slots_BT)].set(v_BTKE.astype(v.dtype), mode=mode))


def _take(cache: KVCache, k, v, slots_BT, K: int):
  """One layer's keys and values at slots ``slots_BT`` of each row, as ``[B, T, K, E]``."""
  B, T = slots_BT.shape
  if cache.layout == "XES":
    x_BTK, s_BTK = _heads(B, T, K), _per_head(slots_BT, K)
    return k[x_BTK, :, s_BTK], v[x_BTK, s_BTK]
  b_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  if cache.layout == "BSKE":
    return k[b_BT, slots_BT], v[b_BT, slots_BT]
  return k[b_BT, :, slots_BT], v[b_BT, :, slots_BT]


def write_layer(cache: KVCache, layer, k_BTKE: jax.Array, v_BTKE: jax.Array) -> KVCache:
  """Write one layer's new K/V at each row's first uncommitted slot (no commit).

  A scatter with explicit (row, slot) indices, in place on the layer's buffers (on the stacked
  array's layer ``layer``, which may be traced, when stacked). Slots past the cache's end are
  dropped (never clamped back onto committed slots).
  """
  T = k_BTKE.shape[1]
  slots_BT = cache.lengths_B[:, None] + jnp.arange(T)[None, :]
  if cache.stacked:
    k, v = _put(cache, k_BTKE, v_BTKE, slots_BT, cache.k[0], cache.v[0], layer=layer)
    return cache.replace(k=(k,), v=(v,))
  k, v = _put(cache, k_BTKE, v_BTKE, slots_BT, cache.k[layer], cache.v[layer])
  put = lambda layers, c: layers[:layer] + (c,) + layers[layer + 1:]
  return cache.replace(k=put(cache.k, k), v=put(cache.v, v))


def visible_mask(lengths_B: jax.Array, mask_BTT: jax.Array, size: int) -> jax.Array:
  """``mask_BTS``: a new token sees every committed slot and the new tokens ``mask_BTT`` allows.

  New token t of row b lives at slot ``lengths[b] + t``. ``size`` may be less than the cache's:
  a forward then reads only the first ``size`` slots (``context_bucket``).
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


def context_buckets(size: int, minimum: int = BUCKET_MIN) -> tuple[int, ...]:
  """The static widths a forward over a ``size``-slot cache may read: powers of two from
  ``minimum`` below ``size``, then ``size`` itself (few widths: few compiled programs)."""
  out, w = [], minimum
  while w < size:
    out.append(w)
    w *= 2
  return tuple(out) + (size,)


def context_bucket(need: int, size: int, minimum: int = BUCKET_MIN) -> int:
  """The smallest bucket of ``context_buckets(size)`` holding ``need`` slots (host side):
  ``need`` is the longest row's committed length plus the slots the next forwards write."""
  if need > size:
    raise CacheError(f"{need} slots needed, but the cache has {size}")
  return next(w for w in context_buckets(size, minimum) if w >= need)


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
  A = path_BA.shape[1]
  K = cache.num_kv_heads
  src_BA = cache.lengths_B[:, None] + path_BA
  dst_BA = cache.lengths_B[:, None] + jnp.arange(A)[None, :]

  def move(k, v):
    k_BAKE, v_BAKE = _take(cache, k, v, src_BA, K)
    return _put(cache, k_BAKE, v_BAKE, dst_BA, k, v)

  k, v = _each_layer(cache, move, cache.k, cache.v)
  return cache.replace(k=k, v=v, lengths_B=cache.lengths_B + num_B.astype(jnp.int32))


def _row_index(cache: KVCache, idx_b: jax.Array) -> jax.Array:
  """Leading-axis indices of rows ``idx_b`` in a cache array (XES: ``k * B + b``)."""
  if cache.layout != "XES":
    return idx_b
  K, B = cache.num_kv_heads, cache.batch
  return (jnp.arange(K)[:, None] * B + idx_b[None, :]).reshape(-1)


def _slot_index(cache: KVCache, at: jax.Array, width: int, *, keys: bool) -> tuple:
  """Index of leading-axis rows ``at`` and the first ``width`` slots of a k (or v) array (of
  every layer, when stacked)."""
  axis = {"XES": 2, "BSKE": 1, "BKSE": 2}[cache.layout] if keys else _SLOT_AXIS[cache.layout]
  index = [slice(None)] * (3 if cache.layout == "XES" else 4)
  index[0], index[axis] = at, slice(0, width)
  return (slice(None),) * cache._lead + tuple(index)


def take_rows(cache: KVCache, idx_b: jax.Array, width: int | None = None) -> KVCache:
  """Rows ``idx_b`` (distinct) of ``cache`` as a cache of ``len(idx_b)`` rows and their first
  ``width`` slots (all when None), same layout: a step that reads only ``width`` slots moves
  only those."""
  at = _row_index(cache, idx_b)
  width = cache.size if width is None else width
  if not 0 < width <= cache.size:
    raise CacheError(f"take_rows: {width} slots of a cache of {cache.size}")
  return cache.replace(k=tuple(k[_slot_index(cache, at, width, keys=True)] for k in cache.k),
                       v=tuple(v[_slot_index(cache, at, width, keys=False)] for v in cache.v),
                       lengths_B=cache.lengths_B[idx_b])


def _form(cache: KVCache) -> str:
  return f"layout {cache.layout!r}" + (", stacked" if cache.stacked else "")


def _same_form(a: KVCache, b: KVCache) -> bool:
  return a.layout == b.layout and a.stacked == b.stacked


def put_rows(cache: KVCache, idx_b: jax.Array, rows: KVCache) -> KVCache:
  """``cache`` with the first T slots of rows ``idx_b`` replaced by ``rows`` (``b`` rows of
  ``T <= size`` slots: ``take_rows``' inverse, or a prefill), lengths included; an index
  ``>= batch`` writes nothing (a padding row of a bucketed admission). One scatter per array,
  on the array as it is (no reshape), so a donated buffer is updated in place (XLA:CPU copies a
  whole buffer whose in-place update feeds a reshape)."""
  b, T = rows.batch, rows.size
  if not _same_form(rows, cache) or idx_b.shape != (b,) or T > cache.size:
    raise CacheError(f"put_rows: needs rows of {_form(cache)} and at most "
                     f"{cache.size} slots, one index per row; got {_form(rows)}, "
                     f"{T} slots, indices {idx_b.shape}")
  B, K = cache.batch, cache.num_kv_heads
  dropped = idx_b >= B
  at = _row_index(cache, jnp.where(dropped, 0, idx_b))
  xes = cache.layout == "XES"
  at = jnp.where(jnp.tile(dropped, K) if xes else dropped, K * B if xes else B, at)
  put = lambda full, part, keys: full.at[_slot_index(cache, at, T, keys=keys)].set(
      part.astype(full.dtype), mode="drop")
  return cache.replace(k=tuple(put(f, r, True) for f, r in zip(cache.k, rows.k)),
                       v=tuple(put(f, r, False) for f, r in zip(cache.v, rows.v)),
                       lengths_B=cache.lengths_B.at[idx_b].set(rows.lengths_B, mode="drop"))


def put_window(cache: KVCache, idx_b: jax.Array, rows: KVCache, start_b: jax.Array,
               size: int) -> KVCache:
  """``cache`` with slots ``[start_b, start_b + size)`` of rows ``idx_b`` (distinct, valid)
  replaced by the same slots of ``rows`` (a cache of ``len(idx_b)`` rows, e.g. ``take_rows``'
  result after a step), lengths included.

  A step writes only its tree's slots from each row's committed length on (``write_layer``,
  then ``commit`` within them), so putting those back is enough: ``size`` slots per row and
  layer instead of the whole context ``put_rows`` writes. Slots past ``rows``' width are not
  written."""
  b = rows.batch
  if not _same_form(rows, cache) or idx_b.shape != (b,) or start_b.shape != (b,):
    raise CacheError(f"put_window: needs rows of {_form(cache)}, one index and one "
                     f"start per row; got {_form(rows)}, indices {idx_b.shape}, "
                     f"starts {start_b.shape}")
  K = cache.num_kv_heads
  slots_bT = start_b[:, None] + jnp.arange(size)[None, :]

  def put(full_k, full_v, part_k, part_v):
    k_bTKE, v_bTKE = _take(rows, part_k, part_v, jnp.minimum(slots_bT, rows.size - 1), K)
    # a slot ``rows`` does not hold is not written (past the cache's end: dropped)
    to_bT = jnp.where(slots_bT < rows.size, slots_bT, cache.size)
    return _put(cache, k_bTKE, v_bTKE, to_bT, full_k, full_v, rows_B=idx_b)

  k, v = _each_layer(cache, put, cache.k, cache.v, rows.k, rows.v)
  return cache.replace(k=k, v=v, lengths_B=cache.lengths_B.at[idx_b].set(rows.lengths_B))
