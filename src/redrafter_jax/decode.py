"""ReDrafter decoding: prefill, then a ``lax.while_loop`` of draft -> pack -> verify -> commit.

One step for every row at once (static shapes, no host sync):
  1. draft   beam search over the drafter from (h, g0)                       -> beams [B, W, L]
             (+ one beam copied from the context when ``cfg.lookup_ngram``: ``lookup``)
  2. pack    de-duplicate prefixes into a tree of N slots                     -> tokens, mask
  3. verify  one LLM forward over the N tree tokens against the cache        -> logits, hidden
  4. accept  the acceptance rule picks a path and the next token g0
  5. commit  move the accepted path's K/V into place (a gather of <= L slots) and advance
Rows finish independently: a finished row stops emitting and committing at once; its slot keeps
computing (masked) until the whole batch is done. ``decode_stepwise`` is the plain Python-loop
twin (same step function) used by tests and for debugging; ``init`` / ``step`` are the pieces
the serving engine and benchmarks drive directly.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from redrafter_jax import kv_cache as kvc
from redrafter_jax import lookup, sampling, tree as tree_lib, verify as verify_lib
from redrafter_jax.beam_search import BeamOutput, beam_search
from redrafter_jax.config import DecodeConfig
from redrafter_jax.generate import (GenerateError, Output, cache_size_for, check_sampling,
                                    empty_output, pack_prompts, prefill, record)
from redrafter_jax.models.drafter import Drafter, restrict_vocab
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

  @classmethod
  def zeros(cls, batch: int, beam_length: int) -> "Metrics":
    z = jnp.zeros((batch,), jnp.int32)
    return cls(z, z, jnp.zeros((batch, beam_length), jnp.int32), z, z, z)


@struct.dataclass
class DecodeState:
  cache: kvc.KVCache
  g0_B: jax.Array  # the LLM's newest token, not yet in the cache (the beams' root)
  h_BD: jax.Array  # LLM hidden state at the last committed token (the drafter's context)
  context_BS: jax.Array  # token at each position: prompt, committed tokens, g0 at cache length
  out: Output
  done_B: jax.Array
  rng: jax.Array
  metrics: Metrics


def init(llm: Llama, tokens_BT, lengths_B, params: sampling.SamplingParams, rng, stop_ids, *,
         cache_size: int, max_new_tokens: int, beam_length: int, filtered: bool,
         greedy: bool = False) -> DecodeState:
  """Prefill the prompts and choose each row's first token."""
  B = tokens_BT.shape[0]
  cache = llm.init_cache(B, cache_size)
  logits_BV, h_BD, cache = prefill(llm, tokens_BT, lengths_B, cache)
  rng, key = jax.random.split(rng)
  if greedy:
    g0_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  else:
    g0_B = sampling.sample(key, sampling.target_logprobs(logits_BV, params, filtered=filtered))
  out, done_B = record(empty_output(B, max_new_tokens), jnp.zeros((B,), bool), g0_B[:, None],
                       jnp.ones((B,), jnp.int32), stop_ids, max_new_tokens)
  context_BS = start_context(tokens_BT, lengths_B, g0_B, cache_size)
  return DecodeState(cache, g0_B, h_BD, context_BS, out, done_B, rng,
                     Metrics.zeros(B, beam_length))


def start_context(tokens_BT, lengths_B, g0_B, size: int) -> jax.Array:
  """The prompt tokens then g0 at position ``length``, in ``size`` positions."""
  context_BS = jnp.zeros((tokens_BT.shape[0], size), jnp.int32)
  context_BS = context_BS.at[:, :tokens_BT.shape[1]].set(tokens_BT.astype(jnp.int32))
  return lookup.write(context_BS, lengths_B, g0_B[:, None], jnp.ones_like(lengths_B))


