"""Which step to run: how many rows (a bucket) and whether to speculate, chosen per step.

A ReDrafter step verifies a tree of N tokens per row; a plain AR step one. At batch 1 the tree
is nearly free (the step is bound by reading the weights), so speculation pays; as the batch
grows the step becomes bound by its token count and a tree costs more than the tokens it saves.
The engine therefore picks, for every step, the mode with the most tokens per second per row:

    tokens_per_step[mode] / seconds[(rows bucket, mode, sampling kind)]

with ``seconds`` measured on the device at hand (``Engine.warmup`` times every compiled step)
and ``tokens_per_step`` 1 for AR and, for ReDrafter, the acceptance observed so far (started
from a prior). Greedy outputs do not depend on the choice: both modes emit the LLM's argmax
tokens. Everything here is a pure function of its inputs (deterministic, testable with a fake
cost table).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

MODES = ("ar", "spec")
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


def choose(bucket: int, kind: str, seconds: Mapping[tuple[int, str, str], float] | None,
           tokens_per_step: Mapping[str, float], modes: Sequence[str]) -> str:
  """The mode in ``modes`` with the most tokens per second at ``bucket`` rows; with no
  measurement (``seconds`` None or missing the bucket), the last mode (the engine's own: the
  tree when it has a drafter). Ties go to the earlier mode (AR: the cheaper program)."""
  if len(modes) == 1:
    return modes[0]
  if not seconds or any((bucket, m, kind) not in seconds for m in modes):
    return modes[-1]
  rate = lambda m: tokens_per_step[m] / max(seconds[bucket, m, kind], 1e-9)
  best = modes[0]
  for m in modes[1:]:
    if rate(m) > rate(best):
      best = m
  return best


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

  def table(self) -> dict[str, float]:
    return {"ar": 1.0, "spec": self.tokens_per_step}
