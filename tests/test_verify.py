"""Acceptance rules: exact tree sampling reproduces AR sampling; the reference rule does not."""

import itertools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from redrafter_jax.config import DecodeConfig, DrafterConfig, LlamaConfig
from redrafter_jax.inference import sampling
from redrafter_jax.inference import tree as tree_lib
from redrafter_jax.inference import verify
from redrafter_jax.inference.ar import generate
from redrafter_jax.inference.beam_search import BeamOutput
from redrafter_jax.inference.decode import decode
from redrafter_jax.models.drafter import Drafter
from redrafter_jax.models.llama import Llama

pytestmark = pytest.mark.usefixtures("float32_matmuls")  # float32 parity: no TF32 on GPUs

V = 8
K = 3  # compare the joint distribution of the first K generated tokens
PROMPT = [1, 2, 3, 4]
# The rules on hand-made trees are checked as called eagerly and under jax.jit.
JIT = pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])


def _exact(rng, tree, logits, params, *, beam_length, filtered):
  """``verify_exact`` on the target distribution of ``logits`` (as ``step.accept`` calls it)."""
  logp = sampling.target_logprobs(logits, params, filtered=filtered)
  return verify.verify_exact(rng, tree, logp, beam_length=beam_length)


def _typical(rng, tree, beams, logits, params, *, eps, delta, filtered):
  logp = sampling.target_logprobs(logits, params, filtered=filtered)
  return verify.verify_typical(rng, tree, beams, logp, eps=eps, delta=delta)


def rules(jitted: bool) -> types.SimpleNamespace:
  """``pack`` and the acceptance rules, plain or jitted (their static arguments static)."""
  fns = dict(pack=tree_lib.pack, exact=_exact, greedy=verify.verify_greedy, typical=_typical)
  if jitted:
    fns = dict(pack=jax.jit(tree_lib.pack, static_argnums=1),
               exact=jax.jit(_exact, static_argnames=("beam_length", "filtered")),
               greedy=jax.jit(verify.verify_greedy, static_argnames=("beam_length",)),
               typical=jax.jit(_typical, static_argnames=("eps", "delta", "filtered")))
  return types.SimpleNamespace(**fns)


@pytest.fixture(scope="module")
def llm():
  cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=8, tie_word_embeddings=True)
  model = Llama(cfg, rngs=nnx.Rngs(0))
  # Flatten the random model so distributions are neither near-uniform nor one-hot, and
  model.embed_tokens.embedding[...] = model.embed_tokens.embedding[...] * 0.7
  return model


@pytest.fixture(scope="module")
def drafter():
  return Drafter(DrafterConfig(vocab_size=V, hidden_size=16, exit_dim=12), rngs=nnx.Rngs(5))


def exact_ar_probs(llm, temperature, top_p, top_k):
  """P(x1, ..., xK) of AR sampling, by enumerating every sequence (V**K of them)."""
  seqs = np.array(list(itertools.product(range(V), repeat=K - 1)))  # [V**(K-1), K-1]
  tokens = np.concatenate([np.tile(PROMPT, (len(seqs), 1)), seqs], axis=1)
  T = tokens.shape[1]
  logits, _, _ = llm(jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(T), tokens.shape),
                     jnp.tril(jnp.ones((len(seqs), T, T), bool)), None)
  params = sampling.SamplingParams.make(len(seqs), temperature, top_p, top_k)
  logp = np.asarray(sampling.target_logprobs(logits[:, len(PROMPT) - 1:], params,
                                             filtered=sampling.needs_filter(top_p, top_k)))
  # Row r holds prefix x1..x(K-1); its position k predicts x(k+1) given x1..xk.
  probs = {}
  for row, prefix in enumerate(seqs):
    for last in range(V):
      seq = tuple(int(x) for x in prefix) + (last,)
      probs[seq] = float(np.exp(sum(logp[row, k, seq[k]] for k in range(K))))
  return probs


def chi_square_pvalue(samples, probs):
  n = len(samples)
  keys = sorted(probs)
  counts = {k: 0 for k in keys}
  for s in samples:
    counts[tuple(s)] += 1
  expected = np.array([probs[k] * n for k in keys])
  observed = np.array([counts[k] for k in keys], float)
  assert abs(expected.sum() - n) < 1e-3 * n
  # Outcomes that top-k/top-p exclude must never occur; then pool rare outcomes into one bin
  # so the chi-square approximation holds.
  impossible = expected == 0
  assert observed[impossible].sum() == 0, "sampled a sequence of probability zero"
  expected, observed = expected[~impossible], observed[~impossible]
  rare = expected < 5
  exp_b, obs_b = expected[~rare], observed[~rare]
  if rare.any():
    exp_b = np.append(exp_b, expected[rare].sum())
    obs_b = np.append(obs_b, observed[rare].sum())
  exp_b *= obs_b.sum() / exp_b.sum()  # float32 probabilities sum to 1 only to ~1e-7
  return stats.chisquare(obs_b, exp_b).pvalue