def draft(llm: Llama, drafter: Drafter, state: DecodeState, cfg: DecodeConfig
          ) -> tuple[BeamOutput, tree_lib.Tree]:
  """Beams from the drafter (and the context lookup, when on), packed into a tree.

  Any NNX module with a ``propose(llm, state, cfg) -> BeamOutput`` method can stand in for the
  drafter: the tests use an oracle that proposes the true continuation with planted errors.
  """
  if hasattr(drafter, "propose"):
    beams = drafter.propose(llm, state, cfg)
  else:
    beams = beam_search(drafter, llm.embed_tokens.embedding[...], state.h_BD, state.g0_B,
                        beam_width=cfg.beam_width, beam_length=cfg.beam_length,
                        return_full=cfg.acceptance == "reference")
  if cfg.lookup_ngram:
    beams = with_lookup_beam(beams, state, cfg.lookup_ngram)
  prefix_logp_BWL = jnp.pad(jnp.cumsum(beams.logp_BWL1, axis=2), ((0, 0), (0, 0), (1, 0)))
  return beams, tree_lib.pack(beams.beams_BWL, cfg.num_tree_tokens, prefix_logp_BWL)


def with_lookup_beam(beams: BeamOutput, state: DecodeState, max_ngram: int) -> BeamOutput:
  """Append the context-lookup beam as beam W. Its drafted tokens get log-prob 0, so the tree
  packs it first (a copy that matches is usually right); with no match it repeats beam 0 and
  de-duplicates to nothing."""
  beam_BL, _ = lookup.lookup_beam(state.context_BS, state.cache.lengths_B, beams.beams_BWL[:, 0],
                                  max_ngram=max_ngram)
  B, _, L1 = beams.logp_BWL1.shape
  return BeamOutput(beams_BWL=jnp.concatenate([beams.beams_BWL, beam_BL[:, None]], axis=1),
                    logp_BWL1=jnp.concatenate([beams.logp_BWL1, jnp.zeros((B, 1, L1))], axis=1),
                    score_BW=jnp.concatenate([beams.score_BW, jnp.zeros((B, 1))], axis=1))


def verify_forward(llm: Llama, state: DecodeState, tree: tree_lib.Tree):
  """One LLM forward over the packed tree; its K/V land in the cache's scratch slots."""
  cache = state.cache
  positions_BN = cache.lengths_B[:, None] + tree.depth_BN
  mask_BNS = kvc.visible_mask(cache.lengths_B, tree.mask_BNN, cache.size)
  hidden_BND, cache = llm.forward_hidden(tree.tokens_BN, positions_BN, mask_BNS, cache)
  return llm.logits(hidden_BND), hidden_BND, cache


def per_row_keys(rng) -> bool:
  """Whether ``rng`` holds one key per row (the server: a request's draws must not depend on
  which other requests share its batch) rather than one key for the whole batch."""
  return jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key) and rng.ndim == 1


def accept(rng, beams: BeamOutput, tree: tree_lib.Tree, logits_BNV,
           params: sampling.SamplingParams, cfg: DecodeConfig, filtered: bool,
           greedy: bool = False) -> verify_lib.Verdict:
  """The acceptance rule of ``cfg``. ``greedy`` (static: every row has temperature 0) takes the
  argmax walk, which is what every rule does for greedy rows, without drawing random numbers."""
  if greedy:
    return verify_lib.verify_greedy(tree, logits_BNV, beam_length=cfg.beam_length)
  if per_row_keys(rng):  # each row decides alone, as a batch of one with its own key
    def row(key, one_row):
      b, t, logits_1NV, p = jax.tree.map(lambda x: x[None], one_row)
      return jax.tree.map(lambda x: x[0], accept(key, b, t, logits_1NV, p, cfg, filtered))
    return jax.vmap(row)(rng, (beams, tree, logits_BNV, params))
  if cfg.acceptance == "typical":
    return verify_lib.verify_typical(rng, tree, beams, logits_BNV, params, eps=cfg.typical_eps,
                                     delta=cfg.typical_delta, filtered=filtered)
  if cfg.acceptance == "reference":
    return verify_lib.verify_reference(rng, tree, beams, logits_BNV, params, filtered=filtered)
  return verify_lib.verify_exact(rng, tree, logits_BNV, params, beam_length=cfg.beam_length,
                                 filtered=filtered)


