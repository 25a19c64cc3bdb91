"""``lease dry-run``: the whole plan of a profile on this CPU, through the fake runner.

A tiny model (``tiny``) is packed like the real one, the payload is split over several calls
(the fake runner's per-call limit is set so that the payload needs three), the calls run back to
back on ``FakeDevice`` with the runner's rules, the last one runs the profile at ``tiny`` sizes,
and what comes back is collected as ``lease collect`` would. It passes only when every call ran,
every step of the profile finished ok, the planned device time fits the lease, and the results
came back within the return rules.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import tempfile

from redrafter_jax.lease import model_pack, runner
from redrafter_jax.lease.fake_device import FakeDevice
from redrafter_jax.lease.limits import MiB, LeaseError, Limits, tree_bytes
from redrafter_jax.lease.plan import STAGE, make_plan, tar_payload
from redrafter_jax.lease.tiny import write_tiny_model

CALLS = 3


def dry_run(profile: str, repo: pathlib.Path, *, budget_s: int = 900, keep: pathlib.Path | None =
            None, log=print) -> int:
  """Returns 0 when the dry-run passes; ``keep``: a folder to leave the fake machine in."""
  root = pathlib.Path(tempfile.mkdtemp(prefix="lease-dry-run-")) if keep is None else keep
  stage = STAGE / "dry-run"
  try:
    tiny = write_tiny_model(root / "tiny-model")
    pack = model_pack.pack(tiny, root / "pack", tokenizer=root / "tiny-model" / "tokenizer")
    size = len(tar_payload(pack))
    base = Limits()
    # The real per-call limit leaves the tiny payload room to spare; shrink it so the payload
    # takes CALLS calls, as the real model's does. The lease's device time is ``budget_s``.
    limits = dataclasses.replace(base, lease_seconds=budget_s,
                                 call_bytes=tree_bytes(repo) + base.margin_bytes + 64 * 1024
                                 + -(-size // CALLS))
    plan = make_plan(repo, pack, profile, limits=limits, budget_s=budget_s, size="tiny",
                     stage=stage)
    log(plan.describe(limits))
    if plan.device_s > limits.lease_seconds:
      raise LeaseError(f"the plan needs {plan.device_s} s of device time, the lease has "
                       f"{limits.lease_seconds} s")
    device = FakeDevice(repo, root / "machine", limits)
    result = None
    for i, call in enumerate(plan.calls):
      result = device.run(call.command, list(call.carry), call.timeout_s)
      log(f"dry-run call {i + 1}/{len(plan.calls)}: rc {result.rc}, {result.seconds:.0f} s, "
          f"{result.travel_bytes / MiB:.1f} MiB sent, {len(result.files)} files back"
          + (f", refused: {result.refused}" if result.refused else "")
          + (f", left out: {result.files_left_out}" if result.files_left_out else ""))
      if result.rc != 0:
        log(result.output[-6000:])
        md = [p for p in result.files if p.name == "lease.md"]
        if md:
          log(md[0].read_text())
        return 1
    names = sorted(p.name for p in result.files)
    if "lease.md" not in names or not any(n.startswith(runner.RESULTS_NAME) for n in names):
      log(f"dry-run: the last call brought back {names}, not lease.md and the results")
      return 1
    folder = runner.collect(result.files[0].parent, root / "collected")
    got = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    log(f"dry-run: collected {len(got)} files into {folder}:\n  " + "\n  ".join(got))
    log((folder / "lease.md").read_text())
    log(f"dry-run: device time as the runner would count it: {device.device_seconds:.0f} s "
        f"(planned {plan.device_s} s, lease {limits.lease_seconds} s)")
    return 0
  finally:
    shutil.rmtree(repo / stage, ignore_errors=True)
    if keep is None:
      shutil.rmtree(root, ignore_errors=True)
