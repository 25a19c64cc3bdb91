"""``python -m redrafter_jax.bench server_step``: a lone request's step, serving layer by layer.

Alone on the server, a request runs the step ``generate``'s loop runs, plus what serving adds:
the step reads a context bucket of the cache (``--min-context-bucket`` and up) rather than a
cache the request's own size, takes its row out of the slot batch and writes it back
(``serving/placement.py``'s ``take_rows``/``put_rows``), is dispatched once per step by the engine thread, and its tokens are read,
detokenized and handed over on the host. For the ReDrafter tree and for AR, in one process:

  ``batch-1 step``         ``ReDrafter.step`` / AR's one-token step on a batch-1 cache of the
                           request's size (what ``generate`` runs per step, less its loop)
  ``server step, 1 slot``  the server's step program on a one-slot batch (nothing gathered), at
                           the request's context bucket
  ``server step, 1 of S``  the same program with ``--slots`` S slots: the row gathered and put back
  ``served``               the request alone through an ``Engine`` of S slots: from its first
                           token to its end, per step (host work and the per-step read included)

The step rows are timed call by call in ``--repeat`` rounds over all six programs, each row's
time the median (``served``: of ``--requests`` requests after one warm-up request each, the two
engines taking turns), so a slow spell of a shared machine slows all rows alike; going down the
table, each difference is what one serving layer costs. The prompt is ``--prompt`` as a chat
message, generated greedily to ``--max-tokens``.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import queue
import statistics
import sys
import time

from redrafter_jax.bench.ar import load_average
from redrafter_jax.helptext import show_defaults

PROMPT = "Write a story about a lighthouse keeper who finds a message in a bottle."


def parse_args(argv):
  from redrafter_jax.inference.tree_choice import Beams

  p = argparse.ArgumentParser(prog="python -m redrafter_jax.bench server_step",
                              description=__doc__.strip().splitlines()[0])
  show_defaults(p)
  p.add_argument("--model", default="smollm2-135m", help="known name, .gguf file or HF folder")
  p.add_argument("--drafter", default="shipped",
                 help="drafter folder, 'shipped' (checkpoints/) or 'random'")
  p.add_argument("--param-dtype", default="auto", help="the LLM's weights (auto: the CPU's)")
  p.add_argument("--beams", default="1x4+3/5", help="the draft tree (WxL+n/N)")
  p.add_argument("--draft-vocab", type=int, default=None,
                 help="draft vocabulary (default: the drafter's decode.json, else all)")
  p.add_argument("--prompt", default=PROMPT, help="the user message")
  p.add_argument("--max-tokens", type=int, default=64, help="the request's new tokens")
  p.add_argument("--slots", type=int, default=8, help="the server's slots (EngineConfig.slots)")
  p.add_argument("--max-context", type=int, default=2048,
                 help="tokens per slot (EngineConfig.max_context)")
  p.add_argument("--min-context-bucket", type=int, default=512,
                 help="the smallest context bucket (EngineConfig.min_context_bucket)")
  p.add_argument("--repeat", type=int, default=20, help="warm calls per step row (median)")
  p.add_argument("--requests", type=int, default=3, help="lone requests for the served row")
  p.add_argument("--out", type=pathlib.Path, help="also write the table (markdown) here")
  args = p.parse_args(argv)
  try:
    (args.beams,) = Beams.parse_list(args.beams)
  except ValueError as e:
    p.error(f"--beams: {e} (give one tree)")
  if min(args.max_tokens, args.slots, args.max_context, args.min_context_bucket, args.repeat,
         args.requests) < 1:
    p.error("--max-tokens, --slots, --max-context, --min-context-bucket, --repeat and "
            "--requests must be >= 1")
  return args


def engine_config(args, cfg, slots: int, speculative: bool):
  from redrafter_jax.serving.engine import EngineConfig

  return EngineConfig(slots=slots, max_context=args.max_context, max_tokens=args.max_tokens,
                      default_max_tokens=args.max_tokens, speculative=speculative, decode=cfg,
                      min_context_bucket=args.min_context_bucket)


def server_stepper(llm, drafter, ecfg, ids: list[int], mode: str):
  """A call running the server's step program for one live row (slot 0, greedy) at the context
  bucket the engine would read for this request. Returns ``(prepare, step)``: ``prepare``
  admits the row again and waits for that (untimed), so every timed step decodes rather than
  meets the row's token limit."""
  import jax

  from redrafter_jax.serving.placement import Placement

  place = Placement(llm, drafter if ecfg.speculative else None, ecfg, ())
  need = min(len(ids) + ecfg.max_tokens + ecfg.scratch, ecfg.max_context)
  context = next(w for w in place.context_buckets() if w >= need)
  rows = [0] if 1 in place.row_buckets() else list(range(ecfg.slots))
  live = [r == 0 for r in rows]

  def prepare():
    jax.block_until_ready(place.admit([place.admission(0, ids, 0, 0.0, 1.0, 0,
                                                       ecfg.max_tokens)]))

  return prepare, lambda: place.step(rows, live, False, True, mode, context)


