"""Base-model weights: GGUF files and Hugging Face folders (Llama / Mistral / Qwen2 names).

``load_llama(source)`` accepts a known model name (``smollm2-135m``, fetched into the cache on
first use), a ``.gguf`` file, a folder holding one ``.gguf``, or a Hugging Face folder with
``config.json`` and ``*.safetensors``. It returns ``(Llama, LlamaConfig)``. GGUF files are read
by ``gguf_file`` (which keeps a tensor index beside each file so that later loads skip parsing
its metadata).
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from redrafter_jax.config import LlamaConfig
from redrafter_jax.models.attention import check_backend
from redrafter_jax.models.linear import preferred_layout, to_layout
from redrafter_jax.models.llama import Llama, abstract_llama, stack_layers
from redrafter_jax.weights.gguf_file import read_gguf
from redrafter_jax.weights.naming import NameTable, Rule, WeightsError, unused
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
  ours = HF_TABLE.import_arrays(tensors, ignore=unused)
  # Loaded in the checkpoint's layout (so errors name its tensors), then stored the fast way.
  model = load_into(abstract_llama(cfg, dtype=dtype, param_dtype=param_dtype, backend=backend,
                                   weight_layout="oi", invariant=invariant),
                    ours, dtype=param_dtype, source=str(path), sharding=sharding)
  model = to_layout(model, preferred_layout(param_dtype))
  return (stack_layers(model) if scan_layers else model), cfg
