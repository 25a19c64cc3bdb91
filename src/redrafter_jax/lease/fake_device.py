"""A stand-in for the GPU runner on this machine, with the runner's rules as we measured them.

Each call gets a FRESH copy of the checkout (the files git lists as tracked or untracked but not
ignored) plus the paths the call carries, so what an earlier call carried is gone; a ``/tmp`` of
its own (``$TMPDIR``) and a home folder that persist between calls, as a warm machine's do; an
empty ``$OUT``; the size limit on what travels; the per-call time limit; and the rules on the
files that come back (``limits.returned_files``). It models the runner's device time (start,
per-call overhead, the command's own seconds) so a plan that would not fit a lease fails here.
Nothing outside the checkout is visible but the Python environment: no model cache, no
folder beside the checkout.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

from redrafter_jax.lease.limits import MiB, Limits, path_bytes, returned_files, travelling_files


@dataclasses.dataclass
class CallResult:
  rc: int | None  # None: refused before it ran
  output: str
  files: list[pathlib.Path]
  files_left_out: list[str]
  travel_bytes: int
  seconds: float
  refused: str = ""


class FakeDevice:

  def __init__(self, repo: pathlib.Path, root: pathlib.Path, limits: Limits):
    self.repo, self.root, self.limits = repo.resolve(), root, limits
    self.tmp, self.home = root / "tmp", root / "home"
    for d in (self.tmp, self.home):
      d.mkdir(parents=True, exist_ok=True)
    self.calls = 0
    self.device_seconds = 0.0

  def _checkout(self, carry: list[str]) -> tuple[pathlib.Path, int, str]:
    dest = self.root / "checkout"
    if dest.exists():
      shutil.rmtree(dest)
    dest.mkdir()
    total = 0
    for src in travelling_files(self.repo):
      if not os.path.lexists(src):
        continue
      to = dest / src.relative_to(self.repo)
      to.parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(src, to, follow_symlinks=False)
      total += os.lstat(src).st_size
    for c in carry:
      src = self.repo / c
      if not src.exists():
        return dest, total, f"carried path {c!r} does not exist"
      to = dest / c
      if to.exists():
        shutil.rmtree(to) if to.is_dir() else to.unlink()
      to.parent.mkdir(parents=True, exist_ok=True)
      (shutil.copytree if src.is_dir() else shutil.copy2)(src, to)
      total += path_bytes(src)
    return dest, total, ""

  def run(self, command: str, carry: list[str] = (), timeout_s: int | None = None) -> CallResult:
    lim = self.limits
    carry = list(carry)
    if len(carry) > lim.carry_paths:
      return CallResult(None, "", [], [], 0, 0.0, f"more than {lim.carry_paths} carried paths")
    checkout, travel, why = self._checkout(carry)
    if not why and travel > lim.call_bytes:
      why = (f"the working tree is larger than {lim.call_bytes / MiB:.0f} MiB "
             f"({travel / MiB:.1f} MiB)")
    if why:
      return CallResult(None, "", [], [], travel, 0.0, why)
    out = self.root / "out"
    if out.exists():
      shutil.rmtree(out)
    out.mkdir()
    env = dict(PATH=f"{pathlib.Path(sys.executable).parent}:/usr/bin:/bin", HOME=str(self.home),
               TMPDIR=str(self.tmp), OUT=str(out), LANG="C.UTF-8")
    limit = min(timeout_s or lim.call_seconds, lim.call_seconds)
    start = time.monotonic()
    proc = subprocess.Popen(["bash", "-c", command], cwd=checkout, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
      output, _ = proc.communicate(timeout=limit)
      rc = proc.returncode
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      output, _ = proc.communicate()
      rc = 124
    seconds = time.monotonic() - start
    self.device_seconds += (lim.start_seconds if self.calls == 0 else 0) + \
        lim.call_overhead_seconds + seconds
    self.calls += 1
    back, left = returned_files(out, lim)
    files_at = self.root / f"files-{self.calls}"
    files = []
    for p in back:
      to = files_at / p.relative_to(out)
      to.parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(p, to)
      files.append(to)
    return CallResult(rc, output.decode("utf-8", errors="replace"), files, left, travel, seconds)
