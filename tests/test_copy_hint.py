"""The copy hint (``DrafterConfig.copy_ngram``): the hint itself against a brute-force search, the
drafter's training path and beam search against a step-by-step reference, exactness of decoding,
growing a drafter into one with the hint, and the formats that hold or refuse it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from redrafter_jax.config import ConfigError, DecodeConfig, DrafterConfig
from redrafter_jax.inference.ar import generate
from redrafter_jax.inference.beam_search import beam_search
from redrafter_jax.inference.decode import decode
from redrafter_jax.models.context_copy import CopyHint, copy_hints, teacher_forced_hints
from redrafter_jax.models.drafter import Drafter, restrict_vocab
from redrafter_jax.training import losses
from redrafter_jax.training.grow import grow_as_asked
from redrafter_jax.weights.drafter_io import save_drafter
from tests.test_losses import _split
from tests.tiny_models import TINY_LLM, TINY_VOCAB, tiny_llm

pytestmark = pytest.mark.usefixtures("float32_matmuls")


def brute_hint(seq, q, K, seg=None):
  """The hint at query q by the definition: longest suffix match (<= K), latest on ties."""
  seg = [1] * len(seq) if seg is None else list(seg)
  best = (0, -1)
  if seg[q] == 0:
    return 0, 0
  for e in range(q):
    m = 0
    while (m < K and e - m >= 0 and seq[e - m] == seq[q - m] and seg[e - m] == seg[q]
           and seg[q - m] == seg[q]):
      m += 1
    if m > 0 and (m, e) > best:
      best = (m, e)
  m, e = best
  return (seq[e + 1], m) if m else (0, 0)


def test_hints_equal_the_definition_with_segments():
  rng = np.random.default_rng(0)
  for K in (1, 2, 4):
    tokens = rng.integers(0, 4, (3, 40)).astype(np.int32)  # a small alphabet: many matches
    seg = np.ones_like(tokens)
    seg[1, 17:] = 2
    seg[2, 30:] = 0
    hint = copy_hints(jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(40), (3, 40)),
                      max_ngram=K, segment_xS=jnp.asarray(seg))
    for b in range(3):
      for q in range(40):
        want = brute_hint(list(tokens[b]), q, K, list(seg[b]))
        assert (int(hint.token_x[b, q]), int(hint.length_x[b, q])) == want, (K, b, q)
  lengths = np.asarray(copy_hints(jnp.asarray(tokens), jnp.asarray([[39]] * 3), max_ngram=4)
                       .length_x)
  assert lengths.max() > 1  # longer matches happen, so the test sees the length rule


def test_teacher_forced_hints_are_the_hints_at_the_read_tokens():
  tokens = jnp.asarray([[5, 6, 7, 5, 6, 8, 5, 6, 7, 9]], jnp.int32)
  per_pos = copy_hints(tokens, jnp.arange(10)[None], max_ngram=3)
  tf = teacher_forced_hints(tokens, 3, max_ngram=3)
  for t in range(10):
    for i in range(3):
      q = t + 1 + i
      want = (int(per_pos.token_x[0, q]), int(per_pos.length_x[0, q])) if q < 10 else (0, 0)
      assert (int(tf.token_x[0, t, i]), int(tf.length_x[0, t, i])) == want
  # Position 7 reads "5 6" (after 8); "5 6" occurred at 0-1 (then 7) and at 3-4 (then 8), both
  # preceded by something else than 8: length 2, the latest wins.
  assert (int(per_pos.token_x[0, 7]), int(per_pos.length_x[0, 7])) == (8, 2)
  assert (int(per_pos.token_x[0, 0]), int(per_pos.length_x[0, 0])) == (0, 0)


D = TINY_LLM.hidden_size


def copy_drafter(seed=1, K=3, vocab=TINY_VOCAB, **kw) -> Drafter:
  """A drafter with the copy hint whose hint weights are random (fresh ones are zero)."""
  cfg = DrafterConfig(vocab_size=vocab, hidden_size=D, exit_dim=48, copy_ngram=K, **kw)
  d = Drafter(cfg, rngs=nnx.Rngs(seed))
  keys = jax.random.split(jax.random.key(seed), 4)
  d.copy_w.kernel.set_value(jax.random.normal(keys[0], d.copy_w.kernel.shape) * 0.3)
  d.copy_length.set_value(jax.random.normal(keys[1], d.copy_length.shape) * 0.3)
  d.copy_gate.kernel.set_value(jax.random.normal(keys[2], d.copy_gate.kernel.shape) * 0.3)
  d.copy_gate.bias.set_value(jnp.arange(K + 1, dtype=jnp.float32) * 2.0)
  for block in list(d.lm_head)[:-1]:
    block.linear.kernel.set_value(jax.random.normal(keys[3], block.linear.kernel.shape) * 0.2)
  return d


def test_config_and_missing_hint():
  with pytest.raises(ConfigError, match="copy_ngram"):
    DrafterConfig(vocab_size=8, hidden_size=4, copy_ngram=-1)
  assert "copy_ngram" not in DrafterConfig(vocab_size=8, hidden_size=4).to_dict()
  d = copy_drafter()
  with pytest.raises(ValueError, match="copy hint"):
    d.step(jnp.zeros((1, D)), jnp.zeros((1, D)), jnp.zeros((1, D)))
  with pytest.raises(ValueError, match="context_BS"):
    beam_search(d, jnp.zeros((TINY_VOCAB, D)), jnp.zeros((1, D)), jnp.zeros((1,), jnp.int32),
                beam_width=2, beam_length=3)


def test_the_gate_boosts_the_hinted_token_by_its_length_bias():
  d = copy_drafter()
  d.copy_gate.kernel.set_value(jnp.zeros_like(d.copy_gate.kernel[...]))
  h, s = jnp.ones((2, D)), jnp.ones((2, D))
  hint = CopyHint(jnp.asarray([7, 7]), jnp.asarray([0, 3]))
  base = np.asarray(d.logits(h, s, CopyHint(jnp.asarray([7, 7]), jnp.asarray([0, 0]))))
  got = np.asarray(d.logits(h, s, hint))
  np.testing.assert_allclose(got[0], base[0])
  diff = got[1] - base[1]
  assert diff[7] == pytest.approx(6.0) and np.count_nonzero(diff) == 1
  # Under a restricted vocabulary the boost lands on the token's row, or nowhere if it is absent.
  d.token_ranking.set_value(jnp.asarray(np.r_[[9, 7], np.arange(TINY_VOCAB)[:7],
                                              np.arange(TINY_VOCAB)[10:], [8]], jnp.int32))
  small = restrict_vocab(d, 4)
  got = np.asarray(small.logits(h, s, hint)) - np.asarray(
      small.logits(h, s, CopyHint(jnp.asarray([7, 7]), jnp.asarray([0, 0]))))
  assert got[1, 1] == pytest.approx(6.0) and np.count_nonzero(got) == 1
  absent = CopyHint(jnp.asarray([50, 50]), jnp.asarray([3, 3]))
  np.testing.assert_allclose(small.logits(h, s, absent),
                             small.logits(h, s, CopyHint(jnp.asarray([50, 50]),
                                                         jnp.asarray([0, 0]))))


def test_training_path_equals_a_step_by_step_reference():
  d = copy_drafter(K=2)
  rng = np.random.default_rng(3)
  B, T, n = 2, 12, 3
  tokens = rng.integers(0, 5, (B, T)).astype(np.int32)
  seg = np.array([[1] * 12, [1] * 6 + [2] * 6], np.int32)
  emb = rng.normal(size=(TINY_VOCAB, D)).astype(np.float32)
  h = rng.normal(size=(B, T, D)).astype(np.float32)
  hint = teacher_forced_hints(jnp.asarray(tokens), n, max_ngram=2, segment_BT=jnp.asarray(seg))
  prev = jnp.take(jnp.asarray(emb), losses.future_window(jnp.asarray(tokens), 1, n), axis=0)
  got = np.asarray(d.unroll_logits(jnp.asarray(h), prev, None, jnp.asarray(emb), hint))
  for b in range(B):
    for t in range(T - n - 1):
      if seg[b, t] != seg[b, t + n]:
        continue
      s = jnp.zeros((D,))
      for i in range(n):
        q = t + 1 + i
        tok, m = brute_hint(list(tokens[b]), q, 2, list(seg[b]))
        one = CopyHint(jnp.asarray(tok), jnp.asarray(m))
        logp, s = d.step(jnp.asarray(h[b, t]), s, jnp.asarray(emb[tokens[b, q]]), one,
                         jnp.asarray(emb))
        np.testing.assert_allclose(jax.nn.log_softmax(got[b, t, i]), logp, rtol=1e-5,
                                   atol=1e-5)


def test_beam_search_reads_each_beams_own_text():
  """Every beam's per-step log-probs equal a step-by-step replay of that beam, its hints found
  by brute force over the context plus the beam's own drafted tokens."""
  d = copy_drafter(K=3)
  rng = np.random.default_rng(5)
  S, W, L = 32, 3, 5
  emb = jnp.asarray(rng.normal(size=(TINY_VOCAB, D)).astype(np.float32))
  lengths = np.array([20, 11])
  context = np.zeros((2, S), np.int32)
  for b, n in enumerate(lengths):
    context[b, :n + 1] = rng.integers(0, 6, n + 1)
  g0 = context[np.arange(2), lengths]
  h = jnp.asarray(rng.normal(size=(2, D)).astype(np.float32))
  out = beam_search(d, emb, h, jnp.asarray(g0), beam_width=W, beam_length=L,
                    context_BS=jnp.asarray(context), length_B=jnp.asarray(lengths))
  beams, logp = np.asarray(out.beams_BWL), np.asarray(out.logp_BWJ)
  fired = 0
  for b in range(2):
    for w in range(W):
      text = list(context[b, :lengths[b] + 1]) + list(beams[b, w, 1:])
      s = jnp.zeros((D,))
      for t in range(L - 1):
        q = lengths[b] + t
        tok, m = brute_hint(text, q, 3)
        fired += m > 0
        lp, s = d.step(h[b], s, emb[text[q]], CopyHint(jnp.asarray(tok), jnp.asarray(m)), emb)
        assert float(lp[text[q + 1]]) == pytest.approx(float(logp[b, w, t]), abs=1e-4)
  assert fired > 0


