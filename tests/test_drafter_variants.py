"""Drafter variants of issue 36 (each an option, off by default): multi-layer features
(``DrafterConfig.feature_layers``), training-time test (``train.self_feed``) and the ranking loss
(``train.rank_loss_weight``): their math against plain references, exactness of decoding, the
checkpoint format and the exporters that refuse them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from redrafter_jax.config import ConfigError, DecodeConfig, DrafterConfig
from redrafter_jax.inference import step as step_lib
from redrafter_jax.inference.ar import generate
from redrafter_jax.inference.decode import ReDrafter, decode
from redrafter_jax.inference.runtime import GenerateError
from redrafter_jax.models import kv_cache as kvc
from redrafter_jax.models.drafter import Drafter
from redrafter_jax.models.llama import Llama, stack_layers
from redrafter_jax.training import feature_store, losses
from redrafter_jax.weights.drafter_io import load_drafter, save_drafter
from redrafter_jax.weights.params import flat_params
from tests.test_losses import _batch, _example, _split
from tests.tiny_models import TINY_LLM, TINY_VOCAB

pytestmark = pytest.mark.usefixtures("float32_matmuls")

LLM3 = dataclasses.replace(TINY_LLM, num_layers=3)
LAYERS = (0, 2)


@pytest.fixture(scope="module")
def llm():
  return Llama(LLM3, rngs=nnx.Rngs(0))


def feature_drafter(layers=LAYERS, seed=1, D=LLM3.hidden_size, V=TINY_VOCAB, **kw) -> Drafter:
  cfg = DrafterConfig(vocab_size=V, hidden_size=D, exit_dim=48, feature_layers=layers, **kw)
  drafter = Drafter(cfg, rngs=nnx.Rngs(seed))
  # A fresh feature_proj copies the last layer; randomise it so every layer matters.
  k = drafter.feature_proj.kernel
  k.set_value(jax.random.normal(jax.random.key(seed), k.shape) * 0.3)
  return drafter


def all_layer_outputs(llm, tokens_BT):
  """A plain forward that keeps every decoder layer's output (before any norm)."""
  B, T = tokens_BT.shape
  from redrafter_jax.models.llama import rope_cos_sin, rope_inv_freq

  positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
  mask_BTT = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
  x = llm.embed_tokens(tokens_BT)
  cos, sin = rope_cos_sin(positions_BT, rope_inv_freq(llm.config), llm.dtype)
  outs = []
  for i, layer in enumerate(llm.layers):
    x, _ = layer(x, cos, sin, mask_BTT, None, i, llm.backend)
    outs.append(x)
  return outs, positions_BT, mask_BTT


def test_config_validation_and_reference_dict():
  base = dict(vocab_size=8, hidden_size=4)
  assert "feature_layers" not in DrafterConfig(**base).to_dict()  # the reference's config.json
  assert DrafterConfig(**base, feature_layers=[1, 3]).feature_layers == (1, 3)
  assert DrafterConfig(**base, feature_layers=(1, 3)).context_width == 8
  for bad in ((1, 1), (-1,), ("a",)):
    with pytest.raises(ConfigError, match="feature_layers"):
      DrafterConfig(**base, feature_layers=bad)


@pytest.mark.parametrize("scan", [False, True])
def test_fused_features_equal_a_plain_all_layer_forward(llm, scan):
  tokens_BT = jnp.asarray(np.random.default_rng(0).integers(0, TINY_VOCAB, (2, 7)), jnp.int32)
  outs, positions_BT, mask_BTT = all_layer_outputs(llm, tokens_BT)
  model = stack_layers(nnx.clone(llm)) if scan else llm
  hidden_BTD, taps_BTX, _ = model.forward_layers(tokens_BT, positions_BT, mask_BTT,
                                                 layers=LAYERS)
  plain_BTD, _ = llm.forward_hidden(tokens_BT, positions_BT, mask_BTT)
  np.testing.assert_allclose(hidden_BTD, plain_BTD, rtol=1e-5, atol=1e-5)
  want = np.concatenate([np.asarray(llm.norm(outs[i])) for i in LAYERS], -1)
  np.testing.assert_allclose(taps_BTX, want, rtol=1e-5, atol=1e-5)
  # The drafter's context: feature_proj of that concatenation (kernel [k*D, D], no bias).
  drafter = feature_drafter()
  np.testing.assert_allclose(drafter.context(taps_BTX),
                             want @ np.asarray(drafter.feature_proj.kernel[...]), rtol=1e-4,
                             atol=1e-5)
  with pytest.raises(ValueError, match="layers"):
    llm.forward_layers(tokens_BT, positions_BT, mask_BTT, layers=(3,))


