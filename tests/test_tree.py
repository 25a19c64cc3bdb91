"""Dynamic tree attention: dedup, packing into a static budget, tree mask, unpack."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from redrafter_jax.config import LlamaConfig
from redrafter_jax.inference import tree as tree_lib
from redrafter_jax.models import kv_cache as kvc
from redrafter_jax.models.llama import Llama

pytestmark = pytest.mark.usefixtures("float32_matmuls")  # float32 parity: no TF32 on GPUs

PAPER_BEAMS = [[91, 92, 93, 95], [91, 92, 94, 96], [91, 92, 93, 97]]
# Every tree function is checked as called eagerly and under jax.jit (the budget static).
JIT = pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])


def tree_fns(jitted: bool):
  """``(dedup_prefix, pack, unpack)``, plain or jitted."""
  if not jitted:
    return tree_lib.dedup_prefix, tree_lib.pack, tree_lib.unpack
  return (jax.jit(tree_lib.dedup_prefix), jax.jit(tree_lib.pack, static_argnums=1),
          jax.jit(tree_lib.unpack))


@JIT
def test_dedup_prefix_paper_example(jitted):
  dedup_prefix, _, _ = tree_fns(jitted)
  prefix = dedup_prefix(jnp.asarray([PAPER_BEAMS]))
  np.testing.assert_array_equal(prefix[0], [[0, 0, 0, 0], [0, 0, 1, 1], [0, 0, 0, 2]])


@JIT
def test_pack_paper_example(jitted):
  _, pack, unpack = tree_fns(jitted)
  t = pack(jnp.asarray([PAPER_BEAMS]), 12)
  assert int(t.num_unique_B[0]) == 7
  assert int(t.valid_BN[0].sum()) == 7
  np.testing.assert_array_equal(t.tokens_BN[0, :7], [91, 92, 93, 94, 95, 96, 97])
  np.testing.assert_array_equal(t.depth_BN[0, :7], [0, 1, 2, 2, 3, 3, 3])
  np.testing.assert_array_equal(t.parent_BN[0, :7], [-1, 0, 1, 1, 2, 3, 2])
  np.testing.assert_array_equal(unpack(t, t.tokens_BN)[0], PAPER_BEAMS)


def _random_beams(rng, B, W, L, vocab):
  """Beams with heavy prefix sharing (small vocab) and a common root, like real drafts."""
  beams = rng.integers(0, vocab, size=(B, W, L))
  beams[:, :, 0] = rng.integers(0, 100, size=(B, 1))
  return beams


def _brute_force_checks(beams, t, scores=None):
  """Compare every packed structure against definitions computed by plain Python. A prefix
  holding a negative token is no node (a beam that ends early)."""
  B, W, L = beams.shape
  N = t.size
  for b in range(B):
    first = {}
    for j in range(L):  # breadth-first: depth, then beam index
      for i in range(W):
        key = tuple(beams[b, i, :j + 1])
        if key not in first and min(key) >= 0:
          first[key] = (len(first), i, j)
    # Best prefix score first; ties keep breadth-first order.
    order = sorted(first, key=lambda k: (0.0 if scores is None else -scores[b, first[k][1],
                                                                            first[k][2]],
                                         first[k][0]))
    prefixes = {key: n for n, key in enumerate(order)}
    assert int(t.num_unique_B[b]) == len(order)
    kept = order[:N]
    valid = np.asarray(t.valid_BN[b])
    assert valid.sum() == len(kept)
    for n, key in enumerate(kept):
      assert int(t.tokens_BN[b, n]) == key[-1]
      assert int(t.depth_BN[b, n]) == len(key) - 1
      parent = prefixes[key[:-1]] if len(key) > 1 else -1
      assert int(t.parent_BN[b, n]) == parent
      # The mask row is exactly the node's ancestors and itself.
      ancestors = {prefixes[key[:k]] for k in range(1, len(key) + 1)}
      assert set(np.flatnonzero(np.asarray(t.mask_BNN[b, n]))) == ancestors
    slot_of = lambda i, j: prefixes.get(tuple(beams[b, i, :j + 1]), N)
    for i, j in itertools.product(range(W), range(L)):
      assert int(t.node_BWL[b, i, j]) == min(slot_of(i, j), N)
    for i in range(W):
      # A beam is usable up to its first cut node (ancestors precede descendants).
      expect = next((j for j in range(L) if slot_of(i, j) >= N), L)
      assert int(t.beam_len_BW[b, i]) == expect


@pytest.mark.parametrize("W,L,vocab,budget", [(4, 4, 3, None), (8, 5, 4, None), (8, 5, 4, 12),
                                              (5, 3, 2, 4), (1, 6, 5, None)])
@JIT
def test_pack_matches_brute_force(W, L, vocab, budget, jitted):
  _, pack, unpack = tree_fns(jitted)
  rng = np.random.default_rng(W * 100 + L)
  beams = _random_beams(rng, 6, W, L, vocab)
  N = budget or W * (L - 1) + 1
  t = pack(jnp.asarray(beams), N)
  _brute_force_checks(beams, t)
  restored = np.asarray(unpack(t, t.tokens_BN, -1))
  usable = np.arange(L)[None, None, :] < np.asarray(t.beam_len_BW)[:, :, None]
  np.testing.assert_array_equal(restored[usable], beams[usable])
  assert (restored[~usable] == -1).all()


@pytest.mark.parametrize("budget", [None, 9])
@JIT
def test_beams_that_end_early_add_no_nodes_past_their_end(budget, jitted):
  """Negative tokens end a beam (the step-1 alternatives are [g0, token, -1, ...]): the packed
  tree is the brute-force tree of the beams' present prefixes."""
  _, pack, unpack = tree_fns(jitted)
  rng = np.random.default_rng(7)
  B, W, L = 6, 8, 5
  beams = _random_beams(rng, B, W, L, 4)
  ends = rng.integers(1, L + 1, size=(B, W))  # beam i keeps its first ends[b, i] tokens
  beams = np.where(np.arange(L)[None, None, :] < ends[:, :, None], beams, -1)
  t = pack(jnp.asarray(beams), budget or W * (L - 1) + 1)
  _brute_force_checks(beams, t)
  assert (np.asarray(t.beam_len_BW) <= ends).all() and (np.asarray(t.tokens_BN) >= 0).all()
  restored = np.asarray(unpack(t, t.tokens_BN, -1))
  usable = np.arange(L)[None, None, :] < np.asarray(t.beam_len_BW)[:, :, None]
  np.testing.assert_array_equal(restored[usable], beams[usable])


