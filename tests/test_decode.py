"""ReDrafter decode on a tiny random model: exactness vs AR, cache commits, batching, tracing."""

import numpy as np
import pytest
from flax import nnx

from oracle import OracleDrafter
from redrafter_jax.config import ConfigError, DecodeConfig, DrafterConfig
from redrafter_jax.inference import decode as decode_lib
from redrafter_jax.inference.ar import generate
from redrafter_jax.inference.decode import decode, decode_stepwise
from redrafter_jax.inference.runtime import GenerateError
from redrafter_jax.models.drafter import Drafter
from tiny_models import TINY_LLM, TINY_VOCAB, tiny_llm

pytestmark = pytest.mark.usefixtures("float32_matmuls")  # float32 parity: no TF32 on GPUs

V = TINY_VOCAB
CFG = TINY_LLM
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [20]]


@pytest.fixture(scope="module")
def ar_greedy(llm):
  return generate(llm, PROMPTS, max_new_tokens=24)


@pytest.mark.parametrize("W,L", [(1, 2), (4, 4), (3, 5), (8, 3)])
def test_random_drafter_greedy_equals_ar(llm, drafter, ar_greedy, W, L):
  result = decode(llm, drafter, PROMPTS, DecodeConfig(beam_width=W, beam_length=L,
                                                      max_new_tokens=24))
  assert result.tokens == ar_greedy.tokens


@pytest.mark.parametrize("W,L,budget", [(3, 4, None), (4, 5, None), (4, 5, 9), (2, 6, 6)])
def test_oracle_drafter_every_accept_length(llm, ar_greedy, W, L, budget):
  """Drafts that ARE accepted: multi-token commits must keep the output identical to AR."""
  oracle = OracleDrafter(np.asarray([t for t in ar_greedy.tokens]), V)
  cfg = DecodeConfig(beam_width=W, beam_length=L, max_new_tokens=24, token_budget=budget)
  seen = []
  result = decode_stepwise(llm, oracle, PROMPTS, cfg,
                           on_step=lambda s: seen.append(np.asarray(s.metrics.accept_hist_BL)))
  assert result.tokens == ar_greedy.tokens
  hist = np.asarray(result.metrics["accepted_length_histogram"])
  if budget is None:
    # The planted error depth cycles through 1..L, so every accepted length occurs.
    assert (hist > 0).all(), hist
  else:
    assert hist.sum() == result.metrics["steps"] and hist[0] > 0 and hist[1:].sum() > 0
  # The jitted while_loop gives the same tokens and statistics as its Python-loop twin.
  looped = decode(llm, oracle, PROMPTS, cfg)
  assert looped.tokens == result.tokens
  assert looped.metrics == result.metrics


def test_oracle_accepts_exactly_the_planted_prefix(llm, ar_greedy):
  W, L = 3, 4
  oracle = OracleDrafter(np.asarray(ar_greedy.tokens), V)
  cfg = DecodeConfig(beam_width=W, beam_length=L, max_new_tokens=24)
  hist_before = [np.zeros((len(PROMPTS), L), int)]
  step = [0]

  def check(state):
    hist = np.asarray(state.metrics.accept_hist_BL)
    delta = hist - hist_before[-1]
    hist_before.append(hist)
    planted = (step[0] + np.arange(len(PROMPTS))) % L  # accepted = planted depth - 1
    for b in range(len(PROMPTS)):
      if delta[b].sum():  # row was active this step
        assert delta[b, planted[b]] == 1, (step[0], b, delta[b])
    step[0] += 1

  decode_stepwise(llm, oracle, PROMPTS, cfg, on_step=check)
  assert step[0] > 3


