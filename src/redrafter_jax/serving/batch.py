"""The server's device-side batch: B request slots decoded together, with static shapes.

``SlotBatch`` is a ``DecodeState`` over B slots plus each slot's sampling settings and token
limit. Four pure functions change it (the engine jits each once per static shape, donating the
batch, so nothing of it makes a host round trip):

  ``admit``     prefill one prompt (batch 1, length bucketed by the caller), choose its first
                token with the request's own key, and write the row into a slot: cache row,
                g0, h, output row, done flag, metrics row, sampling settings, key, limit.
  ``release``   mark the rows whose request ended on the host done (they stop decoding);
  ``spec_step`` one ReDrafter step (``inference.step.step``) for every slot;
  ``ar_step``   one plain autoregressive step (the ReDrafter-off mode, and the steps where a
                tree does not pay).

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
from redrafter_jax.inference.runtime import empty_output, prefill, record
from redrafter_jax.models import kv_cache as kvc
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
          beam_length: int, *, layout: str = "XES", cache_dtype=None) -> SlotBatch:
  """All slots free (done), caches zero, in the attention backend's ``layout`` and
  ``cache_dtype`` (default ``dtype``): ``Llama.init_cache``'s."""
  B = slots
  state = step_lib.DecodeState(
      cache=kvc.init(cfg.num_layers, B, cache_size, cfg.num_kv_heads, cfg.head_dim,
                     cache_dtype or dtype, layout),
      g0_B=jnp.zeros((B,), jnp.int32), h_BD=jnp.zeros((B, cfg.hidden_size), dtype),
      context_BS=jnp.zeros((B, cache_size), jnp.int32), out=empty_output(B, max_tokens),
      done_B=jnp.ones((B,), bool), rng=jax.random.split(jax.random.key(0), B),
      metrics=step_lib.Metrics.zeros(B, beam_length))
  return SlotBatch(state, sampling.SamplingParams.make(B), jnp.zeros((B,), jnp.int32))


def request_key(seed_lo, seed_hi) -> jax.Array:
  """A request's PRNG key from its 64-bit seed (two uint32 words)."""
  return jax.random.fold_in(jax.random.key(seed_lo), seed_hi)


def admit(llm: Llama, batch: SlotBatch, slot, tokens_1T, length, seed_lo, seed_hi, temperature,
          top_p, top_k, limit, stop_ids, filtered) -> tuple[SlotBatch, jax.Array]:
  """Prefill one prompt into ``slot``; returns the batch and the request's first token.
  ``filtered`` (traced bool): the request uses top-k/top-p (one program serves both)."""
  s = batch.state
  M = s.out.tokens_BM.shape[1]
  T = tokens_1T.shape[1]
  length_1 = jnp.reshape(length, (1,)).astype(jnp.int32)
  logits_1V, h_1D, row_cache = prefill(llm, tokens_1T, length_1, llm.init_cache(1, T))
  params_1 = sampling.SamplingParams.make(1, temperature, top_p, top_k)
  rng, key = jax.random.split(request_key(seed_lo, seed_hi))
  draw = lambda f: sampling.sample(key, sampling.target_logprobs(logits_1V, params_1, filtered=f))
  g0_1 = jax.lax.cond(filtered, lambda: draw(True), lambda: draw(False))
  out_1, done_1 = record(empty_output(1, M), jnp.zeros((1,), bool), g0_1[:, None],
                         jnp.ones((1,), jnp.int32), stop_ids, M)
  done_1 = done_1 | (limit <= 1)

  # Only the prompt's T slots are written: slots past a row's length are never visible. The
  # row's length (the prompt's, which prefill advanced it by) comes with it.
  cache = kvc.put_row(s.cache, slot, row_cache)
  put = lambda full, row: full.at[slot].set(row[0])
  out = s.out.replace(tokens_BM=put(s.out.tokens_BM, out_1.tokens_BM),
                      num_B=put(s.out.num_B, out_1.num_B),
                      stopped_B=put(s.out.stopped_B, out_1.stopped_B))
  metrics = jax.tree.map(lambda x: x.at[slot].set(0), s.metrics)
  context_1S = step_lib.start_context(tokens_1T, length_1, g0_1, s.context_BS.shape[1])
  state = s.replace(cache=cache, g0_B=put(s.g0_B, g0_1),
                    context_BS=put(s.context_BS, context_1S),
                    h_BD=put(s.h_BD, h_1D.astype(s.h_BD.dtype)), out=out,
                    done_B=put(s.done_B, done_1), rng=s.rng.at[slot].set(rng), metrics=metrics)
  params = jax.tree.map(put, batch.params, params_1)
  return SlotBatch(state, params, batch.limit_B.at[slot].set(limit)), g0_1[0]


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
              kind, *, context: int | None = None) -> tuple[SlotBatch, StepOut]:
  """One ReDrafter step (draft, verify, accept, commit) for every slot: ``inference.step.step``
  with its acceptance rule chosen at run time by ``kind`` (traced int32; 0 greedy: every active
  request has temperature 0, the argmax walk; 1 sampled; 2 top-k/top-p filtered), so one
  program serves every sampling kind and the draft and verify forward compile once. Rows'
  random keys advance the same in every kind. ``context`` (static; None: the whole cache): the
  cache slots attention reads, a context bucket holding every live row's tokens and tree."""
  s = batch.state
  keys_B2 = jax.vmap(jax.random.split)(s.rng)
  state = s.replace(rng=keys_B2[:, 0])
  beams, tree = step_lib.draft(llm, drafter, state, cfg)
  logits_BNV, hidden_BND, cache = step_lib.verify_forward(llm, state, tree, context)
  rule = lambda filtered, greedy: lambda: step_lib.accept(
      keys_B2[:, 1], beams, tree, logits_BNV, batch.params, cfg, filtered, greedy)
  verdict = jax.lax.switch(kind, [rule(False, True), rule(False, False), rule(True, False)])
  new = step_lib.commit(state, cache, verdict, hidden_BND, tree, stop_ids,
                        max_new_tokens=cfg.max_new_tokens)
  return _finish(batch, s, new, cfg.beam_length)