SETTINGS = [dict(temperature=1.0, top_p=1.0, top_k=0), dict(temperature=0.7, top_p=0.9, top_k=5)]
N_SAMPLES = 12000


@pytest.mark.parametrize("setting", SETTINGS)
def test_exact_rule_matches_ar_distribution_and_reference_rule_fails(llm, drafter, setting):
  probs = exact_ar_probs(llm, **setting)
  assert abs(sum(probs.values()) - 1) < 1e-4
  prompts = [PROMPT] * N_SAMPLES
  # AR sampling itself passes the test (calibrates it).
  ar = generate(llm, prompts, max_new_tokens=K, seed=1, **setting)
  assert chi_square_pvalue(ar.tokens, probs) > 1e-4
  cfg = DecodeConfig(beam_width=3, beam_length=3, max_new_tokens=K, acceptance="exact")
  exact = decode(llm, drafter, prompts, cfg, seed=2, **setting)
  assert exact.metrics["accepted_tokens"] > N_SAMPLES // 4  # the tree path really is used
  assert chi_square_pvalue(exact.tokens, probs) > 1e-4
  # The reference implementation's rule is biased towards drafted tokens: the test bites.
  ref_cfg = DecodeConfig(beam_width=3, beam_length=3, max_new_tokens=K, acceptance="reference")
  wrong = decode(llm, drafter, prompts, ref_cfg, seed=2, **setting)
  assert chi_square_pvalue(wrong.tokens, probs) < 1e-8


def test_exact_rule_with_lookup_beam_matches_ar_distribution(llm, drafter):
  """The context-lookup beam joins the tree: sampling stays exact."""
  setting = SETTINGS[0]
  probs = exact_ar_probs(llm, **setting)
  cfg = DecodeConfig(beam_width=1, beam_length=3, max_new_tokens=K, lookup_ngram=2)
  r = decode(llm, drafter, [PROMPT] * N_SAMPLES, cfg, seed=3, **setting)
  assert r.metrics["mean_unique_tokens"] > 3.2  # the lookup beam often adds nodes of its own
  assert r.metrics["accepted_tokens"] > N_SAMPLES // 4
  assert chi_square_pvalue(r.tokens, probs) > 1e-4


def test_exact_rule_with_step1_alternatives_matches_ar_distribution(llm, drafter):
  """The step-1 alternatives join the tree as siblings of the beams' first tokens: sampling
  stays exact."""
  setting = SETTINGS[0]
  probs = exact_ar_probs(llm, **setting)
  cfg = DecodeConfig(beam_width=1, beam_length=3, max_new_tokens=K, first_alternatives=4)
  r = decode(llm, drafter, [PROMPT] * N_SAMPLES, cfg, seed=4, **setting)
  assert r.metrics["mean_unique_tokens"] > 5.5  # the 3 alternatives the beam does not start with
  assert r.metrics["accepted_tokens"] > N_SAMPLES // 4
  assert chi_square_pvalue(r.tokens, probs) > 1e-4


def test_typical_acceptance_at_temperature_zero_is_greedy(llm, drafter):
  prompts = [PROMPT, [5, 6], [7]]
  ar = generate(llm, prompts, max_new_tokens=12)
  cfg = DecodeConfig(beam_width=3, beam_length=4, max_new_tokens=12, acceptance="typical")
  assert decode(llm, drafter, prompts, cfg).tokens == ar.tokens


@JIT
def test_exact_walk_on_hand_made_tree(jitted):
  """Greedy verdict on a known tree: accept the argmax child at each level, then the argmax."""
  r = rules(jitted)
  beams = jnp.asarray([[[1, 2, 3], [1, 4, 5], [1, 2, 6]]])
  t = r.pack(beams, 7)  # slots by depth then beam: 1 | 2 4 | 3 5 6
  logits = jnp.full((1, 7, V), -10.0)
  logits = logits.at[0, 0, 2].set(5.0)  # after root: 2 (accept beam 0/2's token)
  logits = logits.at[0, 1, 6].set(5.0)  # after 1,2: 6 (the beam-2 child)
  logits = logits.at[0, 5, 7].set(5.0)  # after 1,2,6: 7 (bonus token)
  params = sampling.SamplingParams.make(1)
  v = r.exact(jax.random.key(0), t, logits, params, beam_length=3, filtered=False)
  assert_same_verdict(r.greedy(t, logits, beam_length=3), v)
  assert int(v.num_accepted_B[0]) == 2
  np.testing.assert_array_equal(v.tokens_BA[0], [2, 6, 7])
  np.testing.assert_array_equal(v.path_BA[0], [0, 1, 5])
  assert int(v.end_slot_B[0]) == 5
  # A rejection at the first level: the argmax (3) is not a child of the root.
  logits2 = logits.at[0, 0, 2].set(-10.0).at[0, 0, 3].set(5.0)
  v2 = r.exact(jax.random.key(0), t, logits2, params, beam_length=3, filtered=False)
  assert_same_verdict(r.greedy(t, logits2, beam_length=3), v2)
  assert int(v2.num_accepted_B[0]) == 0
  np.testing.assert_array_equal(v2.tokens_BA[0, :1], [3])
  assert int(v2.end_slot_B[0]) == 0


