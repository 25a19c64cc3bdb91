"""Run an exported drafter with Apple's MLX: strict loading, the drafter in ``mlx.nn``, beam search.

This is the Apple-silicon path for a drafter trained here: ``redrafter-jax export --format mlx``
writes the reference layout, and this module loads it exactly as the reference's MLX code does
(``load_weights`` with ``strict=True``: the key set must match) and drafts with the same beam
search as ``redrafter_jax.inference.beam_search`` (DESIGN §5):

  * beam scores start at ``[0, -5e4, ..., -5e4]`` so step 1 grows W distinct children of beam 0;
  * each step takes the joint top-W over W x V of (beam score + token log-prob), no length
    normalisation;
  * ``beams_BWL`` holds g0 in column 0 (L counts g0: L - 1 drafted tokens), ``logp_BWJ`` the
    drafter's log-prob of each drafted token along its beam, ``score_BW`` the beam scores.

A multi-layer drafter (``feature_layers``, the ``redrafter-jax`` format: the reference's tensors
plus ``feature_proj.weight``) loads and runs too: ``beam_search`` then takes the LLM's
concatenated layer states ``[B, k*D]`` and projects them first, as ``Drafter.context`` does.
Apple's own MLX code cannot run it (it has no ``feature_proj``). So does a drafter with the copy
hint (``copy_ngram``): ``beam_search`` then also takes the committed tokens and their lengths,
and finds each beam's hint over them and the beam's own drafted tokens with the function JAX
decoding uses (``context_copy.beam_hints``). So does a drafter with the context attention
(``context_attention``): ``beam_search`` then also takes the LLM's features at every committed
position (``context_feats_BSX``), builds the memory from them and the committed tokens, and each
step's query reads the positions below the row's length (``models/context_attention.py``).

Ties in the top-W are broken arbitrarily (MLX's partition), unlike ``lax.top_k``'s lowest index.
``mlx`` is imported inside functions, so the package imports without it (``pip install
redrafter_jax[mlx]``; ``mlx[cpu]`` on Linux). Smoke run::

  python -m redrafter_jax.weights.mlx_runtime --drafter DIR [--llm smollm2-135m --prompt "Hi"]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import pathlib
import sys
import time

import numpy as np

from redrafter_jax.config import DrafterConfig
from redrafter_jax.models.context_copy import beam_hints
from redrafter_jax.models.drafter import REFERENCE_CUT_VALUE
from redrafter_jax.weights import drafter_io
from redrafter_jax.weights.naming import WeightsError

log = logging.getLogger(__name__)


def _mlx():
  try:
    import mlx.core as mx
    import mlx.nn as nn
  except ImportError as e:
    raise ImportError("the MLX runner needs the mlx package: pip install 'redrafter_jax[mlx]'"
                      ) from e
  return mx, nn


@functools.cache
def _drafter_class():
  """The ``mlx.nn`` drafter class (built on first use so that importing needs no mlx)."""
  mx, nn = _mlx()

  class ResBlock(nn.Module):

    def __init__(self, dim: int):
      super().__init__()
      self.linear = nn.Linear(dim, dim, bias=True)

    def __call__(self, x):
      return x + nn.silu(self.linear(x))

  class MLXDrafter(nn.Module):
    """The ReDrafter head in MLX; attribute names give the reference's safetensors keys."""

    def __init__(self, cfg: DrafterConfig):
      super().__init__()
      D, C, V = cfg.hidden_size, cfg.exit_dim, cfg.vocab_size
      self.config = cfg
      if cfg.has_input_proj:
        self.input_proj = nn.Linear(2 * D, C, bias=True)
      self.lm_head = [ResBlock(C) for _ in range(cfg.num_draft_layers)] + [
          nn.Linear(C, V, bias=False)]
      if cfg.rnn:
        self.rnn_u = nn.Linear(D, D, bias=True)
        self.rnn_w = nn.Linear(D, D, bias=False)
      if cfg.feature_layers:
        self.feature_proj = nn.Linear(cfg.context_width, D, bias=False)
      if cfg.copy_ngram:
        self.copy_w = nn.Linear(D, D, bias=False)
        self.copy_length = nn.Embedding(cfg.copy_ngram + 1, D)
        self.copy_gate = nn.Linear(C, cfg.copy_ngram + 1, bias=True)
      if cfg.context_attention:
        A = cfg.context_attention
        self.ctx_key = nn.Linear(2 * D, A, bias=False)
        self.ctx_value = nn.Linear(2 * D, A, bias=False)
        self.ctx_query = nn.Linear(2 * D, A, bias=False)
        self.ctx_out = nn.Linear(A, C, bias=False)

    @property
    def dtype(self):
      return self.lm_head[-1].weight.dtype

    def init_state(self, h_xD):
      return mx.zeros(h_xD.shape, self.dtype)

    def context(self, feats_xX):
      """h from the LLM's features: as is, or ``feature_proj`` of the layer states."""
      if not self.config.feature_layers:
        return feats_xX
      return self.feature_proj(feats_xX.astype(self.dtype))

    def recur(self, s_xD, prev_emb_xD, hint=None):
      """``hint``: ``(token_x, length_x, embedding of token_x)`` for a copy-hint drafter."""
      prev_emb_xD = prev_emb_xD.astype(self.dtype)
      extra = 0.0
      if self.config.copy_ngram:
        token_x, length_x, emb_xD = hint
        on_x1 = (length_x > 0)[..., None].astype(self.dtype)
        extra = self.copy_w(emb_xD.astype(self.dtype) * on_x1) + self.copy_length(length_x)
      if self.config.rnn:
        return nn.silu(self.rnn_w(prev_emb_xD) + self.rnn_u(s_xD.astype(self.dtype)) + extra)
      return prev_emb_xD + s_xD.astype(self.dtype) + extra

    def memory_over(self, h_BSD, tokens_BS, next_BS, embed_VD):
      """The context attention's keys and values ``[B, S, A]``: from h, the token at each
      position and the one after it."""
      h_BSD = h_BSD.astype(self.dtype)
      emb = lambda t: mx.take(embed_VD, t, axis=0).astype(self.dtype)
      return (self.ctx_key(mx.concatenate([h_BSD, emb(tokens_BS)], axis=-1)),
              self.ctx_value(mx.concatenate([h_BSD, emb(next_BS)], axis=-1)))

    def read_context(self, h_BWD, s_BWD, memory):
      """What each beam's state reads of ``memory = (keys_BSA, values_BSA, visible_BS)``."""
      keys_BSA, values_BSA, visible_BS = memory
      B, W, _ = h_BWD.shape
      S, A = keys_BSA.shape[1:]
      H = self.config.context_heads
      d = A // H
      q_BWA = self.ctx_query(mx.concatenate([h_BWD.astype(self.dtype), s_BWD.astype(self.dtype)],
                                            axis=-1)).astype(mx.float32)
      heads = lambda x, n: x.astype(mx.float32).reshape(B, n, H, d).transpose(0, 2, 1, 3)
      q_BHWd, k_BHSd, v_BHSd = heads(q_BWA, W), heads(keys_BSA, S), heads(values_BSA, S)
      score_BHWS = (q_BHWd @ k_BHSd.transpose(0, 1, 3, 2)) / float(np.sqrt(d))
      seen_B11S = visible_BS[:, None, None, :]
      score_BHWS = mx.where(seen_B11S, score_BHWS, -1e30)
      weight_BHWS = mx.softmax(score_BHWS, axis=-1) * seen_B11S
      read_BWA = (weight_BHWS @ v_BHSd).transpose(0, 2, 1, 3).reshape(B, W, A)
      return self.ctx_out(read_BWA.astype(self.dtype))

    def logits(self, h_xD, s_xD, hint=None, memory=None):
      x = mx.concatenate([h_xD.astype(self.dtype), s_xD.astype(self.dtype)], axis=-1)
      if self.config.has_input_proj:
        x = self.input_proj(x)
      if self.config.context_attention:
        x = x + self.read_context(h_xD, s_xD, memory)
      for layer in self.lm_head[:-1]:
        x = layer(x)
      logits_xV = self.lm_head[-1](x).astype(mx.float32)
      if not self.config.copy_ngram:
        return logits_xV
      token_x, length_x, _ = hint
      gate_x = mx.take_along_axis(self.copy_gate(x).astype(mx.float32), length_x[..., None],
                                  axis=-1)[..., 0]
      gate_x = mx.where(length_x > 0, gate_x, 0.0)
      at_xV = mx.arange(logits_xV.shape[-1]) == token_x[..., None]
      return logits_xV + mx.where(at_xV, gate_x[..., None], 0.0)

    def log_probs(self, h_xD, s_xD, hint=None, memory=None):
      logits_xV = self.logits(h_xD, s_xD, hint, memory)
      k = self.config.logit_top_k
      if k is not None:
        # The reference's cut: subtract the row max, keep the top-k, the rest to -5e4.
        logits_xV = logits_xV - mx.max(logits_xV, axis=-1, keepdims=True)
        kth_x1 = mx.min(mx.topk(logits_xV, min(k, logits_xV.shape[-1]), axis=-1), axis=-1,
                        keepdims=True)
        logits_xV = mx.where(logits_xV >= kth_x1, logits_xV, REFERENCE_CUT_VALUE)
      return logits_xV - mx.logsumexp(logits_xV, axis=-1, keepdims=True)

    def step(self, h_xD, s_xD, prev_emb_xD, hint=None, memory=None):
      """One draft step: ``(log_probs_xV, new_state_xD)``."""
      s_xD = self.recur(s_xD, prev_emb_xD, hint)
      return self.log_probs(h_xD, s_xD, hint, memory), s_xD

  return MLXDrafter


