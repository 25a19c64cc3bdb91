"""Base-model weight loading: HF folders, GGUF files (llama.cpp's Q/K row order), strict checks."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import tiny_models
from redrafter_jax.config import ConfigError
from redrafter_jax.models import linear
from redrafter_jax.weights.gguf_file import unpermute_qk
from redrafter_jax.weights.llama_weights import HF_TABLE, load_llama
from redrafter_jax.weights.naming import WeightsError
from redrafter_jax.weights.params import flat_params

pytestmark = pytest.mark.usefixtures("float32_matmuls")  # float32 parity: no TF32 on GPUs


def hf_state(hf_model) -> dict[str, np.ndarray]:
  return {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}


def assert_same_weights(model, hf_model):
  """Every parameter of ours equals the HF tensor it comes from: as is, or transposed where a
  projection is stored [in, out] (``kernel``, the layout float32 weights get on a CPU)."""
  ours = flat_params(model)
  theirs = hf_state(hf_model)
  if hf_model.config.tie_word_embeddings:
    theirs.pop("lm_head.weight", None)
  assert len(ours) == len(theirs)
  kernels = [name for name in ours if name.endswith(".kernel")]
  assert bool(kernels) == (linear.preferred_layout(model.param_dtype) == "io")
  for name, value in ours.items():
    value = np.asarray(value)
    if name.endswith(".kernel"):
      name, value = name[:-len("kernel")] + "weight", value.T
    hf_name, transpose = HF_TABLE.to_theirs(name)
    assert not transpose, name
    np.testing.assert_array_equal(value, theirs[hf_name], err_msg=name)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "untied"])
def test_hf_folder_loads_every_tensor(tmp_path, kind):
  model, cfg, hf = tiny_models.load_tiny(tmp_path, kind)
  assert cfg.vocab_size == tiny_models.VOCAB and cfg.num_kv_heads == 2
  assert_same_weights(model, hf)


def test_bfloat16_checkpoint_loads(tmp_path):
  import torch

  hf = tiny_models.hf_model("llama")
  tiny_models.save(hf.to(torch.bfloat16), tmp_path / "bf16")
  model, _ = load_llama(tmp_path / "bf16", dtype=jnp.bfloat16)
  weight = model.layers[1].mlp.down_proj.weight[...]
  assert weight.dtype == jnp.bfloat16
  ref = hf.model.layers[1].mlp.down_proj.weight.detach().float().numpy()
  np.testing.assert_array_equal(np.asarray(weight, np.float32), ref)


def test_name_table_round_trips():
  hf = tiny_models.hf_model("untied")
  theirs = hf_state(hf)
  ours = HF_TABLE.import_arrays(theirs)
  back = HF_TABLE.export_arrays(ours)
  assert back.keys() == theirs.keys()
  for name in theirs:
    np.testing.assert_array_equal(back[name], theirs[name])


# --- strict checks ---------------------------------------------------------------------------


@pytest.fixture
def folder(tmp_path):
  return tiny_models.save(tiny_models.hf_model("llama"), tmp_path / "m")


def edit_tensors(folder, edit):
  path = folder / "model.safetensors"
  tensors = load_file(str(path))
  edit(tensors)
  save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_tensor_is_named(folder):
  edit_tensors(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  with pytest.raises(WeightsError, match=r"missing tensor.*layers\.1\.mlp\.up_proj\.weight"):
    load_llama(folder)


def test_unexpected_tensor_is_named(folder):
  edit_tensors(folder, lambda t: t.update({"model.layers.0.self_attn.rotary.weight":
                                           np.zeros(3, np.float32)}))
  with pytest.raises(WeightsError, match=r"unexpected tensor.*self_attn\.rotary\.weight"):
    load_llama(folder)


def test_tensor_of_a_layer_the_config_lacks_is_unexpected(folder):
  edit_tensors(folder, lambda t: t.update({"model.layers.5.input_layernorm.weight":
                                           np.ones(64, np.float32)}))
  with pytest.raises(WeightsError, match=r"unexpected tensor.*layers\.5\.input_layernorm"):
    load_llama(folder)


def test_shape_mismatch_is_named(folder):
  edit_tensors(folder, lambda t: t.update({"model.layers.0.mlp.gate_proj.weight":
                                           np.zeros((100, 64), np.float32)}))
  with pytest.raises(WeightsError, match=r"gate_proj\.weight.*\(100, 64\).*\(128, 64\)"):
    load_llama(folder)


def test_checkpoint_unused_rotary_buffer_is_ignored(folder):
  edit_tensors(folder, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq":
                                           np.ones(8, np.float32)}))
  load_llama(folder)


@pytest.mark.parametrize("model_type", ["gpt2", "mixtral"])
def test_unsupported_architecture_is_a_config_error(folder, model_type):
  cfg = json.loads((folder / "config.json").read_text())
  (folder / "config.json").write_text(json.dumps(dict(cfg, model_type=model_type)))
  with pytest.raises(ConfigError, match=f"model_type='{model_type}'.*llama"):
    load_llama(folder)


def test_unsupported_rope_scaling_is_a_config_error(folder):
  cfg = json.loads((folder / "config.json").read_text())
  cfg.pop("rope_parameters", None)
  cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
  (folder / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ConfigError, match="yarn"):
    load_llama(folder)


def test_bad_sources_are_weights_errors(tmp_path, folder):
  with pytest.raises(WeightsError, match="neither a known name"):
    load_llama(tmp_path / "nowhere")
  (tmp_path / "empty").mkdir()
  with pytest.raises(WeightsError, match="config.json"):
    load_llama(tmp_path / "empty")
  (folder / "model.safetensors").unlink()
  with pytest.raises(WeightsError, match="no \\*.safetensors"):
    load_llama(folder)
  (tmp_path / "bad.gguf").write_bytes(b"not a gguf at all")
  with pytest.raises(WeightsError, match="not a readable GGUF"):
    load_llama(tmp_path / "bad.gguf")
  (tmp_path / "w.bin").write_bytes(b"\0")
  with pytest.raises(WeightsError, match="unsupported weights file"):
    load_llama(tmp_path / "w.bin")


# --- GGUF ------------------------------------------------------------------------------------


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
  """How llama.cpp's converter reorders Q/K rows (interleaved RoPE pairs)."""
  rows = w.shape[0]
  head_dim = rows // heads
  rest = w.shape[1:]
  return w.reshape(heads, 2, head_dim // 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


@pytest.mark.parametrize("shape, heads", [((64, 48), 4), ((32, 48), 2), ((64,), 4)])
def test_unpermute_qk_undoes_llama_cpp(shape, heads):
  w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
  permuted = llama_cpp_permute(w, heads)
  assert not np.array_equal(permuted, w)
  np.testing.assert_array_equal(unpermute_qk(permuted, heads), w)
  np.testing.assert_array_equal(llama_cpp_permute(unpermute_qk(w, heads), heads), w)


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
GGUF_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf_name: str) -> str:
  if hf_name in GGUF_NAMES:
    return GGUF_NAMES[hf_name]
  _, _, i, *module, kind = hf_name.split(".")
  return f"blk.{i}.{GGUF_LAYER['.'.join(module)]}.{kind}"


