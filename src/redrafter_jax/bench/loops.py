"""``python -m redrafter_jax.bench loops``: the decode loops with and without a host sync per step.

On a GPU, XLA runs a ``lax.while_loop`` whose trip count it does not know by copying the loop's
predicate to the host after every iteration and waiting for it, so the next step's kernels
cannot be launched while the current step runs. This times AR ``generate`` and ReDrafter, both
greedy, three ways:

  plain    the loops as they are: one predicate check per step
  k=<k>    ``steps_per_check`` k (``--steps-per-check``): k steps per check, in an inner loop of
           fixed trip count; steps after the end are masked (``inference.runtime.checked_loop``)
  cmdbuf   plain, with XLA's command buffers (CUDA graphs) for WHILE and CONDITIONAL as well as
           its default commands (``CMDBUF_FLAG``), so that a loop can run as one graph: GPU only

XLA reads its flags once, when the backend starts, so each variant runs in a subprocess of this
module (``--variant``, internal) with its own ``XLA_FLAGS`` and reports one JSON line. Every
variant must give the plain variant's tokens and step counts (and ReDrafter's metrics): the
bench fails, after printing the table, when one does not.

ms/token: the wall time of the calls over the tokens each row generated (no stop tokens, so
``--max-new-tokens`` per row), prefill included, median of ``--reps``; compile s: the seconds
JAX spent compiling during the variant's untimed first calls (its own compile events).
``--tiny`` runs on tiny random models and random prompts (for tests).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

from redrafter_jax.bench.ar import DEFAULT_PROMPTS
from redrafter_jax.helptext import show_defaults

# XLA's default command types (``DefaultDebugOptionsIgnoringFlags`` in xla/debug_options_flags.cc)
# plus WHILE and CONDITIONAL. Written out in full: the flag's "+WHILE,+CONDITIONAL" form adds
# only the first item in some XLA versions.
CMDBUF_FLAG = ("--xla_gpu_enable_command_buffer="
               "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL")
RESULT_PREFIX = "LOOPS_RESULT "  # the line a variant's subprocess reports on
NOT_ON_CPU = "n/a (GPU only)"
TINY = dict(model="random:tiny", drafter="random", exit_dim=32, prompt_tokens=12)


class VariantError(RuntimeError):
  """A variant's subprocess failed or reported nothing."""