@pytest.mark.parametrize("budget", [6, 10, 33])
@JIT
def test_pack_by_score_keeps_most_likely_nodes(budget, jitted):
  _, pack, _ = tree_fns(jitted)
  rng = np.random.default_rng(budget)
  B, W, L = 5, 8, 5
  beams = _random_beams(rng, B, W, L, 3)
  logp = -rng.exponential(size=(B, W, L - 1))
  # Beams sharing a prefix share its log-probs (as beam search produces them).
  for b in range(B):
    for i in range(W):
      for k in range(i):
        for j in range(1, L):
          if (beams[b, i, :j + 1] == beams[b, k, :j + 1]).all():
            logp[b, i, j - 1] = logp[b, k, j - 1]
  scores = np.concatenate([np.zeros((B, W, 1)), np.cumsum(logp, axis=2)], axis=2)
  t = pack(jnp.asarray(beams), budget, jnp.asarray(scores, jnp.float32))
  _brute_force_checks(beams, t, scores.astype(np.float32))


def test_tree_attention_equals_per_beam_attention():
  """One forward over the packed tree gives each beam's logits as if run alone on the prefix."""
  cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8)
  model = Llama(cfg, rngs=nnx.Rngs(3))
  prompt = jnp.asarray([[5, 6, 7, 8, 9]])
  beams = jnp.asarray([[[11, 12, 13, 14], [11, 12, 15, 16], [11, 12, 13, 17], [11, 18, 19, 20]]])
  t = tree_lib.pack(beams, 16)
  cache = model.init_cache(1, 64)
  P = prompt.shape[1]
  mask = kvc.visible_mask(cache.lengths_B, kvc.causal_mask(jnp.ones((1, P), bool)), 64)
  _, _, cache = model(prompt, jnp.arange(P)[None], mask, cache)
  cache = kvc.advance(cache, jnp.asarray([P]))
  mask = kvc.visible_mask(cache.lengths_B, t.mask_BNN, 64)
  logits_tree, _, _ = model(t.tokens_BN, P + t.depth_BN, mask, cache)
  per_beam = tree_lib.unpack(t, logits_tree)
  for i in range(beams.shape[1]):
    seq = jnp.concatenate([prompt, beams[:, i]], axis=1)
    T = seq.shape[1]
    full, _, _ = model(seq, jnp.arange(T)[None], jnp.tril(jnp.ones((1, T, T), bool)), None)
    np.testing.assert_allclose(per_beam[0, i], full[0, P:], rtol=1e-5, atol=1e-5)
