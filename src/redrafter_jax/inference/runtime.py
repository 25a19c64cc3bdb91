"""What every decoder shares: prompt packing, cache sizing, the prefill and the output record.

The AR baseline (``ar``), ReDrafter (``decode``) and the server's slot batch all build on these.
Rows are right-padded and each has its own length, positions and finish flag, so a batch never
needs left padding and a finished row stops emitting at once (its slot keeps computing, masked,
until the batch is done: shapes are static).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from redrafter_jax.errors import UserError
from redrafter_jax.models import kv_cache as kvc
from redrafter_jax.models.invariant import compiler_options
from redrafter_jax.models.llama import Llama


class ModeJit:
  """A function jitted for each mode of the model it runs: XLA's defaults, or the invariant
  mode's compiler options (``models.invariant``). ``of(invariant)`` is the jitted function."""

  def __init__(self, fn: Callable, **jit_kwargs):
    self._jits = {mode: jax.jit(fn, compiler_options=compiler_options(mode), **jit_kwargs)
                  for mode in (False, True)}
    functools.update_wrapper(self, fn)

  def of(self, invariant: bool) -> Callable:
    return self._jits[bool(invariant)]


def mode_jit(**jit_kwargs) -> Callable[[Callable], ModeJit]:
  """Decorator: ``jax.jit(**jit_kwargs)`` per mode (``ModeJit``)."""
  return lambda fn: ModeJit(fn, **jit_kwargs)


class GenerateError(UserError, ValueError):
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


def forward_for_drafter(model: Llama, tokens_BT, positions_BT, mask_BTS, cache: kvc.KVCache,
                        layers: tuple[int, ...] = (), virtual=None):
  """The decoder run every decoding step makes: ``(hidden_BTD, feats_BTX, cache)``, where
  ``feats`` is what the drafter reads as its h: the last hidden state itself, or with ``layers``
  (a multi-layer drafter's ``feature_layers``) those layers' normed states, concatenated
  (``Llama.forward_layers``). ``virtual``: as ``Llama.forward_hidden``'s."""
  if layers:
    return model.forward_layers(tokens_BT, positions_BT, mask_BTS, cache, virtual, layers=layers)
  hidden_BTD, cache = model.forward_hidden(tokens_BT, positions_BT, mask_BTS, cache,
                                           virtual=virtual)
  return hidden_BTD, hidden_BTD, cache


def at_last(x_BTX, lengths_B):
  """Each row's entry at its last position (``lengths_B - 1``): ``[B, X]``."""
  return jnp.take_along_axis(x_BTX, (lengths_B - 1)[:, None, None], axis=1)[:, 0]


def prefill(model: Llama, tokens_BT, lengths_B, cache: kvc.KVCache, layers: tuple[int, ...] = (),
            every_position: bool = False):
  """Run the prompts; returns logits and hidden at each row's last prompt token, and the cache.
  With ``layers`` (a multi-layer drafter's ``feature_layers``) the second output is those
  layers' states there instead (``Llama.forward_layers``); with ``every_position`` it is those
  states at every prompt position (``[B, T, X]``: what a drafter's context memory is built
  from)."""
  B, T = tokens_BT.shape
  positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
  valid_BT = positions_BT < lengths_B[:, None]
  mask_BTS = kvc.visible_mask(cache.lengths_B, kvc.causal_mask(valid_BT), cache.size)
  hidden_BTD, feats_BTX, cache = forward_for_drafter(model, tokens_BT, positions_BT, mask_BTS,
                                                     cache, layers)
  feats = feats_BTX if every_position else at_last(feats_BTX, lengths_B)
  return model.logits(at_last(hidden_BTD, lengths_B)), feats, kvc.advance(cache, lengths_B)


@struct.dataclass
class Output:
  """Generated tokens per row. ``tokens_BM[b, :num_B[b]]`` are valid (stop token included)."""

  tokens_BM: jax.Array
  num_B: jax.Array
  stopped_B: jax.Array  # ended on a stop token (else on max_new_tokens)
  steps: jax.Array  # LLM forward passes after the prefill


