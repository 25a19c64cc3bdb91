"""One ReDrafter step, as pure functions of the models and an explicit state (static shapes):

  1. draft   beam search over the drafter from (h, g0)                       -> beams [B, W, L]
             (+ one beam copied from the context when ``cfg.lookup_ngram``: ``lookup``)
  2. pack    de-duplicate prefixes into a tree of N slots                     -> tokens, mask
  3. verify  one LLM forward over the N tree tokens against the cache        -> logits, hidden
  4. accept  the acceptance rule picks a path and the next token g0
  5. commit  move the accepted path's K/V into place (a gather of <= L slots) and advance

Rows finish independently: a finished row stops emitting and committing at once; its slot keeps
computing (masked) until the whole batch is done. ``decode.ReDrafter`` runs ``init`` once and
``step`` in a ``lax.while_loop``; the serving engine and the benchmarks drive the pieces directly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from redrafter_jax.config import DecodeConfig
from redrafter_jax.inference import lookup, sampling
from redrafter_jax.inference import tree as tree_lib
from redrafter_jax.inference import verify as verify_lib
from redrafter_jax.inference.beam_search import (BeamOutput, attends_to_context, beam_search,
                                                 copy_ngram_of)
from redrafter_jax.inference.runtime import (Output, at_last, empty_output, forward_for_drafter,
                                            prefill, record)
from redrafter_jax.models import kv_cache as kvc
from redrafter_jax.models.context_attention import MemoryCache
from redrafter_jax.models.drafter import Drafter
from redrafter_jax.models.invariant import tree_keys
from redrafter_jax.models.llama import Llama


@struct.dataclass
class Metrics:
  """Per-row counters, updated only while the row is active."""

  steps_B: jax.Array  # verification steps
  accepted_B: jax.Array  # drafted tokens accepted in total
  accept_hist_BL: jax.Array  # steps by number of accepted drafted tokens (0 .. L-1)
  tree_tokens_B: jax.Array  # packed tree tokens (<= N) summed over steps
  unique_tokens_B: jax.Array  # unique tree nodes before the budget cut, summed
  beam_tokens_B: jax.Array  # W * L summed over steps (before de-duplication)
  # Accepted drafted tokens by the source of the beam that held the accepted path (columns:
  # ``SOURCES``); a path that a drafter beam holds counts as the drafter's even where the lookup
  # beam or an alternative held it too, so a column counts only what that source added.
  accepted_by_source_BK: jax.Array

  @classmethod
  def zeros(cls, batch: int, beam_length: int) -> "Metrics":
    z = jnp.zeros((batch,), jnp.int32)
    return cls(z, z, jnp.zeros((batch, beam_length), jnp.int32), z, z, z,
               jnp.zeros((batch, len(SOURCES)), jnp.int32))


# Where a beam of the tree comes from: the drafter's beam search, the context lookup
# (``with_lookup_beam``) or a step-1 alternative (``with_first_alternatives``).
SOURCES = ("drafter", "lookup", "alternative")
DRAFTER, LOOKUP, ALTERNATIVE = range(len(SOURCES))


def beam_sources(cfg: DecodeConfig) -> tuple[int, ...]:
  """The source of each beam that ``draft`` puts in the tree, in its order."""
  return ((DRAFTER,) * cfg.beam_width + (LOOKUP,) * bool(cfg.lookup_ngram)
          + (ALTERNATIVE,) * cfg.first_alternatives)


def winning_source(tree: tree_lib.Tree, verdict: verify_lib.Verdict,
                   sources: tuple[int, ...]) -> jax.Array:
  """``[B, len(SOURCES)]`` one-hot: the first source (in ``SOURCES`` order) with a beam that
  holds the accepted path; all zeros where no drafted token was accepted. ``sources``: each
  beam's (``beam_sources``)."""
  node_BWL = tree.node_BWL
  W = node_BWL.shape[1]
  if len(sources) != W:
    raise ValueError(f"{len(sources)} beam sources for a tree of {W} beams")
  num_B = verdict.num_accepted_B
  at_end_BW = jnp.take_along_axis(node_BWL, num_B[:, None, None], axis=2)[:, :, 0]
  holds_BW = (at_end_BW == verdict.end_slot_B[:, None]) & (num_B[:, None] > 0)
  of_BWK = jnp.asarray(sources)[None, :, None] == jnp.arange(len(SOURCES))[None, None, :]
  held_BK = (holds_BW[:, :, None] & of_BWK).any(axis=1)
  first_BK = held_BK & (jnp.cumsum(held_BK, axis=1) == 1)
  return first_BK.astype(jnp.int32)


