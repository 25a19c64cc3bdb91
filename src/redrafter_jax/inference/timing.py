"""Timing several programs against each other on a shared machine."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Hashable, Mapping

import jax
import psutil

Call = Callable[[], object]


def _once(prepare: Call | None, call: Call) -> float:
  if prepare is not None:
    prepare()
  t = time.perf_counter()
  jax.block_until_ready(call())
  return time.perf_counter() - t


def timed_calls(call: Call, repeat: int, *, warmup: int = 1) -> list[float]:
  """Wall seconds of ``repeat`` calls of ``call`` (its result waited for), after ``warmup``
  untimed ones (the first compiles)."""
  for _ in range(warmup):
    _once(None, call)
  return [_once(None, call) for _ in range(repeat)]


def median_seconds(call: Call, repeat: int, *, warmup: int = 1) -> float:
  """The median of ``timed_calls``: one program timed alone."""
  return statistics.median(timed_calls(call, repeat, warmup=warmup))


def seconds_in_rounds(calls: Mapping[Hashable, tuple[Call | None, Call]], repeat: int
                      ) -> dict[Hashable, float]:
  """Median wall seconds of each ``(prepare, call)`` in ``calls``: ``call``'s result is waited
  for; ``prepare`` (None: nothing) runs before each call, untimed. One untimed (compiling) call
  each, then ``repeat`` rounds of one call each, so that a slow spell of a shared machine slows
  every program alike instead of whichever was being timed then: ratios between them hold."""
  for prepare, call in calls.values():
    _once(prepare, call)
  times: dict[Hashable, list[float]] = {name: [] for name in calls}
  for _ in range(repeat):
    for name, (prepare, call) in calls.items():
      times[name].append(_once(prepare, call))
  return {name: statistics.median(t) for name, t in times.items()}


class OtherLoad:
  """The CPU time other processes took while a block ran, as a share of the machine's CPUs
  (``share``: 0 when this process had the machine to itself, ~1 when others kept every core
  busy; time the hypervisor stole counts as theirs). Timings taken beside such load are slower
  than the device is, and unevenly so: a cache of them should not outlive the run.

    with OtherLoad() as load:
      seconds = time_steps(...)
    load.share
  """

  share: float | None = None  # None until the block has run

  @staticmethod
  def _sample() -> tuple[float, float, float]:
    cpu = psutil.cpu_times()
    busy = sum(cpu) - cpu.idle - getattr(cpu, "iowait", 0.0)
    own = psutil.Process().cpu_times()
    return time.perf_counter(), busy, own.user + own.system

  def __enter__(self) -> "OtherLoad":
    self._start = self._sample()
    return self

  def __exit__(self, *exc) -> None:
    (t0, busy0, own0), (t1, busy1, own1) = self._start, self._sample()
    capacity = (t1 - t0) * (psutil.cpu_count() or 1)
    others = (busy1 - busy0) - (own1 - own0)
    self.share = min(max(others / capacity, 0.0), 1.0) if capacity > 0 else 0.0


class TreeStepper:
  """``ReDrafter.step`` at batch 1 on one prompt, one step per call (for timing it against other
  programs call by call): each call dispatches the next step and returns its state without
  waiting for it. The cache holds ``calls`` steps beyond the first two, so every call decodes."""

  def __init__(self, llm, drafter, cfg, prompt, calls: int):
    import dataclasses

    from redrafter_jax.inference.decode import ReDrafter

    self.rd = ReDrafter(llm, drafter, dataclasses.replace(
        cfg, max_new_tokens=(calls + 2) * cfg.beam_length))
    self.prepared = self.rd.prepare([prompt])
    self.state = self.rd.start(self.prepared)

  def __call__(self):
    self.state = self.rd.step(self.prepared, self.state)
    return self.state

  def cache_width(self) -> int:
    """The cache slots the step reads (after a first call)."""
    return self.rd.width(self.prepared, self.state) or self.prepared.cache_size