def test_greedy_with_the_copy_hint_equals_ar():
  llm = tiny_llm()
  d = copy_drafter(K=3)
  prompts = [[1, 5, 9, 2, 1, 5, 9], [7, 3, 7, 3], [11, 12, 13, 14, 15, 16]]
  ar = generate(llm, prompts, max_new_tokens=24)
  for cfg in (DecodeConfig(beam_width=3, beam_length=4, max_new_tokens=24),
              DecodeConfig(beam_width=1, beam_length=5, max_new_tokens=24, lookup_ngram=2)):
    assert decode(llm, d, prompts, cfg).tokens == ar.tokens


def test_grown_drafter_starts_as_it_was_and_learns_the_hint():
  from tests.test_losses import _drafter, _example

  old = _drafter(seed=2)
  asked = dataclasses.replace(old.config, copy_ngram=2)
  grown = grow_as_asked(old, asked, {"copy_ngram"}, last_layer=0, seed=0, source="test")
  tokens, mask, seg, hidden, emb = map(jnp.asarray, _example())
  batch = losses.LossBatch(hidden, emb, tokens, mask, seg)
  a_of, a = _split(old)
  b_of, b = _split(grown)
  loss_a, _ = losses.distill_loss(a_of, a, batch, losses.LossConfig(num_steps=3, chunk=4))
  loss_b, _ = losses.distill_loss(b_of, b, batch, losses.LossConfig(num_steps=3, chunk=4))
  assert float(loss_b) == pytest.approx(float(loss_a), rel=1e-6)
  grads = jax.grad(lambda p: losses.distill_loss(
      b_of, p, batch, losses.LossConfig(num_steps=3, chunk=4))[0])(b)
  flat = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(grads)}
  assert float(jnp.abs(flat["copy_gate.bias"].get_value()).sum()) > 0
  assert float(jnp.abs(flat["copy_w.kernel"].get_value()).sum()) > 0
  with pytest.raises(ConfigError, match="copy_ngram"):
    grow_as_asked(grown, dataclasses.replace(asked, copy_ngram=3), {"copy_ngram"},
                  last_layer=0, seed=0, source="test")


