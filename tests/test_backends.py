"""Attention backends and KV-cache layouts give the same results: the cache's write, commit and
row copy in every layout, the Pallas kernel (interpret mode) against ``xla`` on random trees,
lengths and rows, whole tiny models on every layout and backend, and context buckets."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tiny_models
from redrafter_jax.config import DecodeConfig, DrafterConfig, LlamaConfig
from redrafter_jax.inference.ar import generate
from redrafter_jax.inference.decode import decode
from redrafter_jax.models import kv_cache as kvc
from redrafter_jax.models.attention import BackendError, attend
from redrafter_jax.models.drafter import Drafter
from redrafter_jax.models.linear import project
from redrafter_jax.models.llama import Llama
from redrafter_jax.models.pallas_attention import attend_pallas, filled_slots

pytestmark = pytest.mark.usefixtures("float32_matmuls")  # float32 parity: no TF32 on GPUs

LAYOUTS = kvc.LAYOUTS


def _filled_cache(layout, B=3, K=2, S=16, E=4, layers=2, seed=0):
  """A cache in ``layout`` holding the same random [B, K, S, E] values in every layout."""
  rng = np.random.default_rng(seed)
  cache = kvc.init(layers, B, S, K, E, layout=layout)
  ks, vs = [], []
  for _ in range(layers):
    k_BKSE, v_BKSE = (jnp.asarray(rng.standard_normal((B, K, S, E)), jnp.float32)
                      for _ in range(2))
    k_BSKE, v_BSKE = k_BKSE.transpose(0, 2, 1, 3), v_BKSE.transpose(0, 2, 1, 3)
    k, v = kvc.from_BTKE(k_BSKE, v_BSKE, layout)  # S in the place of T: the same layout
    ks.append(k)
    vs.append(v)
  return cache.replace(k=tuple(ks), v=tuple(vs), lengths_B=jnp.array([3, 0, 9], jnp.int32))


def _as_BKSE(cache):
  return [np.asarray(a) for i in range(cache.num_layers) for a in cache.layer_BKSE(i)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_shapes_and_properties(layout):
  cache = kvc.init(3, 2, 16, 4, 8, layout=layout)
  assert (cache.size, cache.batch, cache.num_kv_heads, cache.num_layers) == (16, 2, 4, 3)
  k, v = cache.layer(0, 8)
  assert kvc.to_BKSE(k, v, 2, layout)[0].shape == (2, 4, 8, 8)
  with pytest.raises(kvc.CacheError, match="reads 17 slots of a cache of 16"):
    cache.layer(0, 17)


def test_unknown_layout_is_a_clear_error():
  with pytest.raises(kvc.CacheError, match="unknown KV-cache layout 'SEK'"):
    kvc.init(1, 1, 4, 1, 1, layout="SEK")


def test_write_commit_and_put_rows_agree_across_layouts():
  """The same writes and commits leave the same [B, K, S, E] contents in every layout (with
  writes running past the cache's end dropped) and differ from doing nothing."""
  rng = np.random.default_rng(1)
  new_BTKE = jnp.asarray(rng.standard_normal((3, 8, 2, 4)), jnp.float32)
  path_BA = jnp.array([[0, 2, 5], [1, 3, 4], [0, 6, 7]])
  results = {}
  for layout in LAYOUTS:
    cache = _filled_cache(layout)
    before = _as_BKSE(cache)
    for layer in range(cache.num_layers):
      cache = kvc.write_layer(cache, layer, new_BTKE * (layer + 1), -new_BTKE)
    written = _as_BKSE(cache)
    cache = kvc.commit(cache, path_BA, jnp.array([3, 1, 2]))
    committed = _as_BKSE(cache)
    # Two prefilled rows of 8 slots: the first into row 1, the second a padding row (index 3
    # >= batch 3), written nowhere.
    rows = kvc.init(2, 2, 8, 2, 4, layout=layout)
    rows = kvc.write_layer(rows, 1, new_BTKE[:2] + 5, new_BTKE[:2] - 5)
    cache = kvc.put_rows(cache, jnp.array([1, 3]), kvc.advance(rows, jnp.array([8, 7])))
    results[layout] = (written, _as_BKSE(cache), np.asarray(cache.lengths_B))
    assert not np.array_equal(before[0], written[0])
    # Only row 1's first 8 slots changed: rows 0 and 2, and row 1's slots 8.., are as committed.
    for got, was in zip(results[layout][1], committed):
      np.testing.assert_array_equal(got[[0, 2]], was[[0, 2]], err_msg=layout)
      np.testing.assert_array_equal(got[1, :, 8:], was[1, :, 8:], err_msg=layout)
  ref = results["XES"]
  for layout in LAYOUTS:
    for got, want in zip(results[layout][0] + results[layout][1], ref[0] + ref[1]):
      np.testing.assert_array_equal(got, want, err_msg=layout)
    np.testing.assert_array_equal(results[layout][2], [6, 8, 11])  # row 1: the put length
  # Spot-check the XES reference itself: row 2 (length 9) took new token 0..6 at slots 9..15
  # (7 past the end dropped), then committed path [0, 6] to slots 9, 10.
  k0 = ref[1][0]
  np.testing.assert_array_equal(k0[2, :, 9], np.asarray(new_BTKE[2, 0]))
  np.testing.assert_array_equal(k0[2, :, 10], np.asarray(new_BTKE[2, 6]))
  # Row 1 holds the first prefilled row in its first 8 slots (layer 1 the row's writes, layer
  # 0 zeros) and what it held before in the rest; rows 0 and 2 are as committed.
  np.testing.assert_array_equal(ref[1][2][1, :, :8],
                                np.asarray(new_BTKE[0] + 5).transpose(1, 0, 2))
  np.testing.assert_array_equal(ref[1][3][1, :, :8],
                                np.asarray(new_BTKE[0] - 5).transpose(1, 0, 2))
  np.testing.assert_array_equal(ref[1][0][1, :, :8], 0)


def test_put_rows_rejects_another_layout():
  with pytest.raises(kvc.CacheError, match="put_rows: needs rows of layout 'BKSE'"):
    kvc.put_rows(kvc.init(1, 2, 8, 1, 1, layout="BKSE"), jnp.array([0]),
                     kvc.init(1, 1, 8, 1, 1))


# --- attention: every layout, and the Pallas kernel -------------------------------------------


def _random_tree_mask(rng, T):
  """``[T, T]``: a random tree over T nodes in topological order (node 0 the root)."""
  return tiny_models.ancestor_mask([-1] + [int(rng.integers(0, t)) for t in range(1, T)])


def _random_case(seed, B, T, S, H, K, E):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((B, T, H, E)), jnp.float32)
  k_BKSE, v_BKSE = (jnp.asarray(rng.standard_normal((B, K, S, E)), jnp.float32)
                    for _ in range(2))
  lengths = jnp.asarray(rng.integers(0, S - T + 1, B), jnp.int32)
  tree_BTT = jnp.asarray(np.stack([_random_tree_mask(rng, T) for _ in range(B)]))
  return q, k_BKSE, v_BKSE, kvc.visible_mask(lengths, tree_BTT, S)


