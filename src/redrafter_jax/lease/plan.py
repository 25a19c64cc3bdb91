"""The device calls of a lease: what each carries, what it runs, and what it costs.

The payload (the model pack: quantized weights, manifest, tokenizer) is one gzipped tar cut into
chunks, each chunk staged in its own ignored folder ``.lease/call-<i>/`` that call ``i`` carries.
Every call copies what it carried into a stash outside the checkout (``$TMPDIR`` or ``/tmp``,
which survives between calls while the machine is warm; carried paths do not), and the last call
runs the profile's part 1 from the stash (``lease run``), reassembling and checking the payload
first. When the profile has part-2 steps and the lease has at least a minute left after that, one
more call (carrying nothing) runs them from the same stash while the machine is still warm. A
call's size is measured, not assumed: the checkout's travelling files (from git) plus its chunk
must fit the runner's per-call limit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import pathlib
import shutil
import tarfile

from redrafter_jax.lease.limits import MiB, LeaseError, Limits, tree_bytes

STAGE = pathlib.Path(".lease")
STASH = '"${TMPDIR:-/tmp}/redrafter-lease"'  # a shell word: the stash on the device machine
PAYLOAD = "payload.tar.gz"
INDEX = "payload.json"
WHEELS = "wheels"  # in the payload: the profile's ``needs``, for the image's Python


@dataclasses.dataclass(frozen=True)
class Call:
  carry: tuple[str, ...]
  command: str
  travel_bytes: int  # the checkout plus what it carries
  timeout_s: int


@dataclasses.dataclass(frozen=True)
class Plan:
  profile: str
  calls: tuple[Call, ...]
  tree_bytes: int
  payload_bytes: int
  run_budget_s: int  # the profile's part-1 run time (the last upload call)
  device_s: int  # the lease's device time as planned: start, every call, the runs
  part2_budget_s: int = 0  # part 2's run time in a call of its own (0: no such call)
  not_planned: tuple[str, ...] = ()  # part-2 steps the lease has no time left for

  def describe(self, limits: Limits) -> str:
    lines = [f"lease plan, profile {self.profile}: {len(self.calls)} device calls; the checkout "
             f"sends {self.tree_bytes / MiB:.1f} MiB with each, the payload is "
             f"{self.payload_bytes / MiB:.1f} MiB; device time as planned {self.device_s} s of "
             f"{limits.lease_seconds} s (start {limits.start_seconds} s, "
             f"{limits.call_overhead_seconds} s around each call, the run {self.run_budget_s} s"
             + (f", part 2 {self.part2_budget_s} s" if self.part2_budget_s else "") + ")."]
    if self.not_planned:
      lines.append(f"Not planned (no time left for part 2): {', '.join(self.not_planned)}.")
    for i, c in enumerate(self.calls):
      lines.append(f"call {i + 1}/{len(self.calls)}: {c.travel_bytes / MiB:.1f} MiB of "
                   f"{limits.call_bytes / MiB:.0f}; run(carry={json.dumps(list(c.carry))}, "
                   f"timeout_s={c.timeout_s}, command={c.command!r})")
    lines.append("Make the calls back to back (the machine goes back 30 s after a call), then "
                 "`redrafter-jax lease collect FILES_AT` on what the last call brings back (if "
                 "a call fails, collect what the one before it brought back).")
    return "\n".join(lines)


def tar_payload(folder: pathlib.Path) -> bytes:
  """``folder``'s files as a gzipped tar (names relative to it), byte-for-byte reproducible."""
  buf = io.BytesIO()
  with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
    for p in sorted(folder.rglob("*")):
      if p.is_file():
        info = tar.gettarinfo(str(p), arcname=str(p.relative_to(folder)))
        info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
        with open(p, "rb") as f:
          tar.addfile(info, f)
  return buf.getvalue()


def download_wheels(needs: tuple[str, ...], python: str, dest: pathlib.Path) -> list[str]:
  """Download the wheels of ``needs`` (pinned requirements, no dependencies: the profile lists
  every package the image lacks) built for CPython ``python`` on x86-64 Linux into ``dest``;
  returns their file names. Needs the package index (this machine has it; the GPU has not)."""
  import subprocess
  import sys

  dest.mkdir(parents=True, exist_ok=True)
  tag = python.replace(".", "")
  cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--python-version", python, "--implementation", "cp", "--abi", f"cp{tag}",
         "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_28_x86_64",
         "--platform", "any", "--dest", str(dest), *needs]
  done = subprocess.run(cmd, capture_output=True, text=True)
  if done.returncode != 0:
    raise LeaseError(f"cannot download the wheels of {', '.join(needs)} for Python {python} "
                     f"(pip: {done.stderr.strip().splitlines()[-1:] or done.returncode})")
  return sorted(p.name for p in dest.glob("*.whl"))