def commit(state: DecodeState, cache: kvc.KVCache, verdict: verify_lib.Verdict, hidden_BND,
           tree: tree_lib.Tree, stop_ids, *, max_new_tokens: int) -> DecodeState:
  """Keep the accepted path: cache, next (h, g0), output tokens and metrics of active rows."""
  active_B = ~state.done_B
  count_B = verdict.num_accepted_B + 1
  cache = kvc.commit(cache, verdict.path_BA, jnp.where(active_B, count_B, 0))
  h_BD = jnp.take_along_axis(hidden_BND, verdict.end_slot_B[:, None, None], axis=1)[:, 0]
  next_B = jax.vmap(lambda t, n: t[n])(verdict.tokens_BA, verdict.num_accepted_B)
  out, done_B = record(state.out, state.done_B, verdict.tokens_BA, count_B, stop_ids,
                       max_new_tokens)
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
      beam_tokens_B=m.beam_tokens_B + on * (W * L))
  keep = lambda new, old: jnp.where(active_B.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
  return DecodeState(cache=cache, g0_B=keep(next_B, state.g0_B), h_BD=keep(h_BD, state.h_BD),
                     context_BS=context_BS, out=out.replace(steps=out.steps + 1), done_B=done_B,
                     rng=state.rng, metrics=metrics)


def step(llm: Llama, drafter: Drafter, state: DecodeState, params: sampling.SamplingParams,
         stop_ids, cfg: DecodeConfig, *, filtered: bool, greedy: bool = False) -> DecodeState:
  if per_row_keys(state.rng):
    keys_B2 = jax.vmap(jax.random.split)(state.rng)
    rng, key = keys_B2[:, 0], keys_B2[:, 1]
  else:
    rng, key = jax.random.split(state.rng)
  state = state.replace(rng=rng)
  beams, tree = draft(llm, drafter, state, cfg)
  logits_BNV, hidden_BND, cache = verify_forward(llm, state, tree)
  verdict = accept(key, beams, tree, logits_BNV, params, cfg, filtered, greedy)
  return commit(state, cache, verdict, hidden_BND, tree, stop_ids,
                max_new_tokens=cfg.max_new_tokens)


TRACE_COUNT = {"decode": 0}  # incremented when the loop is traced: one trace per static shape


@functools.partial(jax.jit, static_argnames=("llm_def", "cfg", "cache_size", "filtered", "greedy"))
def _init_jit(llm_def, llm_state, tokens_BT, lengths_B, params, rng, stop_ids, *, cfg,
              cache_size, filtered, greedy):
  return init(nnx.merge(llm_def, llm_state), tokens_BT, lengths_B, params, rng, stop_ids,
              cache_size=cache_size, max_new_tokens=cfg.max_new_tokens,
              beam_length=cfg.beam_length, filtered=filtered, greedy=greedy)


# The loop is its own program: it depends on (B, S, cfg) but not on the prompt length, so prompts
# of new lengths only compile the (cheap) prefill again.
_STATIC = ("llm_def", "drafter_def", "cfg", "filtered", "greedy")


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("state",))
def _loop_jit(llm_def, llm_state, drafter_def, drafter_state, state, params, stop_ids, *, cfg,
              filtered, greedy):
  TRACE_COUNT["decode"] += 1
  llm, drafter = nnx.merge(llm_def, llm_state), nnx.merge(drafter_def, drafter_state)
  return jax.lax.while_loop(
      lambda s: ~jnp.all(s.done_B),
      lambda s: step(llm, drafter, s, params, stop_ids, cfg, filtered=filtered, greedy=greedy),
      state)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("state",))
