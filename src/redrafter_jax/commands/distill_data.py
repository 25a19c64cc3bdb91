"""``redrafter-jax distill-data``: the frozen LLM writes the drafter's training data."""

from redrafter_jax.errors import UserError

HELP = "self-distillation data: the frozen LLM answers training prompts (compressed shards)"


def add_arguments(p):
  from redrafter_jax.commands import show_defaults

  show_defaults(p)
  p.add_argument("--prompts", required=True, nargs="+",
                 help="JSON-lines prompts file(s) ({id, prompt, ...}), answered as one list in "
                      "the order given")
  p.add_argument("--out", required=True, help="output folder (resumed if it exists)")
  p.add_argument("--model", default="smollm2-135m",
                 help="base model: known name, GGUF/HF path, or random:<spec> (tests)")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                 help="the LLM's activations")
  p.add_argument("--param-dtype", default=None, choices=["float32", "bfloat16"],
                 help="the LLM's weights (default: --dtype; bfloat16 is the fast CPU setting)")
  p.add_argument("--limit", type=int, default=None,
                 help="use N prompts drawn at random (seeded) from the file(s)")
  p.add_argument("--max-new-tokens", type=int, default=256, help="answer tokens at most")
  p.add_argument("--batch-size", type=int, default=16, help="prompts answered together")
  p.add_argument("--sampled-fraction", type=float, default=0.25,
                 help="sampled answers (T=1) per prompt on average, besides every prompt's "
                      "greedy one: at most 1 it is the fraction of prompts also sampled; above "
                      "1 each prompt gets floor(F) and a seeded frac(F) of them one more "
                      "(at most 16)")
  p.add_argument("--shard-size", type=int, default=256, help="sequences per shard")
  p.add_argument("--max-prompt-tokens", type=int, default=384,
                 help="skip prompts longer than this (after the chat template)")
  p.add_argument("--prompt-multiple", type=int, default=64,
                 help="prompts are padded to a multiple of this; each multiple compiles its own "
                      "programs (on a GPU, where a compile takes tens of seconds, give "
                      "--max-prompt-tokens: one prompt shape)")
  p.add_argument("--max-shards", type=int, default=None,
                 help="stop after writing this many new shards (rerun to continue)")
  p.add_argument("--max-seconds", type=float, default=None,
                 help="time budget from the command's start (model loading included): start "
                      "no shard that would not finish in time, as estimated from the shards "
                      "this run finished (the first always runs); rerun to continue")
  p.add_argument("--seed", type=int, default=0,
                 help="seed of the prompt order, the sampled answers and --limit's draw")


def run(args) -> int:
  import logging
  import time

  started = time.perf_counter()  # --max-seconds counts from here (model loading included)
  logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax/grain narrate every step at INFO
  from redrafter_jax.training import distill
  from redrafter_jax.training.data import DataError
  from redrafter_jax.weights import base_model

  try:
    llm, cfg = base_model.load_base_model(args.model, dtype=args.dtype,
                                          param_dtype=args.param_dtype)
    tok = base_model.load_base_tokenizer(args.model)
    stats = distill.distill(
        llm, tok, args.prompts, args.out, model_name=args.model, limit=args.limit,
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
        sampled_fraction=args.sampled_fraction, shard_size=args.shard_size,
        max_prompt_tokens=args.max_prompt_tokens, seed=args.seed, max_shards=args.max_shards,
        prompt_multiple=args.prompt_multiple,
        max_seconds=None if args.max_seconds is None else
        args.max_seconds - (time.perf_counter() - started))
  except DataError as e:
    raise UserError(str(e)) from e
  left = (f"; stopped at the time budget, {stats.shards_left} shard(s) left (rerun to continue)"
          if stats.stopped_at_budget else
          f"; {stats.shards_left} shard(s) left (rerun to continue)" if stats.shards_left else "")
  print(f"{args.out}: wrote {stats.shards_written} shard(s) ({stats.records} sequences, "
        f"{stats.new_tokens} response tokens in {stats.seconds:.0f} s, "
        f"{stats.tokens_per_s:.1f} tok/s), skipped {stats.shards_skipped} complete shard(s)"
        + left)
  return 0
