"""The server's warm-up step times per rows bucket and step mode, with smaller trees beside the
served one: what ``policy.plan`` reads. Run from the repository root:

  .venv/bin/python results/linux-x86-64-2cpu/2026-11-26-smaller-trees/step_table.py \
      [TREES] [MAX_CONTEXT]

TREES (default "1x2+3/3,1x3+3/4") as ``serve --trees``; MAX_CONTEXT (default 512: one context
bucket, the one short chats read). Real model, shipped drafter, the tree ``serve`` picks here
(``--tree auto``), 8 slots, greedy. Prints, per rows bucket, each mode's step time, its ratio to
AR's, the tokens/step the policy starts from (the drafter's acceptance.json) and the predicted
tokens/s against AR's."""
import logging
import sys

from redrafter_jax.config import load_preset
from redrafter_jax.serving import server

trees = (sys.argv[1] if len(sys.argv) > 1 else "1x2+3/3,1x3+3/4").split(",")
max_context = int(sys.argv[2]) if len(sys.argv) > 2 else 512
logging.basicConfig(level=logging.INFO, format="%(message)s")
srv = server.build(load_preset("configs/smollm2_135m.yaml"), slots=8, max_context=max_context,
                   max_tokens=64, tree="auto", trees=trees, warmup=True)
engine = srv.engine
try:
  warm = engine.costs.warm
  modes = engine._place.modes()
  tps = {"ar": 1.0, **{m: a.prior for m, a in engine.acceptance.items()}}
  print(f"\nserved tree: {engine.config.decode.beam_width}x{engine.config.decode.beam_length}"
        f"+{engine.config.decode.lookup_ngram}/{engine.config.decode.num_tree_tokens}; "
        f"context bucket {max_context}; tokens/step priors {tps}\n")
  print("| rows | " + " | ".join(f"{m} ms (x AR; predicted tok/s vs AR)" for m in modes) + " |")
  print("|---:|" + "---:|" * len(modes))
  for b in engine._place.row_buckets():
    ar = warm[b, "ar", "greedy", max_context]
    cells = []
    for m in modes:
      s = warm[b, m, "greedy", max_context]
      cells.append(f"{s * 1e3:.1f}" if m == "ar" else
                   f"{s * 1e3:.1f} ({s / ar:.2f}x; {tps[m] * ar / s:.2f}x)")
    print(f"| {b} | " + " | ".join(cells) + " |")
finally:
  srv.close()