def _step_jit(llm_def, llm_state, drafter_def, drafter_state, state, params, stop_ids, *, cfg,
              filtered, greedy):
  return step(nnx.merge(llm_def, llm_state), nnx.merge(drafter_def, drafter_state), state,
              params, stop_ids, cfg, filtered=filtered, greedy=greedy)


@dataclasses.dataclass(frozen=True)
class DecodeResult:
  """Host-side result of ``decode``: tokens per prompt and speculative statistics."""

  tokens: list[list[int]]
  stopped: list[bool]
  steps: int  # loop iterations (verify forwards) for the whole batch
  metrics: dict

  @classmethod
  def from_state(cls, state: DecodeState) -> "DecodeResult":
    out, m = state.out, jax.device_get(state.metrics)
    tokens_BM, num_B = np.asarray(out.tokens_BM), np.asarray(out.num_B)
    return cls(tokens=[tokens_BM[b, :num_B[b]].tolist() for b in range(len(num_B))],
               stopped=np.asarray(out.stopped_B).tolist(), steps=int(out.steps),
               metrics=summarize(m, num_B))


def summarize(m: Metrics, num_B: np.ndarray) -> dict:
  """Run-level metrics. tokens_per_step = (accepted + 1) per verification step."""
  steps = int(np.sum(m.steps_B))
  hist = np.asarray(m.accept_hist_BL).sum(0)
  at_least = hist[::-1].cumsum()[::-1]  # steps that accepted >= d drafted tokens
  return dict(
      steps=steps,
      tokens_per_step=float((np.sum(m.accepted_B) + steps) / max(steps, 1)),
      accepted_tokens=int(np.sum(m.accepted_B)),
      per_depth_acceptance=[float(at_least[d] / max(at_least[d - 1], 1))
                            for d in range(1, len(hist))],
      accepted_length_histogram=hist.tolist(),
      mean_tree_tokens=float(np.sum(m.tree_tokens_B) / max(steps, 1)),
      mean_unique_tokens=float(np.sum(m.unique_tokens_B) / max(steps, 1)),
      dedup_saving=float(1 - np.sum(m.unique_tokens_B) / max(np.sum(m.beam_tokens_B), 1)),
      tokens_per_row=np.asarray(num_B).tolist(),
      steps_per_row=np.asarray(m.steps_B).tolist())


def draft_model(drafter, cfg: DecodeConfig):
  """The drafter as decoding uses it: restricted to ``cfg.draft_vocab_size`` tokens if set."""
  if isinstance(drafter, Drafter) and drafter.vocab_ids is None:
    return restrict_vocab(drafter, cfg.draft_vocab_size)
  return drafter


def static_config(cfg: DecodeConfig) -> DecodeConfig:
  """``cfg`` without the sampling defaults, which travel as arrays: changing a temperature must
  not recompile (only whether every row is greedy is static: ``Prepared.greedy``)."""
  return dataclasses.replace(cfg, temperature=0.0, top_p=1.0, top_k=0)


@dataclasses.dataclass(frozen=True)
class Prepared:
  """Validated, packed inputs for one decode call (shared by ``decode`` and its twin)."""

  tokens_BT: jax.Array
  lengths_B: jax.Array
  params: sampling.SamplingParams
  rng: jax.Array
  stop_ids: jax.Array
  cache_size: int
  filtered: bool
  greedy: bool  # every row has temperature 0 (static: the argmax fast path)


