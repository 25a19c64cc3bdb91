"""The server's device-side batch: B request slots decoded together, with static shapes.

``SlotBatch`` is a ``DecodeState`` over B slots plus each slot's sampling settings and token
limit. Four pure functions change it (the engine jits each once per static shape, donating the
batch, so nothing of it makes a host round trip):

  ``admit``     prefill k prompts together (one length bucket, rows bucketed by the caller),
                choose each first token with its request's own key, and write each row into
                its slot: cache row, g0, h (the last hidden state, or the states of a
                multi-layer drafter's ``feature_layers``, which every step keeps current),
                output row, done flag, metrics row, sampling settings, key, limit (and, for a
                drafter with ``context_attention``, its memory of the prompt, which every step,
                AR ones too, extends by the positions it commits).
  ``release``   mark the rows whose request ended on the host done (they stop decoding);
  ``spec_step`` one ReDrafter step (``inference.step.step``) for every slot;
  ``ar_step``   one plain autoregressive step (the ReDrafter-off mode, and the steps where a
                tree does not pay).

A step's cost grows with its rows: the LLM's matmuls and attention run over every row handed to
them, decoding or not. The engine therefore runs each step on a power-of-two bucket of rows
(the active slots, padded with free ones) rather than on all slots: ``take_rows`` gathers those
rows into a batch of their own (static size b), the step runs on it, ``put_rows`` scatters them
back. Only the gathered rows' cache is read and copied, and only the context bucket the step
reads, so a step with one active request costs about what a batch-1 step costs, plus copying
that row's used cache in and out. The KV cache's rows move through ``models/kv_cache.py``
(``take_rows``, ``put_rows``: it knows each backend's layout); every other leaf of the batch has
its row axis first, except the output's scalar step counter.

Both steps return a small ``StepOut`` (the tokens each row gained, counts, flags), which is all
the host reads per step. Every slot keeps its own PRNG key, split once per step, so a request's
draws depend on its seed and its own progress only, never on which slot it sits in or who else
is in the batch (for a given step mode: AR and tree steps draw differently). A slot whose request
ended on the host (stop string, cancelled) is released at the next step that includes its row;
until then it may keep decoding: its row is independent and nothing reads it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from redrafter_jax.config import DecodeConfig, LlamaConfig
from redrafter_jax.inference import lookup, sampling
from redrafter_jax.inference import step as step_lib
from redrafter_jax.inference.beam_search import attends_to_context
from redrafter_jax.inference.runtime import (at_last, empty_output, forward_for_drafter, prefill,
                                            record)
from redrafter_jax.models import kv_cache as kvc
from redrafter_jax.models.context_attention import MemoryCache
from redrafter_jax.models.drafter import Drafter
from redrafter_jax.models.llama import Llama


@struct.dataclass
class SlotBatch:
  state: step_lib.DecodeState  # ``state.rng`` holds one key per slot
  params: sampling.SamplingParams
  limit_B: jax.Array  # int32: the request's max_tokens (the row is done once it has that many)


@struct.dataclass
class StepOut:
  tokens_BA: jax.Array  # tokens each row gained this step; the first ``count_B`` are valid
  count_B: jax.Array
  done_B: jax.Array
  active_B: jax.Array  # the row was decoding during this step
  accepted_B: jax.Array  # drafted tokens accepted this step (0 in AR mode)


def empty(cfg: LlamaConfig, dtype, slots: int, cache_size: int, max_tokens: int,
          beam_length: int, *, layout: str = "XES", cache_dtype=None,
          stacked: bool = False, layers: tuple[int, ...] = (),
          memory: tuple[int, object] | None = None) -> SlotBatch:
  """All slots free (done), caches zero, in the attention backend's ``layout`` and
  ``cache_dtype`` (default ``dtype``), stacked for a model that scans over its layers:
  ``Llama.init_cache``'s form. ``layers``: the drafter's ``feature_layers``, whose states each
  slot then carries as ``h`` (``[B, len(layers) * D]``) instead of the last hidden state.
  ``memory``: ``(width, dtype)`` of a context-attention drafter's memory (None: no memory)."""
  B = slots
  width = cfg.hidden_size * (len(layers) or 1)
  state = step_lib.DecodeState(
      cache=kvc.init(cfg.num_layers, B, cache_size, cfg.num_kv_heads, cfg.head_dim,
                     cache_dtype or dtype, layout, stacked=stacked),
      g0_B=jnp.zeros((B,), jnp.int32), h_BD=jnp.zeros((B, width), dtype),
      context_BS=jnp.zeros((B, cache_size), jnp.int32), out=empty_output(B, max_tokens),
      done_B=jnp.ones((B,), bool), rng=jax.random.split(jax.random.key(0), B),
      metrics=step_lib.Metrics.zeros(B, beam_length),
      memory=None if memory is None else MemoryCache.zeros(B, cache_size, *memory))
  return SlotBatch(state, sampling.SamplingParams.make(B), jnp.zeros((B,), jnp.int32))