def test_tokens_per_step_and_metrics_consistent(llm, ar_greedy):
  oracle = OracleDrafter(np.asarray(ar_greedy.tokens), V)
  r = decode(llm, oracle, PROMPTS, DecodeConfig(beam_width=4, beam_length=5, max_new_tokens=24))
  m = r.metrics
  assert sum(m["accepted_length_histogram"]) == m["steps"] == sum(m["steps_per_row"])
  expected = (m["accepted_tokens"] + m["steps"]) / m["steps"]
  assert m["tokens_per_step"] == pytest.approx(expected)
  assert m["tokens_per_step"] > 2.0  # the oracle's accepted lengths cycle 0..4: mean 3
  assert 1 <= m["mean_tree_tokens"] <= 4 * 4 + 1
  assert 0 < m["dedup_saving"] < 1
  rates = m["per_depth_acceptance"]
  assert len(rates) == 4 and all(0 <= r <= 1 for r in rates)
  # No lookup beam, no alternatives: every accepted token is the drafter's.
  assert m["accepted_per_step_by_source"] == pytest.approx(
      dict(drafter=m["accepted_tokens"] / m["steps"], lookup=0.0, alternative=0.0))


def test_batched_rows_finish_independently(llm, drafter, ar_greedy):
  # Use a token that row 0 emits early (first at index k >= 2) as a stop token: row 0 finishes
  # first, after k + 1 tokens, and the others go on.
  row0 = ar_greedy.tokens[0]
  k = next(i for i in range(2, len(row0)) if row0[i] not in row0[:i])
  stop = row0[k]
  ar = generate(llm, PROMPTS, max_new_tokens=24, stop_ids=[stop])
  r = decode(llm, drafter, PROMPTS, DecodeConfig(beam_width=4, beam_length=4, max_new_tokens=24),
             stop_ids=[stop])
  assert r.tokens == ar.tokens
  assert r.stopped == ar.stopped
  lengths = [len(t) for t in r.tokens]
  assert lengths[0] == k + 1 and max(lengths) > k + 1
  # Per-row: each row alone decodes the same tokens as inside the batch.
  for i, prompt in enumerate(PROMPTS):
    alone = decode(llm, drafter, [prompt], DecodeConfig(beam_width=4, beam_length=4,
                                                        max_new_tokens=24), stop_ids=[stop])
    assert alone.tokens[0] == r.tokens[i]


def test_decode_traced_once_per_shape(llm, drafter):
  """One loop program per static shape and per kind of batch (all greedy, or sampling)."""
  cfg = DecodeConfig(beam_width=2, beam_length=3, max_new_tokens=9)
  before = decode_lib.TRACE_COUNT["decode"]
  decode(llm, drafter, [[1, 2, 3], [4, 5]], cfg)
  decode(llm, drafter, [[5, 5], [6, 6, 6]], cfg, temperature=0.0)
  after_greedy = decode_lib.TRACE_COUNT["decode"]
  # Same static shape (prompt length rounds to the same bucket), other prompts, seeds and
  # temperatures: one more program for sampling, then no retrace; the loop runs many steps
  # inside one compiled program.
  r = decode(llm, drafter, [[9, 8, 7, 6], [3]], cfg, seed=3, temperature=0.8)
  decode(llm, drafter, [[2], [3, 4]], cfg, seed=4, temperature=[1.0, 0.0])
  assert after_greedy == before + 1
  assert decode_lib.TRACE_COUNT["decode"] == after_greedy + 1
  assert r.steps > 1


@pytest.mark.parametrize("kwargs,match", [
    (dict(beam_width=0), "beam_width"),
    (dict(beam_length=1), "beam_length"),
    (dict(beam_width=4, beam_length=4, token_budget=3), "token_budget"),
    (dict(beam_width=4, beam_length=4, token_budget=14), "token_budget"),
    (dict(temperature=-1.0), "temperature"),
    (dict(acceptance="magic"), "acceptance"),
    (dict(first_alternatives=-1), "first_alternatives"),
    (dict(first_alternatives=True), "first_alternatives"),
    (dict(first_alternatives=2, acceptance="reference"), "step-1 alternatives"),
    (dict(first_alternatives=9, draft_vocab_size=8), "first_alternatives"),
    (dict(beam_width=1, beam_length=4, first_alternatives=3, token_budget=8), "token_budget"),
])
def test_bad_decode_config(kwargs, match):
  with pytest.raises(ConfigError, match=match):
    DecodeConfig(**kwargs)


