"""Context lookup (the prompt-lookup beam): the match rule against a plain Python reference, and
the context bookkeeping in decode and in the server's slot batch (exactness when sampling with
the beam on: test_verify)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from redrafter_jax.config import ConfigError, DecodeConfig
from redrafter_jax.inference import lookup
from redrafter_jax.inference.ar import generate
from redrafter_jax.inference.decode import decode, decode_stepwise
from redrafter_jax.serving import batch as batch_lib
from tiny_models import TINY_LLM, TINY_VOCAB

pytestmark = pytest.mark.usefixtures("float32_matmuls")  # float32 parity: no TF32 on GPUs

V = TINY_VOCAB
CFG = TINY_LLM
# Prompts that repeat themselves (a copy is there to find) and ones that do not.
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], [7, 8, 9], [3, 4, 3, 4, 3, 4, 3], [20]]


def reference_beam(context, length, fallback, max_ngram):
  """The lookup rule written as loops: longest n-gram first, then the latest match whose
  continuation is fully known."""
  L = len(fallback)
  seq = list(context[:length + 1])
  for n in range(max_ngram, 0, -1):
    if length + 1 < n:
      continue
    tail = seq[length - n + 1:]
    for e in range(length - (L - 1), n - 2, -1):
      if seq[e - n + 1:e + 1] == tail:
        return seq[e:e + L], True
  return list(fallback), False


@pytest.mark.parametrize("max_ngram,L", [(1, 2), (2, 4), (3, 5), (4, 3)])
def test_lookup_beam_matches_reference(max_ngram, L):
  rng = np.random.default_rng(max_ngram * 10 + L)
  B, S = 64, 24
  context = rng.integers(0, 3, size=(B, S))  # 3 tokens: matches of every length occur
  length = rng.integers(0, S, size=B)
  fallback = rng.integers(100, 200, size=(B, L))
  fallback[:, 0] = context[np.arange(B), length]
  beam, found = lookup.lookup_beam(jnp.asarray(context, jnp.int32), jnp.asarray(length, jnp.int32),
                                   jnp.asarray(fallback, jnp.int32), max_ngram=max_ngram)
  found_any = 0
  for b in range(B):
    want, want_found = reference_beam(context[b], length[b], fallback[b], max_ngram)
    assert np.asarray(beam[b]).tolist() == want, b
    assert bool(found[b]) == want_found
    found_any += want_found
  assert 0 < found_any < B  # both cases are exercised


def test_write_drops_past_count_and_size():
  ctx = jnp.zeros((2, 6), jnp.int32)
  out = lookup.write(ctx, jnp.array([1, 4]), jnp.array([[7, 8, 9], [7, 8, 9]]), jnp.array([2, 3]))
  assert np.asarray(out).tolist() == [[0, 7, 8, 0, 0, 0], [0, 0, 0, 0, 7, 8]]


@pytest.mark.parametrize("W,L,n,budget", [(1, 4, 3, None), (2, 5, 2, None), (1, 2, 1, None),
                                          (2, 4, 3, 5)])
def test_greedy_with_lookup_equals_ar_and_context_is_the_text(llm, drafter, W, L, n, budget):
  """With a budget the tree keeps the lookup beam first and cuts the drafter's nodes."""
  ar = generate(llm, PROMPTS, max_new_tokens=32)
  cfg = DecodeConfig(beam_width=W, beam_length=L, max_new_tokens=32, lookup_ngram=n,
                     token_budget=budget)

  def check(state):  # the context is exactly prompt + emitted tokens (g0 last) in every row
    ctx, length = np.asarray(state.context_BS), np.asarray(state.cache.lengths_B)
    out, num = np.asarray(state.out.tokens_BM), np.asarray(state.out.num_B)
    for b, prompt in enumerate(PROMPTS):
      text = prompt + out[b, :num[b]].tolist()
      # A row's last step may commit past max_new_tokens (the output is cut, the cache not).
      n = min(length[b] + 1, len(text))
      assert n >= len(text) - 1 and ctx[b, :n].tolist() == text[:n], b

  result = decode_stepwise(llm, drafter, PROMPTS, cfg, on_step=check)
  assert result.tokens == ar.tokens
  assert decode(llm, drafter, PROMPTS, cfg).metrics == result.metrics
  # The random model's greedy text loops: copies from the context are accepted, so lookup
  # gives more tokens per step than the (random, useless) drafter alone.
  alone = decode(llm, drafter, PROMPTS, DecodeConfig(beam_width=W, beam_length=L,
                                                     max_new_tokens=32))
  if L > 2:
    assert result.metrics["tokens_per_step"] > alone.metrics["tokens_per_step"] + 0.3, (
        result.metrics["tokens_per_step"], alone.metrics["tokens_per_step"])
  # The metrics credit those copies to the lookup beam; without it, everything is the drafter's.
  by, m = result.metrics["accepted_per_step_by_source"], result.metrics
  assert sum(by.values()) == pytest.approx(m["tokens_per_step"] - 1)
  assert by["alternative"] == 0 and (by["lookup"] > 0.3 if L > 2 else by["lookup"] > 0), by
  assert alone.metrics["accepted_per_step_by_source"]["lookup"] == 0