def _in_layout(k_BKSE, v_BKSE, layout):
  return kvc.from_BTKE(k_BKSE.transpose(0, 2, 1, 3), v_BKSE.transpose(0, 2, 1, 3), layout)


@pytest.mark.parametrize("seed,B,T,S,H,K,E", [(0, 1, 5, 64, 6, 2, 8), (1, 3, 9, 96, 4, 4, 16),
                                              (2, 4, 16, 128, 9, 3, 8), (3, 2, 1, 40, 2, 1, 8)])
def test_pallas_matches_xla_on_random_trees(seed, B, T, S, H, K, E):
  q, k_BKSE, v_BKSE, mask = _random_case(seed, B, T, S, H, K, E)
  ref = attend(q, *_in_layout(k_BKSE, v_BKSE, "XES"), mask, backend="xla")
  for layout in ("BSKE", "BKSE"):
    got = attend(q, *_in_layout(k_BKSE, v_BKSE, layout), mask, backend="xla", layout=layout)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5, err_msg=layout)
  for block_k in (8, 32):
    out = attend_pallas(q, k_BKSE, v_BKSE, mask, interpret=True, block_k=block_k)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)
  out = attend(q, k_BKSE, v_BKSE, mask, backend="pallas")
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)


def test_pallas_reads_only_the_blocks_a_row_has_filled():
  """NaN keys and values in every block past a row's last visible slot leave the output finite
  and equal to xla's on the clean cache: those blocks are never read."""
  B, T, S, H, K, E, block = 3, 4, 64, 4, 2, 8, 8
  q, k_BKSE, v_BKSE, _ = _random_case(7, B, T, S, H, K, E)
  lengths = jnp.array([0, 13, 40], jnp.int32)
  rng = np.random.default_rng(7)
  mask = kvc.visible_mask(lengths, jnp.asarray(np.stack([_random_tree_mask(rng, T)] * B)), S)
  filled = np.asarray(filled_slots(mask))
  np.testing.assert_array_equal(filled, np.asarray(lengths) + T)
  first_unread_B = -(-filled // block) * block
  unread_BS = np.arange(S)[None, :] >= first_unread_B[:, None]
  poison = lambda a: jnp.where(jnp.asarray(unread_BS)[:, None, :, None], jnp.nan, a)
  ref = attend(q, *_in_layout(k_BKSE, v_BKSE, "XES"), mask, backend="xla")
  out = attend_pallas(q, poison(k_BKSE), poison(v_BKSE), mask, interpret=True, block_k=block)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)
  # And the poison is live: the xla reference, which reads every slot, is spoilt by it.
  spoilt = attend(q, *_in_layout(poison(k_BKSE), poison(v_BKSE), "XES"), mask, backend="xla")
  assert np.isnan(np.asarray(spoilt)).any()


