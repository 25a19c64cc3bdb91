"""The ReDrafter head: a small recurrent network on the LLM's last hidden state.

Wiring (the reference implementation's code, DESIGN §5), for one beam at draft step t:

  s_t = SiLU(rnn_w(E(tok_{t-1})) + rnn_u(s_{t-1})),  s_0 = 0   (rnn=True)
  s_t = E(tok_{t-1}) + s_{t-1}                                  (rnn=False)
  x   = concat([h, s_t])          # the LLM hidden state FIRST
  x   = input_proj(x)             # only when exit_dim C != 2 * D
  x   = x + SiLU(linear_i(x))     # num_draft_layers ResBlocks
  logp = log_softmax(lm_head_n(x))

``E`` is the LLM's input embedding table, passed in (it is not part of the drafter's weights).

Copy hint (``DrafterConfig.copy_ngram`` K > 0, an option beyond the reference): each step also
reads ``(c_t, m_t)``, the token that followed the latest earlier occurrence of the longest
suffix (up to K tokens) of the text so far and that match's length (``context_copy``; m = 0:
none). It enters the recurrence and, gated, the logits:

  s_t  += copy_w(E(c_t) * [m_t > 0]) + copy_length[m_t]       (inside the SiLU when rnn=True)
  logit[c_t] += copy_gate(x)[m_t] * [m_t > 0]                  (x: the head's input)

All three start at zero, so a drafter given the option starts as the one without it; training
learns how far to trust a match of each length.

Context attention (``DrafterConfig.context_attention`` A > 0, an option beyond the reference;
``context_attention``): a memory of keys and values at every committed position, and at each
step a query from ``[h, s_t]`` that reads it:

  x += ctx_out(attend(ctx_query([h, s_t]), memory))             (after input_proj)

``ctx_out`` starts at zero, so a drafter given the option starts as the one without it.

Multi-layer features (``DrafterConfig.feature_layers``, an option beyond the reference, after
EAGLE-3): the LLM hands over the outputs of several decoder layers, each through its final norm,
concatenated (``[.., k*D]``, see ``Llama.forward_layers``); ``context`` projects them to D with
the learned ``feature_proj`` (no bias) and that vector takes h's place above. A fresh
``feature_proj`` copies the LAST listed layer and ignores the others, so with the LLM's last
layer listed last, a fresh multi-layer drafter starts as the single-layer one.
Parameter names and shapes follow the reference's safetensors keys (``lm_head.{i}.linear``,
``lm_head.{n}``, ``rnn_u``, ``rnn_w``, ``input_proj``), so export is a transpose per tensor.

Draft vocabulary. On a CPU the drafter's cost is reading its ``[C, V]`` vocabulary projection
once per beam-search step (memory-bound: 100 MB at C=512, V=49152, fp32). ``token_ranking``
(token ids by frequency in the distillation data, saved beside the weights) lets
``restrict_vocab(drafter, R)`` keep only the R most frequent tokens' rows: drafts can then only
use those tokens, which costs little acceptance and no exactness (verification is unchanged).
"""


from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from redrafter_jax.config import DrafterConfig
from redrafter_jax.models.bf16_matmul import bf16_dot_general
from redrafter_jax.models.context_attention import ContextMemory, attend
from redrafter_jax.models.context_copy import CopyHint

REFERENCE_CUT_VALUE = -5e4


class TokenRanking(nnx.Variable):
  """Token ids, most frequent first (not a trained parameter; not in the reference weights)."""


class ResBlock(nnx.Module):

  def __init__(self, dim: int, *, dtype, rngs: nnx.Rngs, dot_general=jax.lax.dot_general):
    # The reference zero-initialises the ResBlock so a fresh head starts as identity.
    self.linear = nnx.Linear(dim, dim, dtype=dtype, param_dtype=dtype, rngs=rngs,
                             kernel_init=nnx.initializers.zeros_init(), dot_general=dot_general)

  def __call__(self, x):
    return x + jax.nn.silu(self.linear(x))


