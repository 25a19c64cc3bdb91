"""Drafter ablations: variants of one training preset, trained on the same data, compared on the
same held-out shards.

An ablation file names a base preset and variants, each a set of dotted overrides (the same
keys as ``train.py``'s command line)::

  base: configs/smollm2_135m_ablation.yaml
  variants:
    baseline: {}
    exit_dim_768: {drafter.exit_dim: 768}

An optional ``common`` mapping holds overrides every variant shares (applied to the base before
the variant's own), e.g. another features folder or output folder for the whole ablation.

Variant ``NAME`` trains into ``<base train.output_dir>/NAME`` (resumable: a rerun continues
where a stopped one ended and skips finished ones), and ``table`` reads each variant's
``eval.csv`` (the held-out scores at its last step) and ``metrics.csv`` (training throughput)
into one table, with ``chain_tokens``: the tokens per step one greedy beam would give if each
step's held-out top-1 held independently, ``1 + sum_k prod_{j<=k} top1_j`` (teacher-forced
top-1 at step j is conditional on steps < j being right, so the product is the chance that the
first k drafted tokens are all the LLM's; a tree of W beams accepts at least that). Every variant sees the same batches in the same order (same data, seed and
batch shape) unless its overrides change those.
"""

from __future__ import annotations

import csv
import dataclasses
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from redrafter_jax.config import ConfigError, Preset, load_preset, read_yaml


@dataclasses.dataclass(frozen=True)
class Ablation:
  base: str  # the base preset (YAML)
  variants: Mapping[str, Mapping[str, Any]]  # name -> dotted overrides
  common: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # for every variant

  def preset(self, name: str) -> Preset:
    """The preset variant ``name`` trains with (its own output folder under the base's)."""
    if name not in self.variants:
      raise ConfigError(f"no variant {name!r}; the ablation has {', '.join(self.variants)}")
    overrides = dict(self.variants[name])
    if "train.output_dir" in overrides:
      raise ConfigError(f"variant {name!r}: train.output_dir is set by the ablation")
    root = load_preset(self.base, dict(self.common)).train.output_dir
    return load_preset(self.base, {**self.common, **overrides,
                                   "train.output_dir": f"{root}/{name}"})


def load_ablation(path: str | pathlib.Path) -> Ablation:
  path = pathlib.Path(path)
  data = read_yaml(path, "ablation file")
  if not isinstance(data, dict) or set(data) - {"base", "variants", "common"} \
      or "base" not in data:
    raise ConfigError(f"{path}: expected the keys 'base' (a preset), 'variants' and optionally "
                      "'common'")
  common = data.get("common") or {}
  if not isinstance(common, dict) or not all(isinstance(k, str) for k in common):
    raise ConfigError(f"{path}: 'common' must map dotted keys to values")
  variants = data.get("variants") or {}
  if not isinstance(variants, dict) or not variants:
    raise ConfigError(f"{path}: 'variants' must map names to overrides")
  for name, overrides in variants.items():
    if not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides):
      raise ConfigError(f"{path}: variant {name!r} must map dotted keys to values")
    if not str(name).replace("_", "").replace("-", "").isalnum():
      raise ConfigError(f"{path}: variant name {name!r} must be letters, digits, '_' or '-'")
  ablation = Ablation(str(data["base"]), {str(k): dict(v) for k, v in variants.items()},
                      dict(common))
  for name in ablation.variants:  # every override must parse before anything trains
    ablation.preset(name)
  return ablation


def describe(ablation: Ablation, name: str) -> str:
  overrides = ablation.variants[name]
  return " ".join(f"{k}={v}" for k, v in overrides.items()) or "(base)"


def _read_csv(path: pathlib.Path) -> list[dict[str, str]]:
  if not path.is_file():
    return []
  with path.open() as f:
    return list(csv.DictReader(f))


def variant_row(ablation: Ablation, name: str) -> dict[str, Any]:
  """One variant's result: its held-out scores at its last evaluated step, its mean training
  tokens/s (steps after the first 5, which include compilation) and its drafter's size."""
  preset = ablation.preset(name)
  out = pathlib.Path(preset.train.output_dir)
  evals = _read_csv(out / "eval.csv")
  steps = _read_csv(out / "metrics.csv")
  row: dict[str, Any] = {"variant": name, "overrides": describe(ablation, name), "step": None}
  if evals:
    last = evals[-1]
    row["step"] = int(last["step"])
    for key in ("loss_1", "top1_1", "top1_2", "top1_3", "top1_4", "top5_1", "coverage_1"):
      row[key] = float(last[key]) if last.get(key) not in (None, "") else None
    row["chain_tokens"] = chain_tokens(last)
  speeds = [float(r["tokens_per_s"]) for r in steps[5:] if r.get("tokens_per_s")]
  row["tokens_per_s"] = sum(speeds) / len(speeds) if speeds else None
  drafter_dir = out / "drafter"
  if drafter_dir.is_dir():
    import jax
    from flax import nnx

    from redrafter_jax.weights.drafter_io import load_drafter

    params = nnx.state(load_drafter(drafter_dir), nnx.Param)
    row["params_m"] = sum(x.size for x in jax.tree.leaves(params)) / 1e6
  return row