def test_fresh_feature_proj_starts_as_the_last_listed_layer():
  cfg = DrafterConfig(vocab_size=16, hidden_size=4, feature_layers=(0, 5))
  drafter = Drafter(cfg, rngs=nnx.Rngs(0))
  x = np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32)
  np.testing.assert_allclose(drafter.context(jnp.asarray(x)), x[:, 4:], rtol=1e-6)


PROMPTS = [[1, 5, 9, 2], [7, 3], [11, 12, 13, 14, 15, 16]]


def test_multi_layer_drafter_greedy_equals_ar_and_carries_the_layers(llm):
  drafter = feature_drafter()
  cfg = DecodeConfig(beam_width=3, beam_length=4, max_new_tokens=20)
  ar = generate(llm, PROMPTS, max_new_tokens=20)
  assert decode(llm, drafter, PROMPTS, cfg).tokens == ar.tokens
  seen = []
  assert ReDrafter(llm, drafter, cfg).stepwise(PROMPTS, on_step=seen.append).tokens == ar.tokens
  assert seen[0].h_BD.shape == (3, 2 * LLM3.hidden_size)
  # The state's h after init is the layers' states at each prompt's last token.
  rd = ReDrafter(llm, drafter, cfg)
  p = rd.prepare(PROMPTS)
  state = rd.start(p)
  tokens_BT = p.tokens_BT
  outs, _, _ = all_layer_outputs(llm, tokens_BT)
  last = np.asarray(p.lengths_B) - 1
  want = np.concatenate([np.asarray(llm.norm(outs[i]))[np.arange(3), last] for i in LAYERS], -1)
  np.testing.assert_allclose(state.h_BD, want, rtol=1e-4, atol=1e-5)


def test_decode_refuses_layers_the_llm_lacks(llm):
  with pytest.raises(GenerateError, match="feature_layers"):
    ReDrafter(llm, feature_drafter(layers=(0, 3)), DecodeConfig())


@pytest.mark.parametrize("option", [dict(feature_layers=LAYERS), dict(copy_ngram=3),
                                    dict(context_attention=16, context_heads=4)],
                         ids=lambda o: next(iter(o)))
def test_redrafter_jax_format_round_trip_and_other_exporters_refuse(tmp_path, option):
  """Each option beyond the reference drafter: the redrafter-jax format holds it (same config,
  same tensors), the reference, MLX and TensorRT-LLM exports refuse it naming the option, and a
  reference config.json that names it is refused rather than read as a reference drafter."""
  import json

  cfg = DrafterConfig(vocab_size=TINY_VOCAB, hidden_size=LLM3.hidden_size, exit_dim=48, **option)
  drafter = Drafter(cfg, rngs=nnx.Rngs(1))
  out = save_drafter(drafter, tmp_path / "d", format="redrafter-jax")
  back = load_drafter(out)
  assert back.config == drafter.config
  a, b = flat_params(drafter), flat_params(back)
  assert sorted(a) == sorted(b) and len(a) > len(flat_params(
      Drafter(DrafterConfig(vocab_size=TINY_VOCAB, hidden_size=LLM3.hidden_size, exit_dim=48),
              rngs=nnx.Rngs(1))))
  for name in a:
    np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))
  config = json.loads((out / "config.json").read_text())
  assert config["model_type"] == "redrafter_jax_drafter"
  name, value = next(iter(option.items()))
  assert config[name] == (list(value) if isinstance(value, tuple) else value)
  said = str(list(value) if isinstance(value, tuple) else value).replace("[", r"\[")
  for fmt in ("reference", "mlx", "trtllm"):
    with pytest.raises(ConfigError, match=rf"cannot hold drafter.{name}={said}"):
      save_drafter(drafter, tmp_path / fmt, format=fmt)
  config["model_type"] = "recurrent_drafting_drafter"
  (out / "config.json").write_text(json.dumps(config))
  with pytest.raises(ConfigError, match=name):
    load_drafter(out)


