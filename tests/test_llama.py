"""Parity of ``models/llama.py`` with transformers' PyTorch models on the same weights.

Tiny random configs (built here, no download) cover plain Llama with GQA and tied embeddings,
Qwen2 (q/k/v biases), Llama-3 RoPE scaling and untied embeddings. The real SmolLM2-135M is
compared with transformers loading the very same GGUF (slow tests).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tiny_models
from tiny_models import forward
from redrafter_jax import sharding
from redrafter_jax.inference.ar import generate
from redrafter_jax.models import kv_cache as kvc
from redrafter_jax.models import linear, llama
from redrafter_jax.models.attention import BackendError, attend, check_backend
from redrafter_jax.weights.llama_weights import load_llama

pytestmark = pytest.mark.usefixtures("float32_matmuls")  # float32 parity: no TF32 on GPUs


def random_tokens(seed, shape, vocab=tiny_models.VOCAB):
  return np.random.default_rng(seed).integers(0, vocab, size=shape, dtype=np.int32)


# --- tiny random models ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", tiny_models.KINDS)
def test_tiny_logits_match_transformers(tmp_path, kind):
  model, cfg, hf = tiny_models.load_tiny(tmp_path, kind)
  assert cfg.attention_bias == (kind == "qwen2")
  assert cfg.tie_word_embeddings == (kind != "untied")
  assert (cfg.rope_scaling is not None) == (kind == "llama3")
  tokens_BT = random_tokens(1, (2, 40))
  ref = tiny_models.hf_logits(hf, tokens_BT)
  assert tiny_models.rel_err(forward(model, tokens_BT), ref) < 1e-4


def test_tiny_logits_match_at_large_positions(tmp_path):
  """Positions past Llama-3's original context exercise every band of the scaled RoPE."""
  model, cfg, hf = tiny_models.load_tiny(tmp_path, "llama3")
  tokens_BT = random_tokens(2, (1, 24))
  positions_BT = np.arange(200, 224)[None]
  ref = tiny_models.hf_logits(hf, tokens_BT, positions_BT)
  assert tiny_models.rel_err(forward(model, tokens_BT, positions_BT), ref) < 1e-4
  # The test can tell the scaling apart: without it the logits move well beyond the tolerance.
  plain, _ = load_llama(tiny_models.save(tiny_models.hf_model("llama", 0), tmp_path / "plain"))
  assert tiny_models.rel_err(forward(plain, tokens_BT, positions_BT), ref) > 1e-2


def test_padding_does_not_change_valid_logits(tmp_path):
  """Right padding (how batches are packed) leaves every real token's logits unchanged."""
  model, _, hf = tiny_models.load_tiny(tmp_path, "llama")
  tokens_BT = random_tokens(3, (2, 16))
  valid_BT = np.arange(16)[None] < np.array([[16], [9]])
  batched = forward(model, tokens_BT, valid_BT=valid_BT)
  alone = forward(model, tokens_BT[1:, :9])
  np.testing.assert_allclose(batched[1, :9], alone[0], rtol=0, atol=1e-5)
  assert tiny_models.rel_err(batched[1, :9], tiny_models.hf_logits(hf, tokens_BT[1:, :9])) < 1e-4


def test_tiny_greedy_generate_matches_transformers(tmp_path):
  import torch

  model, _, hf = tiny_models.load_tiny(tmp_path, "qwen2", seed=4)
  prompt = random_tokens(5, (11,)).tolist()
  ours = generate(model, [prompt], max_new_tokens=24).tokens[0]
  with torch.no_grad():
    ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24,
                      min_new_tokens=24, eos_token_id=None, pad_token_id=0)
  assert ours == ref[0, len(prompt):].tolist()


def test_bf16_forward_is_close_to_fp32(tmp_path):
  model32, _, _ = tiny_models.load_tiny(tmp_path, "llama")
  model16, _ = load_llama(tmp_path / "llama-0", dtype=jnp.bfloat16)
  assert model16.layers[0].self_attn.q_proj.weight.dtype == jnp.bfloat16
  tokens_BT = random_tokens(6, (2, 32))
  l32, l16 = forward(model32, tokens_BT), forward(model16, tokens_BT)
  assert l16.dtype == np.float32 and np.isfinite(l16).all()
  # bf16 keeps ~3 significant digits; across 2 layers a few percent of the logit range.
  assert tiny_models.rel_err(l16, l32) < 0.05
  assert (l16.argmax(-1) == l32.argmax(-1)).mean() > 0.9