def write_gguf(path, hf_model, arch: str, rope_freqs=None):
  """A float32 GGUF of ``hf_model`` as llama.cpp writes it (Q/K rows permuted for llama)."""
  import gguf

  c = hf_model.config
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(c.num_hidden_layers)
  w.add_context_length(c.max_position_embeddings)
  w.add_embedding_length(c.hidden_size)
  w.add_feed_forward_length(c.intermediate_size)
  w.add_head_count(c.num_attention_heads)
  w.add_head_count_kv(c.num_key_value_heads)
  w.add_rope_dimension_count(c.head_dim)
  w.add_rope_freq_base(c.rope_parameters["rope_theta"])
  w.add_layer_norm_rms_eps(c.rms_norm_eps)
  w.add_vocab_size(c.vocab_size)
  for name, value in hf_state(hf_model).items():
    if name == "lm_head.weight" and c.tie_word_embeddings:
      continue
    if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
      heads = c.num_attention_heads if ".q_proj." in name else c.num_key_value_heads
      value = llama_cpp_permute(value, heads)
    w.add_tensor(gguf_name(name), np.ascontiguousarray(value, np.float32))
  if rope_freqs is not None:
    w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


@pytest.mark.parametrize("kind, arch", [("llama", "llama"), ("untied", "llama"),
                                        ("qwen2", "qwen2")])
