"""The distillation loss against a hand-written reference (explicit loops over positions/steps)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from redrafter_jax.config import DrafterConfig, LlamaConfig
from redrafter_jax.models.drafter import Drafter
from redrafter_jax.models.llama import Llama
from redrafter_jax.training import losses

pytestmark = pytest.mark.usefixtures("float32_matmuls")  # float32 parity: no TF32 on GPUs

V, D = 50, 8


def _drafter(seed=0, rnn=True, exit_dim=None):
  cfg = DrafterConfig(vocab_size=V, hidden_size=D, exit_dim=exit_dim, num_draft_layers=1, rnn=rnn)
  drafter = Drafter(cfg, rngs=nnx.Rngs(seed))
  # ResBlocks start at zero (identity); randomise them so the test exercises every weight.
  for layer in drafter.lm_head[:-1]:
    k = layer.linear.kernel
    k.set_value(jax.random.normal(jax.random.key(seed + 7), k.shape) * 0.3)
  return drafter


def _split(drafter):
  """``(params -> drafter, params)``: only ``nnx.Param``s are trained."""
  graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
  return (lambda p: nnx.merge(graphdef, p, rest)), params


def _example():
  rng = np.random.default_rng(0)
  B, T = 2, 11
  tokens = rng.integers(0, V, (B, T)).astype(np.int32)
  # Row 0: prompt of 3 tokens, response of 6, then 2 padding tokens.
  # Row 1: two packed sequences: [prompt 2, response 3] then [prompt 1, response 4], then padding 1.
  seg = np.array([[1] * 9 + [0] * 2, [1] * 5 + [2] * 5 + [0]], np.int32)
  mask = np.array([[0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0],
                   [0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 0]], np.int32)
  tokens[seg == 0] = 0
  hidden = rng.normal(size=(B, T, D)).astype(np.float32)
  emb = rng.normal(size=(V, D)).astype(np.float32)
  return tokens, mask, seg, hidden, emb


def _batch(hidden, emb, tokens, mask, seg, **extra) -> losses.LossBatch:
  """A ``LossBatch`` of numpy arrays (``extra``: ``context_BTX``, ``teacher_out_VD``)."""
  extra = {k: jnp.asarray(v) for k, v in extra.items()}
  return losses.LossBatch(*map(jnp.asarray, (hidden, emb, tokens, mask, seg)), **extra)


def _reference(drafter, tokens, mask, seg, hidden, emb, n, ids=None, teacher_out=None):
  """Loops: position t, step i predicts token t+i+1 from h_t and tokens t+1..t+i.

  ``ids``: the drafter scores only these tokens; a target outside them has no cross-entropy
  and counts as a miss for the accuracies. ``teacher_out`` [V, D]: the cross-entropy is against
  softmax(teacher_out[ids] @ h_{t+i}) (the LLM's prediction of token t+i+1) instead."""
  B, T = tokens.shape
  recur = jax.jit(drafter.recur)  # the drafter's own math, one position at a time
  logits_of = jax.jit(drafter.logits)
  ce = [[] for _ in range(n)]
  top1 = [[] for _ in range(n)]
  top5 = [[] for _ in range(n)]
  for b in range(B):
    for t in range(T):
      s = jnp.zeros((D,))
      for i in range(1, n + 1):
        if t + i < T:
          s = recur(s, jnp.asarray(emb[tokens[b, t + i]]))
        j = t + i + 1  # the target position
        if j >= T or seg[b, t] == 0 or seg[b, j] != seg[b, t] or not mask[b, j]:
          continue
        logits = np.asarray(logits_of(jnp.asarray(hidden[b, t]), s), np.float64)
        vocab = np.arange(V) if ids is None else np.asarray(ids)
        logits = logits[vocab]
        logp = logits - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max()
        target = tokens[b, j]
        if teacher_out is not None:
          z = np.asarray(teacher_out, np.float64)[vocab] @ hidden[b, j - 1]
          p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
          ce[i - 1].append(-np.sum(p * logp))
        elif target in vocab:
          ce[i - 1].append(-logp[list(vocab).index(target)])
        order = vocab[np.argsort(-logits)]
        top1[i - 1].append(target in order[:1])
        top5[i - 1].append(target in order[:5])
  return (sum(np.mean(c) for c in ce), [np.mean(c) for c in ce], [np.mean(a) for a in top1],
          [np.mean(a) for a in top5], [len(a) for a in top1])


def test_targets_alignment_by_hand():
  tokens = np.arange(100, 108, dtype=np.int32)[None]  # one row, T=8
  mask = np.array([[0, 0, 0, 1, 1, 1, 1, 0]], np.int32)  # prompt 0..2, response 3..6, pad 7
  seg = np.array([[1, 1, 1, 1, 1, 1, 1, 0]], np.int32)
  targets, counts = losses.targets_and_weights(jnp.asarray(tokens), jnp.asarray(mask),
                                               jnp.asarray(seg), 3)
  targets, counts = np.asarray(targets)[0], np.asarray(counts)[0]
  # Step 1 at t predicts token t+2 (t+1 is the LLM's own token g0), step 3 predicts t+4.
  assert targets[0].tolist() == [102, 103, 104]
  assert targets[4].tolist() == [106, 107, 0]
  expected = {  # t -> which steps count: target index t+i+1 must be a response token (3..6)
      0: [False, True, True], 1: [True, True, True], 2: [True, True, True],
      3: [True, True, False], 4: [True, False, False], 5: [False, False, False],
      6: [False, False, False], 7: [False, False, False]}
  assert {t: counts[t].tolist() for t in range(8)} == expected


@pytest.mark.parametrize("rnn,exit_dim,chunk", [(True, None, 64), (True, 12, 3), (False, None, 4)])
def test_loss_matches_loop_reference(rnn, exit_dim, chunk):
  n = 3
  drafter = _drafter(rnn=rnn, exit_dim=exit_dim)
  tokens, mask, seg, hidden, emb = _example()
  drafter_of, params = _split(drafter)
  loss, m = losses.distill_loss(drafter_of, params, _batch(hidden, emb, tokens, mask, seg),
                                losses.LossConfig(num_steps=n, chunk=chunk))
  ref_loss, ref_ce, ref_top1, ref_top5, ref_count = _reference(drafter, tokens, mask, seg, hidden,
                                                               emb, n)
  assert np.asarray(m["count_n"]).tolist() == ref_count
  assert min(ref_count) > 0  # every step has targets, so the means are really compared
  np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(m["loss_n"]), ref_ce, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(m["top1_n"]), ref_top1, atol=1e-6)
  np.testing.assert_allclose(np.asarray(m["top5_n"]), ref_top5, atol=1e-6)


