"""Load test for the OpenAI-compatible server (a benchmark script, loopback only, bounded).

Against a running server:
  redrafter-jax loadtest --url http://127.0.0.1:8000 --requests 64 \\
      --concurrency 16
ReDrafter vs AR side by side (starts both servers itself, same settings, each warmed up alone;
then loads them in turn, ``--rounds`` times, alternating which goes first):
  redrafter-jax loadtest --compare --config configs/smollm2_135m.yaml \\
      --requests 64 --concurrency 16 --rounds 3 [--drafter PATH | --random-drafter] [--slots 8]

A shared machine's speed drifts between runs by more than what separates two servers; rounds
taken back to back against servers that stay up give one ratio per round, so the spread is seen
and the drift cancels (ABBA order) instead of landing on one side.

Every request streams (``stream: true`` with usage) so time to first token is measured; each
has a timeout and the whole run a deadline, so the script always ends. A request that neither
completed nor failed by the deadline counts as lost. The first ``--warmup`` requests (default:
one per client) run before the clock starts, so compilation is not measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from typing import Iterator

import httpx
import numpy as np

from redrafter_jax.helptext import show_defaults

LOOPBACK = ("127.0.0.1", "localhost", "::1")
DEFAULT_PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a short poem about the sea.",
    "List three uses of a paperclip.",
    "What is the capital of France? Answer briefly.",
    "Describe a cat to someone who has never seen one.",
    "Give me a recipe for pancakes.",
    "Summarize the plot of Romeo and Juliet.",
    "How do I reverse a list in Python?",
    "Why do we have seasons on Earth?",
    "Tell me a fun fact about octopuses.",
    "Translate 'good morning' into Spanish, French and German.",
    "What are the benefits of regular exercise?",
]


@dataclasses.dataclass
class Result:
  ok: bool
  latency: float = 0.0
  ttft: float | None = None
  tokens: int = 0
  steps: int = 0
  accepted: int = 0
  error: str = ""


def check_loopback(url: str) -> str:
  host = urllib.parse.urlparse(url).hostname
  if host not in LOOPBACK:
    raise SystemExit(f"error: the load test only targets loopback servers, not {host!r}")
  return url.rstrip("/")


async def one_request(client: httpx.AsyncClient, url: str, body: dict, timeout: float) -> Result:
  """One streamed request (a chat completion when ``body`` has ``messages``)."""
  t0 = time.perf_counter()
  res = Result(ok=False)
  route = "chat/completions" if "messages" in body else "completions"
  try:
    async with client.stream("POST", f"{url}/v1/{route}", json=body, timeout=timeout) as r:
      if r.status_code != 200:
        res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
        return res
      async for line in r.aiter_lines():
        if not line.startswith("data: "):
          continue
        data = line[len("data: "):]
        if data == "[DONE]":
          res.ok = True
          break
        obj = json.loads(data)
        if "error" in obj:
          res.error = obj["error"].get("message", "error")
          return res
        if res.ttft is None and any(c.get("text") or (c.get("delta") or {}).get("content")
                                    for c in obj.get("choices", ())):
          res.ttft = time.perf_counter() - t0
        usage = obj.get("usage")
        if usage:
          res.tokens = usage["completion_tokens"]
          spec = usage.get("speculative") or {}
          res.steps, res.accepted = spec.get("steps", 0), spec.get("accepted_tokens", 0)
  except (httpx.HTTPError, json.JSONDecodeError) as e:
    res.error = f"{type(e).__name__}: {e}"
  res.latency = time.perf_counter() - t0
  if not res.ok and not res.error:
    res.error = "stream ended without [DONE]"
  return res


MIXED_SAMPLING = dict(temperature=0.8, top_p=0.9, top_k=40)  # the top-k/top-p kind


async def _run(url: str, prompts: list[str], *, requests: int, concurrency: int,
               max_tokens: int, temperature: float, timeout: float, deadline: float,
               mix_every: int = 0, chat: bool = False) -> "Load":
  async with httpx.AsyncClient(timeout=timeout) as client:
    model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
    results: list[Result | None] = [None] * requests
    counter = iter(range(requests))

    async def worker():
      for i in counter:
        text = prompts[i % len(prompts)]
        body = dict(model=model, max_tokens=max_tokens, temperature=temperature, seed=i,
                    stream=True, stream_options={"include_usage": True},
                    **({"messages": [{"role": "user", "content": text}]} if chat else
                       {"prompt": text}))
        if mix_every and i % mix_every == mix_every - 1:
          body.update(MIXED_SAMPLING)
        results[i] = await one_request(client, url, body, timeout)

    t0 = time.perf_counter()
    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    _, pending = await asyncio.wait(tasks, timeout=deadline)
    for t in pending:
      t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - t0
  return Load([r for r in results if r is not None], requests, wall)


@dataclasses.dataclass
class Load:
  """What one load run saw: a result per request that ended, requests sent, seconds taken."""
  results: list[Result]
  requests: int
  wall: float

  def summary(self) -> dict:
    return summarize(self.results, self.requests, self.wall)

  @staticmethod
  def pooled(loads: list["Load"]) -> "Load":
    """Several runs as one: throughput is their tokens over their summed wall time and the
    percentiles are over all their requests."""
    return Load([r for x in loads for r in x.results], sum(x.requests for x in loads),
                sum(x.wall for x in loads))


def summarize(results: list[Result], requests: int, wall: float) -> dict:
  ok = [r for r in results if r.ok]
  lat = np.array([r.latency for r in ok]) if ok else np.zeros(1)
  ttft = np.array([r.ttft for r in ok if r.ttft is not None] or [0.0])
  tokens, steps = sum(r.tokens for r in ok), sum(r.steps for r in ok)
  return dict(
      requests=requests, completed=len(ok), failed=len(results) - len(ok),
      lost=requests - len(results), wall_s=wall, completion_tokens=tokens,
      tokens_per_s=tokens / wall if wall > 0 else 0.0,
      requests_per_s=len(ok) / wall if wall > 0 else 0.0,
      latency_p50_s=float(np.percentile(lat, 50)), latency_p99_s=float(np.percentile(lat, 99)),
      ttft_p50_s=float(np.percentile(ttft, 50)), ttft_p95_s=float(np.percentile(ttft, 95)),
      ttft_p99_s=float(np.percentile(ttft, 99)),
      tokens_per_step=(sum(r.accepted for r in ok) + steps) / steps if steps else None,
      errors=sorted({r.error for r in results if not r.ok})[:5])


def run_load(url: str, *, requests: int = 64, concurrency: int = 16, max_tokens: int = 64,
             temperature: float = 0.0, prompts: list[str] | None = None, warmup: int | None = None,
             timeout: float = 300.0, deadline: float = 1800.0, mix_every: int = 0,
             chat: bool = False) -> Load:
  """Warm up, then send ``requests`` streaming completions from ``concurrency`` clients (every
  ``mix_every``-th with top-k/top-p sampling, ``MIXED_SAMPLING``, instead; the warm-up
  requests never are, so that kind's first use is measured). ``chat``: each prompt is a user
  message to ``/v1/chat/completions`` (the model's chat template), not a raw completion."""
  url = check_loopback(url)
  prompts = prompts or DEFAULT_PROMPTS
  kwargs = dict(concurrency=concurrency, max_tokens=max_tokens, temperature=temperature,
                timeout=timeout, deadline=deadline, chat=chat)
  warm = concurrency if warmup is None else warmup
  if warm:
    asyncio.run(_run(url, prompts, requests=warm, **kwargs))
  return asyncio.run(_run(url, prompts, requests=requests, mix_every=mix_every, **kwargs))


def read_prompts(path: str, limit: int | None = None) -> list[str]:
  out = []
  for line in pathlib.Path(path).read_text().splitlines():
    if line.strip():
      out.append(json.loads(line)["prompt"])
  return out[:limit] if limit else out


ROWS = [("completed", "{completed}/{requests}"), ("failed", "{failed}"), ("lost", "{lost}"),
        ("wall time (s)", "{wall_s:.2f}"), ("tokens generated", "{completion_tokens}"),
        ("throughput (tok/s)", "{tokens_per_s:.1f}"), ("requests/s", "{requests_per_s:.2f}"),
        ("latency p50 (s)", "{latency_p50_s:.3f}"), ("latency p99 (s)", "{latency_p99_s:.3f}"),
        ("TTFT p50 (s)", "{ttft_p50_s:.3f}"), ("TTFT p95 (s)", "{ttft_p95_s:.3f}"),
        ("TTFT p99 (s)", "{ttft_p99_s:.3f}"),
        ("tokens/step", "{tps}")]


def format_reports(reports: dict[str, dict]) -> str:
  names = list(reports)
  lines = [f"{'':22}" + "".join(f"{n:>14}" for n in names)]
  for label, fmt in ROWS:
    cells = []
    for n in names:
      r = reports[n]
      tps = "-" if r["tokens_per_step"] is None else f"{r['tokens_per_step']:.2f}"
      cells.append(fmt.format(tps=tps, **r))
    lines.append(f"{label:22}" + "".join(f"{c:>14}" for c in cells))
  if len(names) == 2 and reports[names[1]]["tokens_per_s"] > 0:
    a, b = (reports[n]["tokens_per_s"] for n in names)
    lines.append(f"{'speedup (throughput)':22}{a / b:>14.2f}x  ({names[0]} / {names[1]})")
  for n in names:
    for e in reports[n]["errors"]:
      lines.append(f"{n} error: {e}")
  return "\n".join(lines)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log_path: str) -> None:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      raise SystemExit(f"error: the server exited with status {proc.returncode}; see {log_path}")
    try:
      if httpx.get(f"{url}/health", timeout=2).status_code == 200:
        return
    except httpx.HTTPError:
      pass
    time.sleep(1)
  raise SystemExit(f"error: the server was not healthy within {timeout} s; see {log_path}")


MODES = ("redrafter", "ar")  # the servers --compare starts, in this order


@contextlib.contextmanager
def _server(mode: str, args) -> Iterator[str]:
  """A ``serve`` subprocess (ReDrafter or ``--ar``) with ``args``' settings; yields its URL once
  it is healthy (warmed up) and stops it on exit."""
  port = _free_port()
  cmd = [sys.executable, "-m", "redrafter_jax.cli", "serve", "--config", args.config,
         "--host", "127.0.0.1", "--port", str(port), "--slots", str(args.slots),
         "--max-tokens", str(max(args.max_tokens, 1))]
  if mode == "ar":
    cmd.append("--ar")
  elif args.random_drafter:
    cmd.append("--random-drafter")
  elif args.drafter:
    cmd += ["--drafter", args.drafter]
  cmd += args.server_args
  log_path = os.path.join(tempfile.gettempdir(), f"redrafter-loadtest-{mode}-{port}.log")
  print(f"[{mode}] starting: {' '.join(cmd)} (log: {log_path})", flush=True)
  with open(log_path, "w") as log_file:
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    try:
      url = f"http://127.0.0.1:{port}"
      _wait_healthy(url, proc, args.startup_timeout, log_path)
      yield url
    finally:
      proc.terminate()
      try:
        proc.wait(30)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def compare(args) -> list[dict[str, Load]]:
  """Start a ReDrafter and an AR server with the same settings, the second once the first is
  warmed up (so that each measures its step costs alone), then load them in turn for
  ``args.rounds`` rounds, the other server idle; odd rounds load ReDrafter first, even rounds
  AR first. The warm-up requests run in the first round only. Returns each round's loads."""
  rounds = []
  with contextlib.ExitStack() as stack:
    urls = {mode: stack.enter_context(_server(mode, args)) for mode in MODES}
    for r in range(args.rounds):
      loads = {}
      for mode in MODES if r % 2 == 0 else MODES[::-1]:
        loads[mode] = run_load(urls[mode], **_load_kwargs(args, warm=r == 0))
        s = loads[mode].summary()
        print(f"[round {r + 1}/{args.rounds}] {mode}: {s['completed']}/{args.requests} "
              f"completed, {s['tokens_per_s']:.1f} tok/s", flush=True)
      rounds.append({mode: loads[mode] for mode in MODES})
  return rounds


def format_rounds(rounds: list[dict[str, Load]]) -> str:
  """Each round's throughputs and ratio, then the ratios' median and range."""
  a, b = MODES
  lines = [f"{'round':>5}  {'first':<10}{a + ' tok/s':>16}{b + ' tok/s':>12}{a + ' / ' + b:>18}"]
  ratios = []
  for r, loads in enumerate(rounds):
    ta, tb = (loads[m].summary()["tokens_per_s"] for m in MODES)
    ratios.append(ta / tb if tb > 0 else float("nan"))
    lines.append(f"{r + 1:>5}  {MODES[r % 2]:<10}{ta:>16.1f}{tb:>12.1f}{ratios[-1]:>17.2f}x")
  lines.append(f"{a} / {b} over {len(rounds)} rounds: median {np.median(ratios):.2f}x, "
               f"min {min(ratios):.2f}x, max {max(ratios):.2f}x")
  return "\n".join(lines)


def _load_kwargs(args, warm: bool = True) -> dict:
  prompts = read_prompts(args.prompts, args.prompt_limit) if args.prompts else None
  return dict(requests=args.requests, concurrency=args.concurrency, max_tokens=args.max_tokens,
              temperature=args.temperature, prompts=prompts, warmup=args.warmup if warm else 0,
              timeout=args.request_timeout, deadline=args.deadline, mix_every=args.mix_every,
              chat=args.chat)


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="redrafter-jax loadtest",
                              description=__doc__.splitlines()[0])
  show_defaults(p)
  target = p.add_mutually_exclusive_group(required=True)
  target.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
  target.add_argument("--compare", action="store_true",
                      help="start a ReDrafter and an --ar server and load each in turn")
  p.add_argument("--requests", type=int, default=64, help="measured requests per load")
  p.add_argument("--concurrency", type=int, default=16, help="clients sending at once")
  p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request")
  p.add_argument("--temperature", type=float, default=0.0, help="of each request (0: greedy)")
  p.add_argument("--mix-every", type=int, default=0, metavar="K",
                 help="every K-th request samples with top-k/top-p (temperature 0.8, top_p 0.9, "
                      "top_k 40) instead; 0 = none (default)")
  p.add_argument("--prompts", default=None, help="JSON-lines file with a 'prompt' per line")
  p.add_argument("--chat", action="store_true",
                 help="send each prompt as a user message to /v1/chat/completions (the chat "
                      "template) instead of a raw completion")
  p.add_argument("--prompt-limit", type=int, default=None)
  p.add_argument("--warmup", type=int, default=None,
                 help="unmeasured requests first (default: --concurrency)")
  p.add_argument("--request-timeout", type=float, default=300.0,
                 help="seconds a request may take")
  p.add_argument("--deadline", type=float, default=1800.0, help="seconds for the whole run")
  p.add_argument("--json", action="store_true", help="print the reports as JSON too")
  srv = p.add_argument_group("--compare: how to start the servers")
  srv.add_argument("--config", default="configs/smollm2_135m.yaml",
                   help="preset to serve (default: SmolLM2-135M with the shipped drafter; a "
                        "preset without drafter_path needs --drafter or --random-drafter)")
  srv.add_argument("--drafter", default=None)
  srv.add_argument("--random-drafter", action="store_true")
  srv.add_argument("--slots", type=int, default=8, help="each server's decode slots")
  srv.add_argument("--rounds", type=int, default=1,
                   help="load both servers this many times each, alternating which goes first; "
                        "prints each round's ratio and pools the rest")
  srv.add_argument("--startup-timeout", type=float, default=900.0,
                   help="seconds to wait for each server's /health")
  srv.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                   help="further `serve` arguments (last on the line)")
  return p