def test_mlx_runtime_runs_the_redrafter_jax_format(tmp_path):
  pytest.importorskip("mlx.core")
  from redrafter_jax.inference.beam_search import beam_search
  from redrafter_jax.weights import mlx_runtime

  drafter = feature_drafter()
  out = save_drafter(drafter, tmp_path / "d", format="redrafter-jax")
  mlx_drafter = mlx_runtime.load_mlx_drafter(out)
  rng = np.random.default_rng(0)
  embed = rng.normal(size=(TINY_VOCAB, LLM3.hidden_size)).astype(np.float32)
  feats = rng.normal(size=(2, 2 * LLM3.hidden_size)).astype(np.float32)
  g0 = np.array([3, 4], np.int32)
  got = mlx_runtime.beam_search(mlx_drafter, embed, feats, g0, beam_width=3, beam_length=4)
  want = beam_search(drafter, jnp.asarray(embed), drafter.context(jnp.asarray(feats)),
                     jnp.asarray(g0), beam_width=3, beam_length=4)
  np.testing.assert_array_equal(np.array(got.beams_BWL), np.asarray(want.beams_BWL))
  np.testing.assert_allclose(np.array(got.score_BW), np.asarray(want.score_BW), rtol=1e-4)


# ------------------------------------------------------------------------------------------
# Losses.

V, D = 50, 8


def _loss_drafter(seed=0):
  from tests.test_losses import _drafter

  return _drafter(seed)


def test_self_feed_zero_is_todays_loss_and_one_feeds_the_drafters_own_tokens():
  drafter = _loss_drafter()
  drafter_of, params = _split(drafter)
  tokens, mask, seg, hidden, emb = _example()
  args = (drafter_of, params, _batch(hidden, emb, tokens, mask, seg))
  n = 3
  cfg = losses.LossConfig(num_steps=n, chunk=4)
  base, m0 = losses.distill_loss(*args, cfg)
  zero, mz = losses.distill_loss(*args, dataclasses.replace(cfg, self_feed=0.0),
                                 rng=jax.random.key(0))
  assert float(zero) == float(base)
  own, m1 = losses.distill_loss(*args, dataclasses.replace(cfg, self_feed=1.0),
                                rng=jax.random.key(0))
  # Reference: unroll by hand, step i > 1 reading the embedding of step i-1's argmax.
  B, T = tokens.shape
  targets, counts = map(np.asarray, losses.targets_and_weights(*map(jnp.asarray,
                                                                    (tokens, mask, seg)), n))
  ce = np.zeros(n)
  differs = 0
  for b in range(B):
    for t in range(T):
      s = jnp.zeros((D,))
      prev = emb[tokens[b, t + 1]] if t + 1 < T else emb[0]
      for i in range(n):
        s = drafter.recur(s, jnp.asarray(prev))
        logits = np.asarray(drafter.logits(jnp.asarray(hidden[b, t]), s), np.float64)
        if counts[b, t, i]:
          ce[i] += np.log(np.exp(logits - logits.max()).sum()) + logits.max() - logits[
              targets[b, t, i]]
        prev = emb[int(np.argmax(logits))]
        data_next = tokens[b, t + i + 2] if t + i + 2 < T else 0
        differs += int(np.argmax(logits) != data_next and counts[b, t, i])
  assert differs > 0  # the drafter's own tokens are not the data's: the test can tell
  ce /= counts.sum(axis=(0, 1))
  np.testing.assert_allclose(np.asarray(m1["loss_n"]), ce, rtol=1e-5)
  np.testing.assert_allclose(float(own), ce.sum(), rtol=1e-5)
  assert abs(float(own) - float(base)) > 1e-3
  np.testing.assert_allclose(np.asarray(m1["loss_n"])[0], np.asarray(m0["loss_n"])[0], rtol=1e-6)


