"""``python -m redrafter_jax.bench train_step``: a training preset's step, float32 against bf16
matmuls (``train.matmul_dtype``).

Each setting runs the preset's own trainer for ``--steps`` steps from the same start (the preset's
drafter and data; output to a temporary folder, nothing exported): the trainer's meter times the
steps after the first (compiling) one. The settings run one after the other, ``--rounds`` times in
turn, in one process, so compare them as ratios from one run. The first step's loss of each
setting shows that both train the same drafter on the same batch.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

from redrafter_jax.helptext import show_defaults

SETTINGS = ("float32", "bfloat16")


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m redrafter_jax.bench train_step",
                              description=__doc__.strip().splitlines()[0])
  show_defaults(p)
  p.add_argument("--config", type=pathlib.Path, required=True, help="training preset (YAML)")
  p.add_argument("overrides", nargs="*", help="preset overrides, key=value (as train.py takes)")
  p.add_argument("--steps", type=int, default=8, help="steps per setting (the first compiles)")
  p.add_argument("--rounds", type=int, default=1, help="times each setting runs, in turn")
  p.add_argument("--matmul-dtypes", default=",".join(SETTINGS),
                 help="comma-separated train.matmul_dtype settings, in run order")
  p.add_argument("--out", type=pathlib.Path, help="also write the table (markdown) here")
  args = p.parse_args(argv)
  args.matmul_dtypes = args.matmul_dtypes.split(",")
  if not args.matmul_dtypes or set(args.matmul_dtypes) - set(SETTINGS):
    p.error(f"--matmul-dtypes: a comma-separated list of {', '.join(SETTINGS)}, got "
            f"{args.matmul_dtypes}")
  if args.steps < 3 or args.rounds < 1:
    p.error("--steps must be >= 3 (the first compiles) and --rounds >= 1")
  return args


def time_setting(config, overrides, matmul_dtype: str, steps: int) -> dict:
  """One run of ``steps`` steps: seconds per step after the first, tokens/s, first loss."""
  from redrafter_jax.config import load_preset
  from redrafter_jax.training import trainer

  with tempfile.TemporaryDirectory() as tmp:
    preset = load_preset(config, dict(
        overrides, **{"train.output_dir": tmp, "train.num_steps": steps,
                      "train.max_seconds": None, "train.eval_shards": 0,
                      "train.checkpoint_every": 10 * steps, "train.log_every": steps,
                      "train.matmul_dtype": matmul_dtype}))
    result = trainer.train(preset, progress=False, export=False)
  rows = result.history
  tokens_per_step = sum(r["tokens"] for r in rows[1:]) / (len(rows) - 1)
  tok_s = rows[-1]["tokens_per_s"]
  return dict(matmul_dtype=matmul_dtype, seconds_per_step=tokens_per_step / tok_s,
              tokens_per_s=tok_s, first_loss=rows[0]["loss"], last_loss=rows[-1]["loss"])


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  from redrafter_jax.config import parse_overrides

  overrides = parse_overrides(args.overrides)
  runs = [time_setting(args.config, overrides, dtype, args.steps)
          for _ in range(args.rounds) for dtype in args.matmul_dtypes]
  base = runs[0]["seconds_per_step"]
  what = " ".join([f"`{args.config}`", *args.overrides])
  lines = [f"{what}: {args.steps} steps per run (timed after the first)", "",
           "| train.matmul_dtype | s/step | tokens/s | vs the first run | first loss | last loss |",
           "| --- | ---: | ---: | ---: | ---: | ---: |"]
  for r in runs:
    lines.append(f"| {r['matmul_dtype']} | {r['seconds_per_step']:.3f} | {r['tokens_per_s']:.0f} "
                 f"| {base / r['seconds_per_step']:.2f}x | {r['first_loss']:.4f} "
                 f"| {r['last_loss']:.4f} |")
  text = "\n".join(lines)
  print(text)
  if args.out:
    args.out.write_text(text + "\n")
  return 0
