"""``python -m redrafter_jax.bench report FOLDER``: rebuild the suite's ``results.md`` and plots.

Everything is built from ``FOLDER/measurements.json`` alone (written by the ``suite`` benchmark,
through ``Store``): every number in the report is a measurement there or a ratio of two
measurements taken on the same prompts; nothing is typed in, so an unmet goal simply shows.

The measurements and their aggregation live in ``_measurements``; the plots in ``plots``.
"""

from __future__ import annotations

import json
import pathlib
import sys

from redrafter_jax.bench import plots
from redrafter_jax.bench._measurements import (FP32_AR, GREEDY_AR, HF_BF16, HF_GREEDY,
                                               ResultsError, best_greedy, measured, rate,
                                               speedup, tokens_per_step, with_runs)


# ---- markdown --------------------------------------------------------------------------------

def fmt(x, spec: str = ".1f", suffix: str = "") -> str:
  """A number for a table cell; n/a where nothing was measured."""
  return "n/a" if x is None else f"{x:{spec}}{suffix}"


def table(head: list[str], rows: list[list[str]]) -> list[str]:
  align = ["---"] + ["---:"] * (len(head) - 1)
  return ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"] + [
      "| " + " | ".join(r) + " |" for r in rows] + [""]


def greedy_table(data: dict) -> list[str]:
  runs, methods = data["runs"], data["methods"]
  fp32 = FP32_AR in methods and bool(measured(runs, FP32_AR))
  rows = []
  for k in with_runs(data, lambda m: m["temperature"] == 0):
    pids = measured(runs, k)
    same = measured(runs, k, GREEDY_AR)
    agree = sum(runs[p][k]["output_ids"] == runs[p][GREEDY_AR]["output_ids"] for p in same)
    tokens = sum(runs[p][k]["new_tokens"] for p in pids)
    rows.append([methods[k]["label"], str(len(pids)), str(tokens), fmt(rate(runs, k, pids)),
                 fmt(speedup(runs, k, GREEDY_AR), ".2f", "x"),
                 *([fmt(speedup(runs, k, FP32_AR), ".2f", "x")] if fp32 else []),
                 fmt(speedup(runs, k, HF_GREEDY), ".2f", "x"),
                 fmt(tokens_per_step(runs, k, pids), ".2f"), f"{agree}/{len(same)}"])
  return table(["method", "prompts", "new tokens", "tokens/s", "vs our AR",
                *(["vs our AR, fp32 weights"] if fp32 else []), "vs transformers",
                "tokens/step", "same tokens as our AR"], rows)


def sampling_table(data: dict) -> list[str]:
  runs, methods = data["runs"], data["methods"]
  rows = []
  for k in with_runs(data, lambda m: m["temperature"] > 0):
    m, pids = methods[k], measured(runs, k)
    rows.append([m["label"], f"{m['temperature']:g}", str(len(pids)), fmt(rate(runs, k, pids)),
                 fmt(speedup(runs, k, m["reference"]), ".2f", "x"),
                 fmt(tokens_per_step(runs, k, pids), ".2f")])
  return table(["method", "T", "prompts", "tokens/s", "vs our AR at same T", "tokens/step"], rows)


def category_table(data: dict) -> list[str]:
  runs = data["runs"]
  best = best_greedy(data)
  lookup = next(iter(with_runs(data, lambda m: m["kind"] == "prompt_lookup")), None)
  if best is None:
    return ["(no greedy ReDrafter measurements)", ""]
  cats = list(dict.fromkeys(p["category"] for p in data["prompts"].values()))
  rows = []
  for c in cats + [None]:
    pids = measured(runs, best, GREEDY_AR, category=c)
    if not pids:
      continue
    sp = lambda a, b: speedup(runs, a, b, category=c) if a and b else None
    lk = measured(runs, lookup, category=c) if lookup else []
    rd_vs_lk = sp(best, lookup)
    rows.append([c or "**all**", str(len(pids)), fmt(rate(runs, GREEDY_AR, pids)),
                 fmt(rate(runs, best, pids)), fmt(sp(best, GREEDY_AR), ".2f", "x"),
                 fmt(tokens_per_step(runs, best, pids), ".2f"),
                 fmt(rate(runs, lookup, lk) if lk else None),
                 fmt(sp(lookup, HF_GREEDY), ".2f", "x"),
                 fmt(tokens_per_step(runs, lookup, lk) if lk else None, ".2f"),
                 fmt(rd_vs_lk, ".2f", "x")])
  return [f"ReDrafter setting: {data['methods'][best]['label']} (best overall greedy speedup)."
          " Each method's speedup is over its own framework's AR greedy (ours / transformers'),"
          " as in Spec-Bench.", ""] + table(
      ["category", "prompts", "our AR tok/s", "ReDrafter tok/s", "ReDrafter speedup",
       "ReDrafter tok/step", "prompt lookup tok/s", "prompt lookup speedup",
       "prompt lookup tok/step", "ReDrafter / prompt lookup tok/s"], rows)