def ar_step(llm: Llama, batch: SlotBatch, stop_ids, kind, *, width: int = 1,
            context: int | None = None) -> tuple[SlotBatch, StepOut]:
  """One autoregressive token for every slot (the same bookkeeping as ``spec_step``; ``kind``
  and ``context`` as there: the top-k/top-p filter runs for kind 2 only); ``width`` pads
  ``StepOut.tokens_BA`` to the speculative step's width, so both modes return one shape."""
  s = batch.state
  B = s.g0_B.shape[0]
  M = s.out.tokens_BM.shape[1]
  active_B = ~s.done_B
  keys_B2 = jax.vmap(jax.random.split)(s.rng)
  c = s.cache
  mask_B1S = kvc.visible_mask(c.lengths_B, jnp.ones((B, 1, 1), bool), context or c.size)
  logits_B1V, hidden_B1D, cache = llm(s.g0_B[:, None], c.lengths_B[:, None], mask_B1S, c)
  cache = kvc.advance(cache, active_B.astype(jnp.int32))
  target = lambda f: lambda: sampling.target_logprobs(logits_B1V[:, 0], batch.params, filtered=f)
  logp_BV = jax.lax.cond(kind == 2, target(True), target(False))
  next_B = jax.vmap(lambda k, lp_V: sampling.sample(k, lp_V[None])[0])(keys_B2[:, 1], logp_BV)
  out, done_B = record(s.out, s.done_B, next_B[:, None], jnp.ones((B,), jnp.int32), stop_ids, M)
  on_B = active_B.astype(jnp.int32)
  m = s.metrics
  metrics = m.replace(steps_B=m.steps_B + on_B,
                      accept_hist_BL=m.accept_hist_BL.at[:, 0].add(on_B))
  context_BS = lookup.write(s.context_BS, c.lengths_B + 1, next_B[:, None], on_B)
  new = s.replace(cache=cache, g0_B=jnp.where(active_B, next_B, s.g0_B), context_BS=context_BS,
                  h_BD=jnp.where(active_B[:, None], hidden_B1D[:, 0], s.h_BD),
                  out=out.replace(steps=out.steps + 1), done_B=done_B, rng=keys_B2[:, 0],
                  metrics=metrics)
  return _finish(batch, s, new, width)
