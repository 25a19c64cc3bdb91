"""``python -m redrafter_jax.bench server_start``: how long ``redrafter-jax serve`` takes to be ready,
from a cold and a warm compilation cache, and the memory it holds.

Each run starts the server as a subprocess with ``--compile-cache DIR`` (a fresh empty folder for
the first, cold, run; the same folder, now filled, for the warm runs after it), polls ``/health``
from the moment the process starts until it answers 200, then stops it with SIGTERM. Reported
per run: seconds until the port answered, seconds until ready, the warm-up's program count (from
the 503 progress bodies), the resident memory at ready and its peak (``VmRSS``, ``VmHWM`` from
``/proc``), the seconds a short chat request (``PROMPT``, one new token: its admission and
prefill) takes once ready, and the exit status; with ``--settle``, also the seconds until the
background compile (the programs a covering warm-up leaves for later) is done and its steps
timed (those that never pay dropped), the programs the server then holds, the memory then, and
the short request's seconds again, and the pauses between requests in which the engine timed
newly compiled steps (a request arriving then waits: their count and the longest, from the
server's log); with ``--probe-every S`` as well, the short request is also sent every S
seconds while the compile runs, and its longest time is reported (what a user meets then: the
compile's share of the CPU and those pauses). The
drafter's per-device tree timing (``--tree auto``) has its own cache beside the model; the
table says whether it was already there. With ``--out``, each run's server log (its start-up
stages and every warm-up program's seconds; the ``/health`` polls left out) is kept beside the
table as ``<name>-run<i>.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

from redrafter_jax.helptext import show_defaults
from redrafter_jax.hostmem import status_kb


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m redrafter_jax.bench server_start",
                              description=__doc__.strip().splitlines()[0])
  show_defaults(p)
  p.add_argument("--config", default="configs/smollm2_135m.yaml", help="the serving preset")
  p.add_argument("--warm-runs", type=int, default=1, help="runs after the cold one")
  p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for ready")
  p.add_argument("--out", type=pathlib.Path, help="also write the table here (and a .json)")
  p.add_argument("--settle", action="store_true",
                 help="after ready, also wait for the background compile to finish (/health's "
                      "'compiling') and report its seconds and the memory then")
  p.add_argument("--probe-every", type=float, default=0.0, metavar="S",
                 help="with --settle: also send the short request every S seconds while the "
                      "background compile runs (0: not)")
  p.add_argument("serve_args", nargs="*", metavar="ARG",
                 help="more `serve` arguments, after --, e.g. -- --slots 4 --ar")
  args = p.parse_args(argv)
  if args.warm_runs < 0 or args.timeout <= 0 or args.probe_every < 0:
    p.error("--warm-runs and --probe-every must be >= 0 and --timeout > 0")
  if args.probe_every and not args.settle:
    p.error("--probe-every needs --settle")
  if not pathlib.Path(args.config).is_file():
    p.error(f"--config: no such file {args.config}")
  return args


PROMPT = "What is the capital of France? Answer in one sentence."


def first_token_seconds(port: int) -> float:
  """Seconds for a greedy chat request of ``PROMPT`` with ``max_tokens`` 1 (its admission and
  prefill, one token back)."""
  import httpx

  base = f"http://127.0.0.1:{port}/v1"
  model = httpx.get(f"{base}/models", timeout=30).json()["data"][0]["id"]
  t0 = time.monotonic()
  r = httpx.post(f"{base}/chat/completions", timeout=600, json={
      "model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1,
      "temperature": 0})
  if r.status_code != 200:
    raise RuntimeError(f"the short request got HTTP {r.status_code}: {r.text[:200]}")
  return time.monotonic() - t0


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def one_start(args, cache: pathlib.Path, log_path: pathlib.Path) -> dict:
  import httpx

  port = free_port()
  cmd = [sys.executable, "-m", "redrafter_jax.cli", "serve", "--config", args.config, "--port",
         str(port), "--compile-cache", str(cache), *args.serve_args]
  t0 = time.monotonic()
  with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
  out = dict(command=" ".join(cmd[1:]), listening_s=None, ready_s=None, warmup_programs=None,
             rss_mb=None, peak_rss_mb=None, first_token_s=None, settled_s=None,
             settled_programs=None, settled_rss_mb=None, settled_first_token_s=None,
             pauses=None, longest_pause_s=None, probes_s=[], exit_status=None, error=None)
  probed = t0
  try:
    while time.monotonic() - t0 < args.timeout:
      if proc.poll() is not None:
        out["error"] = f"exited {proc.returncode} before ready (log: {log_path})"
        return out
      try:
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
      except httpx.TransportError:
        time.sleep(0.1)
        continue
      if out["listening_s"] is None:
        out["listening_s"] = time.monotonic() - t0
      if r.status_code == 200:
        if out["ready_s"] is None:
          out["ready_s"] = time.monotonic() - t0
          mem = status_kb(proc.pid)
          out["rss_mb"] = mem.get("VmRSS", 0) / 1024
          out["peak_rss_mb"] = mem.get("VmHWM", 0) / 1024
          out["first_token_s"] = first_token_seconds(port)
        compiling = r.json().get("compiling")
        if not args.settle or not compiling or not compiling["running"]:
          if args.settle:
            out["settled_s"] = time.monotonic() - t0
            out["settled_programs"] = (out["warmup_programs"] or 0) + (
                compiling["done"] - compiling.get("dropped", 0) if compiling else 0)
            out["settled_rss_mb"] = status_kb(proc.pid).get("VmRSS", 0) / 1024
            out["settled_first_token_s"] = first_token_seconds(port)
          break
        if args.probe_every and time.monotonic() - probed >= args.probe_every:
          out["probes_s"].append(first_token_seconds(port))
          probed = time.monotonic()
        time.sleep(1.0)
        continue
      body = r.json()
      if body.get("status") == "failed":
        out["error"] = body.get("error")
        return out
      if "warmup" in body:
        out["warmup_programs"] = body["warmup"]["total"]
      time.sleep(0.2)
    else:
      out["error"] = f"not ready within {args.timeout:.0f} s (log: {log_path})"
    return out
  except RuntimeError as e:  # the short request failed
    out["error"] = str(e)
    return out
  finally:
    if proc.poll() is None:
      proc.send_signal(signal.SIGTERM)
      try:
        proc.wait(60)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    out["exit_status"] = proc.returncode
    if args.settle:
      seconds = pause_seconds(log_path.read_text())
      out["pauses"], out["longest_pause_s"] = len(seconds), max(seconds, default=None)


def pause_seconds(log_text: str) -> list[float]:
  """The seconds of each pause between requests the server's log records
  (``engine.PAUSE_LOG``)."""
  from redrafter_jax.serving.engine import PAUSE_LOG

  pattern = re.compile(re.escape(PAUSE_LOG) + r" ([0-9.]+) s")
  return [float(m.group(1)) for m in pattern.finditer(log_text)]


def table(args, runs: list[dict], trees_cached: bool) -> str:
  fmt = lambda v, f="{:.1f}": "n/a" if v is None else f.format(v)
  lines = [f"# Server start-up ({time.strftime('%Y-%m-%d')})", "",
           f"`python -m redrafter_jax.bench server_start --config {args.config}"
           + (" --settle" if args.settle else "")
           + (f" --probe-every {args.probe_every:g}" if args.probe_every else "")
           + (f" -- {' '.join(args.serve_args)}" if args.serve_args else "") + "`", "",
           f"{os.cpu_count()} CPUs; the tree timings of `--tree auto` were "
           f"{'already cached' if trees_cached else 'not cached (the first run timed them)'}.",
           f"Short request: `{PROMPT}` (chat, greedy, one new token).",
           "", "| run | compile cache | port answers (s) | ready (s) | warm-up programs "
           "| RSS at ready (MB) | peak RSS (MB) | short request (s) | all compiled (s) "
           "| programs held then | RSS then (MB) | short request then (s) | pauses "
           "| longest pause (s) | short requests while compiling | longest of them (s) | exit "
           "| error |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:"
           "|---|"]
  for i, r in enumerate(runs):
    lines.append(f"| {i + 1} | {'cold' if i == 0 else 'warm'} | {fmt(r['listening_s'])} "
                 f"| {fmt(r['ready_s'])} | {fmt(r['warmup_programs'], '{}')} "
                 f"| {fmt(r['rss_mb'], '{:.0f}')} | {fmt(r['peak_rss_mb'], '{:.0f}')} "
                 f"| {fmt(r.get('first_token_s'), '{:.2f}')} "
                 f"| {fmt(r.get('settled_s'))} | {fmt(r.get('settled_programs'), '{}')} "
                 f"| {fmt(r.get('settled_rss_mb'), '{:.0f}')} "
                 f"| {fmt(r.get('settled_first_token_s'), '{:.2f}')} "
                 f"| {fmt(r.get('pauses'), '{}')} | {fmt(r.get('longest_pause_s'), '{:.2f}')} "
                 f"| {len(r['probes_s'])} | {fmt(max(r['probes_s'], default=None), '{:.2f}')} "
                 f"| {fmt(r['exit_status'], '{}')} | {r['error'] or ''} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  args = parse_args(argv)
  from redrafter_jax.bench._common import emit
  from redrafter_jax.weights.fetch import cache_dir

  trees_cached = any((pathlib.Path(cache_dir()) / "trees").glob("*"))
  runs = []
  with tempfile.TemporaryDirectory(prefix="server-start-") as tmp:
    cache = pathlib.Path(tmp) / "xla"
    cache.mkdir()
    for i in range(1 + args.warm_runs):
      log_path = pathlib.Path(tmp) / f"serve-{i}.log"
      runs.append(one_start(args, cache, log_path))
      print(f"run {i + 1}: {runs[-1]}", file=sys.stderr, flush=True)
      if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        kept = [line for line in log_path.read_text().splitlines(keepends=True)
                if '"GET /health' not in line]
        (args.out.parent / f"{args.out.stem}-run{i + 1}.log").write_text("".join(kept))
      if runs[-1]["error"]:
        print(log_path.read_text()[-3000:], file=sys.stderr)
        break
  report = table(args, runs, trees_cached)
  emit(report, args.out)
  if args.out:
    args.out.with_suffix(".json").write_text(json.dumps(dict(runs=runs), indent=1))
  return 1 if any(r["error"] for r in runs) else 0


if __name__ == "__main__":
  sys.exit(main())