def request_key(seed_lo, seed_hi) -> jax.Array:
  """A request's PRNG key from its 64-bit seed (two uint32 words)."""
  return jax.random.fold_in(jax.random.key(seed_lo), seed_hi)


def admit(llm: Llama, batch: SlotBatch, slots_k, tokens_kT, lengths_k, seed_lo_k, seed_hi_k,
          temperature_k, top_p_k, top_k_k, limit_k, stop_ids, filtered_k, *,
          layers: tuple[int, ...] = (),
          drafter: Drafter | None = None) -> tuple[SlotBatch, jax.Array]:
  """Prefill k prompts (one length bucket T, padded) into slots ``slots_k``; returns the batch
  and each request's first token ``[k]``. A slot index ``>= B`` marks a padding row: it is
  prefilled (the call's row count is bucketed) but written nowhere. ``filtered_k``: the row's
  request uses top-k/top-p (the vocabulary sort runs only when some row does). Each row draws
  its first token with its own request's key, so a request's tokens do not depend on which
  others were admitted with it. ``layers``: the drafter's ``feature_layers`` (``empty``).
  ``drafter``: needed for a drafter with ``context_attention`` (its memory of the prompts)."""
  s = batch.state
  M = s.out.tokens_BM.shape[1]
  k, T = tokens_kT.shape
  lengths_k = lengths_k.astype(jnp.int32)
  attends = attends_to_context(drafter)
  logits_kV, h_kD, rows = prefill(llm, tokens_kT, lengths_k, llm.init_cache(k, T), layers,
                                  every_position=attends)
  if attends:
    feats_kTX = h_kD
    h_kD = at_last(feats_kTX, lengths_k)
  params_k = sampling.SamplingParams.make(k, temperature_k, top_p_k, top_k_k)
  rng_k2 = jax.vmap(lambda lo, hi: jax.random.split(request_key(lo, hi)))(seed_lo_k, seed_hi_k)
  draw = lambda f: lambda: jax.vmap(lambda key, lp_V: sampling.sample(key, lp_V[None])[0])(
      rng_k2[:, 1], sampling.target_logprobs(logits_kV, params_k, filtered=f))
  # A call whose rows are all greedy takes the argmax without building the distributions (what
  # they would draw: ``target_logprobs`` gives a greedy row a one-hot at ``greedy_tokens``).
  drawn = lambda: jax.lax.cond(filtered_k.any(),
                               lambda: jnp.where(filtered_k, draw(True)(), draw(False)()),
                               draw(False))
  g0_k = jax.lax.cond(params_k.greedy_B.all(), lambda: sampling.greedy_tokens(logits_kV), drawn)
  out_k, done_k = record(empty_output(k, M), jnp.zeros((k,), bool), g0_k[:, None],
                         jnp.ones((k,), jnp.int32), stop_ids, M)
  done_k = done_k | (limit_k <= 1)

  # Only the prompts' T slots are written: slots past a row's length are never visible. Each
  # row's length (its prompt's, which prefill advanced it by) comes with it.
  cache = kvc.put_rows(s.cache, slots_k, rows)
  put = lambda full, part: full.at[slots_k].set(part.astype(full.dtype), mode="drop")
  out = s.out.replace(tokens_BM=put(s.out.tokens_BM, out_k.tokens_BM),
                      num_B=put(s.out.num_B, out_k.num_B),
                      stopped_B=put(s.out.stopped_B, out_k.stopped_B))
  metrics = jax.tree.map(lambda x: x.at[slots_k].set(0, mode="drop"), s.metrics)
  context_kS = step_lib.start_context(tokens_kT, lengths_k, g0_k, s.context_BS.shape[1])
  if attends:
    memory_k = step_lib.start_memory(drafter, llm.embed_tokens.embedding[...], feats_kTX,
                                     context_kS, lengths_k)
    s = s.replace(memory=jax.tree.map(put, s.memory, memory_k))
  state = s.replace(cache=cache, g0_B=put(s.g0_B, g0_k), context_BS=put(s.context_BS, context_kS),
                    h_BD=put(s.h_BD, h_kD), out=out, done_B=put(s.done_B, done_k),
                    rng=s.rng.at[slots_k].set(rng_k2[:, 0], mode="drop"), metrics=metrics)
  params = jax.tree.map(put, batch.params, params_k)
  return SlotBatch(state, params, put(batch.limit_B, limit_k)), g0_k


