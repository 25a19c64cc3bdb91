"""Drafter checkpoints: Apple's reference format (also what MLX loads) and TensorRT-LLM's.

A drafter folder holds ``config.json`` and one unsharded safetensors file in PyTorch layout
(out, in). The formats differ only in tensor names and config fields (DESIGN §8):

  reference / mlx  ``model.safetensors``: ``input_proj.*``, ``lm_head.{i}.linear.*``,
                   ``lm_head.{n}.weight``, ``rnn_u.*``, ``rnn_w.weight``; config fields of §5.
  trtllm           the drafter's part of a TensorRT-LLM ReDrafter checkpoint:
                   ``rank0.safetensors`` (TensorRT-LLM's name for tensor-parallel rank 0) with
                   the same tensors under ``drafter.`` (``drafter.layers.{i}.linear.*``,
                   ``drafter.lm_head.weight``, ...); config ``architecture``, ``dtype``,
                   ``vocab_size``, ``redrafter_num_layers``, ``redrafter_hidden_size``,
                   ``redrafter_exit_dim``, ``redrafter_is_rnn``. NOT written: the base model's
                   tensors and config (``transformer.*``, ``lm_head.weight``) and the engine's
                   build fields (``redrafter_num_beams``, ``redrafter_draft_len_per_beam``,
                   ``redrafter_greedy_search``). A whole checkpoint comes from TensorRT-LLM's own
                   ``examples/redrafter/convert_checkpoint.py``, which reads the reference layout
                   and an HF base model (docs/export.md). Reading a full TensorRT-LLM
                   checkpoint skips the base model's tensors.

Our own format, ``redrafter-jax``, holds what the others cannot: the reference's tensors and
fields plus a multi-layer drafter's ``feature_proj.weight`` ``[D, k*D]`` and ``feature_layers``,
the copy hint's ``copy_w.weight``, ``copy_length.weight``, ``copy_gate.*`` and ``copy_ngram``,
and the context attention's ``ctx_{key,value,query,out}.weight`` and ``context_attention``,
``context_heads`` in config.json, under ``model_type: "redrafter_jax_drafter"`` (so Apple's loader, which would
silently ignore them, refuses the folder instead). The reference, MLX and TensorRT-LLM exports
refuse a drafter with either option, naming the field.

Our own variant of the reference layout, a compact head (``head_rows`` in config.json, see
``save_drafter``), stores only the draft vocabulary's head rows; it reads back as the full drafter.

Some reference-trained checkpoints name the head ``lm_heads.{i}`` / ``input_projs`` or, saved
from a bare ``Sequential``, ``0.{i}``; reading detects those layouts from the tensor names. Every
layout is one ``NameTable``, used both ways, so export and import agree by construction.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import uuid
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from redrafter_jax.config import ConfigError, DrafterConfig
from redrafter_jax.models.drafter import Drafter, abstract_drafter
from redrafter_jax.weights.naming import NameTable, Rule, WeightsError
from redrafter_jax.weights.params import flat_params, load_into

log = logging.getLogger(__name__)

FORMATS = ("reference", "mlx", "trtllm", "redrafter-jax")
DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}
DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
WEIGHTS_FILE = "model.safetensors"
TRTLLM_WEIGHTS_FILE = "rank0.safetensors"
MODEL_TYPE = "recurrent_drafting_drafter"
OWN_MODEL_TYPE = "redrafter_jax_drafter"  # the "redrafter-jax" format
TRTLLM_ARCHITECTURE = "ReDrafterForCausalLM"
# Our sidecar: token ids by frequency in the distillation data (the draft vocabulary's order).
# Not part of any reference format, so strict loaders of model.safetensors never see it.
RANKING_FILE = "token_ranking.json"
# Our config field for a compact head (``save_drafter(head_rows=R)``): the vocabulary head holds
# only the rows of the R top-ranked tokens, in ranking order; every other row is zero.
HEAD_ROWS_FIELD = "head_rows"

# Fields the reference's (transformers) config carries that do not change the drafter's math.
_REFERENCE_EXTRA_FIELDS = ("num_lookback_tokens", "auto_map")
# TensorRT-LLM config field -> DrafterConfig field (``redrafter_logit_top_k`` is ours).
_TRTLLM_FIELDS = {"vocab_size": "vocab_size", "redrafter_hidden_size": "hidden_size",
                  "redrafter_exit_dim": "exit_dim", "redrafter_num_layers": "num_draft_layers",
                  "redrafter_is_rnn": "rnn", "redrafter_logit_top_k": "logit_top_k"}
# Base-model tensors in a full TensorRT-LLM checkpoint: not the drafter's, skipped on import.
_TRTLLM_BASE_PREFIXES = ("transformer.", "base_model.")


def _table(name: str, *, layers: str, proj: tuple[str, ...], head: str | None = None, n: int = 0,
           prefix: str = "") -> NameTable:
  """One layout: ``layers.{i}`` ResBlocks and ``layers.{n}`` the vocab projection (or ``head``,
  unindexed, for layer ``n``); ``proj`` names the input projection (the first is written, all
  are read)."""
  p = prefix
  rules = []
  for name_ in proj:
    rules += [Rule("input_proj.kernel", f"{p}{name_}.weight", True),
              Rule("input_proj.bias", f"{p}{name_}.bias")]
  vocab = (Rule(f"lm_head.{n}.kernel", f"{p}{head}.weight", True) if head else
           Rule("lm_head.{i}.kernel", f"{p}{layers}.{{i}}.weight", True))
  rules += [
      Rule("lm_head.{i}.linear.kernel", f"{p}{layers}.{{i}}.linear.weight", True),
      Rule("lm_head.{i}.linear.bias", f"{p}{layers}.{{i}}.linear.bias"),
      vocab,
      Rule("rnn_u.kernel", f"{p}rnn_u.weight", True),
      Rule("rnn_u.bias", f"{p}rnn_u.bias"),
      Rule("rnn_w.kernel", f"{p}rnn_w.weight", True),
  ]
  return NameTable(name, rules)


def name_table(layout: str, num_draft_layers: int) -> NameTable:
  """The table of one layout (``reference``, ``lm_heads``, ``sequential``, ``trtllm``).

  TensorRT-LLM's vocab projection is unindexed (``drafter.lm_head``), so its table needs
  ``num_draft_layers`` (our ``lm_head.{n}``); the reference layouts index it like the ResBlocks.
  """
  if layout == "reference":
    return _table("reference", layers="lm_head", proj=("input_proj",))
  if layout == "lm_heads":
    return _table("reference (lm_heads.*)", layers="lm_heads", proj=("input_projs", "input_proj"))
  if layout == "sequential":
    return _table("reference (0.{i}.*)", layers="0", proj=("input_proj", "input_projs"))
  if layout == "redrafter-jax":
    table = _table("redrafter-jax", layers="lm_head", proj=("input_proj",))
    return NameTable(table.name, [*table.rules,
                                  Rule("feature_proj.kernel", "feature_proj.weight", True),
                                  Rule("copy_w.kernel", "copy_w.weight", True),
                                  Rule("copy_length", "copy_length.weight"),
                                  Rule("copy_gate.kernel", "copy_gate.weight", True),
                                  Rule("copy_gate.bias", "copy_gate.bias"),
                                  *[Rule(f"ctx_{n}.kernel", f"ctx_{n}.weight", True)
                                    for n in ("key", "value", "query", "out")]])
  if layout == "trtllm":
    return _table("trtllm", layers="layers", proj=("input_proj",), head="lm_head",
                  n=num_draft_layers, prefix="drafter.")
  raise ValueError(f"unknown layout {layout!r}")


_READ_LAYOUTS = {"reference": ("reference", "lm_heads", "sequential"), "trtllm": ("trtllm",),
                 "redrafter-jax": ("redrafter-jax",)}


def canonical_dtype(dtype: str) -> str:
  name = DTYPE_ALIASES.get(str(dtype), str(dtype))
  if name not in DTYPES:
    raise ConfigError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)} "
                      f"(or {sorted(DTYPE_ALIASES)})")
  return name


# ---------------------------------------------------------------------------------------------
# Export.


def _config_json(cfg: DrafterConfig, fmt: str, dtype: str) -> dict[str, Any]:
  if fmt == "trtllm":
    out = {"architecture": TRTLLM_ARCHITECTURE, "dtype": dtype}
    for theirs, ours in _TRTLLM_FIELDS.items():
      value = getattr(cfg, ours)
      if value is not None:
        out[theirs] = value
    return out
  out = cfg.to_dict()
  if out.get("logit_top_k") is None:
    out.pop("logit_top_k", None)
  if fmt == "redrafter-jax":
    out.update(model_type=OWN_MODEL_TYPE, feature_layers=list(cfg.feature_layers))
  return out


def _head_name(cfg: DrafterConfig) -> str:
  """Our name of the vocabulary head's kernel ``[C, V]``."""
  return f"lm_head.{cfg.num_draft_layers}.kernel"


