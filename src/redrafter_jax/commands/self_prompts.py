"""``redrafter-jax self-prompts``: the LLM writes user requests for its own teacher data."""

from redrafter_jax.errors import UserError

HELP = "the LLM samples user requests (a prompts file for distill-data), Magpie-style"


def add_arguments(p):
  from redrafter_jax.commands import show_defaults

  show_defaults(p)
  p.add_argument("--out", required=True, help="JSON-lines prompts file to write (resumed if it exists)")
  p.add_argument("--num", type=int, required=True, help="requests to collect")
  p.add_argument("--model", default="smollm2-135m",
                 help="base model: known name, GGUF/HF path, or random:<spec> (tests)")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                 help="the LLM's activations")
  p.add_argument("--param-dtype", default=None, choices=["float32", "bfloat16"],
                 help="the LLM's weights (default: --dtype; bfloat16 is the fast CPU setting)")
  p.add_argument("--batch-size", type=int, default=64, help="requests written together")
  p.add_argument("--max-new-tokens", type=int, default=96,
                 help="longest request; a request that has not ended by then is dropped")
  p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
  p.add_argument("--max-batches", type=int, default=None,
                 help="stop after drawing this many batches (rerun to continue)")
  p.add_argument("--max-seconds", type=float, default=None,
                 help="time budget from the command's start (model loading included): draw no "
                      "batch that would not finish in time, as estimated from the batches this "
                      "run drew (the first always runs); rerun to continue")
  p.add_argument("--seed", type=int, default=0, help="sampling seed")
  p.add_argument("--seeds", default=None,
                 help="JSON-lines file of request openings (prompt-mix --seeds-out): each user "
                      "turn starts with one and the LLM completes it")


def run(args) -> int:
  import pathlib
  import time

  started = time.perf_counter()  # --max-seconds counts from here (model loading included)
  from redrafter_jax.training import prompt_mix, self_prompts
  from redrafter_jax.training.data import DataError
  from redrafter_jax.weights import base_model

  try:
    seeds = prompt_mix.prompts_as_written(pathlib.Path(args.seeds)) if args.seeds else ()
    llm, _ = base_model.load_base_model(args.model, dtype=args.dtype,
                                        param_dtype=args.param_dtype)
    tok = base_model.load_base_tokenizer(args.model)
    stats = self_prompts.write_self_prompts(
        llm, tok, args.out, num=args.num, source=f"self-prompts ({args.model})",
        batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, seed=args.seed, max_batches=args.max_batches,
        max_seconds=None if args.max_seconds is None else
        args.max_seconds - (time.perf_counter() - started), seeds=seeds)
  except DataError as e:
    raise UserError(str(e)) from e
  print(f"{args.out}: {stats.prompts} requests ({stats.new} new from {stats.batches} batch(es), "
        f"{stats.seconds:.0f} s)" + ("; stopped at the time budget (rerun to continue)"
                                     if stats.stopped_at_budget else ""))
  return 0
