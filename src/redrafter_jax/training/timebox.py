"""Time-boxed runs (``train.max_seconds``): a lease gives a fixed time on a GPU whose step time is
not known beforehand, and a cosine schedule cut off mid-way leaves a drafter trained at a high
learning rate. So the run times its own steps after the first (compiling) one over a short probe
(``PROBE_STEPS``, run on the provisional schedule over ``num_steps``: still in its warmup ramp),
then fixes its step count to what fits in what is left of the budget, counted from the start of
the ``train`` call that decides (loading and compiling count), less a reserve for the end
(``TimeBox.decide``), at most ``num_steps``; the warmup + cosine schedule then runs over that
count. The learning rate is an input of the jitted step in this mode (the optimizer runs at unit
rate and the step scales its updates), so fixing the count recompiles nothing. ``schedule.json``
records the decision and a resumed run reads it back instead of probing again (one resumed
before any decision probes, on its own budget). A short probe can mislead (on a shared VM the
later steps may run slower or faster than it measured), so the run re-times itself at
``REFIT_FRACTIONS`` of the steps it fitted (each over at least ``REFIT_MIN_STEPS`` steps since
the last timing, so short runs are fitted once) and, where the pace since then fits a count
off by more than ``REFIT_TOLERANCE`` of the steps left, re-fits it: the steps still to run take
the rates of the schedule over the new count from the current step on (``_refitted``), as if
that count had been fitted at the start, so the rate still ends at 0. It may jump there (up
where the count grew): stretching the rest of the old schedule instead kept the rate
continuous, but a late re-fit that extended the count then ran its added steps at the tail's
near-zero rates. Each re-fit is recorded in ``schedule.json`` too.
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from redrafter_jax.training.optimizer import make_schedule

log = logging.getLogger(__name__)

# Time-boxed runs (``train.max_seconds``). The probe: steps timed after the first (compiling)
# one; a few, so that one slow step (allocator growth, the data pipeline's first reads) weighs
# little, and few enough to cost little of a short budget. The reserve for the end of the run,
# beyond the final evaluation's measured cost: a margin of steps for the pace to vary, and
# seconds for writing the final checkpoint, the exported drafter and the curves.
PROBE_STEPS = 5
RESERVE_STEPS = 5
RESERVE_SECONDS = 10.0
# Re-timing a decided run: where (fractions of the steps fitted after the decision), over how
# many steps at least, and how far off the fitted count must be to change it.
REFIT_FRACTIONS = (0.1, 0.3, 0.6)
REFIT_MIN_STEPS = 20
REFIT_TOLERANCE = 0.02
clock = time.perf_counter  # the budget's clock (tests replace it)


def _schedule_values(cfg, num_steps: int, count: int) -> np.ndarray:
  """``make_schedule(cfg, num_steps)`` at optimizer counts 0..count-1 (a step's rate is the
  schedule at the number of steps before it, as inside optax), as host float32 values."""
  return np.asarray(make_schedule(cfg, num_steps)(np.arange(count)), np.float32)


def _refitted(cfg, rates: np.ndarray, step: int, num_steps: int) -> np.ndarray:
  """A run's per-step rates (index: step - 1) re-fitted at ``step`` to end at ``num_steps``:
  the steps up to ``step`` keep theirs, and the later ones take the schedule over
  ``num_steps`` at their own positions."""
  step = max(step, 0)
  return np.concatenate([rates[:step], _schedule_values(cfg, num_steps, num_steps)[step:]])


class TimeBox:
  """A time-boxed run's step count and learning rates (``train.max_seconds``).

  Up to step ``decide_at`` (``PROBE_STEPS`` after the call's first step) the steps follow the
  provisional schedule over ``num_steps``; there ``decide`` fixes the run's step count, and the
  later steps follow the schedule over that count; at the ``refits`` steps (set by ``decide``)
  the run times itself again and ``refit`` may change the count. A resumed run reads the
  decision and its re-fits back from ``schedule.json`` (a fresh run drops one left from an
  earlier run in its folder): it replays the same rates and decides nothing. The rates are
  computed on the host once per decision, so a step's rate costs no device round trip.
  ``write``: this process writes ``schedule.json``.
  """

  def __init__(self, cfg, out_dir: pathlib.Path, start: int, t0: float, write: bool):
    self.cfg, self.t0, self.write = cfg, t0, write
    self.path = out_dir / "schedule.json"
    self.num_steps, self.decide_at, self.decided = cfg.num_steps, start + 1 + PROBE_STEPS, False
    self.fitted = cfg.num_steps  # the decision's count, before any re-fit
    self.saved: dict[str, Any] = {}  # what schedule.json holds
    if start and self.path.is_file():
      self.saved = json.loads(self.path.read_text())
      self.num_steps = int(self.saved["num_steps"])
      self.decide_at = int(self.saved["decided_at_step"])
      self.fitted = int(self.saved.get("fitted_num_steps", self.num_steps))
      self.decided = True
    elif write:
      self.path.unlink(missing_ok=True)
    self.marks: list[float] = []  # the clock after the call's first step and after the probe
    self.refits: list[int] = []  # the steps where this call times itself again
    self.last_mark: tuple[int, float] | None = None  # (step, clock) the next re-fit times from
    self.eval_seconds = 0.0
    self.lrs = self._rates()

  def _rates(self) -> np.ndarray:
    """Each step's learning rate (index: step - 1)."""
    cfg, n = self.cfg, self.fitted
    rates = _schedule_values(cfg, cfg.num_steps, min(self.decide_at, n))
    if self.decided:
      rates = _refitted(cfg, rates, len(rates), n)  # the decision: the first fit
      for refit in self.saved.get("refits", ()):
        rates = _refitted(cfg, rates, int(refit["step"]), int(refit["num_steps"]))
    return rates

  def lr(self, step: int) -> np.float32:
    return self.lrs[step - 1]

  def deciding(self, step: int) -> bool:
    return not self.decided and step == self.decide_at

  def refitting(self, step: int) -> bool:
    return step in self.refits

  def time_step(self, step: int, metrics) -> None:
    """Reads the clock once the call's first step, and then the probe's last, have run, and
    at each re-fit step."""
    if ((not self.decided and step in (self.decide_at - PROBE_STEPS, self.decide_at))
        or self.refitting(step)):
      jax.block_until_ready(metrics)
      self.marks.append(clock())

  def _fit(self, step: int, seconds_per_step: float, now: float) -> tuple[int, float, float]:
    """``(steps, elapsed, reserve)``: the steps done plus those that fit at this pace in what
    is left of ``max_seconds`` after a reserve for the end, at most ``num_steps`` (process 0's
    count on every process)."""
    cfg = self.cfg
    elapsed = now - self.t0
    reserve = self.eval_seconds + RESERVE_STEPS * seconds_per_step + RESERVE_SECONDS
    room = (cfg.max_seconds - elapsed - reserve) / seconds_per_step
    fitted = math.floor(min(cfg.num_steps, step + max(room, 0.0)))
    return int(multihost_utils.broadcast_one_to_all(np.int32(fitted))), elapsed, reserve

  def _write(self) -> None:
    if self.write:
      self.path.write_text(json.dumps(self.saved, indent=2) + "\n")

  def decide(self, step: int, eval_seconds: float) -> int:
    """Fix the run's step count: the ``step`` steps done, plus those that fit at the probe's
    pace in what is left of ``max_seconds`` after the time used since ``train`` started and a
    reserve for the end, at most ``num_steps``, and record it in ``schedule.json``. The reserve:
    ``eval_seconds`` (the held-out evaluation just run, compile included, which bounds the
    final one's cost), ``RESERVE_STEPS`` steps and ``RESERVE_SECONDS``. Every process takes
    process 0's count."""
    cfg = self.cfg
    seconds_per_step = max((self.marks[1] - self.marks[0]) / PROBE_STEPS, 1e-9)
    self.eval_seconds = eval_seconds
    self.num_steps, elapsed, reserve = self._fit(step, seconds_per_step, clock())
    self.fitted, self.decided = self.num_steps, True
    self.lrs = self._rates()
    log.info("time budget %g s: %.3g s/step after compile -> %d steps (decided at step %d, "
             "%.1f s in, %.1f s kept for the end)", cfg.max_seconds, seconds_per_step,
             self.num_steps, step, elapsed, reserve)
    self.saved = {"max_seconds": cfg.max_seconds, "seconds_per_step": seconds_per_step,
                  "num_steps": self.num_steps, "decided_at_step": step,
                  "elapsed_seconds": elapsed, "reserve_seconds": reserve,
                  "fitted_num_steps": self.num_steps, "refits": []}
    self._write()
    last = step
    for fraction in REFIT_FRACTIONS:
      at = step + round(fraction * (self.num_steps - step))
      if at - last >= REFIT_MIN_STEPS and at < self.num_steps:
        self.refits.append(at)
        last = at
    if self.refits:
      self.last_mark = (step, clock())
    return self.num_steps

  def refit(self, step: int) -> int:
    """Time the steps since the last timing and, where the count that fits at that pace is off
    by more than ``REFIT_TOLERANCE`` of the steps left, re-fit the run to it (``_refitted``);
    record it in ``schedule.json``. Returns the run's step count."""
    now = self.marks[-1]
    since, then = self.last_mark
    seconds_per_step = max((now - then) / (step - since), 1e-9)
    self.last_mark = (step, now)
    fitted, elapsed, _ = self._fit(step, seconds_per_step, now)
    left = self.num_steps - step
    if abs(fitted - self.num_steps) <= max(REFIT_TOLERANCE * left, 1):
      return self.num_steps
    log.info("time budget %g s: steps %d-%d ran at %.3g s/step -> %d steps, not %d (%.1f s in)",
             self.cfg.max_seconds, since + 1, step, seconds_per_step, fitted, self.num_steps,
             elapsed)
    self.num_steps = self.saved["num_steps"] = fitted
    self.saved["refits"].append({"step": step, "seconds_per_step": seconds_per_step,
                                 "num_steps": fitted, "elapsed_seconds": elapsed})
    self.lrs = self._rates()  # what a resumed run replays from schedule.json
    self._write()
    return self.num_steps
