"""GGUF files: the model's config, where each tensor's bytes lie, and the tensors themselves.

The ``gguf`` package's reader parses every metadata field when it opens a file, the tokenizer's
tens of thousands of strings included: seconds for SmolLM2, most of a warm ``load_llama``. A
load needs only the config and each tensor's type, shape and byte offset, so the first read
saves that index beside the file (``<name>.gguf.index.json``, written to a temporary file and
renamed) and later reads map the tensors straight from the file through it. The index records
the file's size, modification time and inode and is used only while all three match (the
tensors' bytes are always read from the file itself); a folder that cannot be written still
loads, through the reader every time.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import uuid

import numpy as np

from redrafter_jax.config import ConfigError, LlamaConfig, RopeScaling
from redrafter_jax.models.llama import rope_inv_freq
from redrafter_jax.weights.naming import NameTable, Rule, WeightsError, unused

log = logging.getLogger(__name__)

INDEX_SUFFIX = ".index.json"
_INDEX_VERSION = 1

# llama.cpp's names, mapped to Hugging Face's (``llama_weights.HF_TABLE`` maps those to ours).
GGUF_TO_HF = NameTable("gguf", [
    Rule("model.embed_tokens.weight", "token_embd.weight"),
    Rule("model.norm.weight", "output_norm.weight"),
    Rule("lm_head.weight", "output.weight"),
    *[Rule(f"model.layers.{{i}}.{hf}", f"blk.{{i}}.{g}") for hf, g in [
        ("self_attn.q_proj.weight", "attn_q.weight"), ("self_attn.k_proj.weight", "attn_k.weight"),
        ("self_attn.v_proj.weight", "attn_v.weight"), ("self_attn.o_proj.weight", "attn_output.weight"),
        ("self_attn.q_proj.bias", "attn_q.bias"), ("self_attn.k_proj.bias", "attn_k.bias"),
        ("self_attn.v_proj.bias", "attn_v.bias"),
        ("mlp.gate_proj.weight", "ffn_gate.weight"), ("mlp.up_proj.weight", "ffn_up.weight"),
        ("mlp.down_proj.weight", "ffn_down.weight"),
        ("input_layernorm.weight", "attn_norm.weight"),
        ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ]],
])


def unpermute_qk(w: np.ndarray, heads: int) -> np.ndarray:
  """Undo llama.cpp's interleaved RoPE row order for Q/K (rows: heads * head_dim)."""
  rows = w.shape[0]
  head_dim = rows // heads
  rest = w.shape[1:]
  return (w.reshape(heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest))


def gguf_field(reader, key, default=None):
  field = reader.fields.get(key)
  if field is None:
    return default
  return field.contents()


