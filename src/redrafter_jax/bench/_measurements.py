"""The suite's measurements: ``measurements.json`` (``Store``) and the aggregations that the
report and the plots share (every number they show is a measurement or a ratio of two taken on
the same prompts).

JSON layout: ``settings`` (what measurements depend on; a resumed run must match), ``sessions``
(environment of each run), ``methods`` (key -> description), ``prompts`` (id -> category, prompt
tokens, cache size), ``runs`` (prompt id -> method key -> measurement), ``step_split`` (method
key -> ms of draft / verify / accept+commit), ``batch`` (batch size -> method key -> measurement),
``divergence`` (``controls``: prompt id -> control key -> the AR control's output; ``gaps``:
prompt id -> method or control key -> the float32 logit gap where it parts from our AR greedy;
see ``bench.divergence``).
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile

SCHEMA = 1
GREEDY_AR, HF_GREEDY = "ar_greedy", "transformers_greedy"
FP32_AR = "ar_greedy_fp32"  # our AR with float32 weights, in runs whose LLM has bf16 weights
HF_BF16 = "transformers_greedy_bf16"  # transformers in bfloat16, in runs where it is float32


class ResultsError(RuntimeError):
  """A results folder that cannot be read or resumed."""


class Store:
  """``measurements.json``, rewritten atomically after every change."""

  def __init__(self, path: pathlib.Path, settings: dict):
    self.path = path
    if path.is_file():
      self.data = json.loads(path.read_text())
      old = self.data.get("settings") or {}
      if self.data.get("schema") != SCHEMA or old != settings:
        diff = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
        raise ResultsError(f"{path} holds measurements taken with other settings {diff} "
                           "(old, new): pass another --out")
    else:
      self.data = dict(schema=SCHEMA, settings=settings, sessions=[], methods={}, prompts={},
                       runs={}, step_split={}, batch={}, divergence=dict(controls={}, gaps={}))

  def has(self, section: str, *keys) -> bool:
    node = self.data[section]
    for k in keys:
      if k not in node:
        return False
      node = node[k]
    return True

  def put(self, section: str, *keys, value) -> None:
    node = self.data[section]
    for k in keys[:-1]:
      node = node.setdefault(k, {})
    node[keys[-1]] = value
    self.save()

  def save(self) -> None:
    """A crash mid-write leaves the previous file intact."""
    self.path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".measurements-", suffix=".json")
    with os.fdopen(fd, "w") as f:
      json.dump(self.data, f, indent=1)
    os.replace(tmp, self.path)


# ---- aggregation: over the prompts every compared method ran on -----------------------------

def measured(runs: dict, *keys: str, category: str | None = None) -> list[str]:
  return [p for p, r in runs.items() if all(k in r for k in keys)
          and (category is None or r[keys[0]]["category"] == category)]


def rate(runs: dict, key: str, pids: list[str]) -> float | None:
  """Overall tokens/s: all new tokens over all seconds (not a mean of per-prompt rates)."""
  secs = sum(runs[p][key]["seconds"] for p in pids)
  return sum(runs[p][key]["new_tokens"] for p in pids) / secs if pids and secs else None


def speedup(runs: dict, key: str, base: str, category: str | None = None) -> float | None:
  pids = measured(runs, key, base, category=category)
  a, b = rate(runs, key, pids), rate(runs, base, pids)
  return a / b if a and b else None


def tokens_per_step(runs: dict, key: str, pids: list[str]) -> float | None:
  steps = sum(runs[p][key]["steps"] for p in pids)
  if not steps:
    return None
  return sum(runs[p][key]["tokens_per_step"] * runs[p][key]["steps"] for p in pids) / steps


def histogram(runs: dict, key: str) -> list[int]:
  """Verification steps by number of accepted drafted tokens, summed over prompts."""
  out: list[int] = []
  for p in measured(runs, key):
    h = runs[p][key].get("accepted_histogram") or []
    n = max(len(out), len(h))
    out = [a + b for a, b in zip(out + [0] * (n - len(out)), h + [0] * (n - len(h)))]
  return out


def with_runs(data: dict, pred) -> list[str]:
  """Method keys (in run order) that match ``pred`` and have at least one measurement."""
  runs = data["runs"]
  return [k for k, m in data["methods"].items() if pred(m) and measured(runs, k)]


def best_greedy(data: dict) -> str | None:
  keys = with_runs(data, lambda m: m["kind"] == "redrafter" and m["temperature"] == 0)
  ranked = [(speedup(data["runs"], k, GREEDY_AR) or 0.0, k) for k in keys]
  return max(ranked)[1] if ranked else None