def test_plackett_luce_matches_a_brute_force_formula():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(4, 9)).astype(np.float32) * 2
  ranked = np.stack([rng.permutation(9)[:3] for _ in range(4)]).astype(np.int32)
  got = np.asarray(losses.plackett_luce_nll(jnp.asarray(logits), jnp.asarray(ranked)))
  want = []
  for row, r in zip(logits.astype(np.float64), ranked):
    left, nll = list(range(9)), []
    for tok in r:
      z = row[left]
      nll.append(np.log(np.exp(z).sum()) - row[tok])
      left.remove(tok)
    want.append(np.mean(nll))
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_rank_loss_adds_the_weighted_ranking_term_per_step():
  drafter_of, params = _split(_loss_drafter())
  tokens, mask, seg, hidden, emb = _example()
  teacher = np.random.default_rng(3).normal(size=(V, D)).astype(np.float32)
  args = (drafter_of, params, _batch(hidden, emb, tokens, mask, seg, teacher_out_VD=teacher))
  cfg = losses.LossConfig(num_steps=3, chunk=4, soft=False, step_weight_decay=0.5)
  plain, m = losses.distill_loss(*args, cfg)
  ranked, mr = losses.distill_loss(*args, dataclasses.replace(cfg, rank_weight=0.7, rank_top_k=4))
  rank_n = np.asarray(mr["rank_n"])
  assert (rank_n > 0).all()
  w = 0.5 ** np.arange(3)
  np.testing.assert_allclose(float(ranked), float(plain) + 0.7 * np.sum(w * rank_n), rtol=1e-5)
  # Step 1's ranking term by hand at one counted position: the LLM's top-4 at h_{t+1}.
  b, t = 0, 2
  logits = np.asarray(drafter_of(params).unroll_logits(
      jnp.asarray(hidden[b, t]), jnp.asarray(emb[tokens[b, t + 1:t + 2]])))[0]
  top = np.argsort(-(teacher @ hidden[b, t + 1]))[:4]
  one = losses.plackett_luce_nll(jnp.asarray(logits[None]), jnp.asarray(top[None], jnp.int32))
  all_sums = float(rank_n[0]) * float(np.asarray(mr["count_n"])[0])
  assert float(one[0]) < all_sums  # one term of the (positive) sum
  with pytest.raises(ValueError, match="teacher_out_VD"):
    losses.distill_loss(drafter_of, params, _batch(hidden, emb, tokens, mask, seg),
                        losses.LossConfig(num_steps=3, rank_weight=1.0))


def test_lookup_covered_positions_weigh_as_asked():
  """Where the context lookup has the next token right, every step of the position weighs
  ``lookup_covered_weight`` in the objective; the metrics stay unweighted."""
  # One sequence that repeats itself: at t = 3 (reads token 4 = 1, predicts token 5 = 2) and
  # t = 4 (reads 1 2, predicts 3) the lookup's copy is right; at t = 5 (reads 1 2 3) it copies 4
  # where 5 follows; tokens 7-9 never occurred before.
  tokens = np.array([[1, 2, 3, 4, 1, 2, 3, 5, 6, 7, 8, 9]], np.int32)
  seg = np.ones_like(tokens)
  mask = np.ones_like(tokens)
  mask[:, :2] = 0
  covered = np.asarray(losses.lookup_covered(jnp.asarray(tokens), jnp.asarray(seg), 3))
  assert np.flatnonzero(covered[0]).tolist() == [3, 4]
  drafter_of, params = _split(_loss_drafter())
  rng = np.random.default_rng(4)
  hidden = rng.normal(size=tokens.shape + (D,)).astype(np.float32)
  emb = rng.normal(size=(V, D)).astype(np.float32)

  def run(hid, weight):
    cfg = losses.LossConfig(num_steps=3, chunk=4, lookup_covered_weight=weight, lookup_ngram=3)
    return losses.distill_loss(drafter_of, params, _batch(hid, emb, tokens, mask, seg), cfg)

  plain, m1 = run(hidden, 1.0)
  weighted, mw = run(hidden, 0.3)
  for name in ("loss_n", "top1_n", "count_n"):  # the metrics do not move with the weight
    np.testing.assert_allclose(np.asarray(mw[name]), np.asarray(m1[name]), rtol=1e-6)
  assert abs(float(weighted) - float(plain)) > 1e-4
  # Position t reads only h_t here: with weight 0 the covered positions' states drop out of
  # the objective, and an uncovered position's do not.
  moved = hidden.copy()
  moved[0, [3, 4]] += 3.0
  assert float(run(moved, 0.0)[0]) == pytest.approx(float(run(hidden, 0.0)[0]), rel=1e-6)
  assert abs(float(run(moved, 1.0)[0]) - float(plain)) > 1e-4
  moved = hidden.copy()
  moved[0, 5] += 3.0
  assert abs(float(run(moved, 0.0)[0]) - float(run(hidden, 0.0)[0])) > 1e-4


