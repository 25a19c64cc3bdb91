"""A sub-batch of a ``SlotBatch``: the rows a step runs on, taken out and put back.

A step's cost grows with its rows: the LLM's matmuls and attention run over every row handed to
them, decoding or not. The engine therefore runs each step on a power-of-two bucket of rows
(the active slots, padded with free ones) rather than on all slots: ``take`` gathers those rows
into a batch of their own (static size b), the step runs on it, ``put`` scatters them back.
Only the gathered rows' cache is read and copied, and only the context bucket the step reads,
so a step with one active request costs about what a batch-1 step costs, plus copying that
row's used cache in and out.

The KV cache's rows are gathered and scattered by ``models/kv_cache.py`` (``take_rows``,
``put_rows``), which knows each backend's layout. Every other leaf of the batch has its row axis
first, except the output's scalar step counter.
"""

from __future__ import annotations

import jax

from redrafter_jax.models import kv_cache as kvc


def _is_row_leaf(x) -> bool:
  return hasattr(x, "ndim") and x.ndim >= 1


def take(batch, idx_b: jax.Array, width: int | None = None):
  """The rows ``idx_b`` (distinct slot numbers) of ``batch``, as a batch of ``len(idx_b)``,
  with the first ``width`` slots of their cache (all when None): a step reading ``width``
  slots moves only those in and out."""
  sub_cache = kvc.take_rows(batch.state.cache, idx_b, width)
  rest = jax.tree.map(lambda x: x[idx_b] if _is_row_leaf(x) else x,
                      batch.replace(state=batch.state.replace(cache=None)))
  return rest.replace(state=rest.state.replace(cache=sub_cache))


def put(batch, idx_b: jax.Array, sub, window: tuple[jax.Array, int] | None = None):
  """``batch`` with rows ``idx_b`` replaced by the rows of ``sub`` (scalars taken from ``sub``;
  a cache of ``width`` slots replaces the first ``width``). ``window``: ``(start_b, size)``,
  the only cache slots ``sub`` changed (a step writes its tree from each row's length on):
  only those are written back (``kv_cache.put_window``)."""
  if window is None:
    new_cache = kvc.put_rows(batch.state.cache, idx_b, sub.state.cache)
  else:
    new_cache = kvc.put_window(batch.state.cache, idx_b, sub.state.cache, *window)
  strip = lambda b: b.replace(state=b.state.replace(cache=None))
  rest = jax.tree.map(lambda full, part: full.at[idx_b].set(part) if _is_row_leaf(full) else part,
                      strip(batch), strip(sub))
  return rest.replace(state=rest.state.replace(cache=new_cache))
