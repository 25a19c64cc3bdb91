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
  greedy_logp = jnp.where(ids_xV == jnp.argmax(logits, axis=-1, keepdims=True), 0.0, NEG_INF)
  return jnp.where(expand(params.greedy_B), greedy_logp, logp)


def _top_k_top_p(scaled_xV, top_k_x1, top_p_x1):
  V = scaled_xV.shape[-1]
  sorted_xV = -jnp.sort(-scaled_xV, axis=-1)  # descending
  rank_xV = jnp.arange(V).reshape((1,) * (scaled_xV.ndim - 1) + (V,))
  in_top_k_xV = jnp.where(top_k_x1 > 0, rank_xV < top_k_x1, True)
  # top-p measures mass on what top-k kept, renormalised (the order transformers and vLLM use).
  probs_xV = jax.nn.softmax(jnp.where(in_top_k_xV, sorted_xV, NEG_INF), axis=-1)
  mass_before_xV = jnp.cumsum(probs_xV, axis=-1) - probs_xV
  # top_p >= 1 keeps everything top-k kept, even tails whose float mass rounds the sum past 1.
  keep_xV = in_top_k_xV & ((mass_before_xV < top_p_x1) | (top_p_x1 >= 1.0))
  keep_xV = keep_xV.at[..., 0].set(True)
  # The smallest kept (sorted) value is the threshold; everything below it is dropped.
  threshold_x1 = jnp.min(jnp.where(keep_xV, sorted_xV, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(scaled_xV >= threshold_x1, scaled_xV, NEG_INF)


def sample(rng: jax.Array, logprobs_BV: jax.Array) -> jax.Array:
  """One token per row from (processed) log-probabilities; -inf tokens are never drawn."""
  return jax.random.categorical(rng, logprobs_BV, axis=-1).astype(jnp.int32)


def needs_filter(top_p, top_k) -> bool:
  """Host-side check (on Python/NumPy values) whether any row uses top-k or top-p."""
  import numpy as np

  return bool(np.any(np.asarray(top_p) < 1.0) or np.any(np.asarray(top_k) > 0))


def all_greedy(temperature) -> bool:
  """Host-side check (on Python/NumPy values) whether every row is greedy (temperature 0)."""
  import numpy as np

  return not np.any(np.asarray(temperature) > 0)
