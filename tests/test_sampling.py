"""The target distribution (temperature, top-k, top-p) and sampling from it.

``target_logprobs`` is compared with transformers' own logits warpers (temperature, then top-k,
then top-p on what top-k kept), and draws are checked against it with a chi-square test, both
directly and end to end through ``generate``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import tiny_models
from redrafter_jax.inference import sampling
from redrafter_jax.inference.ar import generate

V = 64


def hf_probs(logits_BV: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
  """The distribution transformers' ``generate(do_sample=True)`` draws from."""
  import torch
  from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

  scores = torch.as_tensor(logits_BV, dtype=torch.float32)
  scores = TemperatureLogitsWarper(temperature)(None, scores)
  if top_k > 0:
    scores = TopKLogitsWarper(top_k)(None, scores)
  if top_p < 1:
    scores = TopPLogitsWarper(top_p)(None, scores)
  return torch.softmax(scores, dim=-1).numpy()


def random_logits(seed, shape, scale=3.0):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale


SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 10, 1.0), (1.0, 0, 0.8), (0.8, 20, 0.9),
            (1.0, 3, 0.5), (2.0, 40, 0.3)]


@pytest.mark.parametrize("temperature, top_k, top_p", SETTINGS)
def test_target_distribution_matches_transformers_warpers(temperature, top_k, top_p):
  logits = random_logits(0, (6, V))
  params = sampling.SamplingParams.make(6, temperature, top_p, top_k)
  ours = np.exp(np.asarray(sampling.target_logprobs(jnp.asarray(logits), params,
                                                    filtered=sampling.needs_filter(top_p, top_k))))
  ref = hf_probs(logits, temperature, top_k, top_p)
  np.testing.assert_allclose(ours, ref, atol=1e-6)
  kept = (ref > 0).sum(-1)
  if top_k:
    assert (kept <= top_k).all()
  if top_p < 1 or top_k:
    assert (kept < V).all()  # the filter really removes tokens in these settings


def test_per_row_settings_and_extra_axes():
  rows = [(0.0, 0, 1.0), (1.0, 5, 1.0), (0.5, 0, 0.7)]
  logits_BNV = random_logits(1, (3, 4, V))
  params = sampling.SamplingParams.make(3, [r[0] for r in rows], [r[2] for r in rows],
                                        [r[1] for r in rows])
  probs = np.exp(np.asarray(sampling.target_logprobs(jnp.asarray(logits_BNV), params,
                                                     filtered=True)))
  greedy = np.zeros((4, V))
  greedy[np.arange(4), logits_BNV[0].argmax(-1)] = 1
  np.testing.assert_array_equal(probs[0], greedy)
  for b in (1, 2):
    t, k, p = rows[b]
    np.testing.assert_allclose(probs[b], hf_probs(logits_BNV[b], t, k, p), atol=1e-6)


# (temperature, top_k, top_p, logit scale, exact from 32 candidates of 512): top-k within
# them; top-p reached within them (peaked logits); top-p needing more (flat logits); top-k
# beyond them; no filter on the row.
CANDIDATE_ROWS = [(1.0, 20, 1.0, 3.0, True), (0.8, 32, 0.9, 1.0, True),
                  (1.0, 0, 0.8, 8.0, True), (1.0, 0, 0.99, 0.3, False),
                  (1.0, 100, 0.9, 0.3, False), (0.7, 0, 1.0, 3.0, True)]


