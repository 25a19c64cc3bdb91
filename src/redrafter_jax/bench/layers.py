"""``python -m redrafter_jax.bench layers``: layers unrolled vs scanned, compile time vs run time.

The same weights in both forms (``llama.stack_layers``: one layer body over stacked parameters,
a stacked KV cache). For each form and each program a user meets, the seconds JAX spends
tracing, lowering and compiling it on its first call (summed from JAX's own compile events, so
nothing else is counted) and its warm run time (median of ``--repeat`` calls):

  ``decode``     ``ReDrafter`` over ``--batch`` prompts, ``--max-new-tokens`` each (one program)
  ``generate``   greedy AR over the same prompts (one program)
  ``step``       one ``ReDrafter.step`` (draft, verify, accept, commit) at batch 1
  ``ar step``    AR's one-token step over the same cache slots

Prompts are random tokens of ``--context`` length: both forms compute the same function, and the
table says whether their greedy tokens agree. The two forms run one after the other in one
process, so compare them as ratios from one run.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import statistics
import sys
import time

from redrafter_jax.bench._compiles import compile_seconds
from redrafter_jax.bench.ar import load_average
from redrafter_jax.helptext import show_defaults

def parse_args(argv):
  from redrafter_jax.inference.tree_choice import Beams

  p = argparse.ArgumentParser(prog="python -m redrafter_jax.bench layers",
                              description=__doc__.strip().splitlines()[0])
  show_defaults(p)
  p.add_argument("--model", default="smollm2-135m",
                 help="known name, .gguf file, HF folder or random:<spec>")
  p.add_argument("--drafter", default="shipped",
                 help="drafter folder, 'shipped' (checkpoints/) or 'random'")
  p.add_argument("--param-dtype", default="auto", help="the LLM's weights (auto: the CPU's)")
  p.add_argument("--beams", default="1x4+3/5", help="the draft tree (WxL+n/N)")
  p.add_argument("--draft-vocab", type=int, default=None,
                 help="draft vocabulary (default: the drafter's decode.json, else all)")
  p.add_argument("--batch", type=int, default=2, help="prompts in the decode/generate calls")
  p.add_argument("--context", type=int, default=200, help="prompt length (random tokens)")
  p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per decode")
  p.add_argument("--repeat", type=int, default=5, help="warm calls per program (median)")
  p.add_argument("--forms", default="unrolled,scanned", help="comma-separated, in run order")
  p.add_argument("--out", type=pathlib.Path, help="also write the table (markdown) here")
  args = p.parse_args(argv)
  try:
    (args.beams,) = Beams.parse_list(args.beams)
  except ValueError as e:
    p.error(f"--beams: {e} (give one tree)")
  args.forms = args.forms.split(",")
  if not args.forms or set(args.forms) - {"unrolled", "scanned"}:
    p.error(f"--forms: a comma-separated list of 'unrolled' and 'scanned', got {args.forms}")
  if min(args.batch, args.context, args.max_new_tokens, args.repeat) < 1:
    p.error("--batch, --context, --max-new-tokens and --repeat must be >= 1")
  return args


def _first(fn):
  import jax

  with compile_seconds() as secs:
    out = jax.block_until_ready(fn())
  return out, secs[0]


def measure(llm, drafter, args, prompts) -> tuple[list[dict], list[list[int]]]:
  """The table's rows for one form of ``llm``, and its greedy ReDrafter tokens."""
  import jax

  from redrafter_jax.inference.ar import generate, one_token_step_seconds
  from redrafter_jax.inference.decode import ReDrafter
  from redrafter_jax.inference.timing import TreeStepper, median_seconds

  cfg = args.beams.config(max_new_tokens=args.max_new_tokens, draft_vocab_size=args.draft_vocab)
  rd = ReDrafter(llm, drafter, cfg)
  rows = []
  result, secs = _first(lambda: rd(prompts))
  rows.append(dict(program="decode", compile_s=secs, warm_s=median_seconds(
      lambda: rd(prompts), args.repeat, warmup=0)))
  _, secs = _first(lambda: generate(llm, prompts, max_new_tokens=args.max_new_tokens).tokens)
  rows.append(dict(program="generate", compile_s=secs, warm_s=median_seconds(
      lambda: generate(llm, prompts, max_new_tokens=args.max_new_tokens).tokens, args.repeat,
      warmup=0)))
  one_step = TreeStepper(llm, drafter, args.beams.config(draft_vocab_size=args.draft_vocab),
                         prompts[0], args.repeat)
  _, secs = _first(one_step)
  rows.append(dict(program="step", compile_s=secs, warm_s=median_seconds(one_step, args.repeat,
                                                                      warmup=0)))
  slots = one_step.cache_width()
  with compile_seconds() as secs:
    ar = one_token_step_seconds(llm, 1, slots, args.context, args.repeat)
  rows.append(dict(program="ar step", compile_s=secs[0], warm_s=statistics.median(ar)))
  jax.clear_caches()  # the next form compiles from nothing, as in a fresh process
  return rows, result.tokens


def table(results: dict[str, list[dict]], same: bool | None, args, seconds: float) -> str:
  forms = list(results)
  lines = [f"# Layers unrolled vs scanned ({datetime.date.today()})", "",
           f"`python -m redrafter_jax.bench layers {' '.join(sys.argv[2:])}`".rstrip(), "",
           f"model {args.model}, weights {args.param_dtype}, tree {args.beams.text}, batch "
           f"{args.batch} x {args.context} prompt tokens, {args.max_new_tokens} new tokens, "
           f"warm = median of {args.repeat}; {seconds:.0f} s in all; load average "
           f"{load_average()}", ""]
  head = "| program | " + " | ".join(f"{f} compile s | {f} warm" for f in forms)
  if len(forms) == 2:
    head += " | compile scanned/unrolled | warm scanned/unrolled"
  lines += [head + " |", "|" + "---|" * (1 + 2 * len(forms) + 2 * (len(forms) == 2))]
  for i, row in enumerate(results[forms[0]]):
    cells = [row["program"]]
    for f in forms:
      r = results[f][i]
      warm = f"{r['warm_s'] * 1e3:.1f} ms" if r["warm_s"] < 1 else f"{r['warm_s']:.2f} s"
      cells += [f"{r['compile_s']:.1f}", warm]
    if len(forms) == 2:
      a, b = results["unrolled"][i], results["scanned"][i]
      cells += [f"{b['compile_s'] / a['compile_s']:.2f}x", f"{b['warm_s'] / a['warm_s']:.2f}x"]
    lines.append("| " + " | ".join(cells) + " |")
  if same is not None:
    lines += ["", f"Greedy ReDrafter tokens of the two forms identical: {'yes' if same else 'NO'}"]
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  args = parse_args(argv)
  import numpy as np
  from flax import nnx

  from redrafter_jax.bench._common import emit, load_models
  from redrafter_jax.models.llama import stack_layers

  t0 = time.perf_counter()
  m = load_models(args)
  llm, cfg, drafter = m.llm, m.cfg, m.drafter
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, cfg.vocab_size, (args.batch, args.context)).tolist()
  results, tokens = {}, {}
  for form in args.forms:
    model = stack_layers(nnx.clone(llm)) if form == "scanned" else llm
    results[form], tokens[form] = measure(model, drafter, args, prompts)
    print(f"{form}: done", file=sys.stderr, flush=True)
  same = tokens["unrolled"] == tokens["scanned"] if len(tokens) == 2 else None
  emit(table(results, same, args, time.perf_counter() - t0), args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
