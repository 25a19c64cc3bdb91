"""The drafter's attention over the committed context (``DrafterConfig.context_attention``)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from redrafter_jax.config import ConfigError, DrafterConfig
from redrafter_jax.models.context_attention import ContextMemory, attend
from redrafter_jax.models.drafter import Drafter
from redrafter_jax.training import losses
from redrafter_jax.training.grow import grow_as_asked
from redrafter_jax.weights.drafter_io import save_drafter
from tests.test_losses import _split
from tests.tiny_models import TINY_LLM, TINY_VOCAB

D = TINY_LLM.hidden_size


def attn_drafter(seed=1, A=16, H=2, **kw) -> Drafter:
  """A drafter with context attention whose output projection is random (a fresh one is
  zero, which would hide what the attention reads)."""
  cfg = DrafterConfig(vocab_size=TINY_VOCAB, hidden_size=D, exit_dim=48, context_attention=A,
                      context_heads=H, **kw)
  d = Drafter(cfg, rngs=nnx.Rngs(seed))
  keys = jax.random.split(jax.random.key(seed), 2)
  d.ctx_out.kernel.set_value(jax.random.normal(keys[0], d.ctx_out.kernel.shape) * 0.5)
  for block in list(d.lm_head)[:-1]:
    block.linear.kernel.set_value(jax.random.normal(keys[1], block.linear.kernel.shape) * 0.2)
  return d


def brute_attend(q_A, keys_SA, values_SA, heads):
  """Softmax attention of one query over the given rows, head by head, in NumPy."""
  d = q_A.shape[0] // heads
  out = []
  for h in range(heads):
    sl = slice(h * d, (h + 1) * d)
    score = keys_SA[:, sl] @ q_A[sl] / np.sqrt(d)
    w = np.exp(score - score.max())
    out.append((w / w.sum()) @ values_SA[:, sl])
  return np.concatenate(out)


def test_config():
  for bad in (dict(context_attention=-1), dict(context_attention=15, context_heads=2),
              dict(context_attention=16, context_heads=0)):
    with pytest.raises(ConfigError, match="context_"):
      DrafterConfig(vocab_size=8, hidden_size=4, **bad)
  plain = DrafterConfig(vocab_size=8, hidden_size=4).to_dict()
  assert "context_attention" not in plain and "context_heads" not in plain
  own = DrafterConfig(vocab_size=8, hidden_size=4, context_attention=8).own_options
  assert own == {"context_attention": 8, "context_heads": 2}


def test_attend_equals_per_head_softmax_and_sees_nothing_masked():
  rng = np.random.default_rng(0)
  L, M, S, A, H = 2, 3, 7, 8, 2
  q = rng.normal(size=(L, M, A)).astype(np.float32)
  k = rng.normal(size=(L, S, A)).astype(np.float32)
  v = rng.normal(size=(L, S, A)).astype(np.float32)
  visible = rng.random((L, M, S)) < 0.6
  visible[0, 0] = False  # a query that sees nothing reads zeros
  got = np.asarray(attend(jnp.asarray(q), ContextMemory(jnp.asarray(k), jnp.asarray(v),
                                                        jnp.asarray(visible)), H))
  for l in range(L):
    for m in range(M):
      seen = visible[l, m]
      want = (np.zeros(A) if not seen.any()
              else brute_attend(q[l, m], k[l][seen], v[l][seen], H))
      np.testing.assert_allclose(got[l, m], want, rtol=1e-5, atol=1e-5)


def test_missing_memory_is_an_error():
  d = attn_drafter()
  with pytest.raises(ValueError, match="context memory"):
    d.logits(jnp.zeros((1, 2, D)), jnp.zeros((1, 2, D)))


def test_training_path_equals_a_step_by_step_reference():
  """``distill_loss``'s logits are those of a step-by-step drafter whose memory holds exactly
  the positions j <= t of t's packed sequence (keys from h_j and tok_j, values from h_j and
  tok_{j+1})."""
  d = attn_drafter()
  rng = np.random.default_rng(3)
  B, T, n = 2, 12, 3
  tokens = jnp.asarray(rng.integers(0, TINY_VOCAB, (B, T)).astype(np.int32))
  seg = np.array([[1] * 12, [1] * 6 + [2] * 6], np.int32)
  emb = jnp.asarray(rng.normal(size=(TINY_VOCAB, D)).astype(np.float32))
  h = jnp.asarray(rng.normal(size=(B, T, D)).astype(np.float32))
  keys, values = d.memory_entries(h, emb[tokens],
                                  emb[losses.future_window(tokens, 1, 1)[:, :, 0]])
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  from redrafter_jax.models.context_attention import causal_visible
  memory = ContextMemory(keys, values, causal_visible(pos, jnp.asarray(seg), jnp.asarray(seg)))
  prev = emb[losses.future_window(tokens, 1, n)]
  got = np.asarray(d.unroll_logits(h, prev, memory=memory))
  checked = 0
  for b in range(B):
    for t in range(T - n - 1):
      same = np.flatnonzero((seg[b] == seg[b, t]) & (np.arange(T) <= t))
      one = ContextMemory(keys[b:b + 1, same], values[b:b + 1, same],
                          jnp.ones((1, 1, same.size), bool))
      s = jnp.zeros((1, 1, D))
      for i in range(n):
        logp, s = d.step(h[b:b + 1, t:t + 1], s, emb[tokens[b, t + 1 + i]][None, None],
                         memory=one)
        np.testing.assert_allclose(jax.nn.log_softmax(got[b, t, i]), logp[0, 0], rtol=1e-5,
                                   atol=1e-5)
        checked += 1
  assert checked == 2 * (T - n - 1) * n


def test_the_loss_never_reads_the_future():
  """Changing the tokens and states after what position t's steps read leaves t's loss terms
  as they are (seen through the gradient of the loss with respect to h at t' > t being zero
  for the terms at t: here, the whole loss of a row whose later part is perturbed)."""
  d = attn_drafter(seed=4)
  of, params = _split(d)
  rng = np.random.default_rng(7)
  B, T, n = 1, 14, 2
  tokens = rng.integers(0, TINY_VOCAB, (B, T)).astype(np.int32)
  mask = np.zeros((B, T), np.int32)
  mask[:, :8] = 1  # only the targets up to position 7 count: positions t <= 5 at n = 2
  seg = np.ones((B, T), np.int32)
  emb = rng.normal(size=(TINY_VOCAB, D)).astype(np.float32)
  h = rng.normal(size=(B, T, D)).astype(np.float32)
  run = lambda tok, hid: float(losses.distill_loss(
      of, params, losses.LossBatch(*map(jnp.asarray, (hid, emb, tok, mask, seg))),
      losses.LossConfig(num_steps=n, chunk=4))[0])
  base = run(tokens, h)
  # Positions t <= 5 read h and keys at j <= 5 and tokens up to t + 1 + n - 1 + 1 = 8 (the
  # targets) and values' next tokens up to 6; everything from 9 on may change freely.
  tokens2, h2 = tokens.copy(), h.copy()
  tokens2[:, 9:] = (tokens2[:, 9:] + 1) % TINY_VOCAB
  h2[:, 6:] = rng.normal(size=h2[:, 6:].shape)
  assert run(tokens2, h2) == pytest.approx(base, rel=1e-6)
  h3 = h.copy()
  h3[:, 3] += 1.0  # a position the memory holds: the loss moves
  assert run(tokens, h3) != pytest.approx(base, rel=1e-6)


def test_grown_drafter_starts_as_it_was_and_learns_to_read():
  from tests.test_losses import _drafter, _example

  old = _drafter(seed=2)
  asked = dataclasses.replace(old.config, context_attention=8, context_heads=2)
  grown = grow_as_asked(old, asked, {"context_attention", "context_heads"}, last_layer=0, seed=0,
                        source="test")
  tokens, mask, seg, hidden, emb = map(jnp.asarray, _example())
  batch = losses.LossBatch(hidden, emb, tokens, mask, seg)
  a_of, a = _split(old)
  b_of, b = _split(grown)
  cfg = losses.LossConfig(num_steps=3, chunk=4)
  loss_a, _ = losses.distill_loss(a_of, a, batch, cfg)
  loss_b, _ = losses.distill_loss(b_of, b, batch, cfg)
  assert float(loss_b) == pytest.approx(float(loss_a), rel=1e-6)
  grads = jax.grad(lambda p: losses.distill_loss(b_of, p, batch, cfg)[0])(b)
  flat = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(grads)}
  assert float(jnp.abs(flat["ctx_out.kernel"].get_value()).sum()) > 0
  with pytest.raises(ConfigError, match="context_attention"):
    grow_as_asked(grown, dataclasses.replace(asked, context_attention=16),
                  {"context_attention"}, last_layer=0, seed=0, source="test")


@pytest.mark.parametrize("attention", [False, True], ids=["copy_hint", "copy_hint+attention"])
def test_the_acceptance_bench_scores_as_training_does(attention):
  """``bench acceptance``'s drafter call gives, at every position, the logits the training path
  gives there (the same copy hints and, with the context attention, the same memory), for a
  drafter with the copy hint alone and one with both options."""
  from redrafter_jax.bench import acceptance
  from redrafter_jax.models.context_attention import causal_visible
  from redrafter_jax.models.context_copy import teacher_forced_hints
  from tests.test_copy_hint import copy_drafter

  d = attn_drafter(copy_ngram=2) if attention else copy_drafter(K=2)
  rng = np.random.default_rng(9)
  T, n = 24, 3
  seq = rng.integers(0, 5, T).astype(np.int32)
  emb = jnp.asarray(rng.normal(size=(TINY_VOCAB, D)).astype(np.float32))
  h_TD = jnp.asarray(rng.normal(size=(T, D)).astype(np.float32))
  starts = np.arange(2, T - n - 1)
  prev_xnD = emb[seq[starts[:, None] + 1 + np.arange(n)]]
  tokens_xT = np.broadcast_to(seq[None], (starts.size, T))
  got = acceptance.teacher_forced_logits(d, h_TD[starts], prev_xnD, tokens_xT, starts, emb,
                                         h_TD)
  seq_1T, one_1T = jnp.asarray(seq)[None], jnp.ones((1, T), jnp.int32)
  hint = teacher_forced_hints(seq_1T, n, max_ngram=2)
  memory = None
  if attention:
    keys, values = d.memory_over(h_TD[None], seq_1T, emb)
    memory = ContextMemory(keys, values, causal_visible(jnp.arange(T)[None], one_1T, one_1T))
  prev_1TnD = jnp.take(emb, losses.future_window(seq_1T, 1, n), axis=0)
  want = d.unroll_logits(h_TD[None], prev_1TnD, None, emb, hint, memory)[0, starts]
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_beam_search_reads_the_committed_positions_only():
  """Every beam's per-step log-probs equal a step-by-step replay of that beam whose memory
  holds exactly the row's committed positions (below its length)."""
  from redrafter_jax.inference.beam_search import beam_search
  from redrafter_jax.models.context_attention import committed_visible

  d = attn_drafter(seed=3)
  rng = np.random.default_rng(5)
  S, W, L = 32, 3, 4
  emb = jnp.asarray(rng.normal(size=(TINY_VOCAB, D)).astype(np.float32))
  lengths = jnp.asarray([20, 11])
  keys = jnp.asarray(rng.normal(size=(2, S, 16)).astype(np.float32))
  values = jnp.asarray(rng.normal(size=(2, S, 16)).astype(np.float32))
  memory = ContextMemory(keys, values, committed_visible(lengths, S))
  h = jnp.asarray(rng.normal(size=(2, D)).astype(np.float32))
  g0 = jnp.asarray([3, 7])
  out = beam_search(d, emb, h, g0, beam_width=W, beam_length=L, memory=memory)
  beams, logp = np.asarray(out.beams_BWL), np.asarray(out.logp_BWJ)
  with pytest.raises(ValueError, match="memory"):
    beam_search(d, emb, h, g0, beam_width=W, beam_length=L)
  for b in range(2):
    n = int(lengths[b])
    one = ContextMemory(keys[b:b + 1, :n], values[b:b + 1, :n], jnp.ones((1, 1, n), bool))
    for w in range(W):
      s = jnp.zeros((1, 1, D))
      for t in range(L - 1):
        lp, s = d.step(h[b][None, None], s, emb[beams[b, w, t]][None, None], memory=one)
        assert float(lp[0, 0, beams[b, w, t + 1]]) == pytest.approx(float(logp[b, w, t]),
                                                                    abs=1e-4)


