"""``python -m redrafter_jax.bench divergence``: where greedy outputs part from our AR's, and how
close the model's call was there.

Greedy ReDrafter must give our AR's tokens. With bfloat16 activations it does not always: where
the model's two best tokens nearly tie, any change in the order of the floating-point sums (a
tree forward instead of a one-token one, another batch shape, another cache size) may flip the
argmax. This report tells such flips from bugs. On the same chat-templated Spec-Bench prompts
(the first ``--per-category`` of each category, in file order), greedy, it runs

  reference   our AR at batch 1, at the prompt's cache size (the suite's: its need rounded up
              to 512 slots, or ``--cache-size``)
  ReDrafter   at each ``--beams`` tree, batch 1, the same cache size
  control 1   our AR at batch 4: the prompt in row 0, the next 3 prompts of the run (cycling)
              in rows 1-3; the table names them
  control 2   our AR at batch 1 with another cache size (the reference's + 512; where that
              passes the model's context, a smaller size that still fits)

The controls are AR against AR: they show how far the model's own numerics move with the batch
shape, the yardstick for ReDrafter's differences.

For each prompt and compared run: "same", or the first index t (0-based, into the new tokens)
where the outputs differ, the reference's and the other run's token there, and the float32
model's logit gap: the SAME weights with float32 activations, run on prompt + the reference's
first t tokens, logit[reference token] - logit[other token] at the last position (positive: the
float32 model sides with the reference), and the token the float32 model itself prefers (its
argmax). A small gap is a near-tie, where either token is the model's answer; a large one where
ReDrafter differs is a bug. Outputs that agree up to the shorter one's end differ at its length
(no gap there: one run has no token).

The summary line is ``ReDrafter differs on x/N; AR-vs-AR controls on y/N, z/N``: x counts the
prompts where ANY tree differs (with several trees, the next line gives each tree's count), y
the batch-4 control, z the cache-size control; each N counts the prompts that run was made on.

Output: the tables and the summary on stdout; with ``--out FOLDER``, ``divergence.json`` (every
output and every gap) and ``divergence.md`` there. ``suite`` runs the same controls and puts
this section in its ``results.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import sys
from typing import Sequence

from redrafter_jax.errors import UserError
from redrafter_jax.helptext import show_defaults

REFERENCE = "ar_greedy"  # the suite's key of our AR greedy at batch 1
CONTROL_BATCH, CONTROL_CACHE = "ar_batch4", "ar_other_cache"
CONTROLS = {CONTROL_BATCH: "our AR greedy, batch 4 (control)",
            CONTROL_CACHE: "our AR greedy, another cache size (control)"}
CONTROL_ROWS = 4
CACHE_DELTA = 512


class DivergenceError(UserError, ValueError):
  """Prompts that cannot be compared (none fits the cache)."""


# ---- comparing outputs -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Divergence:
  """Where two outputs first differ: ``index`` into the new tokens, and each one's token there
  (None: that output ended before it)."""

  index: int
  reference_token: int | None
  other_token: int | None


def compare(reference: Sequence[int], other: Sequence[int]) -> Divergence | None:
  """The first difference of ``other`` from ``reference`` (None: the same tokens). When one is a
  prefix of the other they differ at the shorter one's length."""
  n = min(len(reference), len(other))
  t = next((i for i in range(n) if reference[i] != other[i]), n)
  if t == n and len(reference) == len(other):
    return None
  at = lambda s: int(s[t]) if t < len(s) else None
  return Divergence(t, at(reference), at(other))


@dataclasses.dataclass(frozen=True)
class Gap:
  """The float32 model's view of a divergence: ``value`` = logit[a] - logit[b] at the last
  position (positive: it prefers a to b), and ``preferred``, its argmax over the vocabulary."""

  value: float
  preferred: int


@functools.lru_cache(maxsize=None)
def _last_logits_fn():
  import jax

  from redrafter_jax.inference.runtime import prefill

  @functools.partial(jax.jit, static_argnums=0)
  def last_logits(graphdef, state, tokens_BT, lengths_B):
    from flax import nnx

    model = nnx.merge(graphdef, state)
    cache = model.init_cache(tokens_BT.shape[0], tokens_BT.shape[1])
    return prefill(model, tokens_BT, lengths_B, cache)[0]

  return last_logits


