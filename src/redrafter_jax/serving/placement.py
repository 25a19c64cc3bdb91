"""Where the server's model and slot batch live, and the jitted calls that change the batch.

The base LLM is split over the ``model`` axis of a device mesh (tensor parallel, the rules of
``sharding.py``); the drafter is replicated; the slot batch keeps its KV cache split over kv
heads where the axis divides them, everything else replicated. On one device all of this is a
no-op. Each call is jitted once per static shape (prompt bucket; step rows and mode) with the
batch donated, so the batch never leaves the devices; only ``StepOut`` and the first token come
back. The sampling kind (greedy, sampled, top-k/top-p) is a run-time argument of one program, so
the heavy forward passes compile once per shape.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from redrafter_jax import sharding as sh
from redrafter_jax.config import ConfigError
from redrafter_jax.inference.decode import ReDrafter
from redrafter_jax.models import kv_cache as kvc
from redrafter_jax.models.drafter import Drafter
from redrafter_jax.models.llama import Llama
from redrafter_jax.serving import batch as batch_lib
from redrafter_jax.serving import policy as policy_lib
from redrafter_jax.serving import rows as rows_lib

log = logging.getLogger(__name__)


def serving_mesh(devices: int | None = None) -> jax.sharding.Mesh:
  """A ``(data=1, model=n)`` mesh over the first ``n`` devices (default: all local devices)."""
  available = jax.local_devices()
  n = len(available) if devices is None else devices
  if not isinstance(n, int) or not 1 <= n <= len(available):
    raise ConfigError(f"serving: devices must be in [1, {len(available)}], got {devices!r}")
  return sh.make_mesh(data=1, model=n, devices=available[:n])


def prompt_bucket(n: int, minimum: int, maximum: int) -> int:
  """Padded prompt length: a power of two >= ``minimum``, at most ``maximum``."""
  return min(max(minimum, 1 << max(n - 1, 0).bit_length()), maximum)


class Placement:
  """The device side of an ``Engine``: model state, slot batch and compiled steps."""

  def __init__(self, llm: Llama, drafter: Drafter | None, config, stop_ids: Sequence[int], *,
               mesh=None):
    self.config = config
    self.mesh = mesh if mesh is not None else serving_mesh(1)
    repl = sh.replicated(self.mesh)
    self._drafter_def, self.drafter_state = None, None
    # Output rows hold up to max_tokens; each request's own limit is applied per row.
    self._decode = dataclasses.replace(config.decode, max_new_tokens=config.max_tokens)
    if drafter is not None:
      # The object ``decode`` uses: it splits both models and restricts the draft vocabulary
      # once; the steps below run its step function on the slot batch.
      rd = ReDrafter(llm, drafter, self._decode)
      self._llm_def, llm_state, self._decode = rd.llm_def, rd.llm_state, rd.static_config
      self._drafter_def, self.drafter_state = rd.drafter_def, jax.device_put(rd.drafter_state,
                                                                             repl)
    else:
      self._llm_def, llm_state = nnx.split(llm)
    self.llm_state = sh.place(llm_state, sh.state_shardings(llm_state, self.mesh))
    llm_cfg, dtype = llm.config, llm.dtype
    # The attention backend's cache layout and dtype (or the model's override).
    row = jax.eval_shape(lambda: llm.init_cache(1, 1))
    layout, cache_dtype = row.layout, row.k[0].dtype
    self._empty = lambda: batch_lib.empty(
        llm_cfg, dtype, config.slots, config.max_context, config.max_tokens,
        config.decode.beam_length, layout=layout, cache_dtype=cache_dtype)
    self._batch_sharding = self._shardings(jax.eval_shape(self._empty), llm.config.num_kv_heads,
                                           layout)
    self._new_batch = jax.jit(self._empty, out_shardings=self._batch_sharding)
    self.batch = self._new_batch()
    self.stop_ids = jax.device_put(jnp.asarray(list(stop_ids) or [-1], jnp.int32), repl)
    self._out = (self._batch_sharding, repl)
    self._admit_fn = None
    self._step_fns: dict[tuple[int, str], object] = {}
    self._seen: set[int] = set()

  def _shardings(self, abstract_batch, num_kv_heads: int, layout: str):
    model = self.mesh.shape[sh.MODEL]
    axis = kvc.HEAD_AXIS[layout]  # KV caches split over kv heads when they divide evenly

    def one(path, leaf):
      name = sh.path_name(path)
      spec = P()
      if re.search(r"cache\.(k|v)\.\d+$", name) and num_kv_heads % model == 0:
        spec = P(*[sh.MODEL if i == axis else None for i in range(leaf.ndim)])
      return NamedSharding(self.mesh, spec)

    return jax.tree_util.tree_map_with_path(one, abstract_batch)

  def buckets(self) -> list[int]:
    """Every padded prompt length a request can have (prompts leave room for scratch + 1)."""
    cfg = self.config
    longest = max(cfg.max_context - cfg.scratch - 1, 1)
    return sorted({prompt_bucket(n, cfg.min_bucket, cfg.max_context)
                   for n in range(1, longest + 1)})

  def warmup(self, timed_runs: int = 5) -> dict[tuple[int, str, str], float]:
    """Compile every program the server can meet by running each once: the prefill of each
    prompt bucket and the step for each row bucket and mode (AR, tree); one program serves
    every sampling kind (greedy, sampled, filtered). Each step and kind is then timed
    (the median of ``timed_runs``); returns those seconds by (rows, mode, kind), the cost table of
    ``policy.choose``. Then a fresh batch: serving never compiles."""
    for T in self.buckets():
      self.admit(0, [0] * T, 0, 0.0, 1.0, 0, 1)
    programs = [(b, mode, c) for b in self.row_buckets() for mode in self.modes()
                for c in self.context_buckets()]
    for b, mode, c in programs:  # compile
      jax.block_until_ready(self.step(list(range(b)), [False] * b, False, True, mode, c))
    # Timed at the largest context (the policy's costs are an upper bound for any context).
    times = {(b, mode, kind): [] for b in self.row_buckets() for mode in self.modes()
             for kind in policy_lib.KINDS}
    for _ in range(timed_runs):  # interleaved, so a slow spell of a shared machine hits all
      for b, mode, kind in times:
        t0 = time.perf_counter()
        jax.block_until_ready(self.step(list(range(b)), [False] * b, kind == "filtered",
                                        kind == "greedy", mode))
        times[b, mode, kind].append(time.perf_counter() - t0)
    seconds = {key: float(np.median(t)) for key, t in times.items()}
    self.reset()
    return seconds

  def compiled_programs(self) -> int:
    """How many programs the jitted calls hold (grows when something compiles)."""
    fns = [self._admit_fn] * (self._admit_fn is not None) + list(self._step_fns.values())
    return sum(fn._cache_size() for fn in fns)

  def batch_intact(self) -> bool:
    """False once a failed call has consumed (donated) the batch's buffers."""
    return not any(x.is_deleted() for x in jax.tree.leaves(self.batch))

  def reset(self) -> None:
    """A fresh batch (all slots free), e.g. after a failed step left donated buffers behind."""
    self.batch = self._new_batch()

  def admit(self, slot: int, prompt: list[int], seed: int, temperature: float, top_p: float,
            top_k: int, max_tokens: int) -> jax.Array:
    """Dispatch the prefill of ``prompt`` into ``slot``; returns the request's first token as a
    device scalar, without waiting for it."""
    cfg = self.config
    filtered = temperature > 0 and (top_p < 1 or top_k > 0)
    if self._admit_fn is None:
      llm_def = self._llm_def

      def admit(llm_state, batch, *args):
        return batch_lib.admit(nnx.merge(llm_def, llm_state), batch, *args)

      self._admit_fn = jax.jit(admit, donate_argnums=(1,), out_shardings=self._out)
    T = prompt_bucket(len(prompt), cfg.min_bucket, cfg.max_context)
    if T not in self._seen:
      self._seen.add(T)
      log.info("first prompt of bucket %d: compiling its prefill", T)
    tokens_1T = np.zeros((1, T), np.int32)
    tokens_1T[0, :len(prompt)] = prompt
    self.batch, first = self._admit_fn(
        self.llm_state, self.batch, np.int32(slot), tokens_1T, np.int32(len(prompt)),
        np.uint32(seed & 0xFFFFFFFF), np.uint32(seed >> 32), np.float32(temperature),
        np.float32(top_p), np.int32(top_k), np.int32(max_tokens), self.stop_ids,
        np.bool_(filtered))
    return first

  def row_buckets(self) -> list[int]:
    """The sub-batch sizes a step runs on: powers of two below the slot count, and all slots."""
    return policy_lib.row_buckets(self.config.slots)

  def modes(self) -> tuple[str, ...]:
    """Step kinds: plain AR always; ReDrafter's tree step when the engine has a drafter."""
    return ("ar", "spec") if self.config.speculative else ("ar",)

  def context_buckets(self) -> tuple[int, ...]:
    """The cache widths a step may read (``kv_cache.context_buckets``, from
    ``config.min_context_bucket`` up to ``max_context``): each is a program per row bucket and
    mode, compiled at warm-up."""
    cfg = self.config
    return kvc.context_buckets(cfg.max_context, min(cfg.min_context_bucket, cfg.max_context))

  def step(self, rows: Sequence[int], live: Sequence[bool], filtered: bool,
           greedy: bool = False, mode: str | None = None,
           context: int | None = None) -> batch_lib.StepOut:
    """Dispatch one step for the slots ``rows`` (a row bucket's worth, distinct); returns the
    device ``StepOut`` of those rows, in that order, without waiting for it. ``live[i]``: slot
    ``rows[i]`` still holds a request (the others are marked done first). ``greedy``: every live
    request has temperature 0 (a program of its own that accepts by argmax). ``mode``: "spec"
    (ReDrafter; the default with a drafter) or "ar". ``context``: a ``context_buckets()`` width
    holding every live row's tokens, up to its limit, and one step's scratch (None: the whole
    cache)."""
    mode = mode or self.modes()[-1]
    context = context or self.config.max_context
    b = len(rows)
    if b not in self.row_buckets() or mode not in self.modes() or (
        context not in self.context_buckets()):
      raise ValueError(f"no step for {b} rows in mode {mode!r} at context {context}")
    fn = self._step_fns.get((b, mode, context))
    if fn is None:
      fn = self._step_fns[b, mode, context] = self._make_step(b, mode, context)
    kind = policy_lib.KINDS.index(policy_lib.kind_of(filtered, greedy))
    self.batch, out = fn(self.llm_state, self.drafter_state, self.batch, self.stop_ids,
                         np.asarray(rows, np.int32), np.asarray(live, bool), np.int32(kind))
    return out

  def _make_step(self, rows: int, mode: str, context: int):
    llm_def, drafter_def, dcfg = self._llm_def, self._drafter_def, self._decode
    whole = rows == self.config.slots  # the bucket of all slots: no gather (rows = 0..B-1)
    width = dcfg.beam_length if self.config.speculative else 1

    def step(llm_state, drafter_state, batch, stop_ids, idx_b, live_b, kind):
      llm = nnx.merge(llm_def, llm_state)
      sub = batch_lib.release(batch if whole else rows_lib.take(batch, idx_b), live_b)
      if mode == "spec":
        sub, out = batch_lib.spec_step(llm, nnx.merge(drafter_def, drafter_state), sub,
                                       stop_ids, dcfg, kind, context=context)
      else:
        sub, out = batch_lib.ar_step(llm, sub, stop_ids, kind, width=width, context=context)
      return (sub if whole else rows_lib.put(batch, idx_b, sub)), out

    return jax.jit(step, donate_argnums=(2,), out_shardings=self._out)
