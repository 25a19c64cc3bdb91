"""The server's step programs with glibc's default allocator settings and with
``hostmem.keep_freed_memory()``, each in its own process, alternating (A B A B). Run from the
repository root: ``.venv/bin/python results/linux-x86-64-2cpu/2026-11-26-smaller-trees/host_memory.py``.

Each process times ``Placement.step`` (8 slots, context bucket 512, greedy; real model, bfloat16
weights, shipped drafter, tree 1x5+3/6) for b = 1, 2, 4 rows of the 8 (gathered and put back)
and all 8, AR and tree, and batches of exactly b slots (nothing gathered), in 12 rounds over all
programs; prints the medians in ms."""
import json
import os
import subprocess
import sys
import time
import types

ROWS = ((8, 1), (8, 2), (8, 4), (8, 8), (2, 2), (4, 4))  # (slots, rows)


def child():
  from redrafter_jax.hostmem import keep_freed_memory

  applied = keep_freed_memory()
  import jax
  import numpy as np

  from redrafter_jax.bench._common import load_models
  from redrafter_jax.inference.tree_choice import Beams
  from redrafter_jax.serving.engine import EngineConfig
  from redrafter_jax.serving.placement import Placement

  args = types.SimpleNamespace(model="smollm2-135m", param_dtype="bfloat16", drafter="shipped",
                               draft_vocab=None)
  llm, _, drafter = load_models(args)
  dec = Beams.parse_list("1x5+3/6")[0].config(draft_vocab_size=args.draft_vocab,
                                              max_new_tokens=64)
  places = {s: Placement(llm, drafter, EngineConfig(slots=s, max_context=512, max_tokens=64,
                                                    min_context_bucket=512, decode=dec), [2])
            for s in sorted({s for s, _ in ROWS})}
  calls = {}
  for slots, b in ROWS:
    for mode in ("ar", "spec"):
      call = lambda p=places[slots], b=b, mode=mode: p.step(list(range(b)), [True] * b, False,
                                                             True, mode, 512)
      jax.block_until_ready(call())
      calls[f"{b} of {slots} {mode}"] = call
  times = {k: [] for k in calls}
  for _ in range(12):
    for k, call in calls.items():
      t0 = time.perf_counter()
      jax.block_until_ready(call())
      times[k].append(time.perf_counter() - t0)
  print(json.dumps({"applied": applied, **{k: float(np.median(v)) for k, v in times.items()}}))


def main():
  runs = []
  for setting in ("default", "keep", "default", "keep"):
    env = dict(os.environ, REDRAFTER_JAX_MALLOC=setting)
    out = subprocess.run([sys.executable, __file__, "child"], env=env, capture_output=True,
                         text=True, check=True).stdout
    runs.append((setting, json.loads(out.strip().splitlines()[-1])))
    print(setting, runs[-1][1], flush=True)
  keys = [k for k in runs[0][1] if k != "applied"]
  print("\n| step (rows of slots, mode) | " + " | ".join(
      f"{s} ({'applied' if r['applied'] else 'glibc defaults'}) ms" for s, r in runs) + " |")
  print("|---|" + "---:|" * len(runs))
  for k in keys:
    print(f"| {k} | " + " | ".join(f"{r[k] * 1e3:.1f}" for _, r in runs) + " |")


if __name__ == "__main__":
  child() if sys.argv[1:] == ["child"] else main()