def test_filter_from_candidates_is_exact_where_it_says_so(monkeypatch):
  """The top-k/top-p filter from the largest values alone (``lax.top_k``) equals transformers'
  warpers on every row it calls exact, and calls exact exactly the rows whose cut falls among
  the candidates; ``target_logprobs`` equals the warpers on every row, whether all rows of a
  call are exact (the candidate path) or some are not (the full sort)."""
  Vb, C = 512, 32
  rows = CANDIDATE_ROWS
  logits = np.stack([random_logits(10 + i, (Vb,), scale=r[3]) for i, r in enumerate(rows)])
  make = lambda rs: sampling.SamplingParams.make(len(rs), [r[0] for r in rs],
                                                 [r[2] for r in rs], [r[1] for r in rs])
  params = make(rows)
  scaled = jnp.asarray(logits) / params.temperature_B[:, None]
  cut, exact = sampling._candidate_cut(scaled, params.top_k_B[:, None], params.top_p_B[:, None],
                                       C)
  assert np.asarray(exact)[:, 0].tolist() == [r[4] for r in rows]
  monkeypatch.setattr(sampling, "FILTER_CANDIDATES", C)
  for i, (t, k, p, _, is_exact) in enumerate(rows):
    want = hf_probs(logits[i:i + 1], t, k, p)
    if is_exact:
      np.testing.assert_allclose(np.asarray(jax.nn.softmax(cut[i:i + 1])), want, atol=1e-6)
    assert (want > 0).sum() < Vb or (k, p) == (0, 1.0)
  for subset in ([0, 1, 2, 5], list(range(len(rows)))):  # all exact; some not
    got = np.exp(np.asarray(sampling.target_logprobs(jnp.asarray(logits[subset]),
                                                     make([rows[i] for i in subset]),
                                                     filtered=True)))
    for j, i in enumerate(subset):
      t, k, p = rows[i][:3]
      np.testing.assert_allclose(got[j:j + 1], hf_probs(logits[i:i + 1], t, k, p), atol=1e-6)


def test_unfiltered_path_equals_softmax():
  logits = random_logits(2, (2, V))
  params = sampling.SamplingParams.make(2, 0.5)
  assert not sampling.needs_filter(1.0, 0)
  ours = sampling.target_logprobs(jnp.asarray(logits), params, filtered=False)
  np.testing.assert_allclose(np.asarray(ours), jax.nn.log_softmax(logits / 0.5), atol=1e-5)


def chi_square_pvalue(draws: np.ndarray, probs: np.ndarray) -> float:
  """p-value that ``draws`` came from ``probs`` (categories with tiny expectation pooled)."""
  n = len(draws)
  probs = np.asarray(probs, np.float64) / np.sum(probs, dtype=np.float64)
  observed = np.bincount(draws, minlength=len(probs)).astype(float)
  assert observed[probs == 0].sum() == 0, "drew a token the filter excludes"
  expected = probs * n
  big = expected >= 5
  obs = np.append(observed[big], observed[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  if exp[-1] < 5:  # fold the small remainder into the last big category
    obs[-2] += obs[-1]
    exp[-2] += exp[-1]
    obs, exp = obs[:-1], exp[:-1]
  return float(scipy.stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.8, 20, 0.9)])
def test_sample_draws_follow_the_target_distribution(temperature, top_k, top_p):
  logits = random_logits(3, (1, V), scale=1.5)
  params = sampling.SamplingParams.make(1, temperature, top_p, top_k)
  logp = sampling.target_logprobs(jnp.asarray(logits), params, filtered=True)
  keys = jax.random.split(jax.random.key(0), 20000)
  draws = np.asarray(jax.vmap(lambda k: sampling.sample(k, logp)[0])(keys))
  probs = hf_probs(logits, temperature, top_k, top_p)[0]
  assert chi_square_pvalue(draws, probs) > 1e-3
  # The test has power: a slightly different distribution is rejected.
  other = hf_probs(logits, temperature * 1.15, top_k, top_p)[0]
  assert chi_square_pvalue(draws, other) < 1e-3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  return tiny_models.load_tiny(tmp_path_factory.mktemp("tiny"), "llama", seed=3)


