"""``python -m redrafter_jax.bench decode``: AR vs ReDrafter on Spec-Bench prompts, one run.

Prints, per (W, L): tokens/s of our AR greedy and of ReDrafter greedy on the same prompts
(interleaved, batch 1), tokens/step and the accepted drafted tokens per step by the beam that
held them (drafter / context lookup / step-1 alternatives), mean packed tree size and dedup
saving; then the cost split
of one decode step (draft = beam search + tree packing; verify = the LLM forward over the tree;
accept + commit), measured on a real prefilled state, with the overhead ratio
(draft + accept/commit) / verify. ``--weight-layouts oi,io`` runs all of it for each way of
storing the LLM's projections (``models.linear``), interleaved prompt by prompt.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from redrafter_jax.bench._common import draft_vocab_arg, load
from redrafter_jax.bench._compiles import programs_compiled
from redrafter_jax.bench._runner import timed
from redrafter_jax.bench.ar import DEFAULT_PROMPTS
from redrafter_jax.config import DecodeConfig
from redrafter_jax.helptext import show_defaults
from redrafter_jax.inference import step as step_lib
from redrafter_jax.inference.ar import generate
from redrafter_jax.inference.decode import ReDrafter
from redrafter_jax.inference.timing import median_seconds
from redrafter_jax.inference.tree_choice import Beams
from redrafter_jax.models import linear
from redrafter_jax.weights.tokenizer import encode, stop_token_ids


def load_prompts(path, tok, n: int, max_prompt_tokens: int) -> list[list[int]]:
  """``n`` prompts spread evenly over the file (so over its categories), chat-templated."""
  from redrafter_jax.jsonl import read_jsonl

  rows = [row for _, row in read_jsonl(path, "prompt", what="prompts file")]
  ids = [encode(tok, r["prompt"], chat=True) for r in rows]
  ids = [p for p in ids if len(p) <= max_prompt_tokens]
  step = max(1, len(ids) // n)
  return ids[::step][:n]


def _ms(fn, *args, repeat: int) -> float:
  return 1e3 * median_seconds(lambda: fn(*args), repeat)


def step_split(llm, drafter, prompt, cfg: DecodeConfig, repeat: int) -> dict:
  """Median ms of each part of one decode step, on the state after prefilling ``prompt``."""
  rd = ReDrafter(llm, drafter, cfg)
  p = rd.prepare([prompt])
  state = rd.start(p)
  cfg = rd.static_config
  llm_def, llm_state, d_def, d_state = rd.llm_def, rd.llm_state, rd.drafter_def, rd.drafter_state

  @jax.jit
  def draft(llm_state, d_state, state):
    return step_lib.draft(nnx.merge(llm_def, llm_state), nnx.merge(d_def, d_state), state, cfg)

  # Inside the decode loop XLA:CPU converts a bfloat16 embedding table for the drafter's row
  # gathers once, before the loop; a draft() jitted alone would convert all of it on every call.
  # Time the draft as the loop runs it: with the table already in the drafter's dtype.
  draft_state = jax.tree.map(lambda x: x, llm_state)  # new variables, the same arrays
  table = draft_state["embed_tokens"]["embedding"]
  table.set_value(table.get_value().astype(drafter.dtype))

  @jax.jit
  def verify(llm_state, state, tree):
    return step_lib.verify_forward(nnx.merge(llm_def, llm_state), state, tree,
                                   layers=rd.feature_layers)  # a multi-layer drafter's states

  @jax.jit
  def accept_commit(state, beams, tree, logits, hidden, cache):
    verdict = step_lib.accept(state.rng, beams, tree, logits, p.params, cfg, False, p.greedy)
    return step_lib.commit(state, cache, verdict, hidden, tree, p.stop_ids, cfg)

  beams, tree = draft(llm_state, d_state, state)
  logits, hidden, cache = verify(llm_state, state, tree)
  out = dict(draft_ms=_ms(draft, draft_state, d_state, state, repeat=repeat),
             verify_ms=_ms(verify, llm_state, state, tree, repeat=repeat),
             accept_commit_ms=_ms(accept_commit, state, beams, tree, logits, hidden, cache,
                                     repeat=repeat))
  out["overhead_vs_verify"] = (out["draft_ms"] + out["accept_commit_ms"]) / out["verify_ms"]
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m redrafter_jax.bench decode", description=__doc__)
  show_defaults(ap)
  ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="Spec-Bench jsonl")
  ap.add_argument("--model", default="smollm2-135m",
                  help="known name, .gguf file or HF folder")
  ap.add_argument("--drafter", default="random",
                  help="drafter folder, 'shipped' (checkpoints/) or 'random'")
  ap.add_argument("--exit-dim", type=int, default=256, help="exit_dim of a random drafter")
  ap.add_argument("--num-prompts", type=int, default=8, help="prompts, spread over the file")
  ap.add_argument("--max-prompt-tokens", type=int, default=512,
                  help="leave out longer prompts (chat-templated tokens)")
  ap.add_argument("--max-new-tokens", type=int, default=96, help="tokens per prompt")
  ap.add_argument("--beams", default="4x4,8x5",
                  help="comma-separated WxL settings; WxL+n adds the context-lookup beam "
                       "(n-grams up to n), /N a tree token budget (e.g. 1x4+3/5)")
  ap.add_argument("--draft-vocab", type=int, default=None,
                  help="draft vocabulary size (0 = all; default: the drafter's decode.json, else all)")
  ap.add_argument("--repeat", type=int, default=10, help="repeats for the step split")
  ap.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32",
                  help="the LLM's weights (activations stay float32)")
  ap.add_argument("--weight-layouts", default=None,
                  help="comma-separated LLM weight layouts to compare, side by side (oi: [out, "
                  "in]; io: [in, out]); default: the one the weights load in here")
  args = ap.parse_args(argv)
  try:
    settings = Beams.parse_list(args.beams)
  except ValueError as e:
    ap.error(f"--beams: {e}")
  layouts = (args.weight_layouts.split(",") if args.weight_layouts else
             [linear.preferred_layout(jnp.dtype(args.param_dtype))])
  if any(x not in linear.LAYOUTS for x in layouts) or len(set(layouts)) < len(layouts):
    ap.error(f"--weight-layouts: want distinct values from {list(linear.LAYOUTS)}, got "
             f"{args.weight_layouts!r}")
  args.draft_vocab = draft_vocab_arg(args.drafter, args.draft_vocab)

  models = load(args.model, param_dtype=args.param_dtype, drafter=args.drafter,
                exit_dim=args.exit_dim)
  llm, drafter, tok = models.llm, models.drafter, models.tokenizer
  llms = {x: linear.to_layout(nnx.clone(llm) if i else llm, x) for i, x in enumerate(layouts)}
  stops = stop_token_ids(tok)
  prompts = load_prompts(args.prompts, tok, args.num_prompts, args.max_prompt_tokens)
  cfgs = [b.config(max_new_tokens=args.max_new_tokens, draft_vocab_size=args.draft_vocab)
          for b in settings]
  print(f"# {len(prompts)} prompts from {args.prompts}, {args.max_new_tokens} new tokens, "
        f"greedy, batch 1, {args.param_dtype} weights in layout(s) {','.join(layouts)}, "
        f"drafter={args.drafter}, draft_vocab={args.draft_vocab or 'all'}, "
        f"device={jax.devices()[0].platform}")
  # Warm up (compile) the first prompt's programs, then interleave the timed runs by prompt. A
  # prompt of another length needs programs of its own (prefill, cache size, context buckets):
  # a call that compiled anything is run and timed again (``timed``), so no compile is counted.
  redrafters = {}
  for x, model in llms.items():
    generate(model, [prompts[0]], max_new_tokens=args.max_new_tokens, stop_ids=stops)
    for cfg in cfgs:
      redrafters[x, cfg] = ReDrafter(model, drafter, cfg)  # models split once each
      redrafters[x, cfg]([prompts[0]], stop_ids=stops)
  totals = {(x, "ar"): [0, 0.0] for x in layouts}
  totals |= {key: [0, 0.0, 0, 0.0, 0.0, 0, np.zeros(len(step_lib.SOURCES))]
             for key in redrafters}
  compiled_before = programs_compiled()
  for prompt in prompts:
    for x, model in llms.items():
      ar, secs = timed(lambda: generate(model, [prompt], max_new_tokens=args.max_new_tokens,
                                        stop_ids=stops))
      totals[x, "ar"][0] += len(ar.tokens[0])
      totals[x, "ar"][1] += secs
      for cfg in cfgs:
        r, secs = timed(lambda: redrafters[x, cfg]([prompt], stop_ids=stops))
        row = totals[x, cfg]
        row[0] += len(r.tokens[0])
        row[1] += secs
        row[2] += r.metrics["steps"]
        row[3] += r.metrics["accepted_tokens"]
        row[4] += r.metrics["mean_tree_tokens"] * r.metrics["steps"]
        row[5] += r.tokens[0] == ar.tokens[0]
        row[6] += r.metrics["steps"] * np.asarray(
            [r.metrics["accepted_per_step_by_source"][k] for k in step_lib.SOURCES])
  print(f"# {programs_compiled() - compiled_before} programs compiled on the way (other prompt "
        "lengths' shapes); each call that compiled was timed again")
  print("\n| layout | decoder | tokens/s | speedup vs AR (same layout) | tokens/step | accepted "
        f"per step: {' / '.join(step_lib.SOURCES)} | tree tokens (packed / beams) "
        "| same tokens as AR |")
  print("|---|---|---|---|---|---|---|---|")
  for x in layouts:
    ar_tps = totals[x, "ar"][0] / totals[x, "ar"][1]
    print(f"| {x} | AR greedy | {ar_tps:.1f} | 1.00x | 1.00 | - | - | - |")
    for b, cfg in zip(settings, cfgs):
      n, secs, steps, acc, tree, same, by_source = totals[x, cfg]
      by = " / ".join(f"{v / max(steps, 1):.2f}" for v in by_source)
      print(f"| {x} | ReDrafter {b.label} | {n / secs:.1f} | {n / secs / ar_tps:.2f}x | "
            f"{(acc + steps) / max(steps, 1):.2f} | {by} | {tree / max(steps, 1):.1f} / "
            f"{cfg.num_beams * cfg.beam_length + 2 * cfg.first_alternatives} | "
            f"{same}/{len(prompts)} |")
  print("\n| layout | setting | N | draft (beam search + pack) ms | verify forward ms "
        "| accept+commit ms | overhead / verify |")
  print("|---|---|---|---|---|---|---|")
  for x, model in llms.items():
    for b, cfg in zip(settings, cfgs):
      s = step_split(model, drafter, prompts[0], cfg, args.repeat)
      print(f"| {x} | {b.label} | {cfg.num_tree_tokens} | {s['draft_ms']:.1f} "
            f"| {s['verify_ms']:.1f} | {s['accept_commit_ms']:.1f} | "
            f"{100 * s['overhead_vs_verify']:.0f}% |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
