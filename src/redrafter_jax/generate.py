"""Autoregressive baseline: jitted prefill + a ``lax.while_loop`` of single-token steps.

Also holds what every decoder shares: packing prompts into a static batch, the prefill, and the
output record. Rows are right-padded and each has its own length, positions and finish flag, so
a batch never needs left padding and a finished row stops emitting at once (its slot keeps
computing, masked, until the batch is done: shapes are static).
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
from redrafter_jax import sampling
from redrafter_jax.models.llama import Llama


class GenerateError(ValueError):
  """Bad generation arguments (empty prompt, too long for the cache, bad settings)."""


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def pack_prompts(prompts: Sequence[Sequence[int]], *, pad_id: int = 0, multiple: int = 64
                 ) -> tuple[np.ndarray, np.ndarray]:
  """Right-pad token lists into ``tokens_BT`` (T rounded up to limit recompiles) + ``lengths_B``."""
  if len(prompts) == 0:
    raise GenerateError("no prompts given")
  lengths = np.array([len(p) for p in prompts], np.int32)
  if (lengths == 0).any():
    raise GenerateError(f"prompt {int(np.argmin(lengths))} is empty: every prompt needs >= 1 token")
  T = round_up(int(lengths.max()), multiple)
  tokens = np.full((len(prompts), T), pad_id, np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  return tokens, lengths


def cache_size_for(prompt_len: int, max_new_tokens: int, extra: int, limit: int, *,
                   multiple: int = 128) -> int:
  """Static cache slots: prompt + new tokens + scratch for one forward, rounded up to
  ``multiple`` (fewer distinct sizes, fewer compilations)."""
  need = prompt_len + max_new_tokens + extra
  if need > limit:
    raise GenerateError(
        f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) + {extra} scratch "
        f"slots = {need} exceeds the model's context of {limit} tokens")
  return min(round_up(need, multiple), limit)


def prefill(model: Llama, tokens_BT, lengths_B, cache: kvc.KVCache):
  """Run the prompts; returns logits and hidden at each row's last prompt token, and the cache."""
  B, T = tokens_BT.shape
  positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
  valid_BT = positions_BT < lengths_B[:, None]
  mask_BTS = kvc.visible_mask(cache.lengths_B, kvc.causal_mask(valid_BT), cache.size)
  hidden_BTD, cache = model.forward_hidden(tokens_BT, positions_BT, mask_BTS, cache)
  cache = kvc.advance(cache, lengths_B)
  last_BD = jnp.take_along_axis(hidden_BTD, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
  return model.logits(last_BD), last_BD, cache


@struct.dataclass
class Output:
  """Generated tokens per row. ``tokens_BM[b, :num_B[b]]`` are valid (stop token included)."""

  tokens_BM: jax.Array
  num_B: jax.Array
  stopped_B: jax.Array  # ended on a stop token (else on max_new_tokens)
  steps: jax.Array  # LLM forward passes after the prefill


@struct.dataclass
class _ARState:
  cache: kvc.KVCache
  last_B: jax.Array  # the newest token, not yet in the cache
  out: Output
  done_B: jax.Array
  rng: jax.Array


def record(out: Output, done_B, new_BA, count_B, stop_ids, max_new: int):
  """Append ``count_B`` tokens of ``new_BA`` to each unfinished row; stop at a stop token or at
  ``max_new``. Returns the new output and done flags."""
  A = new_BA.shape[1]
  idx_A = jnp.arange(A)
  is_stop_BA = jnp.isin(new_BA, stop_ids) & (idx_A < count_B[:, None])
  first_stop_B = jnp.where(is_stop_BA.any(1), jnp.argmax(is_stop_BA, axis=1) + 1, A + 1)
  room_B = max_new - out.num_B
  keep_B = jnp.where(done_B, 0, jnp.minimum(jnp.minimum(count_B, first_stop_B), room_B))
  dest_BA = jnp.where(idx_A < keep_B[:, None], out.num_B[:, None] + idx_A, max_new)  # OOB: drop
  tokens = jax.vmap(lambda t, d, n: t.at[d].set(n, mode="drop"))(out.tokens_BM, dest_BA, new_BA)
  stopped_B = out.stopped_B | (~done_B & (first_stop_B <= keep_B))
  num_B = out.num_B + keep_B
  out = out.replace(tokens_BM=tokens, num_B=num_B, stopped_B=stopped_B)
  return out, done_B | stopped_B | (num_B >= max_new)


def empty_output(batch: int, max_new: int) -> Output:
  return Output(tokens_BM=jnp.zeros((batch, max_new), jnp.int32),
                num_B=jnp.zeros((batch,), jnp.int32), stopped_B=jnp.zeros((batch,), bool),
                steps=jnp.zeros((), jnp.int32))


def _next_tokens(key, logits_BV, params: sampling.SamplingParams, *, filtered: bool,
                 greedy: bool) -> jax.Array:
  if greedy:  # every row is greedy (static): skip the per-step random draw over the vocabulary
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  return sampling.sample(key, sampling.target_logprobs(logits_BV, params, filtered=filtered))


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "cache_size",
                                             "filtered", "greedy"), donate_argnames=())