@pytest.mark.parametrize("kind", ["llama", "untied"])
def test_bf16_weights_with_fp32_activations(tmp_path, kind):
  """``param_dtype=bfloat16`` stores every weight in bf16 (PyTorch's [out, in] layout) and keeps
  activations and the cache in fp32: it is fp32 up to the weights' and matmul inputs' rounding,
  closer to fp32 than a bf16 model is."""
  model32, _, _ = tiny_models.load_tiny(tmp_path, kind)
  mixed, _ = load_llama(tmp_path / f"{kind}-0", param_dtype=jnp.bfloat16)
  full16, _ = load_llama(tmp_path / f"{kind}-0", dtype=jnp.bfloat16)
  params = jax.tree.leaves(nnx.state(mixed, nnx.Param))
  assert params and all(p.dtype == jnp.bfloat16 for p in params)
  q = mixed.layers[0].self_attn.q_proj.weight
  assert q.shape == (mixed.config.num_heads * mixed.config.head_dim, mixed.config.hidden_size)
  assert mixed.init_cache(1, 8).k[0].dtype == jnp.float32
  tokens_BT = random_tokens(6, (2, 32))
  l32, lmix, l16 = (forward(m, tokens_BT) for m in (model32, mixed, full16))
  err = tiny_models.rel_err(lmix, l32)
  assert 0 < err < 0.02 and err < tiny_models.rel_err(l16, l32)
  assert (lmix.argmax(-1) == l32.argmax(-1)).mean() > 0.95


@pytest.mark.parametrize("layout", linear.LAYOUTS)
@pytest.mark.parametrize("x_dtype,w_dtype", [(jnp.float32, jnp.float32),
                                             (jnp.float32, jnp.bfloat16),
                                             (jnp.bfloat16, jnp.bfloat16)])
def test_project_matches_float64_math_for_any_row_count(x_dtype, w_dtype, layout):
  """``x @ W^T`` with ``W`` [out, in], stored as is or transposed: float32 inputs keep ~16 bits
  through bf16 weights (the hi + lo split), so the result is close to exact math on the
  unrounded input, far closer than rounding the input to bf16 would be; one row (padded or split
  into two) gives the same result as that row in a batch."""
  rng = np.random.default_rng(0)
  w_OI = jnp.asarray(rng.normal(size=(48, 40)) / np.sqrt(40), w_dtype)
  x_rI = jnp.asarray(rng.normal(size=(3, 40)), x_dtype)
  exact = np.asarray(x_rI, np.float64) @ np.asarray(w_OI, np.float64).T
  w = w_OI if layout == "oi" else w_OI.T
  project = functools.partial(linear.project, layout=layout)
  many = project(x_rI, w, jnp.float32)
  one = project(x_rI[None, 1:2], w, jnp.float32)  # [1, 1, I]: one row in all
  assert many.shape == (3, 48) and one.shape == (1, 1, 48) and one.dtype == jnp.float32
  np.testing.assert_allclose(one[0, 0], many[1], rtol=1e-6, atol=1e-6)
  err = np.abs(np.asarray(many) - exact).max()
  assert err < 1e-5 if x_dtype == jnp.float32 else err < 1e-2
  if (x_dtype, w_dtype) == (jnp.float32, jnp.bfloat16):
    rounded = np.asarray(x_rI.astype(jnp.bfloat16), np.float64) @ np.asarray(w_OI, np.float64).T
    assert err < np.abs(rounded - exact).max() / 30
  jaxpr = str(jax.make_jaxpr(lambda x: project(x, w, jnp.float32))(x_rI[:1]))
  assert ("concatenate" in jaxpr) == (w_dtype == jnp.bfloat16)  # f32 weights: a plain dot