def test_step_weight_decay_weighs_later_steps_less():
  drafter_of, params = _split(_drafter())
  tokens, mask, seg, hidden, emb = _example()
  args = (drafter_of, params, _batch(hidden, emb, tokens, mask, seg))
  plain, m = losses.distill_loss(*args, losses.LossConfig(num_steps=3))
  decayed, m2 = losses.distill_loss(*args, losses.LossConfig(num_steps=3, step_weight_decay=0.5))
  ce = np.asarray(m["loss_n"])
  np.testing.assert_allclose(float(decayed), ce[0] + 0.5 * ce[1] + 0.25 * ce[2], rtol=1e-6)
  np.testing.assert_allclose(float(plain), ce.sum(), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(m2["loss_n"]), ce)  # the metrics stay unweighted


def test_restricted_vocabulary_matches_loop_reference():
  """Training on K tokens (``restrict_vocab``): cross-entropy over those K, other targets
  skipped for the loss and counted as misses for the accuracies."""
  from redrafter_jax.models.drafter import TokenRanking, restrict_vocab

  n = 3
  drafter = _drafter(exit_dim=12)
  tokens, mask, seg, hidden, emb = _example()
  targets = sorted(set(tokens[mask > 0].tolist()))
  ids = targets[::2] + [t for t in range(V) if t not in targets][:6]  # half the targets + others
  drafter.token_ranking = TokenRanking(jnp.asarray(ids + [t for t in range(V) if t not in ids]))
  graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
  K = len(ids)
  loss, m = losses.distill_loss(
      lambda p: restrict_vocab(nnx.merge(graphdef, p, rest), K), params,
      _batch(hidden, emb, tokens, mask, seg), losses.LossConfig(num_steps=n, chunk=4),
      vocab_ids_R=jnp.asarray(ids))
  ref_loss, ref_ce, ref_top1, ref_top5, ref_count = _reference(drafter, tokens, mask, seg, hidden,
                                                               emb, n, ids=np.asarray(ids))
  assert np.asarray(m["count_n"]).tolist() == ref_count
  assert 0.2 < float(np.asarray(m["coverage_n"]).mean()) < 0.8  # both kinds of target occur
  np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(m["loss_n"]), ref_ce, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(m["top1_n"]), ref_top1, atol=1e-6)
  np.testing.assert_allclose(np.asarray(m["top5_n"]), ref_top5, atol=1e-6)
  # The gradient reaches only the K used columns of the vocabulary projection.
  grads = jax.grad(lambda p: losses.distill_loss(
      lambda q: restrict_vocab(nnx.merge(graphdef, q, rest), K), p,
      _batch(hidden, emb, tokens, mask, seg), losses.LossConfig(num_steps=n),
      vocab_ids_R=jnp.asarray(ids))[0])(params)
  g_CV = np.asarray(grads["lm_head"][len(drafter.lm_head) - 1]["kernel"])
  used = np.zeros(V, bool)
  used[ids] = True
  assert np.abs(g_CV[:, ~used]).max() == 0 and np.abs(g_CV[:, used]).max() > 0


