"""Distillation data: the on-disk shard format and the grain input pipeline for training.

On disk (written by ``redrafter-jax distill-data``, see ``training/distill.py``) a data folder holds
``manifest.json`` and shards ``shard-NNNNN.npz``. A shard is a compressed NumPy archive of its
records, stored compactly so teacher data can be committed and built on in a later session:

  ``tokens``   uint16 (int32 for vocabularies over 65,536) [total]  every record's ids, one after
               the other (a prompt, then the frozen LLM's response)
  ``offsets``  int64 [n + 1]                     record i is ``tokens[offsets[i]:offsets[i + 1]]``
  ``mask``     uint8 [ceil(total / 8)]           ``np.packbits`` of the per-token mask: 1 on
               response tokens (the only training targets)
  ``ids``      str [n], ``sampled`` bool [n]     the prompt's id; answered by sampling (else greedy)

A record in memory is ``{"id": str, "sampled": bool, "tokens": int32 [n], "mask": uint8 [n]}``.

In training the pipeline turns records into fixed-shape batches of local rows:

  ``tokens``      int32 [B, T]  token ids (0 on padding)
  ``loss_mask``   int32 [B, T]  1 where the token is a response token (may be a target)
  ``segment_ids`` int32 [B, T]  which packed sequence a token belongs to, 0 on padding
  ``positions``   int32 [B, T]  RoPE position within its own sequence

A record longer than ``seq_len`` keeps a window of it (``_window``: the response, or at least
half a row of it, after the end of the prompt). Order is fixed by the seed: shuffle records
(reshuffled every epoch), optionally pack several sequences into one row (grain's first-fit
packing) or pad each to ``seq_len``, batch to the GLOBAL batch, and keep this process's rows.
Every process therefore walks the same global sequence of batches, so a run's batches do not
depend on how many processes or devices share them, and the iterator state (grain's, saved in
checkpoints) is the same on every process.

The trainer's held-out set is not drawn that way: ``held_out_batches`` packs every greedy answer
of the held-out shards, in a fixed order, into the same batches whatever the seed.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Iterator, Mapping, Sequence

import grain
import numpy as np

# Raised here for data folders, shards and records too; importable from here as before.
from redrafter_jax.jsonl import DataError
from redrafter_jax.training.feature_store import feature_paths

MANIFEST = "manifest.json"
SHARD_SUFFIX = ".npz"
FIELDS = ("tokens", "loss_mask", "segment_ids", "positions")


def make_record(tokens: Sequence[int], mask: Sequence[int], *, id: str = "",
                sampled: bool = False) -> dict[str, Any]:
  """A record (see the module docstring), checked: 1-D tokens and mask of one length."""
  tokens = np.asarray(tokens, np.int32)
  mask = np.asarray(mask, np.uint8)
  if tokens.ndim != 1 or tokens.shape != mask.shape:
    raise DataError(f"record {id!r}: tokens {tokens.shape} and mask {mask.shape} must be equal 1-D")
  if tokens.size and int(tokens.min()) < 0:
    raise DataError(f"record {id!r}: negative token id {int(tokens.min())}")
  return {"id": str(id), "sampled": bool(sampled), "tokens": tokens, "mask": mask}


def write_shard(path: pathlib.Path, records: Sequence[Mapping[str, Any]]) -> None:
  """Write records (``make_record``) as one compressed shard at ``path`` (a file object's name
  is kept as given; the caller renames it into place)."""
  if not records:
    raise DataError(f"{path}: a shard needs at least one record")
  tokens = np.concatenate([np.asarray(r["tokens"], np.int32) for r in records])
  mask = np.concatenate([np.asarray(r["mask"], np.uint8) for r in records])
  if tokens.shape != mask.shape:
    raise DataError(f"{path}: tokens and masks differ in length")
  wide = tokens.size and int(tokens.max()) > np.iinfo(np.uint16).max
  offsets = np.cumsum([0] + [len(r["tokens"]) for r in records], dtype=np.int64)
  with open(path, "wb") as f:
    np.savez_compressed(
        f, tokens=tokens if wide else tokens.astype(np.uint16), offsets=offsets,
        mask=np.packbits(mask > 0), ids=np.array([str(r["id"]) for r in records]),
        sampled=np.array([bool(r["sampled"]) for r in records]))


def read_shard(path: str | pathlib.Path) -> list[dict[str, Any]]:
  """The records of one shard, in order."""
  try:
    with np.load(path, allow_pickle=False) as z:
      tokens, offsets, ids, sampled = z["tokens"], z["offsets"], z["ids"], z["sampled"]
      mask = np.unpackbits(z["mask"], count=tokens.size)
  except (OSError, ValueError, KeyError) as e:
    raise DataError(f"{path}: not a readable data shard ({e})") from e
  return [{"id": str(ids[i]), "sampled": bool(sampled[i]),
           "tokens": tokens[offsets[i]:offsets[i + 1]].astype(np.int32),
           "mask": mask[offsets[i]:offsets[i + 1]]} for i in range(len(ids))]


class ShardSource:
  """Random access to the records of several shards (grain's ``RandomAccessDataSource``
  protocol). Shards are small and compressed: all are read into memory at once. With
  ``feature_paths`` (one ``features.py`` file per shard, memory-mapped) each record also holds
  ``hidden``, the LLM's states over its ``seq_len`` window (``hidden_columns``: only these of
  each file's columns, per file: ``feature_store.feature_columns``)."""

  def __init__(self, paths: Sequence[str | pathlib.Path],
               feature_paths: Sequence[str | pathlib.Path] | None = None, seq_len: int = 0,
               hidden_columns: Sequence | None = None):
    self._records, self._columns = [], []
    for i, path in enumerate(paths):
      records = read_shard(path)
      if feature_paths is not None:
        hidden = np.load(feature_paths[i], mmap_mode="r")
        sizes = window_lengths(records, seq_len)
        if hidden.ndim != 2 or hidden.shape[0] != sum(sizes):
          raise DataError(f"{feature_paths[i]}: {hidden.shape[0]} rows of states, but the "
                          f"windows of {path} hold {sum(sizes)} tokens at seq_len={seq_len}")
        ends = np.cumsum(sizes)
        for r, end, size in zip(records, ends, sizes):
          r["hidden"] = hidden[end - size:end]
      cols = None if hidden_columns is None else hidden_columns[i]
      self._records += records
      self._columns += [cols] * len(records)

  def __len__(self) -> int:
    return len(self._records)

  def __getitem__(self, index: int) -> dict[str, Any]:
    r, cols = self._records[index], self._columns[index]
    # columns are taken as a record is read: the memory-mapped states stay on disk until then
    return r if cols is None else {**r, "hidden": r["hidden"][:, cols]}