def _compact_head(params: dict[str, Any], cfg: DrafterConfig, ranking: np.ndarray,
                  head_rows: int) -> dict[str, Any]:
  """``params`` with the head cut to the ``head_rows`` top-ranked tokens' rows, checking that
  every row it drops is zero (what the trainer leaves outside ``train.vocab_limit``), so that
  reading the folder back gives the same drafter."""
  V = cfg.vocab_size
  if not 0 < head_rows < V:
    raise ConfigError(f"head_rows must be in 1..{V - 1} (the drafter has {V} head rows), "
                      f"got {head_rows}")
  name = _head_name(cfg)
  kernel_CV = np.asarray(params[name])
  dropped_V = np.ones((V,), bool)
  dropped_V[ranking[:head_rows]] = False
  nonzero = int(np.count_nonzero(np.any(kernel_CV[:, dropped_V] != 0, axis=0)))
  if nonzero:
    raise ConfigError(f"cannot keep only the {head_rows} top-ranked head rows: {nonzero} of the "
                      f"other {V - head_rows} rows are not zero, so the compact head would "
                      f"change the drafter (train with train.vocab_limit <= {head_rows}, or "
                      f"export the full head)")
  return dict(params, **{name: kernel_CV[:, ranking[:head_rows]]})


def save_drafter(drafter: Drafter, out_dir, *, format: str = "reference", dtype: str = "float32",
                 overwrite: bool = False, head_rows: int = 0) -> pathlib.Path:
  """Write ``drafter`` as a folder in ``format`` (reference | mlx | trtllm | redrafter-jax) at
  ``dtype`` (only redrafter-jax holds a drafter with ``feature_layers``).

  ``reference`` and ``mlx`` are the same layout (MLX loads the reference's file as is). Refuses a
  non-empty ``out_dir`` unless ``overwrite``; the folder is built beside it and renamed into
  place, so a failure leaves either the old folder or nothing, never a half-written one.

  ``head_rows`` R > 0 (``reference`` and ``redrafter-jax``) writes a compact head: the
  vocabulary projection's rows of the R top-ranked tokens only (``token_ranking.json`` says
  which), which is lossless when every other row is zero, as the trainer leaves them with
  ``train.vocab_limit`` <= R (refused otherwise); the head is most of a drafter's size, so this
  keeps a wide drafter small. ``load_drafter`` restores the full drafter; Apple's MLX code and
  TensorRT-LLM need the full head, so export for them without ``head_rows``.
  """
  if format not in FORMATS:
    raise ConfigError(f"unknown export format {format!r}; choose one of {list(FORMATS)}")
  cfg = drafter.config
  own = cfg.own_options
  if own and format != "redrafter-jax":
    name, value = next(iter(own.items()))
    raise ConfigError(f"the {format} format cannot hold drafter.{name}={value} (an option "
                      f"beyond the reference drafter): save it with format='redrafter-jax'")
  if head_rows and format not in ("reference", "redrafter-jax"):
    raise ConfigError(f"a compact head (head_rows) is this library's own variant of the "
                      f"reference layout; the {format} format needs the full head")
  dtype = canonical_dtype(dtype)
  if drafter.vocab_ids is not None:
    raise ConfigError("cannot export a drafter with a restricted draft vocabulary; export the "
                      "full drafter (restriction is an inference-time option)")
  ranking_V = np.asarray(drafter.token_ranking[...])
  params = flat_params(drafter)
  if head_rows:
    params = _compact_head(params, cfg, ranking_V, head_rows)
  layout = format if format in ("trtllm", "redrafter-jax") else "reference"
  table = name_table(layout, cfg.num_draft_layers)
  tensors = {name: np.ascontiguousarray(np.asarray(jnp.asarray(value, DTYPES[dtype])))
             for name, value in table.export_arrays(params).items()}
  config = _config_json(cfg, format, dtype)
  if head_rows:
    config[HEAD_ROWS_FIELD] = head_rows
  weights_file = TRTLLM_WEIGHTS_FILE if format == "trtllm" else WEIGHTS_FILE
  ranking = ranking_V.tolist()

  def write(folder: pathlib.Path):
    from safetensors.numpy import save

    # "pt" lets transformers' from_pretrained (the reference's PyTorch loader) accept the file.
    # Bytes written by Python's open(), so the file gets the umask's mode like its neighbours
    # (safetensors' save_file creates it 0600, unreadable to the other users of a shared export).
    (folder / weights_file).write_bytes(save(tensors, metadata={"format": "pt"}))
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if head_rows or ranking != list(range(cfg.vocab_size)):
      (folder / RANKING_FILE).write_text(json.dumps({"token_ranking": ranking}) + "\n")

  out = _write_atomically(pathlib.Path(out_dir), write, overwrite=overwrite)
  log.info("wrote %s drafter (%s, %d tensors) to %s", format, dtype, len(tensors), out)
  return out