def test_mlx_runtime_drafts_the_same_beams(tmp_path):
  pytest.importorskip("mlx.core")
  from redrafter_jax.weights import mlx_runtime

  rng = np.random.default_rng(7)
  d = copy_drafter(K=3)
  out = save_drafter(d, tmp_path / "d", format="redrafter-jax")
  m = mlx_runtime.load_mlx_drafter(out)
  S, W, L = 32, 3, 5
  emb = rng.normal(size=(TINY_VOCAB, D)).astype(np.float32)
  lengths = np.array([20, 11], np.int32)
  context = np.zeros((2, S), np.int32)
  for b, n in enumerate(lengths):
    context[b, :n + 1] = rng.integers(0, 6, n + 1)
  g0 = context[np.arange(2), lengths]
  h = rng.normal(size=(2, D)).astype(np.float32)
  got = mlx_runtime.beam_search(m, emb, h, g0, beam_width=W, beam_length=L, context_BS=context,
                                length_B=lengths)
  want = beam_search(d, jnp.asarray(emb), jnp.asarray(h), jnp.asarray(g0), beam_width=W,
                     beam_length=L, context_BS=jnp.asarray(context), length_B=jnp.asarray(lengths))
  np.testing.assert_array_equal(np.array(got.beams_BWL), np.asarray(want.beams_BWL))
  np.testing.assert_allclose(np.array(got.logp_BWJ), np.asarray(want.logp_BWJ), atol=1e-3)
  with pytest.raises(ValueError, match="context_BS"):
    mlx_runtime.beam_search(m, emb, h, g0, beam_width=W, beam_length=L)