def test_generate_first_token_distribution(tiny):
  """2048 rows of one prompt, one token each: their histogram is the filtered softmax."""
  model, _, hf = tiny
  ids = np.random.default_rng(4).integers(0, tiny_models.VOCAB, 12)
  logits = tiny_models.hf_logits(hf, ids[None])[:, -1]
  settings = dict(temperature=0.7, top_k=30, top_p=0.9)
  out = generate(model, [ids.tolist()] * 2048, max_new_tokens=1, seed=5, **settings)
  draws = np.array([t[0] for t in out.tokens])
  probs = hf_probs(logits, settings["temperature"], settings["top_k"], settings["top_p"])[0]
  assert chi_square_pvalue(draws, probs) > 1e-3
  hot = hf_probs(logits, 1.5, 0, 1.0)[0]  # a wrong temperature is detected
  assert chi_square_pvalue(draws, np.where(probs > 0, hot, 0) / hot[probs > 0].sum()) < 1e-3


def test_same_seed_same_output_other_seed_differs(tiny):
  model = tiny[0]
  prompts = [[1, 2, 3, 4], [5, 6, 7]]
  a = generate(model, prompts, max_new_tokens=16, temperature=1.0, top_p=0.95, seed=7).tokens
  b = generate(model, prompts, max_new_tokens=16, temperature=1.0, top_p=0.95, seed=7).tokens
  c = generate(model, prompts, max_new_tokens=16, temperature=1.0, top_p=0.95, seed=8).tokens
  assert a == b
  assert a != c


def test_top_k_1_equals_greedy(tiny):
  model = tiny[0]
  prompts = [[9, 8, 7, 6, 5], [3, 1, 4, 1, 5, 9, 2, 6]]
  greedy = generate(model, prompts, max_new_tokens=16).tokens
  assert generate(model, prompts, max_new_tokens=16, temperature=1.7, top_k=1,
                  seed=11).tokens == greedy
  # A tiny top_p keeps only the most likely token as well.
  assert generate(model, prompts, max_new_tokens=16, temperature=1.0, top_p=1e-6,
                  seed=12).tokens == greedy


def test_lower_temperature_concentrates_the_draws(tiny):
  model = tiny[0]
  ids = [11, 12, 13, 14, 15, 16]
  distinct = {}
  for t in (0.3, 1.0, 3.0):
    out = generate(model, [ids] * 512, max_new_tokens=1, temperature=t, seed=13)
    distinct[t] = len({tok[0] for tok in out.tokens})
  assert distinct[0.3] < distinct[1.0] < distinct[3.0]


def test_greedy_tokens_is_argmax_with_its_ties_and_nans():
  """``greedy_tokens`` answers as ``jnp.argmax`` (first index among ties, first NaN when there
  is one) for every row kind decoding can meet, over any leading axes."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(6, 3, 257)).astype(np.float32)
  x[0, 0, [5, 9, 200]] = 10.0  # a three-way tie: the first wins
  x[0, 1] = 1.0  # all equal
  x[0, 2] = -np.inf  # nothing allowed
  x[1, 0, [3, 100]] = np.nan  # NaNs win, the first of them
  x[1, 1, 256] = np.inf
  x[1, 2, [0, 256]] = np.inf
  x[2] = np.round(x[2])  # many ties
  x = jnp.asarray(x)
  got = sampling.greedy_tokens(x)
  assert got.dtype == jnp.int32 and got.shape == (6, 3)
  np.testing.assert_array_equal(got, jnp.argmax(x, axis=-1))
  assert got[0, 0] == 5 and got[1, 0] == 3 and got[1, 2] == 0
  bf16 = x.astype(jnp.bfloat16)
  np.testing.assert_array_equal(sampling.greedy_tokens(bf16), jnp.argmax(bf16, axis=-1))


def test_sample_draws_what_jax_random_categorical_draws():
  """``sample`` is the Gumbel-max draw of ``jax.random.categorical`` (the same noise, argmax
  taken by ``greedy_tokens``): the same key gives the same tokens."""
  logits = jax.random.normal(jax.random.key(1), (8, 5, 500)) * 3
  logp = jax.nn.log_softmax(logits.at[..., :7].set(-jnp.inf), axis=-1)
  for seed in range(5):
    key = jax.random.key(seed)
    np.testing.assert_array_equal(sampling.sample(key, logp),
                                  jax.random.categorical(key, logp, axis=-1))
  assert (sampling.sample(jax.random.key(0), logp) >= 7).all()  # -inf never drawn
