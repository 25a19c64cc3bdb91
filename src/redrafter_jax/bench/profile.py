"""``python -m redrafter_jax.bench profile``: where one decoding step's time goes, per XLA op.

Runs AR ``generate()`` or ReDrafter ``decode()`` once to compile, once timed, and once under the
JAX profiler, then sums the trace's op events by kind (``dot``, ``copy``, ``fusion`` names with
their numeric suffix removed) and, where the program's optimized HLO could be dumped, by output
shape too. Times are per decoding step (AR: per token; ReDrafter: per verify step). With the HLO
at hand, the table holds only the ops of the decoding loop (the instructions of a ``while`` body
and what it calls); the ops outside it (prefill, setup) are one total line. A ``copy`` row is
data movement XLA inserted, e.g. around the KV cache's in-place update in the loop; a ``dot`` row
whose time is far above its weight bytes over the memory bandwidth is a slow matmul path. Ops are the trace events that name an HLO op
(the CPU runtime names every thunk; loop containers and host events are left out).

The HLO shapes need ``XLA_FLAGS=--xla_dump_to=...`` before JAX starts: this command sets it
when it runs as the first JAX user of the process (it does from the command line).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import pathlib
import re
import tempfile
import time

from redrafter_jax.helptext import show_defaults

# Containers (their time is their body's ops) and host-side events are not ops of the step.
_CONTAINERS = ("while", "conditional", "call")
OUTSIDE_LOOP = "(all ops outside the decoding loop: prefill, setup)"


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m redrafter_jax.bench profile",
                              description=__doc__.strip().splitlines()[0])
  show_defaults(p)
  p.add_argument("--mode", choices=("ar", "redrafter"), default="ar",
                 help="the decoder profiled")
  p.add_argument("--model", default="smollm2-135m", help="known name, .gguf file or HF folder")
  p.add_argument("--drafter", default="shipped", help="drafter folder for --mode redrafter")
  p.add_argument("--prompt-tokens", type=int, default=200, help="length of a synthetic prompt")
  p.add_argument("--max-new-tokens", type=int, default=64, help="tokens decoded")
  p.add_argument("--top", type=int, default=20, help="rows to print")
  p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32",
                 help="the LLM's weights (activations stay float32)")
  args = p.parse_args(argv)
  if min(args.prompt_tokens, args.max_new_tokens, args.top) < 1:
    p.error("--prompt-tokens, --max-new-tokens and --top must be >= 1")
  return args


_CALLEE = re.compile(r"\b(?:body|condition|calls|to_apply|true_computation|false_computation|"
                     r"branch_computations)=\{?([^,}\s]+(?:, %[^,}\s]+)*)")


def hlo_signatures(dump_dir: pathlib.Path | None) -> dict[tuple[str, str], tuple[str, bool]]:
  """``{(module, op name): ('kind output-shape', in_loop)}`` from the optimized HLO texts in
  ``dump_dir``; ``in_loop``: the op belongs to a ``while`` body or a computation it calls (every
  op of a module without a ``while`` counts as in the loop: there is nothing to set apart)."""
  sig = {}
  for f in glob.glob(str(dump_dir / "*after_optimizations.txt")) if dump_dir else ():
    module = re.sub(r"^module_\d+\.(.*?)\.\w+_after_optimizations\.txt$", r"\1",
                    pathlib.Path(f).name)
    ops, callees, loop_roots, computation = {}, collections.defaultdict(set), set(), ""
    for line in pathlib.Path(f).read_text().splitlines():
      head = re.match(r"(?:ENTRY )?%([\w.\-]+) .*\{$", line)
      if head and not line.startswith(" "):
        computation = head.group(1)
        continue
      for names in _CALLEE.findall(line):
        called = {n.strip().lstrip("%") for n in names.split(",")}
        callees[computation] |= called
        if re.search(r"\swhile\(", line):
          loop_roots |= called
      m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ([^ ]+(?: [^ ]+)?) (\w[\w-]*)\(", line)
      if m:
        ops[m.group(1)] = (f"{m.group(3)} {m.group(2).split('{')[0]}", computation)
    in_loop, todo = set(), list(loop_roots)
    while todo:
      c = todo.pop()
      if c not in in_loop:
        in_loop.add(c)
        todo.extend(callees[c])
    for name, (label, comp) in ops.items():  # a module without a loop counts whole
      sig[(module, name)] = (label, comp in in_loop or not loop_roots)
  return sig


def op_table(trace_file: pathlib.Path, steps: int, sig: dict) -> list[tuple[float, float, str]]:
  """``[(ms per step, ops per step, 'kind [shape]')]``, largest first, from one trace file.

  Where ``sig`` places an op outside every loop, it is summed into one row,
  ``OUTSIDE_LOOP``."""
  events = json.load(gzip.open(trace_file))["traceEvents"]
  total, count = collections.Counter(), collections.Counter()
  for e in events:
    args = e.get("args", {})
    if e.get("ph") != "X" or "dur" not in e or "hlo_op" not in args:
      continue
    module = args.get("hlo_module", "")
    kind = re.sub(r"[._]\d+$", "", e["name"])
    if kind in _CONTAINERS:
      continue
    label, in_loop = sig.get((module, e["name"]), (None, True))
    key = f"{kind}: {label.split(' ', 1)[1]}" if label else kind
    if not in_loop:
      key = OUTSIDE_LOOP
    total[key] += e["dur"]
    count[key] += 1
  return [(us / steps / 1e3, count[k] / steps, k) for k, us in total.most_common()]


def _newest_trace(folder: str) -> pathlib.Path:
  files = sorted(glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True), key=os.path.getmtime)
  if not files:
    raise RuntimeError(f"the profiler wrote no trace under {folder}")
  return pathlib.Path(files[-1])


def profile(run, steps_of, dump_dir: pathlib.Path | None = None):
  """Compile ``run()``, time it, trace it; returns ``(seconds, steps, table)``."""
  import jax

  run()
  t = time.perf_counter()
  result = run()
  seconds = time.perf_counter() - t
  steps = max(int(steps_of(result)), 1)
  with tempfile.TemporaryDirectory() as folder:
    jax.profiler.start_trace(folder)
    try:
      run()
    finally:
      jax.profiler.stop_trace()
    return seconds, steps, op_table(_newest_trace(folder), steps, hlo_signatures(dump_dir))


def main(argv=None) -> int:
  args = parse_args(argv)
  flags = os.environ.get("XLA_FLAGS", "")
  given = re.search(r"--xla_dump_to=(\S+)", flags)
  if given:  # the user's own dump folder
    return _run(args, pathlib.Path(given.group(1)))
  # Else a temporary one; XLA reads the flag only when JAX starts (so: from the command line).
  with tempfile.TemporaryDirectory(prefix="redrafter_hlo_") as dump:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_dump_to={dump}".strip()
    try:
      return _run(args, pathlib.Path(dump))
    finally:
      os.environ["XLA_FLAGS"] = flags


def _run(args, dump: pathlib.Path) -> int:
  import jax

  from redrafter_jax.bench._common import load
  from redrafter_jax.inference.ar import generate
  from redrafter_jax.inference.decode import ReDrafter
  from redrafter_jax.weights.drafter_io import load_drafter
  from redrafter_jax.weights.shipped import recommended_config, resolve_drafter

  models = load(args.model, param_dtype=args.param_dtype, tokenizer=False)
  llm, cfg = models.llm, models.cfg
  prompt = [1] + [100 + i % (cfg.vocab_size - 100) for i in range(args.prompt_tokens - 1)]
  if args.mode == "ar":
    run = lambda: generate(llm, [prompt], max_new_tokens=args.max_new_tokens)
    steps_of = lambda r: sum(len(t) for t in r.tokens)
    what = "AR generate"
  else:
    path = resolve_drafter(args.drafter)
    dcfg = recommended_config(path, max_new_tokens=args.max_new_tokens)
    redrafter = ReDrafter(llm, load_drafter(path), dcfg)
    run = lambda: redrafter([prompt])
    steps_of = lambda r: r.metrics["steps"]
    what = (f"ReDrafter decode W={dcfg.beam_width} L={dcfg.beam_length} "
            f"lookup={dcfg.lookup_ngram} N={dcfg.num_tree_tokens}")
  seconds, steps, table = profile(run, steps_of, dump)
  print(f"# {what}: {args.model} ({args.param_dtype} weights), {jax.default_backend()}, "
        f"prompt {args.prompt_tokens} tokens, "
        f"{args.max_new_tokens} new; {steps} steps, {seconds / steps * 1e3:.1f} ms/step wall "
        f"(the whole call over its steps, prefill included)\n")
  loop = [r for r in table if r[2] != OUTSIDE_LOOP]
  outside = sum(r[0] for r in table if r[2] == OUTSIDE_LOOP)
  print("| ms/step | ops/step | op kind: output shape |\n| ---: | ---: | --- |")
  for ms, n, key in loop[:args.top]:
    print(f"| {ms:.2f} | {n:.1f} | {key} |")
  print(f"\nsum of op time in the loop: {sum(r[0] for r in loop):.1f} ms/step (ops may overlap on "
        f"threads); outside it (prefill, setup): {outside * steps:.1f} ms in all")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