def build_mlx_drafter(cfg: DrafterConfig):
  """An MLX drafter with fresh (random) weights: load real ones with ``load_weights``."""
  return _drafter_class()(cfg)


def load_mlx_drafter(path, *, dtype: str | None = None):
  """Load an MLX / reference drafter folder strictly: the file's keys must be exactly the
  drafter's. ``dtype`` (float32 | float16 | bfloat16) casts; None keeps the file's dtype."""
  mx, _ = _mlx()
  folder = pathlib.Path(path)
  if not (folder / "config.json").is_file():
    raise WeightsError(f"{folder}: no config.json (expected an MLX / reference drafter folder)")
  fmt, fields = drafter_io.read_config(folder)
  if fmt not in ("reference", "redrafter-jax"):
    raise WeightsError(f"{folder}: a {fmt} drafter; MLX loads the reference layout "
                       f"(redrafter-jax export --format mlx) or the redrafter-jax one")
  if fields.get(drafter_io.HEAD_ROWS_FIELD):
    raise WeightsError(f"{folder}: its head keeps only the draft vocabulary's rows "
                       f"({drafter_io.HEAD_ROWS_FIELD} in config.json), which MLX's strict "
                       f"loading (the reference's and ours) cannot take; write the full head "
                       f"with `redrafter-jax export --drafter {folder} --format "
                       f"{'mlx' if fmt == 'reference' else fmt} --out DIR`")
  weights_path = folder / drafter_io.WEIGHTS_FILE
  if not weights_path.is_file():
    raise WeightsError(f"{folder}: no {drafter_io.WEIGHTS_FILE}")
  try:
    weights = mx.load(str(weights_path))
  except (RuntimeError, ValueError) as e:
    raise WeightsError(f"{weights_path}: MLX cannot read it ({e})") from e
  fields.setdefault("rnn", "rnn_u.weight" in weights)  # as drafter_io.read_drafter does
  cfg = drafter_io.drafter_config(fields, folder / "config.json")
  if dtype is not None:
    target = getattr(mx, drafter_io.canonical_dtype(dtype))
    weights = {k: v.astype(target) for k, v in weights.items()}
  drafter = build_mlx_drafter(cfg)
  try:
    drafter.load_weights(list(weights.items()), strict=True)
  except ValueError as e:
    raise WeightsError(f"{weights_path}: does not match the drafter of config.json: "
                       f"{' '.join(str(e).split())}") from e
  mx.eval(drafter.parameters())
  return drafter