def test_lookup_covered_weight_needs_a_lookup_beam_and_a_weight():
  from redrafter_jax.config import load_preset

  with pytest.raises(ConfigError, match="set decode.lookup_ngram"):
    load_preset(_tiny(), {"train.lookup_covered_weight": 0.5, "decode.lookup_ngram": 0})
  with pytest.raises(ConfigError, match="train.lookup_covered_weight must be a number >= 0"):
    load_preset(_tiny(), {"train.lookup_covered_weight": -1, "decode.lookup_ngram": 3})
  assert load_preset(_tiny(), {"decode.lookup_ngram": 0}).train.lookup_covered_weight == 1.0


def test_feature_context_is_what_the_drafter_reads():
  cfg = DrafterConfig(vocab_size=V, hidden_size=D, exit_dim=12, num_draft_layers=1,
                      feature_layers=(0, 1))
  drafter = Drafter(cfg, rngs=nnx.Rngs(0))
  k = drafter.feature_proj.kernel
  k.set_value(jax.random.normal(jax.random.key(2), k.shape) * 0.3)
  drafter_of, params = _split(drafter)
  tokens, mask, seg, hidden, emb = _example()
  ctx = np.random.default_rng(5).normal(size=hidden.shape[:2] + (2 * D,)).astype(np.float32)
  got, _ = losses.distill_loss(drafter_of, params,
                               _batch(hidden, emb, tokens, mask, seg, context_BTX=ctx),
                               losses.LossConfig(num_steps=3))
  # Same loss as a single-layer drafter fed the projected context directly.
  single = Drafter(DrafterConfig(vocab_size=V, hidden_size=D, exit_dim=12, num_draft_layers=1),
                   rngs=nnx.Rngs(0))
  nnx.update(single, nnx.state(drafter, nnx.Not(nnx.PathContains("feature_proj"))))
  s_of, s_params = _split(single)
  proj = np.asarray(drafter.context(jnp.asarray(ctx)))
  want, _ = losses.distill_loss(s_of, s_params, _batch(proj, emb, tokens, mask, seg),
                                losses.LossConfig(num_steps=3))
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)


# ------------------------------------------------------------------------------------------
# Training with each option (tiny config) and the precomputed features of a multi-layer drafter.

from tests.test_trainer import write_synthetic  # noqa: E402


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
  return write_synthetic(tmp_path_factory.mktemp("variants") / "syn", num=64)


@pytest.mark.parametrize("option", [
    {"drafter.feature_layers": [0, 1]},
    {"train.self_feed": 0.5},
    {"train.rank_loss_weight": 0.5},
    {"train.lookup_covered_weight": 0.25, "decode.lookup_ngram": 2},
], ids=["feature_layers", "self_feed", "rank_loss", "lookup_covered_weight"])
def test_short_training_with_each_option_decreases_the_loss(synthetic, tmp_path, option):
  from redrafter_jax.config import load_preset
  from redrafter_jax.training import trainer

  p = load_preset(_tiny(), {**_overrides(synthetic, tmp_path / "run"), **option})
  result = trainer.train(p, progress=False, export=True)
  loss = [r["loss"] for r in result.history]
  assert all(np.isfinite(loss)) and np.mean(loss[-3:]) < 0.8 * np.mean(loss[:3]), loss
  back = load_drafter(result.drafter_dir)
  assert back.config.feature_layers == tuple(option.get("drafter.feature_layers", ()))


def _tiny():
  from tests.test_trainer import TINY

  return TINY


def _overrides(data_dir, out_dir):
  return {"train.data": str(data_dir), "train.output_dir": str(out_dir), "train.seq_len": 64,
          "train.log_every": 2, "train.num_steps": 16, "train.learning_rate": 0.01}