def logit_gap(model_f32, prompt_ids: Sequence[int], prefix: Sequence[int], tok_a: int,
              tok_b: int) -> Gap:
  """``Gap`` of the float32-activation model on ``prompt_ids + prefix``: logit[tok_a] -
  logit[tok_b] at the last position. ``model_f32`` must compute in float32 (its weights may be
  bfloat16: the same weights as the run it judges)."""
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from redrafter_jax.inference.runtime import pack_prompts

  if jnp.dtype(model_f32.dtype) != jnp.float32:
    raise ValueError(f"logit_gap needs float32 activations, the model computes in "
                     f"{jnp.dtype(model_f32.dtype).name}")
  tokens_BT, lengths_B = pack_prompts([list(prompt_ids) + list(prefix)])
  graphdef, state = nnx.split(model_f32)
  logits_V = np.asarray(_last_logits_fn()(graphdef, state, tokens_BT, lengths_B)[0])
  return Gap(float(logits_V[tok_a]) - float(logits_V[tok_b]), int(np.argmax(logits_V)))


def gap_record(d: Divergence, gap: Gap, decode=None) -> dict:
  """The JSON form of a divergence and its gap (``decode``: token id -> text, for the table)."""
  rec = dict(index=d.index, reference_token=d.reference_token, other_token=d.other_token,
             gap=gap.value, float32_prefers=gap.preferred)
  if decode is not None:
    rec.update(reference_text=decode(d.reference_token), other_text=decode(d.other_token),
               float32_prefers_text=decode(gap.preferred))
  return rec


def _matches(rec: dict | None, d: Divergence) -> bool:
  return rec is not None and (rec.get("index"), rec.get("reference_token"),
                              rec.get("other_token")) == (d.index, d.reference_token,
                                                          d.other_token)


def missing_gaps(runs: dict, gaps: dict, keys: Sequence[str], reference: str = REFERENCE
                 ) -> list[tuple[str, str, Divergence]]:
  """``(pid, key, divergence)`` of each divergence of ``runs[pid][key]``'s ``output_ids`` from
  the reference's whose gap ``gaps[pid][key]`` lacks, or holds for other tokens (a run measured
  again). Drops the records of runs that no longer differ (or differ only in length)."""
  out = []
  for pid, recs in runs.items():
    if reference not in recs:
      continue
    ref = recs[reference]["output_ids"]
    for key in keys:
      if key not in recs:
        continue
      d = compare(ref, recs[key]["output_ids"])
      if d is None or d.reference_token is None or d.other_token is None:
        gaps.get(pid, {}).pop(key, None)
      elif not _matches(gaps.get(pid, {}).get(key), d):
        out.append((pid, key, d))
  return out


def fill_gaps(model_f32, prompt_ids: dict, runs: dict, gaps: dict, keys: Sequence[str], *,
              reference: str = REFERENCE, decode=None) -> int:
  """Computes into ``gaps[pid][key]`` every gap ``missing_gaps`` names (``prompt_ids[pid]``: the
  prompt's token ids); returns how many it computed."""
  todo = missing_gaps(runs, gaps, keys, reference)
  for pid, key, d in todo:
    ref = runs[pid][reference]["output_ids"]
    gap = logit_gap(model_f32, prompt_ids[pid], ref[:d.index], d.reference_token, d.other_token)
    gaps.setdefault(pid, {})[key] = gap_record(d, gap, decode)
  return len(todo)


# ---- the controls ----------------------------------------------------------------------------

def companions(pids: Sequence[str], pid: str, n: int = CONTROL_ROWS - 1) -> list[str]:
  """The prompts beside ``pid`` in its batch control: the next ``n`` of ``pids`` after it,
  cycling (itself again only when it is the only one)."""
  pids = list(pids)
  i = pids.index(pid)
  others = pids[i + 1:] + pids[:i] or [pid]
  return [others[j % len(others)] for j in range(n)]