def test_gguf_loads_equal_to_hf(tmp_path, kind, arch):
  hf = tiny_models.hf_model(kind, seed=1)
  path = write_gguf(tmp_path / "m.gguf", hf, arch)
  model, cfg = load_llama(path)
  assert cfg.attention_bias == (kind == "qwen2")
  assert cfg.tie_word_embeddings == (kind != "untied")
  assert_same_weights(model, hf)


def llama3_rope_freqs(head_dim, theta, factor=8.0, low=1.0, high=4.0, original=8192):
  """The per-frequency divisors llama.cpp's converter stores for Llama-3 RoPE scaling."""
  freqs = theta ** -(np.arange(0, head_dim, 2) / head_dim)
  out = []
  for f in freqs:
    wavelen = 2 * np.pi / f
    if wavelen < original / high:
      out.append(1.0)
    elif wavelen > original / low:
      out.append(factor)
    else:
      smooth = (original / wavelen - low) / (high - low)
      out.append(1 / ((1 - smooth) / factor + smooth))
  return np.array(out)


def test_gguf_llama3_rope_freqs_become_rope_scaling(tmp_path):
  import torch
  import transformers

  rope = dict(tiny_models.LLAMA3_ROPE, original_max_position_embeddings=8192, rope_theta=5e5)
  config = transformers.LlamaConfig(**dict(tiny_models.BASE, rope_theta=500000.0),
                                    tie_word_embeddings=True, rope_scaling=rope)
  assert config.rope_parameters["rope_theta"] == 5e5
  hf = transformers.LlamaForCausalLM(config).eval()
  ref_model = tiny_models.hf_model("llama", seed=2)
  hf.load_state_dict(ref_model.state_dict())
  divisors = llama3_rope_freqs(16, 500000.0)
  assert 1 < len(set(np.round(divisors, 4))) and divisors.max() == 8.0
  model, cfg = load_llama(write_gguf(tmp_path / "l3.gguf", hf, "llama", rope_freqs=divisors))
  assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
  tokens = np.random.default_rng(0).integers(0, tiny_models.VOCAB, (1, 20))
  positions = np.arange(100, 120)[None]
  with torch.no_grad():
    ref = hf(input_ids=torch.as_tensor(tokens), position_ids=torch.as_tensor(positions)).logits
  assert tiny_models.rel_err(tiny_models.forward(model, tokens, positions), ref.numpy()) < 1e-4

  with pytest.raises(ConfigError, match="rope_freqs"):
    load_llama(write_gguf(tmp_path / "odd.gguf", hf, "llama", rope_freqs=divisors * 1.5))


def test_gguf_unsupported_architecture_is_a_config_error(tmp_path):
  path = write_gguf(tmp_path / "m.gguf", tiny_models.hf_model("llama"), "gpt2")
  with pytest.raises(ConfigError, match="architecture 'gpt2'"):
    load_llama(path)


@pytest.mark.slow
def test_smollm2_gguf_matches_its_published_architecture(smollm2):
  model, cfg, _ = smollm2
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
          cfg.intermediate_size, cfg.vocab_size) == (30, 576, 9, 3, 64, 1536, 49152)
  assert cfg.tie_word_embeddings and not cfg.attention_bias and cfg.rope_scaling is None
  assert cfg.rope_theta == 100000.0
  assert model.layers[0].mlp.down_proj.matrix_OI().shape == (576, 1536)
