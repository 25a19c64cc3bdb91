"""Base-model weights: GGUF files and Hugging Face folders (Llama / Mistral / Qwen2 names).

``load_llama(source)`` accepts a known model name (``smollm2-135m``, fetched into the cache on
first use), a ``.gguf`` file, a folder holding one ``.gguf``, or a Hugging Face folder with
``config.json`` and ``*.safetensors``. It returns ``(Llama, LlamaConfig)``.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from redrafter_jax.config import ConfigError, LlamaConfig, RopeScaling
from redrafter_jax.models.attention import check_backend
from redrafter_jax.models.linear import preferred_layout, to_layout
from redrafter_jax.models.llama import (Llama, abstract_llama, rope_inv_freq,
                                         stack_layers)
from redrafter_jax.weights.naming import NameTable, Rule, WeightsError
from redrafter_jax.weights.params import load_into

# Ours keep Hugging Face's layout ([out, in]); only the names differ.
_LAYER = [
    ("self_attn.q_proj.weight", "self_attn.q_proj.weight"),
    ("self_attn.k_proj.weight", "self_attn.k_proj.weight"),
    ("self_attn.v_proj.weight", "self_attn.v_proj.weight"),
    ("self_attn.o_proj.weight", "self_attn.o_proj.weight"),
    ("self_attn.q_proj.bias", "self_attn.q_proj.bias"),
    ("self_attn.k_proj.bias", "self_attn.k_proj.bias"),
    ("self_attn.v_proj.bias", "self_attn.v_proj.bias"),
    ("mlp.gate_proj.weight", "mlp.gate_proj.weight"),
    ("mlp.up_proj.weight", "mlp.up_proj.weight"),
    ("mlp.down_proj.weight", "mlp.down_proj.weight"),
    ("input_layernorm.scale", "input_layernorm.weight"),
    ("post_attention_layernorm.scale", "post_attention_layernorm.weight"),
]

HF_TABLE = NameTable("hf-llama", [
    Rule("embed_tokens.embedding", "model.embed_tokens.weight"),
    Rule("norm.scale", "model.norm.weight"),
    Rule("lm_head.weight", "lm_head.weight"),
    *[Rule(f"layers.{{i}}.{o}", f"model.layers.{{i}}.{t}") for o, t in _LAYER],
])

# llama.cpp's names, mapped to Hugging Face's (then through HF_TABLE to ours).
_GGUF_TO_HF = NameTable("gguf", [
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

# Tensors some checkpoints carry that the forward does not use.
_IGNORED = ("rotary_emb.inv_freq", "rope_freqs.weight")


def _ignored(name: str) -> bool:
  return any(name.endswith(s) for s in _IGNORED)


def unpermute_qk(w: np.ndarray, heads: int) -> np.ndarray:
  """Undo llama.cpp's interleaved RoPE row order for Q/K (rows: heads * head_dim)."""
  rows = w.shape[0]
  head_dim = rows // heads
  rest = w.shape[1:]
  return (w.reshape(heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest))


def _gguf_field(reader, key, default=None):
  field = reader.fields.get(key)
  if field is None:
    return default
  value = field.contents()
  return value


def gguf_config(reader) -> LlamaConfig:
  arch = _gguf_field(reader, "general.architecture")
  if arch not in ("llama", "qwen2"):
    raise ConfigError(f"unsupported GGUF architecture {arch!r}; supported: llama, qwen2")
  g = lambda k, d=None: _gguf_field(reader, f"{arch}.{k}", d)
  hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
  names = {t.name for t in reader.tensors}
  vocab = g("vocab_size") or len(_gguf_field(reader, "tokenizer.ggml.tokens"))
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


