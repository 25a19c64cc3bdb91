"""Drafting: beam search over the drafter with ``lax.scan`` and ``lax.top_k``, static shapes.

Inputs are the LLM's hidden state ``h_BD`` at the last committed token and ``g0_B``, the token the
LLM itself chose next (not yet in the cache). Beam scores start at ``[0, -5e4, ..., -5e4]`` so the
first step grows W distinct children of beam 0; every step keeps the joint top-W of
(beam score + token log-prob) over all W x V extensions, with no length normalisation.

The joint top-W over W x V equals the top-W among each beam's own top-W tokens (any token outside a
beam's top-W is beaten by W tokens of that same beam), so we take ``top_k(k=W)`` per beam and
then over the W x W survivors: the same beams for a fraction of the sort work.

``beam_length`` L counts g0 (the reference's convention): beams are ``[B, W, L]`` with g0 in
column 0 and L - 1 drafted tokens.

A drafter with the copy hint (``DrafterConfig.copy_ngram``) reads, at each step and for each beam,
the hint at the beam's newest token over the committed context (``context_BS``, g0 at position
``length_B``) followed by the beam's own drafted tokens: the text that beam would make. A drafter
with the context attention (``DrafterConfig.context_attention``) reads the committed positions'
memory (``memory``); every beam of a row reads the same one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from redrafter_jax.models.context_attention import ContextMemory
from redrafter_jax.models.context_copy import beam_hints
from redrafter_jax.models.drafter import Drafter

LOG_ZERO = -5e4  # the reference's log(0) for the initial non-first beams


@struct.dataclass
class BeamOutput:
  beams_BWL: jax.Array  # int32, g0 in column 0
  logp_BWJ: jax.Array  # float32, drafter log-prob of each drafted token along its beam
  score_BW: jax.Array  # float32, sum of logp along the beam (beams are sorted by it, best first)
  # Drafter distributions along the beams (only when asked for; over the draft vocabulary).
  full_logp_BWJV: jax.Array | None = None
  # The drafter's K best first drafted tokens and their log-probs (only when asked for): the
  # step-1 alternatives, which the kept beams may no longer start with.
  first_BK: jax.Array | None = None
  first_logp_BK: jax.Array | None = None


def copy_ngram_of(drafter) -> int:
  """The drafter's ``copy_ngram`` (0 for drafters without a config, such as the tests' oracles)."""
  return int(getattr(getattr(drafter, "config", None), "copy_ngram", 0) or 0)


def attends_to_context(drafter) -> bool:
  """Whether the drafter reads the committed context's memory (``context_attention``; False
  for drafters without a config)."""
  return bool(getattr(getattr(drafter, "config", None), "context_attention", 0))


def beam_search(drafter: Drafter, embed_VD: jax.Array, h_BD: jax.Array, g0_B: jax.Array, *,
                beam_width: int, beam_length: int, return_full: bool = False,
                first_k: int = 0, context_BS: jax.Array | None = None,
                length_B: jax.Array | None = None,
                memory: ContextMemory | None = None) -> BeamOutput:
  """Draft ``beam_width`` beams of ``beam_length`` tokens (g0 first) per row.

  Args:
    drafter: the draft head.
    embed_VD: the LLM's input embedding table.
    h_BD: the drafter's context vector (``drafter.context`` of the LLM's features).
    g0_B: the LLM's newest token, each beam's column 0.
    beam_width, beam_length: W and L.
    return_full: also return the drafter's distributions along the beams.
    first_k: > 0 also returns the drafter's ``first_k`` best first tokens (``first_BK``).
    context_BS, length_B: the committed tokens with g0 at position ``length_B`` (``DecodeState``'s
      ``context_BS`` and cache lengths); needed by a drafter with ``copy_ngram``.
    memory: the committed positions' keys and values ``[B, S, A]`` (``[B, 1, S]`` visible);
      needed by a drafter with ``context_attention``.

  Returns:
    ``BeamOutput``, beams sorted best first.
  """
  B, D = h_BD.shape
  K = copy_ngram_of(drafter)
  if K and (context_BS is None or length_B is None):
    raise ValueError(f"a drafter with copy_ngram={K} drafts from the context: pass context_BS "
                     "and length_B")
  if attends_to_context(drafter) and memory is None:
    raise ValueError("a drafter with context_attention drafts from the committed context's "
                     "memory: pass memory")
  W, L = beam_width, beam_length
  vocab_ids = drafter.vocab_ids[...] if drafter.vocab_ids is not None else None
  V = vocab_ids.shape[0] if vocab_ids is not None else embed_VD.shape[0]
  h_BWD = jnp.broadcast_to(h_BD[:, None, :], (B, W, D))
  score_BW = jnp.tile(jnp.asarray([0.0] + [LOG_ZERO] * (W - 1), jnp.float32), (B, 1))
  beams_BWL = jnp.zeros((B, W, L), jnp.int32).at[:, :, 0].set(g0_B[:, None])
  logp_BWJ = jnp.zeros((B, W, L - 1), jnp.float32)
  full_BWJV = jnp.zeros((B, W, L - 1, V), jnp.float32) if return_full else None
  state_BWD = drafter.init_state(h_BWD)
  gather = jax.vmap(lambda x, idx: x[idx])  # per row: x[b][parent_W]

  def step(carry, t, first_k=0):
    beams_BWL, score_BW, logp_BWJ, full_BWJV, state_BWD = carry
    prev_BW = jax.lax.dynamic_index_in_dim(beams_BWL, t, axis=2, keepdims=False)
    if K:
      hint = beam_hints(context_BS, length_B, beams_BWL, t, K)
      logp_BWV, state_BWD = drafter.step(h_BWD, state_BWD, embed_VD[prev_BW], hint, embed_VD,
                                         memory)
    elif memory is not None:
      logp_BWV, state_BWD = drafter.step(h_BWD, state_BWD, embed_VD[prev_BW], memory=memory)
    else:
      logp_BWV, state_BWD = drafter.step(h_BWD, state_BWD, embed_VD[prev_BW])
    # Per-beam top-W, then the joint top-W over the W*W survivors.
    tok_logp_BWW, tok_BWW = jax.lax.top_k(logp_BWV, W)
    cand_BZ = (score_BW[:, :, None] + tok_logp_BWW).reshape(B, W * W)
    score_BW, pick_BW = jax.lax.top_k(cand_BZ, W)
    parent_BW = pick_BW // W
    token_BW = jnp.take_along_axis(tok_BWW.reshape(B, W * W), pick_BW, axis=1)
    if vocab_ids is not None:  # restricted draft vocabulary: output row -> token id
      token_BW = vocab_ids[token_BW]
    token_logp_BW = jnp.take_along_axis(tok_logp_BWW.reshape(B, W * W), pick_BW, axis=1)
    beams_BWL = gather(beams_BWL, parent_BW)
    beams_BWL = jax.lax.dynamic_update_index_in_dim(beams_BWL, token_BW, t + 1, axis=2)
    logp_BWJ = gather(logp_BWJ, parent_BW)
    logp_BWJ = jax.lax.dynamic_update_index_in_dim(logp_BWJ, token_logp_BW, t, axis=2)
    if full_BWJV is not None:
      full_BWJV = gather(full_BWJV, parent_BW)
      full_BWJV = jax.lax.dynamic_update_index_in_dim(full_BWJV, gather(logp_BWV, parent_BW),
                                                       t, axis=2)
    state_BWD = gather(state_BWD, parent_BW)
    first = None
    if first_k:  # every beam is beam 0 at the first step: its top-k are the step-1 choices
      first_logp_BK, first_BK = jax.lax.top_k(logp_BWV[:, 0], first_k)
      first = (first_BK if vocab_ids is None else vocab_ids[first_BK], first_logp_BK)
    return (beams_BWL, score_BW, logp_BWJ, full_BWJV, state_BWD), first

  carry = (beams_BWL, score_BW, logp_BWJ, full_BWJV, state_BWD)
  first, steps = None, jnp.arange(L - 1)
  if first_k:  # the first step outside the scan: only it takes the step-1 top-k
    carry, first = step(carry, steps[0], first_k)
    steps = steps[1:]
  (beams_BWL, score_BW, logp_BWJ, full_BWJV, _), _ = jax.lax.scan(step, carry, steps)
  if first is None:
    return BeamOutput(beams_BWL, logp_BWJ, score_BW, full_BWJV)
  return BeamOutput(beams_BWL, logp_BWJ, score_BW, full_BWJV, *first)