@pytest.mark.parametrize("restricted", [False, True])
def test_soft_targets_match_loop_reference(restricted):
  """Soft targets: cross-entropy against the LLM's distribution from the hidden state one
  position before the target (over the restricted vocabulary when there is one)."""
  from redrafter_jax.models.drafter import TokenRanking, restrict_vocab

  n = 3
  drafter = _drafter(exit_dim=12)
  tokens, mask, seg, hidden, emb = _example()
  out = np.random.default_rng(3).normal(size=(V, D)).astype(np.float32)
  ids = None
  graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
  drafter_of = lambda p: nnx.merge(graphdef, p, rest)
  if restricted:
    ids = list(range(0, V, 3))
    drafter.token_ranking = TokenRanking(jnp.asarray(ids + [t for t in range(V) if t not in ids]))
    graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
    drafter_of = lambda p: restrict_vocab(nnx.merge(graphdef, p, rest), len(ids))
  loss, m = losses.distill_loss(
      drafter_of, params, _batch(hidden, emb, tokens, mask, seg, teacher_out_VD=out),
      losses.LossConfig(num_steps=n, chunk=4, soft=True),
      vocab_ids_R=None if ids is None else jnp.asarray(ids))
  ref_loss, ref_ce, ref_top1, _, ref_count = _reference(
      drafter, tokens, mask, seg, hidden, emb, n, ids=None if ids is None else np.asarray(ids),
      teacher_out=out)
  assert np.asarray(m["count_n"]).tolist() == ref_count and min(ref_count) > 0
  np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(m["loss_n"]), ref_ce, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(m["top1_n"]), ref_top1, atol=1e-6)
  hard, _ = losses.distill_loss(drafter_of, params, _batch(hidden, emb, tokens, mask, seg),
                                losses.LossConfig(num_steps=n, chunk=4),
                                vocab_ids_R=None if ids is None else jnp.asarray(ids))
  assert abs(float(hard) - float(loss)) > 1e-3  # a different loss, not the hard one renamed


def test_masked_positions_do_not_change_the_loss():
  """Changing prompt-target, padding and other-segment tokens' targets leaves the loss alone,
  while changing a response token does change it."""
  n = 2
  drafter = _drafter()
  drafter_of, params = _split(drafter)
  tokens, mask, seg, hidden, emb = _example()

  def loss_of(tok, hid=hidden):
    return float(losses.distill_loss(drafter_of, params, _batch(hid, emb, tok, mask, seg),
                                     losses.LossConfig(num_steps=n))[0])

  base = loss_of(tokens)
  hid = hidden.copy()
  hid[0, 9:] += 5.0  # padding positions of row 0
  assert loss_of(tokens, hid) == pytest.approx(base, rel=1e-6)
  changed = tokens.copy()
  changed[0, 0] = (changed[0, 0] + 1) % V  # prompt token: only an input (as t), never a target;
  # as h_t it is not read (hidden is fixed here), as an embedding it feeds position -1: no one
  assert loss_of(changed) == pytest.approx(base, rel=1e-6)
  changed = tokens.copy()
  changed[0, 5] = (changed[0, 5] + 1) % V  # a response token: a target and an input
  assert abs(loss_of(changed) - base) > 1e-4


def test_no_gradient_reaches_the_llm():
  cfg = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=16, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=4)
  llm = Llama(cfg, rngs=nnx.Rngs(1))
  drafter = _drafter()
  tokens, mask, seg, _, _ = _example()
  pos = np.tile(np.arange(tokens.shape[1]), (2, 1)).astype(np.int32)
  llm_gd, llm_state = nnx.split(llm)
  drafter_of, d_params = _split(drafter)

  def loss_fn(llm_state, d_params):
    model = nnx.merge(llm_gd, llm_state)
    hidden = losses.frozen_hidden(model, tokens, pos, seg)
    batch = losses.LossBatch(hidden, model.embed_tokens.embedding[...], tokens, mask, seg)
    return losses.distill_loss(drafter_of, d_params, batch, losses.LossConfig(num_steps=2))[0]

  g_llm, g_drafter = jax.grad(loss_fn, argnums=(0, 1))(llm_state, d_params)
  assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree.leaves(g_llm))
  assert any(float(jnp.abs(x).max()) > 0.0 for x in jax.tree.leaves(g_drafter))


def test_packed_hidden_equals_separate_sequences():
  """The LLM hidden states of a packed row equal those of each sequence run alone."""
  cfg = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=16, num_layers=2, num_heads=2,
                    num_kv_heads=1, head_dim=4)
  llm = Llama(cfg, rngs=nnx.Rngs(2))
  a, b = np.arange(1, 6, dtype=np.int32), np.arange(20, 24, dtype=np.int32)
  packed = np.concatenate([a, b, [0]])[None]
  seg = np.array([[1] * 5 + [2] * 4 + [0]], np.int32)
  pos = np.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0]], np.int32)
  h = np.asarray(losses.frozen_hidden(llm, packed, pos, seg))[0]
  for x, sl in ((a, slice(0, 5)), (b, slice(5, 9))):
    alone = np.asarray(losses.frozen_hidden(llm, x[None], np.arange(len(x))[None],
                                            np.ones((1, len(x)), np.int32)))[0]
    np.testing.assert_allclose(h[sl], alone, rtol=1e-5, atol=1e-5)