def chain_tokens(eval_row: Mapping[str, Any]) -> float | None:
  """``1 + sum_k prod_{j<=k} top1_j`` over the steps ``eval_row`` holds (``top1_1``, ...)."""
  accs = []
  while eval_row.get(f"top1_{len(accs) + 1}") not in (None, ""):
    accs.append(float(eval_row[f"top1_{len(accs) + 1}"]))
  if not accs:
    return None
  total, run = 1.0, 1.0
  for acc in accs:
    run *= acc
    total += run
  return total


def table(rows: Sequence[Mapping[str, Any]]) -> str:
  """The rows as a Markdown table (missing values as "-")."""
  cols = [("variant", "variant", "{}"), ("overrides", "overrides", "{}"),
          ("step", "held-out at step", "{}"), ("params_m", "params (M)", "{:.2f}"),
          ("top1_1", "top-1 step 1", "{:.3f}"), ("top1_2", "step 2", "{:.3f}"),
          ("top1_3", "step 3", "{:.3f}"), ("top1_4", "step 4", "{:.3f}"),
          ("chain_tokens", "1-beam tokens/step", "{:.3f}"), ("top5_1", "top-5 step 1", "{:.3f}"),
          ("loss_1", "loss step 1", "{:.3f}"), ("coverage_1", "coverage", "{:.3f}"),
          ("tokens_per_s", "train tok/s", "{:.0f}")]
  fmt = lambda r, k, f: "-" if r.get(k) is None else f.format(r[k])
  lines = ["| " + " | ".join(h for _, h, _ in cols) + " |",
           "| " + " | ".join("---" if k in ("variant", "overrides") else "---:"
                            for k, _, _ in cols) + " |"]
  lines += ["| " + " | ".join(fmt(r, k, f) for k, _, f in cols) + " |" for r in rows]
  return "\n".join(lines)


PAIRED_KEYS = ("top1_1", "top1_2", "top1_3", "top1_4", "loss")


def paired_by_step(base: Sequence[Mapping[str, str]], other: Sequence[Mapping[str, str]], *,
                   block: int = 20, keys: Sequence[str] = PAIRED_KEYS) -> list[dict[str, Any]]:
  """``other`` minus ``base`` on the training metrics of the steps both logged (two variants of
  one ablation see the same batches in the same order, so step s is a paired comparison on one
  batch), averaged over blocks of ``block`` steps with a normal 95% half-width over the block's
  steps.

  Args:
    base, other: ``metrics.csv`` rows (``step`` and ``keys`` columns).
    block: steps per block.
    keys: the metrics compared.

  Returns:
    One dict per block: ``first``, ``last`` (steps), ``base_<key>`` (the base's mean) and, per
    key, ``(mean difference, half-width)`` (half-width None for a block of one step).
  """
  a = {int(r["step"]): r for r in base}
  b = {int(r["step"]): r for r in other}
  common = sorted(set(a) & set(b))
  out = []
  for start in range(0, len(common), block):
    steps = common[start:start + block]
    row: dict[str, Any] = {"first": steps[0], "last": steps[-1]}
    for k in keys:
      d = np.array([float(b[s][k]) - float(a[s][k]) for s in steps])
      half = 1.96 * d.std(ddof=1) / np.sqrt(d.size) if d.size > 1 else None
      row[k] = (float(d.mean()), None if half is None else float(half))
      row[f"base_{k}"] = float(np.mean([float(a[s][k]) for s in steps]))
    out.append(row)
  return out


def paired_table(ablation: Ablation, base: str, block: int = 20) -> str:
  """Every other variant against ``base`` by ``paired_by_step``, as Markdown."""
  if base not in ablation.variants:
    raise ConfigError(f"--paired {base}: no such variant ({', '.join(ablation.variants)})")
  rows = lambda n: _read_csv(pathlib.Path(ablation.preset(n).train.output_dir) / "metrics.csv")
  lines = ["| variant | steps | base top-1 step 1 | " + " | ".join(
      f"- base, {k}" for k in PAIRED_KEYS) + " |", "|---|---|---:|" + "---:|" * len(PAIRED_KEYS)]
  for name in ablation.variants:
    if name == base:
      continue
    for r in paired_by_step(rows(base), rows(name), block=block):
      cell = lambda m, h: f"{m:+.3f}" + ("" if h is None else f" ± {h:.3f}")
      lines.append(f"| {name} | {r['first']}-{r['last']} | {r['base_top1_1']:.3f} | "
                   + " | ".join(cell(*r[k]) for k in PAIRED_KEYS) + " |")
  return "\n".join(lines)
