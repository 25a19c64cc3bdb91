"""The two arms' training metrics at equal steps (both saw the same batches in the same order):
copy_3 minus baseline, mean over blocks of 20 steps with a normal 95% interval over the steps.

  python results/linux-x86-64-2cpu/2026-12-07-copy-hint/paired_batches.py
"""
import csv
import math
import pathlib
import statistics as st

HERE = pathlib.Path(__file__).parent


def rows(path):
  return {int(r["step"]): r for r in csv.DictReader(open(path))}


a, b = rows(HERE / "baseline" / "metrics.csv"), rows(HERE / "copy_3" / "metrics.csv")
common = sorted(set(a) & set(b))
print("| steps | baseline step-1 top-1 | " + " | ".join(
    f"copy_3 - baseline, {k}" for k in ("top1_1", "top1_2", "top1_3", "top1_4", "loss")) + " |")
print("|---|---:|" + "---:|" * 5)
for lo in range(1, common[-1] + 1, 20):
  steps = [s for s in common if lo <= s < lo + 20]
  cells = []
  for k in ("top1_1", "top1_2", "top1_3", "top1_4", "loss"):
    d = [float(b[s][k]) - float(a[s][k]) for s in steps]
    cells.append(f"{st.mean(d):+.3f} ± {1.96 * st.stdev(d) / math.sqrt(len(d)):.3f}")
  base = st.mean(float(a[s]["top1_1"]) for s in steps)
  print(f"| {steps[0]}-{steps[-1]} | {base:.3f} | " + " | ".join(cells) + " |")
