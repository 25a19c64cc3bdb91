"""Where the server's model and slot batch live, and the jitted calls that change the batch.

The base LLM is split over the ``model`` axis of a device mesh (tensor parallel, the rules of
``sharding.py``); the drafter is replicated; the slot batch keeps its KV cache split over kv
heads where the axis divides them, everything else replicated. On one device all of this is a
no-op. Each call is jitted once per static shape (admission: prompt bucket and rows; step: rows,
mode and context) with the batch donated, so the batch never leaves the devices; only
``StepOut`` and the first tokens come back. The sampling kind (greedy, sampled, top-k/top-p) is
a run-time argument of one program, so the heavy forward passes compile once per shape.

Programs are compiled ahead of time (``compile``: lowered from the arrays' shapes, so another
thread can compile while the engine serves) and kept by key: ``("admit", bucket, rows)`` and
``("step", rows, mode, context)``. An admission runs on the cheapest compiled program that
covers it (a larger bucket or more rows only pad), so a server can start serving once a
*covering* set is compiled (``cover_programs``) and compile the rest (``rest_programs``) in the
background; a program nothing covers is compiled when first needed.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from redrafter_jax import sharding as sh
from redrafter_jax.config import ConfigError
from redrafter_jax.hostmem import memory_mappings, release_free_memory, resident_bytes
from redrafter_jax.inference import step as step_lib
from redrafter_jax.inference.beam_search import attends_to_context
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


class MemoryLimit:
  """Stops a background compile before it takes the process's resident memory past ``limit``
  bytes.

  Every program compiled and kept holds host memory for as long as the server runs (XLA:CPU's
  executable: tens of MB per server step program of SmolLM2-135M, about twice that when loaded
  from the compilation cache), so a server that compiles every program it could meet ends far
  above what its weights and cache take. ``check(kinds)`` before each compile estimates what
  the programs of ``kinds`` about to compile will add (per kind, such as an admission or a
  step mode, the most that one of that kind has added so far, measured between checks; before
  any, the most of any kind) and raises ``ConfigError`` when the resident memory now plus that
  would pass the limit; the server then goes on with the programs it has (the covering set
  serves any request, padded to a larger program). A step group's modes are checked together
  (only a whole group is used). Serving itself can still add a little beyond the limit."""

  def __init__(self, limit: int, probe=resident_bytes):
    self.limit, self.probe = limit, probe
    self.last = probe()  # None: no /proc, no check
    self.most: dict[str, int] = {}  # kind -> the largest growth one program of it caused
    self.previous: str | None = None  # the kind checked last (compiled since)

  def estimate(self, kind: str) -> int:
    return self.most.get(kind, max(self.most.values(), default=0))

  def check(self, kinds: Sequence[str]) -> None:
    now = self.probe()
    if now is None or self.last is None:
      return
    if self.previous is not None:
      self.most[self.previous] = max(self.most.get(self.previous, 0), now - self.last)
    self.last, self.previous = now, kinds[0]
    need = sum(self.estimate(kind) for kind in kinds)
    if now + need > self.limit:
      raise ConfigError(
          f"resident memory {now / 1e9:.2f} GB plus about {need / 1e6:.0f} MB for the next "
          f"{len(kinds)} program(s) would pass the memory limit of {self.limit / 1e9:.2f} GB "
          "(serve.memory_limit_gb, --memory-limit-gb); serving goes on with the programs "
          "compiled, padding requests to larger ones")


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
    # A multi-layer drafter reads several layers' states: every slot carries them as its h, and
    # every step (AR ones too) keeps them current.
    self.layers = step_lib.drafter_layers(drafter) if drafter is not None else ()
    # A drafter with a context memory takes part in admission (the prompts' memory) and in AR
    # steps too (the memory of the tokens they commit).
    self._attends = attends_to_context(drafter)
    memory = (drafter.config.context_attention, drafter.dtype) if self._attends else None
    self._empty = lambda: batch_lib.empty(
        llm_cfg, dtype, config.slots, config.max_context, config.max_tokens,
        config.decode.beam_length, layout=row.layout, cache_dtype=row.k[0].dtype,
        stacked=row.stacked, layers=self.layers, memory=memory)
    self._batch_sharding = self._shardings(jax.eval_shape(self._empty), llm.config.num_kv_heads,
                                           row.head_axis)
    # The invariant mode's programs keep every bfloat16 rounding (models.invariant)
    self._options = compiler_options(llm.invariant)
    self._new_batch = jax.jit(self._empty, out_shardings=self._batch_sharding)
    self.batch = self._new_batch()
    self._batch_shapes = self._shape(self.batch)  # every batch alike: ``compile`` lowers from it
    self.stop_ids = jax.device_put(jnp.asarray(list(stop_ids) or [-1], jnp.int32), repl)
    self._out = (self._batch_sharding, repl)
    self._repl = repl
    # Compiled programs by key (``program_name``); ``compile`` adds to it from any thread.
    self._programs: dict[tuple, object] = {}
    self.dropped: set[tuple] = set()  # programs compiled, then let go (``drop``)
    self._lock = threading.Lock()
    # True: an admission runs on its bucket's own program, compiled when first needed. False
    # (while a background compile fills in the programs): on the cheapest compiled cover.
    self.compile_on_demand = True

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

  def admission_programs(self) -> list[tuple]:
    """Every admission program: each prompt bucket at each of its admission row counts."""
    return [("admit", T, k) for T in self.buckets() for k in self.admission_rows(T)]

  def step_programs(self) -> list[tuple]:
    """Every step program: each row bucket, mode and context bucket."""
    return [("step", b, mode, c) for b in self.row_buckets() for mode in self.modes()
            for c in self.context_buckets()]

  def cover_programs(self) -> list[tuple]:
    """The fewest programs that serve any request without a long wait: one prompt of the
    largest bucket (every prompt pads into it, and a burst is admitted one prompt per call),
    one prompt of the bucket of half the smallest context (``short_bucket``: a prompt padded
    to the largest bucket prefills all of it, which takes many times longer; docs/serving.md),
    and each mode's step over all slots at the largest context (it holds any rows and any
    context)."""
    cfg = self.config
    admit = sorted({max(self.buckets()), self.short_bucket()}, reverse=True)
    return [("admit", T, 1) for T in admit] + [
        ("step", cfg.slots, mode, max(self.context_buckets())) for mode in self.modes()]

  def short_bucket(self) -> int:
    """The prompt bucket of half the smallest context bucket: a request whose prompt and reply
    fit that context (those the first steps compiled serve) has a prompt shorter than it."""
    return prompt_bucket(max(min(self.context_buckets()) // 2, 1), self.config.min_bucket,
                         max(self.buckets()))

  def rest_programs(self) -> list[tuple]:
    """The programs ``cover_programs`` leaves out, in the order they pay once compiled (what a
    memory limit cuts is the end of it: ``MemoryLimit``): single-prompt admissions by bucket
    (a short prompt no longer pads to a larger bucket; each holds less memory than a step),
    then the steps by context, and within a context the row buckets of the two ends of load
    first: one row (a lone request, where a draft tree pays most) and all slots (a full
    server; without its own program a full batch steps at the largest context), then the
    others by size (all modes of one row bucket together, as the policy compares them); then
    the admissions of several prompts (bursts)."""
    cover = set(self.cover_programs())
    admit = [key for key in self.admission_programs() if key not in cover]
    ends = (1, self.config.slots)
    steps = sorted((key for key in self.step_programs() if key not in cover),
                   key=lambda key: (key[3], key[1] not in ends, key[1],
                                    self.modes().index(key[2])))
    return [key for key in admit if key[2] == 1] + steps + [key for key in admit if key[2] > 1]

  @staticmethod
  def program_name(key: tuple) -> str:
    if key[0] == "admit":
      return f"admission of {key[2]} prompt(s) of {key[1]} tokens"
    return f"{key[2]} step, {key[1]} rows, context {key[3]}"

  def compiled(self, key: tuple) -> bool:
    return key in self._programs

  def compile(self, key: tuple) -> float:
    """Compile the program ``key`` (a no-op when it is compiled) from the arrays' shapes, not
    their values, so any thread may call it while the engine serves; returns its seconds."""
    if key in self._programs:
      return 0.0
    t0 = time.perf_counter()
    if key[0] == "admit":
      fn, args = self._admit_jit(), self._admit_shapes(key[1], key[2])
    else:
      fn, args = self._step_jit(*key[1:]), self._step_shapes(key[1])
    compiled = fn.lower(*args).compile()
    with self._lock:
      self._programs.setdefault(key, compiled)
    release_free_memory()  # what the compiler used
    return time.perf_counter() - t0

  def warmup(self, timed_runs: int = 5, kinds: Sequence[str] = policy_lib.KINDS,
             progress=None, keys: Sequence[tuple] | None = None, timed: bool = True
             ) -> dict[tuple[int, str, str, int], float]:
    """Compile ``keys`` (default: every program the server can meet, ``admission_programs``
    and ``step_programs``), then time their steps (``time_steps``; not when ``timed`` is
    False); returns those seconds, the cost table of ``policy.plan``. ``progress(done, total,
    what, seconds)``: called after each compile (or load from the compilation cache)."""
    keys = list(keys if keys is not None else self.admission_programs() + self.step_programs())
    budget = MappingBudget(len(keys))
    for done, key in enumerate(keys, 1):
      budget.check()
      seconds = self.compile(key)
      if progress is not None:
        progress(done, len(keys), self.program_name(key), seconds)
    if not timed:
      return {}
    return self.time_steps([key for key in keys if key[0] == "step"], timed_runs, kinds)

  def time_steps(self, keys: Sequence[tuple], timed_runs: int = 5,
                 kinds: Sequence[str] = policy_lib.KINDS,
                 stop: Callable[[], bool] | None = None
                 ) -> dict[tuple[int, str, str, int], float]:
    """Seconds of each compiled step ``("step", rows, mode, context)`` for each sampling kind in
    ``kinds`` (the median of ``timed_runs``), by (rows, mode, kind, context): a tree's cost
    relative to an AR step's changes with the rows and the context read. Runs on the slot
    batch, then starts a fresh one: call it while no slot holds a request. ``stop``, asked
    after each round (one call of every step): True ends the timing there, with the medians of
    the rounds run (at least one), so that a request arriving meanwhile waits one round at
    most."""
    times = {(b, mode, kind, c): [] for _, b, mode, c in keys for kind in kinds}
    for i in range(timed_runs):  # interleaved, so a slow spell of a shared machine hits all
      if i and stop is not None and stop():
        break
      for b, mode, kind, c in times:
        t0 = time.perf_counter()
        jax.block_until_ready(self.step(list(range(b)), [False] * b, kind == "filtered",
                                        kind == "greedy", mode, c))
        times[b, mode, kind, c].append(time.perf_counter() - t0)
    self.reset()
    return {key: float(np.median(t)) for key, t in times.items()}

  def drop(self, keys: Sequence[tuple]) -> None:
    """Let the compiled programs ``keys`` go, and the memory their executables hold (tens of MB
    each, little of it machine code): the engine drops the steps it has measured will never pay
    (``policy.dominated``) and asks for them no more (a later call would compile them again)."""
    with self._lock:
      for key in keys:
        if self._programs.pop(key, None) is not None:
          self.dropped.add(key)
    release_free_memory()

  def compiled_programs(self) -> int:
    """How many programs are compiled (grows when something compiles)."""
    return len(self._programs)

  def batch_intact(self) -> bool:
    """False once a failed call has consumed (donated) the batch's buffers."""
    return not any(x.is_deleted() for x in jax.tree.leaves(self.batch))

  def reset(self) -> None:
    """A fresh batch (all slots free), e.g. after a failed step left donated buffers behind.
    The old one's buffers are freed first, so the two never take memory at once."""
    for x in jax.tree.leaves(self.batch):
      if not x.is_deleted():
        x.delete()
    self.batch = self._new_batch()
    release_free_memory()

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

  def admission_cover(self, bucket: int, rows: int) -> tuple | None:
    """The compiled admission program with the fewest padded tokens that takes ``rows``
    prompts of ``bucket`` (a bucket and a row count at least theirs), or None."""
    fits = [key for key in list(self._programs)
            if key[0] == "admit" and key[1] >= bucket and key[2] >= rows]
    return min(fits, key=lambda key: (key[1] * key[2], key[1]), default=None)

  def admission_capacity(self, bucket: int) -> int:
    """The most prompts of ``bucket`` one admission call takes now: ``prefill_rows``, or
    without ``compile_on_demand`` the most that a compiled program covering it takes."""
    most = self.prefill_rows(bucket)
    if self.compile_on_demand or self.compiled(("admit", bucket, most)):
      return most
    covers = [key[2] for key in list(self._programs) if key[0] == "admit" and key[1] >= bucket]
    return min(max(covers), most) if covers else most

  def group(self, admissions: Sequence[Admission]) -> list[list[Admission]]:
    """Admission calls for ``admissions``: one length bucket per call (in the order buckets
    first appear), at most ``admission_capacity`` requests each."""
    by_bucket: dict[int, list[Admission]] = {}
    for a in admissions:
      by_bucket.setdefault(a.bucket, []).append(a)
    return [same[i:i + cap] for T, same in by_bucket.items()
            for cap in [self.admission_capacity(T)] for i in range(0, len(same), cap)]

  def admit(self, admissions: Sequence[Admission]) -> jax.Array:
    """Dispatch one prefill of ``admissions`` (one ``group``: same bucket, at most
    ``prefill_rows``) into their slots; returns their first tokens (device ``[k]``, padding
    rows past ``len(admissions)``) without waiting for them. Runs on the bucket's own program
    (compiled first if need be) or, without ``compile_on_demand``, on ``admission_cover``'s."""
    T = admissions[0].bucket
    n = len(admissions)
    if any(a.bucket != T for a in admissions) or not 1 <= n <= self.prefill_rows(T):
      raise ValueError(f"an admission call takes 1 to {self.prefill_rows(T)} prompts of one "
                       f"bucket, got {n} of buckets {sorted({a.bucket for a in admissions})}")
    key = None if self.compile_on_demand else self.admission_cover(T, n)
    if key is None:
      key = ("admit", T, policy_lib.bucket_for(n, self.admission_rows(T)))
    if key not in self._programs:
      log.info("first admission of %d prompts of bucket %d: compiling its prefill", key[2], T)
      self.compile(key)
    _, T, k = key
    rows = list(admissions) + [admissions[0]] * (k - n)  # padding: prefilled, written nowhere
    tokens_kT = np.zeros((k, T), np.int32)
    for i, a in enumerate(rows):
      tokens_kT[i, :len(a.tokens)] = a.tokens
    field = lambda name: np.stack([getattr(a, name) for a in rows])
    slots_k = np.asarray([a.slot for a in admissions] + [self.config.slots] * (k - n), np.int32)
    self.batch, first_k = self._programs[key](
        self.llm_state, self._admit_drafter(), self.batch, slots_k, tokens_kT,
        np.asarray([len(a.tokens) for a in rows], np.int32), field("seed_lo"), field("seed_hi"),
        field("temperature"), field("top_p"), field("top_k"), field("limit"), self.stop_ids,
        field("filtered"))
    return first_k

  def _admit_drafter(self):
    """The drafter state admission reads: a context-attention drafter's (None otherwise)."""
    return self.drafter_state if self._attends else None

  def _admit_jit(self):
    llm_def, layers = self._llm_def, self.layers
    drafter_def = self._drafter_def if self._attends else None

    def admit(llm_state, drafter_state, batch, *args):
      drafter = None if drafter_def is None else nnx.merge(drafter_def, drafter_state)
      return batch_lib.admit(nnx.merge(llm_def, llm_state), batch, *args, layers=layers,
                             drafter=drafter)

    return jax.jit(admit, donate_argnums=(2,), out_shardings=self._out,
                   compiler_options=self._options)

  def _shape(self, tree):
    """Shapes, dtypes and shardings of device arrays (what ``compile`` lowers from)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        tree)

  def _host(self, shape, dtype):
    """A host argument's shape: numpy arrays, placed replicated."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=self._repl)

  def _admit_shapes(self, T: int, k: int) -> tuple:
    h = self._host
    return (self._shape(self.llm_state), self._shape(self._admit_drafter()), self._batch_shapes,
            h((k,), np.int32),
            h((k, T), np.int32), h((k,), np.int32), h((k,), np.uint32), h((k,), np.uint32),
            h((k,), np.float32), h((k,), np.float32), h((k,), np.int32), h((k,), np.int32),
            self._shape(self.stop_ids), h((k,), np.bool_))

  def _step_shapes(self, rows: int) -> tuple:
    h = self._host
    return (self._shape(self.llm_state), self._shape(self.drafter_state),
            self._shape(self.draft_embed), self._batch_shapes, self._shape(self.stop_ids),
            h((rows,), np.int32), h((rows,), np.bool_), h((), np.int32))

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
    key = ("step", b, mode, context)
    if key not in self._programs:
      log.info("first %s: compiling it", self.program_name(key))
      self.compile(key)
    kind = policy_lib.KINDS.index(policy_lib.kind_of(filtered, greedy))
    self.batch, out = self._programs[key](
        self.llm_state, self.drafter_state, self.draft_embed, self.batch, self.stop_ids,
        np.asarray(rows, np.int32), np.asarray(live, bool), np.int32(kind))
    return out

  def _step_jit(self, rows: int, mode: str, context: int):
    llm_def, drafter_def, layers = self._llm_def, self._drafter_def, self.layers
    attends = self._attends
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
        drafter = nnx.merge(drafter_def, drafter_state) if attends else None
        sub, out = batch_lib.ar_step(llm, sub, stop_ids, kind, width=width, context=context,
                                     layers=layers, drafter=drafter, embed_VD=embed_VD)
      if whole:
        return sub, out
      return batch_lib.put_rows(batch, idx_b, sub, (start_b, written)), out

    return jax.jit(step, donate_argnums=(3,), out_shardings=self._out,
                   compiler_options=self._options)
