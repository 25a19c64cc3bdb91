"""Where the server's model and slot batch live, and the jitted calls that change the batch.

The base LLM is split over the ``model`` axis of a device mesh (tensor parallel, the rules of
``sharding.py``); the drafter is replicated; the slot batch keeps its KV cache split over kv
heads where the axis divides them, everything else replicated. On one device all of this is a
no-op. Each call is jitted once per static shape (admission: prompt bucket and rows; step: rows,
mode and context) with the batch donated, so the batch never leaves the devices; only
``StepOut`` and the first tokens come back. The sampling kind (greedy, sampled, top-k/top-p) is
a run-time argument of one program, so the heavy forward passes compile once per shape.
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
from redrafter_jax.models.invariant import compiler_options
from redrafter_jax.models.llama import Llama
from redrafter_jax.serving import batch as batch_lib
from redrafter_jax.serving import policy as policy_lib

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


def memory_mappings() -> tuple[int, int] | None:
  """The memory mappings this process holds and the kernel's limit per process
  (``vm.max_map_count``), on Linux; None elsewhere."""
  try:
    with open("/proc/self/maps", "rb") as f:
      held = sum(1 for _ in f)
    with open("/proc/sys/vm/max_map_count") as f:
      return held, int(f.read())
  except (OSError, ValueError):
    return None


class MappingBudget:
  """Stops a warm-up that would run out of memory mappings, before it does.

  XLA:CPU maps each compiled kernel's code and data on its own (900-1200 mappings per server
  step program of SmolLM2-135M), and Linux aborts the process once it holds
  ``vm.max_map_count`` (65,530 by default): a server with many programs (row buckets x modes x
  context buckets, plus the admissions) would die mid warm-up with an LLVM error. ``check()``
  before each compile measures what the programs so far took and raises ``ConfigError`` saying
  what to change when the rest would not fit."""

  def __init__(self, programs: int, probe=memory_mappings):
    self.left, self.probe = programs, probe
    self.last = probe()  # None: not Linux, no check
    self.most = 0  # the largest growth one compile caused

  def check(self) -> None:
    now = self.probe()
    if now is None or self.last is None:
      return
    self.most = max(self.most, now[0] - self.last[0])
    self.last = now
    need = now[0] + int(1.05 * self.most * self.left)
    self.left -= 1
    if need > now[1]:
      raise ConfigError(
          f"serving: the warm-up's remaining {self.left + 1} programs would take about "
          f"{need - now[0]} more memory mappings (up to {self.most} per program here), beyond "
          f"the kernel's limit of {now[1]} per process (vm.max_map_count; {now[0]} held now), "
          "and the process would abort. Compile fewer programs (fewer --trees, fewer --slots, "
          "a larger --min-context-bucket or a smaller --max-context) or raise the limit, e.g. "
          "`sysctl -w vm.max_map_count=262144`")


@dataclasses.dataclass(frozen=True)
class Admission:
  """One request's prefill inputs, converted to the dtypes the slot batch holds."""

  slot: int
  bucket: int  # padded prompt length (``prompt_bucket``)
  tokens: np.ndarray  # int32 prompt ids
  seed_lo: np.uint32
  seed_hi: np.uint32
  temperature: np.float32
  top_p: np.float32
  top_k: np.int32
  limit: np.int32  # max_tokens
  filtered: np.bool_  # uses top-k/top-p


