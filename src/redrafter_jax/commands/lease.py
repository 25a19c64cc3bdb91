"""``redrafter-jax lease plan|run|dry-run|collect``: a GPU lease, planned here, run there.

  plan      (here)   pack the model, stage one payload chunk per device call, print the calls
  run       (there)  the last call: run the profile from the stash within its budget
  dry-run   (here)   the whole plan through a fake runner with the runner's rules, tiny model
  collect   (here)   unpack what the last call brought back into results/
"""

from __future__ import annotations

import os
import pathlib

HELP = "plan, run, dry-run or collect a GPU lease (docs/gpu.md)"
REPO = pathlib.Path.cwd


def add_arguments(p):
  from redrafter_jax.commands import show_defaults

  show_defaults(p)
  sub = p.add_subparsers(dest="lease_command", required=True, metavar="ACTION")
  for name, help_ in (("plan", "pack the model and print the device calls"),
                      ("run", "run a profile on the GPU machine (the plan's last call does)"),
                      ("dry-run", "the whole plan on this CPU through a fake runner"),
                      ("collect", "unpack a lease's returned files into results/")):
    s = sub.add_parser(name, help=help_, description=help_)
    if name != "collect":
      # train: every lease after the first (measure has run once, on an H200: issue 36)
      s.add_argument("--profile", default="train",
                     help="train: teacher data, a drafter trained on it and measured; measure: "
                     "the GPU table's numbers (default: %(default)s)")
      s.add_argument("--budget", type=int, default=None,
                     help="seconds: the lease's device time for plan and dry-run (default 900), "
                     "the run's own time for run (default 570)")
    if name == "plan":
      s.add_argument("--model", default="smollm2-135m", help="a known name or .gguf file "
                     "(default: %(default)s)")
    if name == "run":
      s.add_argument("--stash", type=pathlib.Path, required=True,
                     help="where the earlier calls copied the payload")
      s.add_argument("--size", choices=("gpu", "tiny"), default="gpu",
                     help="gpu: the real model's sizes; tiny: the dry-run's (default: %(default)s)")
      s.add_argument("--out", type=pathlib.Path, default=None,
                     help="where the returned files go (default: $OUT, else lease-out/)")
      s.add_argument("--part", type=int, choices=(1, 2), default=1,
                     help="the profile's part to run; 2 continues from part 1's stash "
                     "(default: %(default)s)")
    if name == "dry-run":
      s.add_argument("--keep", type=pathlib.Path, default=None,
                     help="leave the fake machine's folders here (default: a temporary folder)")
    if name == "collect":
      s.add_argument("files_at", type=pathlib.Path, help="the folder the files came back to")


def run(args) -> int:
  from redrafter_jax.lease.limits import Limits

  repo = REPO()
  if args.lease_command == "plan":
    import tempfile

    from redrafter_jax.lease.model_pack import pack
    from redrafter_jax.lease.plan import WHEELS, download_wheels, make_plan
    from redrafter_jax.lease.profiles import IMAGE_PYTHON, profile_of

    needs = profile_of(args.profile, "gpu").needs  # an unknown profile fails before the packing
    limits = Limits()
    with tempfile.TemporaryDirectory() as tmp:
      payload = pack(args.model, pathlib.Path(tmp) / "pack")
      if needs:
        wheels = download_wheels(needs, IMAGE_PYTHON, payload / WHEELS)
        print(f"wheels for the image's Python {IMAGE_PYTHON}: {', '.join(wheels)}")
      plan = make_plan(repo, payload, args.profile, limits=limits, budget_s=args.budget)
    print(plan.describe(limits))
    return 0
  if args.lease_command == "run":
    from redrafter_jax.lease import runner

    out = args.out or pathlib.Path(os.environ.get("OUT") or "lease-out")
    return runner.run(args.profile, args.size, args.stash, out,
                      args.budget or Limits().call_seconds - 30, repo, part=args.part)
  if args.lease_command == "dry-run":
    from redrafter_jax.lease.dry_run import dry_run

    return dry_run(args.profile, repo, budget_s=args.budget or Limits().lease_seconds,
                   keep=args.keep)
  from redrafter_jax.lease.runner import collect

  folder = collect(args.files_at, repo)
  print(f"collected into {folder}")
  return 0
