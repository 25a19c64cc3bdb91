"""Attention backends behind one signature.

``attend(q_BTHE, k_XES, v_XSE, mask_BTS, backend=...) -> out_BTHE``

The mask says, for each new token, which cache slots it may see: this one signature serves a
prefill (causal), one AR step, and a packed draft tree (each token sees the committed prefix and
its own ancestors). Grouped-query attention is native: ``H = K * G``. Keys and values come in the
cache's layout, ``k_XES`` and ``v_XSE`` with ``X = K * B`` head-major (see ``kv_cache``): the two
matmuls read them as they are.

Backends:
  ``xla``    einsum reference; runs on every platform; softmax in float32.
  ``cudnn``  ``jax.nn.dot_product_attention(implementation="cudnn")``; NVIDIA GPUs only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from redrafter_jax.errors import UserError
from redrafter_jax.models import kv_cache as kvc

BACKENDS = ("xla", "cudnn")
_NEG_INF = -1e30


class BackendError(UserError, RuntimeError):
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


def attend(q_BTHE: jax.Array, k_XES: jax.Array, v_XSE: jax.Array, mask_BTS: jax.Array,
           *, backend: str = "xla") -> jax.Array:
  if backend == "xla":
    return _attend_xla(q_BTHE, k_XES, v_XSE, mask_BTS)
  if backend == "cudnn":
    return _attend_cudnn(q_BTHE, k_XES, v_XSE, mask_BTS)
  raise BackendError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")


def _attend_xla(q_BTHE, k_XES, v_XSE, mask_BTS):
  B, T, H, E = q_BTHE.shape
  X, _, S = k_XES.shape
  K = X // B
  G = H // K
  q_XQE = q_BTHE.reshape(B, T, K, G, E).transpose(2, 0, 3, 1, 4).reshape(X, G * T, E)
  scores_XQS = jnp.einsum("xqe,xes->xqs", q_XQE, k_XES,
                          preferred_element_type=jnp.float32) * (E ** -0.5)
  scores_KBGTS = scores_XQS.reshape(K, B, G, T, S)
  scores_KBGTS = jnp.where(mask_BTS[None, :, None, :, :], scores_KBGTS, _NEG_INF)
  probs_XQS = jax.nn.softmax(scores_KBGTS, axis=-1).astype(v_XSE.dtype).reshape(X, G * T, S)
  out_XQE = jnp.einsum("xqs,xse->xqe", probs_XQS, v_XSE)
  return out_XQE.reshape(K, B, G, T, E).transpose(1, 3, 0, 2, 4).reshape(B, T, H, E)


def _attend_cudnn(q_BTHE, k_XES, v_XSE, mask_BTS):
  # cuDNN wants half precision and [B, S, K, E]; the mask broadcasts over heads as [B, 1, T, S].
  dtype = q_BTHE.dtype if q_BTHE.dtype in (jnp.bfloat16, jnp.float16) else jnp.bfloat16
  k_BKSE, v_BKSE = kvc.as_BKSE(k_XES, v_XSE, q_BTHE.shape[0])
  k_BSKE, v_BSKE = k_BKSE.transpose(0, 2, 1, 3), v_BKSE.transpose(0, 2, 1, 3)
  out = jax.nn.dot_product_attention(
      q_BTHE.astype(dtype), k_BSKE.astype(dtype), v_BSKE.astype(dtype),
      mask=mask_BTS[:, None, :, :], implementation="cudnn")
  return out.astype(q_BTHE.dtype)