class Drafter(nnx.Module):

  def __init__(self, cfg: DrafterConfig, *, dtype=jnp.float32, matmul_dtype=None,
               rngs: nnx.Rngs):
    """``dtype``: the parameters' (and activations'). ``matmul_dtype`` bfloat16 (training only,
    ``train.matmul_dtype``; see ``with_matmul_dtype``) multiplies in bfloat16 with float32
    accumulation (``bf16_matmul``); None multiplies in ``dtype``."""
    D, C, V = cfg.hidden_size, cfg.exit_dim, cfg.vocab_size
    self.config = cfg
    self.dtype = dtype
    if matmul_dtype is not None and jnp.dtype(matmul_dtype) != jnp.bfloat16:
      raise ValueError(f"matmul_dtype must be None or bfloat16, got {matmul_dtype!r}")
    dot = jax.lax.dot_general if matmul_dtype is None else bf16_dot_general
    lin = lambda i, o, bias: nnx.Linear(i, o, use_bias=bias, dtype=dtype, param_dtype=dtype,
                                        rngs=rngs, dot_general=dot)
    if cfg.has_input_proj:
      self.input_proj = lin(2 * D, C, True)
    self.lm_head = nnx.List([ResBlock(C, dtype=dtype, rngs=rngs, dot_general=dot)
                             for _ in range(cfg.num_draft_layers)] + [lin(C, V, False)])
    if cfg.feature_layers:
      k = len(cfg.feature_layers)
      self.feature_proj = lin(k * D, D, False)
      self.feature_proj.kernel.set_value(jnp.concatenate(
          [jnp.zeros(((k - 1) * D, D), dtype), jnp.eye(D, dtype=dtype)]))
    if cfg.rnn:
      self.rnn_u = lin(D, D, True)
      self.rnn_w = lin(D, D, False)
    if cfg.copy_ngram:
      K = cfg.copy_ngram
      zeros = nnx.initializers.zeros_init()
      self.copy_w = nnx.Linear(D, D, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs,
                               kernel_init=zeros, dot_general=dot)
      self.copy_length = nnx.Param(jnp.zeros((K + 1, D), dtype))
      self.copy_gate = nnx.Linear(C, K + 1, use_bias=True, dtype=dtype, param_dtype=dtype,
                                  rngs=rngs, kernel_init=zeros, dot_general=dot)
    if cfg.context_attention:
      A = cfg.context_attention
      self.ctx_key = lin(2 * D, A, False)
      self.ctx_value = lin(2 * D, A, False)
      self.ctx_query = lin(2 * D, A, False)
      self.ctx_out = nnx.Linear(A, C, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs,
                                kernel_init=nnx.initializers.zeros_init(), dot_general=dot)
    self.token_ranking = TokenRanking(jnp.arange(V, dtype=jnp.int32))
    # Set by ``restrict_vocab``: the token id of each output row.
    self.vocab_ids = nnx.data(None)

  def context(self, feats_xX: jax.Array) -> jax.Array:
    """The context vector h ``[.., D]`` from what the LLM hands over: its last hidden state
    (returned as is) or, with ``feature_layers``, its concatenated layer states ``[.., k*D]``."""
    if not self.config.feature_layers:
      return feats_xX
    want = self.config.context_width
    if feats_xX.shape[-1] != want:
      raise ValueError(f"drafter with feature_layers={self.config.feature_layers} reads "
                       f"{want} features per token, got {feats_xX.shape[-1]}")
    return self.feature_proj(feats_xX.astype(self.dtype))

  def init_state(self, h_xD: jax.Array) -> jax.Array:
    return jnp.zeros_like(h_xD, self.dtype)

  def _check_hint(self, hint: CopyHint | None, embed_VD) -> bool:
    """Whether this step reads a hint (the config says; one must then be given)."""
    if not self.config.copy_ngram:
      return False
    if hint is None or embed_VD is None:
      raise ValueError(f"a drafter with copy_ngram={self.config.copy_ngram} needs the copy hint "
                       "and the embedding table at every step (the context it copies from)")
    return True

  def recur(self, s_xD: jax.Array, prev_emb_xD: jax.Array, hint: CopyHint | None = None,
            embed_VD: jax.Array | None = None) -> jax.Array:
    """Advance the recurrent state by one token (its embedding ``prev_emb``) and, with
    ``copy_ngram``, the copy hint (whose token is embedded from ``embed_VD``)."""
    extra_xD = 0.0
    if self._check_hint(hint, embed_VD):
      on_x1 = (hint.length_x > 0)[..., None]
      emb_xD = jnp.take(embed_VD, hint.token_x, axis=0).astype(self.dtype) * on_x1
      extra_xD = self.copy_w(emb_xD) + self.copy_length[...][hint.length_x]
    if self.config.rnn:
      return jax.nn.silu(self.rnn_w(prev_emb_xD) + self.rnn_u(s_xD) + extra_xD)
    return prev_emb_xD.astype(s_xD.dtype) + s_xD + extra_xD

  def memory_entries(self, h_xD: jax.Array, tok_emb_xD: jax.Array,
                     next_emb_xD: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The context attention's key and value ``[.., A]`` at committed positions: from the
    context vector there (``context``) with the embeddings of the token there and of the one
    that followed it."""
    h_xD = h_xD.astype(self.dtype)
    keys = self.ctx_key(jnp.concatenate([h_xD, tok_emb_xD.astype(self.dtype)], axis=-1))
    values = self.ctx_value(jnp.concatenate([h_xD, next_emb_xD.astype(self.dtype)], axis=-1))
    return keys, values

  def memory_over(self, h_LSD: jax.Array, tokens_LS: jax.Array,
                  embed_VD: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``memory_entries`` at every position of token rows (the token that followed position j
    is the row's token j + 1; the last position's is never read, since a query at j sees j's
    follower only once it is in the row)."""
    next_LS = jnp.pad(tokens_LS[:, 1:], ((0, 0), (0, 1)))
    return self.memory_entries(h_LSD, jnp.take(embed_VD, tokens_LS, axis=0),
                               jnp.take(embed_VD, next_LS, axis=0))

  def _read_context(self, h_LMD, s_LMD, memory: ContextMemory | None) -> jax.Array:
    """The context attention's contribution ``[L, M, C]`` to the head's input."""
    if memory is None:
      raise ValueError(f"a drafter with context_attention={self.config.context_attention} "
                       "needs the context memory at every step")
    if h_LMD.ndim != 3:
      raise ValueError(f"context attention reads queries [rows, queries, D], got {h_LMD.shape}")
    query_LMA = self.ctx_query(jnp.concatenate([h_LMD.astype(self.dtype),
                                                s_LMD.astype(self.dtype)], axis=-1))
    read_LMA = attend(query_LMA, memory, self.config.context_heads)
    return self.ctx_out(read_LMA.astype(self.dtype))

  def copy_row(self, token_x: jax.Array) -> jax.Array:
    """The output row of each token (-1 where the restricted draft vocabulary lacks it)."""
    if self.vocab_ids is None:
      return token_x
    ids_R = self.vocab_ids[...]
    row_of_V = jnp.full((self.config.vocab_size,), -1, jnp.int32).at[ids_R].set(
        jnp.arange(ids_R.shape[0], dtype=jnp.int32))
    return row_of_V[token_x]

  def logits(self, h_xD: jax.Array, s_xD: jax.Array, hint: CopyHint | None = None,
             memory: ContextMemory | None = None) -> jax.Array:
    """Unnormalised vocabulary logits (float32) from the LLM hidden state and drafter state
    (and, with ``copy_ngram``, the copy hint's gated boost; with ``context_attention``, what
    the state reads from ``memory``, for ``h``/``s`` of shape ``[rows, queries, D]``)."""
    x = jnp.concatenate([h_xD.astype(self.dtype), s_xD.astype(self.dtype)], axis=-1)
    if self.config.has_input_proj:
      x = self.input_proj(x)
    if self.config.context_attention:
      x = x + self._read_context(h_xD, s_xD, memory)
    *blocks, head = list(self.lm_head)
    for block in blocks:
      x = block(x)
    logits_xV = head(x).astype(jnp.float32)
    if not self.config.copy_ngram:
      return logits_xV
    if hint is None:
      raise ValueError(f"a drafter with copy_ngram={self.config.copy_ngram} needs the copy hint")
    gate_x = jnp.take_along_axis(self.copy_gate(x).astype(jnp.float32),
                                 hint.length_x[..., None], axis=-1)[..., 0]
    row_x = self.copy_row(hint.token_x)
    gate_x = jnp.where((hint.length_x > 0) & (row_x >= 0), gate_x, 0.0)
    V = logits_xV.shape[-1]
    at_xV = jnp.arange(V).reshape((1,) * row_x.ndim + (V,)) == row_x[..., None]
    return logits_xV + jnp.where(at_xV, gate_x[..., None], 0.0)

  def log_probs(self, h_xD, s_xD, hint: CopyHint | None = None,
                memory: ContextMemory | None = None) -> jax.Array:
    logits_xV = self.logits(h_xD, s_xD, hint, memory)
    if self.config.logit_top_k is not None:
      logits_xV = reference_top_k_cut(logits_xV, self.config.logit_top_k)
    return jax.nn.log_softmax(logits_xV, axis=-1)

  def step(self, h_xD, s_xD, prev_emb_xD, hint: CopyHint | None = None, embed_VD=None,
           memory: ContextMemory | None = None):
    """One draft step: ``(log_probs_xV, new_state_xD)``. ``hint`` (with ``embed_VD``): the copy
    hint at the token just read, for a drafter with ``copy_ngram``; ``memory``: the committed
    context, for a drafter with ``context_attention``."""
    s_xD = self.recur(s_xD, prev_emb_xD, hint, embed_VD)
    return self.log_probs(h_xD, s_xD, hint, memory), s_xD

  def unroll_logits(self, h_xD: jax.Array, prev_emb_xnD: jax.Array,
                    own_xn: jax.Array | None = None,
                    embed_VD: jax.Array | None = None,
                    hint_xn: CopyHint | None = None,
                    memory: ContextMemory | None = None) -> jax.Array:
    """Teacher-forced logits for n steps: step i sees the embeddings of tokens 1..i.

    ``prev_emb_xnD[..., i, :]`` is the embedding of the token before draft step i (g0 first).
    Returns ``logits_xnV`` (float32). This is the training path (no top-k cut). ``h_xD`` is
    the context vector (``context`` of the LLM's features).

    ``own_xn`` (bool; training-time test): where set at step i > 0, the step reads the
    embedding (from ``embed_VD``) of this drafter's own argmax at step i-1 instead of
    ``prev_emb``, as beam search's best beam does; the choice itself carries no gradient.
    ``hint_xn`` (with ``embed_VD``; a drafter with ``copy_ngram``): each step's copy hint
    (``context_copy.teacher_forced_hints``). ``memory`` (a drafter with ``context_attention``;
    ``h`` then ``[rows, queries, D]``): the committed context every step reads.
    """
    if own_xn is not None and self.config.copy_ngram:
      raise ValueError("the training-time test (self_feed) cannot be combined with copy_ngram: "
                       "the copy hints are those of the data tokens")
    s_xD = self.init_state(h_xD)
    out = []
    for i in range(prev_emb_xnD.shape[-2]):
      prev_xD = prev_emb_xnD[..., i, :]
      if own_xn is not None and i > 0:
        row_x = jnp.argmax(out[-1], axis=-1)
        tok_x = row_x if self.vocab_ids is None else self.vocab_ids[...][row_x]
        own_emb_xD = jax.lax.stop_gradient(jnp.take(embed_VD, tok_x, axis=0))
        prev_xD = jnp.where(own_xn[..., i, None], own_emb_xD.astype(prev_xD.dtype), prev_xD)
      hint = None if hint_xn is None else jax.tree.map(lambda a: a[..., i], hint_xn)
      s_xD = self.recur(s_xD, prev_xD, hint, embed_VD)
      out.append(self.logits(h_xD, s_xD, hint, memory))
    return jnp.stack(out, axis=-2)


def restrict_vocab(drafter: Drafter, size: int) -> Drafter:
  """A copy of ``drafter`` whose head scores only the ``size`` top-ranked tokens.

  ``size`` of 0 or >= V returns ``drafter`` unchanged. The copy's log-probs are over those tokens
  (renormalised), and ``vocab_ids`` maps its output rows back to token ids.
  """
  V = drafter.config.vocab_size
  if size <= 0 or size >= V:
    return drafter
  if drafter.vocab_ids is not None:
    raise ValueError("drafter vocabulary is already restricted")
  out = nnx.clone(drafter)
  ids_R = jnp.asarray(drafter.token_ranking[...][:size], jnp.int32)
  head = out.lm_head[-1]
  head.kernel = nnx.Param(jnp.take(head.kernel[...], ids_R, axis=1))
  out.vocab_ids = nnx.Variable(ids_R)
  return out


def init_head_from_llm(drafter: Drafter, out_VD, vocab_ids_R=None) -> None:
  """Start ``drafter``'s head from the LLM's own output projection ``out_VD`` (in place).

  Like Medusa's heads, a fresh drafter then scores tokens with the LLM's vocabulary geometry
  (at step 1 it reproduces the LLM's rank-C logits ``out_VD @ h``) instead of a random matrix,
  which matters when the distillation data is small. With ``input_proj`` (C != 2D) the h half
  of ``input_proj`` projects onto the top-C right singular vectors ``U_DC`` of ``out_VD``
  (restricted to the rows ``vocab_ids_R`` when given) and the head is ``(out_VD @ U_DC)^T``;
  the state half keeps its random init. Without ``input_proj`` the head's h rows are
  ``out_VD^T`` and its state rows start at zero. ResBlocks are zero-initialised (identity).
  """
  cfg = drafter.config
  D, C = cfg.hidden_size, cfg.exit_dim
  out_VD = np.asarray(out_VD, np.float32)
  if out_VD.shape != (cfg.vocab_size, D):
    raise ValueError(f"LLM output projection has shape {out_VD.shape}, the drafter needs "
                     f"{(cfg.vocab_size, D)}")
  head = drafter.lm_head[-1]
  dtype = head.kernel[...].dtype
  if cfg.has_input_proj:
    rows_RD = out_VD if vocab_ids_R is None else out_VD[np.asarray(vocab_ids_R)]
    _, _, vt_DD = np.linalg.svd(rows_RD, full_matrices=False)
    u_DC = np.zeros((D, C), np.float32)
    k = min(C, vt_DD.shape[0])
    u_DC[:, :k] = vt_DD[:k].T
    kernel = np.array(drafter.input_proj.kernel[...], np.float32)
    kernel[:D] = u_DC
    drafter.input_proj.kernel.set_value(jnp.asarray(kernel, dtype))
    drafter.input_proj.bias.set_value(jnp.zeros_like(drafter.input_proj.bias[...]))
    head.kernel.set_value(jnp.asarray((out_VD @ u_DC).T, dtype))
  else:
    head.kernel.set_value(jnp.asarray(
        np.concatenate([out_VD.T, np.zeros((D, cfg.vocab_size), np.float32)]), dtype))


def reference_top_k_cut(logits_xV: jax.Array, k: int) -> jax.Array:
  """The reference's cut: subtract the row max, keep the top-k logits, set the rest to -5e4."""
  logits_xV = logits_xV - jnp.max(logits_xV, axis=-1, keepdims=True)
  kth_x1 = jax.lax.top_k(logits_xV, k)[0][..., -1:]
  return jnp.where(logits_xV >= kth_x1, logits_xV, REFERENCE_CUT_VALUE)


def init_drafter(cfg: DrafterConfig, *, seed: int = 0, dtype=jnp.float32) -> Drafter:
  return Drafter(cfg, dtype=dtype, rngs=nnx.Rngs(seed))


def with_matmul_dtype(drafter: Drafter, matmul_dtype) -> Drafter:
  """``drafter`` (same parameters, same state) whose layers multiply in ``matmul_dtype``
  (``Drafter``'s argument; None: its own dtype). Training builds the step's drafter this way
  (``train.matmul_dtype``); what it saves, evaluates and decodes with stays the plain one."""
  out = nnx.eval_shape(lambda: Drafter(drafter.config, dtype=drafter.dtype,
                                       matmul_dtype=matmul_dtype, rngs=nnx.Rngs(0)))
  nnx.update(out, nnx.state(drafter))
  return out


def abstract_drafter(cfg: DrafterConfig, *, dtype=jnp.float32) -> Drafter:
  """Shape-only parameters to load weights into; the token ranking defaults to id order."""
  drafter = nnx.eval_shape(lambda: Drafter(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
  drafter.token_ranking = TokenRanking(jnp.arange(cfg.vocab_size, dtype=jnp.int32))
  return drafter
