"""``python -m redrafter_jax.bench invariant``: the invariant mode on the real model, bfloat16:
the same tokens at every batch and tree, and what that costs.

With ``load_llama(..., invariant=True)`` (bfloat16 activations and weights), on the chat-
templated Spec-Bench prompts (``--num-prompts`` spread over the file), greedy, exactly
``--max-new-tokens`` each (no stop token), it runs

  reference    AR, batch 1
  AR b4        AR, batch 4 (consecutive prompts of the run)
  RD shipped   ReDrafter at the drafter's own tree (its ``decode.json``), batch 1 and 4
  RD 4x5       ReDrafter at W=4, L=5, the whole tree (no lookup beam), batch 1 and 4

and prints, per prompt, "same" or the first index where each run differs from the reference,
then the summary line. The default (non-invariant) model runs AR at batch 1 and 4 too, as the
control: its batch-4 differences are the batch-shape noise the invariant mode removes.

Cost: milliseconds per new token (wall time of a call, prefill included, compile excluded by an
untimed first call of every shape) of AR batch 1 and ReDrafter (shipped tree) batch 1, for the
default and the invariant model, interleaved prompt by prompt in the same run, and their ratio.
``--cost-only`` runs the timing alone (it wants a quiet machine; the identity runs do not).

The whole run takes an hour or more on a 2-core CPU. ``--state FILE`` keeps every finished run
and prompt there, and a run started again with the same settings goes on from them. Compiled
programs are dropped after each run, and in the cost's prompts once they hold half the memory
mappings (``jax.clear_caches``): each padded prompt length compiles its own programs, and
XLA:CPU maps each one's code into memory, so keeping a few hundred of them exhausts the
process's memory mappings (LLVM: "Cannot allocate memory").
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax

from redrafter_jax.helptext import show_defaults
from redrafter_jax.hostmem import memory_mappings


def parse_args(argv) -> argparse.Namespace:
  from redrafter_jax.bench.ar import DEFAULT_PROMPTS

  p = argparse.ArgumentParser(prog="python -m redrafter_jax.bench invariant",
                              description=__doc__.strip().splitlines()[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog="\n".join(__doc__.strip().splitlines()[2:]))
  show_defaults(p)
  p.add_argument("--prompts", type=pathlib.Path, default=DEFAULT_PROMPTS,
                 help="Spec-Bench jsonl ({'prompt': ...} per line)")
  p.add_argument("--num-prompts", type=int, default=40, help="prompts, spread over the file")
  p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
  p.add_argument("--model", default="smollm2-135m", help="known name, .gguf file or HF folder")
  p.add_argument("--drafter", default="shipped",
                 help="drafter folder, 'shipped' (checkpoints/) or 'random'")
  p.add_argument("--batch", type=int, default=4, help="the batched runs' batch size")
  only = p.add_mutually_exclusive_group()
  only.add_argument("--no-cost", action="store_true", help="skip the timing of both modes")
  only.add_argument("--cost-only", action="store_true",
                    help="only the timing of both modes (no identity runs)")
  p.add_argument("--out", type=pathlib.Path, default=None, help="also write the report here")
  p.add_argument("--state", type=pathlib.Path, default=None,
                 help="keep finished runs here and go on from them when started again "
                 "(e.g. runs/invariant-40x128.json)")
  o = p.parse_args(argv)
  for name in ("num_prompts", "max_new_tokens", "batch"):
    if getattr(o, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(o, name)}")
  return o


def trees(drafter_spec: str, max_new_tokens: int) -> dict:
  """The two ReDrafter settings: the drafter's own tree and W=4 L=5 whole, greedy."""
  from redrafter_jax.config import DecodeConfig

  if drafter_spec == "random":
    shipped = DecodeConfig(beam_width=4, beam_length=4, max_new_tokens=max_new_tokens)
  else:
    from redrafter_jax.weights.shipped import recommended_config, resolve_drafter

    shipped = recommended_config(resolve_drafter(drafter_spec), max_new_tokens=max_new_tokens)
  whole = DecodeConfig(beam_width=4, beam_length=5, max_new_tokens=max_new_tokens,
                       draft_vocab_size=shipped.draft_vocab_size)
  return {"RD shipped": shipped, "RD 4x5": whole}