@struct.dataclass
class DecodeState:
  cache: kvc.KVCache
  g0_B: jax.Array  # the LLM's newest token, not yet in the cache (the beams' root)
  # LLM hidden state at the last committed token (the drafter's context); for a drafter with
  # ``feature_layers``, the normed states of those layers there, concatenated ([B, k*D]).
  h_BD: jax.Array
  context_BS: jax.Array  # token at each position: prompt, committed tokens, g0 at cache length
  out: Output
  done_B: jax.Array
  rng: jax.Array
  metrics: Metrics
  # The context-attention memory of a drafter with ``context_attention`` (None for others):
  # keys and values at every committed position, kept by ``remember``.
  memory: MemoryCache | None = None


def init(llm: Llama, tokens_BT, lengths_B, params: sampling.SamplingParams, rng, stop_ids, *,
         cache_size: int, max_new_tokens: int, beam_length: int, filtered: bool,
         greedy: bool = False, feature_layers: tuple[int, ...] = (),
         drafter: Drafter | None = None) -> DecodeState:
  """Prefill the prompts and choose each row's first token. ``feature_layers``: the drafter's
  (``drafter_layers``), whose states the state carries as ``h``. ``drafter``: needed for a
  drafter with ``context_attention``, whose memory of the prompt the state then carries."""
  B, T = tokens_BT.shape
  cache = llm.init_cache(B, cache_size)
  attends = attends_to_context(drafter)
  logits_BV, h_BD, cache = prefill(llm, tokens_BT, lengths_B, cache, feature_layers,
                                   every_position=attends)
  if attends:
    feats_BTX = h_BD
    h_BD = at_last(feats_BTX, lengths_B)
  rng, key = jax.random.split(rng)
  if greedy:
    g0_B = sampling.greedy_tokens(logits_BV)
  else:
    g0_B = sampling.sample(key, sampling.target_logprobs(logits_BV, params, filtered=filtered))
  out, done_B = record(empty_output(B, max_new_tokens), jnp.zeros((B,), bool), g0_B[:, None],
                       jnp.ones((B,), jnp.int32), stop_ids, max_new_tokens)
  context_BS = start_context(tokens_BT, lengths_B, g0_B, cache_size)
  memory = None
  if attends:
    memory = start_memory(drafter, llm.embed_tokens.embedding[...], feats_BTX, context_BS,
                          lengths_B)
  return DecodeState(cache, g0_B, h_BD, context_BS, out, done_B, rng,
                     Metrics.zeros(B, beam_length), memory)


def start_memory(drafter: Drafter, embed_VD, feats_BTX, context_BS, lengths_B) -> MemoryCache:
  """The memory of the prompts: an entry at each prompt position (the last one's follower is
  g0, at ``length`` in ``context_BS``), in a buffer of the context's size."""
  B, T, _ = feats_BTX.shape
  S = context_BS.shape[1]
  h_BTD = jnp.pad(drafter.context(feats_BTX), ((0, 0), (0, 1), (0, 0)))
  tokens_BT = jnp.pad(context_BS, ((0, 0), (0, 1)))[:, :T + 1]
  keys_BTA, values_BTA = drafter.memory_over(h_BTD, tokens_BT, embed_VD)
  memory = MemoryCache.zeros(B, S, drafter.config.context_attention, keys_BTA.dtype)
  return memory.write(jnp.zeros_like(lengths_B), keys_BTA[:, :T], values_BTA[:, :T], lengths_B)


def remember(drafter: Drafter, embed_VD, memory: MemoryCache, start_B, context_BS, feats_BNX,
             count_B) -> MemoryCache:
  """``memory`` with the entries of newly committed positions ``start + i``, ``i < count``:
  from the LLM's features there (``feats_BNX[:, i]``) and the tokens there and after them (in
  ``context_BS``, which already holds the new tokens)."""
  N = feats_BNX.shape[1]
  S = context_BS.shape[1]
  idx_BN1 = jnp.minimum(start_B[:, None] + jnp.arange(N + 1)[None], S - 1)
  tokens_BN1 = jnp.take_along_axis(context_BS, idx_BN1, axis=1)
  keys_BNA, values_BNA = drafter.memory_entries(
      drafter.context(feats_BNX), jnp.take(embed_VD, tokens_BN1[:, :N], axis=0),
      jnp.take(embed_VD, tokens_BN1[:, 1:], axis=0))
  return memory.write(start_B, keys_BNA, values_BNA, count_B)


