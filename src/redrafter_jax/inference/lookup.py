"""Context lookup: one extra draft beam copied from the text so far (prompt lookup, n-grams).

Where a response repeats its context (extraction, summarisation, retrieval, code edits) the
next tokens are often a copy of what followed an earlier occurrence of the latest tokens. The
lookup beam is that copy: find the most recent earlier position where the last ``n`` tokens
(ending with g0) occur, for the largest ``n <= max_ngram`` that matches, and propose the
``L - 1`` tokens that followed it. It joins the drafter's W beams in the same tree, so the LLM
checks both in one forward pass and keeps whichever it accepts.

Exactness is untouched: the beam is a deterministic function of the committed context, and the
exact rule (``verify``) is exact for any fixed tree. Where nothing matches, the beam repeats the
drafter's best beam, which the tree's de-duplication merges away.

``context_BS[b, p]`` is the token at position p (the prompt, then the committed tokens, then g0
at ``length_B[b]``, the cache length). Static shapes throughout: one comparison of the context
per n-gram offset, no host sync.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def match_end(context_BS: jax.Array, length_B: jax.Array, *, ngram: int, span: int) -> jax.Array:
  """Latest position e whose n-gram ``context[e-n+1 .. e]`` equals the one ending at g0
  (``context[length-n+1 .. length]``) and whose ``span`` following tokens are all known
  (``e + span <= length``). -1 where there is none."""
  B, S = context_BS.shape
  pos_S = jnp.arange(S)
  match_BS = ((pos_S[None] >= ngram - 1) & (pos_S[None] + span <= length_B[:, None])
              & (length_B[:, None] >= ngram - 1))
  for k in range(ngram):  # compare context[e - k] with context[length - k]
    tail_B = jnp.take_along_axis(context_BS, jnp.maximum(length_B - k, 0)[:, None], axis=1)[:, 0]
    shifted_BS = jnp.pad(context_BS, ((0, 0), (k, 0)))[:, :S]  # shifted[e] = context[e - k]
    match_BS = match_BS & (shifted_BS == tail_B[:, None])
  return jnp.max(jnp.where(match_BS, pos_S[None], -1), axis=1)


def lookup_beam(context_BS: jax.Array, length_B: jax.Array, fallback_BL: jax.Array, *,
                max_ngram: int) -> tuple[jax.Array, jax.Array]:
  """``(beam_BL, found_B)``: g0 then the L - 1 tokens that followed the best match, or
  ``fallback_BL`` (the drafter's best beam) where no n-gram of size 1..max_ngram matches."""
  L = fallback_BL.shape[1]
  end_B = jnp.full(length_B.shape, -1, jnp.int32)
  for n in range(1, max_ngram + 1):  # a longer match overrides a shorter one
    e_B = match_end(context_BS, length_B, ngram=n, span=L - 1)
    end_B = jnp.where(e_B >= 0, e_B, end_B)
  found_B = end_B >= 0
  idx_BL = jnp.clip(end_B[:, None] + jnp.arange(L)[None], 0, context_BS.shape[1] - 1)
  copied_BL = jnp.take_along_axis(context_BS, idx_BL, axis=1)
  # Column 0 is the match's own last token, which equals g0 by construction.
  beam_BL = jnp.where(found_B[:, None], copied_BL, fallback_BL)
  return beam_BL.astype(jnp.int32), found_B


def write(context_BS: jax.Array, start_B: jax.Array, tokens_BA: jax.Array,
          count_B: jax.Array) -> jax.Array:
  """``context[start + i] = tokens[i]`` for ``i < count`` (per row; positions past S dropped)."""
  B, S = context_BS.shape
  A = tokens_BA.shape[1]
  idx_BA = start_B[:, None] + jnp.arange(A)[None]
  idx_BA = jnp.where(jnp.arange(A)[None] < count_B[:, None], idx_BA, S)  # S: out of range
  return context_BS.at[jnp.arange(B)[:, None], idx_BA].set(tokens_BA, mode="drop")