def served(llm, tok, drafter, configs: dict, ids: list[int], requests: int
           ) -> dict[str, tuple[float, float]]:
  """``{mode: (seconds per step from the first token to the end, tokens per step)}``: medians
  over ``requests`` greedy requests sent alone to an ``Engine`` per mode (``configs``), the
  engines taking turns, after one warm-up request each."""
  from redrafter_jax.serving.engine import Engine
  from redrafter_jax.serving.request import Finished, GenerationRequest

  engines = {}
  try:
    for mode, ecfg in configs.items():
      engines[mode] = Engine(llm, tok, drafter if ecfg.speculative else None, config=ecfg,
                             stop_ids=()).start()
    per_step = {mode: [] for mode in engines}
    tps = {mode: [] for mode in engines}
    for i in range(requests + 1):
      for mode, engine in engines.items():
        events: queue.Queue = queue.Queue()
        engine.submit(GenerationRequest(ids, max_tokens=configs[mode].max_tokens, seed=0),
                      lambda e, events=events: events.put((time.perf_counter(), e)))
        first, done = events.get(timeout=600)[0], None
        while not isinstance(done, Finished):
          end, done = events.get(timeout=600)
        usage = done.usage["speculative"]
        if i:  # the first request compiles its programs
          per_step[mode].append((end - first) / max(usage["steps"], 1))
          tps[mode].append(usage["tokens_per_step"])
    return {mode: (statistics.median(per_step[mode]), statistics.median(tps[mode]))
            for mode in engines}
  finally:
    for engine in engines.values():
      engine.stop()


def measure(llm, tok, drafter, args, ids: list[int]) -> dict[str, dict[str, float]]:
  """``{row: {"spec": seconds, "ar": seconds}}`` and the served tokens/step (``"tps"``)."""
  from redrafter_jax.inference.ar import one_token_stepper
  from redrafter_jax.inference.timing import TreeStepper, seconds_in_rounds

  cfg = args.beams.config(max_new_tokens=args.max_tokens, draft_vocab_size=args.draft_vocab)
  cache = len(ids) + args.max_tokens + cfg.beam_length + cfg.num_tree_tokens
  labels = {"b1": "batch-1 step", 1: "server step, 1 slot",
            args.slots: f"server step, 1 of {args.slots}"}
  calls = {("b1", "spec"): (None, TreeStepper(llm, drafter, cfg, ids, args.repeat)),
           ("b1", "ar"): (None, one_token_stepper(llm, 1, cache, len(ids)))}
  for slots in (1, args.slots):
    for mode in ("spec", "ar"):
      calls[slots, mode] = server_stepper(llm, drafter,
                                          engine_config(args, cfg, slots, mode == "spec"), ids,
                                          mode)
  seconds = seconds_in_rounds(calls, args.repeat)
  rows = {labels[k]: {mode: seconds[k, mode] for mode in ("spec", "ar")} for k in labels}
  print("steps: done", file=sys.stderr, flush=True)
  got = served(llm, tok, drafter, {mode: engine_config(args, cfg, args.slots, mode == "spec")
                                   for mode in ("spec", "ar")}, ids, args.requests)
  rows["served"] = dict(spec=got["spec"][0], ar=got["ar"][0], tps=got["spec"][1])
  return rows


def table(rows: dict[str, dict[str, float]], args, ids: list[int], seconds: float) -> str:
  tps = rows["served"]["tps"]
  lines = [f"# A lone request's step in the server ({datetime.date.today()})", "",
           f"`python -m redrafter_jax.bench server_step {' '.join(sys.argv[2:])}`".rstrip(), "",
           f"model {args.model}, weights {args.param_dtype}, tree {args.beams.text}, prompt "
           f"{len(ids)} tokens (chat), {args.max_tokens} new, greedy; {args.slots} slots, context "
           f"{args.max_context} (buckets from {args.min_context_bucket}); step rows: median of "
           f"{args.repeat}, served: of {args.requests} requests; {seconds:.0f} s in all; load "
           f"average {load_average()}", "",
           "| part | tree ms/step | AR ms/step | tree / AR | tree tok/s over AR tok/s at the "
           "served tokens/step |", "|---|---:|---:|---:|---:|"]
  for label, r in rows.items():
    ratio = r["spec"] / r["ar"]
    lines.append(f"| {label} | {r['spec'] * 1e3:.1f} | {r['ar'] * 1e3:.1f} | {ratio:.2f}x | "
                 f"{tps / ratio:.2f}x |")
  lines += ["", f"Served tokens/step of the tree: {tps:.2f} (the last column's numerator)."]
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  args = parse_args(argv)
  from redrafter_jax.bench._common import emit, load_models
  from redrafter_jax.weights import tokenizer as tokenizer_lib

  t0 = time.perf_counter()
  m = load_models(args)
  llm, drafter, tok = m.llm, m.drafter, m.tokenizer
  ids = tokenizer_lib.encode(tok, args.prompt, chat=True)
  if len(ids) + args.max_tokens + 16 > args.max_context:
    raise SystemExit(f"error: the prompt ({len(ids)} tokens) and --max-tokens "
                     f"{args.max_tokens} do not fit --max-context {args.max_context}")
  rows = measure(llm, tok, drafter, args, ids)
  emit(table(rows, args, ids, time.perf_counter() - t0), args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