def test_greedy_with_the_context_attention_equals_ar_and_the_memory_is_the_training_one():
  """Greedy ReDrafter with a context-attention drafter (and the copy hint) gives AR's tokens,
  and after decoding, the state's memory at every committed position equals the memory the
  training path builds over the same tokens from the LLM's own states."""
  from redrafter_jax.config import DecodeConfig
  from redrafter_jax.inference.ar import generate
  from redrafter_jax.inference.decode import ReDrafter, decode
  from tests.tiny_models import tiny_llm

  llm = tiny_llm()
  d = attn_drafter(copy_ngram=2)
  prompts = [[1, 5, 9, 2, 1, 5, 9], [7, 3, 7, 3], [11, 12, 13, 14, 15, 16]]
  ar = generate(llm, prompts, max_new_tokens=20)
  for cfg in (DecodeConfig(beam_width=3, beam_length=4, max_new_tokens=20),
              DecodeConfig(beam_width=1, beam_length=5, max_new_tokens=20, lookup_ngram=2)):
    assert decode(llm, d, prompts, cfg).tokens == ar.tokens
  rd = ReDrafter(llm, d, DecodeConfig(beam_width=2, beam_length=4, max_new_tokens=12))
  p = rd.prepare(prompts[:1])
  state = rd.loop(p, rd.start(p))
  n = int(state.cache.lengths_B[0])
  seq = jnp.asarray(state.context_BS[:, :n + 1])
  hidden, _ = llm.forward_hidden(seq, jnp.arange(n + 1)[None],
                                 jnp.tril(jnp.ones((1, n + 1, n + 1), bool)))
  keys, values = d.memory_over(hidden, seq, llm.embed_tokens.embedding[...])
  np.testing.assert_allclose(np.asarray(state.memory.keys_BSA[0, :n]), np.asarray(keys[0, :n]),
                             rtol=2e-4, atol=2e-4)
  np.testing.assert_allclose(np.asarray(state.memory.values_BSA[0, :n]),
                             np.asarray(values[0, :n]), rtol=2e-4, atol=2e-4)