def _finish(batch: SlotBatch, old: step_lib.DecodeState, new: step_lib.DecodeState,
            width: int) -> tuple[SlotBatch, StepOut]:
  """Apply the per-row limits and cut out the tokens each row gained."""
  M = new.out.tokens_BM.shape[1]
  start_B = old.out.num_B
  idx_BA = jnp.minimum(start_B[:, None] + jnp.arange(width)[None, :], M - 1)
  tokens_BA = jnp.take_along_axis(new.out.tokens_BM, idx_BA, axis=1)
  done_B = new.done_B | (new.out.num_B >= batch.limit_B)
  out = StepOut(tokens_BA=tokens_BA, count_B=new.out.num_B - start_B, done_B=done_B,
                active_B=~old.done_B,
                accepted_B=new.metrics.accepted_B - old.metrics.accepted_B)
  return batch.replace(state=new.replace(done_B=done_B)), out


def release(batch: SlotBatch, live_B) -> SlotBatch:
  """Mark rows whose request ended on the host (stop string, cancelled, failed) done, so they
  stop decoding: the host says which slots still hold a request (``live_B``)."""
  return batch.replace(state=batch.state.replace(done_B=batch.state.done_B | ~live_B))


def spec_step(llm: Llama, drafter: Drafter, batch: SlotBatch, stop_ids, cfg: DecodeConfig,
              kind, *, context: int | None = None, embed_VD=None,
              width: int | None = None) -> tuple[SlotBatch, StepOut]:
  """One ReDrafter step (draft, verify, accept, commit) for every slot: ``inference.step.step``
  with its acceptance rule chosen at run time by ``kind`` (traced int32; 0 greedy: every active
  request has temperature 0, the argmax walk; 1 sampled; 2 top-k/top-p filtered), so one
  program serves every sampling kind and the draft and verify forward compile once. Rows'
  random keys advance the same in every kind. ``context`` (static; None: the whole cache): the
  cache slots attention reads, a context bucket holding every live row's tokens and tree.
  ``embed_VD``: the embedding table the drafter reads (``step.draft``). ``width``: pads
  ``StepOut.tokens_BA`` to that many (a smaller tree's step in a batch made for a larger one;
  None: ``cfg.beam_length``)."""
  s = batch.state
  keys_B2 = jax.vmap(jax.random.split)(s.rng)
  state = s.replace(rng=keys_B2[:, 0])
  beams, tree = step_lib.draft(llm, drafter, state, cfg, embed_VD)
  logits_BNV, hidden_BND, cache = step_lib.verify_forward(llm, state, tree, context,
                                                          step_lib.drafter_layers(drafter))
  rule = lambda filtered, greedy: lambda: step_lib.accept(
      keys_B2[:, 1], beams, tree, logits_BNV, batch.params, cfg, filtered, greedy)
  verdict = jax.lax.switch(kind, [rule(False, True), rule(False, False), rule(True, False)])
  new = step_lib.commit(state, cache, verdict, hidden_BND, tree, stop_ids, cfg)
  new = step_lib.remember_step(drafter, llm, embed_VD, state, new, verdict, hidden_BND)
  return _finish(batch, s, new, width or cfg.beam_length)


