"""Drafter wiring and beam search against a straightforward NumPy implementation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from redrafter_jax.config import DrafterConfig
from redrafter_jax.inference.beam_search import beam_search
from redrafter_jax.models.drafter import Drafter, reference_top_k_cut
from redrafter_jax.weights.params import flat_params

pytestmark = pytest.mark.usefixtures("float32_matmuls")  # float32 parity: no TF32 on GPUs

D, V = 8, 40


def _drafter(exit_dim, rnn, layers=2, seed=0, top_k=None):
  cfg = DrafterConfig(vocab_size=V, hidden_size=D, exit_dim=exit_dim, num_draft_layers=layers,
                      rnn=rnn, logit_top_k=top_k)
  d = Drafter(cfg, rngs=nnx.Rngs(seed))
  # ResBlocks start at zero (identity); give them weights so the test sees them.
  rng = np.random.default_rng(seed)
  for block in list(d.lm_head)[:-1]:
    block.linear.kernel[...] = jnp.asarray(rng.normal(0, 0.3, block.linear.kernel.shape),
                                           jnp.float32)
    block.linear.bias[...] = jnp.asarray(rng.normal(0, 0.3, block.linear.bias.shape), jnp.float32)
  return d


def _np_silu(x):
  return x / (1 + np.exp(-x))


def _np_log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _np_step(p, cfg, h, s, emb):
  """The DESIGN §5 wiring written out in NumPy from the flat parameter dict."""
  lin = lambda x, name, bias=True: x @ p[f"{name}.kernel"] + (p[f"{name}.bias"] if bias else 0)
  if cfg.rnn:
    s = _np_silu(lin(emb, "rnn_w", bias=False) + lin(s, "rnn_u"))
  else:
    s = emb + s
  x = np.concatenate([h, s], axis=-1)  # LLM hidden state first
  if cfg.has_input_proj:
    x = lin(x, "input_proj")
  n = cfg.num_draft_layers
  for i in range(n):
    x = x + _np_silu(lin(x, f"lm_head.{i}.linear"))
  logits = x @ p[f"lm_head.{n}.kernel"]
  if cfg.logit_top_k:
    logits = logits - logits.max(-1, keepdims=True)
    kth = np.sort(logits, axis=-1)[..., -cfg.logit_top_k][..., None]
    logits = np.where(logits >= kth, logits, -5e4)
  return _np_log_softmax(logits), s


def _np_beam_search(p, cfg, embed, h, g0, W, L, ids=None):
  """Textbook beam search: joint top-W over all W*V extensions, scores start [0, -5e4...].

  ``ids`` (optional) maps the head's output rows to token ids (a restricted draft vocabulary).
  """
  ids = np.arange(cfg.vocab_size) if ids is None else ids
  K = len(ids)
  beams = [[g0] for _ in range(W)]
  scores = np.array([0.0] + [-5e4] * (W - 1))
  logps = [[] for _ in range(W)]
  states = np.zeros((W, D))
  for _ in range(L - 1):
    prev = np.array([b[-1] for b in beams])
    lp, states = _np_step(p, cfg, np.tile(h, (W, 1)), states, embed[prev])
    cand = (scores[:, None] + lp).reshape(-1)
    top = np.argsort(-cand, kind="stable")[:W]
    parent, row = top // K, top % K
    beams = [beams[a] + [int(ids[r])] for a, r in zip(parent, row)]
    logps = [logps[a] + [float(lp[a, r])] for a, r in zip(parent, row)]
    scores, states = cand[top], states[parent]
  return np.array(beams), np.array(logps), scores


@pytest.mark.parametrize("exit_dim,rnn,top_k", [(2 * D, True, None), (12, True, None),
                                                (12, False, None), (12, True, 5)])
def test_drafter_step_matches_numpy(exit_dim, rnn, top_k):
  d = _drafter(exit_dim, rnn, top_k=top_k)
  p = {k: np.asarray(v, np.float64) for k, v in flat_params(d).items()}
  assert ("input_proj.kernel" in p) == (exit_dim != 2 * D)
  rng = np.random.default_rng(1)
  h, s, emb = (rng.normal(size=(3, D)) for _ in range(3))
  logp, s_new = d.step(jnp.asarray(h, jnp.float32), jnp.asarray(s, jnp.float32),
                       jnp.asarray(emb, jnp.float32))
  ref_logp, ref_s = _np_step(p, d.config, h, s, emb)
  np.testing.assert_allclose(s_new, ref_s, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(logp, ref_logp, rtol=1e-4, atol=1e-4)


def test_reference_top_k_cut():
  x = jnp.asarray([[3.0, 1.0, 2.0, -1.0, 0.5]])
  np.testing.assert_allclose(reference_top_k_cut(x, 2), [[0.0, -5e4, -1.0, -5e4, -5e4]])


@pytest.mark.parametrize("W,L,rnn,exit_dim", [(1, 4, True, 12), (4, 4, True, 12),
                                              (6, 5, False, 2 * D), (3, 2, True, 12)])
def test_beam_search_matches_numpy(W, L, rnn, exit_dim):
  d = _drafter(exit_dim, rnn, seed=W + L)
  p = {k: np.asarray(v, np.float64) for k, v in flat_params(d).items()}
  rng = np.random.default_rng(7)
  B = 3
  embed = rng.normal(size=(V, D))
  h = rng.normal(size=(B, D))
  g0 = rng.integers(0, V, size=B)
  out = beam_search(d, jnp.asarray(embed, jnp.float32), jnp.asarray(h, jnp.float32),
                    jnp.asarray(g0, jnp.int32), beam_width=W, beam_length=L, return_full=True)
  assert out.beams_BWL.shape == (B, W, L) and out.logp_BWJ.shape == (B, W, L - 1)
  for b in range(B):
    beams, logps, scores = _np_beam_search(p, d.config, embed, h[b], int(g0[b]), W, L)
    np.testing.assert_array_equal(out.beams_BWL[b], beams)
    np.testing.assert_allclose(out.logp_BWJ[b], logps, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out.score_BW[b], scores, rtol=1e-4, atol=1e-4)
  # The full distributions along each beam give back the chosen tokens' log-probs.
  picked = jnp.take_along_axis(out.full_logp_BWJV, out.beams_BWL[:, :, 1:, None], -1)[..., 0]
  np.testing.assert_allclose(picked, out.logp_BWJ, rtol=1e-6)


def test_beam_search_first_step_grows_distinct_children():
  d = _drafter(12, True, seed=3)
  out = beam_search(d, jax.random.normal(jax.random.key(0), (V, D)), jnp.ones((1, D)),
                    jnp.asarray([5]), beam_width=6, beam_length=2)
  firsts = np.asarray(out.beams_BWL[0, :, 1])
  assert len(set(firsts.tolist())) == 6  # W distinct children of the single root
  assert (np.diff(np.asarray(out.score_BW[0])) <= 0).all()  # best beam first


def test_restricted_draft_vocab_drafts_only_top_ranked_tokens():
  """A restricted drafter equals beam search over the full one with other tokens forbidden."""
  from redrafter_jax.models.drafter import restrict_vocab

  d = _drafter(12, True, seed=11)
  ranking = np.random.default_rng(0).permutation(V).astype(np.int32)
  d.token_ranking[...] = jnp.asarray(ranking)
  K = 10
  small = restrict_vocab(d, K)
  assert small.lm_head[-1].kernel.shape == (12, K)
  assert d.lm_head[-1].kernel.shape == (12, V)  # the original is untouched
  p = {k: np.asarray(v, np.float64) for k, v in flat_params(d).items()}
  head = f"lm_head.{d.config.num_draft_layers}.kernel"
  p[head] = p[head][:, ranking[:K]]
  rng = np.random.default_rng(2)
  embed = rng.normal(size=(V, D))
  h = rng.normal(size=(2, D))
  g0 = np.array([3, 30])
  out = beam_search(small, jnp.asarray(embed, jnp.float32), jnp.asarray(h, jnp.float32),
                    jnp.asarray(g0, jnp.int32), beam_width=4, beam_length=4)
  assert np.isin(np.asarray(out.beams_BWL[:, :, 1:]), ranking[:K]).all()
  # NumPy: the same search over the K-token head, mapping rows back to token ids.
  cfg_k = DrafterConfig(vocab_size=K, hidden_size=D, exit_dim=12, num_draft_layers=2, rnn=True)
  for b in range(2):
    beams_k, logps, _ = _np_beam_search(p, cfg_k, embed, h[b], int(g0[b]), 4, 4, ranking[:K])
    np.testing.assert_array_equal(out.beams_BWL[b], beams_k)
    np.testing.assert_allclose(out.logp_BWJ[b], logps, rtol=1e-4, atol=1e-4)



@pytest.mark.parametrize("W,K,restricted,L", [(1, 3, False, 4), (4, 6, False, 4), (2, 5, True, 2)])
def test_first_k_are_the_drafters_best_first_tokens(W, K, restricted, L):
  """``first_k``: the K best tokens of the first draft step (from g0), best first, as token ids;
  the kept beams' first tokens are among them when K >= W (L = 2: one draft step, no scan)."""
  from redrafter_jax.models.drafter import restrict_vocab

  d = _drafter(12, True, seed=5)
  p = {k: np.asarray(v, np.float64) for k, v in flat_params(d).items()}
  ids = np.arange(V)
  if restricted:
    d.token_ranking[...] = np.random.default_rng(3).permutation(V).astype(np.int32)
    d = restrict_vocab(d, 10)
    ids = np.asarray(d.vocab_ids[...])
  rng = np.random.default_rng(11)
  B = 3
  embed, h = rng.normal(size=(V, D)), rng.normal(size=(B, D))
  g0 = rng.integers(0, V, size=B)
  out = beam_search(d, jnp.asarray(embed, jnp.float32), jnp.asarray(h, jnp.float32),
                    jnp.asarray(g0, jnp.int32), beam_width=W, beam_length=L, first_k=K)
  assert out.first_BK.shape == out.first_logp_BK.shape == (B, K)
  for b in range(B):
    lp, _ = _np_step(p, d.config, h[b][None], np.zeros((1, D)), embed[g0[b]][None])
    lp = lp[0][ids]  # a restricted head: the ranked rows, renormalised
    lp = lp - np.log(np.exp(lp).sum())
    best = np.argsort(-lp, kind="stable")[:K]
    np.testing.assert_array_equal(out.first_BK[b], ids[best])
    np.testing.assert_allclose(out.first_logp_BK[b], lp[best], rtol=1e-4, atol=1e-4)
    assert set(np.asarray(out.beams_BWL[b, :, 1]).tolist()) <= set(ids[best].tolist())
  plain = beam_search(d, jnp.asarray(embed, jnp.float32), jnp.asarray(h, jnp.float32),
                      jnp.asarray(g0, jnp.int32), beam_width=W, beam_length=L)
  assert plain.first_BK is None
  np.testing.assert_array_equal(plain.beams_BWL, out.beams_BWL)  # the beams do not change