def parse_args(argv):
  from redrafter_jax.inference.tree_choice import Beams

  p = argparse.ArgumentParser(prog="python -m redrafter_jax.bench loops",
                              description=__doc__.strip().splitlines()[0])
  show_defaults(p)
  p.add_argument("--model", default="smollm2-135m",
                 help="known name, .gguf file, HF folder or random:<spec>")
  p.add_argument("--drafter", default="shipped",
                 help="drafter folder, 'shipped' (checkpoints/) or 'random'")
  p.add_argument("--exit-dim", type=int, default=256, help="exit_dim of a random drafter")
  p.add_argument("--draft-vocab", type=int, default=None,
                 help="draft vocabulary (default: the drafter's decode.json, else all)")
  p.add_argument("--param-dtype", choices=("float32", "bfloat16", "auto"), default="auto",
                 help="the LLM's weights (auto: the platform's faster one)")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                 help="activations and KV cache")
  p.add_argument("--beams", default="1x4+3/5", help="ReDrafter's tree (WxL+n/N)")
  p.add_argument("--prompts", default=None,
                 help=f"Spec-Bench style jsonl, or 'random' (random token ids); default "
                      f"{DEFAULT_PROMPTS} (random with --tiny)")
  p.add_argument("--num-prompts", type=int, default=4, help="prompts, spread over the file")
  p.add_argument("--prompt-tokens", type=int, default=64,
                 help="longest random prompt (random prompts only)")
  p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt")
  p.add_argument("--prompt-multiple", type=int, default=64,
                 help="prompts are padded to a multiple of this (one prefill program per "
                      "padded length: a large value compiles fewer)")
  p.add_argument("--cache-size", type=int, default=None,
                 help="KV-cache slots per row (default: prompt + new tokens, rounded up)")
  p.add_argument("--batch-sizes", default="1", help="comma-separated batch sizes")
  p.add_argument("--steps-per-check", default="4,8", help="comma-separated k values (> 1)")
  p.add_argument("--reps", type=int, default=3, help="timed repetitions (median)")
  p.add_argument("--tiny", action="store_true",
                 help="tiny random LLM and drafter, random prompts (for tests)")
  p.add_argument("--out", type=pathlib.Path, help="also write the table here (and a .json)")
  p.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant, print JSON
  args = p.parse_args(argv)
  try:
    (args.beams,) = Beams.parse_list(args.beams)
  except ValueError as e:
    p.error(f"--beams: {e} (give one tree)")
  try:
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.steps_per_check = [int(k) for k in args.steps_per_check.split(",") if k.strip()]
  except ValueError:
    p.error("--batch-sizes and --steps-per-check take comma-separated integers")
  if min(args.batch_sizes) < 1 or any(k < 2 for k in args.steps_per_check):
    p.error("batch sizes must be >= 1 and --steps-per-check values >= 2 (1 is plain)")
  if len(set(args.steps_per_check)) < len(args.steps_per_check):
    p.error(f"--steps-per-check: repeated values in {args.steps_per_check}")
  if min(args.num_prompts, args.prompt_tokens, args.max_new_tokens, args.reps,
         args.exit_dim, args.prompt_multiple,
         1 if args.cache_size is None else args.cache_size) < 1:
    p.error("--num-prompts, --prompt-tokens, --max-new-tokens, --reps, --exit-dim, "
            "--prompt-multiple and --cache-size must be >= 1")
  if args.tiny:
    for name, value in TINY.items():
      if p.get_default(name) == getattr(args, name):
        setattr(args, name, value)
  if args.prompts is None:
    args.prompts = "random" if args.tiny else str(DEFAULT_PROMPTS)
  if args.prompts != "random" and not pathlib.Path(args.prompts).is_file():
    p.error(f"--prompts: no such file {args.prompts} (or give 'random')")
  if args.variant is not None and args.variant not in variant_names(args):
    p.error(f"--variant: one of {variant_names(args)}, got {args.variant!r}")
  return args


def variant_names(args) -> list[str]:
  return ["plain"] + [f"k={k}" for k in args.steps_per_check] + ["cmdbuf"]


def steps_of(variant: str) -> int:
  return int(variant[2:]) if variant.startswith("k=") else 1


# ----------------------------------------------------------------------------------------------
# One variant (in its own process)