def ar_step(llm: Llama, batch: SlotBatch, stop_ids, kind, *, width: int = 1,
            context: int | None = None, layers: tuple[int, ...] = (),
            drafter: Drafter | None = None, embed_VD=None) -> tuple[SlotBatch, StepOut]:
  """One autoregressive token for every slot (the same bookkeeping as ``spec_step``; ``kind``
  and ``context`` as there: kind 0 takes the argmax without a draw, the top-k/top-p filter runs
  for kind 2 only); ``width`` pads ``StepOut.tokens_BA`` to the speculative step's width, so
  both modes return one shape. ``layers``: the drafter's ``feature_layers`` (``empty``), whose
  states the step keeps as ``h`` for the next tree step. ``drafter`` (with ``embed_VD``, the
  table it reads): a drafter with ``context_attention``, whose memory the step extends by the
  committed token."""
  s = batch.state
  B = s.g0_B.shape[0]
  M = s.out.tokens_BM.shape[1]
  active_B = ~s.done_B
  keys_B2 = jax.vmap(jax.random.split)(s.rng)
  c = s.cache
  mask_B1S = kvc.visible_mask(c.lengths_B, jnp.ones((B, 1, 1), bool), context or c.size)
  last_B1D, hidden_B1D, cache = forward_for_drafter(llm, s.g0_B[:, None], c.lengths_B[:, None],
                                                    mask_B1S, c, layers)
  logits_B1V = llm.logits(last_B1D)
  cache = kvc.advance(cache, active_B.astype(jnp.int32))
  draw = lambda f: lambda: jax.vmap(lambda k, lp_V: sampling.sample(k, lp_V[None])[0])(
      keys_B2[:, 1], sampling.target_logprobs(logits_B1V[:, 0], batch.params, filtered=f))
  next_B = jax.lax.switch(kind, [lambda: sampling.greedy_tokens(logits_B1V[:, 0]), draw(False),
                                 draw(True)])
  out, done_B = record(s.out, s.done_B, next_B[:, None], jnp.ones((B,), jnp.int32), stop_ids, M)
  on_B = active_B.astype(jnp.int32)
  m = s.metrics
  metrics = m.replace(steps_B=m.steps_B + on_B,
                      accept_hist_BL=m.accept_hist_BL.at[:, 0].add(on_B))
  context_BS = lookup.write(s.context_BS, c.lengths_B + 1, next_B[:, None], on_B)
  memory = s.memory
  if memory is not None:
    embed_VD = llm.embed_tokens.embedding[...] if embed_VD is None else embed_VD
    memory = step_lib.remember(drafter, embed_VD, memory, c.lengths_B, context_BS, hidden_B1D,
                               on_B)
  new = s.replace(cache=cache, g0_B=jnp.where(active_B, next_B, s.g0_B), context_BS=context_BS,
                  h_BD=jnp.where(active_B[:, None], hidden_B1D[:, 0], s.h_BD),
                  out=out.replace(steps=out.steps + 1), done_B=done_B, rng=keys_B2[:, 0],
                  metrics=metrics, memory=memory)
  return _finish(batch, s, new, width)


def _is_row_leaf(x) -> bool:
  return hasattr(x, "ndim") and x.ndim >= 1


def take_rows(batch, idx_b: jax.Array, width: int | None = None):
  """The rows ``idx_b`` (distinct slot numbers) of ``batch``, as a batch of ``len(idx_b)``,
  with the first ``width`` slots of their cache (all when None): a step reading ``width``
  slots moves only those in and out."""
  sub_cache = kvc.take_rows(batch.state.cache, idx_b, width)
  rest = jax.tree.map(lambda x: x[idx_b] if _is_row_leaf(x) else x,
                      batch.replace(state=batch.state.replace(cache=None)))
  return rest.replace(state=rest.state.replace(cache=sub_cache))


def put_rows(batch, idx_b: jax.Array, sub, window: tuple[jax.Array, int] | None = None):
  """``batch`` with rows ``idx_b`` replaced by the rows of ``sub`` (scalars taken from ``sub``;
  a cache of ``width`` slots replaces the first ``width``). ``window``: ``(start_b, size)``,
  the only cache slots ``sub`` changed (a step writes its tree from each row's length on):
  only those are written back (``kv_cache.put_window``)."""
  if window is None:
    new_cache = kvc.put_rows(batch.state.cache, idx_b, sub.state.cache)
  else:
    new_cache = kvc.put_window(batch.state.cache, idx_b, sub.state.cache, *window)
  strip = lambda b: b.replace(state=b.state.replace(cache=None))
  rest = jax.tree.map(lambda full, part: full.at[idx_b].set(part) if _is_row_leaf(full) else part,
                      strip(batch), strip(sub))
  return rest.replace(state=rest.state.replace(cache=new_cache))
