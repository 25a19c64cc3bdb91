"""The serving engine: a fixed number of batch slots, continuous batching at step granularity.

The engine owns one thread, the only one that touches JAX after start-up. Its loop:
  1. move waiting requests into free slots (``batch.admit``: the prompts of one length bucket
     prefilled together, up to ``prefill_tokens`` padded tokens per call, each written into its
     slot's row on the device; dispatched, not waited for);
  2. dispatch one step for the occupied slots: on a row bucket that holds them (``rows``: the
     step costs what its rows cost, not what all slots cost), as a ReDrafter tree step (the
     served tree, or a smaller one of ``EngineConfig.trees``) or a plain AR step: the bucket
     and mode giving them the most tokens per second (``policy``: step times measured at
     warm-up and corrected by the steps served, acceptance observed while serving; a mode not
     chosen runs now and then, so that its cost is also the served one);
  3. while that step runs, read the previous step's tokens (and the new requests' first tokens),
     turn them into text (``TextStream``: stop strings, partial characters), and hand events to
     each request's ``sink``. A request that ends (stop token, stop string, max_tokens,
     cancelled) frees its slot at once; whatever the step already in flight computed for it is
     dropped (each step remembers which request held each of its rows).
Requests wait in a bounded queue; ``submit`` raises ``QueueFull`` beyond it instead of blocking.
A fault in one request's own work (its prefill, its detokenization or stop strings) fails that
request alone (``Failed``, its slot freed) and the others carry on; only a failed batched step,
which every row shares, fails all active requests (and starts a fresh batch).
Sinks are called from the engine thread and must not block (the HTTP layer hands events over
to its event loop).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import queue
import secrets
import threading
import time
from typing import Callable, Sequence

import jax

from redrafter_jax.config import ConfigError, DecodeConfig
from redrafter_jax.hostmem import status_kb
from redrafter_jax.models.drafter import Drafter
from redrafter_jax.models.llama import Llama
from redrafter_jax.serving import policy as policy_lib
from redrafter_jax.serving.metrics import ServingMetrics
from redrafter_jax.serving.placement import MappingBudget, MemoryLimit, Placement
from redrafter_jax.serving.request import (Delta, EngineStopped, Event, Failed, Finished,
                                           GenerationRequest, QueueFull, RequestError, validate)
from redrafter_jax.serving.textstream import TextStream, decoder_for

log = logging.getLogger(__name__)
# The log line of each pause between requests in which the engine times newly compiled steps
# (``Engine._adopt_compiled``), followed by its seconds.
PAUSE_LOG = "paused between requests to time steps:"

__all__ = ["Delta", "Engine", "EngineConfig", "EngineStopped", "Event", "Failed", "Finished",
           "GenerationRequest", "Handle", "QueueFull", "RequestError"]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  slots: int = 8  # rows decoded together (B)
  max_context: int = 2048  # cache slots per row: prompt + max_tokens + one step's scratch
  max_tokens: int = 512  # the most tokens one request may ask for
  default_max_tokens: int = 256  # when a request does not say (cut to what fits the context)
  max_queue: int = 64  # requests waiting for a slot before new ones get QueueFull
  speculative: bool = True  # False: plain autoregressive steps (for comparison)
  decode: DecodeConfig = DecodeConfig()  # beam width/length, acceptance rule, token budget
  min_bucket: int = 16  # prompts are padded to a power of two >= this (few compiles)
  # Padded prompt tokens one admission call prefills: waiting prompts of one length bucket are
  # prefilled together, up to this many tokens (a power-of-two number of them, at most
  # ``slots``), so a burst of arrivals costs a few calls, not one per request; a longer prompt
  # is prefilled alone. Each (bucket, rows) pair is a program compiled at warm-up.
  prefill_tokens: int = 1024
  # Steps read only a context bucket of the cache (powers of two from this up to max_context,
  # each a compiled program): the smallest holding every live row's prompt + max_tokens.
  min_context_bucket: int = 512
  # Per step, a plain AR step instead of the tree when it gives more tokens per second at that
  # many rows (needs the step times ``warmup`` measures; without them the tree always runs).
  adaptive: bool = True
  # Switch modes for sampled requests too. Off by default: a sampled request's draws differ
  # between the modes, so a seeded request would give the same tokens only under the same load
  # (greedy ones are identical in both modes).
  adaptive_sampled: bool = False
  # ReDrafter tokens per step per row assumed before any is observed (None: beam_length, the
  # most a step can give, so the tree is tried until acceptance is known).
  prior_tokens_per_step: float | None = None
  # Run the mode not chosen once its served cost at the step's rows bucket is this many steps
  # old (``policy.explore``), so that both modes are priced under the load at hand; 0: never.
  explore_every: int = 64
  # ... and space those runs out so that what they lose against the chosen mode stays within
  # this fraction of the served time (``policy.explore_interval``); 0: every explore_every.
  explore_budget: float = 0.01
  # Smaller draft trees the policy may run instead of ``decode``'s (``WxL[+n][+aK][/N]`` texts,
  # each with L and N at most ``decode``'s): per step, the tree (or AR) that gives the step's rows
  # the most tokens per second, so the tree shrinks as the batch grows. Each is one more step
  # mode (``tree_modes``): a program per rows and context bucket, compiled at warm-up.
  trees: tuple[str, ...] = ()
  # Their tokens per step per row assumed before any is observed, in ``trees`` order (empty, or
  # None for one: its beam_length).
  tree_priors: tuple[float | None, ...] = ()
  # A background compile (``warmup(background=True)``) stops before the process's resident
  # memory would pass this many GB (``MemoryLimit``): each program kept holds memory, and the
  # covering set serves any request without the rest. None: compile them all.
  memory_limit_gb: float | None = None

  def __post_init__(self):
    for name in ("slots", "max_context", "max_tokens", "default_max_tokens", "min_bucket",
                 "min_context_bucket", "prefill_tokens"):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
        raise ConfigError(f"serving: {name} must be an integer >= 1, got {getattr(self, name)!r}")
    if not isinstance(self.explore_every, int) or self.explore_every < 0:
      raise ConfigError(f"serving: explore_every must be an integer >= 0, got "
                        f"{self.explore_every!r}")
    if (isinstance(self.explore_budget, bool)
        or not isinstance(self.explore_budget, (int, float)) or not 0 <= self.explore_budget < 1):
      raise ConfigError(f"serving: explore_budget must be a number in [0, 1), got "
                        f"{self.explore_budget!r}")
    if not isinstance(self.max_queue, int) or self.max_queue < 0:
      raise ConfigError(f"serving: max_queue must be an integer >= 0, got {self.max_queue!r}")
    m = self.memory_limit_gb
    if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or m <= 0):
      raise ConfigError(f"serving: memory_limit_gb must be a number of GB > 0 (or None), got "
                        f"{m!r}")
    p = self.prior_tokens_per_step
    if p is not None and not 1.0 <= p <= self.decode.beam_length:
      raise ConfigError(f"serving: prior_tokens_per_step must be in [1, beam_length], got {p!r}")
    modes = self.tree_modes()
    if self.tree_priors and len(self.tree_priors) != len(self.trees):
      raise ConfigError(f"serving: tree_priors needs one value per tree ({len(self.trees)}), got "
                        f"{len(self.tree_priors)}")
    for text, prior in zip(self.trees, self.tree_priors):
      L = modes[tree_mode(text)].beam_length
      if prior is not None and not 1.0 <= prior <= L:
        raise ConfigError(f"serving: the prior of tree {text} must be in [1, {L}], got {prior!r}")

  def tree_modes(self, base: DecodeConfig | None = None) -> dict[str, DecodeConfig]:
    """Step mode -> its draft settings: "spec" (``decode``'s tree) and ``tree_mode(text)`` for
    each of ``trees``: ``base``'s settings (default ``decode``; the placement passes its
    resolved copy of them) with that tree. Raises ``ConfigError`` for a tree that is malformed,
    repeated, or larger than ``decode``'s (its steps share the batch's output width and
    scratch slots)."""
    from redrafter_jax.inference.tree_choice import Beams

    d = self.decode
    base = base or d
    out = {"spec": base}
    if not isinstance(self.trees, (tuple, list)):
      raise ConfigError(f"serving: trees must be a list of WxL[+n][+aK][/N] texts, got "
                        f"{self.trees!r}")
    for text in self.trees:
      try:
        (beams,) = Beams.parse_list(str(text))
      except ValueError as e:
        raise ConfigError(f"serving: tree {text!r}: {e}") from None
      cfg = beams.onto(base)
      mode = tree_mode(beams.text)
      shape = lambda c: (c.beam_width, c.beam_length, c.lookup_ngram, c.num_tree_tokens,
                         c.first_alternatives)
      if mode in out or any(shape(cfg) == shape(c) for c in out.values()):
        raise ConfigError(f"serving: tree {text!r} is given twice (or is decode's own tree)")
      if cfg.beam_length > d.beam_length or cfg.num_tree_tokens > d.num_tree_tokens:
        raise ConfigError(
            f"serving: tree {text!r} (L={cfg.beam_length}, {cfg.num_tree_tokens} tree tokens) "
            f"must fit within decode's (L={d.beam_length}, {d.num_tree_tokens} tree tokens)")
      out[mode] = cfg
    return out

  @property
  def scratch(self) -> int:
    """Cache slots a row needs beyond its tokens: one step's uncommitted writes."""
    d = self.decode
    return d.beam_length + d.num_tree_tokens if self.speculative else 1


