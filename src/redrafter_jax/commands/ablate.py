"""``redrafter-jax ablate ABLATION.yaml``: train drafter variants and compare them held out."""

HELP = ("train the variants of an ablation file (one base preset + overrides) on the same data "
        "and print their held-out scores as a table")


def add_arguments(p):
  from redrafter_jax.commands import show_defaults

  show_defaults(p)
  p.add_argument("ablation", help="ablation file, e.g. configs/ablations/mix_v1.yaml")
  p.add_argument("--only", nargs="+", default=None, metavar="NAME",
                 help="train only these variants (the table still lists all)")
  p.add_argument("--table-only", action="store_true", help="train nothing; print the table")
  p.add_argument("--stop-after-steps", type=int, default=None,
                 help="end each variant after N more steps, with a checkpoint (rerun continues)")
  p.add_argument("--out", default=None, help="also write the table (Markdown) to this file")
  p.add_argument("--no-progress", action="store_true", help="no progress bars")
  p.add_argument("--paired", default=None, metavar="BASE",
                 help="also compare every variant with BASE step by step on their training "
                      "metrics (the same batches in the same order), in blocks of 20 steps")


def run(args) -> int:
  import logging
  import pathlib

  logging.getLogger("absl").setLevel(logging.WARNING)
  from redrafter_jax.errors import UserError
  from redrafter_jax.training import ablation as ablation_lib
  from redrafter_jax.training.data import DataError

  ablation = ablation_lib.load_ablation(args.ablation)
  names = list(ablation.variants)
  for name in args.only or ():
    if name not in ablation.variants:
      raise UserError(f"--only {name}: no such variant in {args.ablation} ({', '.join(names)})")
  if not args.table_only:
    import jax

    from redrafter_jax.training import trainer

    for name in args.only or names:
      print(f"== {name}: {ablation_lib.describe(ablation, name)}", flush=True)
      try:
        trainer.train(ablation.preset(name), stop_after=args.stop_after_steps,
                      progress=not args.no_progress)
      except DataError as e:
        raise UserError(f"variant {name}: {e}") from e
      jax.clear_caches()
  text = ablation_lib.table([ablation_lib.variant_row(ablation, n) for n in names])
  if args.paired:
    text += "\n\n" + ablation_lib.paired_table(ablation, args.paired)
  print(text)
  if args.out:
    pathlib.Path(args.out).write_text(text + "\n")
  return 0
