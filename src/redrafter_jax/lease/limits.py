"""The GPU runner's rules, as measured on our first lease, and the checks both sides share.

A lease is 15 minutes of device time in all (the machine's start, every call and every idle
second counted); one call runs at most 10 minutes; what travels in a call (the checkout's tracked
and untracked-but-not-ignored files, plus the paths the call carries) is at most 64 MiB; the
paths a call carries REPLACE the previous call's (they do not accumulate), while what a command
copies outside the checkout (``/tmp``) stays while the machine is warm; at most 8 files of at
most 16 MiB (64 MiB together, at most two folders down, names of letters, digits, ``.``, ``_``,
``-``) come back from ``$OUT``.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess

from redrafter_jax.errors import UserError

MiB = 2 ** 20
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


class LeaseError(UserError, ValueError):
  """A plan or run that cannot fit the runner's rules; reported as one line."""


@dataclasses.dataclass(frozen=True)
class Limits:
  call_bytes: int = 64 * MiB  # what travels per call, the checkout included
  call_seconds: int = 600
  lease_seconds: int = 900
  return_files: int = 8
  return_file_bytes: int = 16 * MiB
  return_bytes: int = 64 * MiB
  return_depth: int = 2  # $OUT/a/b/file comes back, $OUT/a/b/c/file does not
  carry_paths: int = 8
  # Seconds the runner spends around the commands (first lease: ~30 s to start; each call's
  # transfer of up to 64 MiB each way). The plan budgets with these; a lease measures them.
  start_seconds: int = 60
  call_overhead_seconds: int = 20
  margin_bytes: int = 1 * MiB  # slack under call_bytes for what git does not see (.git is not sent)


def travelling_files(repo: pathlib.Path) -> list[pathlib.Path]:
  """The files every call sends: tracked, and untracked but not ignored (git's own view)."""
  try:
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others",
                          "--exclude-standard"], check=True, capture_output=True).stdout
  except (OSError, subprocess.CalledProcessError) as e:
    raise LeaseError(f"{repo}: cannot list the checkout's files with git ({e})") from e
  names = sorted({n for n in out.decode().split("\0") if n})
  return [repo / n for n in names]


def path_bytes(path: pathlib.Path) -> int:
  """Bytes of a file or of every file under a folder (links count as links)."""
  if path.is_symlink() or path.is_file():
    return os.lstat(path).st_size
  return sum(os.lstat(p).st_size for p in path.rglob("*") if p.is_symlink() or p.is_file())


def tree_bytes(repo: pathlib.Path) -> int:
  """What the checkout adds to every call, measured from git (deleted files count nothing)."""
  return sum(os.lstat(p).st_size for p in travelling_files(repo) if os.path.lexists(p))


def returned_files(out: pathlib.Path, limits: Limits) -> tuple[list[pathlib.Path], list[str]]:
  """``(files that come back, 'PATH (why)' for each that does not)``, in the runner's order:
  by path, the first ``return_files`` that pass every rule while the total stays in bounds."""
  back, left, total = [], [], 0
  for p in sorted(out.rglob("*")):
    rel = p.relative_to(out)
    if p.is_dir() and not p.is_symlink():
      continue
    why = None
    if p.is_symlink() or not p.is_file():
      why = "not a plain file"
    elif len(rel.parts) - 1 > limits.return_depth:
      why = f"more than {limits.return_depth} folders down"
    elif not all(_NAME.match(part) for part in rel.parts):
      why = "a name with characters other than letters, digits, '.', '_', '-'"
    elif p.stat().st_size > limits.return_file_bytes:
      why = f"over {limits.return_file_bytes // MiB} MiB"
    elif len(back) >= limits.return_files:
      why = f"more than {limits.return_files} files"
    elif total + p.stat().st_size > limits.return_bytes:
      why = f"over {limits.return_bytes // MiB} MiB together"
    if why:
      left.append(f"{rel} ({why})")
    else:
      back.append(p)
      total += p.stat().st_size
  return back, left