def main(argv: list[str] | None = None) -> int:
  p = parser()
  args = p.parse_args(argv)
  if min(args.requests, args.concurrency, args.max_tokens) < 1:
    p.error("--requests, --concurrency and --max-tokens must be >= 1")
  if args.mix_every < 0:
    p.error("--mix-every must be >= 0")
  if args.rounds < 1:
    p.error("--rounds must be >= 1")
  if args.rounds > 1 and not args.compare:
    p.error("--rounds needs --compare")
  rounds = compare(args) if args.compare else [{"server": run_load(args.url,
                                                                   **_load_kwargs(args))}]
  reports = {m: Load.pooled([r[m] for r in rounds]).summary() for m in rounds[0]}
  mix = f", every {args.mix_every}th top-k/top-p sampled" if args.mix_every else ""
  mix += ", chat template" if args.chat else ""
  print(f"\n{args.requests} requests, {args.concurrency} concurrent clients, "
        f"max_tokens {args.max_tokens}, temperature {args.temperature}{mix}"
        + (f"; {len(rounds)} rounds, pooled" if len(rounds) > 1 else ""))
  print(format_reports(reports))
  if len(rounds) > 1:
    print(format_rounds(rounds))
  if args.json:
    out = reports if len(rounds) == 1 else \
        {"pooled": reports, "rounds": [{m: x.summary() for m, x in r.items()} for r in rounds]}
    print(json.dumps(out, indent=1))
  ok = all(r["completed"] == r["requests"] for r in reports.values())
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