def _write_atomically(out: pathlib.Path, write, *, overwrite: bool) -> pathlib.Path:
  if out.exists() or out.is_symlink():
    if not out.is_dir():
      raise FileExistsError(f"output path {out} exists and is not a folder")
    if any(out.iterdir()) and not overwrite:
      raise FileExistsError(f"output folder {out} is not empty; pass --overwrite "
                            f"(overwrite=True) to replace it")
  out.parent.mkdir(parents=True, exist_ok=True)
  tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
  tmp = out.with_name(f".{out.name}.tmp-{tag}")
  tmp.mkdir()
  try:
    write(tmp)
    if out.is_dir():
      old = out.with_name(f".{out.name}.old-{tag}")
      out.rename(old)
      try:
        tmp.rename(out)
      except BaseException:
        old.rename(out)
        raise
      shutil.rmtree(old, ignore_errors=True)
    else:
      tmp.rename(out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out


# ---------------------------------------------------------------------------------------------
# Import.


def read_config(folder: pathlib.Path) -> tuple[str, dict[str, Any]]:
  """``(format, DrafterConfig fields)`` from a drafter folder's ``config.json``."""
  path = folder / "config.json"
  if not path.is_file():
    raise WeightsError(f"{folder}: no config.json (expected a drafter folder in the reference, "
                       f"MLX or TensorRT-LLM format)")
  try:
    raw = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ConfigError(f"{path}: invalid JSON: {e}") from e
  if not isinstance(raw, Mapping):
    raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
  if any(k.startswith("redrafter_") for k in raw) or raw.get("architecture") == TRTLLM_ARCHITECTURE:
    missing = [k for k in _TRTLLM_FIELDS if k not in raw and k != "redrafter_logit_top_k"]
    if missing:
      raise ConfigError(f"{path}: TensorRT-LLM drafter config lacks field(s) {missing}")
    # A full TensorRT-LLM config also describes the base model: only the drafter's fields count.
    return "trtllm", {ours: raw[theirs] for theirs, ours in _TRTLLM_FIELDS.items() if theirs in raw}
  model_type = raw.get("model_type", MODEL_TYPE)
  if model_type == OWN_MODEL_TYPE:
    return "redrafter-jax", {k: v for k, v in raw.items() if k not in _REFERENCE_EXTRA_FIELDS}
  for own in DrafterConfig.OWN_OPTIONS:
    if raw.get(own):
      raise ConfigError(f"{path}: {own} (an option beyond the reference drafter) needs "
                        f"model_type {OWN_MODEL_TYPE!r}, the redrafter-jax format")
  if model_type != MODEL_TYPE:
    raise WeightsError(f"{path}: model_type {model_type!r} is not a drafter (expected "
                       f"{MODEL_TYPE!r}, or TensorRT-LLM's redrafter_* fields)")
  return "reference", {k: v for k, v in raw.items() if k not in _REFERENCE_EXTRA_FIELDS}


def drafter_config(fields: Mapping[str, Any], path: pathlib.Path) -> DrafterConfig:
  for required in ("vocab_size", "hidden_size"):
    if required not in fields:
      raise ConfigError(f"{path}: drafter config lacks {required!r}")
  try:
    return DrafterConfig.from_dict(fields)
  except ConfigError as e:
    raise ConfigError(f"{path}: {e}") from e


def _weights_path(folder: pathlib.Path, fmt: str) -> pathlib.Path:
  names = (TRTLLM_WEIGHTS_FILE, WEIGHTS_FILE) if fmt == "trtllm" else (WEIGHTS_FILE,)
  for name in names:
    if (folder / name).is_file():
      if fmt == "trtllm" and (folder / "rank1.safetensors").exists():
        raise WeightsError(f"{folder}: tensor-parallel shards (rank1.safetensors ...) are not "
                           f"supported; convert with tp_size=1")
      return folder / name
  present = sorted(p.name for p in folder.glob("*.safetensors"))
  hint = f" (found {present}; sharded checkpoints are not supported)" if present else ""
  raise WeightsError(f"{folder}: no {' or '.join(names)}{hint}")


def _read_tensors(path: pathlib.Path) -> dict[str, np.ndarray]:
  from safetensors import SafetensorError
  from safetensors.numpy import load_file

  try:
    return load_file(str(path))
  except (SafetensorError, OSError, ValueError) as e:
    raise WeightsError(f"{path}: not a readable safetensors file ({e})") from e


def _describe(cfg: DrafterConfig) -> str:
  layers = "".join(f", {k}={v}" for k, v in cfg.own_options.items())
  return (f"vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}, exit_dim={cfg.exit_dim}, "
          f"num_draft_layers={cfg.num_draft_layers}, rnn={cfg.rnn}{layers}")


def _pick_layout(names, fmt: str, n: int) -> tuple[NameTable, list[str]]:
  """The layout whose table knows every name (else the closest one, with its unknown names)."""
  best = None
  for layout in _READ_LAYOUTS[fmt]:
    table = name_table(layout, n)
    unknown = sorted(name for name in names if table.to_ours(name) is None)
    if not unknown:
      return table, []
    if best is None or len(unknown) < len(best[1]):
      best = (table, unknown)
  return best


def _check(tensors: Mapping[str, np.ndarray], table: NameTable, cfg: DrafterConfig,
           source: str, head_rows: int = 0) -> None:
  """Missing, unexpected and misshapen tensors, named as the file names them (the head has
  ``head_rows`` rows when the folder's head is compact)."""
  theirs_of = {}
  for name in sorted(tensors):
    ours = table.to_ours(name)[0]
    if ours in theirs_of:
      raise WeightsError(f"{source}: tensors {theirs_of[ours]!r} and {name!r} are the same "
                         f"parameter; keep one")
    theirs_of[ours] = name
  expected = {name: var.shape for name, var in flat_params(abstract_drafter(cfg)).items()}
  if head_rows:
    expected[_head_name(cfg)] = (cfg.exit_dim, head_rows)
  missing = sorted(table.to_theirs(o)[0] for o in expected if o not in theirs_of)
  unexpected = sorted(t for o, t in theirs_of.items() if o not in expected)
  if missing:
    raise WeightsError(f"{source}: missing tensor(s) {missing} that config.json "
                       f"({_describe(cfg)}) requires")
  if unexpected:
    raise WeightsError(f"{source}: tensor(s) {unexpected} do not belong to the drafter config.json "
                       f"describes ({_describe(cfg)})")
  for ours, shape in expected.items():
    theirs = theirs_of[ours]
    want = tuple(reversed(shape)) if table.to_theirs(ours)[1] else tuple(shape)
    got = tuple(tensors[theirs].shape)
    if got != want:
      raise WeightsError(f"{source}: tensor {theirs!r} has shape {got}, but config.json "
                         f"({_describe(cfg)}) implies {want}")


def _head_rows(fields: dict[str, Any], path: pathlib.Path) -> int:
  """Pops and checks ``head_rows`` (0: the head is full)."""
  rows = fields.pop(HEAD_ROWS_FIELD, 0)
  if (not isinstance(rows, int) or isinstance(rows, bool) or
      not 0 <= rows < fields.get("vocab_size", rows + 1)):
    raise ConfigError(f"{path}: {HEAD_ROWS_FIELD} must be an integer in 0..vocab_size-1 (the "
                      f"number of head rows stored), got {rows!r}")
  return rows


def read_drafter(path) -> tuple[str, str, DrafterConfig, dict[str, np.ndarray]]:
  """``(format, layout name, config, {our name: array})`` of a drafter folder, fully checked;
  the arrays include ``token_ranking`` (``read_token_ranking``).

  A compact head (``head_rows`` in config.json) comes back full: its rows go to the ranked
  tokens they belong to and every other row is zero, the drafter that was saved."""
  folder = pathlib.Path(path)
  if folder.is_file() and folder.suffix == ".safetensors":
    folder = folder.parent
  if not folder.exists():
    raise FileNotFoundError(f"drafter not found: {folder}")
  if not folder.is_dir():
    raise WeightsError(f"{folder}: expected a drafter folder (config.json + model.safetensors)")
  fmt, fields = read_config(folder)
  head_rows = _head_rows(fields, folder / "config.json")
  weights = _weights_path(folder, fmt)
  tensors = _read_tensors(weights)
  if "rnn" not in fields:
    # The reference's own default is rnn=False; its configs always say. Trust the tensors here.
    fields["rnn"] = any(n.endswith("rnn_u.weight") for n in tensors)
  cfg = drafter_config(fields, folder / "config.json")
  if fmt == "trtllm":
    base = [n for n in tensors if n.startswith(_TRTLLM_BASE_PREFIXES) or n == "lm_head.weight"]
    if base:
      log.info("%s: skipping %d base-model tensors", weights, len(base))
    tensors = {n: v for n, v in tensors.items() if n not in set(base)}
  table, unknown = _pick_layout(tensors, fmt, cfg.num_draft_layers)
  if unknown:
    more = " ..." if len(unknown) > 8 else ""
    raise WeightsError(f"{weights}: unknown tensor name(s) {unknown[:8]}{more} (not a "
                       f"{fmt} drafter layout)")
  _check(tensors, table, cfg, str(weights), head_rows)
  arrays = table.import_arrays(tensors)
  if head_rows and not (folder / RANKING_FILE).is_file():
    raise WeightsError(f"{folder}: config.json says the head keeps only the {head_rows} "
                       f"top-ranked tokens' rows, but there is no {RANKING_FILE} to say which")
  arrays["token_ranking"] = ranking_V = read_token_ranking(folder, cfg.vocab_size)
  if head_rows:
    rows_CR = arrays[_head_name(cfg)]
    kernel_CV = np.zeros((cfg.exit_dim, cfg.vocab_size), rows_CR.dtype)
    kernel_CV[:, ranking_V[:head_rows]] = rows_CR
    arrays[_head_name(cfg)] = kernel_CV
  return fmt, table.name, cfg, arrays


def load_drafter(path, *, dtype=jnp.float32) -> Drafter:
  """A ``Drafter`` from a folder in any supported format (detected from config and names)."""
  fmt, layout, cfg, arrays = read_drafter(path)
  drafter = load_into(abstract_drafter(cfg, dtype=dtype), arrays, dtype=dtype, source=str(path))
  log.info("loaded drafter from %s (%s layout; %s)", path, layout, _describe(cfg))
  return drafter


def read_token_ranking(path, vocab_size: int) -> np.ndarray:
  """The saved token ranking, or token-id order when the folder has none (e.g. Apple's)."""
  folder = pathlib.Path(path)
  folder = folder.parent if folder.is_file() else folder
  file = folder / RANKING_FILE
  if not file.is_file():
    return np.arange(vocab_size, dtype=np.int32)
  try:
    ranking = np.asarray(json.loads(file.read_text())["token_ranking"], np.int32)
  except (ValueError, KeyError, TypeError) as e:
    raise WeightsError(f"{file}: malformed token ranking ({e})") from e
  if ranking.shape != (vocab_size,) or not np.array_equal(np.sort(ranking),
                                                          np.arange(vocab_size)):
    raise WeightsError(f"{file}: token_ranking must be a permutation of the {vocab_size} "
                       f"token ids")
  return ranking