class State:
  """Finished runs (``runs``: name -> tokens per prompt) and cost prompts (``costs``: one
  {method/mode: ms per token} per prompt), kept in ``path`` (None: in memory only) for the
  settings ``settings``; a file written for other settings is an error, not silently reused."""

  def __init__(self, path: pathlib.Path | None, settings: dict):
    self.path, self.settings = path, settings
    self.runs, self.costs = {}, []
    if path is not None and path.is_file():
      data = json.loads(path.read_text())
      if data.get("settings") != settings:
        from redrafter_jax.errors import UserError

        raise UserError(f"--state {path} holds a run with other settings "
                         f"({data.get('settings')}); remove it or name another file")
      self.runs, self.costs = data["runs"], data["costs"]
      print(f"going on from {path}: {len(self.runs)} run(s), {len(self.costs)} cost prompt(s)",
            file=sys.stderr, flush=True)

  def save(self) -> None:
    if self.path is not None:
      self.path.parent.mkdir(parents=True, exist_ok=True)
      tmp = self.path.with_suffix(".tmp")
      tmp.write_text(json.dumps({"settings": self.settings, "runs": self.runs,
                                 "costs": self.costs}))
      tmp.replace(self.path)

  def run(self, name: str, call, prompts: list, size: int) -> list[list[int]]:
    """``call`` on ``prompts`` in batches of ``size`` (or the kept result); its wall time goes
    to stderr."""
    if name not in self.runs:
      t0, out = time.perf_counter(), []
      for i in range(0, len(prompts), size):
        out += [list(map(int, row)) for row in call(prompts[i:i + size])]
      jax.clear_caches()
      print(f"{name}: {len(prompts)} prompts in {time.perf_counter() - t0:.0f} s",
            file=sys.stderr, flush=True)
      self.runs[name] = out
      self.save()
    return self.runs[name]


def first_difference(ref: list[int], other: list[int]) -> int | None:
  """The first index where ``other`` differs from ``ref`` (None: the same tokens)."""
  n = min(len(ref), len(other))
  t = next((i for i in range(n) if ref[i] != other[i]), n)
  return None if t == n and len(ref) == len(other) else t


def timed_per_token(call, prompts: list) -> float:
  """Milliseconds per new token of ``call([prompt])`` over the prompts, each called once
  untimed first (its compile) and once timed."""
  seconds, tokens = 0.0, 0
  for p in prompts:
    call([p])
    t = time.perf_counter()
    out = call([p])
    seconds += time.perf_counter() - t
    tokens += len(out[0])
  return 1e3 * seconds / max(tokens, 1)


def clear_when_crowded(share: float = 0.5) -> None:
  """Drop the compiled programs (``jax.clear_caches``) once they hold more than ``share`` of
  the process's memory mappings: prompts of one padded length share their programs, so the
  cost's prompts keep them until then rather than compiling each prompt's again."""
  held = memory_mappings()
  if held is None or held[0] > share * held[1]:
    jax.clear_caches()


def run(o) -> str:
  from redrafter_jax.bench._common import load
  from redrafter_jax.bench.ar import read_prompts
  from redrafter_jax.inference.ar import generate
  from redrafter_jax.inference.decode import ReDrafter
  from redrafter_jax.weights.tokenizer import encode

  inv = load(o.model, dtype="bfloat16", invariant=True, drafter=o.drafter)
  default = load(o.model, dtype="bfloat16", tokenizer=False)
  models = {"default": default.llm, "inv": inv.llm}
  drafter, tok = inv.drafter, inv.tokenizer
  prompts = [encode(tok, row["prompt"], chat=True)
             for row in read_prompts(o.prompts, o.num_prompts)]
  N = o.max_new_tokens
  ar = {mode: (lambda ps, m=m: generate(m, ps, max_new_tokens=N).tokens)
        for mode, m in models.items()}
  rd = {(mode, name): ReDrafter(m, drafter, c)
        for mode, m in models.items() for name, c in trees(o.drafter, N).items()}

  B = o.batch
  state = State(o.state, {"model": o.model, "drafter": o.drafter, "prompts": str(o.prompts),
                          "num_prompts": o.num_prompts, "max_new_tokens": N, "batch": B})
  if o.cost_only:
    return "\n".join([f"# Invariant mode's cost, {o.model}, bfloat16 activations and weights, "
                      f"greedy, {N} new tokens, {len(prompts)} prompts; drafter {o.drafter}",
                      "", *cost_table(cost(state, prompts, ar, rd))])
  runs = {"AR b1": state.run("invariant AR b1", ar["inv"], prompts, 1),
          f"AR b{B}": state.run(f"invariant AR b{B}", ar["inv"], prompts, B)}
  for name in trees(o.drafter, N):
    call = lambda ps, r=rd[("inv", name)]: r(ps).tokens
    runs[f"{name} b1"] = state.run(f"invariant {name} b1", call, prompts, 1)
    runs[f"{name} b{B}"] = state.run(f"invariant {name} b{B}", call, prompts, B)
  control = {"AR b1": state.run("default AR b1", ar["default"], prompts, 1),
             f"AR b{B}": state.run(f"default AR b{B}", ar["default"], prompts, B)}
  return report(o, prompts, runs, control, None if o.no_cost else cost(state, prompts, ar, rd))


