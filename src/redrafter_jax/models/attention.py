"""Attention backends behind one signature, each reading the KV-cache layout it reads best.

``attend(q_BTHE, k, v, mask_BTS, backend=..., layout=...) -> out_BTHE``

The mask says, for each new token, which cache slots it may see: this one signature serves a
prefill (causal), one AR step, and a packed draft tree (each token sees the committed prefix and
its own ancestors). Grouped-query attention is native: ``H = K * G``. Keys and values come in the
cache's layout (``kv_cache.LAYOUTS``), which the backend chooses (``LAYOUT``) so that no step
copies or transposes the cache; the mask's width is the number of slots read (``S`` may be a
bucket of the cache, ``kv_cache.context_bucket``).

Backends:
  ``xla``     einsum reference; runs on every platform; softmax in float32. Its own layout is
              ``XES`` (tuned for XLA:CPU); it also reads the others, which is how tests compare
              layouts on a CPU.
  ``cudnn``   ``jax.nn.dot_product_attention(implementation="cudnn")`` on ``BSKE``, which it
              takes as it is; NVIDIA GPUs only. Its cache is kept in half precision
              (``cache_dtype``), so nothing is cast per step either.
  ``pallas``  a flash-style Pallas kernel on ``BKSE`` that reads only the blocks each row has
              filled (``pallas_attention``); Triton on a GPU, interpret mode on CPU (slow:
              for tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from redrafter_jax.errors import UserError
from redrafter_jax.models import kv_cache as kvc
from redrafter_jax.models.invariant import VirtualKeys, attend_invariant

BACKENDS = ("xla", "cudnn", "pallas")
LAYOUT = {"xla": "XES", "cudnn": "BSKE", "pallas": "BKSE"}  # the cache layout each backend reads
_NEG_INF = -1e30


class BackendError(UserError, RuntimeError):
  """An attention backend is unknown or cannot run on this platform."""


def check_backend(backend: str) -> None:
  """Fail early, with a clear message, when ``backend`` cannot run here."""
  if backend not in BACKENDS:
    raise BackendError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
  platform = jax.default_backend()
  if backend == "cudnn" and platform != "gpu":
    raise BackendError(
        f"attention backend 'cudnn' needs an NVIDIA GPU, but JAX runs on {platform!r}; "
        "use backend='xla'")
  if backend == "pallas" and platform not in ("gpu", "cpu"):
    raise BackendError(f"attention backend 'pallas' runs on a GPU (Triton) or, in interpret "
                       f"mode, on CPU; JAX runs on {platform!r}: use backend='xla'")


def cache_layout(backend: str) -> str:
  """The KV-cache layout ``backend`` reads."""
  if backend not in LAYOUT:
    raise BackendError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
  return LAYOUT[backend]


def cache_dtype(backend: str, dtype):
  """The KV cache's dtype for activations of ``dtype``: cuDNN reads half precision only, so its
  cache is stored in bfloat16 rather than cast in every layer at every step."""
  if backend == "cudnn" and dtype not in (jnp.bfloat16, jnp.float16):
    return jnp.bfloat16
  return dtype


def attend(q_BTHE: jax.Array, k: jax.Array, v: jax.Array, mask_BTS: jax.Array, *,
           backend: str = "xla", layout: str | None = None, invariant: bool = False,
           virtual: VirtualKeys | None = None) -> jax.Array:
  """Masked grouped-query attention; ``k`` and ``v`` in ``layout`` (default: the backend's).

  ``invariant``: every query's output independent of the other queries and of the width read
  (``invariant.attend_invariant``, any backend's layout, computed by XLA); ``virtual``: where a
  tree's tokens find their keys in that mode (``invariant.tree_keys``)."""
  if backend not in BACKENDS:
    raise BackendError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
  layout = LAYOUT[backend] if layout is None else layout
  kvc.check_layout(layout)
  if invariant:
    B = q_BTHE.shape[0]
    if layout != "XES":  # one copy of each into the layout the invariant products read
      k_BKSE, v_BKSE = kvc.to_BKSE(k, v, B, layout)
      _, K, S, E = k_BKSE.shape
      k = k_BKSE.transpose(1, 0, 3, 2).reshape(K * B, E, S)
      v = v_BKSE.transpose(1, 0, 2, 3).reshape(K * B, S, E)
    return attend_invariant(q_BTHE, k, v, mask_BTS, virtual)
  if virtual is not None:
    raise BackendError("virtual keys (tree_keys) are read by the invariant attention only")
  if backend == "xla":
    return _attend_xla(q_BTHE, k, v, mask_BTS, layout)
  if layout != LAYOUT[backend]:
    raise BackendError(f"attention backend {backend!r} reads the {LAYOUT[backend]} cache "
                       f"layout, got {layout}")
  if backend == "cudnn":
    return _attend_cudnn(q_BTHE, k, v, mask_BTS)
  from redrafter_jax.models.pallas_attention import attend_pallas

  return attend_pallas(q_BTHE, k, v, mask_BTS, interpret=jax.default_backend() == "cpu")


def _attend_xla(q_BTHE, k, v, mask_BTS, layout):
  B, T, H, E = q_BTHE.shape
  S = mask_BTS.shape[-1]
  if layout != "XES":  # [B, S, K, E] or [B, K, S, E]: one einsum each way, no copy of k or v
    K = k.shape[2] if layout == "BSKE" else k.shape[1]
    kv = "bske" if layout == "BSKE" else "bkse"
    q_BTKGE = q_BTHE.reshape(B, T, K, H // K, E)
    scores_BKGTS = jnp.einsum(f"btkge,{kv}->bkgts", q_BTKGE, k,
                              preferred_element_type=jnp.float32) * (E ** -0.5)
    scores_BKGTS = jnp.where(mask_BTS[:, None, None, :, :], scores_BKGTS, _NEG_INF)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(v.dtype)
    out_BTKGE = jnp.einsum(f"bkgts,{kv}->btkge", probs_BKGTS, v)
    return out_BTKGE.reshape(B, T, H, E).astype(q_BTHE.dtype)
  X = k.shape[0]
  K = X // B
  G = H // K
  q_XQE = q_BTHE.reshape(B, T, K, G, E).transpose(2, 0, 3, 1, 4).reshape(X, G * T, E)
  scores_XQS = jnp.einsum("xqe,xes->xqs", q_XQE, k,
                          preferred_element_type=jnp.float32) * (E ** -0.5)
  scores_KBGTS = scores_XQS.reshape(K, B, G, T, S)
  scores_KBGTS = jnp.where(mask_BTS[None, :, None, :, :], scores_KBGTS, _NEG_INF)
  probs_XQS = jax.nn.softmax(scores_KBGTS, axis=-1).astype(v.dtype).reshape(X, G * T, S)
  out_XQE = jnp.einsum("xqs,xse->xqe", probs_XQS, v)
  return out_XQE.reshape(K, B, G, T, E).transpose(1, 3, 0, 2, 4).reshape(B, T, H, E)


def _attend_cudnn(q_BTHE, k_BSKE, v_BSKE, mask_BTS):
  # cuDNN wants half precision and [B, S, K, E] (the cache's layout and dtype already); the mask
  # broadcasts over heads as [B, 1, T, S].
  dtype = k_BSKE.dtype if k_BSKE.dtype in (jnp.bfloat16, jnp.float16) else jnp.bfloat16
  out = jax.nn.dot_product_attention(
      q_BTHE.astype(dtype), k_BSKE.astype(dtype), v_BSKE.astype(dtype),
      mask=mask_BTS[:, None, :, :], implementation="cudnn")
  return out.astype(q_BTHE.dtype)
