"""Which step to run: how many rows (a bucket) and whether to speculate, chosen per step.

A ReDrafter step verifies a tree of N tokens per row; a plain AR step one. At batch 1 the tree
is nearly free (the step is bound by reading the weights), so speculation pays; as the batch
grows the step becomes bound by its token count and a tree costs more than the tokens it saves.
The engine therefore picks, for every step, the rows bucket (any that holds the live rows) and
the mode with the most tokens per second per row:

    tokens_per_step[mode] / seconds[(rows bucket, mode, sampling kind)]

with ``seconds`` measured on the device at hand (``Engine.warmup`` times every compiled step)
and ``tokens_per_step`` 1 for AR and, for ReDrafter, the acceptance observed so far (started
from a prior). Only what was timed competes: a step no one timed runs AR. Greedy outputs do not
depend on the choice: both modes emit the LLM's argmax tokens. Everything here is a pure
function of its inputs (deterministic, testable with a fake cost table).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

MODES = ("ar", "spec")  # plain AR and the served tree; smaller trees add "spec:WxL..." modes
KINDS = ("greedy", "sampled", "filtered")  # every live request greedy / some sampled / filtered


def row_buckets(slots: int) -> list[int]:
  """Sub-batch sizes: the powers of two below ``slots``, and ``slots`` itself."""
  out, b = [], 1
  while b < slots:
    out.append(b)
    b *= 2
  return out + [slots]


def bucket_for(rows: int, buckets: Sequence[int]) -> int:
  """The smallest bucket holding ``rows`` rows."""
  return next(b for b in sorted(buckets) if b >= rows)


def kind_of(filtered: bool, greedy: bool) -> str:
  return "filtered" if filtered else "greedy" if greedy else "sampled"


def plan(rows: int, kind: str, seconds: Mapping[tuple[int, str, str], float] | None,
         tokens_per_step: Mapping[str, float], modes: Sequence[str],
         buckets: Sequence[int]) -> tuple[int, str]:
  """The (rows bucket, mode) giving ``rows`` live rows the most tokens per second.

  Args:
    rows: the live rows.
    kind: the step's sampling kind (``KINDS``).
    seconds: seconds per step by (rows bucket, mode, kind), or None when the engine keeps no
      cost table (it was not timed): then the smallest bucket and the last mode (the engine's
      own: the tree when it has a drafter).
    tokens_per_step: tokens per step per row of each mode.
    modes: the modes to choose from, AR first.
    buckets: the rows buckets; any that holds ``rows`` competes (a larger one can cost less:
      on XLA:CPU the all-slots bucket gathers no rows).

  Returns:
    The cheapest (bucket, mode) per token among those ``seconds`` prices: a candidate whose
    cost was never measured is not chosen over one that was, and with none priced (this kind
    never timed) the smallest bucket runs the first mode, AR, the safe default. Ties go to the
    smaller bucket, then the earlier mode (AR: the cheaper program).
  """
  fits = sorted(b for b in buckets if b >= rows)
  if not fits:
    raise ValueError(f"no rows bucket in {sorted(buckets)} holds {rows} rows")
  if seconds is None:
    return fits[0], modes[-1]
  priced = [(b, m) for b in fits for m in modes if (b, m, kind) in seconds]
  if not priced:
    return fits[0], modes[0]
  # seconds per token per row; min keeps the first of equals (smaller bucket, earlier mode)
  return min(priced, key=lambda bm: max(seconds[bm[0], bm[1], kind], 1e-9) / tokens_per_step[bm[1]])


def dominated(seconds: Mapping[tuple[int, str, str, int], float]) -> set[tuple[int, int]]:
  """The (rows bucket, context) step groups of ``seconds`` (by (rows, mode, kind, context))
  that some larger rows bucket at the same context matches or beats in every mode and sampling
  kind timed for both: ``plan`` never gains by picking one of them (on XLA:CPU a bucket below
  all slots gathers its rows out of the slot batch and puts them back, and can cost more than
  the all-slots step). A group timed in a mode or kind its rival was not is kept."""
  groups: dict[tuple[int, int], dict[tuple[str, str], float]] = {}
  for (b, mode, kind, c), s in seconds.items():
    groups.setdefault((b, c), {})[mode, kind] = s
  return {(b, c) for (b, c), mine in groups.items()
          if any(c2 == c and b2 > b and mine.keys() <= theirs.keys()
                 and all(theirs[x] <= mine[x] for x in mine)
                 for (b2, c2), theirs in groups.items())}


@dataclasses.dataclass
class Acceptance:
  """Tokens per ReDrafter step per row: a prior worth ``prior_weight`` row-steps, updated with
  every observed row-step (accepted drafted tokens + the LLM's own token)."""

  prior: float
  prior_weight: float = 32.0
  tokens: float = 0.0
  row_steps: int = 0

  def observe(self, accepted: Sequence[int]) -> None:
    self.tokens += sum(accepted) + len(accepted)
    self.row_steps += len(accepted)

  @property
  def tokens_per_step(self) -> float:
    return (self.prior * self.prior_weight + self.tokens) / (self.prior_weight + self.row_steps)


def tokens_per_step(acceptance: Mapping[str, Acceptance]) -> dict[str, float]:
  """The tokens per step per row ``plan`` reads: 1 for AR, each tree mode's observed."""
  return {"ar": 1.0, **{mode: a.tokens_per_step for mode, a in acceptance.items()}}


@dataclasses.dataclass
class StepCosts:
  """Seconds per step by (rows, mode, sampling kind, context): those ``Engine.warmup`` measured,
  each replaced by the steps actually served once ``min_seen`` of them were seen (an
  exponential moving average, weight ``alpha``): under load a step costs more than it did alone
  (the host's work shares the machine), and not by the same factor for every mode. A step that
  ran right after a prefill is counted (it ran) but not priced (its time is both's). ``min_seen``
  None keeps the warm-up table (tests)."""

  warm: Mapping[tuple[int, str, str, int], float]
  min_seen: int | None = 4
  alpha: float = 0.1
  seen: dict = dataclasses.field(default_factory=dict)  # key -> (average seconds, steps priced)
  steps: int = 0  # steps served, any key: the clock ``age`` reads
  last: dict = dataclasses.field(default_factory=dict)  # key -> ``steps`` when it last ran

  def observe(self, key: tuple[int, str, str, int], seconds: float | None) -> None:
    """A step of ``key`` ran; ``seconds`` its cost, or None when it is not to be priced."""
    self.steps += 1
    self.last[key] = self.steps
    if seconds is not None:
      average, n = self.seen.get(key, (seconds, 0))
      self.seen[key] = (average + max(self.alpha, 1.0 / (n + 1)) * (seconds - average), n + 1)

  def priced(self, key: tuple[int, str, str, int]) -> bool:
    """Whether ``key``'s served cost is in use (``min_seen`` steps priced; always, when the
    warm-up table is kept or ``key`` was not measured at warm-up)."""
    return (self.min_seen is None or key not in self.warm
            or self.seen.get(key, (0.0, 0))[1] >= self.min_seen)

  def age(self, key: tuple[int, str, str, int]) -> int:
    """Steps served since ``key`` last ran (every step served so far if it never ran)."""
    return self.steps - self.last.get(key, 0)

  def table(self, kind: str, context: int) -> dict[tuple[int, str, str], float]:
    """The costs ``plan`` reads for one sampling kind at one context bucket."""
    out = {}
    for (b, mode, k, c), warm in self.warm.items():
      if k == kind and c == context:
        average, n = self.seen.get((b, mode, k, c), (warm, 0))
        out[b, mode, k] = average if self.min_seen is not None and n >= self.min_seen else warm
    return out


# A priced mode not chosen runs at least once per ``every * MAX_STRETCH`` steps, however much
# its runs lose: the load may have changed since.
MAX_STRETCH = 16


def explore_interval(loss: float, chosen: float, every: int, budget: float) -> int:
  """Steps between runs of a mode not chosen: ``every``, stretched so that each run's
  ``loss`` (seconds it costs beyond the chosen mode's price for the same tokens) stays within
  ``budget`` of the ``chosen`` mode's served time (seconds per step) in between; at most
  ``every * MAX_STRETCH``. ``budget`` 0: ``every``."""
  if budget <= 0 or loss <= 0:
    return every
  return min(every * MAX_STRETCH, max(every, math.ceil(loss / (budget * max(chosen, 1e-9)))))


def explore(rows_bucket: int, mode: str, kind: str, context: int, costs: StepCosts | None,
            modes: Sequence[str], every: int, *,
            tokens_per_step: Mapping[str, float] | None = None, budget: float = 0.0) -> str:
  """The mode to run: ``plan``'s, unless another mode at the same rows bucket, kind and context
  is due: not yet priced (``StepCosts.priced``), or not run for ``explore_interval`` steps.
  The warm-up table prices each mode alone, and under load the modes do not slow down alike
  (the host's work and the other requests' prefills share the machine); a cost is corrected
  only by running its mode. Each such run costs what the other mode loses against the chosen
  one (its seconds minus the chosen mode's price for its tokens, from ``tokens_per_step``):
  ``budget`` bounds that loss as a fraction of the served time by spacing the runs out (0: a
  run every ``every`` steps; ``every`` 0: never explore). Greedy outputs are the same in both
  modes; the price is one step of the other mode."""
  if costs is None or every <= 0 or costs.min_seen is None:  # a kept table learns nothing
    return mode
  seconds = costs.table(kind, context)
  chosen = seconds.get((rows_bucket, mode, kind))
  for other in modes:
    key = (rows_bucket, other, kind, context)
    if other == mode or key not in costs.warm:
      continue
    if not costs.priced(key):
      return other
    loss = 0.0
    if tokens_per_step is not None and chosen is not None:
      rate = chosen / tokens_per_step[mode]  # the chosen mode's seconds per token per row
      loss = seconds[rows_bucket, other, kind] - rate * tokens_per_step[other]
    if costs.age(key) >= explore_interval(loss, chosen or 0.0, every, budget):
      return other
  return mode