def cost(state: State, prompts, ar, rd) -> dict:
  """ms per new token, per (method, mode): the mean over prompts, each prompt timing every
  method and mode in turn (interleaved, so that a change in the machine's load falls on all)."""
  calls = {("AR b1", mode): ar[mode] for mode in ("default", "inv")}
  calls.update({("RD shipped b1", mode): (lambda ps, r=rd[(mode, "RD shipped")]: r(ps).tokens)
                for mode in ("default", "inv")})
  for p in prompts[len(state.costs):]:
    state.costs.append({f"{m}|{mode}": timed_per_token(call, [p])
                        for (m, mode), call in calls.items()})
    clear_when_crowded()
    state.save()
  return {key: sum(c[f"{key[0]}|{key[1]}"] for c in state.costs) / len(state.costs)
          for key in calls}


def report(o, prompts, runs: dict, control: dict, costs: dict | None) -> str:
  ref = runs["AR b1"]
  keys = [k for k in runs if k != "AR b1"]
  ckey = f"AR b{o.batch}"
  head = ["prompt", "tokens"] + keys + [f"default {ckey}"]
  lines = [f"# Invariant mode, {o.model}, bfloat16 activations and weights, greedy, "
           f"{o.max_new_tokens} new tokens; drafter {o.drafter}", "",
           "Each run against AR batch 1 of the invariant model: `same`, or the first index "
           "(into the new tokens) where it differs. The last column is the default model's AR "
           f"batch {o.batch} against its own AR batch 1 (the control).", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  cells = lambda d: "same" if d is None else f"differs at {d}"
  for i, p in enumerate(prompts):
    row = [str(i), str(len(p))] + [cells(first_difference(ref[i], runs[k][i])) for k in keys]
    row.append(cells(first_difference(control["AR b1"][i], control[ckey][i])))
    lines.append("| " + " | ".join(row) + " |")
  n = len(prompts)
  same = {k: sum(first_difference(ref[i], runs[k][i]) is None for i in range(n)) for k in keys}
  all_same = sum(all(first_difference(ref[i], runs[k][i]) is None for k in keys)
                 for i in range(n))
  ctrl = sum(first_difference(control["AR b1"][i], control[ckey][i]) is None for i in range(n))
  lines += ["", f"Invariant: every run equals AR batch 1 on {all_same}/{n} prompts ("
            + ", ".join(f"{k} {v}/{n}" for k, v in same.items())
            + f"). Default control: AR b{o.batch} equals AR b1 on {ctrl}/{n}."]
  if costs:
    lines += ["", *cost_table(costs)]
  return "\n".join(lines)


def cost_table(costs: dict) -> list[str]:
  """``cost``'s means as a table: per method, both modes' ms per token and their ratio."""
  lines = ["| method | default ms/token | invariant ms/token | ratio |", "|---|---|---|---|"]
  for method in ("AR b1", "RD shipped b1"):
    d, v = costs[(method, "default")], costs[(method, "inv")]
    lines.append(f"| {method} | {d:.1f} | {v:.1f} | {v / d:.2f}x |")
  return lines


def main(argv=None) -> int:
  from redrafter_jax.bench._common import emit

  o = parse_args(argv)
  emit(run(o), o.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