def test_bad_inputs(llm, drafter):
  cfg = DecodeConfig(beam_width=2, beam_length=3, max_new_tokens=8)
  with pytest.raises(GenerateError, match="empty"):
    decode(llm, drafter, [[1, 2], []], cfg)
  with pytest.raises(GenerateError, match="temperature"):
    decode(llm, drafter, [[1, 2]], cfg, temperature=-0.5)
  other = Drafter(DrafterConfig(vocab_size=V + 1, hidden_size=32, exit_dim=16), rngs=nnx.Rngs(0))
  with pytest.raises(GenerateError, match="does not match the LLM"):
    decode(llm, other, [[1, 2]], cfg)
  with pytest.raises(GenerateError, match="context"):
    decode(llm, drafter, [[1] * 8190], cfg)


def test_restricted_draft_vocab_keeps_greedy_exact(llm, ar_greedy):
  # Rank the tokens the model actually emits first, so restricted drafts can be accepted.
  d = Drafter(DrafterConfig(vocab_size=V, hidden_size=32, exit_dim=48), rngs=nnx.Rngs(4))
  emitted = [t for row in ar_greedy.tokens for t in row]
  counts = np.bincount(emitted, minlength=V)
  d.token_ranking[...] = np.argsort(-counts, kind="stable").astype(np.int32)
  cfg = DecodeConfig(beam_width=4, beam_length=4, max_new_tokens=24, draft_vocab_size=8)
  r = decode(llm, d, PROMPTS, cfg)
  assert r.tokens == ar_greedy.tokens
  with pytest.raises(ConfigError, match="reference"):
    DecodeConfig(draft_vocab_size=8, acceptance="reference")


@pytest.mark.parametrize("W,L,lookup,budget", [(1, 3, 0, None), (2, 4, 2, None), (2, 4, 0, 6)])
def test_step1_alternatives_keep_greedy_exact_and_get_accepted(llm, ar_greedy, W, L, lookup,
                                                               budget):
  """The model's own tokens ranked first and 8 of them drafted: the 8 step-1 alternatives hold
  the LLM's next token wherever it is one of the 8, so more drafted tokens are accepted than
  by the beams alone, and the tokens stay AR's (also in the Python-loop twin)."""
  import dataclasses

  d = Drafter(DrafterConfig(vocab_size=V, hidden_size=32, exit_dim=48), rngs=nnx.Rngs(4))
  emitted = [t for row in ar_greedy.tokens for t in row]
  d.token_ranking[...] = np.argsort(-np.bincount(emitted, minlength=V), kind="stable"
                                    ).astype(np.int32)
  base = DecodeConfig(beam_width=W, beam_length=L, max_new_tokens=24, draft_vocab_size=8,
                      lookup_ngram=lookup)
  alts = dataclasses.replace(base, first_alternatives=8, token_budget=budget)
  plain, with_alts = decode(llm, d, PROMPTS, base), decode(llm, d, PROMPTS, alts)
  assert plain.tokens == with_alts.tokens == ar_greedy.tokens
  assert with_alts.metrics["accepted_tokens"] > plain.metrics["accepted_tokens"]
  # The accepted tokens that only an alternative held are counted as the alternatives'.
  by, m = with_alts.metrics["accepted_per_step_by_source"], with_alts.metrics
  assert by["alternative"] > 0 and plain.metrics["accepted_per_step_by_source"]["alternative"] == 0
  assert sum(by.values()) == pytest.approx(m["tokens_per_step"] - 1)
  stepwise = decode_stepwise(llm, d, PROMPTS, alts)
  assert stepwise.tokens == with_alts.tokens and stepwise.metrics == with_alts.metrics


