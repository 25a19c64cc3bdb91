"""``python -m redrafter_jax.bench throughput``: the distillation pipeline against the machine's limit.

Three measurements in one run, so their ratios hold whatever else the machine is doing:

1. **Roofline**: the best tokens/s of a batched forward of the LLM (causal, no KV cache, logits
   included) over a few shapes ``BxT``, with float32 and with bfloat16 weights (activations
   float32). Nothing that processes tokens through the LLM can beat it on this machine.
2. **Teacher generation**: ``distill()`` itself (the code ``redrafter-jax distill-data`` runs)
   answering ``--gen-prompts`` prompts of a prompts file, per batch size and sampled fraction;
   tokens/s counts response tokens over the whole second of two identical calls (prefill
   included; the first call compiles every shape, which a long job pays once).
3. **Training**: ``train()`` with a preset's model and training settings on the data written in
   2, for ``--train-steps`` steps after one untimed compiling step; tokens/s counts every token
   of every packed row (the trainer's own meter), the LLM forward included. Then the same
   training reading the LLM's hidden states precomputed once (``redrafter-jax features``,
   ``train.features``): a row for writing them (one LLM forward per token) and one for the
   steps, which then run only the drafter and the loss.

A fourth kind of row explains generation's distance from the roofline: **decode steps**, one
jitted one-token step of the LLM at batch ``B`` over a KV cache of ``S`` slots half full (the
step teacher generation repeats, cache donated as in its loop), tokens/s = B / step time, for
each ``--decode-steps BxS``. A step reads every weight once for its B rows but every row's cache
slots too, so its cost grows with S where the roofline's does not.
``--roofline-only`` stops after the roofline and decode-step rows.

Prints one markdown table; each row also gives its share of the roofline.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

from redrafter_jax.helptext import show_defaults

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m redrafter_jax.bench throughput",
                              description=__doc__.strip().splitlines()[0])
  show_defaults(p)
  p.add_argument("--model", default="smollm2-135m", help="known name, .gguf file or HF folder")
  p.add_argument("--prompts", type=pathlib.Path, required=True,
                 help="prompts file for the generation rows (e.g. prompt-mix's output)")
  p.add_argument("--forward-shapes", default="8x384,32x128,128x32",
                 help="comma-separated BxT shapes of the roofline forward")
  p.add_argument("--gen-prompts", type=int, default=128, help="prompts per generation row")
  p.add_argument("--gen-batch", default="64,128", help="batch sizes of the generation rows")
  p.add_argument("--sampled-fraction", default="0.25",
                 help="comma-separated sampled fractions of the generation rows")
  p.add_argument("--max-new-tokens", default="128",
                 help="answer length cap(s) of the generation rows, e.g. 128,256 (a longer cap "
                      "spreads each prompt's prefill over more answer tokens)")
  p.add_argument("--gen-param-dtype", default="float32", choices=("float32", "bfloat16"),
                 help="the LLM's weights when generating")
  p.add_argument("--config", type=pathlib.Path, default=REPO_ROOT / "configs" / "smollm2_135m.yaml",
                 help="preset whose drafter and training settings the training row uses")
  p.add_argument("--train-steps", type=int, default=4, help="timed training steps (0: no row)")
  p.add_argument("--reps", type=int, default=3, help="timed repetitions per forward shape")
  p.add_argument("--decode-steps", default="64x128,64x512",
                 help="BxS shapes of one-token decode steps (batch x cache slots); '' for none")
  p.add_argument("--roofline-only", action="store_true",
                 help="only the roofline and decode-step rows (no generation or training)")
  args = p.parse_args(argv)
  try:
    args.forward_shapes = [tuple(int(x) for x in s.split("x")) for s in
                           args.forward_shapes.split(",")]
    args.decode_steps = [tuple(int(x) for x in s.split("x")) for s in
                         args.decode_steps.split(",") if s]
    args.gen_batch = [int(b) for b in args.gen_batch.split(",")]
    args.sampled_fraction = [float(f) for f in args.sampled_fraction.split(",")]
    args.max_new_tokens = [int(n) for n in args.max_new_tokens.split(",")]
  except ValueError as e:
    p.error(f"bad list argument ({e})")
  if any(len(s) != 2 or min(s) < 1 for s in args.forward_shapes):
    p.error("--forward-shapes: each shape is BxT with B, T >= 1")
  if any(len(s) != 2 or s[0] < 1 or s[1] < 2 for s in args.decode_steps):
    p.error("--decode-steps: each shape is BxS with B >= 1 and S >= 2")
  if min(args.gen_batch) < 1 or args.gen_prompts < 1 or min(args.max_new_tokens) < 1 or (
      args.reps < 1):
    p.error("--gen-batch, --gen-prompts, --max-new-tokens and --reps must be >= 1")
  if args.train_steps < 0:
    p.error("--train-steps must be >= 0")
  return args


def forward_tokens_per_s(llm, batch: int, length: int, reps: int) -> float:
  """Best-of-``reps`` tokens/s of one jitted causal forward over ``[batch, length]`` tokens."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  graphdef, state = nnx.split(llm)

  @jax.jit
  def forward(state, tokens_BT):
    model = nnx.merge(graphdef, state)
    B, T = tokens_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
    mask_BTT = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    logits_BTV, _, _ = model(tokens_BT, positions_BT, mask_BTT)
    return jnp.argmax(logits_BTV, axis=-1)

  tokens_BT = jax.random.randint(jax.random.key(0), (batch, length), 100, 20000)
  jax.block_until_ready(forward(state, tokens_BT))
  best = float("inf")
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(forward(state, tokens_BT))
    best = min(best, time.perf_counter() - t)
  return batch * length / best