def read_gguf(path: pathlib.Path) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
  """Config and dequantized float32 tensors (HF names, PyTorch layout) from a GGUF file."""
  import gguf  # imported here: only GGUF users pay for it

  try:
    reader = gguf.GGUFReader(str(path))
  except Exception as e:  # the gguf package raises bare ValueErrors/struct errors
    raise WeightsError(f"{path}: not a readable GGUF file ({e})") from e
  cfg = gguf_config(reader)
  arch = _gguf_field(reader, "general.architecture")
  tensors = {}
  for t in reader.tensors:
    if _ignored(t.name):
      continue
    mapped = _GGUF_TO_HF.to_ours(t.name)
    if mapped is None:
      raise WeightsError(f"{path}: unexpected GGUF tensor {t.name!r}")
    w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
    if arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
      heads = cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads
      w = unpermute_qk(w, heads)
    tensors[mapped[0]] = w
  return cfg, tensors


def read_hf_folder(folder: pathlib.Path) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
  from safetensors.flax import load_file

  cfg_path = folder / "config.json"
  if not cfg_path.is_file():
    raise WeightsError(f"{folder}: no config.json (expected a Hugging Face model folder)")
  cfg = LlamaConfig.from_hf(json.loads(cfg_path.read_text()))
  files = sorted(folder.glob("*.safetensors"))
  if not files:
    raise WeightsError(f"{folder}: no *.safetensors files")
  tensors = {}
  for f in files:
    # The flax reader (not numpy's) understands bfloat16, the usual dtype of HF checkpoints;
    # arrays stay on the host until ``load_into`` places them.
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
      for name, value in load_file(str(f)).items():
        tensors[name] = np.asarray(value)
  return cfg, tensors


def resolve_source(source: str | pathlib.Path) -> pathlib.Path:
  """A known model name (fetched on first use), a GGUF file, or a model folder."""
  from redrafter_jax.weights import fetch

  if str(source) in fetch.KNOWN_MODELS:
    return fetch.ensure_model(str(source))
  path = pathlib.Path(source).expanduser()
  if not path.exists():
    raise WeightsError(f"model {str(source)!r} is neither a known name "
                       f"({', '.join(fetch.KNOWN_MODELS)}) nor an existing path")
  return path


def read_llama(source) -> tuple[LlamaConfig, dict[str, np.ndarray], pathlib.Path]:
  """(config, {HF name: array}, resolved path) for any supported source."""
  path = resolve_source(source)
  if path.is_dir():
    ggufs = sorted(path.glob("*.gguf"))
    if (path / "config.json").is_file():
      return (*read_hf_folder(path), path)
    if len(ggufs) == 1:
      path = ggufs[0]
    else:
      raise WeightsError(f"{path}: expected config.json + *.safetensors or exactly one .gguf file")
  if path.suffix != ".gguf":
    raise WeightsError(f"{path}: unsupported weights file (expected .gguf or a model folder)")
  return (*read_gguf(path), path)


def load_llama(source, *, dtype=jnp.float32, param_dtype=None, backend: str = "xla",
               sharding=None, scan_layers: bool = False,
               invariant: bool = False) -> tuple[Llama, LlamaConfig]:
  """The model and its config. ``dtype``: activations and KV cache; ``param_dtype``: the weights
  (None: ``dtype``). Float32 activations with bfloat16 weights is the fast CPU setting.
  ``invariant``: the invariant mode (``Llama``: identical greedy tokens at any batch and tree,
  bfloat16 included, at a cost in time).
  ``scan_layers``: run the layers as a scan (``llama.stack_layers``; with ``sharding``, place
  the stacked model again with ``sharding.shard_module``)."""
  check_backend(backend)
  param_dtype = dtype if param_dtype is None else param_dtype
  cfg, tensors, path = read_llama(source)
  if cfg.tie_word_embeddings:
    tensors.pop("lm_head.weight", None)  # some tied checkpoints also store the copy
  ours = HF_TABLE.import_arrays(tensors, ignore=_ignored)
  # Loaded in the checkpoint's layout (so errors name its tensors), then stored the fast way.
  model = load_into(abstract_llama(cfg, dtype=dtype, param_dtype=param_dtype, backend=backend,
                                   weight_layout="oi", invariant=invariant),
                    ours, dtype=param_dtype, source=str(path), sharding=sharding)
  model = to_layout(model, preferred_layout(param_dtype))
  return (stack_layers(model) if scan_layers else model), cfg