def prepare(llm: Llama, drafter: Drafter, prompts: Sequence[Sequence[int]], cfg: DecodeConfig,
            *, seed: int, stop_ids: Sequence[int], temperature, top_p, top_k) -> Prepared:
  temperature = cfg.temperature if temperature is None else temperature
  top_p = cfg.top_p if top_p is None else top_p
  top_k = cfg.top_k if top_k is None else top_k
  check_sampling(temperature, top_p, top_k)
  dcfg = getattr(drafter, "config", None)
  if dcfg is not None and (dcfg.hidden_size, dcfg.vocab_size) != (llm.config.hidden_size,
                                                                  llm.config.vocab_size):
    raise GenerateError(
        f"drafter (hidden_size={drafter.config.hidden_size}, vocab_size="
        f"{drafter.config.vocab_size}) does not match the LLM (hidden_size="
        f"{llm.config.hidden_size}, vocab_size={llm.config.vocab_size})")
  tokens_BT, lengths_B = pack_prompts(prompts)
  extra = cfg.beam_length + cfg.num_tree_tokens
  size = cfg.cache_size or cache_size_for(int(lengths_B.max()), cfg.max_new_tokens, extra,
                                          llm.config.max_position_embeddings, multiple=256)
  if size < max(tokens_BT.shape[1], int(lengths_B.max()) + cfg.max_new_tokens + extra):
    raise GenerateError(f"cache_size {size} is too small: need prompt + max_new_tokens + "
                        f"{extra} scratch slots")
  B = len(prompts)
  return Prepared(jnp.asarray(tokens_BT), jnp.asarray(lengths_B),
                  sampling.SamplingParams.make(B, temperature, top_p, top_k),
                  jax.random.key(seed), jnp.asarray(list(stop_ids) or [-1], jnp.int32), size,
                  sampling.needs_filter(top_p, top_k), sampling.all_greedy(temperature))


@dataclasses.dataclass(frozen=True)
class _Run:
  """A prefilled decode, ready for the loop (``_loop_jit``) or its twin (``_step_jit``)."""

  models: tuple  # (llm_def, llm_state, drafter_def, drafter_state)
  state: DecodeState
  loop_args: tuple  # (params, stop_ids)
  static: dict  # cfg, filtered and greedy

  @classmethod
  def start(cls, llm, drafter, prompts, cfg, **kwargs) -> "_Run":
    p = prepare(llm, drafter, prompts, cfg, **kwargs)
    llm_def, llm_state = nnx.split(llm)
    drafter_def, drafter_state = nnx.split(draft_model(drafter, cfg))
    static = dict(cfg=static_config(cfg), filtered=p.filtered, greedy=p.greedy)
    state = _init_jit(llm_def, llm_state, p.tokens_BT, p.lengths_B, p.params, p.rng, p.stop_ids,
                      cache_size=p.cache_size, **static)
    return cls((llm_def, llm_state, drafter_def, drafter_state), state, (p.params, p.stop_ids),
               static)


def decode(llm: Llama, drafter: Drafter, prompts: Sequence[Sequence[int]], cfg: DecodeConfig,
           *, seed: int = 0, stop_ids: Sequence[int] = (), temperature=None, top_p=None,
           top_k=None) -> DecodeResult:
  """ReDrafter generation for a batch of token-id prompts; one compiled program per shape.

  Sampling settings default to ``cfg``'s and may be given per prompt (arrays of length B).
  Greedy (temperature 0) output equals ``generate``'s greedy output.
  """
  run = _Run.start(llm, drafter, prompts, cfg, seed=seed, stop_ids=stop_ids,
                   temperature=temperature, top_p=top_p, top_k=top_k)
  return DecodeResult.from_state(_loop_jit(*run.models, run.state, *run.loop_args, **run.static))


def decode_stepwise(llm: Llama, drafter: Drafter, prompts: Sequence[Sequence[int]],
                    cfg: DecodeConfig, *, seed: int = 0, stop_ids: Sequence[int] = (),
                    temperature=None, top_p=None, top_k=None, on_step=None) -> DecodeResult:
  """The Python-loop twin of ``decode``: same init and step, one jitted call per step.

  ``on_step(state)`` (optional) sees the state after every step, for tests and debugging.
  """
  run = _Run.start(llm, drafter, prompts, cfg, seed=seed, stop_ids=stop_ids,
                   temperature=temperature, top_p=top_p, top_k=top_k)
  state = run.state
  while not bool(jnp.all(state.done_B)):
    state = _step_jit(*run.models, state, *run.loop_args, **run.static)
    if on_step is not None:
      on_step(state)
  return DecodeResult.from_state(state)