def test_context_buckets_keep_tokens_and_cross_segments(llm, drafter):
  """With small context buckets the loop runs in segments, each reading only a bucket of the
  cache; the tokens equal AR's and the Python-loop twin's, and each bucket used is one program."""
  from redrafter_jax.models import kv_cache as kvc

  prompts = [[1, 2, 3, 4, 5], list(range(1, 30))]
  cfg = DecodeConfig(beam_width=2, beam_length=3, max_new_tokens=40)
  ar = generate(llm, prompts, max_new_tokens=40)
  rd = decode_lib.ReDrafter(llm, drafter, cfg, min_bucket=16)
  assert kvc.context_buckets(128, 16) == (16, 32, 64, 128)
  widths = []
  p = rd.prepare(prompts, cache_size=128)
  state = rd.start(p)
  while not bool(np.all(np.asarray(state.done_B))):
    widths.append(rd.width(p, state))
    state = rd.step(p, state)
  assert widths[0] == 64 and widths[-1] is None and 64 in widths  # crossed 64 -> whole cache
  before = decode_lib.TRACE_COUNT["decode"]
  looped = rd(prompts, cache_size=128)
  assert decode_lib.TRACE_COUNT["decode"] == before + 2  # the 64 bucket, then the whole cache
  assert looped.tokens == ar.tokens
  assert decode_lib.DecodeResult.from_state(state).tokens == ar.tokens
  whole = decode_lib.ReDrafter(llm, drafter, cfg, min_bucket=None)(prompts, cache_size=128)
  assert whole.tokens == ar.tokens and whole.steps == looped.steps


def test_bf16_weights_draft_from_a_float32_table_made_once(drafter):
  """With bfloat16 weights ``ReDrafter`` keeps one float32 copy of the embedding table for the
  drafter (each compiled call would otherwise convert the whole table); greedy decoding, looped
  and stepwise, still equals greedy AR of the same bf16 model."""
  import jax.numpy as jnp

  from redrafter_jax.models.llama import Llama

  llm = Llama(CFG, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  rd = decode_lib.ReDrafter(llm, drafter, DecodeConfig(beam_width=3, beam_length=3,
                                                       max_new_tokens=16))
  assert rd.draft_embed.dtype == np.float32
  np.testing.assert_array_equal(np.asarray(rd.draft_embed),
                                np.asarray(llm.embed_tokens.embedding[...], np.float32))
  ar = generate(llm, PROMPTS, max_new_tokens=16)
  assert rd(PROMPTS).tokens == ar.tokens
  assert rd.stepwise(PROMPTS).tokens == ar.tokens
  assert decode_lib.ReDrafter(tiny_llm(), drafter, DecodeConfig()).draft_embed is None


def test_scanned_layers_decode_like_the_unrolled_model(llm, drafter, ar_greedy):
  """A model that scans over its layers (``stack_layers``, a stacked KV cache) decodes the same
  greedy tokens as AR with the unrolled model: the looped program, its Python-loop twin, and
  across context buckets (programs that read a slice of the stacked cache)."""
  from redrafter_jax.models.llama import stack_layers

  scanned = stack_layers(nnx.clone(llm))
  cfg = DecodeConfig(beam_width=3, beam_length=4, max_new_tokens=24)
  assert decode(scanned, drafter, PROMPTS, cfg).tokens == ar_greedy.tokens
  assert decode_stepwise(scanned, drafter, PROMPTS, cfg).tokens == ar_greedy.tokens
  prompts = [[1, 2, 3, 4, 5], list(range(1, 30))]
  rd = decode_lib.ReDrafter(scanned, drafter, DecodeConfig(beam_width=2, beam_length=3,
                                                           max_new_tokens=40), min_bucket=16)
  assert rd(prompts, cache_size=128).tokens == generate(llm, prompts, max_new_tokens=40).tokens
