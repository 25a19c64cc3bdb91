"""Attention backends behind one signature.

``attend(q_BTHE, k_BKSE, v_BKSE, mask_BTS, backend=...) -> out_BTHE``

The mask says, for each new token, which cache slots it may see: this one signature serves a
prefill (causal), one AR step, and a packed draft tree (each token sees the committed prefix and
its own ancestors). Grouped-query attention is native: ``H = K * G``. Keys and values come in the cache's layout
``[B, K, S, E]`` (see ``kv_cache``).

Backends:
  ``xla``    einsum reference; runs on every platform; softmax in float32.
  ``cudnn``  ``jax.nn.dot_product_attention(implementation="cudnn")``; NVIDIA GPUs only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BACKENDS = ("xla", "cudnn")
_NEG_INF = -1e30


class BackendError(RuntimeError):
  """An attention backend is unknown or cannot run on this platform."""


def check_backend(backend: str) -> None:
  """Fail early, with a clear message, when ``backend`` cannot run here."""
  if backend not in BACKENDS:
    raise BackendError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
  if backend == "cudnn":
    platform = jax.default_backend()
    if platform != "gpu":
      raise BackendError(
          f"attention backend 'cudnn' needs an NVIDIA GPU, but JAX runs on {platform!r}; "
          "use backend='xla'")


def attend(q_BTHE: jax.Array, k_BKSE: jax.Array, v_BKSE: jax.Array, mask_BTS: jax.Array,
           *, backend: str = "xla") -> jax.Array:
  if backend == "xla":
    return _attend_xla(q_BTHE, k_BKSE, v_BKSE, mask_BTS)
  if backend == "cudnn":
    return _attend_cudnn(q_BTHE, k_BKSE, v_BKSE, mask_BTS)
  raise BackendError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")


def _attend_xla(q_BTHE, k_BKSE, v_BKSE, mask_BTS):
  B, T, H, E = q_BTHE.shape
  K = k_BKSE.shape[1]
  q_BKGTE = q_BTHE.reshape(B, T, K, H // K, E).transpose(0, 2, 3, 1, 4)
  scores_BKGTS = jnp.einsum("bkgte,bkse->bkgts", q_BKGTE, k_BKSE,
                            preferred_element_type=jnp.float32) * (E ** -0.5)
  scores_BKGTS = jnp.where(mask_BTS[:, None, None, :, :], scores_BKGTS, _NEG_INF)
  probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(v_BKSE.dtype)
  out_BKGTE = jnp.einsum("bkgts,bkse->bkgte", probs_BKGTS, v_BKSE)
  return out_BKGTE.transpose(0, 3, 1, 2, 4).reshape(B, T, H, E)


def _attend_cudnn(q_BTHE, k_BKSE, v_BKSE, mask_BTS):
  # cuDNN wants half precision and [B, S, K, E]; the mask broadcasts over heads as [B, 1, T, S].
  dtype = q_BTHE.dtype if q_BTHE.dtype in (jnp.bfloat16, jnp.float16) else jnp.bfloat16
  k_BSKE = k_BKSE.transpose(0, 2, 1, 3)
  v_BSKE = v_BKSE.transpose(0, 2, 1, 3)
  out = jax.nn.dot_product_attention(
      q_BTHE.astype(dtype), k_BSKE.astype(dtype), v_BSKE.astype(dtype),
      mask=mask_BTS[:, None, :, :], implementation="cudnn")
  return out.astype(q_BTHE.dtype)