@dataclasses.dataclass(frozen=True)
class MLXBeamOutput:
  """Beam search result as ``mx.array``s (same fields as ``beam_search.BeamOutput``)."""

  beams_BWL: object  # int32, g0 in column 0
  logp_BWJ: object  # float32, log-prob of each drafted token along its beam
  score_BW: object  # float32, beam scores (sum of logp_BWJ, no length normalisation)


def beam_search(drafter, embed_VD, h_BD, g0_B, *, beam_width: int,
                beam_length: int, context_BS=None, length_B=None,
                context_feats_BSX=None) -> MLXBeamOutput:
  """Draft ``beam_width`` beams of ``beam_length`` tokens (g0 included) with MLX ops.

  ``embed_VD`` is the LLM's input embedding table, ``h_BD`` its last hidden state (after the
  final norm; for a drafter with ``feature_layers``, its concatenated layer states ``[B, k*D]``)
  and ``g0_B`` the token it chose; arrays may be NumPy or MLX. A drafter with ``copy_ngram``
  also needs ``context_BS`` (NumPy, the committed tokens with g0 at ``length_B``); one with
  ``context_attention`` needs them too, and the LLM's features (as ``h_BD``'s) at the first S
  positions of each row, ``context_feats_BSX``, S >= every length.
  """
  mx, _ = _mlx()
  W, L = beam_width, beam_length
  K = drafter.config.copy_ngram
  if K and (context_BS is None or length_B is None):
    raise ValueError(f"a drafter with copy_ngram={K} drafts from the context: pass context_BS "
                     "and length_B")
  attends = bool(drafter.config.context_attention)
  if attends and (context_BS is None or length_B is None or context_feats_BSX is None):
    raise ValueError("a drafter with context_attention drafts from the committed context: pass "
                     "context_BS, length_B and context_feats_BSX")
  if W < 1 or L < 2:
    raise ValueError(f"need beam_width >= 1 and beam_length >= 2, got {W}, {L}")
  embed_VD, h_BD = mx.array(embed_VD), mx.array(h_BD)
  g0_B = mx.array(g0_B).astype(mx.int32)
  B, X = h_BD.shape
  V = embed_VD.shape[0]
  if V != drafter.config.vocab_size or X != drafter.config.context_width:
    raise ValueError(f"embedding table [{V}, {embed_VD.shape[1]}] / hidden [{B}, {X}] do not "
                     f"fit the drafter (vocab_size={drafter.config.vocab_size}, "
                     f"hidden_size={drafter.config.hidden_size}, context width "
                     f"{drafter.config.context_width})")
  memory = None
  if attends:
    S = context_feats_BSX.shape[1]
    tokens_BS1 = np.pad(np.asarray(context_BS), ((0, 0), (0, 1)))[:, :S + 1]
    keys_BSA, values_BSA = drafter.memory_over(
        drafter.context(mx.array(context_feats_BSX)), mx.array(tokens_BS1[:, :S]),
        mx.array(tokens_BS1[:, 1:]), embed_VD)
    memory = (keys_BSA, values_BSA, mx.array(np.arange(S)[None] < np.asarray(length_B)[:, None]))
  h_BD = drafter.context(h_BD)
  D = h_BD.shape[-1]
  score_BW = mx.broadcast_to(
      mx.array([0.0] + [REFERENCE_CUT_VALUE] * (W - 1), mx.float32), (B, W))
  h_BWD = mx.broadcast_to(h_BD[:, None, :], (B, W, D))
  beams_BWl = mx.broadcast_to(g0_B[:, None, None], (B, W, 1))
  logp_BWl = mx.zeros((B, W, 0), mx.float32)
  s_BWD = drafter.init_state(h_BWD)
  for t in range(L - 1):
    hint = None
    if K:  # the hints JAX decoding reads, by the same function (its later columns unread)
      beams_BWL = np.zeros((B, W, L), np.int32)
      beams_BWL[:, :, :t + 1] = np.array(beams_BWl)
      found = beam_hints(np.asarray(context_BS), np.asarray(length_B), beams_BWL, t, K)
      tok_BW = mx.array(np.asarray(found.token_x))
      len_BW = mx.array(np.asarray(found.length_x))
      hint = (tok_BW, len_BW, mx.take(embed_VD, tok_BW, axis=0))
    logp_BWV, s_BWD = drafter.step(h_BWD, s_BWD, mx.take(embed_VD, beams_BWl[..., -1], axis=0),
                                   hint, memory)
    total_BU = (score_BW[..., None] + logp_BWV).reshape(B, W * V)
    # Top-W of W*V, sorted best first (as lax.top_k returns them).
    top_BW = mx.argpartition(-total_BU, kth=W - 1, axis=-1)[:, :W]
    order_BW = mx.argsort(-mx.take_along_axis(total_BU, top_BW, axis=-1), axis=-1)
    top_BW = mx.take_along_axis(top_BW, order_BW, axis=-1)
    score_BW = mx.take_along_axis(total_BU, top_BW, axis=-1)
    parent_BW1 = (top_BW // V)[..., None].astype(mx.int32)
    token_BW1 = (top_BW % V)[..., None].astype(mx.int32)
    chosen_BW1 = mx.take_along_axis(logp_BWV.reshape(B, W * V), top_BW, axis=-1)[..., None]
    beams_BWl = mx.concatenate([mx.take_along_axis(beams_BWl, parent_BW1, axis=1), token_BW1],
                               axis=-1)
    logp_BWl = mx.concatenate([mx.take_along_axis(logp_BWl, parent_BW1, axis=1), chosen_BW1],
                              axis=-1)
    s_BWD = mx.take_along_axis(s_BWD, parent_BW1, axis=1)
  mx.eval(beams_BWl, logp_BWl, score_BW)
  return MLXBeamOutput(beams_BWL=beams_BWl, logp_BWJ=logp_BWl, score_BW=score_BW)


# ---------------------------------------------------------------------------------------------
# Smoke entry point.


def _llm_inputs(source: str, prompt: str, layers=()):
  """Embedding table, the hidden states at every prompt position (or the states of
  ``layers``, ``[1, T, X]``), g0, the prompt's token ids and the tokenizer from a base LLM run
  in JAX."""
  import jax.numpy as jnp

  from redrafter_jax.models import kv_cache as kvc
  from redrafter_jax.weights import tokenizer as toks
  from redrafter_jax.weights.llama_weights import load_llama, resolve_source

  model, _ = load_llama(source)
  tok = toks.load_tokenizer(resolve_source(source))
  ids = toks.encode(tok, prompt, chat=True)
  tokens_BT = jnp.asarray([ids], jnp.int32)
  positions_BT = jnp.arange(len(ids))[None]
  mask_BTT = kvc.causal_mask(jnp.ones_like(tokens_BT, bool))
  logits_BTV, hidden_BTD, _ = model(tokens_BT, positions_BT, mask_BTT, None)
  if layers:
    _, hidden_BTD, _ = model.forward_layers(tokens_BT, positions_BT, mask_BTT, layers=layers)
  embed_VD = np.asarray(model.embed_tokens.embedding[...], np.float32)
  g0_B = np.asarray(jnp.argmax(logits_BTV[:, -1], axis=-1), np.int32)
  return embed_VD, np.asarray(hidden_BTD, np.float32), g0_B, ids, tok


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m redrafter_jax.weights.mlx_runtime",
                              description="Load an exported drafter in MLX and draft beams.")
  p.add_argument("--drafter", required=True, help="folder written by export --format mlx")
  p.add_argument("--llm", help="base model (name, GGUF or HF folder) for the embedding table and "
                 "hidden state; without it a random table and hidden state are used")
  p.add_argument("--prompt", default="Write a haiku about the sea.")
  p.add_argument("--beam-width", type=int, default=4)
  p.add_argument("--beam-length", type=int, default=5, help="tokens per beam, g0 included")
  p.add_argument("--dtype", choices=sorted(drafter_io.DTYPES), help="cast the weights")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
  try:
    drafter = load_mlx_drafter(args.drafter, dtype=args.dtype)
  except (WeightsError, ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  cfg = drafter.config
  tok = None
  if args.llm:
    embed_VD, feats_BTX, g0_B, ids, tok = _llm_inputs(args.llm, args.prompt, cfg.feature_layers)
  else:
    rng = np.random.default_rng(args.seed)
    embed_VD = rng.normal(size=(cfg.vocab_size, cfg.hidden_size)).astype(np.float32)
    ids = rng.integers(0, cfg.vocab_size, 8).tolist()
    feats_BTX = rng.normal(size=(1, len(ids), cfg.context_width)).astype(np.float32)
    g0_B = np.zeros((1,), np.int32)
  # What a drafter that reads its context needs: the prompt then g0, and the LLM's features.
  context = dict(context_BS=np.asarray([ids + [int(g0_B[0])]], np.int32),
                 length_B=np.asarray([len(ids)], np.int32), context_feats_BSX=feats_BTX)
  start = time.perf_counter()
  out = beam_search(drafter, embed_VD, feats_BTX[:, -1], g0_B, beam_width=args.beam_width,
                    beam_length=args.beam_length, **context)
  ms = 1e3 * (time.perf_counter() - start)
  beams, scores = np.array(out.beams_BWL)[0], np.array(out.score_BW)[0]
  print(f"drafted {args.beam_width} beams x {args.beam_length - 1} tokens in {ms:.1f} ms (MLX)")
  for w in range(args.beam_width):
    text = f"  {tok.decode(beams[w])!r}" if tok is not None else ""
    print(f"beam {w}: score {scores[w]:9.3f}  tokens {beams[w].tolist()}{text}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
