"""Llama-family decoder in Flax NNX (Llama 1-3, Mistral, Qwen2, SmolLM2).

One forward serves prefill, an AR step and tree verification:

  ``model(tokens_BT, positions_BT, mask_BTS, cache) -> (logits_BTV, hidden_BTD, cache)``

``mask_BTS`` says which cache slots each new token sees (see ``kv_cache.visible_mask``); the new
tokens' K/V are written at each row's first uncommitted slots and left uncommitted. The mask's
width is how many slots attention reads: a mask narrower than the cache (a context bucket,
``kv_cache.context_bucket``) makes attention cost follow the used length. With
``cache=None`` the forward attends only among the T tokens (``mask_BTS`` is then ``[B, T, T]``),
which is what training uses. ``hidden`` is taken AFTER the final norm: it is the drafter's input.

Layers run unrolled by default (XLA sees 30 distinct layers: the fastest steps, the longest
compiles). ``stack_layers`` turns a model into one whose layers are a single ``DecoderLayer``
with stacked ``[L, ...]`` parameters, run by a ``jax.lax.scan``: each program compiles one layer
body whatever the depth, which is what deep models want; its KV cache is stacked to match
(``kv_cache``, "Stacked"). Same function, same parameter values.

Parameter names and layouts mirror Hugging Face's (``layers.3.self_attn.q_proj.weight``,
``[out, in]``) so the name tables in ``weights/`` stay one line per tensor. ``dtype`` is the
activations' (and KV cache's) dtype, ``param_dtype`` the weights' (default: ``dtype``); float32
activations with bfloat16 weights is the fast CPU setting (see ``models/linear.py``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from redrafter_jax.config import LlamaConfig
from redrafter_jax.models import kv_cache as kvc
from redrafter_jax.models.attention import attend, cache_dtype, cache_layout
from redrafter_jax.models.invariant import VirtualKeys, fixed_sum
from redrafter_jax.models.linear import Dense, Embed, on_cpu


class RMSNorm(nnx.Module):
  """Normalise in float32, cast back, then scale (the order Hugging Face's Llama uses).
  ``invariant``: the mean of squares in a fixed order (``invariant.fixed_sum``)."""

  def __init__(self, dim: int, eps: float, *, param_dtype, invariant: bool = False):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps
    self.invariant = invariant

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    sq = x32 * x32
    mean = (fixed_sum(sq, keepdims=True) / x.shape[-1] if self.invariant
            else jnp.mean(sq, axis=-1, keepdims=True))
    x32 = x32 * jax.lax.rsqrt(mean + self.eps)
    scale_xD = self.scale[...].astype(x.dtype).reshape((1,) * (x.ndim - 1) + (-1,))
    return scale_xD * x32.astype(x.dtype)


def rope_inv_freq(cfg: LlamaConfig) -> jax.Array:
  """Inverse frequencies ``[E/2]``, with Llama-3 scaling when configured."""
  E = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, E, 2, dtype=jnp.float32) / E))
  s = cfg.rope_scaling
  if s is None:
    return inv
  low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
  high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
  wavelen = 2 * math.pi / inv
  smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
            / (s.high_freq_factor - s.low_freq_factor))
  scaled = jnp.where(wavelen > low_wavelen, inv / s.factor, inv)
  mid = (1 - smooth) * scaled / s.factor + smooth * scaled
  is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return jnp.where(is_mid, mid, scaled)


def rope_cos_sin(positions_BT: jax.Array, inv_freq: jax.Array, dtype):
  angles_BTe = positions_BT[:, :, None].astype(jnp.float32) * inv_freq[None, None, :]
  angles_BTE = jnp.concatenate([angles_BTe, angles_BTe], axis=-1)
  return jnp.cos(angles_BTE).astype(dtype), jnp.sin(angles_BTE).astype(dtype)


def apply_rope(x_BTHE, cos_BTE, sin_BTE):
  half = x_BTHE.shape[-1] // 2
  rotated = jnp.concatenate([-x_BTHE[..., half:], x_BTHE[..., :half]], axis=-1)
  return x_BTHE * cos_BTE[:, :, None, :] + rotated * sin_BTE[:, :, None, :]


class Attention(nnx.Module):

  def __init__(self, cfg: LlamaConfig, *, dtype, param_dtype, rngs: nnx.Rngs,
               weight_layout: str | None = None, invariant: bool = False):
    D, H, K, E = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    linear = lambda i, o, bias: Dense(i, o, use_bias=bias, dtype=dtype, param_dtype=param_dtype,
                                      rngs=rngs, layout=weight_layout, invariant=invariant)
    self.q_proj = linear(D, H * E, cfg.attention_bias)
    self.k_proj = linear(D, K * E, cfg.attention_bias)
    self.v_proj = linear(D, K * E, cfg.attention_bias)
    self.o_proj = linear(H * E, D, False)
    self.num_heads, self.num_kv_heads, self.head_dim = H, K, E
    self.invariant = invariant

  def __call__(self, x_BTD, cos_BTE, sin_BTE, mask_BTS, cache, layer, backend, virtual=None):
    B, T, _ = x_BTD.shape
    H, K, E = self.num_heads, self.num_kv_heads, self.head_dim
    q_BTHE = apply_rope(self.q_proj(x_BTD).reshape(B, T, H, E), cos_BTE, sin_BTE)
    k_BTKE = apply_rope(self.k_proj(x_BTD).reshape(B, T, K, E), cos_BTE, sin_BTE)
    v_BTKE = self.v_proj(x_BTD).reshape(B, T, K, E)
    if cache is None:  # attend among the T tokens only (S = T), in the backend's layout
      layout = cache_layout(backend)
      keys, values = kvc.from_BTKE(k_BTKE, v_BTKE, layout)
    else:  # read only the slots the mask covers (its width: a context bucket, or the whole)
      layout = cache.layout
      cache = kvc.write_layer(cache, layer, k_BTKE, v_BTKE)
      keys, values = cache.layer(layer, mask_BTS.shape[-1])
    out_BTHE = attend(q_BTHE, keys, values, mask_BTS, backend=backend, layout=layout,
                      invariant=self.invariant, virtual=virtual)
    return self.o_proj(out_BTHE.reshape(B, T, H * E)), cache


class MLP(nnx.Module):

  def __init__(self, cfg: LlamaConfig, *, dtype, param_dtype, rngs: nnx.Rngs,
               weight_layout: str | None = None, invariant: bool = False):
    D, F = cfg.hidden_size, cfg.intermediate_size
    linear = lambda i, o: Dense(i, o, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                                rngs=rngs, layout=weight_layout, invariant=invariant)
    self.gate_proj, self.up_proj, self.down_proj = linear(D, F), linear(D, F), linear(F, D)

  def __call__(self, x_BTD):
    return self.down_proj(jax.nn.silu(self.gate_proj(x_BTD)) * self.up_proj(x_BTD))


class DecoderLayer(nnx.Module):

  def __init__(self, cfg: LlamaConfig, *, dtype, param_dtype, rngs: nnx.Rngs,
               weight_layout: str | None = None, invariant: bool = False):
    norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype,
                           invariant=invariant)
    self.input_layernorm = norm()
    self.self_attn = Attention(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                               weight_layout=weight_layout, invariant=invariant)
    self.post_attention_layernorm = norm()
    self.mlp = MLP(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                   weight_layout=weight_layout, invariant=invariant)

  def __call__(self, x_BTD, cos_BTE, sin_BTE, mask_BTS, cache, layer, backend, virtual=None):
    attn_BTD, cache = self.self_attn(self.input_layernorm(x_BTD), cos_BTE, sin_BTE, mask_BTS,
                                     cache, layer, backend, virtual)
    x_BTD = x_BTD + attn_BTD
    x_BTD = x_BTD + self.mlp(self.post_attention_layernorm(x_BTD))
    return x_BTD, cache


def _as_bits(w: jax.Array) -> jax.Array:
  half = jnp.issubdtype(w.dtype, jnp.floating) and w.dtype.itemsize == 2
  return jax.lax.bitcast_convert_type(w, jnp.uint16) if half else w


def _from_bits(w: jax.Array, dtype) -> jax.Array:
  return jax.lax.bitcast_convert_type(w, dtype) if w.dtype != dtype else w


class Llama(nnx.Module):
  """The base LLM. ``backend`` picks the attention implementation (``attention.BACKENDS``) and
  with it the KV cache's layout (``init_cache``);
  ``dtype`` the activations' and the KV cache's dtype, ``param_dtype`` the weights' (None: the
  same); ``weight_layout`` how projections store their matrices (``linear.LAYOUTS``; None:
  ``linear.preferred_layout(param_dtype)``, the faster one on this platform).

  ``invariant`` (the invariant mode, ``models/invariant.py``) makes every token's logits a
  function of that token and its ancestors only, whatever else is in the forward. What greedy
  decoding guarantees, in each mode:

  - float32 activations, default: ReDrafter, AR at any batch and any cache size give the same
    tokens, except where two candidates tie within float32 rounding;
  - bfloat16 activations, default: the model's own greedy output changes with the batch's
    shape (batch size, padding, cache size, tree) at near-ties; ReDrafter's divergences from
    AR fall within that noise (``bench divergence`` reports both);
  - ``invariant=True`` (any activation dtype): identical tokens, with no tie exception, from
    ``generate`` at any batch size and from ``decode`` / ``ReDrafter`` at any tree and batch
    (``verify_forward`` reads a tree's keys in their AR positions, ``invariant.tree_keys``).
    It costs time: the cost is measured by ``python -m redrafter_jax.bench invariant``."""

  def __init__(self, cfg: LlamaConfig, *, dtype=jnp.float32, param_dtype=None,
               backend: str = "xla", cache_layout: str | None = None,
               weight_layout: str | None = None, invariant: bool = False, rngs: nnx.Rngs):
    param_dtype = dtype if param_dtype is None else param_dtype
    self.config = cfg
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.backend = backend
    self.cache_layout = cache_layout  # None: the backend's (only ``xla`` reads every layout)
    self.scan_layers = False  # ``stack_layers`` sets it (and stacks ``layers``)
    self.invariant = invariant
    self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                              param_dtype=param_dtype, rngs=rngs, invariant=invariant)
    self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                                         weight_layout=weight_layout, invariant=invariant)
                            for _ in range(cfg.num_layers)])
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype,
                        invariant=invariant)
    if not cfg.tie_word_embeddings:
      self.lm_head = Dense(cfg.hidden_size, cfg.vocab_size, use_bias=False, dtype=jnp.float32,
                           param_dtype=param_dtype, rngs=rngs, layout=weight_layout,
                           invariant=invariant)

  def embed(self, tokens):
    return self.embed_tokens(tokens)

  def forward_hidden(self, tokens_BT, positions_BT, mask_BTS, cache: kvc.KVCache | None = None,
                     virtual: VirtualKeys | None = None):
    """Run the decoder; returns ``(hidden_BTD, cache)`` with hidden after the final norm.
    ``virtual`` (invariant mode only): where a tree's tokens find their keys, with ``mask_BTS``
    in those virtual positions (``invariant.tree_keys``)."""
    x_BTD = self.embed_tokens(tokens_BT)
    cos_BTE, sin_BTE = rope_cos_sin(positions_BT, rope_inv_freq(self.config), self.dtype)
    if not self.scan_layers:
      for i, layer in enumerate(self.layers):
        x_BTD, cache = layer(x_BTD, cos_BTE, sin_BTE, mask_BTS, cache, i, self.backend, virtual)
      return self.norm(x_BTD), cache
    if cache is not None and not cache.stacked:
      raise kvc.CacheError("a model that scans over its layers needs a stacked KV cache "
                           "(its init_cache makes one)")
    graphdef, params_L = nnx.split(self.layers)
    # XLA:CPU slices 16-bit float arrays by converting them ALL to float32 first (before the
    # loop, at every call): on a CPU the scan slices the weights' bits (uint16) instead.
    dtypes = jax.tree.map(lambda w: w.dtype, params_L)
    if on_cpu():
      params_L = jax.tree.map(_as_bits, params_L)

    def one_layer(carry, bits):
      x_BTD, cache, i = carry
      params = jax.tree.map(_from_bits, bits, dtypes)
      x_BTD, cache = nnx.merge(graphdef, params)(x_BTD, cos_BTE, sin_BTE, mask_BTS, cache, i,
                                                  self.backend, virtual)
      return (x_BTD, cache, i + 1), None

    (x_BTD, cache, _), _ = jax.lax.scan(one_layer, (x_BTD, cache, jnp.int32(0)), params_L)
    return self.norm(x_BTD), cache

  def forward_layers(self, tokens_BT, positions_BT, mask_BTS, cache: kvc.KVCache | None = None,
                     virtual: VirtualKeys | None = None, *, layers: tuple[int, ...]):
    """``forward_hidden`` that also returns the outputs of decoder ``layers`` (0-based), each
    put through the final norm and concatenated: ``(hidden_BTD, taps_BTX, cache)`` with
    ``X = len(layers) * D``. A multi-layer drafter reads ``taps`` (``DrafterConfig
    .feature_layers``); the last layer's tap is ``hidden`` itself. A separate method so that
    ``forward_hidden`` keeps its program."""
    L = self.config.num_layers
    if not layers or any(not 0 <= i < L for i in layers):
      raise ValueError(f"forward_layers: layers {tuple(layers)} must be a non-empty list of "
                       f"indices in [0, {L})")
    x_BTD = self.embed_tokens(tokens_BT)
    cos_BTE, sin_BTE = rope_cos_sin(positions_BT, rope_inv_freq(self.config), self.dtype)
    if not self.scan_layers:
      taps = {}
      for i, layer in enumerate(self.layers):
        x_BTD, cache = layer(x_BTD, cos_BTE, sin_BTE, mask_BTS, cache, i, self.backend, virtual)
        if i in layers:
          taps[i] = x_BTD
      taps_kBTD = [taps[i] for i in layers]
    else:
      if cache is not None and not cache.stacked:
        raise kvc.CacheError("a model that scans over its layers needs a stacked KV cache "
                             "(its init_cache makes one)")
      graphdef, params_L = nnx.split(self.layers)
      dtypes = jax.tree.map(lambda w: w.dtype, params_L)
      if on_cpu():  # see forward_hidden
        params_L = jax.tree.map(_as_bits, params_L)
      layers_k = jnp.asarray(layers, jnp.int32)

      def one_layer(carry, bits):
        x_BTD, cache, i, taps_kBTD = carry
        params = jax.tree.map(_from_bits, bits, dtypes)
        x_BTD, cache = nnx.merge(graphdef, params)(x_BTD, cos_BTE, sin_BTE, mask_BTS, cache, i,
                                                    self.backend, virtual)
        hit_k = (layers_k == i).reshape(-1, 1, 1, 1)
        return (x_BTD, cache, i + 1, jnp.where(hit_k, x_BTD[None], taps_kBTD)), None

      taps0 = jnp.zeros((len(layers),) + x_BTD.shape, x_BTD.dtype)
      (x_BTD, cache, _, taps_kBTD), _ = jax.lax.scan(
          one_layer, (x_BTD, cache, jnp.int32(0), taps0), params_L)
      taps_kBTD = list(taps_kBTD)
    taps_BTX = jnp.concatenate([self.norm(t) for t in taps_kBTD], axis=-1)
    return self.norm(x_BTD), taps_BTX, cache

  def logits(self, hidden_xD: jax.Array) -> jax.Array:
    """Vocabulary logits (float32) for hidden states of any leading shape."""
    if self.config.tie_word_embeddings:
      out = self.embed_tokens.attend(hidden_xD)
    else:
      out = self.lm_head(hidden_xD)
    return out.astype(jnp.float32)

  def output_matrix(self) -> jax.Array:
    """The output projection as ``[V, D]`` (the embedding table when they are tied)."""
    if self.config.tie_word_embeddings:
      return self.embed_tokens.embedding[...]
    return self.lm_head.matrix_OI()

  def __call__(self, tokens_BT, positions_BT, mask_BTS, cache: kvc.KVCache | None = None):
    hidden_BTD, cache = self.forward_hidden(tokens_BT, positions_BT, mask_BTS, cache)
    return self.logits(hidden_BTD), hidden_BTD, cache

  def init_cache(self, batch: int, size: int, layout: str | None = None) -> kvc.KVCache:
    """An empty cache in the layout (and dtype) the attention backend reads; ``layout`` (or the
    model's ``cache_layout``) overrides it (only the ``xla`` backend reads every layout)."""
    c = self.config
    layout = layout or self.cache_layout or cache_layout(self.backend)
    return kvc.init(c.num_layers, batch, size, c.num_kv_heads, c.head_dim,
                    cache_dtype(self.backend, self.dtype), layout, stacked=self.scan_layers)


def stack_layers(model: Llama) -> Llama:
  """Make ``model`` scan over its layers (in place; also returned): its ``layers`` become one
  ``DecoderLayer`` whose parameters are the layers' stacked on a leading axis (a copy of the
  layer weights, once), and its caches stacked (``init_cache``). Parameter names lose the layer
  index (``layers.mlp.up_proj.weight``, shape ``[L, ...]``); ``sharding`` knows that axis."""
  if model.scan_layers:
    return model
  splits = [nnx.split(layer) for layer in model.layers]
  if len({graphdef for graphdef, _ in splits}) != 1:
    raise ValueError("stack_layers: the layers differ in structure (weight layouts?)")
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(state for _, state in splits))
  model.layers = nnx.merge(splits[0][0], stacked)
  model.scan_layers = True
  return model


def abstract_llama(cfg: LlamaConfig, *, dtype=jnp.float32, param_dtype=None,
                   backend: str = "xla", weight_layout: str | None = None,
                   invariant: bool = False) -> Llama:
  """A Llama with shape-only parameters (no memory, no random init), for loading weights into."""
  return nnx.eval_shape(lambda: Llama(cfg, dtype=dtype, param_dtype=param_dtype,
                                      backend=backend, weight_layout=weight_layout,
                                      invariant=invariant, rngs=nnx.Rngs(0)))