def drafter_layers(drafter) -> tuple[int, ...]:
  """The LLM layers whose states ``drafter`` reads (``DrafterConfig.feature_layers``; empty: the
  last hidden state only, also for drafters without a config, such as the tests' oracles)."""
  return tuple(getattr(getattr(drafter, "config", None), "feature_layers", ()) or ())


def start_context(tokens_BT, lengths_B, g0_B, size: int) -> jax.Array:
  """The prompt tokens then g0 at position ``length``, in ``size`` positions."""
  context_BS = jnp.zeros((tokens_BT.shape[0], size), jnp.int32)
  context_BS = context_BS.at[:, :tokens_BT.shape[1]].set(tokens_BT.astype(jnp.int32))
  return lookup.write(context_BS, lengths_B, g0_B[:, None], jnp.ones_like(lengths_B))


def draft(llm: Llama, drafter: Drafter, state: DecodeState, cfg: DecodeConfig,
          embed_VD: jax.Array | None = None) -> tuple[BeamOutput, tree_lib.Tree]:
  """Beams from the drafter (and the context lookup, when on), packed into a tree.

  ``embed_VD``: the LLM's input embedding table for the drafter to read (default: the LLM's
  own). A program that runs one step per call should pass it in the activations' dtype when
  the weights are narrower: XLA converts the whole table before the beam-search loop, so a bf16
  table costs a full conversion per call.
  Any NNX module with a ``propose(llm, state, cfg) -> BeamOutput`` method can stand in for the
  drafter: the tests use an oracle that proposes the true continuation with planted errors.
  """
  if hasattr(drafter, "propose"):
    beams = drafter.propose(llm, state, cfg)
  else:
    embed_VD = llm.embed_tokens.embedding[...] if embed_VD is None else embed_VD
    # A drafter with the copy hint reads the committed context (others need no cache here).
    context = (dict(context_BS=state.context_BS, length_B=state.cache.lengths_B)
               if copy_ngram_of(drafter) else {})
    if attends_to_context(drafter):
      if state.memory is None:
        raise ValueError("a drafter with context_attention needs the state's memory: start "
                         "the state with init(..., drafter=drafter)")
      context["memory"] = state.memory.read(state.cache.lengths_B)
    beams = beam_search(drafter, embed_VD, drafter.context(state.h_BD), state.g0_B,
                        beam_width=cfg.beam_width, beam_length=cfg.beam_length,
                        return_full=cfg.acceptance == "reference",
                        first_k=cfg.first_alternatives, **context)
  first = (beams.first_BK, beams.first_logp_BK)
  if cfg.lookup_ngram:
    beams = with_lookup_beam(beams, state, cfg.lookup_ngram)
  if cfg.first_alternatives:
    if first[0] is None:
      raise ValueError(f"{type(drafter).__name__}.propose returned no step-1 alternatives "
                       "(BeamOutput.first_BK), which first_alternatives needs")
    beams = with_first_alternatives(beams, *first)
  prefix_logp_BWL = jnp.pad(jnp.cumsum(beams.logp_BWJ, axis=2), ((0, 0), (0, 0), (1, 0)))
  return beams, tree_lib.pack(beams.beams_BWL, cfg.num_tree_tokens, prefix_logp_BWL)


def with_lookup_beam(beams: BeamOutput, state: DecodeState, max_ngram: int) -> BeamOutput:
  """Append the context-lookup beam as beam W. Its drafted tokens get log-prob 0, so the tree
  packs it first (a copy that matches is usually right); with no match it repeats beam 0 and
  de-duplicates to nothing."""
  beam_BL, _ = lookup.lookup_beam(state.context_BS, state.cache.lengths_B, beams.beams_BWL[:, 0],
                                  max_ngram=max_ngram)
  B, _, J = beams.logp_BWJ.shape
  return BeamOutput(beams_BWL=jnp.concatenate([beams.beams_BWL, beam_BL[:, None]], axis=1),
                    logp_BWJ=jnp.concatenate([beams.logp_BWJ, jnp.zeros((B, 1, J))], axis=1),
                    score_BW=jnp.concatenate([beams.score_BW, jnp.zeros((B, 1))], axis=1))


