"""A features folder on disk (written by ``features.write_features``): the manifest that ties
each file of LLM states to its data shard's bytes, and the columns of a row a drafter reads.

The reading side only (no JAX): the data pipeline (``data.py``) reads features folders through
it, and the writer (``features.py``) shares its names, so neither imports the other's module
for them.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Sequence

import numpy as np

from redrafter_jax.jsonl import DataError

MANIFEST = "manifest.json"  # the folder's manifest: its settings and one entry per shard


def sha256(path: pathlib.Path) -> str:
  """The SHA-256 of a file's bytes (hex), which ties a features file to its data shard."""
  return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def feature_columns(stored_layers: Sequence[int], wanted_layers: Sequence[int],
                    hidden_size: int, num_layers: int | None = None):
  """The columns of a features row (``[D + k*D]`` for ``stored_layers``) that a drafter reading
  ``wanted_layers`` needs: None for all of them, a slice when they are contiguous (rows stay
  memory-mapped views), else an index array. ``wanted_layers`` must be among the stored, or be
  the model's last layer (``num_layers - 1``, when given), read from the row's first block: its
  tap through the final norm is the last hidden state (``Llama.forward_layers``)."""
  stored, D = list(stored_layers), hidden_size
  if list(wanted_layers) == stored:
    return None
  last = None if num_layers is None else num_layers - 1
  blocks = [0] + [0 if i == last and i not in stored else 1 + stored.index(i)
                  for i in wanted_layers]
  cols = np.concatenate([np.arange(b * D, (b + 1) * D) for b in blocks])
  if np.array_equal(cols, np.arange(cols[0], cols[0] + cols.size)):
    return slice(int(cols[0]), int(cols[0]) + cols.size)
  return cols


def feature_paths(features: str | pathlib.Path, shards: Sequence[pathlib.Path], *, seq_len: int,
                  hidden_size: int | None = None, model_name: str | None = None,
                  feature_layers: tuple[int, ...] = (), num_layers: int | None = None):
  """``(paths, columns)``: the feature file of each data shard in ``shards``, checked against
  the manifest: made for this ``seq_len`` (and hidden size and model, when given), holding these
  ``feature_layers`` (and maybe more; the last of ``num_layers``, when given, is always held),
  and for exactly these shards' bytes; and the columns of those files the layers need
  (``feature_columns``)."""
  folder = pathlib.Path(features)
  path = folder / MANIFEST
  if not path.is_file():
    raise DataError(f"{folder} has no {MANIFEST}: not a folder written by "
                             "`redrafter-jax features`")
  manifest = json.loads(path.read_text())
  s = manifest["settings"]
  want = dict(seq_len=seq_len, **({"hidden_size": hidden_size} if hidden_size else {}),
              **({"model": model_name} if model_name else {}))
  got = {k: s.get(k) for k in want}
  stored = list(s.get("feature_layers", []))
  held = set(stored) | (set() if num_layers is None else {num_layers - 1})
  if got != want or not set(feature_layers) <= held:
    raise DataError(
        f"{folder}: features made with {dict(got, feature_layers=stored)}, but training needs "
        f"{dict(want, feature_layers=list(feature_layers))} (layers: any of the stored ones"
        f"{'' if num_layers is None else f' or the last, {num_layers - 1}'})")
  out = []
  for shard in shards:
    entry = manifest["shards"].get(shard.name)
    if entry is None:
      raise DataError(f"{folder}: no features for data shard {shard.name} (run "
                               f"`redrafter-jax features --data {shard.parent} --out {folder}`)")
    if entry["sha256"] != sha256(shard):
      raise DataError(f"{folder}: features of {shard.name} were made from other data "
                               "(its SHA-256 differs)")
    out.append(folder / entry["file"])
  return out, feature_columns(stored, feature_layers, s["hidden_size"], num_layers)