def gguf_config(reader) -> LlamaConfig:
  """The architecture a ``gguf.GGUFReader``'s metadata describes (llama and qwen2)."""
  arch = gguf_field(reader, "general.architecture")
  if arch not in ("llama", "qwen2"):
    raise ConfigError(f"unsupported GGUF architecture {arch!r}; supported: llama, qwen2")
  g = lambda k, d=None: gguf_field(reader, f"{arch}.{k}", d)
  hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
  names = {t.name for t in reader.tensors}
  vocab = g("vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens"))
  if g("rope.scaling.type") not in (None, "none") and g("rope.scaling.factor", 1.0) != 1.0:
    raise ConfigError(f"unsupported GGUF rope scaling {g('rope.scaling.type')!r} "
                      f"(factor {g('rope.scaling.factor')}); supported: none, llama3")
  head_dim = int(g("rope.dimension_count", hidden // heads))
  theta = float(g("rope.freq_base", 10000.0))
  scaling = _llama3_scaling_from_rope_freqs(reader, head_dim, theta)
  return LlamaConfig(
      vocab_size=int(vocab), hidden_size=hidden, intermediate_size=int(g("feed_forward_length")),
      num_layers=int(g("block_count")), num_heads=heads,
      num_kv_heads=int(g("attention.head_count_kv", heads)),
      head_dim=head_dim, rope_theta=theta, rope_scaling=scaling,
      rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
      tie_word_embeddings="output.weight" not in names,
      attention_bias="blk.0.attn_q.bias" in names,
      max_position_embeddings=int(g("context_length", 8192)))


def _llama3_scaling_from_rope_freqs(reader, head_dim: int, theta: float) -> RopeScaling | None:
  """Llama-3 GGUFs store their RoPE scaling only as per-frequency divisors (``rope_freqs``).

  Recover the ``llama3`` parameters when the divisors are exactly what Meta's published
  parameters give (every Llama 3.x release); anything else is refused rather than ignored.
  """
  tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
  if tensor is None:
    return None
  divisors = np.asarray(tensor.data, np.float32).reshape(-1)
  if np.allclose(divisors, 1.0):
    return None
  base = LlamaConfig(vocab_size=1, hidden_size=head_dim, intermediate_size=1, num_layers=1,
                     num_heads=1, num_kv_heads=1, head_dim=head_dim, rope_theta=theta)
  scaling = RopeScaling(factor=float(divisors.max()), low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=8192)
  plain = np.asarray(rope_inv_freq(base))
  scaled = np.asarray(rope_inv_freq(dataclasses.replace(base, rope_scaling=scaling)))
  if divisors.shape != plain.shape or not np.allclose(plain / scaled, divisors, rtol=1e-4):
    raise ConfigError("unsupported GGUF rope_freqs (RoPE scaling that is not Llama-3's); load "
                      "the Hugging Face folder of this model instead")
  return scaling


@dataclasses.dataclass(frozen=True)
class TensorEntry:
  """One tensor's bytes: ``type`` is ggml's type name, ``data_shape``/``dtype`` the array the
  ``gguf`` reader views them as (uint8 rows of blocks for quantized types), ``shape`` the
  tensor's own (PyTorch order)."""

  name: str
  type: str
  dtype: str
  data_shape: tuple[int, ...]
  shape: tuple[int, ...]
  offset: int
  nbytes: int


@dataclasses.dataclass(frozen=True)
class GgufIndex:
  arch: str
  config: LlamaConfig
  tensors: tuple[TensorEntry, ...]

  def raw(self, data: np.ndarray, t: TensorEntry) -> np.ndarray:
    """``t``'s bytes in ``data`` (the whole file, as uint8) as the reader's array."""
    return (data[t.offset:t.offset + t.nbytes].view(np.dtype(t.dtype)).reshape(t.data_shape))


def index_path(path: pathlib.Path) -> pathlib.Path:
  return path.with_name(path.name + INDEX_SUFFIX)


def _stamp(path: pathlib.Path) -> dict[str, int]:
  st = path.stat()
  return dict(size=st.st_size, mtime_ns=st.st_mtime_ns, inode=st.st_ino)


def _parse(path: pathlib.Path) -> GgufIndex:
  import gguf  # imported here: only GGUF users pay for it

  try:
    reader = gguf.GGUFReader(str(path))
  except Exception as e:  # the gguf package raises bare ValueErrors/struct errors
    raise WeightsError(f"{path}: not a readable GGUF file ({e})") from e
  tensors = tuple(
      TensorEntry(name=t.name, type=t.tensor_type.name, dtype=t.data.dtype.str,
                  data_shape=tuple(int(d) for d in t.data.shape),
                  shape=tuple(int(d) for d in reversed(t.shape)),
                  offset=int(t.data_offset), nbytes=int(t.data.nbytes))
      for t in reader.tensors)
  return GgufIndex(arch=gguf_field(reader, "general.architecture"), config=gguf_config(reader),
                   tensors=tensors)


def _load_saved(path: pathlib.Path) -> GgufIndex | None:
  """The saved index if it was made from this very file, else None."""
  try:
    saved = json.loads(index_path(path).read_text())
    if saved.get("version") != _INDEX_VERSION or saved.get("file") != _stamp(path):
      return None
    return GgufIndex(arch=saved["arch"], config=LlamaConfig(**saved["config"]),
                     tensors=tuple(TensorEntry(**{**t, "data_shape": tuple(t["data_shape"]),
                                                  "shape": tuple(t["shape"])})
                                   for t in saved["tensors"]))
  except FileNotFoundError:
    return None
  except (OSError, ValueError, TypeError, KeyError) as e:  # damaged: made again below
    log.warning("ignoring the GGUF index %s (%s); reading the file's header", index_path(path), e)
    return None


def _save(path: pathlib.Path, index: GgufIndex, stamp: dict[str, int]) -> None:
  body = dict(version=_INDEX_VERSION, file=stamp, arch=index.arch,
              config=dataclasses.asdict(index.config),
              tensors=[dataclasses.asdict(t) for t in index.tensors])
  # Written by open() (the umask's mode, like the GGUF beside it) under a name of its own, then
  # renamed: a reader never sees half an index.
  tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
  try:
    with open(tmp, "x") as f:
      json.dump(body, f)
    os.replace(tmp, index_path(path))
  except OSError as e:  # a read-only folder still loads, through the reader every time
    log.warning("could not save the GGUF index beside %s: %s", path, e)
    tmp.unlink(missing_ok=True)


def read_index(path: pathlib.Path) -> GgufIndex:
  """The config and tensor index of a GGUF file: saved beside it, or parsed and then saved."""
  index = _load_saved(path)
  if index is None:
    stamp = _stamp(path)
    index = _parse(path)
    _save(path, index, stamp)
  size = path.stat().st_size
  for t in index.tensors:
    if t.offset + t.nbytes > size:
      raise WeightsError(f"{path}: tensor {t.name!r} ends at byte {t.offset + t.nbytes}, past "
                         f"the file's {size} bytes (a truncated GGUF?)")
  return index


def read_gguf(path: pathlib.Path) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
  """Config and dequantized float32 tensors (HF names, PyTorch layout) from a GGUF file."""
  import gguf

  index = read_index(path)
  cfg = index.config
  data = np.memmap(path, dtype=np.uint8, mode="r")
  tensors = {}
  for t in index.tensors:
    if unused(t.name):
      continue
    mapped = GGUF_TO_HF.to_ours(t.name)
    if mapped is None:
      raise WeightsError(f"{path}: unexpected GGUF tensor {t.name!r}")
    w = gguf.quants.dequantize(index.raw(data, t), gguf.GGMLQuantizationType[t.type])
    w = np.asarray(w, np.float32).reshape(t.shape)
    if np.may_share_memory(w, data):  # F32 tensors come back as views: keep no map open
      w = w.copy()
    if index.arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
      w = unpermute_qk(w, cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads)
    tensors[mapped[0]] = w
  return cfg, tensors