def read_manifest(folder: str | pathlib.Path) -> dict[str, Any]:
  folder = pathlib.Path(folder)
  if not folder.is_dir():
    raise DataError(f"data folder not found: {folder} (write one with `redrafter-jax "
                    "distill-data --out DIR`)")
  path = folder / MANIFEST
  if not path.is_file():
    raise DataError(f"{folder} has no {MANIFEST}: not a folder written by distill-data")
  try:
    return json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise DataError(f"{path}: invalid JSON ({e})") from e


def folders(data: str | pathlib.Path | Sequence[str | pathlib.Path]) -> list[pathlib.Path]:
  """``train.data`` as a list of folders: one folder, or several whose shards are read as one."""
  items = [data] if isinstance(data, (str, pathlib.Path)) else list(data)
  if not items:
    raise DataError("no data folder given")
  return [pathlib.Path(f) for f in items]


def data_vocab_size(data) -> int | None:
  """The vocabulary size the data was made with (every folder must agree); reads the manifests,
  so a missing or malformed folder fails here."""
  sizes = {f: read_manifest(f).get("settings", {}).get("vocab_size") for f in folders(data)}
  known = {v for v in sizes.values() if v is not None}
  if len(known) > 1:
    raise DataError(f"data folders were made by models with different vocab_size: {sizes}")
  return known.pop() if known else None


def shard_paths(data: str | pathlib.Path | Sequence[str | pathlib.Path], *, holdout: int = 0,
                part: str = "train", first: int = 0) -> list[pathlib.Path]:
  """The completed shards listed in the manifest(s), in order; every one must exist.

  ``data`` is one folder or several (their shards are concatenated in the order given).
  ``first`` N > 0 takes only the first N shards of EACH folder (a folder that keeps growing then
  still means the same data: a run, a stage or an ablation stays reproducible). ``holdout``
  K > 0 sets the last K of those aside for evaluation: ``part="train"`` returns the others,
  ``part="eval"`` those (distill-data shuffles prompts across shards, so they are a uniform
  sample of each folder's prompts)."""
  if part not in ("train", "eval"):
    raise ValueError(f"part must be 'train' or 'eval', got {part!r}")
  return [p for folder in folders(data) for p in _folder_shards(folder, holdout, part, first)]