def test_multi_layer_features_folder_gives_the_inline_loss(synthetic, tmp_path):
  from redrafter_jax.config import load_preset
  from redrafter_jax.training import data, features, trainer
  from redrafter_jax.weights.base_model import load_base_model

  llm, _ = load_base_model("random:tiny")
  feats = tmp_path / "f"
  features.write_features(llm, synthetic, feats, model_name="random:tiny", seq_len=64,
                          batch_tokens=256, feature_layers=(0, 1))
  p = load_preset(_tiny(), {**_overrides(synthetic, tmp_path / "run"),
                            "drafter.feature_layers": [0, 1], "train.soft_targets": True})
  _, drafter_of, _, params, vocab_ids_R = trainer._trainable_drafter(p, llm.config)
  kw = dict(seq_len=64, global_batch=4, seed=0, hidden_size=64)
  with pytest.raises(data.DataError, match="feature_layers"):
    data.make_iterator(synthetic, **kw, features=feats, feature_layers=(2,))  # not stored
  batch = next(data.make_iterator(synthetic, **kw, features=feats, feature_layers=(0, 1)))
  assert batch["hidden"].shape == (4, 64, 3 * 64)
  # the same folder serves fewer layers, down to the last hidden state alone (a baseline):
  # the same batches, with only their columns
  last = next(data.make_iterator(synthetic, **kw, features=feats))
  only_1 = next(data.make_iterator(synthetic, **kw, features=feats, feature_layers=(1,)))
  for name in ("tokens", "loss_mask"):
    np.testing.assert_array_equal(last[name], batch[name])
  np.testing.assert_array_equal(last["hidden"], batch["hidden"][..., :64])
  np.testing.assert_array_equal(only_1["hidden"],
                                np.concatenate([batch["hidden"][..., :64],
                                                batch["hidden"][..., 128:]], -1))
  assert feature_store.feature_columns([0, 1], [], 64) == slice(0, 64)
  assert feature_store.feature_columns([0, 1], [0], 64) == slice(0, 128)
  assert feature_store.feature_columns([0, 1], [0, 1], 64) is None
  np.testing.assert_array_equal(feature_store.feature_columns([0, 1], [1], 2), [0, 1, 4, 5])
  graphdef, state = nnx.split(llm)
  spec = trainer.LossSpec(graphdef, drafter_of, vocab_ids_R,
                          losses.LossConfig(num_steps=3, chunk=16, soft=True), (0, 1))
  inline = {k: jnp.asarray(v) for k, v in batch.items() if k != "hidden"}
  l1, _ = trainer._batch_loss(spec, state, inline)(params)
  l2, _ = trainer._batch_loss(spec, state, {k: jnp.asarray(v) for k, v in batch.items()})(params)
  np.testing.assert_allclose(float(l2), float(l1), rtol=1e-5)
  moved = dict(batch, hidden=np.concatenate([batch["hidden"][..., :64],
                                             2 * batch["hidden"][..., 64:]], -1))
  l3, _ = trainer._batch_loss(spec, state, {k: jnp.asarray(v) for k, v in moved.items()})(params)
  assert abs(float(l3) - float(l1)) > 1e-4  # the layer states are what the drafter reads


def test_features_folder_serves_the_last_layer_from_the_last_hidden_state(synthetic, tmp_path):
  """The last layer's tap is the last hidden state, which every folder stores: a folder made
  for layer 0 alone serves a drafter reading layers (0, 1) of a 2-layer LLM, with the batches a
  folder made for (0, 1) gives; without the LLM's layer count it refuses, naming the layers."""
  from redrafter_jax.training import data, features
  from redrafter_jax.weights.base_model import load_base_model

  llm, _ = load_base_model("random:tiny")
  assert llm.config.num_layers == 2
  both, first = tmp_path / "both", tmp_path / "first"
  for out, layers in ((both, (0, 1)), (first, (0,))):
    features.write_features(llm, synthetic, out, model_name="random:tiny", seq_len=64,
                            batch_tokens=256, feature_layers=layers)
  kw = dict(seq_len=64, global_batch=4, seed=0, hidden_size=64, feature_layers=(0, 1))
  want = next(data.make_iterator(synthetic, **kw, features=both))
  got = next(data.make_iterator(synthetic, **kw, features=first, num_layers=2))
  assert got["hidden"].shape == want["hidden"].shape == (4, 64, 3 * 64)
  for name in want:
    np.testing.assert_array_equal(got[name], want[name])
  with pytest.raises(data.DataError, match=r"feature_layers.*\[0, 1\]"):
    data.make_iterator(synthetic, **kw, features=first)
  with pytest.raises(data.DataError, match="or the last, 2"):  # layer 1 of 3 is not the last
    data.make_iterator(synthetic, **kw, features=first, num_layers=3)
  assert feature_store.feature_columns([0], [1, 0], 2, num_layers=2).tolist() == [0, 1, 0, 1, 2, 3]


def test_ablation_chain_tokens_is_one_plus_the_running_products():
  from redrafter_jax.training.ablation import chain_tokens

  row = {"top1_1": "0.5", "top1_2": "0.4", "top1_3": "0.5", "top1_4": ""}
  assert chain_tokens(row) == pytest.approx(1 + 0.5 + 0.2 + 0.1)
  assert chain_tokens({}) is None
