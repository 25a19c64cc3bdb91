"""``redrafter-jax train --config PRESET.yaml [section.key=value ...]``: distill the drafter."""

from redrafter_jax.errors import UserError

HELP = "train the drafter by distillation from the frozen LLM (resumes from the newest checkpoint)"


def add_arguments(p):
  from redrafter_jax.commands import show_defaults

  show_defaults(p)
  p.add_argument("--config", required=True, help="YAML preset, e.g. configs/smollm2_135m.yaml")
  p.add_argument("overrides", nargs="*", metavar="section.key=value",
                 help="override preset values, e.g. train.num_steps=100 train.batch_size=4")
  p.add_argument("--stop-after-steps", type=int, default=None,
                 help="end this call after N steps, with a checkpoint (rerun to continue)")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.add_argument("--no-export", action="store_true", help="do not export the drafter at the end")
  dist = p.add_argument_group("multi-process (one process per host; docs/training.md)")
  dist.add_argument("--coordinator", default=None, help="host:port of process 0's coordinator")
  dist.add_argument("--num-processes", type=int, default=None)
  dist.add_argument("--process-id", type=int, default=None)
  dist.add_argument("--distributed-auto", action="store_true",
                    help="let JAX detect the cluster (SLURM, Open MPI, Kubernetes, Cloud TPU)")


def run(args) -> int:
  import logging

  logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax/grain narrate every step at INFO
  from redrafter_jax import sharding
  from redrafter_jax.config import load_preset, parse_overrides
  from redrafter_jax.training import trainer
  from redrafter_jax.training.data import DataError

  preset = load_preset(args.config, parse_overrides(args.overrides))
  if args.coordinator is not None and (args.num_processes is None or args.process_id is None):
    raise UserError("--coordinator needs --num-processes and --process-id")
  sharding.initialize_distributed(args.coordinator, args.num_processes, args.process_id,
                                  auto=args.distributed_auto)
  try:
    result = trainer.train(preset, stop_after=args.stop_after_steps,
                           progress=not args.no_progress, export=not args.no_export)
  except DataError as e:
    raise UserError(str(e)) from e
  import jax

  if jax.process_index() == 0:
    if result.last_step == result.start_step:
      print(f"{preset.train.output_dir}: already at step {result.last_step}; nothing to do")
    else:
      last = result.history[-1]
      print(f"trained steps {result.start_step + 1}..{result.last_step} of "
            f"{result.num_steps}: loss {last['loss']:.4f}, top-1 (step 1) "
            f"{last['top1_1']:.3f}; outputs in {preset.train.output_dir}"
            + (f"; drafter exported to {result.drafter_dir}" if result.drafter_dir else ""))
  return 0