def _folder_shards(folder: pathlib.Path, holdout: int, part: str,
                   first: int = 0) -> list[pathlib.Path]:
  manifest = read_manifest(folder)
  names = sorted(manifest.get("shards", {}))
  if not names:
    raise DataError(f"{folder}: the manifest lists no completed shards")
  if first:
    if first > len(names):
      raise DataError(f"{folder}: asked for its first {first} shards, but only {len(names)} "
                      "are complete")
    names = names[:first]
  if holdout:
    if not 0 < holdout < len(names):
      raise DataError(f"{folder}: cannot hold out {holdout} of its {len(names)} completed "
                      "shard(s) for evaluation (at least one must remain for training)")
    names = names[:-holdout] if part == "train" else names[-holdout:]
  elif part == "eval":
    raise DataError(f"{folder}: no shards are held out for evaluation (holdout=0)")
  paths = [folder / name for name in names]
  missing = [p.name for p in paths if not p.is_file()]
  if missing:
    raise DataError(f"{folder}: shard file(s) listed in the manifest are missing: {missing[:4]}")
  return paths


def read_records(folder, **split) -> list[dict[str, Any]]:
  """Every record of a data folder or folders (or of its ``split``, see ``shard_paths``),
  decoded, in shard order (for tests and inspection)."""
  return [rec for p in shard_paths(folder, **split) for rec in read_shard(p)]


def token_counts(folder, vocab_size: int, **split) -> np.ndarray:
  """How often each token id occurs as a response token (``[vocab_size]`` int64)."""
  counts = np.zeros((vocab_size,), np.int64)
  for rec in read_records(folder, **split):
    ids = rec["tokens"][rec["mask"] > 0]
    np.add.at(counts, ids[ids < vocab_size], 1)
  return counts


def window_lengths(records: Sequence[Mapping[str, Any]], seq_len: int) -> np.ndarray:
  """How many tokens of each record a ``seq_len`` row keeps (``window``)."""
  return np.array([len(range(*window(r["mask"], seq_len).indices(r["mask"].size)))
                   for r in records], np.int64)