def load_prompts(args, tok, vocab_size: int) -> list[list[int]]:
  """Token-id prompts: from the jsonl (chat-formatted), or random ids of varied lengths."""
  if args.prompts == "random":
    import numpy as np

    rng = np.random.default_rng(0)
    lengths = rng.integers(max(1, args.prompt_tokens // 2), args.prompt_tokens + 1,
                           args.num_prompts)
    return [rng.integers(1, vocab_size, n).tolist() for n in lengths]
  from redrafter_jax.bench.ar import read_prompts
  from redrafter_jax.weights.tokenizer import encode

  rows = read_prompts(pathlib.Path(args.prompts), args.num_prompts)
  return [encode(tok, row["prompt"], chat=True) for row in rows]


def batches(prompts: list[list[int]], size: int) -> list[list[list[int]]]:
  """The prompts in consecutive batches of ``size`` (the last one, or a batch larger than all
  the prompts, filled up from the first prompts again)."""
  n = -(-len(prompts) // size)
  return [[prompts[(i * size + j) % len(prompts)] for j in range(size)] for i in range(n)]


def measure(calls, reps: int) -> dict:
  """Untimed first calls (their compile seconds), then ``reps`` timed rounds of them."""
  from redrafter_jax.bench._compiles import compile_seconds

  with compile_seconds() as compiled:
    first = [call() for call in calls]
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    for call in calls:
      call()  # results come back to the host: the call has finished
    times.append(time.perf_counter() - start)
  times.sort()
  return dict(first=first, seconds=times[len(times) // 2], compile_s=compiled[0])


def run_variant(args) -> dict:
  """Time AR and ReDrafter for each batch size in this process (its XLA flags set)."""
  import jax

  from redrafter_jax.bench._common import draft_vocab_arg, load
  from redrafter_jax.inference.ar import generate
  from redrafter_jax.inference.decode import ReDrafter
  from redrafter_jax.weights.param_dtype import weights_dtype

  k = steps_of(args.variant)
  models = load(args.model, dtype=args.dtype, param_dtype=args.param_dtype,
                drafter=args.drafter, exit_dim=args.exit_dim, tokenizer=args.prompts != "random")
  llm, cfg, drafter, tok = models.llm, models.cfg, models.drafter, models.tokenizer
  draft_vocab = draft_vocab_arg(args.drafter, args.draft_vocab)
  prompts = load_prompts(args, tok, cfg.vocab_size)
  n = args.max_new_tokens
  rd = ReDrafter(llm, drafter, args.beams.config(max_new_tokens=n, draft_vocab_size=draft_vocab,
                                                 steps_per_check=k))
  out = dict(variant=args.variant, steps_per_check=k, backend=jax.default_backend(),
             device=jax.devices()[0].device_kind, jax=jax.__version__,
             xla_flags=os.environ.get("XLA_FLAGS", ""), draft_vocab=draft_vocab,
             param_dtype=weights_dtype(args.param_dtype, dtype=args.dtype), rows=[])
  shapes = dict(cache_size=args.cache_size, prompt_multiple=args.prompt_multiple)
  for B in args.batch_sizes:
    groups = batches(prompts, B)
    ar = measure([lambda g=g: generate(llm, g, max_new_tokens=n, steps_per_check=k, **shapes)
                  for g in groups], args.reps)
    red = measure([lambda g=g: rd(g, **shapes) for g in groups], args.reps)
    row_tokens = len(groups) * n  # per row: no stop tokens, so every row makes n tokens
    out["rows"].append(dict(
        batch=B, calls=len(groups),
        ar_ms_per_token=1e3 * ar["seconds"] / row_tokens, ar_compile_s=ar["compile_s"],
        redrafter_ms_per_token=1e3 * red["seconds"] / row_tokens,
        redrafter_compile_s=red["compile_s"],
        ar_tokens=[r.tokens for r in ar["first"]], ar_steps=[r.steps for r in ar["first"]],
        redrafter_tokens=[r.tokens for r in red["first"]],
        redrafter_metrics=[r.metrics for r in red["first"]],
        tokens_per_step=sum(r.metrics["tokens_per_step"] for r in red["first"]) / len(groups)))
    print(f"{args.variant}: batch {B} done", file=sys.stderr, flush=True)
  return out


# ----------------------------------------------------------------------------------------------
# The parent: one subprocess per variant, then the table


def child_argv(args, variant: str) -> list[str]:
  argv = ["--model", args.model, "--drafter", args.drafter, "--exit-dim", str(args.exit_dim),
          "--param-dtype", args.param_dtype, "--dtype", args.dtype, "--beams", args.beams.text,
          "--prompts", args.prompts, "--num-prompts", str(args.num_prompts),
          "--prompt-tokens", str(args.prompt_tokens), "--max-new-tokens",
          str(args.max_new_tokens), "--prompt-multiple", str(args.prompt_multiple),
          *(["--cache-size", str(args.cache_size)] if args.cache_size else []),
          "--batch-sizes", ",".join(map(str, args.batch_sizes)),
          "--steps-per-check", ",".join(map(str, args.steps_per_check)),
          "--reps", str(args.reps), "--variant", variant]
  return argv + ([] if args.draft_vocab is None else ["--draft-vocab", str(args.draft_vocab)])


def variant_env(variant: str) -> dict:
  env = dict(os.environ)
  if variant == "cmdbuf":
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {CMDBUF_FLAG}".strip()
  return env


def spawn(args, variant: str) -> dict:
  """Run one variant in a subprocess (its stderr passed through) and return its report."""
  cmd = [sys.executable, "-m", "redrafter_jax.bench", "loops", *child_argv(args, variant)]
  proc = subprocess.run(cmd, env=variant_env(variant), stdout=subprocess.PIPE, text=True)
  lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
  if proc.returncode != 0 or not lines:
    raise VariantError(f"variant {variant!r} failed (exit status {proc.returncode}); "
                       f"its output ends: {proc.stdout[-500:]!r}")
  return json.loads(lines[-1][len(RESULT_PREFIX):])


def differences(plain: dict, other: dict) -> list[str]:
  """Where a variant's outputs differ from the plain variant's (empty: identical)."""
  out = []
  for a, b in zip(plain["rows"], other["rows"]):
    for key in ("ar_tokens", "ar_steps", "redrafter_tokens", "redrafter_metrics"):
      if a[key] != b[key]:
        out.append(f"{other['variant']}, batch {a['batch']}: {key} differ from plain's")
  return out


def table(args, results: dict, failures: dict, seconds: float, pending: bool = False) -> str:
  """The Markdown table; ``pending``: written while variants still run (they show as not run)."""
  plain = results["plain"]
  lines = [f"# Decode loops: host sync per step vs k steps per check vs command buffers "
           f"({time.strftime('%Y-%m-%d')})", "",
           f"model {args.model}, weights {plain['param_dtype']}, activations {args.dtype}, drafter "
           f"{args.drafter} (draft vocab {plain['draft_vocab'] or 'all'}), tree "
           f"{args.beams.text}, greedy, {args.num_prompts} prompts ({args.prompts}), "
           f"{args.max_new_tokens} new tokens per row, prompts padded to a multiple of "
           f"{args.prompt_multiple}, median of {args.reps}; "
           f"{plain['device']} ({plain['backend']}), jax {plain['jax']}; {seconds:.0f} s in all",
           "", "| variant | batch | AR ms/token | ReDrafter ms/token | AR speed vs plain "
           "| ReDrafter speed vs plain | ReDrafter tokens/step | compile s (AR + ReDrafter) "
           "| same outputs as plain |", "|---|---:|---:|---:|---:|---:|---:|---:|:---:|"]
  for variant in variant_names(args):
    if variant in failures or variant not in results:
      why = failures.get(variant, "not run (yet)" if pending else "not run")
      lines.append(f"| {variant} | | {why} | | | | | | |")
      continue
    r = results[variant]
    same = "yes" if not differences(plain, r) else "NO"
    for row, base in zip(r["rows"], plain["rows"]):
      lines.append(
          f"| {variant} | {row['batch']} | {row['ar_ms_per_token']:.3f} "
          f"| {row['redrafter_ms_per_token']:.3f} "
          f"| {base['ar_ms_per_token'] / row['ar_ms_per_token']:.2f}x "
          f"| {base['redrafter_ms_per_token'] / row['redrafter_ms_per_token']:.2f}x "
          f"| {row['tokens_per_step']:.2f} "
          f"| {row['ar_compile_s']:.1f} + {row['redrafter_compile_s']:.1f} | {same} |")
  lines += ["", f"cmdbuf: `XLA_FLAGS={CMDBUF_FLAG}`; k=<k>: `DecodeConfig.steps_per_check` / "
            "`generate(steps_per_check=k)`."]
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.variant is not None:
    print(RESULT_PREFIX + json.dumps(run_variant(args)), flush=True)
    return 0
  from redrafter_jax.bench._common import emit

  start = time.perf_counter()
  results, failures = {"plain": spawn(args, "plain")}, {}

  def write(report: str) -> None:
    if not args.out:
      return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    data = args.out.with_suffix(".json")
    data = data if data != args.out else args.out.with_suffix(".data.json")
    data.write_text(json.dumps(dict(argv=child_argv(args, "plain")[:-2], results=results,
                                    not_run=failures), indent=1))

  for variant in variant_names(args)[1:]:
    # what has run so far is on disk before the next variant starts (a caller with a deadline,
    # such as a lease, keeps it when this process is stopped)
    write(table(args, results, failures, time.perf_counter() - start, pending=True))
    if variant == "cmdbuf" and results["plain"]["backend"] != "gpu":
      failures[variant] = NOT_ON_CPU
      continue
    try:
      results[variant] = spawn(args, variant)
    except VariantError as e:
      print(f"error: {e}", file=sys.stderr)
      failures[variant] = "failed (see stderr)"
  report = table(args, results, failures, time.perf_counter() - start)
  emit(report, None)
  write(report)
  wrong = [d for v in results for d in differences(results["plain"], results[v])]
  for line in wrong:
    print(f"error: {line}", file=sys.stderr)
  if wrong:
    return 1
  return 1 if any(f != NOT_ON_CPU for f in failures.values()) else 0


if __name__ == "__main__":
  sys.exit(main())
