"""The copy hint: what the context says comes next, as an input the drafter may trust or ignore.

At a query position q (the token the drafter has just read), the hint is the token that followed
the latest earlier occurrence of the longest suffix of the sequence up to q, up to ``max_ngram``
tokens long, and that suffix's length (the match length; 0 where not even tok[q] occurred
before). A longer match is a surer copy, so the drafter gets both.

Candidates are the positions e < q whose follower ``tok[e+1]`` is therefore known. The match
length at e is the number of leading offsets k = 0, 1, .. with ``tok[e-k] == tok[q-k]`` (both
inside the sequence and inside q's segment). The hint takes the longest match and, among equal
lengths, the latest e. The same function serves training (every position of packed rows, with
segment ids) and decoding (one query per beam over the committed context plus the beam's own
drafted tokens), so both see the same hint for the same tokens.

Static shapes: one ``[x, Q, S]`` comparison per offset, no host sync.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class CopyHint:
  """The hint at each query: the proposed token and its match length (0: no match)."""

  token_x: jax.Array  # int32; 0 where length is 0
  length_x: jax.Array  # int32 in 0..max_ngram


def copy_hints(tokens_xS: jax.Array, query_xQ: jax.Array, *, max_ngram: int,
               segment_xS: jax.Array | None = None) -> CopyHint:
  """The copy hint at each query position.

  Args:
    tokens_xS: token ids of each row (``[..., S]``); positions after a query are never read
      for that query.
    query_xQ: int positions (``[..., Q]``, same leading dims) whose hint to find.
    max_ngram: the longest suffix compared (>= 1).
    segment_xS: optional packed-sequence ids; a match never reaches outside the query's segment
      and segment 0 (padding) never matches.

  Returns:
    ``CopyHint`` with ``[..., Q]`` token and length.
  """
  if max_ngram < 1:
    raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
  S = tokens_xS.shape[-1]
  lead = tokens_xS.shape[:-1]
  if query_xQ.shape[:-1] != lead:
    raise ValueError(f"queries {query_xQ.shape} and tokens {tokens_xS.shape} differ in their "
                     "leading dimensions")
  pos_11S = jnp.arange(S).reshape((1,) * (len(lead) + 1) + (S,))
  query_xQ = query_xQ.astype(jnp.int32)
  take = lambda x_xS, idx_xQ: jnp.take_along_axis(x_xS, jnp.clip(idx_xQ, 0, S - 1), axis=-1)
  if segment_xS is None:
    segment_xS = jnp.ones_like(tokens_xS)
  seg_q_xQ1 = take(segment_xS, query_xQ)[..., None]
  # Candidate e: strictly before q (its follower is known), in q's segment, not padding.
  alive_xQS = ((pos_11S < query_xQ[..., None]) & (segment_xS[..., None, :] == seg_q_xQ1)
               & (seg_q_xQ1 > 0))
  length_xQS = jnp.zeros(alive_xQS.shape, jnp.int32)
  for k in range(max_ngram):
    qk_xQ = query_xQ - k
    tok_qk_xQ1 = take(tokens_xS, qk_xQ)[..., None]
    seg_qk_xQ1 = take(segment_xS, qk_xQ)[..., None]
    pad = [(0, 0)] * len(lead) + [(k, 0)]
    shifted_tok_xS = jnp.pad(tokens_xS, pad)[..., :S]  # shifted[e] = tokens[e - k]
    shifted_seg_xS = jnp.pad(segment_xS, pad)[..., :S]
    alive_xQS = (alive_xQS & (qk_xQ[..., None] >= 0) & (pos_11S >= k)
                 & (seg_qk_xQ1 == seg_q_xQ1) & (shifted_seg_xS[..., None, :] == seg_q_xQ1)
                 & (shifted_tok_xS[..., None, :] == tok_qk_xQ1))
    length_xQS = length_xQS + alive_xQS
  score_xQS = jnp.where(length_xQS > 0, length_xQS * S + pos_11S, -1)
  best_xQ = jnp.max(score_xQS, axis=-1)
  found_xQ = best_xQ >= 0
  length_xQ = jnp.where(found_xQ, best_xQ // S, 0)
  follower_xQ = take(tokens_xS, jnp.where(found_xQ, best_xQ % S + 1, 0))
  return CopyHint(token_x=jnp.where(found_xQ, follower_xQ, 0).astype(jnp.int32),
                  length_x=length_xQ.astype(jnp.int32))


def teacher_forced_hints(tokens_BT: jax.Array, num_steps: int, *, max_ngram: int,
                         segment_BT: jax.Array | None = None) -> CopyHint:
  """The hints a teacher-forced drafter reads: at position t, step i (0-based) reads token
  t+1+i, so its hint is the one at query t+1+i (past the row's end: no hint).

  Returns:
    ``CopyHint`` of ``[B, T, num_steps]``.
  """
  B, T = tokens_BT.shape
  hint = copy_hints(tokens_BT, jnp.broadcast_to(jnp.arange(T), (B, T)), max_ngram=max_ngram,
                    segment_xS=segment_BT)
  idx_Tn = jnp.arange(T)[:, None] + 1 + jnp.arange(num_steps)[None, :]
  inside_1Tn = (idx_Tn < T)[None]
  pick = lambda x_BT: jnp.where(inside_1Tn, x_BT[:, jnp.minimum(idx_Tn, T - 1)], 0)
  return CopyHint(token_x=pick(hint.token_x), length_x=pick(hint.length_x))


def beam_hints(context_BS: jax.Array, length_B: jax.Array, beams_BWL: jax.Array, t,
               max_ngram: int) -> CopyHint:
  """The copy hint of each beam at its column ``t`` (position ``length + t``): the committed
  context with the beam's drafted tokens written after g0 (later columns are never read)."""
  B, W, L = beams_BWL.shape
  S = context_BS.shape[1]
  ctx_BWS = jnp.broadcast_to(context_BS[:, None, :], (B, W, S))
  idx_BWJ = jnp.broadcast_to(length_B[:, None, None] + 1 + jnp.arange(L - 1)[None, None, :],
                             (B, W, L - 1))
  ctx_BWS = ctx_BWS.at[jnp.arange(B)[:, None, None], jnp.arange(W)[None, :, None],
                       idx_BWJ].set(beams_BWL[:, :, 1:], mode="drop")
  query_BW1 = jnp.broadcast_to((length_B + t)[:, None, None], (B, W, 1))
  hint = copy_hints(ctx_BWS, query_BW1, max_ngram=max_ngram)
  return jax.tree.map(lambda a: a[..., 0], hint)