def other_cache_size(size: int, need: int, limit: int, delta: int = CACHE_DELTA) -> int | None:
  """A cache size other than ``size`` that still holds ``need`` slots within ``limit``: ``size
  + delta``, else ``size - delta``, else ``need`` rounded up to 128, else ``need`` (None: no
  other size fits)."""
  for c in (size + delta, size - delta, -(-need // 128) * 128, need):
    if need <= c <= limit and c != size:
      return c
  return None


def run_controls(runner, prompts: dict, pid: str, cache_size: int) -> dict:
  """Our AR greedy on ``prompts[pid]`` at batch 4 (``companions`` in rows 1-3) and at another
  cache size, through the suite's ``Runner``: ``{control key: {output_ids, cache_size,
  [companions]}}`` (no cache-size control when no other size fits)."""
  from redrafter_jax.bench._methods import Method

  ar = Method(REFERENCE, "our AR greedy", "ar")
  mates = companions(list(prompts), pid)
  batch = [prompts[pid]] + [prompts[q] for q in mates]
  size = max(cache_size, runner.cache_size(max(len(p) for p in batch)) or cache_size)
  tokens, _ = runner.call(ar, batch, size, 0)
  out = {CONTROL_BATCH: dict(output_ids=tokens[0], cache_size=size, companions=mates)}
  other = other_cache_size(cache_size, runner.need(len(prompts[pid])), runner.limit)
  if other is not None:
    tokens, _ = runner.call(ar, [prompts[pid]], other, 0)
    out[CONTROL_CACHE] = dict(output_ids=tokens[0], cache_size=other)
  return out


# ---- the report ------------------------------------------------------------------------------

def _token(tok, text) -> str:
  if tok is None:
    return "(ended)"
  return f"{tok}" + ("" if text is None else " " + repr(text).replace("|", "\\|"))


def _note(rec: dict, ref_size) -> str:
  if "companions" in rec:
    return f"rows 1-3: {', '.join(rec['companions'])}; cache {rec['cache_size']}"
  return f"cache {rec.get('cache_size')} (reference {ref_size})"


def table(runs: dict, key: str, gaps: dict, prompts: dict, reference: str = REFERENCE
          ) -> list[str]:
  """One markdown table: each prompt where ``key`` and the reference ran."""
  control = key in CONTROLS
  head = ["prompt", "category", "first divergence", "reference token", "other token",
          "float32 gap (ref - other)", "float32 prefers"] + (["run"] if control else [])
  rows = []
  for pid, recs in runs.items():
    if key not in recs or reference not in recs:
      continue
    meta = prompts.get(pid, {})
    cells = [pid, str(meta.get("category", "?"))]
    d = compare(recs[reference]["output_ids"], recs[key]["output_ids"])
    g = gaps.get(pid, {}).get(key)
    g = g if d is not None and _matches(g, d) else None
    if d is None:
      cells += ["same", "", "", "", ""]
    else:
      g = g or {}
      pref = g.get("float32_prefers")
      side = ("reference" if pref == d.reference_token else "other" if pref == d.other_token
              else "neither: " + _token(pref, g.get("float32_prefers_text")))
      cells += [str(d.index), _token(d.reference_token, g.get("reference_text")),
                _token(d.other_token, g.get("other_text")),
                "n/a" if "gap" not in g else f"{g['gap']:+.3f}",
                "n/a" if pref is None else side]
    rows.append(cells + ([_note(recs[key], meta.get("cache_size"))] if control else []))
  align = ["---"] * 2 + ["---:"] * 3 + ["---:", "---"] + (["---"] if control else [])
  return (["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
          + ["| " + " | ".join(r) + " |" for r in rows] + [""])


def _count(runs: dict, keys: Sequence[str], reference: str) -> tuple[int, int]:
  """(prompts where any of ``keys`` differs from the reference, prompts where one ran)."""
  differ = total = 0
  for recs in runs.values():
    have = [k for k in keys if k in recs]
    if reference not in recs or not have:
      continue
    total += 1
    ref = recs[reference]["output_ids"]
    differ += any(compare(ref, recs[k]["output_ids"]) is not None for k in have)
  return differ, total


def summary(runs: dict, trees: Sequence[tuple[str, str]], reference: str = REFERENCE
            ) -> list[str]:
  """The summary line, and with several trees (``(key, label)`` each) a line of each one's."""
  x = _count(runs, [k for k, _ in trees], reference)
  y, z = (_count(runs, [k], reference) for k in (CONTROL_BATCH, CONTROL_CACHE))
  lines = [f"ReDrafter differs on {x[0]}/{x[1]}; AR-vs-AR controls on {y[0]}/{y[1]}, "
           f"{z[0]}/{z[1]}"]
  if len(trees) > 1:
    lines.append("Per tree: " + "; ".join(
        f"{label} {'{}/{}'.format(*_count(runs, [k], reference))}" for k, label in trees) + ".")
  return lines


def report(runs: dict, trees: Sequence[tuple[str, str]], gaps: dict, prompts: dict,
           reference: str = REFERENCE) -> list[str]:
  """Markdown lines: a table per greedy ReDrafter tree (``(key, label)`` each) and per control
  present, then the summary. ``runs[pid][key]`` holds ``output_ids`` (and a control's
  ``cache_size`` / ``companions``); ``gaps[pid][key]`` a ``gap_record``; ``prompts[pid]`` the
  prompt's ``category`` and ``cache_size``."""
  lines = []
  present = {k for recs in runs.values() for k in recs}
  for key, label in list(trees) + [(k, v) for k, v in CONTROLS.items() if k in present]:
    n = _count(runs, [key], reference)
    lines += [f"### {label} vs our AR greedy (differs on {n[0]}/{n[1]})", ""]
    lines += table(runs, key, gaps, prompts, reference)
  return lines + summary(runs, trees, reference) + [""]


# ---- the command -----------------------------------------------------------------------------

def parse_args(argv) -> argparse.Namespace:
  from redrafter_jax.bench.ar import DEFAULT_PROMPTS
  from redrafter_jax.bench.decode import Beams

  p = argparse.ArgumentParser(prog="python -m redrafter_jax.bench divergence",
                              description=__doc__.strip().splitlines()[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog="\n".join(__doc__.strip().splitlines()[2:]))
  show_defaults(p)
  p.add_argument("--prompts", type=pathlib.Path, default=DEFAULT_PROMPTS,
                 help="Spec-Bench jsonl ({id, source, category, prompt} per line)")
  p.add_argument("--per-category", type=int, default=1, help="first N prompts of each category")
  p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt")
  p.add_argument("--model", default="smollm2-135m", help="known name, .gguf file or HF folder")
  p.add_argument("--drafter", default="shipped",
                 help="drafter folder, 'shipped' (checkpoints/) or 'random'")
  p.add_argument("--exit-dim", type=int, default=256, help="exit_dim of a random drafter")
  p.add_argument("--draft-vocab", type=int, default=None,
                 help="draft vocabulary size (0 = all; default: the drafter's decode.json, "
                 "else all)")
  p.add_argument("--beams", default="1x4+3/5,4x5", help="greedy ReDrafter trees WxL[+n][+aK][/N]")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                 help="the LLM's activations and the drafter's dtype")
  p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="bfloat16",
                 help="the LLM's weights (the float32 judge uses the same)")
  p.add_argument("--attention", choices=("xla", "cudnn", "pallas"), default="xla",
                 help="the runs' attention (the float32 judge uses xla)")
  p.add_argument("--cache-size", type=int, default=None,
                 help="one static cache size for every prompt (default: each prompt's need "
                 "rounded up to 512)")
  p.add_argument("--out", type=pathlib.Path, default=None,
                 help="folder for divergence.json and divergence.md")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  o = p.parse_args(argv)
  try:
    o.beams = Beams.parse_list(o.beams)
  except ValueError as e:
    p.error(f"--beams: {e}")
  o.main_beams = o.beams[0]  # what the suite's Runner reads (its scratch slots)
  o.prompt_lookup_tokens = 0
  for name in ("per_category", "max_new_tokens", "exit_dim"):
    if getattr(o, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(o, name)}")
  if o.cache_size is not None and o.cache_size < 1:
    p.error(f"--cache-size must be >= 1, got {o.cache_size}")
  from redrafter_jax.bench._common import draft_vocab_arg

  try:
    o.draft_vocab = draft_vocab_arg(o.drafter, o.draft_vocab)
  except FileNotFoundError as e:
    p.error(str(e))
  return o


def judge_model(llm, model: str, param_dtype: str):
  """The float32-activation model with ``llm``'s weights (``llm`` itself when it is one)."""
  import jax.numpy as jnp

  from redrafter_jax.bench._common import load

  if jnp.dtype(llm.dtype) == jnp.float32 and llm.backend == "xla":
    return llm
  return load(model, param_dtype=param_dtype, tokenizer=False).llm


def run(o) -> dict:
  """Every run and gap, as the JSON ``divergence.json`` holds."""
  from tqdm import tqdm

  from redrafter_jax.bench._common import load
  from redrafter_jax.bench._runner import Runner
  from redrafter_jax.bench._methods import Method, select_prompts
  from redrafter_jax.weights.tokenizer import encode

  rows = select_prompts(o.prompts, o.per_category)
  models = load(o.model, dtype=o.dtype, param_dtype=o.param_dtype, backend=o.attention,
                drafter=o.drafter, exit_dim=o.exit_dim)
  llm, drafter, tok = models.llm, models.drafter, models.tokenizer
  runner = Runner(o, llm, drafter, tok, None)
  prompts, meta = {}, {}
  for row in rows:
    ids = encode(tok, row["prompt"], chat=True)
    size = runner.cache_size(len(ids))
    if size is None:
      print(f"skipping prompt {row['id']}: {len(ids)} tokens need {runner.need(len(ids))} "
            f"cache slots, more than {o.cache_size or runner.limit}", file=sys.stderr)
      continue
    prompts[str(row["id"])] = ids
    meta[str(row["id"])] = dict(category=row["category"], prompt_tokens=len(ids),
                                cache_size=size)
  if not prompts:
    raise DivergenceError(f"{o.prompts}: no prompt fits the cache")
  methods = [Method(REFERENCE, "our AR greedy", "ar")] + [Method.redrafter(b) for b in o.beams]
  runs = {}
  for pid in tqdm(prompts, disable=o.no_progress, unit="prompt"):
    size = meta[pid]["cache_size"]
    runs[pid] = {m.key: dict(output_ids=runner.call(m, [prompts[pid]], size, 0)[0][0],
                             cache_size=size) for m in methods}
    runs[pid].update(run_controls(runner, prompts, pid, size))
  trees = [(m.key, m.label) for m in methods[1:]]
  gaps = {}
  fill_gaps(judge_model(llm, o.model, o.param_dtype), prompts, runs, gaps,
            [k for k, _ in trees] + list(CONTROLS), decode=lambda t: tok.decode([t]))
  return dict(settings=dict(model=str(o.model), drafter=str(o.drafter), dtype=o.dtype,
                            param_dtype=o.param_dtype, attention=o.attention,
                            max_new_tokens=o.max_new_tokens, draft_vocab=o.draft_vocab,
                            cache_size=o.cache_size, beams=[b.text for b in o.beams]),
              prompts=meta, trees=[list(t) for t in trees], runs=runs, gaps=gaps,
              summary=summary(runs, trees)[0])


def render(data: dict) -> str:
  s = data["settings"]
  head = ["# Greedy divergence from our AR greedy (batch 1)", "",
          f"Model {s['model']} ({s['dtype']} activations, {s['param_dtype']} weights, attention "
          f"{s['attention']}); drafter {s['drafter']}; up to {s['max_new_tokens']} new tokens; "
          f"{len(data['prompts'])} Spec-Bench prompts. Gaps: the same weights with float32 "
          "activations, on the prompt + the common prefix.", ""]
  return "\n".join(head + report(data["runs"], [tuple(t) for t in data["trees"]], data["gaps"],
                                 data["prompts"]))


def main(argv=None) -> int:
  from redrafter_jax.bench._methods import SuiteError
  from redrafter_jax.errors import user_errors

  o = parse_args(argv)
  try:
    data = run(o)
  except (SuiteError, *user_errors()) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  md = render(data)
  if o.out:
    o.out.mkdir(parents=True, exist_ok=True)
    (o.out / "divergence.json").write_text(json.dumps(data, indent=1))
    (o.out / "divergence.md").write_text(md)
  print(md)
  return 0


if __name__ == "__main__":
  sys.exit(main())