def test_backend_reads_only_its_layout():
  q, k_BKSE, v_BKSE, mask = _random_case(0, 1, 2, 8, 2, 1, 4)
  with pytest.raises(BackendError, match="'pallas' reads the BKSE cache layout, got XES"):
    attend(q, *_in_layout(k_BKSE, v_BKSE, "XES"), mask, backend="pallas", layout="XES")


# --- whole models: every layout and backend ---------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0, 1))
def _forward(graphdef, width, state, cache, tokens_BT, positions_BT, mask_BTT):
  model = nnx.merge(graphdef, state)
  mask_BTS = kvc.visible_mask(cache.lengths_B, mask_BTT, width or cache.size)
  logits_BTV, _, cache = model(tokens_BT, positions_BT, mask_BTS, cache)
  return logits_BTV, cache


def _prefill_tree_commit_follow(model, layout, width=None):
  """Prefill two prompts, verify a packed tree, commit a path, run one more token: the logits
  of each forward and the final cache (as [B, K, S, E])."""
  graphdef, state = nnx.split(model)
  run = lambda cache, *args: _forward(graphdef, width, state, cache,
                                      *(jnp.asarray(a) for a in args))
  prompts = np.array([tiny_models.random_tokens(0, 12), tiny_models.random_tokens(1, 12)],
                     np.int32)
  lengths = np.array([12, 7], np.int32)
  cache = model.init_cache(2, 64, layout)
  assert cache.layout == layout
  valid = np.arange(12)[None] < lengths[:, None]
  l0, cache = run(cache, prompts, np.broadcast_to(np.arange(12), (2, 12)),
                  kvc.causal_mask(jnp.asarray(valid)))
  cache = kvc.advance(cache, jnp.asarray(lengths))
  tree = np.stack([_random_tree_mask(np.random.default_rng(s), 6) for s in (3, 4)])
  depth = tree.sum(-1) - 1
  l1, cache = run(cache, np.array([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]], np.int32),
                  lengths[:, None] + depth, tree)
  cache = kvc.commit(cache, jnp.array([[0, 1, 1], [0, 2, 2]]), jnp.array([2, 1]))
  l2, cache = run(cache, np.array([[20], [21]], np.int32),
                  np.asarray(cache.lengths_B)[:, None], np.ones((2, 1, 1), bool))
  return [np.asarray(x) for x in (l0, l1, l2)], _as_BKSE(cache)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  folder = tiny_models.save(tiny_models.hf_model("llama", seed=2),
                            tmp_path_factory.mktemp("tiny") / "llama")
  return folder