def run_command(profile: str, budget_s: int, size: str, part: int = 1) -> str:
  return (f"PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src python3 -m redrafter_jax.cli lease run "
          f"--profile {profile} --size {size} --stash {STASH} --budget {budget_s}"
          + (f" --part {part}" if part != 1 else ""))


def make_plan(repo: pathlib.Path, payload: pathlib.Path, profile: str, *, limits: Limits,
              budget_s: int | None = None, size: str = "gpu",
              stage: pathlib.Path = STAGE) -> Plan:
  """Stage ``payload`` (a folder) under ``repo/stage`` in per-call chunks; returns the calls.

  ``budget_s``: the lease's device time (default ``limits.lease_seconds``)."""
  from redrafter_jax.lease.profiles import profile as profile_steps

  part2 = [s.name for s in profile_steps(profile, size) if s.part == 2]
  budget_s = limits.lease_seconds if budget_s is None else budget_s
  data = tar_payload(payload)
  tree = tree_bytes(repo)
  room = limits.call_bytes - tree - limits.margin_bytes - 64 * 1024  # the index and the slack
  if room <= 0:
    raise LeaseError(f"the checkout alone sends {tree / MiB:.1f} MiB with every call, leaving no "
                     f"room under the runner's {limits.call_bytes / MiB:.0f} MiB per call")
  chunks = [data[i:i + room] for i in range(0, len(data), room)] or [b""]
  transfer_s = limits.call_overhead_seconds + 5
  run_s = min(limits.call_seconds - 30,
              budget_s - limits.start_seconds - transfer_s * len(chunks) - 30)
  if run_s < 60:
    raise LeaseError(f"{len(chunks)} calls of {room / MiB:.1f} MiB leave {run_s} s of a "
                     f"{budget_s} s lease to run the profile (at least 60 s needed)")
  root = repo / stage
  if root.exists():
    shutil.rmtree(root)
  calls = []
  for i, chunk in enumerate(chunks):
    folder = root / f"call-{i}"
    folder.mkdir(parents=True)
    (folder / f"{PAYLOAD}.{i:02d}").write_bytes(chunk)
    last = i == len(chunks) - 1
    if last:
      (folder / INDEX).write_text(json.dumps(dict(
          chunks=[f"{PAYLOAD}.{j:02d}" for j in range(len(chunks))], bytes=len(data),
          sha256=hashlib.sha256(data).hexdigest()), indent=1))
    rel = str(stage / f"call-{i}")
    command = f"mkdir -p {STASH} && cp {rel}/* {STASH}/ && ls -l {STASH}"
    if last:
      command += " && " + run_command(profile, run_s, size)
    calls.append(Call((rel,), command, tree + sum(p.stat().st_size for p in folder.iterdir()),
                      min(limits.call_seconds, run_s + 30) if last else 120))
  device = limits.start_seconds + transfer_s * len(chunks) + run_s
  part2_s = min(limits.call_seconds - 30, budget_s - device - transfer_s - 30)
  if part2 and part2_s >= 60:
    calls.append(Call((), run_command(profile, part2_s, size, part=2), tree,
                      min(limits.call_seconds, part2_s + 30)))
    device += transfer_s + part2_s
    return Plan(profile, tuple(calls), tree, len(data), run_s, device, part2_s)
  return Plan(profile, tuple(calls), tree, len(data), run_s, device,
              not_planned=tuple(part2))


def restore_payload(stash: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
  """Reassemble the payload from the chunks in ``stash``, check it, extract it into ``out``."""
  index_path = stash / INDEX
  if not index_path.is_file():
    raise LeaseError(f"{stash}: no {INDEX} (the last call carries it): was the plan's last "
                     "call the one that ran?")
  index = json.loads(index_path.read_text())
  missing = [c for c in index["chunks"] if not (stash / c).is_file()]
  if missing:
    raise LeaseError(f"{stash}: chunks {missing} have not arrived (the machine went back between "
                     "calls, or a call was skipped): run the plan's calls again, back to back")
  data = b"".join((stash / c).read_bytes() for c in index["chunks"])
  if len(data) != index["bytes"] or hashlib.sha256(data).hexdigest() != index["sha256"]:
    raise LeaseError(f"{stash}: the chunks do not reassemble the payload (stale chunks from "
                     "another plan?)")
  if out.exists():
    shutil.rmtree(out)
  out.mkdir(parents=True)
  with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
    tar.extractall(out, filter="data")
  return out
