"""The target distribution: temperature, top-k and top-p applied to LLM logits, per row.

AR sampling and ReDrafter's exact verification both sample from ``target_logprobs``, so the
speculative decoder reproduces AR sampling's distribution by construction of one function.
A temperature of 0 means greedy (argmax); sampling settings are arrays so every row (or server
request) has its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

NEG_INF = -jnp.inf


def greedy_tokens(logits_xV: jax.Array) -> jax.Array:
  """The largest logit's index along the last axis, int32: ``jnp.argmax``'s answer (the first
  index among ties; the first NaN when there is one), computed as a max, then the smallest index
  that reaches it. XLA:CPU runs those two reductions vectorised and ``argmax``'s one reduction
  over (value, index) pairs an element at a time, ~5x slower over a 49,152-token vocabulary
  (results/linux-x86-64-2cpu/2026-11-26-explore-budget); every greedy choice in decoding goes
  through here, so AR and ReDrafter pick the same tokens by the same code."""
  max_x1 = jnp.max(logits_xV, axis=-1, keepdims=True)
  ids_xV = jax.lax.broadcasted_iota(jnp.int32, logits_xV.shape, logits_xV.ndim - 1)
  top_xV = (logits_xV == max_x1) | jnp.isnan(logits_xV)  # jnp.max returns NaN if any
  return jnp.min(jnp.where(top_xV, ids_xV, logits_xV.shape[-1]), axis=-1)


@struct.dataclass
class SamplingParams:
  temperature_B: jax.Array  # float32; 0 = greedy
  top_p_B: jax.Array  # float32 in (0, 1]
  top_k_B: jax.Array  # int32; 0 = off

  @classmethod
  def make(cls, batch: int, temperature=0.0, top_p=1.0, top_k=0) -> "SamplingParams":
    full = lambda v, dt: jnp.broadcast_to(jnp.asarray(v, dt), (batch,))
    return cls(full(temperature, jnp.float32), full(top_p, jnp.float32), full(top_k, jnp.int32))

  @property
  def greedy_B(self) -> jax.Array:
    return self.temperature_B <= 0


def target_logprobs(logits_BxV: jax.Array, params: SamplingParams, *, filtered: bool
                    ) -> jax.Array:
  """Log-probabilities of the distribution AR sampling draws from (float32; -inf = excluded).

  ``logits_BxV`` has the batch first and any number of middle axes (e.g. tree tokens).
  ``filtered`` (static) adds the top-k/top-p filter, which costs a vocabulary sort; leave it off
  when no row uses top-k/top-p. Top-k applies first and top-p to the renormalised survivors, as
  in transformers. Ties at the cut-off are kept.
  Greedy rows get a one-hot (log) distribution at the argmax.
  """
  extra = logits_BxV.ndim - 2
  expand = lambda a: a.reshape(a.shape + (1,) * (extra + 1))
  logits = logits_BxV.astype(jnp.float32)
  temp = expand(jnp.where(params.greedy_B, 1.0, params.temperature_B))
  scaled = logits / temp
  if filtered:
    scaled = _top_k_top_p(scaled, expand(params.top_k_B), expand(params.top_p_B))
  logp = jax.nn.log_softmax(scaled, axis=-1)
  ids_xV = jnp.arange(logits.shape[-1]).reshape((1,) * (logits.ndim - 1) + (-1,))
  greedy_logp = jnp.where(ids_xV == greedy_tokens(logits)[..., None], 0.0, NEG_INF)
  return jnp.where(expand(params.greedy_B), greedy_logp, logp)


# The top-k/top-p filter first looks at this many candidates (``lax.top_k``, a partial sort);
# the full vocabulary sort runs only when some row's kept set may reach past them.
FILTER_CANDIDATES = 256


def _top_k_top_p(scaled_xV, top_k_x1, top_p_x1):
  """``scaled_xV`` with what top-k then top-p drop set to -inf. Exact in every case: from the
  ``FILTER_CANDIDATES`` largest values when every row's cut falls among them (top-k at most
  that many, or the top-p mass reached within them, or no filter on the row), else (for the
  whole call: one ``lax.cond``) from a full sort."""
  sorted_cut = lambda: _cut(scaled_xV, _threshold(-jnp.sort(-scaled_xV, axis=-1), top_k_x1,
                                                 top_p_x1)[0])
  if FILTER_CANDIDATES >= scaled_xV.shape[-1]:
    return sorted_cut()
  cut_xV, exact_x1 = _candidate_cut(scaled_xV, top_k_x1, top_p_x1, FILTER_CANDIDATES)
  return jax.lax.cond(jnp.all(exact_x1), lambda: cut_xV, sorted_cut)


def _candidate_cut(scaled_xV, top_k_x1, top_p_x1, C: int):
  """The filter from the C largest values (``lax.top_k``, a partial sort), and for each row
  whether that is exact: its cut falls among them (top-k in 1..C, or top-k off and top-p
  dropping one of them) or it has no filter (top-k off, top-p 1)."""
  cand_xC = jax.lax.top_k(scaled_xV, C)[0]  # descending, as a sort's first C
  vocab_lse_x1 = jax.nn.logsumexp(scaled_xV, axis=-1, keepdims=True)
  threshold_x1, kept_all_x1 = _threshold(cand_xC, top_k_x1, top_p_x1, vocab_lse_x1)
  unfiltered_x1 = (top_k_x1 <= 0) & (top_p_x1 >= 1.0)
  inside_x1 = ((top_k_x1 > 0) & (top_k_x1 <= C)) | ((top_k_x1 <= 0) & ~kept_all_x1)
  threshold_x1 = jnp.where(unfiltered_x1, -jnp.inf, threshold_x1)
  return _cut(scaled_xV, threshold_x1), unfiltered_x1 | inside_x1


def _threshold(sorted_xC, top_k_x1, top_p_x1, vocab_lse_x1=None):
  """The smallest value top-k then top-p keep, and whether all C values given were kept, from
  the largest C values in descending order: all V, or the first C with ``vocab_lse_x1`` (the
  whole vocabulary's log-mass: top-p's normaliser on rows where top-k is off)."""
  C = sorted_xC.shape[-1]
  rank_xC = jnp.arange(C).reshape((1,) * (sorted_xC.ndim - 1) + (C,))
  in_top_k_xC = jnp.where(top_k_x1 > 0, rank_xC < top_k_x1, True)
  # top-p measures mass on what top-k kept, renormalised (the order transformers and vLLM use).
  top_k_xC = jnp.where(in_top_k_xC, sorted_xC, NEG_INF)
  if vocab_lse_x1 is None:
    probs_xC = jax.nn.softmax(top_k_xC, axis=-1)
  else:  # top-k within the C values (else the caller sorts): its mass is theirs
    norm_x1 = jnp.where(top_k_x1 > 0, jax.nn.logsumexp(top_k_xC, axis=-1, keepdims=True),
                        vocab_lse_x1)
    probs_xC = jnp.exp(top_k_xC - norm_x1)
  mass_before_xC = jnp.cumsum(probs_xC, axis=-1) - probs_xC
  # top_p >= 1 keeps everything top-k kept, even tails whose float mass rounds the sum past 1.
  keep_xC = in_top_k_xC & ((mass_before_xC < top_p_x1) | (top_p_x1 >= 1.0))
  keep_xC = keep_xC.at[..., 0].set(True)
  # The smallest kept (sorted) value is the threshold; everything below it is dropped.
  threshold_x1 = jnp.min(jnp.where(keep_xC, sorted_xC, jnp.inf), axis=-1, keepdims=True)
  return threshold_x1, keep_xC[..., -1:]


def _cut(scaled_xV, threshold_x1):
  return jnp.where(scaled_xV >= threshold_x1, scaled_xV, NEG_INF)


def sample(rng: jax.Array, logprobs_BV: jax.Array) -> jax.Array:
  """One token per row from (processed) log-probabilities; -inf tokens are never drawn.

  The draws of ``jax.random.categorical(rng, logprobs_BV)`` (the Gumbel-max trick with the same
  noise), with its argmax taken by ``greedy_tokens`` (XLA:CPU's argmax reduction is slow)."""
  noise_BV = jax.random.gumbel(rng, logprobs_BV.shape, logprobs_BV.dtype)
  return greedy_tokens(logprobs_BV + noise_BV)


def needs_filter(top_p, top_k) -> bool:
  """Host-side check (on Python/NumPy values) whether any row uses top-k or top-p."""
  import numpy as np

  return bool(np.any(np.asarray(top_p) < 1.0) or np.any(np.asarray(top_k) > 0))


def all_greedy(temperature) -> bool:
  """Host-side check (on Python/NumPy values) whether every row is greedy (temperature 0)."""
  import numpy as np

  return not np.any(np.asarray(temperature) > 0)