def _generate(graphdef, state, tokens_BT, lengths_B, params: sampling.SamplingParams, rng,
              stop_ids, *, max_new_tokens: int, cache_size: int, filtered: bool,
              greedy: bool = False) -> Output:
  model = nnx.merge(graphdef, state)
  B = tokens_BT.shape[0]
  cache = model.init_cache(B, cache_size)
  logits_BV, _, cache = prefill(model, tokens_BT, lengths_B, cache)
  rng, key = jax.random.split(rng)
  first_B = _next_tokens(key, logits_BV, params, filtered=filtered, greedy=greedy)
  out, done_B = record(empty_output(B, max_new_tokens), jnp.zeros((B,), bool), first_B[:, None],
                       jnp.ones((B,), jnp.int32), stop_ids, max_new_tokens)
  ones_B11 = jnp.ones((B, 1, 1), bool)

  def cond(s: _ARState):
    return ~jnp.all(s.done_B)

  def body(s: _ARState):
    mask_BTS = kvc.visible_mask(s.cache.lengths_B, ones_B11, cache_size)
    logits_BTV, _, cache = model(s.last_B[:, None], s.cache.lengths_B[:, None], mask_BTS, s.cache)
    cache = kvc.advance(cache, jnp.ones_like(s.done_B, jnp.int32))
    rng, key = jax.random.split(s.rng)
    next_B = _next_tokens(key, logits_BTV[:, 0], params, filtered=filtered, greedy=greedy)
    out, done_B = record(s.out, s.done_B, next_B[:, None], jnp.ones_like(next_B), stop_ids,
                         max_new_tokens)
    return _ARState(cache, next_B, out.replace(steps=out.steps + 1), done_B, rng)

  state0 = _ARState(cache, first_B, out, done_B, rng)
  return jax.lax.while_loop(cond, body, state0).out


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


def check_sampling(temperature, top_p, top_k) -> None:
  if np.any(np.asarray(temperature) < 0):
    raise GenerateError(f"temperature must be >= 0, got {temperature}")
  if np.any((np.asarray(top_p) <= 0) | (np.asarray(top_p) > 1)):
    raise GenerateError(f"top_p must be in (0, 1], got {top_p}")
  if np.any(np.asarray(top_k) < 0):
    raise GenerateError(f"top_k must be >= 0, got {top_k}")


def generate(model: Llama, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128,
             temperature=0.0, top_p=1.0, top_k=0, seed: int = 0, stop_ids: Sequence[int] = (),
             cache_size: int | None = None) -> Result:
  """Plain AR decoding of a batch of token-id prompts (greedy when temperature is 0).

  Sampling settings may be scalars or one value per prompt.
  """
  if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise GenerateError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
  check_sampling(temperature, top_p, top_k)
  tokens_BT, lengths_B = pack_prompts(prompts)
  limit = model.config.max_position_embeddings
  size = cache_size or cache_size_for(int(lengths_B.max()), max_new_tokens, 1, limit)
  if size < tokens_BT.shape[1] or size < int(lengths_B.max()) + max_new_tokens:
    raise GenerateError(f"cache_size {size} is too small for the prompts + max_new_tokens")
  B = len(prompts)
  params = sampling.SamplingParams.make(B, temperature, top_p, top_k)
  graphdef, state = nnx.split(model)
  out = _generate(graphdef, state, jnp.asarray(tokens_BT), jnp.asarray(lengths_B), params,
                  jax.random.key(seed), jnp.asarray(list(stop_ids) or [-1], jnp.int32),
                  max_new_tokens=max_new_tokens, cache_size=size,
                  filtered=sampling.needs_filter(top_p, top_k),
                  greedy=sampling.all_greedy(temperature))
  return Result.from_output(out)