def test_weight_layouts_compute_the_same_model(tmp_path):
  """On a CPU, float32 projections are stored [in, out] (``kernel``) and bfloat16 ones [out, in]
  (``weight``); ``to_layout`` converts either way exactly (a transposition), and the logits of
  the two layouts agree to float32 rounding (the matmuls sum in another order)."""
  model, _, _ = tiny_models.load_tiny(tmp_path, "untied")
  want = "io" if jax.default_backend() == "cpu" else "oi"
  assert linear.preferred_layout(jnp.float32) == want
  assert linear.preferred_layout(jnp.bfloat16) == "oi"
  denses = [m for _, m in nnx.iter_modules(model) if isinstance(m, linear.Dense)]
  assert len(denses) == 2 * 7 + 1 and {d.layout for d in denses} == {want}
  before = {id(d): np.asarray(d.matrix_OI()) for d in denses}
  tokens_BT = random_tokens(7, (2, 16))
  logits = forward(model, tokens_BT)
  for layout in ("oi", "io", "oi"):
    linear.to_layout(model, layout)
    assert {d.layout for d in denses} == {layout}
    for d in denses:
      assert not hasattr(d, linear.PARAM_NAME["io" if layout == "oi" else "oi"])
      np.testing.assert_array_equal(d.matrix_OI(), before[id(d)])
    np.testing.assert_allclose(forward(model, tokens_BT), logits, rtol=1e-5, atol=1e-5)
  assert model.output_matrix().shape == (model.config.vocab_size, model.config.hidden_size)
  with pytest.raises(ValueError, match="unknown weight layout 'xy'"):
    linear.to_layout(model, "xy")


def test_sharding_rules_follow_the_layout():
  """A column-parallel projection splits its output features in either layout."""
  mesh = sharding.make_mesh(data=1, model=1)
  P = jax.sharding.PartitionSpec
  for name, oi, io in [("layers.0.mlp.up_proj", P("model", None), P(None, "model")),
                       ("layers.0.mlp.down_proj", P(None, "model"), P("model", None)),
                       ("layers.3.self_attn.k_proj", P("model", None), P(None, "model")),
                       ("lm_head", P("model", None), P(None, "model"))]:
    assert sharding.spec_for(f"{name}.weight", (4, 4), mesh) == oi
    assert sharding.spec_for(f"{name}.kernel", (4, 4), mesh) == io


@pytest.mark.parametrize("kind", tiny_models.KINDS)
def test_scanned_layers_compute_the_same_model(tmp_path, kind):
  """``stack_layers`` runs the layers as one scanned body over stacked parameters: the same
  logits (float32 rounding) as the unrolled model and as transformers', cached decoding gives
  the same greedy tokens, and the parameters are the layers' own, stacked."""
  model, cfg, hf = tiny_models.load_tiny(tmp_path, kind)
  tokens_BT = random_tokens(3, (2, 24))
  unrolled = forward(model, tokens_BT)
  per_layer = {n: np.asarray(v) for n, v in _named(model).items() if n.startswith("layers.")}
  scanned = llama.stack_layers(nnx.clone(model))
  assert scanned.scan_layers and llama.stack_layers(scanned) is scanned
  names = _named(scanned)
  for name, value in names.items():
    if name.startswith("layers."):
      rest = name[len("layers."):]
      assert value.shape[0] == cfg.num_layers, name
      for i in range(cfg.num_layers):
        np.testing.assert_array_equal(value[i], per_layer[f"layers.{i}.{rest}"])
  assert len(names) == len(_named(model)) - (cfg.num_layers - 1) * len(
      [n for n in per_layer if n.startswith("layers.0.")])
  np.testing.assert_allclose(forward(scanned, tokens_BT), unrolled, rtol=1e-5, atol=1e-5)
  assert tiny_models.rel_err(forward(scanned, tokens_BT),
                             tiny_models.hf_logits(hf, tokens_BT)) < 1e-4
  prompts = [list(tokens_BT[0, :9]), list(tokens_BT[1, :4])]
  assert generate(scanned, prompts, max_new_tokens=12).tokens == generate(
      model, prompts, max_new_tokens=12).tokens
  other = "oi" if next(m for _, m in nnx.iter_modules(scanned)
                       if isinstance(m, linear.Dense)).layout == "io" else "io"
  np.testing.assert_allclose(forward(linear.to_layout(scanned, other), tokens_BT), unrolled,
                             rtol=1e-5, atol=1e-5)
  with pytest.raises(kvc.CacheError, match="stacked KV cache"):
    mask = kvc.visible_mask(jnp.zeros((1,), jnp.int32), jnp.ones((1, 1, 1), bool), 8)
    scanned(jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), mask,
            model.init_cache(1, 8))