def divergence_section(data: dict) -> list[str]:
  """Where each greedy ReDrafter and the two AR controls part from our AR greedy, with the
  float32 gaps the JSON holds (``bench.divergence.report``); older folders without controls
  count 0/0 for them."""
  from redrafter_jax.bench import divergence

  methods = data["methods"]
  trees = [(k, methods[k]["label"]) for k in
           with_runs(data, lambda m: m["kind"] == "redrafter" and m["temperature"] == 0)]
  section = data.get("divergence") or {}
  controls = section.get("controls") or {}
  keep = {GREEDY_AR} | {k for k, _ in trees}
  runs = {pid: {**{k: r for k, r in recs.items() if k in keep}, **controls.get(pid, {})}
          for pid, recs in data["runs"].items()}
  return ["The first new-token index where each greedy run's output parts from our AR greedy "
          "(batch 1). Gap: the same weights with float32 activations on the prompt + the common "
          "prefix, logit[our AR's token] - logit[the other's] (small: a near-tie, either token is "
          "the model's). The controls run our AR against itself at batch 4 and at another cache "
          "size: the model's own noise under a change of shape.", ""] + divergence.report(
              runs, trees, section.get("gaps") or {}, data["prompts"], GREEDY_AR)


def split_table(data: dict) -> list[str]:
  rows = [[data["methods"][k]["label"], str(s["tree_tokens"]), fmt(s["draft_ms"]),
           fmt(s["verify_ms"]), fmt(s["accept_commit_ms"]),
           fmt(100 * s["overhead_vs_verify"], ".0f", "%")] for k, s in data["step_split"].items()]
  return table(["setting", "tree tokens N", "draft ms", "verify ms", "accept+commit ms",
                "overhead / verify"], rows)


def batch_table(data: dict) -> list[str]:
  rows = []
  for B, recs in sorted(data["batch"].items(), key=lambda item: int(item[0])):
    ar, rd = recs.get(GREEDY_AR), next((r for k, r in recs.items() if k != GREEDY_AR), None)
    get = lambda r, k: r[k] if r else None
    rows.append([B, fmt(get(ar, "per_request_tokens_per_s")), fmt(get(ar, "tokens_per_s")),
                 fmt(get(rd, "per_request_tokens_per_s")), fmt(get(rd, "tokens_per_s")),
                 fmt(rd["tokens_per_s"] / ar["tokens_per_s"] if ar and rd else None, ".2f", "x"),
                 fmt(get(rd, "tokens_per_step"), ".2f")])
  name = next((data["methods"][k]["label"] for recs in data["batch"].values() for k in recs
               if k != GREEDY_AR), "ReDrafter")
  return [f"Greedy, our AR vs {name}; per-request = a row's new tokens / wall time of the "
          "batch call, averaged over rows.", ""] + table(
      ["batch", "AR per-request tok/s", "AR total tok/s", "ReDrafter per-request tok/s",
       "ReDrafter total tok/s", "speedup", "ReDrafter tok/step"], rows)