def with_first_alternatives(beams: BeamOutput, first_BK, first_logp_BK) -> BeamOutput:
  """Append each step-1 alternative as a beam ``[g0, token]`` that ends there (its later
  positions hold -1, which ``tree.pack`` leaves out). Where a kept beam starts with the same
  token the alternative de-duplicates to nothing; the others cost one tree token each."""
  B, W, L = beams.beams_BWL.shape
  K = first_BK.shape[1]
  alt_BKL = jnp.full((B, K, L), -1, jnp.int32)
  alt_BKL = alt_BKL.at[:, :, 0].set(beams.beams_BWL[:, :1, 0]).at[:, :, 1].set(first_BK)
  logp_BKJ = jnp.zeros((B, K, L - 1), jnp.float32).at[:, :, 0].set(first_logp_BK)
  return beams.replace(beams_BWL=jnp.concatenate([beams.beams_BWL, alt_BKL], axis=1),
                       logp_BWJ=jnp.concatenate([beams.logp_BWJ, logp_BKJ], axis=1),
                       score_BW=jnp.concatenate([beams.score_BW, first_logp_BK], axis=1),
                       full_logp_BWJV=None)


def verify_forward(llm: Llama, state: DecodeState, tree: tree_lib.Tree,
                   width: int | None = None, layers: tuple[int, ...] = ()):
  """One LLM forward over the packed tree; its K/V land in the cache's scratch slots.

  ``width`` (static; None: the whole cache) is how many cache slots attention reads: a context
  bucket (``kv_cache.context_bucket``) holding every row's committed tokens and the N new ones.
  An invariant model (``Llama(invariant=True)``) reads each tree token's keys in the positions
  an AR step would (``invariant.tree_keys``), so its logits are AR's bit for bit.
  ``layers`` (a multi-layer drafter's, ``drafter_layers``): the second output is those layers'
  states (``Llama.forward_layers``) instead of the last hidden state.
  """
  cache = state.cache
  positions_BN = cache.lengths_B[:, None] + tree.depth_BN
  virtual = None
  if getattr(llm, "invariant", False):
    virtual, mask_BNS = tree_keys(cache.lengths_B, tree.depth_BN, tree.mask_BNN,
                                  width or cache.size)
  else:
    mask_BNS = kvc.visible_mask(cache.lengths_B, tree.mask_BNN, width or cache.size)
  hidden_BND, feats_BNX, cache = forward_for_drafter(llm, tree.tokens_BN, positions_BN, mask_BNS,
                                                     cache, layers, virtual)
  return llm.logits(hidden_BND), feats_BNX, cache


def per_row_keys(rng) -> bool:
  """Whether ``rng`` holds one key per row (the server: a request's draws must not depend on
  which other requests share its batch) rather than one key for the whole batch."""
  return jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key) and rng.ndim == 1


def accept(rng, beams: BeamOutput, tree: tree_lib.Tree, logits_BNV,
           params: sampling.SamplingParams, cfg: DecodeConfig, filtered: bool,
           greedy: bool = False) -> verify_lib.Verdict:
  """The acceptance rule of ``cfg``. ``greedy`` (static: every row has temperature 0) takes the
  argmax walk, which is what every rule does for greedy rows, without drawing random numbers;
  so does ``cfg.acceptance == "greedy"`` (whose callers admit temperature 0 only)."""
  if greedy or cfg.acceptance == "greedy":
    return verify_lib.verify_greedy(tree, logits_BNV, beam_length=cfg.beam_length)
  # The target distribution of every tree slot, for all rows in one batched pass (outside the
  # per-row vmap below, where the top-k/top-p filter's candidate shortcut would turn into
  # running both of its branches).
  logp_BNV = sampling.target_logprobs(logits_BNV, params, filtered=filtered)
  if per_row_keys(rng):  # each row decides alone, as a batch of one with its own key
    def row(key, one_row):
      b, t, logp_1NV = jax.tree.map(lambda x: x[None], one_row)
      return jax.tree.map(lambda x: x[0], _sampled_rule(key, b, t, logp_1NV, cfg))
    return jax.vmap(row)(rng, (beams, tree, logp_BNV))
  return _sampled_rule(rng, beams, tree, logp_BNV, cfg)


def _sampled_rule(rng, beams: BeamOutput, tree: tree_lib.Tree, logp_BNV,
                  cfg: DecodeConfig) -> verify_lib.Verdict:
  if cfg.acceptance == "typical":
    return verify_lib.verify_typical(rng, tree, beams, logp_BNV, eps=cfg.typical_eps,
                                     delta=cfg.typical_delta)
  if cfg.acceptance == "reference":
    return verify_lib.verify_reference(rng, tree, beams, logp_BNV)
  return verify_lib.verify_exact(rng, tree, logp_BNV, beam_length=cfg.beam_length)