def window(mask: np.ndarray, seq_len: int) -> slice:
  """Which ``seq_len`` tokens of a longer record to keep: the whole response if the row has room,
  at least half a row of it otherwise, and the END of the prompt before it (the part the first
  response tokens depend on most)."""
  n = mask.size
  if n <= seq_len:
    return slice(0, n)
  n_prompt = int(np.argmax(mask > 0)) if mask.any() else n
  keep_response = min(n - n_prompt, max(seq_len - n_prompt, seq_len // 2))
  keep_prompt = min(n_prompt, seq_len - keep_response)
  return slice(n_prompt - keep_prompt, n_prompt + keep_response)


def _truncate(rec: Mapping[str, Any], seq_len: int, vocab_size: int | None) -> dict[str, Any]:
  keep = window(rec["mask"], seq_len)
  tokens = rec["tokens"][keep]
  if vocab_size is not None and tokens.size and int(tokens.max()) >= vocab_size:
    raise DataError(f"record {rec['id']!r} has token id {int(tokens.max())} >= the LLM's "
                    f"vocab_size {vocab_size}: the data was made with another model")
  out = {"tokens": tokens, "loss_mask": rec["mask"][keep].astype(np.int32)}
  if "hidden" in rec:  # already the window's states (features.py)
    out["hidden"] = np.asarray(rec["hidden"])
  return out


def _pad(rec: Mapping[str, np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
  n = rec["tokens"].size
  out = {}
  for name in ("tokens", "loss_mask", "hidden"):
    if name not in rec:
      continue
    row = np.zeros((seq_len,) + rec[name].shape[1:], rec[name].dtype)
    row[:n] = rec[name]
    out[name] = row
  out["segment_ids"] = (np.arange(seq_len) < n).astype(np.int32)
  out["positions"] = np.arange(seq_len, dtype=np.int32)
  return out


def _from_packed(rec: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  out = {"tokens": rec["tokens"], "loss_mask": rec["loss_mask"],
         "segment_ids": rec["tokens_segment_ids"], "positions": rec["tokens_positions"]}
  if "hidden" in rec:
    out["hidden"] = rec["hidden"]
  return out


def _rows(batch: Mapping[str, np.ndarray], start: int, stop: int) -> dict[str, np.ndarray]:
  return {name: np.ascontiguousarray(batch[name][start:stop]) for name in FIELDS + ("hidden",)
          if name in batch}


def _check_rows(rows: tuple[int, int] | None, global_batch: int) -> tuple[int, int]:
  start, stop = rows if rows is not None else (0, global_batch)
  if not 0 <= start < stop <= global_batch:
    raise DataError(f"rows {rows} are not a slice of the global batch of {global_batch}")
  return start, stop


def _source(folder, *, seq_len: int, holdout: int, part: str, first: int, features,
            hidden_size: int | None, feature_layers: tuple[int, ...],
            num_layers: int | None) -> ShardSource:
  """The records of ``folder``'s selected shards (``shard_paths``), with their states from
  ``features`` when given (``make_dataset``'s arguments)."""
  paths = shard_paths(folder, holdout=holdout, part=part, first=first)
  hidden_paths = hidden_columns = None
  if features is not None:
    feats = folders(features)
    if len(feats) != len(folders(folder)):
      raise DataError(f"give one features folder per data folder: {len(feats)} for "
                      f"{len(folders(folder))}")
    hidden_paths, hidden_columns = [], []
    for d, f in zip(folders(folder), feats):
      got, cols = feature_paths(f, shard_paths(d, holdout=holdout, part=part, first=first),
                                seq_len=seq_len, hidden_size=hidden_size,
                                feature_layers=feature_layers, num_layers=num_layers)
      hidden_paths += got
      hidden_columns += [cols] * len(got)
  source = ShardSource(paths, hidden_paths, seq_len, hidden_columns)
  if len(source) == 0:
    raise DataError(f"{', '.join(map(str, folders(folder)))}: the shards hold no records")
  return source


def make_dataset(folder, *, seq_len: int, global_batch: int, seed: int,
                 pack: bool = True, rows: tuple[int, int] | None = None,
                 vocab_size: int | None = None, packing_bins: int | None = None,
                 holdout: int = 0, part: str = "train", first: int = 0, features=None,
                 hidden_size: int | None = None, feature_layers: tuple[int, ...] = (),
                 num_layers: int | None = None) -> grain.IterDataset:
  """An endless, deterministic ``IterDataset`` of rows ``[start, stop)`` of each global batch.

  ``rows`` is this process's part of the batch (``sharding.process_rows``); None means all.
  ``folder`` is one data folder or several; ``holdout`` / ``part`` / ``first`` pick the
  shards (``shard_paths``). ``features``: a features folder per data folder (``features.py``; made
  for this ``seq_len``, ``hidden_size`` and ``feature_layers``; ``num_layers``, the LLM's, lets
  a drafter read the last layer from any folder): batches then hold ``hidden`` too. The batches
  are otherwise the same, in the same order.
  """
  start, stop = _check_rows(rows, global_batch)
  source = _source(folder, seq_len=seq_len, holdout=holdout, part=part, first=first,
                   features=features, hidden_size=hidden_size, feature_layers=feature_layers,
                   num_layers=num_layers)
  # repeat() after shuffle() reseeds the shuffle every epoch (grain's documented behaviour).
  ds = grain.MapDataset.source(source).shuffle(seed=seed).repeat()
  ds = ds.map(lambda rec: _truncate(rec, seq_len, vocab_size))
  if pack:
    bins = packing_bins or max(global_batch, 8)
    lengths = {"tokens": seq_len, "loss_mask": seq_len,
               **({"hidden": seq_len} if features is not None else {})}
    it_ds = grain.experimental.FirstFitPackIterDataset(
        ds.to_iter_dataset(), length_struct=lengths,
        num_packing_bins=bins, seed=seed, shuffle_bins=True)
    it_ds = it_ds.map(_from_packed)
  else:
    it_ds = ds.map(lambda rec: _pad(rec, seq_len)).to_iter_dataset()
  return it_ds.batch(global_batch, drop_remainder=True).map(lambda b: _rows(b, start, stop))


def make_iterator(folder, **kwargs) -> Iterator[dict[str, np.ndarray]]:
  """A checkpointable iterator (``get_state()`` / ``set_state()``) over ``make_dataset``."""
  return iter(make_dataset(folder, **kwargs))


def first_fit_rows(lengths_N: Sequence[int], seq_len: int) -> list[list[int]]:
  """Which items share a row: each item, in order, goes into the first row with room for it (a
  new row where none has). Every length must be at most ``seq_len``."""
  members, room = [], []
  for i, n in enumerate(lengths_N):
    if not 0 <= n <= seq_len:
      raise DataError(f"item {i} has length {n}, which a row of {seq_len} cannot hold")
    r = next((r for r, free in enumerate(room) if n <= free), None)
    if r is None:
      members.append([])
      room.append(seq_len)
      r = len(room) - 1
    members[r].append(i)
    room[r] -= n
  return members


def _packed_row(recs: Sequence[Mapping[str, np.ndarray]], seq_len: int,
                hidden_like: np.ndarray | None) -> dict[str, np.ndarray]:
  """One row of ``seq_len`` holding ``recs`` (``_truncate``'s) one after the other, as packed
  training rows hold them (segments 1, 2, ..., each with positions from 0), then padding;
  with ``hidden_like`` (some record's states: their columns and dtype) their states too."""
  row = {"tokens": np.zeros((seq_len,), np.int32), "loss_mask": np.zeros((seq_len,), np.int32),
         "segment_ids": np.zeros((seq_len,), np.int32),
         "positions": np.zeros((seq_len,), np.int32)}
  if hidden_like is not None:
    row["hidden"] = np.zeros((seq_len,) + hidden_like.shape[1:], hidden_like.dtype)
  at = 0
  for k, rec in enumerate(recs):
    n = rec["tokens"].size
    row["tokens"][at:at + n] = rec["tokens"]
    row["loss_mask"][at:at + n] = rec["loss_mask"]
    row["segment_ids"][at:at + n] = k + 1
    row["positions"][at:at + n] = np.arange(n)
    if hidden_like is not None:
      row["hidden"][at:at + n] = rec["hidden"]
    at += n
  return row


def greedy_indices(records: Sequence[Mapping[str, Any]]) -> list[int]:
  """Which teacher-data records (``data.read_shard``'s) are greedy answers, in order."""
  return [i for i, r in enumerate(records) if not r["sampled"]]


def held_out_batches(folder, *, seq_len: int, global_batch: int, holdout: int,
                     rows: tuple[int, int] | None = None, vocab_size: int | None = None,
                     pack: bool = True, first: int = 0, features=None,
                     hidden_size: int | None = None, feature_layers: tuple[int, ...] = (),
                     num_layers: int | None = None) -> Iterator[dict[str, np.ndarray]]:
  """The trainer's held-out set, in fixed batches: every greedy answer of the held-out shards
  (``part="eval"``; ``greedy_indices``), windowed as training rows are (``window``),
  packed first-fit into rows of ``seq_len``, longest first (ties in shard and record order;
  with ``pack=False`` one answer per row, in record order), and cut into global batches, the
  last one filled up with empty rows (no targets). No seed enters, so every run, seed and
  process count scores the same positions.

  Args:
    folder, seq_len, global_batch, rows, vocab_size, first, features, hidden_size,
      feature_layers, num_layers: as ``make_dataset``'s (``rows``: this process's rows of each
      global batch).
    holdout: how many of each folder's last shards are held out (at least 1).
    pack: pack several answers per row (else one answer per row).

  Returns:
    An iterator over the batches (``FIELDS``, and ``hidden`` with ``features``), each built as it
    is read, so that at most one batch of stored states is in memory.

  Raises:
    DataError: the held-out shards hold no greedy answer, or the usual data errors.
  """
  start, stop = _check_rows(rows, global_batch)
  source = _source(folder, seq_len=seq_len, holdout=holdout, part="eval", first=first,
                   features=features, hidden_size=hidden_size, feature_layers=feature_layers,
                   num_layers=num_layers)
  picked = greedy_indices(source._records)
  if not picked:
    raise DataError(f"{', '.join(map(str, folders(folder)))}: the held-out shards hold no "
                    "greedy answer to evaluate on")
  lengths = window_lengths([source._records[i] for i in picked], seq_len)
  if pack:  # longest first: first-fit then fills rows better (fewer batches to score)
    order = np.argsort(-lengths, kind="stable")
    members = [[int(order[k]) for k in row] for row in first_fit_rows(lengths[order], seq_len)]
  else:
    members = [[k] for k in range(len(picked))]
  members += [[]] * (-len(members) % global_batch)
  hidden_like = source[picked[0]]["hidden"][:0] if features is not None else None

  def batches():
    for b in range(0, len(members), global_batch):
      recs = [[_truncate(source[picked[k]], seq_len, vocab_size) for k in members[r]]
              for r in range(b + start, b + stop)]
      rows_ = [_packed_row(rs, seq_len, hidden_like) for rs in recs]
      yield {name: np.stack([r[name] for r in rows_]) for name in rows_[0]}

  return batches()