def record(out: Output, done_B, new_BA, count_B, stop_ids, max_new: int):
  """Append ``count_B`` tokens of ``new_BA`` to each unfinished row; stop at a stop token or at
  ``max_new``. Returns the new output and done flags."""
  A = new_BA.shape[1]
  idx_1A = jnp.arange(A)[None, :]
  is_stop_BA = jnp.isin(new_BA, stop_ids) & (idx_1A < count_B[:, None])
  first_stop_B = jnp.where(is_stop_BA.any(1), jnp.argmax(is_stop_BA, axis=1) + 1, A + 1)
  room_B = max_new - out.num_B
  keep_B = jnp.where(done_B, 0, jnp.minimum(jnp.minimum(count_B, first_stop_B), room_B))
  dest_BA = jnp.where(idx_1A < keep_B[:, None], out.num_B[:, None] + idx_1A, max_new)  # OOB: drop
  tokens = jax.vmap(lambda t, d, n: t.at[d].set(n, mode="drop"))(out.tokens_BM, dest_BA, new_BA)
  stopped_B = out.stopped_B | (~done_B & (first_stop_B <= keep_B))
  num_B = out.num_B + keep_B
  out = out.replace(tokens_BM=tokens, num_B=num_B, stopped_B=stopped_B)
  return out, done_B | stopped_B | (num_B >= max_new)


def empty_output(batch: int, max_new: int) -> Output:
  return Output(tokens_BM=jnp.zeros((batch, max_new), jnp.int32),
                num_B=jnp.zeros((batch,), jnp.int32), stopped_B=jnp.zeros((batch,), bool),
                steps=jnp.zeros((), jnp.int32))


def check_sampling(temperature, top_p, top_k) -> None:
  if np.any(np.asarray(temperature) < 0):
    raise GenerateError(f"temperature must be >= 0, got {temperature}")
  if np.any((np.asarray(top_p) <= 0) | (np.asarray(top_p) > 1)):
    raise GenerateError(f"top_p must be in (0, 1], got {top_p}")
  if np.any(np.asarray(top_k) < 0):
    raise GenerateError(f"top_k must be >= 0, got {top_k}")


def checked_loop(cond: Callable, step: Callable, state, steps_per_check: int):
  """``lax.while_loop(cond, step, state)`` that checks ``cond`` once per ``steps_per_check`` steps.

  On a GPU, XLA runs a while loop of unknown trip count by copying each predicate to the host and
  waiting for it, so the next step's kernels cannot be launched while the current step runs. With
  ``steps_per_check`` k > 1 each outer iteration runs k steps in an inner loop of static trip
  count (which XLA runs without reading anything back), and only the outer loop checks ``cond``.

  ``step(state, live)`` gets ``live``, ``cond`` of its state as a traced bool (None when k = 1:
  every step is live), and must change nothing that matters when it is false; ``keep_unless``
  does that for a state with a ``.cache``. Steps after ``cond`` fails are masked with selects,
  not skipped with ``lax.cond``: a conditional reads its predicate back on a GPU too.
  """
  if steps_per_check == 1:
    return jax.lax.while_loop(cond, lambda s: step(s, None), state)

  def block(s):
    return jax.lax.fori_loop(0, steps_per_check, lambda _, s: step(s, cond(s)), s)

  return jax.lax.while_loop(cond, block, state)


def keep_unless(live, new, old):
  """The state after a step of ``checked_loop``: ``new`` where ``live`` (a traced bool; None:
  always), else ``old``, leaf by leaf, for a state that holds its KV cache as ``.cache``.

  The cache's K/V buffers are always ``new``'s: a step writes only at or past each row's
  committed length (the new tokens' K/V, then the accepted ones moved within those slots), and
  with the lengths kept those slots are scratch that the next forward writes before it reads.
  Selecting them too would copy the whole cache at every step.
  """
  if live is None:
    return new
  pick = lambda n, o: jax.lax.select(live, n, o)
  small = jax.tree.map(pick, new.replace(cache=new.cache.lengths_B),
                       old.replace(cache=old.cache.lengths_B))
  return small.replace(cache=new.cache.replace(lengths_B=small.cache))


def check_steps_per_check(steps_per_check) -> None:
  if (not isinstance(steps_per_check, int) or isinstance(steps_per_check, bool)
      or steps_per_check < 1):
    raise GenerateError(f"steps_per_check must be an integer >= 1, got {steps_per_check!r}")