def test_server_slot_batch_keeps_the_context(llm, drafter):
  """admit / spec_step / ar_step keep each slot's context equal to its prompt + tokens."""
  cfg = DecodeConfig(beam_width=1, beam_length=4, max_new_tokens=16, lookup_ngram=3)
  B, S, M = 3, 64, 16
  batch = batch_lib.empty(CFG, jnp.float32, B, S, M, cfg.beam_length)
  stop = jnp.asarray([-1], jnp.int32)
  prompts = {2: PROMPTS[0], 0: PROMPTS[2]}
  # Both admitted in one call, with a padding row (slot B: written nowhere).
  tokens_kT = np.zeros((3, 16), np.int32)
  for i, p in enumerate(prompts.values()):
    tokens_kT[i, :len(p)] = p
  tokens_kT[2] = tokens_kT[0]
  lengths = [len(p) for p in prompts.values()]
  k = lambda v, dt: np.full(3, v, dt)
  batch, _ = batch_lib.admit(llm, batch, np.asarray([*prompts, B], np.int32), tokens_kT,
                             np.asarray(lengths + lengths[:1], np.int32), k(0, np.uint32),
                             k(0, np.uint32), k(0, np.float32), k(1, np.float32), k(0, np.int32),
                             k(M, np.int32), stop, k(False, bool))
  assert np.asarray(batch.state.done_B).tolist() == [False, True, False]  # slot 1 still free
  greedy = jnp.int32(0)  # the sampling kind: every active request greedy
  spec = jax.jit(lambda b: batch_lib.spec_step(llm, drafter, b, stop, cfg, greedy))
  ar = jax.jit(lambda b: batch_lib.ar_step(llm, b, stop, greedy))
  for i in range(6):
    batch, _ = (ar if i % 3 == 2 else spec)(batch)
  s = batch.state
  ctx, length = np.asarray(s.context_BS), np.asarray(s.cache.lengths_B)
  out, num = np.asarray(s.out.tokens_BM), np.asarray(s.out.num_B)
  for slot, p in prompts.items():
    assert num[slot] > 6
    text = p + out[slot, :num[slot]].tolist()
    assert length[slot] + 1 == len(text)
    assert ctx[slot, :len(text)].tolist() == text
  want = generate(llm, [prompts[2]], max_new_tokens=int(num[2])).tokens[0]
  assert out[2, :num[2]].tolist() == want


@pytest.mark.parametrize("kwargs,match", [
    (dict(lookup_ngram=-1), "lookup_ngram"),
    (dict(lookup_ngram=9), "lookup_ngram"),
    (dict(lookup_ngram=2, acceptance="reference"), "lookup"),
    (dict(beam_width=1, beam_length=4, lookup_ngram=2, token_budget=8), "token_budget"),
])
def test_bad_lookup_config(kwargs, match):
  with pytest.raises(ConfigError, match=match):
    DecodeConfig(**kwargs)


def test_budget_counts_the_lookup_beam():
  assert DecodeConfig(beam_width=1, beam_length=4, lookup_ngram=3).num_tree_tokens == 7
  assert DecodeConfig(beam_width=1, beam_length=4, lookup_ngram=3,
                      token_budget=7).num_tree_tokens == 7
  assert DecodeConfig(beam_width=4, beam_length=4).num_tree_tokens == 13