def test_scanned_bf16_weights_compute_the_same_model():
  """With 16-bit weights the scan slices their bits on a CPU (``llama._as_bits``): the same
  weights reach each layer, so the logits equal the unrolled model's."""
  model = llama.Llama(tiny_models.TINY_LLM, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  tokens_BT = random_tokens(6, (2, 10), tiny_models.TINY_VOCAB)
  want = forward(model, tokens_BT)
  scanned = llama.stack_layers(nnx.clone(model))
  assert scanned.layers.mlp.up_proj.matrix[...].dtype == jnp.bfloat16
  np.testing.assert_allclose(forward(scanned, tokens_BT), want, rtol=1e-5, atol=1e-5)


def _named(model) -> dict:
  return {sharding.path_name(path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model))}


def test_sharding_splits_scanned_layers_past_their_layer_axis():
  """Stacked layers (``layers.mlp.up_proj.weight``, [L, out, in]) keep the layer axis whole
  and split the rest by the per-layer rules; a scanned model placed on a (data, model) mesh
  computes what it computed on one device."""
  mesh = sharding.make_mesh(data=4, model=2)
  P = jax.sharding.PartitionSpec
  assert sharding.spec_for("layers.mlp.up_proj.weight", (3, 4, 4), mesh) == P(None, "model", None)
  assert sharding.spec_for("layers.mlp.down_proj.kernel", (3, 4, 4), mesh) == P(None, "model", None)
  assert sharding.spec_for("layers.2.mlp.up_proj.weight", (4, 4), mesh) == P("model", None)
  assert sharding.spec_for("layers.input_layernorm.scale", (3, 4), mesh) == P()
  model = llama.stack_layers(tiny_models.tiny_llm())
  tokens_BT = random_tokens(5, (4, 12), tiny_models.TINY_VOCAB)
  want = forward(model, tokens_BT)
  sharding.shard_module(model, mesh)
  q = model.layers.self_attn.q_proj.matrix[...]
  assert q.sharding.spec[0] is None and "model" in tuple(q.sharding.spec)
  np.testing.assert_allclose(forward(model, tokens_BT), want, rtol=1e-5, atol=1e-5)


# --- attention backends ----------------------------------------------------------------------


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU error path")
def test_cudnn_backend_on_cpu_is_a_clear_error(tmp_path):
  with pytest.raises(BackendError, match="cudnn.*GPU.*xla"):
    check_backend("cudnn")
  tiny_models.save(tiny_models.hf_model("llama"), tmp_path / "m")
  with pytest.raises(BackendError, match="cudnn"):
    load_llama(tmp_path / "m", backend="cudnn")


