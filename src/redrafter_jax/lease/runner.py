"""``lease run``: a profile on the GPU machine, within its time, bringing back whatever finished.

Runs in the lease's last call, from the stash the earlier calls filled. It reassembles and checks
the payload, unpacks the model, then runs the profile's steps one process each. Each step's
deadline is its share of the run's seconds, counted from the start (a step that finishes early
leaves its time to the next ones); a step past its deadline is stopped, its process group killed.
After every step the results are bundled into ``$OUT`` within the runner's return rules, so a
call cut short still brings back every step that finished: ``lease.md`` (the table of steps, with
each step's compiled programs and their seconds), ``lease.log`` (every step's output, its tail
when too long) and ``results.tar.gz`` (the results folder; cut into numbered parts when over the
per-file limit). ``lease collect`` unpacks that into the repository.

``--part 2`` (the plan's call after that one) runs the profile's part-2 steps from the same stash:
the model, the results folder, the log and the table of steps (``lease.json``) that part 1 left
there, so what it brings back holds both parts.

Every step shares one persistent compilation cache in the stash (programs compiled by one step
are loaded by the next, and by a second run while the machine is warm), and JAX logs each compile
with its seconds (``JAX_LOG_COMPILES``), which this module reads back out of the log. The lease's
own process never starts a JAX backend, so the GPU's memory is the steps'.
"""

from __future__ import annotations

import dataclasses
import datetime
import gzip
import io
import json
import os
import pathlib
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time

from redrafter_jax.lease import model_pack
from redrafter_jax.lease.limits import MiB, LeaseError, Limits
from redrafter_jax.lease.plan import WHEELS, restore_payload
from redrafter_jax.lease.profiles import PROMPTS, STEP_RESERVE_S, Step

COMPILED = re.compile(r"Finished XLA compilation of (.+?) in ([0-9.eE+-]+) sec")
# JAX's compile log (JAX_LOG_COMPILES): kept in lease.log, not echoed to the call's output,
# whose tail is all the runner shows.
JAX_LOG = re.compile(r"^(Finished (tracing|jaxpr|XLA compilation)|Compiling |Persistent "
                     r"compilation cache (hit|miss)|Not writing persistent cache)")
RESERVE_S = 15  # kept back at the end for the last bundle
LISTED_COMPILE_S = 0.5  # lease.md lists each program compiled at least this long
RESULTS_NAME = "results.tar.gz"
STATE = "lease.json"  # in the stash's work folder: the results folder, budgets and step table
PYLIB = "pylib"  # in the stash: the payload's wheels, unpacked (``profiles``: needs)
SCRATCH = "scratch"  # in the stash's work folder: what a step leaves for the next ones only


@dataclasses.dataclass
class StepResult:
  name: str
  what: str
  status: str = "not run"  # ok | failed (rc N) | stopped at its deadline | not run
  seconds: float = 0.0
  deadline_s: float = 0.0
  compiles: list[tuple[str, float]] = dataclasses.field(default_factory=list)
  part: int = 1


def machine_slug() -> str:
  """The GPU's name as JAX spells the device kind (from nvidia-smi: no JAX backend started
  here), else ``<system>-<machine>-<cpus>cpu`` as the suite names a CPU."""
  try:
    name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
  except (OSError, IndexError, subprocess.SubprocessError):
    name = f"{platform.system()}-{platform.machine()}-{os.cpu_count()}cpu"
  return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def install_wheels(folder: pathlib.Path, target: pathlib.Path) -> list[str]:
  """Unpack every wheel in ``folder`` into ``target`` (a ``PYTHONPATH`` entry); returns their
  names. A wheel is a zip whose top level is importable as is, so this needs no pip (the image's
  Python may have none); scripts and data files, which the profiles' packages do not use, are
  not installed."""
  import zipfile

  names = []
  for wheel in sorted(folder.glob("*.whl")):
    with zipfile.ZipFile(wheel) as z:
      z.extractall(target)
    names.append(wheel.name)
  return names