def tree_mode(text: str) -> str:
  """The step mode of an extra draft tree (``EngineConfig.trees``), e.g. "spec:1x2+3/3"."""
  from redrafter_jax.inference.tree_choice import Beams

  return f"spec:{Beams.parse_list(text)[0].text}"


def _rss() -> str:
  """", RSS x.xx GB": this process's resident memory, for the compile logs (Linux only)."""
  kb = status_kb(keys=("VmRSS",)).get("VmRSS")
  return "" if kb is None else f", RSS {kb * 1024 / 1e9:.2f} GB"


def _fault_message(e: BaseException) -> str:
  return f"internal error while generating: {type(e).__name__}: {e}"


class Handle:
  """A submitted request: ``cancel()`` frees its slot at the next step."""

  _ids = itertools.count()

  def __init__(self, request: GenerationRequest, sink: Callable[[Event], None], seed: int,
               max_tokens: int):
    self.id = next(self._ids)
    self.request, self.sink, self.seed, self.max_tokens = request, sink, seed, max_tokens
    self.arrival = time.perf_counter()
    self._cancelled = threading.Event()

  def cancel(self) -> None:
    self._cancelled.set()

  @property
  def cancelled(self) -> bool:
    return self._cancelled.is_set()


@dataclasses.dataclass
class _Active:
  """Host-side progress of the request in one slot."""

  handle: Handle
  text: TextStream
  tokens: list[int] = dataclasses.field(default_factory=list)
  steps: int = 0
  accepted: int = 0
  first_token_at: float | None = None


