"""What the Spec-Bench suite runs: its methods (``Method``), the prompts it picks
(``select_prompts``) and its error. Shared by ``suite``, ``divergence`` and ``report``, so that
none of them imports another for these.
"""

from __future__ import annotations

import dataclasses
import pathlib

from redrafter_jax.bench.ar import read_prompts
from redrafter_jax.bench.decode import Beams


class SuiteError(RuntimeError):
  """Bad arguments or an out folder that cannot be resumed; reported without a traceback."""


@dataclasses.dataclass(frozen=True)
class Method:
  key: str
  label: str
  kind: str  # ar | redrafter | transformers | prompt_lookup
  temperature: float = 0.0
  beam_width: int = 0
  beam_length: int = 0
  acceptance: str = "greedy"  # greedy | exact | typical
  reference: str = "ar_greedy"  # our AR at the same temperature: the speedup baseline
  lookup_ngram: int = 0  # the context-lookup beam's n-gram size (0: none)
  token_budget: int = 0  # tree tokens N (0: the whole tree)
  param_dtype: str = ""  # the LLM's weights when not the run's own (--param-dtype)
  first_alternatives: int = 0  # the step-1 alternatives K (0: none)

  @classmethod
  def redrafter(cls, b: Beams, prefix: str = "", label: str = "", temperature: float = 0.0,
                acceptance: str = "greedy", reference: str = "ar_greedy") -> "Method":
    return cls(f"redrafter_{prefix}{b.key}", f"ReDrafter {label}{b.label}", "redrafter",
               temperature, b.width, b.length, acceptance, reference, b.lookup, b.budget,
               first_alternatives=b.alternatives)

  @property
  def beams(self) -> Beams:
    return Beams(self.beam_width, self.beam_length, self.lookup_ngram, self.token_budget,
                 self.first_alternatives)


def select_prompts(path: pathlib.Path, per_category: int, skip: int = 0) -> list[dict]:
  """Rows ``skip + 1 .. skip + per_category`` of each category (in file order), categories in
  file order. ``skip`` makes disjoint subsets: choose settings on ``skip=0`` prompts, report on
  ``skip=per_category`` ones."""
  try:
    rows = read_prompts(path, None)
  except (FileNotFoundError, ValueError) as e:
    raise SuiteError(str(e)) from e
  seen, out = {}, []
  for i, row in enumerate(rows):
    missing = [k for k in ("id", "category", "prompt") if k not in row]
    if missing:
      raise SuiteError(f"{path}: line {i + 1} lacks {missing} (want id, category, prompt)")
    if str(row["id"]) in seen:
      raise SuiteError(f"{path}: duplicate prompt id {row['id']!r}")
    seen[str(row["id"])] = row["category"]
    if skip < sum(c == row["category"] for c in seen.values()) <= skip + per_category:
      out.append(row)
  return sorted(out, key=lambda r: list(dict.fromkeys(seen.values())).index(r["category"]))
