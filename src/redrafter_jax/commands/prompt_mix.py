"""``redrafter-jax prompt-mix``: the broad distillation prompt set and self-prompt seeds."""

from redrafter_jax.errors import UserError

HELP = "build the distillation prompt mix (train, qa, passage tasks) and self-prompt seeds"


def add_arguments(p):
  from redrafter_jax.commands import show_defaults

  show_defaults(p)
  p.add_argument("--data", default=None,
                 help="folder with train_prompts, qa_prompts and passages (.jsonl or .jsonl.gz; "
                 "default: the checkout's data/sources)")
  p.add_argument("--out", required=True, help="JSON-lines prompts file to write")
  p.add_argument("--seeds-out", default=None,
                 help="also write self-prompt seeds here (for self-prompts --seeds)")
  p.add_argument("--num-seeds", type=int, default=6000, help="self-prompt seeds to write")
  p.add_argument("--tasks-per-passage", type=int, default=3,
                 help="context tasks built around each passage")
  p.add_argument("--exclude", action="append", default=[],
                 help="prompts file whose prompts must not appear (repeatable): the eval set")
  p.add_argument("--max-per-category", type=int, default=None,
                 help="keep at most this many prompts of each category (seeded choice)")
  p.add_argument("--seed", type=int, default=0, help="seed of every choice (same seed, same file)")


def run(args) -> int:
  from redrafter_jax.training import prompt_mix
  from redrafter_jax.training.data import DataError

  try:
    rows = prompt_mix.build_mix(args.data or prompt_mix.SOURCES,
                                tasks_per_passage=args.tasks_per_passage, seed=args.seed,
                                exclude=args.exclude, max_per_category=args.max_per_category)
    prompt_mix.write_rows(rows, args.out)
    print(f"{args.out}: {len(rows)} prompts {prompt_mix.count_mix(rows)}")
    if args.seeds_out:
      seeds = prompt_mix.self_prompt_seeds(args.num_seeds, seed=args.seed)
      prompt_mix.write_rows(seeds, args.seeds_out)
      print(f"{args.seeds_out}: {len(seeds)} seeds {prompt_mix.count_mix(seeds)}")
  except DataError as e:
    raise UserError(str(e)) from e
  return 0
