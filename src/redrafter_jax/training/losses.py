"""The drafter's distillation loss (DESIGN §7) and its per-step accuracies.

At position t, drafter step i (1..n) reads the LLM hidden state ``h_t`` and the embeddings of
tokens t+1..t+i (teacher forcing: the tokens are the LLM's own continuation), and predicts token
t+i+1. A target counts when it is a response token (``loss_mask``), lies inside the row, and
belongs to the same packed sequence as t (so padding and prompt tokens never count, and nothing
reaches across a packing boundary). The loss is the sum over steps of the mean cross-entropy over
that step's counted targets; the means are over the whole global batch, so the loss is the same
however the batch is split over devices or processes.

Soft targets (``teacher_out_VD``, an option beyond the reference): the cross-entropy is taken
against the LLM's whole next-token distribution at the target's position (softmax of its logits
from ``h_{t+i+1}``, over the drafter's vocabulary) instead of the one token in the data. Same
positions, same weights; on greedy teacher data its argmax is the data token. It tells the
drafter how sure the LLM is and what its runners-up are, which is more signal per position
(knowledge distillation; Medusa-2 and DistillSpec train draft models this way).

Multi-layer features (``DrafterConfig.feature_layers``): ``context_BTX`` holds the LLM's
concatenated layer states, which the drafter projects (``Drafter.context``) in place of ``h_t``;
the teacher's distributions still come from the last hidden state.

Training-time test (``self_feed`` p): at each (position, step i > 1) with probability p the
drafter's state advances on its own argmax at step i-1 instead of the data token (the target is
still the data token), so training sees the states beam search sees. p = 0 is the code path of
pure teacher forcing, unchanged.

Ranking loss (``rank_weight``, after HASS): at each counted target, the negative Plackett-Luce
log-likelihood of the LLM's top-K tokens in the LLM's order under the drafter's logits,
``mean_j [logsumexp(l over V minus x_1..x_{j-1}) - l_{x_j}]``. Its j = 1 term is the hard
cross-entropy against the LLM's argmax; the later terms reward ordering the runners-up as the
LLM does, which is what the W children of a beam-search node need. Added per step with weight
``rank_weight`` (and the step weights).

Copy hint (``DrafterConfig.copy_ngram``): step i at position t reads the hint at token t+1+i
over the row's tokens so far, within its packed sequence (``context_copy.teacher_forced_hints``),
as decoding's beam search reads it at the same tokens.

Positions the lookup covers (``LossConfig.lookup_covered_weight`` w != 1): decoding's tree also
holds the context-lookup beam, so at a position where the lookup's first token is right (the
copy hint over up to ``lookup_ngram`` tokens, ``context_copy.teacher_forced_hints``, at step 1)
the tree accepts that token whatever the drafter says, and the drafter adds tokens there only by
out-running the lookup. Every step of such a position weighs w in the objective (the
cross-entropy and ranking terms are then weighted means); the per-step metrics stay unweighted,
so runs with different w compare.

Context attention (``DrafterConfig.context_attention``): the memory holds every position of the
row (``Drafter.memory_entries`` from the context vectors and tokens), and the steps at position t
read the positions j <= t of t's packed sequence (``context_attention.causal_visible``): what
decoding has committed when it drafts from t.

Memory: logits ``[B, T, n, V]`` at V=49152 would be GBs. The positions are cut into chunks of
``chunk`` and a ``lax.scan`` over chunks computes each chunk's logits inside ``jax.checkpoint``,
so only one chunk's ``[B, chunk, n, V]`` logits (and their gradient) are alive at a time; the
backward pass recomputes them chunk by chunk. Accuracies use the target's rank (how many logits
beat it), which avoids a sort over V.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from redrafter_jax.models.context_attention import ContextMemory, causal_visible
from redrafter_jax.models.context_copy import CopyHint, teacher_forced_hints
from redrafter_jax.models.drafter import Drafter


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """The static settings of ``distill_loss``.

  Attributes:
    num_steps: n, drafter steps per position (``beam_length - 1`` at decode).
    chunk: positions per chunk of logits (bounds the ``[B, chunk, n, V]`` memory).
    soft: cross-entropy against the LLM's distribution (needs ``LossBatch.teacher_out_VD``).
    step_weight_decay: d; step i (0-based) weighs ``d**i``.
    self_feed: p, the training-time test's share of self-fed (position, step > 1) pairs.
    rank_weight: w of the ranking loss (0: off; needs ``teacher_out_VD``).
    rank_top_k: how many of the LLM's best tokens the ranking loss orders.
    lookup_covered_weight: the objective's weight of positions where the context lookup's
      first token is right (1.0: every position the same).
    lookup_ngram: the longest n-gram the lookup matches (decoding's ``lookup_ngram``).
  """

  num_steps: int
  chunk: int = 64
  soft: bool = False
  step_weight_decay: float = 1.0
  self_feed: float = 0.0
  rank_weight: float = 0.0
  rank_top_k: int = 8
  lookup_covered_weight: float = 1.0
  lookup_ngram: int = 3


class LossBatch(NamedTuple):
  """What one batch's loss reads. The LLM's arrays get no gradient.

  Attributes:
    hidden_BTD: the frozen LLM's hidden states (after the final norm) for ``tokens_BT``.
    embedding_VD: the LLM's input embedding table.
    tokens_BT: packed rows of token ids.
    loss_mask_BT: 1 at response tokens (the only targets that count).
    segment_ids_BT: packed-sequence ids (0: padding).
    context_BTX: what a multi-layer drafter reads instead of ``hidden_BTD`` (None: the hidden
      states).
    teacher_out_VD: the LLM's output projection, for soft targets and the ranking loss.
  """

  hidden_BTD: jax.Array
  embedding_VD: jax.Array
  tokens_BT: jax.Array
  loss_mask_BT: jax.Array
  segment_ids_BT: jax.Array
  context_BTX: jax.Array | None = None
  teacher_out_VD: jax.Array | None = None


def future_window(x_BT: jax.Array, offset: int, n: int, fill=0) -> jax.Array:
  """``out[b, t, i] = x[b, t + offset + i]`` for i < n, ``fill`` past the end of the row."""
  T = x_BT.shape[1]
  pad = [(0, 0), (0, offset + n)] + [(0, 0)] * (x_BT.ndim - 2)
  padded = jnp.pad(x_BT, pad, constant_values=fill)
  return jnp.stack([padded[:, offset + i:offset + i + T] for i in range(n)], axis=2)


def targets_and_weights(tokens_BT, loss_mask_BT, segment_ids_BT, n: int):
  """Step i+1's target ``tokens[t+i+2]`` and whether it counts, both ``[B, T, n]``."""
  T = tokens_BT.shape[1]
  targets_BTn = future_window(tokens_BT, 2, n)
  in_row_BTn = (jnp.arange(T)[:, None] + 2 + jnp.arange(n)[None, :]) < T
  same_seq_BTn = future_window(segment_ids_BT, 2, n, fill=-1) == segment_ids_BT[:, :, None]
  counts_BTn = (in_row_BTn[None] & same_seq_BTn & (segment_ids_BT[:, :, None] > 0)
                & (future_window(loss_mask_BT, 2, n) > 0))
  return targets_BTn, counts_BTn


def frozen_hidden(llm, tokens_BT, positions_BT, segment_ids_BT) -> jax.Array:
  """The LLM's hidden states (after the final norm), causal within each packed sequence, with
  no gradient path into the LLM."""
  T = tokens_BT.shape[1]
  causal_TT = jnp.tril(jnp.ones((T, T), bool))
  seg_BT = segment_ids_BT
  mask_BTT = causal_TT[None] & (seg_BT[:, :, None] == seg_BT[:, None, :]) & (seg_BT[:, None, :] > 0)
  hidden_BTD, _ = llm.forward_hidden(tokens_BT, positions_BT, mask_BTT)
  return jax.lax.stop_gradient(hidden_BTD)


def frozen_features(llm, tokens_BT, positions_BT, segment_ids_BT, layers: tuple[int, ...]):
  """``(hidden_BTD, taps_BTX)``: ``frozen_hidden`` and the normed outputs of decoder ``layers``
  concatenated (``Llama.forward_layers``; what a multi-layer drafter reads)."""
  if not layers:
    hidden_BTD = frozen_hidden(llm, tokens_BT, positions_BT, segment_ids_BT)
    return hidden_BTD, hidden_BTD
  T = tokens_BT.shape[1]
  causal_TT = jnp.tril(jnp.ones((T, T), bool))
  seg_BT = segment_ids_BT
  mask_BTT = causal_TT[None] & (seg_BT[:, :, None] == seg_BT[:, None, :]) & (seg_BT[:, None, :] > 0)
  hidden_BTD, taps_BTX, _ = llm.forward_layers(tokens_BT, positions_BT, mask_BTT, layers=layers)
  return jax.lax.stop_gradient(hidden_BTD), jax.lax.stop_gradient(taps_BTX)


def plackett_luce_nll(logits_xV: jax.Array, ranked_xK: jax.Array) -> jax.Array:
  """Mean over j of ``logsumexp(logits without ranked[:j]) - logits[ranked[j]]`` (``[x]``): the
  negative log-likelihood, per ranked token, of drawing ``ranked`` in order without
  replacement."""
  logz_x = jax.nn.logsumexp(logits_xV, axis=-1)
  picked_xK = jnp.take_along_axis(logits_xV, ranked_xK, axis=-1)
  p_xK = jnp.exp(picked_xK - logz_x[..., None])
  before_xK = jnp.cumsum(p_xK, axis=-1) - p_xK  # mass already drawn before rank j
  rest_xK = logz_x[..., None] + jnp.log(jnp.maximum(1.0 - before_xK, 1e-6))
  return jnp.mean(rest_xK - picked_xK, axis=-1)


def _chunk_sums(drafter, soft, embed_VD, memory_kv, h_BPD, prev_emb_BPnD, targets_BPn,
                weights_BPn, ce_weights_BPn, obj_weights_BPn, teacher_p_BPnV, own_BPn,
                ranked_BPnK, hint_tok_BPn, hint_len_BPn, pos_BP, seg_BP):
  """Per-step sums over one chunk: cross-entropy, the objective's weighted cross-entropy, top-1
  hits, top-5 hits, the objective's weighted ranking loss (each ``[n]``).

  ``targets`` index the drafter's output rows; ``weights`` are 0 for targets that do not count
  (accuracies), ``ce_weights`` for those the cross-entropy skips, ``obj_weights`` the
  objective's (``ce_weights`` times each position's weight). With ``soft`` the
  cross-entropy is against the LLM's distributions ``teacher_p`` over the same rows. ``own``
  (or None): steps that read the drafter's own previous argmax; ``ranked`` (K may be 0): the
  LLM's top-K rows for the ranking loss; ``hint_*`` (or None): the copy hints. ``memory_kv``
  (or None): the context attention's keys, values and segment ids over the whole rows, read
  by the chunk's positions ``pos_BP`` in their segments ``seg_BP``."""
  hint = None if hint_tok_BPn is None else CopyHint(hint_tok_BPn, hint_len_BPn)
  memory = None
  if memory_kv is not None:
    keys_BTA, values_BTA, segment_BT = memory_kv
    memory = ContextMemory(keys_BTA, values_BTA, causal_visible(pos_BP, segment_BT, seg_BP))
  logits_BPnV = drafter.unroll_logits(h_BPD, prev_emb_BPnD, own_BPn, embed_VD, hint, memory)
  logz_BPn = jax.nn.logsumexp(logits_BPnV, axis=-1)
  target_logit_BPn = jnp.take_along_axis(logits_BPnV, targets_BPn[..., None], axis=-1)[..., 0]
  rank_BPn = jnp.sum(logits_BPnV > target_logit_BPn[..., None], axis=-1)
  if soft:
    soft_logit_BPn = jnp.sum(teacher_p_BPnV * logits_BPnV, axis=-1)
    ce_BPn = logz_BPn - soft_logit_BPn
  else:
    ce_BPn = logz_BPn - target_logit_BPn
  ce_n = jnp.sum(ce_BPn * ce_weights_BPn, axis=(0, 1))
  obj_n = jnp.sum(ce_BPn * obj_weights_BPn, axis=(0, 1))
  top1_n = jnp.sum((rank_BPn < 1) * weights_BPn, axis=(0, 1))
  top5_n = jnp.sum((rank_BPn < 5) * weights_BPn, axis=(0, 1))
  rank_loss_n = jnp.zeros_like(ce_n)
  if ranked_BPnK.shape[-1]:
    rank_loss_n = jnp.sum(plackett_luce_nll(logits_BPnV, ranked_BPnK) * obj_weights_BPn,
                          axis=(0, 1))
  return ce_n, obj_n, top1_n, top5_n, rank_loss_n


def lookup_covered(tokens_BT, segment_ids_BT, lookup_ngram: int) -> jax.Array:
  """Where the context lookup's first token is right: at position t (step 1 reads token t+1 and
  predicts token t+2), the copy hint at t+1 over up to ``lookup_ngram`` tokens of t's packed
  sequence fires and equals token t+2 (``[B, T]`` bool; past the row's end the target is 0)."""
  hint = teacher_forced_hints(tokens_BT, 1, max_ngram=lookup_ngram, segment_BT=segment_ids_BT)
  next_BT = future_window(tokens_BT, 2, 1)[:, :, 0]
  return (hint.length_x[:, :, 0] > 0) & (hint.token_x[:, :, 0] == next_BT)


def restricted_targets(targets_BTn, vocab_ids_R, vocab_size: int):
  """Output-row index of each target under a restricted vocabulary, and whether it is in it."""
  R = vocab_ids_R.shape[0]
  row_of_V = jnp.full((vocab_size,), -1, jnp.int32).at[vocab_ids_R].set(jnp.arange(R))
  rows_BTn = row_of_V[targets_BTn]
  return jnp.maximum(rows_BTn, 0), rows_BTn >= 0


def distill_loss(drafter_of: Callable[[Any], Drafter], drafter_params, batch: LossBatch,
                 config: LossConfig, *, vocab_ids_R: jax.Array | None = None,
                 rng: jax.Array | None = None):
  """The distillation loss of one batch; differentiable in ``drafter_params`` only.

  Args:
    drafter_of: builds the drafter from its parameters (e.g. ``nnx.merge`` with the graph
      definition and any non-trained state).
    drafter_params: the trained parameters.
    batch: the rows and the frozen LLM's arrays (``LossBatch``).
    config: the loss's static settings (``LossConfig``; the module docstring describes each
      option).
    vocab_ids_R: the drafter scores only these tokens (``restrict_vocab``; output row r is token
      ``vocab_ids_R[r]``). Cross-entropy is then over the R tokens and averages over the targets
      among them (soft targets: over every counted target); accuracies still count every target
      (one outside the R is a miss).
    rng: the self-fed positions' key (needed when ``config.self_feed`` > 0).

  Returns:
    ``(loss, metrics)``: the objective ``sum_i d**i * (loss_n[i] + w * rank_n[i])`` and per-step
    arrays ``[n]``: ``loss_n`` (mean cross-entropy, unweighted by ``lookup_covered_weight``),
    ``top1_n``, ``top5_n`` (accuracies against the data tokens), ``count_n`` (targets),
    ``coverage_n`` (share of targets the drafter's vocabulary holds), and ``rank_n`` with the
    ranking loss on.
  """
  hidden_BTD, embedding_VD, tokens_BT, loss_mask_BT, segment_ids_BT, context_BTX, \
      teacher_out_VD = batch
  soft, rank_weight = config.soft, config.rank_weight
  n = config.num_steps
  B, T, D = hidden_BTD.shape
  # Both come from the frozen LLM: no gradient may flow back into it.
  hidden_BTD = jax.lax.stop_gradient(hidden_BTD)
  embedding_VD = jax.lax.stop_gradient(embedding_VD)
  targets_BTn, counts_BTn = targets_and_weights(tokens_BT, loss_mask_BT, segment_ids_BT, n)
  # Step i+1 (0-based i) consumes the embedding of token t+1+i.
  prev_emb_BTnD = jnp.take(embedding_VD, future_window(tokens_BT, 1, n), axis=0)
  weights_BTn = counts_BTn.astype(jnp.float32)
  count_n = jnp.sum(weights_BTn, axis=(0, 1))
  if (soft or rank_weight > 0) and teacher_out_VD is None:
    raise ValueError("soft targets and the ranking loss need teacher_out_VD")
  teacher_p_BTnV = jnp.zeros((B, T, n, 0), jnp.float32)
  ranked_BTnK = jnp.zeros((B, T, n, 0), jnp.int32)
  if soft or rank_weight > 0:
    out_VD = jax.lax.stop_gradient(teacher_out_VD)
    if vocab_ids_R is not None:
      out_VD = jnp.take(out_VD, vocab_ids_R, axis=0)
    # The LLM's logits at each position, once ([B, T, V]: one matmul, not n), then step
    # i+1's (token t+i+2) is the one predicted from the hidden state at t+i+1.
    teacher_BTV = jnp.einsum("btd,vd->btv", hidden_BTD, out_VD,
                             preferred_element_type=jnp.float32)
    if soft:  # the window holds [B, T, n, V] floats (400 MB at B=8, T=384, n=4, V=8192)
      teacher_p_BTnV = future_window(jax.nn.softmax(teacher_BTV, -1), 1, n)
    if rank_weight > 0:
      ranked_BTnK = future_window(jax.lax.top_k(teacher_BTV, config.rank_top_k)[1], 1, n)
  own_BTn = None
  if config.self_feed > 0:
    if rng is None:
      raise ValueError("self_feed needs rng")
    own_BTn = jax.random.bernoulli(rng, config.self_feed, (B, T, n)).at[:, :, 0].set(False)
  context_BTX = hidden_BTD if context_BTX is None else jax.lax.stop_gradient(context_BTX)
  drafter = drafter_of(drafter_params)
  # The drafter's context vector at every position, once (not per chunk: the context attention
  # reads it at every position too).
  h_BTD = drafter.context(context_BTX)
  memory_kv = None
  if drafter.config.context_attention:
    keys_BTA, values_BTA = drafter.memory_over(h_BTD, tokens_BT, embedding_VD)
    memory_kv = (keys_BTA, values_BTA, segment_ids_BT)
  hint_BTn = CopyHint(None, None)
  copy_ngram = drafter.config.copy_ngram
  if copy_ngram:
    hint_BTn = teacher_forced_hints(tokens_BT, n, max_ngram=copy_ngram, segment_BT=segment_ids_BT)
  # The objective's weights: the lookup-covered positions' (every step) weigh less or more.
  position_w_BT = jnp.ones((B, T), jnp.float32)
  if config.lookup_covered_weight != 1.0:
    covered_BT = lookup_covered(tokens_BT, segment_ids_BT, config.lookup_ngram)
    position_w_BT = jnp.where(covered_BT, jnp.float32(config.lookup_covered_weight), 1.0)
  if vocab_ids_R is not None:
    targets_BTn, in_vocab_BTn = restricted_targets(targets_BTn, vocab_ids_R,
                                                   embedding_VD.shape[0])
    weights_BTn = weights_BTn * in_vocab_BTn
  # Hard targets outside the drafter's vocabulary have no cross-entropy; soft ones always do.
  ce_weights_BTn = counts_BTn.astype(jnp.float32) if soft else weights_BTn
  obj_weights_BTn = ce_weights_BTn * position_w_BT[:, :, None]
  P = min(config.chunk, T)
  num_chunks = -(-T // P)
  pad_T = num_chunks * P - T

  def chunked(x):  # [B, T, ...] -> [chunks, B, P, ...], padding positions carry zero weight
    x = jnp.pad(x, [(0, 0), (0, pad_T)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(B, num_chunks, P, *x.shape[2:]), 1, 0)

  @jax.checkpoint
  def chunk_sums(params, memory_kv, xs):
    return _chunk_sums(drafter_of(params), soft, embedding_VD, memory_kv, *xs)

  def body(carry, xs):
    return jax.tree.map(jnp.add, carry, chunk_sums(drafter_params, memory_kv, xs)), None

  zeros_n = jnp.zeros((n,), jnp.float32)
  pos_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  xs = tuple(None if x is None else chunked(x)
             for x in (h_BTD, prev_emb_BTnD, targets_BTn, weights_BTn, ce_weights_BTn,
                       obj_weights_BTn, teacher_p_BTnV, own_BTn, ranked_BTnK, hint_BTn.token_x,
                       hint_BTn.length_x, pos_BT, segment_ids_BT))
  (ce_n, obj_n, top1_n, top5_n, rank_sum_n), _ = jax.lax.scan(body, (zeros_n,) * 5, xs)
  scored_n = jnp.sum(weights_BTn, axis=(0, 1))
  denom_n = jnp.maximum(count_n, 1.0)
  ce_count_n = jnp.maximum(jnp.sum(ce_weights_BTn, axis=(0, 1)), 1.0)
  obj_count_n = jnp.maximum(jnp.sum(obj_weights_BTn, axis=(0, 1)), 1e-6)
  loss_n = ce_n / ce_count_n
  metrics = dict(loss_n=loss_n, top1_n=top1_n / denom_n, top5_n=top5_n / denom_n,
                 count_n=count_n, coverage_n=scored_n / denom_n)
  weights_n = config.step_weight_decay ** jnp.arange(n, dtype=jnp.float32)
  objective_n = obj_n / obj_count_n
  if rank_weight > 0:
    metrics["rank_n"] = rank_sum_n / obj_count_n
    objective_n = objective_n + rank_weight * metrics["rank_n"]
  return jnp.sum(weights_n * objective_n), metrics