def header(data: dict) -> list[str]:
  s, env = data["settings"], (data["sessions"] or [{}])[-1]
  lines = ["# ReDrafter benchmark suite", "",
           f"Machine: {env.get('system')} {env.get('machine')}, {env.get('cpus')} CPUs, device "
           f"{env.get('device')} ({env.get('backend')}); jax {env.get('jax')}, torch "
           f"{env.get('torch', 'n/a')} ({env.get('torch_threads', 'n/a')} threads), transformers "
           f"{env.get('transformers', 'n/a')}.",
           f"Model {s['model']} ({s['dtype']} activations, {s.get('param_dtype') or s['dtype']} "
           f"weights, attention {s['attention']}; transformers "
           f"{s['dtype'] if str(env.get('transformers_device')).startswith('cuda') else 'float32'}"
           f"{', and bfloat16 in its own row' if HF_BF16 in data['methods'] else ''}); drafter "
           f"{s['drafter']}; up to {s['max_new_tokens']} new tokens per prompt (stop tokens end "
           f"a response); {len(data['prompts'])} Spec-Bench prompts, batch 1 unless stated.",
           f"Command: `python -m redrafter_jax.bench suite {' '.join(env.get('argv', []))}`.",
           "Runs: " + "; ".join(f"{x.get('started')} (load average {x.get('load_average_start')}"
                                 f" -> {x.get('load_average_end', '?')})"
                                 for x in data["sessions"]) + "."]
  busy = [x for x in data["sessions"] if _load(x) > 0.5 * (x.get("cpus") or 1)]
  if busy:
    lines.append("**The machine was busy during a run (see the load averages): timings are noisy, "
                 "and transformers' multi-threaded CPU kernels slow down far more under "
                 "contention than XLA's, so ratios against transformers are unreliable.**")
  if s["drafter"] == "random":
    lines.append("**The drafter is untrained (random weights): drafts are almost never accepted, "
                 "so these numbers time the machinery, not ReDrafter's speedup.**")
  lines += [x["note"] for x in data["sessions"] if x.get("note")]
  return lines + [""]


def _load(session: dict) -> float:
  try:
    return float(session.get("load_average_start"))
  except (TypeError, ValueError):
    return 0.0


DEFINITIONS = """\
Definitions. tokens/s: all new tokens over all wall seconds of whole calls (prefill included,
compilation excluded: a call that compiled is timed again). Speedups are ratios of tokens/s over
the prompts both methods ran on, in the same run, interleaved prompt by prompt. tokens/step:
ReDrafter's (accepted drafted tokens + 1) per verification step; transformers': new tokens per
forward call; AR: 1. "same tokens": prompts whose greedy output equals our AR greedy output
token for token (float32 ties may flip a few). "our AR greedy, float32 weights" (runs with bfloat16
weights) is the same model with its weights unrounded: its tokens may differ from the
bfloat16-weight AR's, ReDrafter's must not. "transformers greedy, bfloat16" computes in bfloat16
throughout (weights and activations), so its tokens drift from the float32 model's; "vs
transformers" is against its float32 run. Typical acceptance is lossy by design: its output
distribution differs from the model's."""


def render(data: dict, plots: list[str]) -> str:
  lines = header(data)
  lines += ["## Greedy", ""] + greedy_table(data)
  lines += ["## Greedy divergence from our AR", ""] + divergence_section(data)
  lines += ["## Sampling", ""] + sampling_table(data)
  lines += ["## Per category (greedy)", ""] + category_table(data)
  if data["step_split"]:
    lines += ["## One decode step, split (median ms)", ""] + split_table(data)
  if data["batch"]:
    lines += ["## Batch sizes", ""] + batch_table(data)
  lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + ["", DEFINITIONS, ""]
  return "\n".join(lines)


def write(folder: pathlib.Path) -> pathlib.Path:
  """``results.md`` and the plots from ``folder/measurements.json``; returns the markdown path."""

  path = pathlib.Path(folder) / "measurements.json"
  if not path.is_file():
    raise ResultsError(f"no measurements.json in {folder}")
  data = json.loads(path.read_text())
  out = path.parent / "results.md"
  out.write_text(render(data, plots.write(path.parent, data)))
  return out


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if len(argv) != 1 or argv[0].startswith("-"):
    print("usage: python -m redrafter_jax.bench report RESULTS_FOLDER\n" + __doc__.strip())
    return 2
  try:
    print(write(pathlib.Path(argv[0])).read_text())
  except ResultsError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