def test_tiny_model_same_outputs_on_every_layout_and_backend(tiny):
  from redrafter_jax.weights.llama_weights import load_llama

  xla, _ = load_llama(tiny)
  ref_logits, ref_cache = _prefill_tree_commit_follow(xla, "XES")
  runs = {f"xla/{layout}": (xla, layout) for layout in ("BSKE", "BKSE")}
  runs["pallas"] = (load_llama(tiny, backend="pallas")[0], "BKSE")
  for name, (model, layout) in runs.items():
    logits, cache = _prefill_tree_commit_follow(model, layout)
    for got, want in zip(logits, ref_logits):
      np.testing.assert_allclose(got, want, atol=1e-5, err_msg=name)
    for got, want in zip(cache, ref_cache):
      np.testing.assert_allclose(got, want, atol=1e-5, err_msg=name)
  # A context bucket (32 of the 64 slots, enough for every row) gives the same logits.
  logits, _ = _prefill_tree_commit_follow(xla, "XES", width=32)
  for got, want in zip(logits, ref_logits):
    np.testing.assert_allclose(got, want, atol=1e-5, err_msg="bucket")


def test_pallas_backend_decodes_the_same_greedy_tokens():
  cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
  xla = Llama(cfg, rngs=nnx.Rngs(0))
  pallas = Llama(cfg, backend="pallas", rngs=nnx.Rngs(0))
  drafter = Drafter(DrafterConfig(vocab_size=64, hidden_size=32, exit_dim=48), rngs=nnx.Rngs(1))
  prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
  dcfg = DecodeConfig(beam_width=3, beam_length=3, max_new_tokens=12)
  want = generate(xla, prompts, max_new_tokens=12).tokens
  assert decode(xla, drafter, prompts, dcfg).tokens == want
  assert decode(pallas, drafter, prompts, dcfg).tokens == want
  assert generate(pallas, prompts, max_new_tokens=12).tokens == want


# --- CPU-only numerics ------------------------------------------------------------------------


def test_projection_off_cpu_is_one_exact_dot():
  """Off CPU, float32 activations with bf16 weights are one float32 dot (no hi/lo split, no row
  duplication): equal to float32 weights; on CPU the split is there."""
  rng = np.random.default_rng(0)
  x_rI = jnp.asarray(rng.standard_normal((1, 32)), jnp.float32)
  w_OI = jnp.asarray(rng.standard_normal((16, 32)), jnp.bfloat16)
  exact = np.asarray(x_rI, np.float64) @ np.asarray(w_OI, np.float64).T
  off = project(x_rI, w_OI, jnp.float32, cpu=False)
  np.testing.assert_allclose(np.asarray(off), exact, rtol=1e-5, atol=1e-5)
  jaxpr = lambda cpu, x, w: str(jax.make_jaxpr(lambda a: project(a, w, x.dtype, cpu=cpu))(x))
  assert "concatenate" not in jaxpr(False, x_rI, w_OI)
  assert "concatenate" in jaxpr(True, x_rI, w_OI)
  x_bf = x_rI.astype(jnp.bfloat16)
  assert "concatenate" not in jaxpr(False, x_bf, w_OI)  # one bf16 row: not duplicated off CPU
  assert "concatenate" in jaxpr(True, x_bf, w_OI)


def test_a_context_bucket_reads_only_its_slots(tiny):
  """NaN in every cache slot past the bucket leaves a bucketed forward finite; the same forward
  over the whole cache reads them (the poison is live)."""
  from redrafter_jax.weights.llama_weights import load_llama

  for backend in ("xla", "pallas"):
    model, _ = load_llama(tiny, backend=backend)
    graphdef, state = nnx.split(model)
    cache = model.init_cache(1, 64)
    poison = lambda a, axis: jnp.where(
        (jnp.arange(a.shape[axis]) >= 32).reshape([-1 if i == axis else 1
                                                   for i in range(a.ndim)]), jnp.nan, a)
    k_axis = 2 if cache.layout in ("XES", "BKSE") else 1
    v_axis = {"XES": 1, "BSKE": 1, "BKSE": 2}[cache.layout]
    cache = cache.replace(k=tuple(poison(a, k_axis) for a in cache.k),
                          v=tuple(poison(a, v_axis) for a in cache.v),
                          lengths_B=jnp.array([20], jnp.int32))
    args = (jnp.ones((1, 3), jnp.int32), jnp.array([[20, 21, 22]]),
            kvc.causal_mask(jnp.ones((1, 3), bool)))
    bucketed, _ = _forward(graphdef, 32, state, cache, *args)
    assert np.isfinite(np.asarray(bucketed)).all(), backend
    if backend == "xla":  # pallas skips the unfilled blocks even over the whole cache
      whole, _ = _forward(graphdef, None, state, cache, *args)
      assert np.isnan(np.asarray(whole)).any()