def _reference_attention(q_BTHE, k_BKSE, v_BKSE, mask_BTS):
  """Per (row, head) softmax attention in NumPy float64; head h reads kv head h // G."""
  B, T, H, E = q_BTHE.shape
  G = H // k_BKSE.shape[1]
  out = np.zeros((B, T, H, E))
  for b in range(B):
    for h in range(H):
      scores = q_BTHE[b, :, h] @ k_BKSE[b, h // G].T / np.sqrt(E)
      scores = np.where(mask_BTS[b], scores, -np.inf)
      p = np.exp(scores - scores.max(-1, keepdims=True))
      out[b, :, h] = (p / p.sum(-1, keepdims=True)) @ v_BKSE[b, h // G]
  return out


def _as_cache_layout(k_BKSE, v_BKSE):
  """[B, K, S, E] -> the cache's k_XES, v_XSE (X = K * B, head-major)."""
  B, K, S, E = k_BKSE.shape
  return (k_BKSE.transpose(1, 0, 3, 2).reshape(K * B, E, S),
          v_BKSE.transpose(1, 0, 2, 3).reshape(K * B, S, E))


def test_xla_attention_matches_per_head_reference():
  """Grouped-query attention over the cache layout, rows with different visible slots."""
  rng = np.random.default_rng(0)
  B, T, S, H, K, E = 2, 3, 10, 6, 2, 8
  q = rng.standard_normal((B, T, H, E)).astype(np.float32)
  k = rng.standard_normal((B, K, S, E)).astype(np.float32)
  v = rng.standard_normal((B, K, S, E)).astype(np.float32)
  mask = np.asarray(kvc.visible_mask(jnp.array([4, 7]), kvc.causal_mask(jnp.ones((B, T), bool)),
                                     S))
  out = attend(jnp.asarray(q), *map(jnp.asarray, _as_cache_layout(k, v)), jnp.asarray(mask),
               backend="xla")
  np.testing.assert_allclose(np.asarray(out), _reference_attention(q, k, v, mask), atol=1e-5)


def test_unknown_backend_is_a_clear_error():
  with pytest.raises(BackendError, match="unknown attention backend 'flash'"):
    check_backend("flash")
  x = jnp.zeros((1, 1, 2, 4))
  kv = jnp.zeros((2, 4, 1))
  with pytest.raises(BackendError, match="unknown"):
    attend(x, kv, kv.transpose(0, 2, 1), jnp.ones((1, 1, 1), bool), backend="flash")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
def test_cudnn_and_pallas_match_xla_on_gpu():
  rng = np.random.default_rng(0)
  B, T, S, H, K, E = 2, 8, 256, 8, 2, 64
  q = jnp.asarray(rng.standard_normal((B, T, H, E)), jnp.bfloat16)
  k_BKSE, v_BKSE = (jnp.asarray(rng.standard_normal((B, K, S, E)), jnp.bfloat16)
                    for _ in range(2))
  mask = kvc.visible_mask(jnp.array([20, 140]), kvc.causal_mask(jnp.ones((B, T), bool)), S)
  ref = attend(q, *_as_cache_layout(k_BKSE, v_BKSE), mask, backend="xla").astype(jnp.float32)
  k_BSKE, v_BSKE = k_BKSE.transpose(0, 2, 1, 3), v_BKSE.transpose(0, 2, 1, 3)
  out = attend(q, k_BSKE, v_BSKE, mask, backend="cudnn").astype(jnp.float32)  # its layout
  np.testing.assert_allclose(out, ref, atol=3e-2)
  out = attend(q, k_BKSE, v_BKSE, mask, backend="pallas").astype(jnp.float32)  # Triton
  np.testing.assert_allclose(out, ref, atol=3e-2)


# --- the real SmolLM2-135M (slow) ------------------------------------------------------------

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works, with an example in Python.",
    "What are three reasons the Roman Empire declined?",
    "Translate to French: The weather is lovely today and we are going to the beach.",
]


@pytest.fixture(scope="module")
def hf_smollm2():
  import torch
  from transformers import AutoModelForCausalLM

  from redrafter_jax.weights import fetch

  path = fetch.ensure_model("smollm2-135m")
  model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                               dtype=torch.float32)
  return model.eval()


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2, hf_smollm2):
  from redrafter_jax.weights.tokenizer import encode

  model, cfg, tok = smollm2
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
  for prompt in PROMPTS:
    ids = np.array([encode(tok, prompt, chat=True)], np.int32)
    ref = tiny_models.hf_logits(hf_smollm2, ids)
    assert tiny_models.rel_err(forward(model, ids), ref) < 1e-3, prompt


@pytest.mark.slow
def test_smollm2_greedy_64_tokens_match_transformers(smollm2, hf_smollm2):
  import torch

  from redrafter_jax.weights.tokenizer import encode

  model, _, tok = smollm2
  eos = hf_smollm2.generation_config.eos_token_id
  eos = [eos] if isinstance(eos, int) else list(eos)
  full_length = 0
  for prompt in PROMPTS[:2]:
    ids = encode(tok, prompt, chat=True)
    ours = generate(model, [ids], max_new_tokens=64, stop_ids=eos).tokens[0]
    with torch.no_grad():
      ref = hf_smollm2.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                do_sample=False, max_new_tokens=64)[0, len(ids):].tolist()
    # Both stop at the same EOS (included) or both run the full 64 tokens.
    assert ours == ref, prompt
    full_length += len(ours) == 64
  assert full_length >= 1  # at least one comparison spans all 64 tokens