def step_env(stash: pathlib.Path, extra) -> dict[str, str]:
  env = dict(os.environ)
  pylib = stash / PYLIB
  if pylib.is_dir():
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pylib), env.get("PYTHONPATH")) if p)
  env.update(JAX_COMPILATION_CACHE_DIR=str(stash / "jax-cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_LOG_COMPILES="1",
             PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
  env.update(dict(extra))
  return env


def run_step(argv: list[str], env, cwd: pathlib.Path, timeout_s: float, log) -> tuple[str, list]:
  """Run one step, copying its output to ``log`` and to stdout; ``(status, compiles)``."""
  compiles = []
  if timeout_s <= 1:
    return "not run (no time left)", compiles
  try:
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
  except OSError as e:
    log.write(f"cannot start {argv[0]}: {e}\n")
    return f"failed (cannot start: {e})", compiles

  def pump():
    for raw in proc.stdout:
      line = raw.decode("utf-8", errors="replace")
      log.write(line)
      if not JAX_LOG.match(line):
        sys.stdout.write(line)
      m = COMPILED.search(line)
      if m:
        compiles.append((m.group(1), float(m.group(2))))

  reader = threading.Thread(target=pump, daemon=True)
  reader.start()
  try:
    rc = proc.wait(timeout=timeout_s)
    status = "ok" if rc == 0 else f"failed (rc {rc})"
  except subprocess.TimeoutExpired:
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
      try:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=wait)
        break
      except (ProcessLookupError, subprocess.TimeoutExpired):
        continue
    status = f"stopped at its deadline ({timeout_s:.0f} s)"
  reader.join(timeout=5)
  log.flush()
  return status, compiles


def rebuild_reports(folder: pathlib.Path, env, cwd: pathlib.Path, log) -> None:
  """``bench report`` on every suite folder under ``folder`` (a step cut short wrote its JSON
  after each measurement, but its report only at the end)."""
  for m in sorted(folder.rglob("measurements.json")):
    run_step([sys.executable, "-m", "redrafter_jax.bench", "report", str(m.parent)], env, cwd,
             60, log)


def summary(profile: str, device: str, runs: dict[str, list[float]],
            results: list[StepResult]) -> str:
  """lease.md; ``runs``: each part's ``[budget s, seconds used]``."""
  spent = ", ".join(f"part {p}: budget {b:.0f} s, {u:.0f} s used" for p, (b, u) in runs.items())
  lines = [f"# Lease: profile {profile} on {device}", "",
           f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {spent}.", "",
           "| step | part | status | seconds | deadline (s from the part's start) "
           "| programs compiled | compile s | what |", "|---|---:|---|---:|---:|---:|---:|---|"]
  for r in results:
    lines.append(f"| {r.name} | {r.part} | {r.status} | {r.seconds:.1f} | {r.deadline_s:.0f} | "
                 f"{len(r.compiles)} | {sum(s for _, s in r.compiles):.1f} | {r.what} |")
  for r in results:
    if r.compiles:
      slow = sorted((c for c in r.compiles if c[1] >= LISTED_COMPILE_S), key=lambda c: -c[1])
      rest = [s for _, s in r.compiles if s < LISTED_COMPILE_S]
      lines += ["", f"## {r.name}: compiled programs, slowest first", "",
                "| program | seconds |", "|---|---:|"]
      lines += [f"| `{p}` | {s:.2f} |" for p, s in slow]
      if rest:
        lines.append(f"| {len(rest)} programs under {LISTED_COMPILE_S} s | {sum(rest):.2f} |")
  return "\n".join(lines) + "\n"


def _replace(path: pathlib.Path, data: bytes) -> None:
  tmp = path.with_name(f".{path.name}.tmp")
  tmp.write_bytes(data)
  os.replace(tmp, path)


def bundle(results_root: pathlib.Path, log_path: pathlib.Path, summary_md: str,
           out: pathlib.Path, limits: Limits) -> list[str]:
  """Write ``out``: lease.md, lease.log and the results tar within the return rules; returns
  notes on what did not fit."""
  out.mkdir(parents=True, exist_ok=True)
  notes = []
  _replace(out / "lease.md", summary_md.encode())
  cap = limits.return_file_bytes - 4096
  log = log_path.read_bytes() if log_path.is_file() else b""
  if len(log) > cap:
    log = b"[... the log's first %d bytes left out ...]\n" % (len(log) - cap) + log[-cap:]
  _replace(out / "lease.log", log)
  files = sorted(p for p in results_root.rglob("*") if p.is_file())
  max_parts = limits.return_files - 2
  while True:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
      for p in files:
        tar.add(str(p), arcname=str(p.relative_to(results_root.parent)))
    data = buf.getvalue()
    parts = [data[i:i + cap] for i in range(0, len(data), cap)]
    if len(parts) <= max_parts or not files:
      break
    biggest = max(files, key=lambda p: p.stat().st_size)
    notes.append(f"left out {biggest.relative_to(results_root)} ({biggest.stat().st_size} bytes)")
    files.remove(biggest)
  for old in out.glob(RESULTS_NAME + "*"):
    old.unlink()
  if len(parts) == 1:
    _replace(out / RESULTS_NAME, parts[0])
  else:
    for i, part in enumerate(parts):
      _replace(out / f"{RESULTS_NAME}.{i:02d}", part)
  return notes


def _start_part(profile_name: str, part: int, stash: pathlib.Path, work: pathlib.Path,
                size: str, budget_s: int):
  """``(folder, runs, records)``: a fresh results folder for part 1; part 1's, read back from
  the stash, for a later part."""
  state = work / STATE
  if part == 1:
    if work.exists():
      shutil.rmtree(work)
    folder = (work / "results" / machine_slug()
              / f"{datetime.date.today().isoformat()}-lease-{profile_name}")
    folder.mkdir(parents=True)
    return folder, {"1": [budget_s, 0.0]}, [
        StepResult("payload", "reassemble and check the payload, unpack the model")]
  if not state.is_file():
    raise LeaseError(f"{stash}: no part 1 of a lease here ({state} missing): the machine went "
                     f"back after the part-1 call, or it did not run; part {part} needs it")
  saved = json.loads(state.read_text())
  if saved["profile"] != profile_name or saved["size"] != size:
    raise LeaseError(f"{stash}: part 1 ran profile {saved['profile']} at size {saved['size']}, "
                     f"not {profile_name} at {size}")
  records = [StepResult(**dict(r, compiles=[tuple(c) for c in r["compiles"]]))
             for r in saved["records"]]
  runs = dict(saved["runs"], **{str(part): [budget_s, 0.0]})
  return pathlib.Path(saved["folder"]), runs, records


def run(profile_name: str, size: str, stash: pathlib.Path, out: pathlib.Path, budget_s: int,
        repo: pathlib.Path, limits: Limits = Limits(), part: int = 1) -> int:
  """Run a profile's steps of ``part`` from ``stash`` within ``budget_s`` seconds, results
  (those of the earlier parts too) into ``out``; returns 0 when every step finished ok."""
  from redrafter_jax.lease.profiles import profile

  t0 = time.monotonic()
  steps: list[Step] = [s for s in profile(profile_name, size) if s.part == part]
  if not steps:
    raise LeaseError(f"profile {profile_name} has no part-{part} steps")
  stash = stash.resolve()
  work = stash / "work"
  folder, runs, records = _start_part(profile_name, part, stash, work, size, budget_s)
  results_root = work / "results"
  log_path = work / "lease.log"
  slug = folder.parent.name
  device = slug if size == "gpu" else f"{slug} (dry-run sizes)"
  first = len(records)
  records += [StepResult(s.name, s.what, part=part) for s in steps]
  usable = budget_s - RESERVE_S
  total_share = sum(s.share for s in steps)

  def publish():
    runs[str(part)][1] = time.monotonic() - t0
    md = summary(profile_name, device, runs, records)
    (folder / "lease.md").write_text(md)
    (work / STATE).write_text(json.dumps(dict(
        profile=profile_name, size=size, folder=str(folder), runs=runs,
        records=[dataclasses.asdict(r) for r in records]), indent=1))
    for n in bundle(results_root, log_path, md, out, limits):
      print(f"lease: {n}", file=sys.stderr)

  with open(log_path, "w" if part == 1 else "a") as log:
    start = time.monotonic()
    if part == 1:
      try:
        payload = restore_payload(stash, stash / "payload")
        model_pack.unpack(payload, stash / "model")
        wheels = install_wheels(payload / WHEELS, stash / PYLIB)
        if wheels:
          log.write(f"payload: installed {', '.join(wheels)} into {stash / PYLIB}\n")
        records[0].status = "ok"
      except (LeaseError, OSError, ValueError) as e:
        records[0].status = f"failed ({e})"
        log.write(f"payload: {e}\n")
      records[0].seconds = time.monotonic() - start
      publish()
      if records[0].status != "ok":
        return 1
    else:
      log.write(f"\n===== part {part}\n")
    fill = dict(py=sys.executable, model=str(stash / "model"), results=str(folder),
                prompts=str(repo / PROMPTS), scratch=str(work / SCRATCH))
    (work / SCRATCH).mkdir(parents=True, exist_ok=True)
    done_share = 0.0
    ready = time.monotonic() - t0
    for step, rec in zip(steps, records[first:]):
      done_share += step.share
      rec.deadline_s = ready + (usable - ready) * done_share / total_share
      timeout = min(rec.deadline_s, usable) - (time.monotonic() - t0)
      argv = [a.format(**fill, budget=max(1, int(timeout - STEP_RESERVE_S)))
              for a in step.argv]
      log.write(f"\n===== {step.name}: {' '.join(argv)} (until {rec.deadline_s:.0f} s)\n")
      log.flush()
      print(f"lease: step {step.name}, {timeout:.0f} s", flush=True)
      env = step_env(stash, step.env)
      start = time.monotonic()
      rec.status, rec.compiles = run_step(argv, env, repo, timeout, log)
      rec.seconds = time.monotonic() - start
      if step.reports:
        rebuild_reports(folder, env, repo, log)
      publish()
  failed = [r.name for r in records if r.status != "ok"]
  print(f"lease: {len(records) - len(failed)}/{len(records)} steps ok"
        + (f"; not ok: {', '.join(failed)}" if failed else ""), flush=True)
  return 1 if any(r.status != "ok" for r in records[first:]) else 0


def collect(files_at: pathlib.Path, repo: pathlib.Path) -> pathlib.Path:
  """Unpack what a lease brought back into ``repo``; returns the lease's results folder."""
  parts = sorted(files_at.rglob(RESULTS_NAME + "*"))
  if not parts:
    raise LeaseError(f"{files_at}: no {RESULTS_NAME} (did the last call run `lease run`? its "
                     "lease.md and lease.log say how far it got)")
  data = b"".join(p.read_bytes() for p in parts)
  with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
    names = tar.getnames()
    if any(not n.startswith("results/") for n in names):
      raise LeaseError(f"{files_at}: the tar holds paths outside results/")
    tar.extractall(repo, filter="data")
  folders = {pathlib.Path(*pathlib.Path(n).parts[:3]) for n in names if len(
      pathlib.Path(n).parts) > 3}
  log = next(iter(sorted(files_at.rglob("lease.log"))), None)
  for f in sorted(folders):
    if log is not None:  # gzipped: JAX's compile log makes it large and repetitive
      (repo / f / "lease.log.gz").write_bytes(gzip.compress(log.read_bytes(), mtime=0))
  return repo / sorted(folders)[0] if folders else repo / "results"