def test_winning_source_credits_the_first_source_holding_the_path():
  """Beams from the drafter, the lookup and a step-1 alternative: the accepted path is credited
  to the first source (drafter, lookup, alternative) with a beam that holds it."""
  from redrafter_jax.inference.step import ALTERNATIVE, DRAFTER, LOOKUP, winning_source

  sources = (DRAFTER, DRAFTER, LOOKUP, ALTERNATIVE)
  # drafter [1 2 3] [1 4 5]; lookup [1 2 6] (shares the drafter's first node); alternative [1 7]
  beams = jnp.asarray([[[1, 2, 3], [1, 4, 5], [1, 2, 6], [1, 7, -1]]])
  t = tree_lib.pack(beams, 8)
  node = np.asarray(t.node_BWL[0])

  def credit(num, beam):
    end = node[beam, num]
    v = verify.Verdict(path_BA=jnp.zeros((1, 3), jnp.int32), num_accepted_B=jnp.asarray([num]),
                       tokens_BA=jnp.zeros((1, 3), jnp.int32), end_slot_B=jnp.asarray([end]))
    return np.asarray(winning_source(t, v, sources))[0].tolist()

  assert credit(0, 0) == [0, 0, 0]  # nothing drafted was accepted
  assert credit(1, 2) == [1, 0, 0]  # [1 2]: the lookup holds it, so does drafter beam 0
  assert credit(2, 2) == [0, 1, 0]  # [1 2 6]: the lookup's alone
  assert credit(2, 1) == [1, 0, 0]
  assert credit(1, 3) == [0, 0, 1]  # [1 7]: the alternative's alone
  v = verify.Verdict(path_BA=jnp.zeros((1, 3), jnp.int32), num_accepted_B=jnp.asarray([1]),
                     tokens_BA=jnp.zeros((1, 3), jnp.int32), end_slot_B=jnp.asarray([node[3, 1]]))
  with pytest.raises(ValueError, match="3 beam sources for a tree of 4 beams"):
    winning_source(t, v, sources[:3])


def assert_same_verdict(got, want):
  for name in ("path_BA", "num_accepted_B", "tokens_BA", "end_slot_B"):
    np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)


@pytest.mark.parametrize("W,L", [(1, 4), (3, 4), (4, 5)])
@JIT
def test_greedy_verdict_equals_every_rule_at_temperature_zero(W, L, jitted):
  """The all-greedy fast path gives the exact (and typical) rule's verdict at temperature 0, on
  random trees with shared prefixes and logits whose argmax follows the drafts to random depths,
  including tied maxima (the lowest token id wins in both)."""
  r = rules(jitted)
  Vb, B, seeds = 6, 8, 25
  params = sampling.SamplingParams.make(B)
  for seed in range(seeds):
    rng = np.random.default_rng(seed)
    beams = rng.integers(0, 3, (B, W, L))  # a small alphabet: many shared prefixes
    beams[:, :, 0] = rng.integers(0, Vb, (B, 1))
    t = r.pack(jnp.asarray(beams, jnp.int32), W * (L - 1) + 1)
    logits = rng.integers(-2, 2, (B, t.size, Vb)).astype(np.float32)  # ties are common
    # Plant each slot's first child as its argmax with probability 1/2.
    tokens, parent = np.asarray(t.tokens_BN), np.asarray(t.parent_BN)
    for b in range(B):
      for n in range(t.size - 1, 0, -1):  # the lowest slot among siblings is planted last
        if parent[b, n] >= 0 and rng.random() < 0.5:
          logits[b, parent[b, n], tokens[b, n]] = 5.0
    logits = jnp.asarray(logits)
    greedy = r.greedy(t, logits, beam_length=L)
    assert_same_verdict(greedy, r.exact(jax.random.key(seed), t, logits, params, beam_length=L,
                                        filtered=False))
    beams_out = BeamOutput(jnp.asarray(beams, jnp.int32), jnp.zeros((B, W, L - 1)),
                           jnp.zeros((B, W)))
    typical = r.typical(jax.random.key(seed), t, beams_out, logits, params, eps=0.3, delta=0.09,
                        filtered=False)
    for name in ("num_accepted_B", "tokens_BA"):  # the same tokens (beam-indexed path slots)
      np.testing.assert_array_equal(getattr(typical, name), getattr(greedy, name), err_msg=name)