def commit(state: DecodeState, cache: kvc.KVCache, verdict: verify_lib.Verdict, hidden_BND,
           tree: tree_lib.Tree, stop_ids, cfg: DecodeConfig) -> DecodeState:
  """Keep the accepted path: cache, next (h, g0), output tokens and metrics of active rows.
  ``cfg``: the settings ``draft`` built ``tree`` with (its beams' sources, for the metrics, and
  ``max_new_tokens``)."""
  active_B = ~state.done_B
  count_B = verdict.num_accepted_B + 1
  cache = kvc.commit(cache, verdict.path_BA, jnp.where(active_B, count_B, 0))
  h_BD = jnp.take_along_axis(hidden_BND, verdict.end_slot_B[:, None, None], axis=1)[:, 0]
  next_B = jax.vmap(lambda t, n: t[n])(verdict.tokens_BA, verdict.num_accepted_B)
  out, done_B = record(state.out, state.done_B, verdict.tokens_BA, count_B, stop_ids,
                       cfg.max_new_tokens)
  context_BS = lookup.write(state.context_BS, state.cache.lengths_B + 1, verdict.tokens_BA,
                            jnp.where(active_B, count_B, 0))
  m = state.metrics
  on = active_B.astype(jnp.int32)
  L = m.accept_hist_BL.shape[1]
  W = tree.node_BWL.shape[1]
  metrics = Metrics(
      steps_B=m.steps_B + on,
      accepted_B=m.accepted_B + on * verdict.num_accepted_B,
      accept_hist_BL=m.accept_hist_BL + on[:, None] * jax.nn.one_hot(
          verdict.num_accepted_B, L, dtype=jnp.int32),
      tree_tokens_B=m.tree_tokens_B + on * jnp.minimum(tree.num_unique_B, tree.size),
      unique_tokens_B=m.unique_tokens_B + on * tree.num_unique_B,
      beam_tokens_B=m.beam_tokens_B + on * (W * L),
      accepted_by_source_BK=m.accepted_by_source_BK + (on * verdict.num_accepted_B)[:, None]
      * winning_source(tree, verdict, beam_sources(cfg)))
  keep = lambda new, old: jnp.where(active_B.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
  return DecodeState(cache=cache, g0_B=keep(next_B, state.g0_B), h_BD=keep(h_BD, state.h_BD),
                     context_BS=context_BS, out=out.replace(steps=out.steps + 1), done_B=done_B,
                     rng=state.rng, metrics=metrics)


def step(llm: Llama, drafter: Drafter, state: DecodeState, params: sampling.SamplingParams,
         stop_ids, cfg: DecodeConfig, *, filtered: bool, greedy: bool = False,
         width: int | None = None, embed_VD: jax.Array | None = None) -> DecodeState:
  """One draft -> verify -> accept -> commit. ``width`` (static): the context bucket the
  verify forward reads (see ``verify_forward``); the caller keeps every row within it.
  ``embed_VD``: the drafter's embedding table (see ``draft``)."""
  if per_row_keys(state.rng):
    keys_B2 = jax.vmap(jax.random.split)(state.rng)
    rng, key = keys_B2[:, 0], keys_B2[:, 1]
  else:
    rng, key = jax.random.split(state.rng)
  state = state.replace(rng=rng)
  beams, tree = draft(llm, drafter, state, cfg, embed_VD)
  logits_BNV, hidden_BND, cache = verify_forward(llm, state, tree, width,
                                                 drafter_layers(drafter))
  verdict = accept(key, beams, tree, logits_BNV, params, cfg, filtered, greedy)
  new = commit(state, cache, verdict, hidden_BND, tree, stop_ids, cfg)
  return remember_step(drafter, llm, embed_VD, state, new, verdict, hidden_BND)


def remember_step(drafter, llm: Llama, embed_VD, old: DecodeState, new: DecodeState,
                  verdict: verify_lib.Verdict, feats_BNX) -> DecodeState:
  """``new`` with the memory entries of the positions this step committed (the accepted path's
  slots; none for finished rows). A state without a memory is returned as it is."""
  if old.memory is None:
    return new
  embed_VD = llm.embed_tokens.embedding[...] if embed_VD is None else embed_VD
  path_feats_BAX = jnp.take_along_axis(feats_BNX, verdict.path_BA[:, :, None], axis=1)
  count_B = jnp.where(old.done_B, 0, verdict.num_accepted_B + 1)
  return new.replace(memory=remember(drafter, embed_VD, old.memory, old.cache.lengths_B,
                                     new.context_BS, path_feats_BAX, count_B))