class Placement:
  """The device side of an ``Engine``: model state, slot batch and compiled steps."""

  def __init__(self, llm: Llama, drafter: Drafter | None, config, stop_ids: Sequence[int], *,
               mesh=None):
    self.config = config
    self.mesh = mesh if mesh is not None else serving_mesh(1)
    repl = sh.replicated(self.mesh)
    self._drafter_def, self.drafter_state = None, None
    self.draft_embed = None  # the drafter's embedding table, when the LLM's own will not do
    # Output rows hold up to max_tokens; each request's own limit is applied per row.
    self._decode = dataclasses.replace(config.decode, max_new_tokens=config.max_tokens)
    if drafter is not None:
      # The object ``decode`` uses: it splits both models and restricts the draft vocabulary
      # once; the steps below run its step function on the slot batch.
      rd = ReDrafter(llm, drafter, self._decode)
      self._llm_def, llm_state, self._decode = rd.llm_def, rd.llm_state, rd.static_config
      self._drafter_def, self.drafter_state = rd.drafter_def, jax.device_put(rd.drafter_state,
                                                                             repl)
      # The drafter's embedding table in the activations' dtype (decode.draft_embedding):
      # each server step is a call of its own.
      if rd.draft_embed is not None:
        self.draft_embed = jax.device_put(rd.draft_embed, repl)
    else:
      self._llm_def, llm_state = nnx.split(llm)
    # Each tree step mode's settings: the served tree's, and the smaller ones (``trees``) with
    # the same resolved settings otherwise (draft vocabulary, acceptance rule, limits).
    self._trees = config.tree_modes(self._decode) if drafter is not None else {}
    self.llm_state = sh.place(llm_state, sh.state_shardings(llm_state, self.mesh))
    llm_cfg, dtype = llm.config, llm.dtype
    # The attention backend's cache layout and dtype (or the model's override), stacked when
    # the model scans over its layers.
    row = jax.eval_shape(lambda: llm.init_cache(1, 1))
    self._empty = lambda: batch_lib.empty(
        llm_cfg, dtype, config.slots, config.max_context, config.max_tokens,
        config.decode.beam_length, layout=row.layout, cache_dtype=row.k[0].dtype,
        stacked=row.stacked)
    self._batch_sharding = self._shardings(jax.eval_shape(self._empty), llm.config.num_kv_heads,
                                           row.head_axis)
    # The invariant mode's programs keep every bfloat16 rounding (models.invariant)
    self._options = compiler_options(llm.invariant)
    self._new_batch = jax.jit(self._empty, out_shardings=self._batch_sharding)
    self.batch = self._new_batch()
    self.stop_ids = jax.device_put(jnp.asarray(list(stop_ids) or [-1], jnp.int32), repl)
    self._out = (self._batch_sharding, repl)
    self._admit_fn = None
    self._step_fns: dict[tuple[int, str], object] = {}
    self._seen: set[tuple[int, int]] = set()  # (rows, bucket) admitted so far

  def _shardings(self, abstract_batch, num_kv_heads: int, axis: int):
    """Shardings of a slot batch: KV caches split over kv heads (array axis ``axis``) when
    they divide evenly, the rest replicated."""
    model = self.mesh.shape[sh.MODEL]

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

  def warmup(self, timed_runs: int = 5, kinds: Sequence[str] = policy_lib.KINDS,
             progress=None) -> dict[tuple[int, str, str, int], float]:
    """Compile every program the server can meet by running each once: the prefill of each
    prompt bucket and admission row count, and the step for each row bucket, mode and context
    bucket; one program serves every sampling kind (greedy, sampled, filtered). Then each step
    is timed for each sampling kind in ``kinds`` (the median of ``timed_runs``) at each context
    bucket, as a tree's cost relative to an AR step's changes with the context read; returns
    those seconds by (rows, mode, kind, context), the cost table of ``policy.plan``. Then a
    fresh batch: serving never compiles. ``progress(done, total, what, seconds)``: called after
    each program's first run (its compile, or its load from the compilation cache)."""
    programs = [(b, mode, c) for b in self.row_buckets() for mode in self.modes()
                for c in self.context_buckets()]
    admissions = [(T, k) for T in self.buckets() for k in self.admission_rows(T)]
    first_runs = [(f"admission of {k} prompt(s) of {T} tokens",
                   lambda T=T, k=k: self.admit([self.admission(slot, [0] * T, 0, 0.0, 1.0, 0, 1)
                                                for slot in range(k)]))
                  for T, k in admissions]
    first_runs += [(f"{mode} step, {b} rows, context {c}",
                    lambda b=b, mode=mode, c=c: self.step(list(range(b)), [False] * b, False,
                                                          True, mode, c))
                   for b, mode, c in programs]
    budget = MappingBudget(len(first_runs))
    for done, (what, run) in enumerate(first_runs, 1):  # compile
      budget.check()
      t0 = time.perf_counter()
      jax.block_until_ready(run())
      if progress is not None:
        progress(done, len(first_runs), what, time.perf_counter() - t0)
    times = {(b, mode, kind, c): [] for b, mode, c in programs for kind in kinds}
    for _ in range(timed_runs):  # interleaved, so a slow spell of a shared machine hits all
      for b, mode, kind, c in times:
        t0 = time.perf_counter()
        jax.block_until_ready(self.step(list(range(b)), [False] * b, kind == "filtered",
                                        kind == "greedy", mode, c))
        times[b, mode, kind, c].append(time.perf_counter() - t0)
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

  def admission(self, slot: int, prompt: Sequence[int], seed: int, temperature: float,
                top_p: float, top_k: int, max_tokens: int) -> Admission:
    """One request's prefill inputs as the device arrays hold them (host work only: a value
    that does not convert fails this request alone, before any batched call)."""
    filtered = temperature > 0 and (top_p < 1 or top_k > 0)
    T = prompt_bucket(len(prompt), self.config.min_bucket, self.config.max_context)
    return Admission(slot=slot, bucket=T, tokens=np.asarray(prompt, np.int32),
                     seed_lo=np.uint32(seed & 0xFFFFFFFF), seed_hi=np.uint32(seed >> 32),
                     temperature=np.float32(temperature), top_p=np.float32(top_p),
                     top_k=np.int32(top_k), limit=np.int32(max_tokens),
                     filtered=np.bool_(filtered))

  def prefill_rows(self, bucket: int) -> int:
    """The most prompts of length bucket ``bucket`` one admission call prefills: a power of two,
    at most the slot count, with at most ``config.prefill_tokens`` padded tokens (at least 1)."""
    fit = max(self.config.prefill_tokens // bucket, 1)
    return min(self.config.slots, 1 << (fit.bit_length() - 1))

  def admission_rows(self, bucket: int) -> list[int]:
    """The row counts an admission call at ``bucket`` runs with (each a compiled program)."""
    return [b for b in self.row_buckets() if b <= self.prefill_rows(bucket)]

  def group(self, admissions: Sequence[Admission]) -> list[list[Admission]]:
    """Admission calls for ``admissions``: one length bucket per call (in the order buckets
    first appear), at most ``prefill_rows`` requests each."""
    by_bucket: dict[int, list[Admission]] = {}
    for a in admissions:
      by_bucket.setdefault(a.bucket, []).append(a)
    return [same[i:i + self.prefill_rows(T)] for T, same in by_bucket.items()
            for i in range(0, len(same), self.prefill_rows(T))]

  def admit(self, admissions: Sequence[Admission]) -> jax.Array:
    """Dispatch one prefill of ``admissions`` (one ``group``: same bucket, at most
    ``prefill_rows``) into their slots; returns their first tokens (device ``[k]``, padding
    rows past ``len(admissions)``) without waiting for them."""
    T = admissions[0].bucket
    n = len(admissions)
    if any(a.bucket != T for a in admissions) or not 1 <= n <= self.prefill_rows(T):
      raise ValueError(f"an admission call takes 1 to {self.prefill_rows(T)} prompts of one "
                       f"bucket, got {n} of buckets {sorted({a.bucket for a in admissions})}")
    if self._admit_fn is None:
      llm_def = self._llm_def

      def admit(llm_state, batch, *args):
        return batch_lib.admit(nnx.merge(llm_def, llm_state), batch, *args)

      self._admit_fn = jax.jit(admit, donate_argnums=(1,), out_shardings=self._out,
                               compiler_options=self._options)
    k = policy_lib.bucket_for(n, self.admission_rows(T))
    if (k, T) not in self._seen:
      self._seen.add((k, T))
      log.info("first admission of %d prompts of bucket %d: compiling its prefill", k, T)
    rows = list(admissions) + [admissions[0]] * (k - n)  # padding: prefilled, written nowhere
    tokens_kT = np.zeros((k, T), np.int32)
    for i, a in enumerate(rows):
      tokens_kT[i, :len(a.tokens)] = a.tokens
    field = lambda name: np.stack([getattr(a, name) for a in rows])
    slots_k = np.asarray([a.slot for a in admissions] + [self.config.slots] * (k - n), np.int32)
    self.batch, first_k = self._admit_fn(
        self.llm_state, self.batch, slots_k, tokens_kT,
        np.asarray([len(a.tokens) for a in rows], np.int32), field("seed_lo"), field("seed_hi"),
        field("temperature"), field("top_p"), field("top_k"), field("limit"), self.stop_ids,
        field("filtered"))
    return first_k

  def row_buckets(self) -> list[int]:
    """The sub-batch sizes a step runs on: powers of two below the slot count, and all slots."""
    return policy_lib.row_buckets(self.config.slots)

  def modes(self) -> tuple[str, ...]:
    """Step kinds: plain AR always; with a drafter, a tree step per smaller tree
    (``EngineConfig.trees``, "spec:WxL...") and last the served tree's ("spec")."""
    if not self.config.speculative:
      return ("ar",)
    return ("ar", *(m for m in self._trees if m != "spec"), "spec")

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
    request has temperature 0 (a program of its own that accepts by argmax). ``mode``: one of
    ``modes()``: "spec" (ReDrafter's served tree; the default with a drafter), a smaller tree's
    "spec:WxL..." or "ar". ``context``: a ``context_buckets()`` width
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
    self.batch, out = fn(self.llm_state, self.drafter_state, self.draft_embed, self.batch,
                         self.stop_ids, np.asarray(rows, np.int32), np.asarray(live, bool),
                         np.int32(kind))
    return out

  def _make_step(self, rows: int, mode: str, context: int):
    llm_def, drafter_def = self._llm_def, self._drafter_def
    dcfg = self._trees.get(mode)  # None: AR
    whole = rows == self.config.slots  # the bucket of all slots: no gather (rows = 0..B-1)
    # Every mode returns the served tree's width of tokens per row (the batch's output shape).
    width = self._decode.beam_length if self.config.speculative else 1
    written = dcfg.num_tree_tokens if dcfg is not None else 1  # cache slots a step writes

    def step(llm_state, drafter_state, embed_VD, batch, stop_ids, idx_b, live_b, kind):
      llm = nnx.merge(llm_def, llm_state)
      sub = batch_lib.release(batch if whole else batch_lib.take_rows(batch, idx_b, context),
                              live_b)
      start_b = sub.state.cache.lengths_B  # the step writes only from here on
      if dcfg is not None:
        sub, out = batch_lib.spec_step(llm, nnx.merge(drafter_def, drafter_state), sub,
                                       stop_ids, dcfg, kind, context=context, embed_VD=embed_VD,
                                       width=width)
      else:
        sub, out = batch_lib.ar_step(llm, sub, stop_ids, kind, width=width, context=context)
      if whole:
        return sub, out
      return batch_lib.put_rows(batch, idx_b, sub, (start_b, written)), out

    return jax.jit(step, donate_argnums=(3,), out_shardings=self._out,
                   compiler_options=self._options)
