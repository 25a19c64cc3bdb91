"""The frozen LLM's hidden states for a data folder, computed once and kept on disk.

Every training step needs ``h_t``, the LLM's last hidden state (after the final norm), at every
position of its rows; computing it is a full forward of the LLM, the larger part of a step on a
CPU. ``redrafter-jax features`` runs that forward once per record and writes the result; the
trainer reads it (``train.features``) instead of running the LLM, so a step costs only the
drafter and the loss, and every later epoch, run or ablation on the same data reuses it. The soft
targets need no more than ``h``: they are ``softmax(h @ E_R^T)`` with the LLM's output matrix,
computed in the loss as before.

A record's states are those of its training window (``data.window``: the part of a long record
that a ``seq_len`` row keeps), computed as a sequence of its own from position 0, which is what a
packed row computes for it (segments never attend across each other). Stored float32, they equal
the trainer's own up to float rounding (other matmul shapes); float16 halves the size.

Layout of a features folder (one per data folder, shard for shard)::

  manifest.json       model, seq_len, dtype, hidden size, and per data shard its record and
                      token counts and the data shard's SHA-256 (a features folder never pairs
                      with other data)
  shard-NNNNN.npy     [tokens, D] the states of the shard's records' windows, in record order
                      (uncompressed: the trainer memory-maps it)

With ``feature_layers`` (a multi-layer drafter's ``DrafterConfig.feature_layers``; listed in the
manifest's settings) each row is ``[D + k*D]``: the last hidden state (the soft targets' source),
then the normed states of those layers (``Llama.forward_layers``: what the drafter reads). Such a
folder also serves drafters that read fewer of its layers, down to none (the last hidden state
alone), and the model's last layer, whose tap is the last hidden state itself: training reads only
their columns (``feature_store.feature_columns``), so one folder serves a whole ablation over
layer choices and its baseline.

The command resumes: shards the manifest lists are skipped.
"""

from __future__ import annotations

import functools
import json
import logging
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from redrafter_jax.training import data as data_lib
from redrafter_jax.training.feature_store import MANIFEST, sha256
from redrafter_jax.training.losses import frozen_features, frozen_hidden

log = logging.getLogger(__name__)

DTYPES = ("float32", "float16")


@functools.partial(jax.jit, static_argnames=("graphdef", "layers"))
def _hidden_BTD(graphdef, state, tokens_BT, lengths_B, layers=()):
  T = tokens_BT.shape[1]
  segments_BT = (jnp.arange(T)[None] < lengths_B[:, None]).astype(jnp.int32)
  positions_BT = jnp.broadcast_to(jnp.arange(T)[None], tokens_BT.shape)
  llm = nnx.merge(graphdef, state)
  if not layers:
    return frozen_hidden(llm, tokens_BT, positions_BT, segments_BT)
  return jnp.concatenate(frozen_features(llm, tokens_BT, positions_BT, segments_BT, layers), -1)


def shard_hidden(llm, records, seq_len: int, *, batch_tokens: int = 8192,
                 bucket: int = 64, feature_layers: tuple[int, ...] = ()) -> np.ndarray:
  """``[sum of window lengths, D]`` float32: each record's window's hidden states, in order
  (``[.., D + k*D]`` with ``feature_layers``: see the module docstring).

  Records are grouped by length rounded up to ``bucket`` and run ``batch_tokens // length`` at a
  time (padding at the end of a row, which causal attention never reads), so a shard compiles
  one program per length bucket."""
  graphdef, state = nnx.split(llm)
  windows = [r["tokens"][data_lib.window(r["mask"], seq_len)] for r in records]
  lengths = np.array([w.size for w in windows])
  D = llm.config.hidden_size * (1 + len(feature_layers))
  out = [np.zeros((n, D), np.float32) for n in lengths]
  padded = -(-np.maximum(lengths, 1) // bucket) * bucket
  for T in sorted(set(padded.tolist())):
    members = np.flatnonzero(padded == T)
    rows = max(1, batch_tokens // T)
    for start in range(0, members.size, rows):
      idx = members[start:start + rows]
      tokens_BT = np.zeros((rows, T), np.int32)
      lengths_B = np.zeros((rows,), np.int32)
      for b, i in enumerate(idx):
        tokens_BT[b, :lengths[i]] = windows[i]
        lengths_B[b] = lengths[i]
      hidden_BTD = np.asarray(_hidden_BTD(graphdef, state, jnp.asarray(tokens_BT),
                                          jnp.asarray(lengths_B), tuple(feature_layers)),
                              np.float32)
      for b, i in enumerate(idx):
        out[i] = hidden_BTD[b, :lengths[i]]
  return np.concatenate(out) if out else np.zeros((0, D), np.float32)


def write_features(llm, data: str | pathlib.Path, out: str | pathlib.Path, *, model_name: str,
                   seq_len: int, dtype: str = "float32", batch_tokens: int = 8192,
                   max_shards: int | None = None,
                   feature_layers: tuple[int, ...] = ()) -> dict[str, Any]:
  """Write (or continue) the features folder ``out`` for the data folder ``data``; returns
  ``{"shards": written, "tokens": ..., "seconds": ...}``. ``feature_layers``: also store those
  layers' states (for a multi-layer drafter)."""
  if dtype not in DTYPES:
    raise data_lib.DataError(f"features dtype must be one of {DTYPES}, got {dtype!r}")
  data, out = pathlib.Path(data), pathlib.Path(out)
  paths = data_lib.shard_paths(data)
  settings = dict(model=model_name, seq_len=seq_len, dtype=dtype,
                  hidden_size=llm.config.hidden_size, data=str(data))
  if feature_layers:  # absent for the last hidden state only (older folders stay readable)
    settings["feature_layers"] = list(feature_layers)
  manifest = {"settings": settings, "shards": {}}
  if (out / MANIFEST).is_file():
    manifest = json.loads((out / MANIFEST).read_text())
    old = {k: v for k, v in manifest["settings"].items() if k != "data"}
    new = {k: v for k, v in settings.items() if k != "data"}
    if old != new:
      raise data_lib.DataError(f"{out} holds features made with {old}, not {new}: use another "
                               "--out")
  out.mkdir(parents=True, exist_ok=True)
  written, tokens, start = 0, 0, time.perf_counter()
  for path in paths:
    if path.name in manifest["shards"]:
      continue
    if max_shards is not None and written >= max_shards:
      break
    t0 = time.perf_counter()
    records = data_lib.read_shard(path)
    hidden = shard_hidden(llm, records, seq_len, batch_tokens=batch_tokens,
                          feature_layers=tuple(feature_layers)).astype(dtype)
    name = path.name.replace(data_lib.SHARD_SUFFIX, ".npy")
    tmp = out / (name + ".tmp")
    with open(tmp, "wb") as f:
      np.save(f, hidden)
    tmp.replace(out / name)
    manifest["shards"][path.name] = dict(
        file=name, records=len(records), tokens=int(hidden.shape[0]), sha256=sha256(path),
        seconds=round(time.perf_counter() - t0, 1))
    _write_json(out / MANIFEST, manifest)
    written, tokens = written + 1, tokens + int(hidden.shape[0])
    log.info("%s: %d records, %d tokens", out / name, len(records), hidden.shape[0])
  return {"shards": written, "tokens": tokens, "seconds": time.perf_counter() - start}


def _write_json(path: pathlib.Path, obj) -> None:
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(json.dumps(obj, indent=1) + "\n")
  tmp.replace(path)