def test_mlx_runtime_drafts_the_same_beams(tmp_path):
  """The exported drafter (copy hint and context attention) drafts in our MLX runtime the beams
  beam search drafts in JAX, from the same committed tokens and LLM features."""
  pytest.importorskip("mlx.core")
  from redrafter_jax.inference.beam_search import beam_search
  from redrafter_jax.inference.step import start_memory
  from redrafter_jax.weights import mlx_runtime

  d = attn_drafter(seed=6, copy_ngram=3)
  m = mlx_runtime.load_mlx_drafter(save_drafter(d, tmp_path / "d", format="redrafter-jax"))
  rng = np.random.default_rng(8)
  S, W, L = 32, 3, 5
  emb = rng.normal(size=(TINY_VOCAB, D)).astype(np.float32)
  lengths = np.array([20, 11], np.int32)
  context = np.zeros((2, S), np.int32)
  for b, n in enumerate(lengths):
    context[b, :n + 1] = rng.integers(0, 6, n + 1)
  g0 = context[np.arange(2), lengths]
  feats = rng.normal(size=(2, S, D)).astype(np.float32)
  h = feats[np.arange(2), lengths - 1]
  got = mlx_runtime.beam_search(m, emb, h, g0, beam_width=W, beam_length=L, context_BS=context,
                                length_B=lengths, context_feats_BSX=feats)
  memory = start_memory(d, jnp.asarray(emb), jnp.asarray(feats), jnp.asarray(context),
                        jnp.asarray(lengths))
  want = beam_search(d, jnp.asarray(emb), jnp.asarray(h), jnp.asarray(g0), beam_width=W,
                     beam_length=L, context_BS=jnp.asarray(context),
                     length_B=jnp.asarray(lengths), memory=memory.read(jnp.asarray(lengths)))
  np.testing.assert_array_equal(np.array(got.beams_BWL), np.asarray(want.beams_BWL))
  np.testing.assert_allclose(np.array(got.logp_BWJ), np.asarray(want.logp_BWJ), atol=1e-3)
  with pytest.raises(ValueError, match="context_feats_BSX"):
    mlx_runtime.beam_search(m, emb, h, g0, beam_width=W, beam_length=L, context_BS=context,
                            length_B=lengths)
