"""``python -m redrafter_jax.bench plots FOLDER``: the suite's PNG plots from its measurements.json.

speedup_vs_beam_width.png     greedy speedup over our AR and tokens/step against W, one line per L
                              (and per L with the context-lookup beam)
accepted_length_histogram.png share of steps accepting k drafted tokens, per greedy setting
step_split.png                draft / verify / accept+commit ms of one step, per setting
batch_throughput.png          total and per-request tokens/s against batch size (if measured)

A plot without data still gets its file (saying so), so a results folder always has the same
set of files.
"""

from __future__ import annotations

import json
import pathlib
import sys

from redrafter_jax.bench._measurements import (GREEDY_AR, HF_GREEDY, histogram, measured,
                                               rate, speedup, tokens_per_step, with_runs)


def _figure(ncols: int = 1):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, 4), squeeze=False)
  return plt, fig, axes[0]


def _log2_axis(ax, ticks, label: str) -> None:
  ax.set_xscale("log", base=2)
  if ticks:
    ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
    ax.minorticks_off()
  ax.set_xlabel(label)


def _save(plt, fig, folder: pathlib.Path, name: str, empty: bool) -> str:
  if empty:
    fig.text(0.5, 0.5, "no measurements for this plot", ha="center", va="center")
  fig.tight_layout()
  fig.savefig(folder / name, dpi=110)
  plt.close(fig)
  return name


def speedup_vs_width(folder, data) -> str:
  runs, methods = data["runs"], data["methods"]
  plt, fig, (ax_s, ax_t) = _figure(2)
  keys = with_runs(data, lambda m: m["kind"] == "redrafter" and m["temperature"] == 0)
  line_of = lambda k: (methods[k]["beam_length"], methods[k].get("lookup_ngram", 0),
                       methods[k].get("token_budget", 0))
  for L, n, N in sorted({line_of(k) for k in keys}):
    pts = sorted((methods[k]["beam_width"], speedup(runs, k, GREEDY_AR),
                  tokens_per_step(runs, k, measured(runs, k)))
                 for k in keys if line_of(k) == (L, n, N))
    label = f"L={L}" + (f" + lookup {n}" if n else "") + (f", N={N}" if N else "")
    ax_s.plot([p[0] for p in pts], [p[1] or 0 for p in pts], "o-" if not n else "s--",
              label=label)
    ax_t.plot([p[0] for p in pts], [p[2] or 0 for p in pts], "o-" if not n else "s--",
              label=label)
  lookup = with_runs(data, lambda m: m["kind"] == "prompt_lookup")
  if keys and lookup and speedup(runs, lookup[0], HF_GREEDY):
    ax_s.axhline(speedup(runs, lookup[0], HF_GREEDY), color="gray", ls="--",
                 label="prompt lookup (vs transformers)")
  for ax, name in ((ax_s, "speedup over our AR greedy"), (ax_t, "tokens/step")):
    ax.axhline(1.0, color="black", lw=0.8)
    _log2_axis(ax, {methods[k]["beam_width"] for k in keys}, "beam width W")
    ax.set_ylabel(name)
    if keys:
      ax.legend()
  ax_s.set_title("ReDrafter greedy")
  return _save(plt, fig, folder, "speedup_vs_beam_width.png", not keys)


def accepted_histogram(folder, data) -> str:
  plt, fig, (ax,) = _figure()
  keys = with_runs(data, lambda m: m["kind"] == "redrafter")
  hists = {k: histogram(data["runs"], k) for k in keys}
  hists = {k: h for k, h in hists.items() if sum(h)}
  width = 0.8 / max(len(hists), 1)
  for i, (k, h) in enumerate(hists.items()):
    ax.bar([x + (i - (len(hists) - 1) / 2) * width for x in range(len(h))],
           [c / sum(h) for c in h], width,
           label=data["methods"][k]["label"])
  ax.set_xticks(range(max((len(h) for h in hists.values()), default=0)))
  ax.set_xlabel("drafted tokens accepted in a step")
  ax.set_ylabel("share of steps")
  if hists:
    ax.legend(fontsize=7)
  return _save(plt, fig, folder, "accepted_length_histogram.png", not hists)


def step_split(folder, data) -> str:
  plt, fig, (ax,) = _figure()
  split = data["step_split"]
  names = [data["methods"][k]["label"].replace("ReDrafter ", "") for k in split]
  bottom = [0.0] * len(split)
  for part, label in (("draft_ms", "draft (beam search + pack)"), ("verify_ms", "verify forward"),
                      ("accept_commit_ms", "accept + commit")):
    vals = [s[part] for s in split.values()]
    ax.bar(names, vals, bottom=bottom, label=label)
    bottom = [b + v for b, v in zip(bottom, vals)]
  ar = rate(data["runs"], GREEDY_AR, measured(data["runs"], GREEDY_AR))
  if split and ar:
    ax.axhline(1000 / ar, color="black", ls="--", label="our AR greedy: ms per token")
  ax.set_ylabel("ms per decode step (median)")
  ax.tick_params(axis="x", labelrotation=30)
  if split:
    ax.legend()
  return _save(plt, fig, folder, "step_split.png", not split)


def batch_throughput(folder, data) -> str:
  plt, fig, (ax_t, ax_r) = _figure(2)
  sizes = sorted(data["batch"], key=int)
  keys = list(dict.fromkeys(k for B in sizes for k in data["batch"][B]))
  for k in keys:
    pts = [(int(B), data["batch"][B][k]) for B in sizes if k in data["batch"][B]]
    label = data["methods"][k]["label"]
    ax_t.plot([b for b, _ in pts], [r["tokens_per_s"] for _, r in pts], "o-", label=label)
    ax_r.plot([b for b, _ in pts], [r["per_request_tokens_per_s"] for _, r in pts], "o-",
              label=label)
  for ax, name in ((ax_t, "total tokens/s"), (ax_r, "per-request tokens/s")):
    _log2_axis(ax, {int(B) for B in sizes}, "batch size")
    ax.set_ylabel(name)
    if keys:
      ax.legend()
  return _save(plt, fig, folder, "batch_throughput.png", not keys)


def write(folder: pathlib.Path, data: dict) -> list[str]:
  """Write every plot into ``folder``; returns the file names."""
  folder = pathlib.Path(folder)
  out = [speedup_vs_width(folder, data), accepted_histogram(folder, data),
         step_split(folder, data)]
  if data["batch"]:
    out.append(batch_throughput(folder, data))
  return out


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  path = pathlib.Path(argv[0]) / "measurements.json" if len(argv) == 1 else None
  if path is None or not path.is_file():
    print("usage: python -m redrafter_jax.bench plots RESULTS_FOLDER (with measurements.json)",
          file=sys.stderr)
    return 2
  print("\n".join(write(path.parent, json.loads(path.read_text()))))
  return 0


if __name__ == "__main__":
  sys.exit(main())