def decode_step_tokens_per_s(llm, batch: int, slots: int, reps: int) -> float:
  """Best-of-``reps`` tokens/s (``batch`` / step time) of generation's one-token step
  (``ar.one_token_step``, jitted) over a KV cache of ``slots`` slots, each row's half full; the
  cache is donated, as in generation's loop, so the step writes it in place."""
  from redrafter_jax.inference.ar import one_token_step_seconds

  return batch / min(one_token_step_seconds(llm, batch, slots, slots // 2, reps))


def main(argv=None) -> int:
  args = parse_args(argv)
  import sys

  from redrafter_jax.errors import UserError

  try:
    return _run(args)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


def _run(args) -> int:
  import logging

  import jax

  from redrafter_jax.bench._common import load
  from redrafter_jax.config import load_preset
  from redrafter_jax.training import distill
  from redrafter_jax.training.trainer import train
  from redrafter_jax.weights import base_model

  logging.getLogger("absl").setLevel(logging.WARNING)
  distill.read_prompts(args.prompts)  # a bad file fails now, not after the roofline rows
  rows = []  # (job, setting, tokens/s)
  for dtype in ("float32", "bfloat16"):
    llm = load(args.model, param_dtype=dtype, tokenizer=False).llm
    for B, T in args.forward_shapes:
      tok_s = forward_tokens_per_s(llm, B, T, args.reps)
      rows.append(("forward (roofline)", f"{dtype} weights, {B}x{T}", tok_s))
      print(f"forward {dtype} {B}x{T}: {tok_s:.0f} tok/s", flush=True)
    del llm
  llm = load(args.model, param_dtype=args.gen_param_dtype, tokenizer=False).llm
  for B, S in args.decode_steps:
    tok_s = decode_step_tokens_per_s(llm, B, S, args.reps)
    rows.append(("decode step", f"{args.gen_param_dtype} weights, batch {B}, cache {S} slots "
                 f"(half full)", tok_s))
    print(f"decode step {args.gen_param_dtype} {B}x{S}: {tok_s:.0f} tok/s", flush=True)
  tokenizer = base_model.load_base_tokenizer(args.model)
  with tempfile.TemporaryDirectory(prefix="redrafter_throughput_") as tmp:
    data_dir = None
    for batch in [] if args.roofline_only else args.gen_batch:
      for fraction in args.sampled_fraction:
        for new in args.max_new_tokens:
          run = lambda out: distill.distill(
              llm, tokenizer, args.prompts, out, model_name=args.model, limit=args.gen_prompts,
              max_new_tokens=new, batch_size=batch, sampled_fraction=fraction,
              shard_size=max(batch, args.gen_prompts // 2), progress=False)
          name = f"b{batch}-s{fraction}-n{new}"
          run(pathlib.Path(tmp) / f"warmup-{name}")  # compiles every shape it meets
          out = pathlib.Path(tmp) / f"gen-{name}"
          stats = run(out)
          rows.append(("teacher generation", f"{args.gen_param_dtype} weights, batch {batch}, "
                       f"sampled {fraction:g}, {new} new", stats.tokens_per_s))
          print(f"generation batch {batch} sampled {fraction} new {new}: "
                f"{stats.tokens_per_s:.0f} tok/s ({stats.new_tokens} tokens, "
                f"{stats.seconds:.0f} s)", flush=True)
          data_dir = data_dir or out
    del llm
    if args.train_steps and not args.roofline_only:
      preset = load_preset(args.config, {
          "train.data": str(data_dir), "train.output_dir": str(pathlib.Path(tmp) / "train"),
          "train.num_steps": args.train_steps + 1, "train.eval_shards": 0,
          "train.checkpoint_every": 10**6, "train.log_every": 1})
      result = train(preset, progress=False, export=False)
      tok_s = result.history[-1]["tokens_per_s"]
      p = preset.train
      rows.append(("training", f"{preset.dtype} LLM, batch {p.batch_size} x {p.seq_len}, "
                   f"{p.num_draft_steps} draft steps, vocab {p.vocab_limit or 'full'}, "
                   f"soft {p.soft_targets}", tok_s))
      print(f"training: {tok_s:.0f} tok/s", flush=True)
      from redrafter_jax.training import features

      llm = load(preset.model, dtype=preset.dtype, param_dtype=preset.param_dtype,
                 tokenizer=False).llm
      feats = pathlib.Path(tmp) / "features"
      features.write_features(llm, data_dir, feats / "warmup", model_name=preset.model,
                              seq_len=p.seq_len)  # compiles every length bucket
      stats = features.write_features(llm, data_dir, feats / "timed", model_name=preset.model,
                                      seq_len=p.seq_len)
      del llm
      tok_s = stats["tokens"] / stats["seconds"]
      rows.append(("features (once per data)", f"{preset.dtype} LLM, windows of {p.seq_len}",
                   tok_s))
      print(f"features: {tok_s:.0f} tok/s", flush=True)
      preset = load_preset(args.config, {
          "train.data": str(data_dir), "train.features": str(feats / "timed"),
          "train.output_dir": str(pathlib.Path(tmp) / "train_features"),
          "train.num_steps": args.train_steps + 1, "train.eval_shards": 0,
          "train.checkpoint_every": 10**6, "train.log_every": 1})
      tok_s = train(preset, progress=False, export=False).history[-1]["tokens_per_s"]
      rows.append(("training from features", f"the same, hidden states read from disk", tok_s))
      print(f"training from features: {tok_s:.0f} tok/s", flush=True)
  roof = max(r[2] for r in rows if r[0].startswith("forward"))
  print(f"\n# Distillation throughput: {args.model} on {jax.devices()[0].device_kind} "
        f"({distill.machine()})\n")
  print("| job | setting | tokens/s | of roofline |\n| --- | --- | ---: | ---: |")
  for job, setting, tok_s in rows:
    print(f"| {job} | {setting} | {tok_s:.0f} | {tok_s / roof:.0%} |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