@dataclasses.dataclass
class _InFlight:
  """A dispatched step: its device output and which request held each of its rows then."""

  out: object  # batch.StepOut on the device; row i is slot rows[i]
  rows: list[int]
  actives: list["_Active | None"]
  mode: str
  dispatched_at: float
  key: tuple[int, str, str, int]  # (rows bucket, mode, sampling kind, context): its cost entry
  # A prefill was dispatched just before it: the device ran both between the last read and
  # this step's, so its time is not the step's cost.
  after_admission: bool = False


class Engine:
  """Continuous-batching ReDrafter (or AR) generation over ``config.slots`` slots."""

  def __init__(self, llm: Llama, tokenizer, drafter: Drafter | None = None, *,
               config: EngineConfig = EngineConfig(), stop_ids: Sequence[int] = (),
               mesh=None, metrics: ServingMetrics | None = None):
    if config.speculative and drafter is None:
      raise ConfigError("serving with ReDrafter needs a drafter (or speculative=False)")
    limit = llm.config.max_position_embeddings
    if config.max_context > limit:
      raise ConfigError(f"serving: max_context {config.max_context} exceeds the model's "
                        f"context of {limit} tokens")
    if config.max_context < config.scratch + 2:
      raise ConfigError(f"serving: max_context {config.max_context} leaves no room beside the "
                        f"{config.scratch} scratch slots one step needs")
    dcfg = getattr(drafter, "config", None)
    if config.speculative and dcfg is not None and (dcfg.hidden_size, dcfg.vocab_size) != (
        llm.config.hidden_size, llm.config.vocab_size):
      raise ConfigError(f"drafter (hidden_size={dcfg.hidden_size}, vocab_size={dcfg.vocab_size})"
                        f" does not match the LLM (hidden_size={llm.config.hidden_size}, "
                        f"vocab_size={llm.config.vocab_size})")
    self.config = config
    self.vocab_size = llm.config.vocab_size
    self.metrics = metrics or ServingMetrics(config.decode.beam_length)
    self._decode_text = decoder_for(tokenizer)
    self._stop_ids = tuple(int(i) for i in stop_ids)
    self._place = Placement(llm, drafter if config.speculative else None, config,
                            self._stop_ids, mesh=mesh)
    self._queue: queue.Queue[Handle] = queue.Queue()  # bounded by ``submit``
    self._load = 0  # requests submitted and not yet ended (waiting or in a slot)
    self._load_lock = threading.Lock()
    self._slots: list[_Active | None] = [None] * config.slots
    self._stopping = threading.Event()
    self._thread: threading.Thread | None = None
    # Admitted, first token unread: (slot, request, its call's first tokens, its row there, t0).
    self._firsts: list[tuple[int, _Active, jax.Array, int, float]] = []
    self._last_collect = 0.0
    # Seconds per step by (rows, mode, sampling kind, context): measured by ``warmup``, then
    # corrected by the steps served.
    self.costs: policy_lib.StepCosts | None = None
    # Tokens per step per row observed for each tree mode (each from its own prior).
    priors = dict(zip(map(tree_mode, config.trees), config.tree_priors))
    priors["spec"] = config.prior_tokens_per_step
    self.acceptance = {mode: policy_lib.Acceptance(priors.get(mode) or float(cfg.beam_length))
                       for mode, cfg in config.tree_modes().items()} if config.speculative else {}
    self.step_counts: collections.Counter = collections.Counter()  # steps by (rows, mode)
    self.context_counts: collections.Counter = collections.Counter()  # steps by context read
    self.error: BaseException | None = None  # set if the loop itself died
    # (rows bucket, context) groups the policy may step with: all (None) until a warm-up
    # compiles some; then those compiled and timed (``_adopt_compiled`` adds to them).
    self._usable: set[tuple[int, int]] | None = None
    self._pending: list[tuple] = []  # programs the background compile works through
    self._untimed: set[tuple[int, int]] = set()  # usable step groups the policy has no time for
    self._unsettled: list[int] = []  # contexts whose steps are to be timed together (``_settle``)
    self._compiler: threading.Thread | None = None
    self._compile_stopped: str | None = None  # why the background compile stopped early
    self._compile_done = threading.Event()  # cleared while a background compile has work
    self._compile_done.set()

  # ------------------------------------------------------------------ public API (any thread)

  @property
  def mode(self) -> str:
    return "redrafter" if self.config.speculative else "ar"

  def warmup(self, progress=None, *, background: bool = False) -> float:
    """Compile the programs serving meets now (before ``start``) and time the steps for the
    policy; returns the seconds it took. ``background``: compile only a covering set now
    (``Placement.cover_programs``: any request can be served, padded to larger programs), time
    it between requests, and compile the rest on a background thread from ``start`` on, each
    group of steps taken into use once compiled and timed (``_adopt_compiled``; until the
    policy has timings it runs AR); otherwise everything now, so no request ever waits
    for a compile. Each program's compile is logged with its seconds; ``progress(done,
    total, what, seconds)`` also hears of it (the server's start-up: ``lifecycle.Startup``)."""
    if self._thread is not None:
      raise RuntimeError("warmup() runs before start(): only the engine thread touches JAX then")
    t0 = time.perf_counter()
    place = self._place
    def each(done: int, total: int, what: str, seconds: float) -> None:
      log.info("warm-up %d/%d: %s in %.2f s%s", done, total, what, seconds, _rss())
      if progress is not None:
        progress(done, total, what, seconds)

    keys = place.cover_programs() if background else None
    costs = place.warmup(kinds=self._timed_kinds(), progress=each, keys=keys,
                         timed=not background)
    self._usable = {(b, c) for b, _, _, c in costs}
    if background:
      self._pending = place.rest_programs()
      if self._pending:
        self._compile_done.clear()  # set by ``_compile_rest`` when it ends
      place.compile_on_demand = False  # admissions run on compiled covers meanwhile
      self._untimed = {(key[1], key[3]) for key in keys if key[0] == "step"}
      self._unsettled = list(place.context_buckets())
      self._usable |= self._untimed
    if self.config.adaptive:
      self.costs = policy_lib.StepCosts(costs)
    seconds = time.perf_counter() - t0
    log.info("warm-up: compiled %d programs in %.1f s%s%s", place.compiled_programs(), seconds,
             f"; {len(self._pending)} more to compile in the background" if background else "",
             _rss())
    if costs:
      log.info("step seconds (rows, mode, kind, context): %s",
               ", ".join(f"{k}: {v * 1e3:.1f} ms" for k, v in sorted(costs.items())))
      self._drop_dominated(place.context_buckets())  # all timed together, nothing compiling
    return seconds

  def _timed_kinds(self) -> tuple[str, ...]:
    # Only greedy batches switch modes unless ``adaptive_sampled``: time the other kinds then.
    return policy_lib.KINDS if self.config.adaptive_sampled else ("greedy",)

  def start(self) -> "Engine":
    if self._thread is None:
      self._thread = threading.Thread(target=self._loop, name="redrafter-engine", daemon=True)
      self._thread.start()
      if self._pending:
        self._compiler = threading.Thread(target=self._compile_rest, name="redrafter-compile",
                                          daemon=True)
        self._compiler.start()
    return self

  def compile_progress(self) -> dict:
    """The background compile's progress (``warmup(background=True)``): programs compiled of
    those it has, whether it is still running (compiling, or steps not yet timed and in use,
    or not yet timed together: ``_settle``), and how many programs were dropped as never
    paying (``_drop_dominated``); ``stopped``: why it stopped before the last program (a
    limit: ``MappingBudget``, ``MemoryLimit``), or None."""
    place = self._place
    done = sum(place.compiled(key) or key in place.dropped for key in self._pending)
    running = not self._compile_done.is_set() or (
        bool(self._pending) and bool(self._unsettled or self._adoptable()))
    return {"done": done, "total": len(self._pending), "running": running,
            "dropped": len(place.dropped), "stopped": self._compile_stopped}

  def _compile_rest(self) -> None:
    """The background thread: compile ``_pending`` in order (at a lower CPU priority where
    the OS allows, so the engine's own steps come first), until done, stopped, or a limit
    would be passed: the memory mappings (``MappingBudget``) or ``config.memory_limit_gb``
    (``MemoryLimit``); the server goes on with what it has."""
    try:
      self._compile_programs()
    finally:
      self._compile_done.set()  # the engine may settle now (``_settle``)

  def _compile_programs(self) -> None:
    """``_compile_rest``'s loop."""
    try:
      os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # this thread, on Linux
    except (AttributeError, OSError):
      pass
    mappings = MappingBudget(len(self._pending))
    memory = (None if self.config.memory_limit_gb is None
              else MemoryLimit(int(self.config.memory_limit_gb * 1e9)))
    modes = self._place.modes()
    for done, key in enumerate(self._pending, 1):
      if self._stopping.is_set():
        return
      try:
        mappings.check()
        if memory is not None:  # a step's group (its modes from here on) fits, or none of it
          memory.check(["admit"] if key[0] == "admit" else
                       [f"step {m}" for m in modes[modes.index(key[2]):]])
        seconds = self._place.compile(key)
      except ConfigError as e:
        self._compile_stopped = f"{done - 1} of {len(self._pending)} compiled: {e}"
        log.warning("background compile stopped after %d of %d programs: %s", done - 1,
                    len(self._pending), e)
        return
      except Exception:  # the server keeps serving on the programs it has
        log.exception("background compile of %s failed", self._place.program_name(key))
        return
      log.info("background compile %d/%d: %s in %.2f s%s", done, len(self._pending),
               self._place.program_name(key), seconds, _rss())

  def _adopt_compiled(self) -> None:
    """Between requests (no slot held): take into use each row/context group whose steps
    (all modes) the background thread has compiled since, timing them first for the policy;
    once it is done, settle one context bucket (``_settle``)."""
    new = self._adoptable()
    start = time.perf_counter()
    if new:
      self._untimed = set()
      timed, _ = self._time_groups(new)  # cut short: fewer samples, timed again at the settle
      self._usable.update(new)
      log.info("steps for (rows, context) %s timed and in use%s", sorted(new), timed)
    elif self._unsettled and self._compile_done.is_set():
      if self._settle(self._unsettled[0]):
        del self._unsettled[0]  # after: ``compile_progress`` says running until the drop is done
    else:
      return
    # A request that arrives meanwhile waits one timing round at most (``_time_groups``); the
    # pause's seconds are logged for ``bench server_start``.
    log.info("%s %.2f s", PAUSE_LOG, time.perf_counter() - start)

  def _time_groups(self, groups) -> tuple[str, bool]:
    """Time the steps of ``groups`` (all modes, interleaved) into the policy's costs, ending
    after the current round when a request arrives or the engine stops; returns them for a log
    line, and whether every round ran."""
    if self.costs is None:
      return "", True
    cut = []

    def stop() -> bool:
      if not self._queue.empty() or self._stopping.is_set():
        cut.append(True)
      return bool(cut)

    timed = self._place.time_steps(
        [("step", b, m, c) for b, c in groups for m in self._place.modes()],
        kinds=self._timed_kinds(), stop=stop)
    self.costs.warm.update(timed)
    text = "".join(f"; {k}: {v * 1e3:.1f} ms" for k, v in sorted(timed.items()))
    return text + ("; cut short by a request" if cut else ""), not cut

  def _settle(self, context: int) -> bool:
    """With the background compile done (no compile shares the CPU any more), time every
    usable step group at ``context`` again, together (``time_steps`` interleaves them, so a
    slow spell hits all alike: the groups timed as each compiled ran beside different
    compiles), and drop those a larger rows bucket matches or beats there. Returns False when
    a request cut the timing short: nothing is dropped on so few samples, and the context is
    settled again at the next pause."""
    groups = sorted(g for g in self._usable if g[1] == context)
    timed, complete = self._time_groups(groups)
    log.info("steps at context %d timed together%s", context, timed)
    self._untimed -= set(groups)
    if complete:
      self._drop_dominated({context})
    return complete

  def _adoptable(self) -> list[tuple[int, int]]:
    """The (rows, context) step groups compiled but not yet timed and in use: those whose
    every mode the background thread has compiled since, with the covering set's (timed
    beside the first of them, not at once: alone, the covering steps have nothing to be
    compared with, and timing them as the server gets ready would hold its first request;
    ``_settle`` times them at the latest)."""
    place = self._place
    new = [(b, c) for b in place.row_buckets() for c in place.context_buckets()
           if (b, c) not in self._usable
           and all(place.compiled(("step", b, m, c)) for m in place.modes())]
    return new + sorted(self._untimed) if new else []

  def _drop_dominated(self, contexts) -> None:
    """Drop the step groups at ``contexts`` that a larger rows bucket at the same context
    matches or beats in every timed mode and kind (``policy.dominated``, by the warm-up
    timings, which must have timed the groups together): the policy would never pick them,
    and each of their programs holds memory (``Placement.drop``)."""
    if self.costs is None or self._usable is None:
      return
    drop = policy_lib.dominated({key: s for key, s in self.costs.warm.items()
                                 if (key[0], key[3]) in self._usable and key[3] in contexts})
    if not drop:
      return
    self._usable -= drop
    for key in [key for key in self.costs.warm if (key[0], key[3]) in drop]:
      del self.costs.warm[key]
    self._place.drop([("step", b, m, c) for b, c in drop for m in self._place.modes()])
    log.info("dropped the steps for (rows, context) %s: a larger rows bucket costs no more "
             "there%s", sorted(drop), _rss())

  def _step_groups(self, rows: int, need: int) -> tuple[int, list[int]]:
    """The smallest context bucket holding ``need`` tokens with a usable step group for
    ``rows`` live rows, and the row buckets usable there (every one until a warm-up says)."""
    buckets = self._place.row_buckets()
    for c in self._place.context_buckets():
      if c < need:
        continue
      fits = [b for b in buckets if b >= rows and (self._usable is None or (b, c) in self._usable)]
      if fits:
        return c, fits
    raise RuntimeError(f"no usable step for {rows} rows at context {need}")

  def stop(self, timeout: float = 30.0) -> None:
    """Stop the engine thread (waiting up to ``timeout`` seconds), then the background compile
    once its program in progress is compiled: a process that exits during an XLA compile on
    another thread aborts."""
    self._stopping.set()
    if self._thread is not None:
      self._thread.join(timeout)
      self._thread = None
      if self.step_counts:
        log.info("%s", self.served_summary())
    if self._compiler is not None:
      if self._compiler.is_alive():
        log.info("waiting for the background compile's program in progress")
      self._compiler.join()
      self._compiler = None

  def served_summary(self) -> str:
    """What the policy did: steps served by (rows bucket, mode), the acceptance observed, and
    the served seconds per step (average, steps) next to the warm-up's, by (rows, mode, kind,
    context)."""
    steps = ", ".join(f"{b} rows {m}: {n}" for (b, m), n in sorted(self.step_counts.items()))
    out = f"steps served: {steps}"
    for mode, acc in self.acceptance.items():
      out += (f"; {mode} tokens/step observed {acc.tokens_per_step:.2f} over {acc.row_steps} "
              "row-steps")
    if self.costs is not None and self.costs.seen:
      served = ", ".join(
          f"{key}: {avg * 1e3:.1f} ms x {n} (warm-up {self.costs.warm.get(key, 0) * 1e3:.1f})"
          for key, (avg, n) in sorted(self.costs.seen.items()))
      out += f"; served step seconds: {served}"
    return out

  @property
  def alive(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  def queue_length(self) -> int:
    return self._queue.qsize()

  def active_slots(self) -> int:
    return sum(a is not None for a in self._slots)

  def check(self, request: GenerationRequest) -> int:
    """Validate ``request``; returns its effective max_tokens. Raises ``RequestError``."""
    cfg = self.config
    if cfg.speculative and cfg.decode.acceptance == "greedy" and request.temperature > 0:
      raise RequestError("this server verifies greedily (acceptance 'greedy'): temperature must "
                         "be 0", "temperature")
    return validate(request, vocab_size=self.vocab_size, max_context=cfg.max_context,
                    reserved=cfg.scratch, max_tokens=cfg.max_tokens,
                    default_max_tokens=cfg.default_max_tokens)

  def submit(self, request: GenerationRequest, sink: Callable[[Event], None]) -> Handle:
    """Queue a request for a slot; its events go to ``sink``.

    Args:
      request: prompt token ids and sampling settings (``GenerationRequest``).
      sink: called from the engine thread with each ``Delta`` (new text and token ids), then one
        ``Finished`` (or ``Failed``); it must not block.

    Returns:
      A ``Handle`` (``cancel()`` frees the request's slot at the next step).

    Raises:
      RequestError: the request does not fit this server's limits.
      QueueFull: every slot is busy and the waiting queue is full.
      EngineStopped: the engine is not running.
    """
    max_tokens = self.check(request)
    if not self.alive:
      raise EngineStopped("the engine is not running")
    seed = secrets.randbits(64) if request.seed is None else request.seed % (1 << 64)
    handle = Handle(request, sink, seed, max_tokens)
    with self._load_lock:
      if self._load >= self.config.slots + self.config.max_queue:
        self.metrics.rejected.labels(reason="queue_full").inc()
        raise QueueFull(f"all {self.config.slots} slots are busy and {self.config.max_queue} "
                        "requests are waiting; retry later")
      self._load += 1
      self._queue.put_nowait(handle)
    self.metrics.queue_length.set(self._queue.qsize())
    return handle

  def generate(self, request: GenerationRequest, timeout: float = 300.0) -> Finished:
    """Submit and wait for the whole result (for scripts and tests)."""
    events: queue.Queue[Event] = queue.Queue()
    handle = self.submit(request, events.put)
    deadline = time.monotonic() + timeout
    pieces = []
    while True:
      try:
        event = events.get(timeout=max(deadline - time.monotonic(), 0.0))
      except queue.Empty:
        handle.cancel()
        raise TimeoutError(f"no result within {timeout} s") from None
      if isinstance(event, Failed):
        raise RuntimeError(event.message)
      pieces.append(event.text)
      if isinstance(event, Finished):
        return dataclasses.replace(event, text="".join(pieces))

  # ------------------------------------------------------------------ engine thread

  def _loop(self) -> None:
    pending: _InFlight | None = None
    try:
      while not self._stopping.is_set():
        try:
          self._admit_waiting()
          ahead = self._dispatch()  # step t+1 runs on the device while step t is read below
          if pending is not None:
            done, pending = pending, None
            self._collect(done)
          self._deliver_firsts()
          pending = ahead
          if pending is None and not self._firsts:
            if (self._pending or self._untimed) and not self.active_slots():
              self._adopt_compiled()
            self._wait_for_work()
        except Exception as e:  # a failed step must not take the server down
          log.exception("engine step failed; failing the active requests")
          pending = None
          self._firsts.clear()
          self._fail_active(_fault_message(e))
          self._place.reset()
    except BaseException as e:
      self.error = e
      log.exception("engine loop died")
      raise
    finally:
      self._fail_active("the server is shutting down", "shutting_down")
      while not self._queue.empty():
        self._emit(self._queue.get_nowait(), Failed("the server is shutting down",
                                                     "shutting_down"))
      self.metrics.queue_length.set(0)

  def _wait_for_work(self) -> None:
    try:
      handle = self._queue.get(timeout=0.05)
    except queue.Empty:
      return
    self._admit_waiting([handle])

  def _admit_waiting(self, taken: Sequence[Handle] = ()) -> None:
    """Move waiting requests (``taken`` ones first) into free slots: each request's inputs are
    converted on its own (a fault there fails it alone), then prefilled together with the
    others of its prompt bucket (``Placement.group``), one dispatched call per group."""
    handles = list(taken)
    free = [slot for slot, a in enumerate(self._slots) if a is None]
    while len(handles) < len(free):
      try:
        handles.append(self._queue.get_nowait())
      except queue.Empty:
        break
    self.metrics.queue_length.set(self._queue.qsize())
    ready = []
    for handle in handles:
      if handle.cancelled:
        self._finish_cancelled(handle)
        continue
      req, slot = handle.request, free[len(ready)]
      try:
        ready.append((handle, self._place.admission(slot, req.prompt_ids, handle.seed,
                                                    req.temperature, req.top_p, req.top_k,
                                                    handle.max_tokens)))
      except Exception as e:
        log.exception("request %d: admission failed", handle.id)
        self._admission_failed([handle], _fault_message(e))
    adm_of = {id(a): h for h, a in ready}
    for group in self._place.group([a for _, a in ready]):
      members = [adm_of[id(a)] for a in group]
      t0 = time.perf_counter()
      try:
        first_k = self._place.admit(group)
      except Exception as e:
        log.exception("requests %s: admission failed", [h.id for h in members])
        self._admission_failed(members, _fault_message(e))
        continue
      for i, (handle, a) in enumerate(zip(members, group)):
        self.metrics.prompt_tokens.inc(len(handle.request.prompt_ids))
        active = _Active(handle, TextStream(self._decode_text, handle.request.stop))
        self._slots[a.slot] = active
        self._firsts.append((a.slot, active, first_k, i, t0))
    self.metrics.active_slots.set(self.active_slots())

  def _admission_failed(self, handles: Sequence[Handle], message: str) -> None:
    """Fail requests whose admission failed (they hold no slot yet); all active ones too if
    the failed call consumed the shared batch."""
    for handle in handles:
      self.metrics.requests.labels(finish_reason="error").inc()
      self._emit(handle, Failed(message))
    self._recover_batch(message)

  def _recover_batch(self, message: str) -> None:
    """After a failed call: if it consumed (donated) the shared batch, fail every active
    request and start a fresh batch."""
    if not self._place.batch_intact():
      self._fail_active(message)
      self._place.reset()

  def _deliver_firsts(self) -> None:
    """Read the first tokens of the requests admitted since the last read (their prefills were
    dispatched before the step now in flight, so this waits for them alone)."""
    firsts, self._firsts = self._firsts, []
    read: dict[int, object] = {}
    for slot, active, first_k, i, t0 in firsts:
      if self._slots[slot] is not active:  # failed meanwhile
        continue
      try:
        if id(first_k) not in read:
          read[id(first_k)] = jax.device_get(first_k)
        token = int(read[id(first_k)][i])
        self.metrics.prefill_seconds.observe(time.perf_counter() - t0)
        self._deliver(slot, [token])
      except Exception as e:
        log.exception("request %d: its prefill or first token failed", active.handle.id)
        self._fail_slot(slot, _fault_message(e))
        self._recover_batch(_fault_message(e))

  def _dispatch(self) -> _InFlight | None:
    """Dispatch one step for the occupied slots (cancelled requests end here first)."""
    for slot, active in enumerate(self._slots):
      if active is not None and active.handle.cancelled:
        self._finish(slot, "cancelled", "")
    live = [slot for slot, a in enumerate(self._slots) if a is not None]
    if not live:
      return None
    requests = [self._slots[slot].handle.request for slot in live]
    filtered = any(r.temperature > 0 and (r.top_p < 1 or r.top_k > 0) for r in requests)
    greedy = all(r.temperature <= 0 for r in requests)  # the argmax fast path (own program)
    kind = policy_lib.kind_of(filtered, greedy)
    # Attention reads the smallest context bucket that holds every live row to its limit
    # (prompt + max_tokens + one step's scratch): an upper bound known at admission, so the
    # steps already in flight (dispatched ahead) never outgrow it.
    need = max(len(self._slots[slot].handle.request.prompt_ids) +
               self._slots[slot].handle.max_tokens + self.config.scratch for slot in live)
    need = min(need, self.config.max_context)
    context, buckets = self._step_groups(len(live), need)
    costs = None
    if self.costs is not None and (greedy or self.config.adaptive_sampled):
      costs = self.costs.table(kind, context)
    tokens_per_step = policy_lib.tokens_per_step(self.acceptance)
    b, mode = policy_lib.plan(len(live), kind, costs, tokens_per_step, self._place.modes(),
                              buckets)
    if costs:
      mode = policy_lib.explore(b, mode, kind, context, self.costs, self._place.modes(),
                                self.config.explore_every, tokens_per_step=tokens_per_step,
                                budget=self.config.explore_budget)
    if b == self.config.slots:
      rows = list(range(b))
    else:
      rows = live + [slot for slot, a in enumerate(self._slots) if a is None][:b - len(live)]
    actives = [self._slots[slot] for slot in rows]
    t0 = time.perf_counter()
    out = self._place.step(rows, [a is not None for a in actives], filtered, greedy, mode,
                           context)
    self.step_counts[b, mode] += 1
    self.context_counts[context] += 1
    # Admitted requests whose first token is unread were prefilled since the last dispatch.
    return _InFlight(out, rows, actives, mode, t0, (b, mode, kind, context), bool(self._firsts))

  def _collect(self, step: _InFlight) -> None:
    """Wait for ``step`` and deliver its tokens to the requests still holding its rows."""
    out = jax.device_get(step.out)
    now = time.perf_counter()
    seconds = now - max(step.dispatched_at, self._last_collect)
    self._last_collect = now
    accepted = []
    for i, (slot, active) in enumerate(zip(step.rows, step.actives)):
      if active is None or self._slots[slot] is not active:  # ended after the dispatch
        continue
      if active.handle.cancelled:
        self._finish(slot, "cancelled", "")
        continue
      if out.active_B[i]:
        active.steps += 1
        active.accepted += int(out.accepted_B[i])
        accepted.append(int(out.accepted_B[i]))
      try:
        self._deliver(slot, out.tokens_BA[i, :out.count_B[i]].tolist(),
                      device_done=bool(out.done_B[i]))
      except Exception as e:  # this request's own host-side work: it alone fails
        log.exception("request %d: delivering its tokens failed", active.handle.id)
        self._fail_slot(slot, _fault_message(e))
    # Acceptance statistics count tree steps only (an AR step drafts nothing), of any tree.
    tree = step.mode in self.acceptance
    self.metrics.observe_step(seconds, accepted if tree or not self.config.speculative else [])
    if self.costs is not None:  # a step's cost, no prefill's: one after a prefill only counts
      self.costs.observe(step.key, None if step.after_admission else seconds)
    if tree:
      self.acceptance[step.mode].observe(accepted)

  def _deliver(self, slot: int, new: list[int], *, device_done: bool = False) -> None:
    """Hand a row's new tokens to its request; end it when it is done."""
    active = self._slots[slot]
    if active.first_token_at is None and new:
      active.first_token_at = time.perf_counter()
      self.metrics.ttft_seconds.observe(active.first_token_at - active.handle.arrival)
    new = new[:active.handle.max_tokens - len(active.tokens)]
    stop_at = next((i for i, t in enumerate(new) if t in self._stop_ids), None)
    if stop_at is not None:
      new = new[:stop_at + 1]
    active.tokens.extend(new)
    text = active.text.push(new[:stop_at] if stop_at is not None else new)
    if active.text.stopped or stop_at is not None:
      self._finish(slot, "stop", text)
    elif len(active.tokens) >= active.handle.max_tokens or device_done:
      self._finish(slot, "length", text + active.text.flush())
    elif text or new:
      self._emit(active.handle, Delta(text, new))

  def _finish(self, slot: int, reason: str, text: str) -> None:
    active = self._slots[slot]
    self._slots[slot] = None
    h = active.handle
    n = len(active.tokens)
    steps = max(active.steps, 1)
    usage = dict(prompt_tokens=len(h.request.prompt_ids), completion_tokens=n,
                 total_tokens=len(h.request.prompt_ids) + n,
                 speculative=dict(mode=self.mode, steps=active.steps,
                                  accepted_tokens=active.accepted,
                                  tokens_per_step=(active.accepted + active.steps) / steps))
    self.metrics.requests.labels(finish_reason=reason).inc()
    self.metrics.generated_tokens.inc(n)
    self.metrics.request_seconds.observe(time.perf_counter() - h.arrival)
    self.metrics.active_slots.set(self.active_slots())
    self._emit(h, Finished(text, list(active.tokens), reason, usage))

  def _finish_cancelled(self, handle: Handle) -> None:
    self.metrics.requests.labels(finish_reason="cancelled").inc()
    usage = dict(prompt_tokens=len(handle.request.prompt_ids), completion_tokens=0,
                 total_tokens=len(handle.request.prompt_ids))
    self._emit(handle, Finished("", [], "cancelled", usage))

  def _fail_active(self, message: str, code: str = "internal_error") -> None:
    for slot, active in enumerate(self._slots):
      if active is not None:
        self._fail_slot(slot, message, code)

  def _fail_slot(self, slot: int, message: str, code: str = "internal_error") -> None:
    """End the request in ``slot`` with ``Failed`` and free the slot (its device row is left
    to decode until the slot is reused, like any ended request's)."""
    active = self._slots[slot]
    self._slots[slot] = None
    self.metrics.requests.labels(finish_reason="error").inc()
    self.metrics.active_slots.set(self.active_slots())
    self._emit(active.handle, Failed(message, code))

  def _emit(self, handle: Handle, event: Event) -> None:
    if isinstance(event, (Finished, Failed)):
      with self._load_lock:
        self._load -= 1
    try:
      handle.sink(event)
    except Exception:  # a closed connection's sink: the request is simply abandoned
      log.debug("request %d: sink failed; cancelling", handle.id, exc_info=True)
      handle.cancel()
