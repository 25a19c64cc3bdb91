"""``python -m redrafter_jax.bench context``: time per step against context length, one cache.

One cache capacity (``--cache-size`` slots per row) for every row of the table; only the rows'
committed length changes. Each context is timed twice: attention over the whole cache (what
every step did before context buckets) and over the smallest context bucket that holds the
context plus the step's new tokens (``kv_cache.context_bucket``; what ``ReDrafter`` now does).
The steps timed are the LLM forward of one decoding step: an AR step (T = 1) and a verify
forward over ``--tree-tokens`` tree tokens (a chain: the mask's shape does not change the cost).
The two variants of a row are timed alternately, so load from other work on the machine falls
on both alike: compare them as ratios.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import pathlib
import statistics
import sys
import time

from redrafter_jax.bench.ar import load_average
from redrafter_jax.helptext import show_defaults


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m redrafter_jax.bench context",
                              description=__doc__.strip().splitlines()[0])
  show_defaults(p)
  p.add_argument("--model", default="smollm2-135m", help="known name, .gguf file or HF folder")
  p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="bfloat16",
                 help="the LLM's weights (activations and cache stay float32)")
  p.add_argument("--backend", default="xla", help="attention backend")
  p.add_argument("--cache-size", type=int, default=2048, help="cache slots per row (capacity)")
  p.add_argument("--contexts", default="240,500,1000,2000",
                 help="comma-separated committed lengths")
  p.add_argument("--batch", type=int, default=1, help="rows per step")
  p.add_argument("--tree-tokens", type=int, default=16, help="N of the verify forward")
  p.add_argument("--min-bucket", type=int, default=256, help="the smallest context bucket")
  p.add_argument("--reps", type=int, default=7, help="timed calls per program (median)")
  p.add_argument("--out", type=pathlib.Path, help="also write the table (markdown) here")
  args = p.parse_args(argv)
  try:
    args.contexts = [int(c) for c in args.contexts.split(",")]
  except ValueError:
    p.error(f"--contexts must be comma-separated integers, got {args.contexts!r}")
  if min(args.contexts + [args.batch, args.tree_tokens, args.reps, args.min_bucket]) < 1:
    p.error("contexts, --batch, --tree-tokens, --min-bucket and --reps must be >= 1")
  if max(args.contexts) + args.tree_tokens > args.cache_size:
    p.error(f"context {max(args.contexts)} + {args.tree_tokens} tree tokens does not fit "
            f"--cache-size {args.cache_size}")
  return args


@functools.lru_cache(maxsize=None)
def _forward():
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from redrafter_jax.models import kv_cache as kvc

  @functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=3)
  def forward(graphdef, width, state, cache, tokens_BT):
    """T chained new tokens after each row's committed prefix, reading ``width`` slots (None:
    all); they stay uncommitted, so the returned cache serves the next repetition."""
    model = nnx.merge(graphdef, state)
    B, T = tokens_BT.shape
    positions_BT = cache.lengths_B[:, None] + jnp.arange(T)[None, :]
    mask_BTS = kvc.visible_mask(cache.lengths_B, kvc.causal_mask(jnp.ones((B, T), bool)),
                                width or cache.size)
    logits_BTV, _, cache = model(tokens_BT, positions_BT, mask_BTS, cache)
    return jnp.argmax(logits_BTV, axis=-1), cache  # every logit is needed: none is cut away

  return forward


def machine() -> str:
  from redrafter_jax.training.distill import machine as describe

  return describe()


def measure(llm, args) -> list[dict]:
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from redrafter_jax.models import kv_cache as kvc

  graphdef, state = nnx.split(llm)
  forward = _forward()
  B, S = args.batch, args.cache_size
  cache = llm.init_cache(B, S)
  rows = []
  for T, label in ((1, "AR step (T=1)"), (args.tree_tokens, f"verify (N={args.tree_tokens})")):
    tokens = jnp.ones((B, T), jnp.int32)
    for ctx in args.contexts:
      cache = cache.replace(lengths_B=jnp.full((B,), ctx, jnp.int32))
      bucket = kvc.context_bucket(ctx + T, S, args.min_bucket)
      widths = {"whole": None, "bucket": None if bucket == S else bucket}
      times = {k: [] for k in widths}
      for k, w in widths.items():  # compile, and warm up
        for _ in range(2):
          out, cache = forward(graphdef, w, state, cache, tokens)
          jax.block_until_ready(out)
      for _ in range(args.reps):  # alternate: load falls on both alike
        for k, w in widths.items():
          t = time.perf_counter()
          out, cache = forward(graphdef, w, state, cache, tokens)
          jax.block_until_ready(out)
          times[k].append(time.perf_counter() - t)
      whole, bucketed = (1e3 * statistics.median(times[k]) for k in ("whole", "bucket"))
      rows.append(dict(step=label, context=ctx, bucket=bucket, whole_ms=whole,
                       bucket_ms=bucketed))
      print(f"{label} context {ctx}: whole {whole:.1f} ms, bucket {bucket} {bucketed:.1f} ms",
            file=sys.stderr)
  return rows


def render(rows: list[dict], args, header: str) -> str:
  lines = [header, "",
           f"| step | context | slots read (bucket) | ms, all {args.cache_size} slots | "
           "ms, bucket | bucket / all | vs the shortest context, bucket |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  first = {}
  for r in rows:
    first.setdefault(r["step"], r["bucket_ms"])
    lines.append(f"| {r['step']} | {r['context']} | {r['bucket']} | {r['whole_ms']:.1f} | "
                 f"{r['bucket_ms']:.1f} | {r['bucket_ms'] / r['whole_ms']:.2f} | "
                 f"{r['bucket_ms'] / first[r['step']]:.2f} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  import jax

  from redrafter_jax.bench._common import load
  from redrafter_jax.errors import UserError

  args = parse_args(argv)
  try:
    llm = load(args.model, backend=args.backend, param_dtype=args.param_dtype,
               tokenizer=False).llm
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  rows = measure(llm, args)
  header = (f"Context bench, {datetime.date.today()}: {args.model}, {args.param_dtype} weights, "
            f"float32 activations and cache, backend {args.backend}, batch {args.batch}, "
            f"cache {args.cache_size} slots per row, median of {args.reps}. Machine: "
            f"{machine()}; jax {jax.__version__}; load average {load_average()} at the end.")
  text = render(rows, args, header)
  print(text)
  if args.out:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
  return 0
