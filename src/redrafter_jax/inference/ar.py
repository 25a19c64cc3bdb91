"""The autoregressive baseline: a jitted prefill, then a ``lax.while_loop`` of one-token steps.

It is what ReDrafter is measured against and must reproduce (greedy), and what writes the
teacher data for training. The whole generation runs on the device; only the result comes back.
Its loop checks the stop predicate once per k steps when asked (``runtime.checked_loop``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from redrafter_jax.inference import sampling
from redrafter_jax.inference.runtime import (GenerateError, Output, cache_size_for, check_sampling,
                                             check_steps_per_check, checked_loop, empty_output,
                                             keep_unless, mode_jit, pack_prompts, prefill,
                                             record)
from redrafter_jax.inference.timing import timed_calls
from redrafter_jax.models import kv_cache as kvc
from redrafter_jax.models.invariant import compiler_options
from redrafter_jax.models.llama import Llama


@struct.dataclass
class _ARState:
  cache: kvc.KVCache
  last_B: jax.Array  # the newest token, not yet in the cache
  out: Output
  done_B: jax.Array
  rng: jax.Array


def _next_tokens(key, logits_BV, params: sampling.SamplingParams, *, filtered: bool,
                 greedy: bool) -> jax.Array:
  if greedy:  # every row is greedy (static): skip the per-step random draw over the vocabulary
    return sampling.greedy_tokens(logits_BV)
  return sampling.sample(key, sampling.target_logprobs(logits_BV, params, filtered=filtered))


def one_token_step(model: Llama, last_B: jax.Array, cache: kvc.KVCache
                   ) -> tuple[jax.Array, kvc.KVCache]:
  """One AR forward of each row's newest token ``last_B`` over its cache: ``(logits_BV, cache)``
  with the token written and every row advanced by one slot. The step generation repeats (and
  ``bench throughput``'s decode-step rows time)."""
  B = last_B.shape[0]
  mask_BTS = kvc.visible_mask(cache.lengths_B, jnp.ones((B, 1, 1), bool), cache.size)
  logits_BTV, _, cache = model(last_B[:, None], cache.lengths_B[:, None], mask_BTS, cache)
  return logits_BTV[:, 0], kvc.advance(cache, jnp.ones((B,), jnp.int32))


def one_token_stepper(model: Llama, batch: int, slots: int, length: int
                      ) -> Callable[[], jax.Array]:
  """A call that runs the one-token step once (jitted, greedy, the cache donated as in
  generation's loop) for ``batch`` rows over a cache of ``slots`` slots holding ``length``
  tokens each, and returns its tokens without waiting for them: for timing it against other
  programs call by call. Each call advances the rows by one slot."""
  graphdef, state = nnx.split(model)

  @functools.partial(jax.jit, donate_argnums=(2,), compiler_options=compiler_options(
      model.invariant))
  def step(state, last_B, cache):
    logits_BV, cache = one_token_step(nnx.merge(graphdef, state), last_B, cache)
    return sampling.greedy_tokens(logits_BV), cache

  carry = [jnp.full((batch,), 1000 % model.config.vocab_size, jnp.int32),
           kvc.advance(model.init_cache(batch, slots), jnp.full((batch,), length, jnp.int32))]

  def call() -> jax.Array:
    carry[:] = step(state, *carry)
    return carry[0]

  return call


def one_token_step_seconds(model: Llama, batch: int, slots: int, length: int, repeat: int
                           ) -> list[float]:
  """Wall seconds of ``repeat`` calls of the one-token step (``one_token_stepper``); the first
  (compiling) call is not timed."""
  return timed_calls(one_token_stepper(model, batch, slots, length), repeat)


@mode_jit(static_argnames=("graphdef", "max_new_tokens", "cache_size", "filtered", "greedy",
                           "steps_per_check"))
def _generate(graphdef, state, tokens_BT, lengths_B, params: sampling.SamplingParams, rng,
              stop_ids, *, max_new_tokens: int, cache_size: int, filtered: bool,
              greedy: bool = False, steps_per_check: int = 1) -> Output:
  model = nnx.merge(graphdef, state)
  B = tokens_BT.shape[0]
  cache = model.init_cache(B, cache_size)
  logits_BV, _, cache = prefill(model, tokens_BT, lengths_B, cache)
  rng, key = jax.random.split(rng)
  first_B = _next_tokens(key, logits_BV, params, filtered=filtered, greedy=greedy)
  out, done_B = record(empty_output(B, max_new_tokens), jnp.zeros((B,), bool), first_B[:, None],
                       jnp.ones((B,), jnp.int32), stop_ids, max_new_tokens)

  def cond(s: _ARState):
    return ~jnp.all(s.done_B)

  def body(s: _ARState, live):
    logits_BV, cache = one_token_step(model, s.last_B, s.cache)
    rng, key = jax.random.split(s.rng)
    next_B = _next_tokens(key, logits_BV, params, filtered=filtered, greedy=greedy)
    out, done_B = record(s.out, s.done_B, next_B[:, None], jnp.ones_like(next_B), stop_ids,
                         max_new_tokens)
    # A masked step (every row already done) keeps the old state: no step counted, the
    # lengths kept, so its K/V write stays on one scratch slot inside the cache.
    return keep_unless(live, _ARState(cache, next_B, out.replace(steps=out.steps + 1), done_B,
                                      rng), s)

  state0 = _ARState(cache, first_B, out, done_B, rng)
  return checked_loop(cond, body, state0, steps_per_check).out


@dataclasses.dataclass(frozen=True)
class Result:
  """Host-side result: one token list per prompt, plus counters."""

  tokens: list[list[int]]
  stopped: list[bool]
  steps: int

  @classmethod
  def from_output(cls, out: Output) -> "Result":
    tokens_BM, num_B = np.asarray(out.tokens_BM), np.asarray(out.num_B)
    return cls(tokens=[tokens_BM[b, :num_B[b]].tolist() for b in range(len(num_B))],
               stopped=np.asarray(out.stopped_B).tolist(), steps=int(out.steps))


def generate(model: Llama, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128,
             temperature=0.0, top_p=1.0, top_k=0, seed: int = 0, stop_ids: Sequence[int] = (),
             cache_size: int | None = None, steps_per_check: int = 1,
             prompt_multiple: int = 64) -> Result:
  """Plain AR decoding of a batch of token-id prompts: the baseline ReDrafter must reproduce.

  Args:
    model: the LLM.
    prompts: B token-id lists (each non-empty); they are right-padded into one batch.
    max_new_tokens: the most tokens generated per row.
    temperature, top_p, top_k: sampling settings, a scalar or one value per prompt;
      temperature 0 is greedy.
    seed: the PRNG seed of the sampled rows.
    stop_ids: token ids that end a row (the stop token is included in its output).
    cache_size: static KV-cache slots per row; None: prompt + ``max_new_tokens``, rounded up.
    steps_per_check: steps per check of the loop's stop predicate (``checked_loop``; as
      ``DecodeConfig.steps_per_check``); the result does not depend on it.
    prompt_multiple: the padded prompt length is a multiple of it (each padded length compiles
      its own program).

  Returns:
    A ``Result``: each row's new tokens, whether it stopped on a stop token, and the number of
    LLM forwards after the prefill.
  """
  if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise GenerateError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
  check_steps_per_check(steps_per_check)
  check_sampling(temperature, top_p, top_k)
  tokens_BT, lengths_B = pack_prompts(prompts, multiple=prompt_multiple)
  limit = model.config.max_position_embeddings
  size = cache_size or cache_size_for(int(lengths_B.max()), max_new_tokens, 1, limit)
  if size < tokens_BT.shape[1] or size < int(lengths_B.max()) + max_new_tokens:
    raise GenerateError(f"cache_size {size} is too small for the prompts + max_new_tokens")
  B = len(prompts)
  params = sampling.SamplingParams.make(B, temperature, top_p, top_k)
  graphdef, state = nnx.split(model)
  out = _generate.of(model.invariant)(
      graphdef, state, jnp.asarray(tokens_BT), jnp.asarray(lengths_B), params,
      jax.random.key(seed), jnp.asarray(list(stop_ids) or [-1], jnp.int32),
      max_new_tokens=max_new_tokens, cache_size=size, filtered=sampling.needs_filter(top_p, top_k),
      greedy=sampling.all_greedy(temperature), steps_per_check=steps_per_check)
  return Result.from_output(out)
