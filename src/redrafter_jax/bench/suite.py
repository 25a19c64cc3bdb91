"""``python -m redrafter_jax.bench suite``: ReDrafter against its peers on Spec-Bench, in one run.

On the same prompts, machine and run, INTERLEAVED prompt by prompt (every method runs on a
prompt before the next prompt starts, so drift in machine load hits all methods alike):

  our AR         ``generate``: greedy, and sampled at each ``--temperatures`` value; with
                 ``--param-dtype bfloat16`` also greedy with float32 weights (the precision
                 the other methods would otherwise run in)
  ReDrafter      ``decode``: greedy at each ``--beams`` (W, L; ``WxL+N`` adds the context-lookup
                 beam); exact sampling at each temperature and typical acceptance (lossy) at
                 ``--typical-temperature``, at ``--main-beams``
  transformers   PyTorch greedy ``generate`` on the same GGUF, and its prompt-lookup assisted
                 generation (the peers a user would try first on this model); on a CPU, where it
                 runs in float32, also greedy in bfloat16 (what a user tries to make it faster)

Prompts: the first ``--per-category`` prompts of each category in file order (a fixed subset),
chat-templated. Every method stops at the model's stop tokens or after ``--max-new-tokens``;
tokens/s is new tokens over the wall time of the whole call (prefill included). A call during
which JAX compiled anything is timed again, so compilation never counts. Each prompt gets one
static cache size (its need rounded up to 512 slots) shared by all our methods, which keeps
recompilation rare; ``--cache-size N`` gives every method, prompt and batch the one size N (one
compiled program per method and padded prompt length, prompts being padded to a multiple of 64
tokens; a prompt that does not fit N is skipped).
Then the greedy-divergence controls (``bench.divergence``): per prompt, our AR greedy at batch 4
and at another cache size, untimed, and the float32 model's logit gap wherever a greedy
ReDrafter or a control parts from our AR greedy. Then, per greedy setting: the draft / verify /
accept+commit split of one step (``bench.decode.step_split``); and with ``--batch-sizes``
(default with ``--gpu``) our AR and ReDrafter at batch sizes 1..16 (per-request and total
tokens/s).

Output: ``<out>/<machine>/<date>/`` (``-quick`` appended for ``--quick``; an ``--out`` folder that
already holds ``measurements.json`` is used as is): ``measurements.json`` (every measurement;
rewritten atomically after each one; re-running skips what it holds), ``results.md`` and PNG
plots, both built from the JSON alone (``python -m redrafter_jax.bench report FOLDER`` rebuilds
them).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pathlib
import platform
import re
import sys
import zlib

from redrafter_jax.bench._runner import (Runner, adds_fp32_ar, adds_hf_bf16, environment,
                                         load_models)
from redrafter_jax.bench.ar import DEFAULT_PROMPTS, load_average
from redrafter_jax.bench.decode import Beams
from redrafter_jax.bench._methods import Method, SuiteError, select_prompts
from redrafter_jax.bench._measurements import FP32_AR, HF_BF16
from redrafter_jax.helptext import show_defaults

# CPU defaults: a full run takes well under an hour on 2 idle cores (13 prompts x 16 methods;
# --per-category 2 roughly doubles the measuring). The drafter-only trees are the training
# issue's (W, L) grid; the context-lookup trees with a token budget are the ones that pay on a
# CPU, where the verify forward grows with the tree (W=16 L=5, 65 tokens, costs several AR
# steps); the GPU preset sweeps wide trees. 1x4+3/5 is the shipped drafter's own setting (its
# decode.json).
FULL = dict(per_category=1, max_new_tokens=128, beams="1x4,4x4,8x5,16x5,1x4+3/5,2x4+3/7,4x4+3/9",
            main_beams="4x4+3/9", temperatures="0.7,1.0", split_repeat=10)
GPU = dict(beams="1x4,4x4,8x4,4x5,8x5,16x5", main_beams="8x5", batch_sizes="1,2,4,8,16")
# --quick: the two shortest of the first prompts of each category, few tokens, fewer settings.
QUICK = dict(per_category=1, max_new_tokens=16, beams="1x4+3,4x5", main_beams="4x5",
             temperatures="0.7", split_repeat=2)
QUICK_PROMPTS = 2


def parse_args(argv) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m redrafter_jax.bench suite",
                              description=__doc__.strip().splitlines()[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog="\n".join(__doc__.strip().splitlines()[2:]))
  show_defaults(p)
  p.add_argument("--prompts", type=pathlib.Path, default=DEFAULT_PROMPTS,
                 help="Spec-Bench jsonl ({id, source, category, prompt} per line)")
  p.add_argument("--model", default="smollm2-135m", help="known name, .gguf file or HF folder")
  p.add_argument("--drafter", default="random",
                 help="drafter folder, 'shipped' (checkpoints/), or 'random' (untrained: times "
                 "the machinery only)")
  p.add_argument("--exit-dim", type=int, default=256, help="exit_dim of a random drafter")
  p.add_argument("--per-category", type=int, help=f"first N prompts of each category "
                 f"(default {FULL['per_category']})")
  p.add_argument("--skip-per-category", type=int, default=0,
                 help="leave out the first N prompts of each category (a subset disjoint from "
                 "the one settings were chosen on)")
  p.add_argument("--max-new-tokens", type=int, help=f"default {FULL['max_new_tokens']}")
  p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"), help="results root")
  p.add_argument("--beams", help=f"greedy ReDrafter settings WxL, or WxL+n with the "
                 f"context-lookup beam (n-grams up to n), each optionally /N with a tree token "
                 f"budget N (default {FULL['beams']})")
  p.add_argument("--main-beams", help="WxL[+n][+aK][/N] of the sampling runs and the batch sweep "
                 f"(default {FULL['main_beams']})")
  p.add_argument("--temperatures", help=f"exact-sampling temperatures (default "
                 f"{FULL['temperatures']})")
  p.add_argument("--typical-temperature", type=float, default=0.7,
                 help="temperature of the typical-acceptance run (lossy); 0 skips it")
  p.add_argument("--draft-vocab", type=int, default=None,
                 help="draft vocabulary size (0 = all; default: the drafter's decode.json, else all)")
  p.add_argument("--prompt-lookup-tokens", type=int, default=10,
                 help="transformers' prompt_lookup_num_tokens")
  p.add_argument("--no-transformers", action="store_true", help="skip the transformers peers")
  p.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1,
                 help="transformers' CPU threads (default: the core count)")
  p.add_argument("--batch-sizes", help=f"batch sweep, e.g. 1,2,4 (default: none; "
                 f"{GPU['batch_sizes']} with --gpu)")
  p.add_argument("--split-repeat", type=int, help="timed repeats of each step part")
  p.add_argument("--cache-size", type=int, default=None,
                 help="one static cache size for every method, prompt and batch (default: each "
                 "prompt's need rounded up to 512); prompts that do not fit are skipped")
  p.add_argument("--prompt-multiple", type=int, default=64,
                 help="pad prompts to a multiple of this many tokens: each padded length is its "
                 "own prefill program, so a larger multiple compiles fewer (default %(default)s)")
  p.add_argument("--seed", type=int, default=0, help="base seed of the sampled runs")
  p.add_argument("--quick", action="store_true", help="~2-minute smoke run")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), help="the LLM's activations and "
                 "the drafter's dtype: default float32 (bf16 --gpu)")
  p.add_argument("--param-dtype", choices=("float32", "bfloat16", "auto"),
                 help="the LLM's weights (default: --dtype); bfloat16 with float32 activations "
                 "is the fast setting on CPUs with bf16 instructions, and adds our float32 AR as "
                 "a baseline; auto: linear.preferred_param_dtype() with float32 activations, "
                 "else --dtype")
  p.add_argument("--attention", choices=("xla", "cudnn", "pallas"),
                 help="default xla (cudnn with --gpu)")
  p.add_argument("--gpu", action="store_true", help="NVIDIA GPU preset: bf16, cudnn attention, "
                 f"beams {GPU['beams']}, main beams {GPU['main_beams']}, batch sizes "
                 f"{GPU['batch_sizes']}; fails without a GPU")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  o = p.parse_args(argv)
  o.argv = list(sys.argv[1:] if argv is None else argv)
  defaults = {**FULL, **(GPU if o.gpu else {}), **(QUICK if o.quick else {}),
              **({"batch_sizes": "1,4"} if o.gpu and o.quick else {})}
  for name, value in defaults.items():
    if getattr(o, name) is None:
      setattr(o, name, value)
  o.dtype = o.dtype or ("bfloat16" if o.gpu else "float32")
  from redrafter_jax.weights.param_dtype import weights_dtype

  o.param_dtype = weights_dtype(o.param_dtype, dtype=o.dtype)
  o.attention = o.attention or ("cudnn" if o.gpu else "xla")
  o.beams = parse_beams(p, "--beams", o.beams)
  o.main_beams = parse_beams(p, "--main-beams", o.main_beams)[0]
  try:
    o.temperatures = [float(t) for t in o.temperatures.split(",") if t.strip()]
    o.batch_sizes = [int(b) for b in (o.batch_sizes or "").split(",") if b.strip()]
  except ValueError as e:
    p.error(f"--temperatures / --batch-sizes: {e}")
  if any(t <= 0 for t in o.temperatures) or o.typical_temperature < 0:
    p.error("sampling temperatures must be > 0 (greedy runs always happen)")
  for name in ("per_category", "max_new_tokens", "split_repeat", "prompt_lookup_tokens",
               "torch_threads"):
    if getattr(o, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(o, name)}")
  if o.cache_size is not None and o.cache_size < 1:
    p.error(f"--cache-size must be >= 1, got {o.cache_size}")
  if o.prompt_multiple < 1:
    p.error(f"--prompt-multiple must be >= 1, got {o.prompt_multiple}")
  if o.skip_per_category < 0:
    p.error(f"--skip-per-category must be >= 0, got {o.skip_per_category}")
  if any(b < 1 for b in o.batch_sizes):
    p.error(f"--batch-sizes must be >= 1, got {o.batch_sizes}")
  from redrafter_jax.bench._common import draft_vocab_arg

  try:
    o.draft_vocab = draft_vocab_arg(o.drafter, o.draft_vocab)
  except FileNotFoundError as e:
    p.error(str(e))
  return o


def parse_beams(p, flag: str, text: str) -> list[Beams]:
  try:
    return Beams.parse_list(text)
  except ValueError as e:
    p.error(f"{flag}: {e}")


def build_methods(o) -> list[Method]:
  """Every measured method, in the order they run on each prompt."""
  fmt = lambda t: f"{t:g}"
  main = o.main_beams
  sampled = sorted(set(o.temperatures) | ({o.typical_temperature} - {0.0}))
  out = [Method("ar_greedy", "our AR greedy", "ar")]
  if adds_fp32_ar(o):
    out.append(Method(FP32_AR, "our AR greedy, float32 weights", "ar", param_dtype="float32"))
  if not o.no_transformers:
    out.append(Method("transformers_greedy", "transformers greedy", "transformers"))
  if adds_hf_bf16(o):
    out.append(Method(HF_BF16, "transformers greedy, bfloat16", "transformers",
                      param_dtype="bfloat16"))
  out += [Method.redrafter(b) for b in o.beams]
  if not o.no_transformers:
    n = o.prompt_lookup_tokens
    out.append(Method(f"prompt_lookup_{n}", f"transformers prompt lookup ({n})", "prompt_lookup"))
  for t in sampled:
    ref = f"ar_T{fmt(t)}"
    out.append(Method(ref, f"our AR T={fmt(t)}", "ar", t, reference=ref))
    if t in o.temperatures:
      out.append(Method.redrafter(main, f"exact_T{fmt(t)}_", f"exact T={fmt(t)} ", t, "exact",
                                  ref))
    if t == o.typical_temperature:
      m = Method.redrafter(main, f"typical_T{fmt(t)}_", f"typical T={fmt(t)} ", t, "typical",
                           ref)
      out.append(dataclasses.replace(m, label=m.label + ", LOSSY"))
  return out


def machine_slug(gpu: bool) -> str:
  import jax

  name = (jax.devices()[0].device_kind if gpu else
          f"{platform.system()}-{platform.machine()}-{os.cpu_count()}cpu")
  return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def run_folder(out: pathlib.Path, machine: str, quick: bool) -> pathlib.Path:
  if (out / "measurements.json").is_file():
    return out
  return out / machine / (datetime.date.today().isoformat() + ("-quick" if quick else ""))


def settings_of(o) -> dict:
  """What measurements depend on; a resumed run must match it exactly."""
  from redrafter_jax.weights import shipped

  # The drafter's fingerprint, not just its path: a retrained drafter at the same path must not
  # resume (and mix with) measurements of the old one.
  return dict(model=str(o.model), drafter=str(o.drafter),
              drafter_sha256=(None if o.drafter == "random" else
                              shipped.fingerprint(shipped.resolve_drafter(o.drafter))),
              exit_dim=o.exit_dim if o.drafter == "random" else None,
              dtype=o.dtype, param_dtype=o.param_dtype, attention=o.attention,
              max_new_tokens=o.max_new_tokens, draft_vocab=o.draft_vocab,
              prompt_lookup_tokens=o.prompt_lookup_tokens, seed=o.seed,
              torch_threads=None if o.no_transformers or o.gpu else o.torch_threads,
              # only when set, so folders from before the option still resume
              **({"cache_size": o.cache_size} if o.cache_size is not None else {}),
              **({"prompt_multiple": o.prompt_multiple} if o.prompt_multiple != 64 else {}))


def run(o) -> pathlib.Path:
  """Measure everything missing from the out folder, then write the report; returns the folder."""
  from tqdm import tqdm

  from redrafter_jax.bench import report
  from redrafter_jax.bench.decode import step_split
  from redrafter_jax.bench._measurements import Store
  from redrafter_jax.weights.tokenizer import encode

  if o.gpu:
    import jax

    if jax.default_backend() != "gpu":
      raise SuiteError(f"--gpu needs an NVIDIA GPU visible to JAX, but JAX runs on "
                       f"{jax.default_backend()!r} (install redrafter_jax[gpu] on a GPU machine, "
                       "or drop --gpu)")
  rows = select_prompts(o.prompts, o.per_category, o.skip_per_category)
  folder = run_folder(o.out, machine_slug(o.gpu), o.quick)
  store = Store(folder / "measurements.json", settings_of(o))
  llm, llm_fp32, drafter, tok, hf, hf_bf16, note = load_models(o)
  runner = Runner(o, llm, drafter, tok, hf, llm_fp32, hf_bf16)
  store.data["sessions"].append(dict(environment(o, hf), note=note))
  prompts = {}
  for row in rows:
    ids = encode(tok, row["prompt"], chat=True)
    size = runner.cache_size(len(ids))
    if size is None:
      where = (f"--cache-size {o.cache_size} ({runner.need(len(ids))} slots needed)"
               if o.cache_size is not None else "the context")
      print(f"skipping prompt {row['id']}: {len(ids)} tokens do not fit {where}",
            file=sys.stderr)
      continue
    prompts[str(row["id"])] = (row, ids, size)
  if o.quick:
    keep = sorted(prompts, key=lambda k: len(prompts[k][1]))[:QUICK_PROMPTS]
    prompts = {k: v for k, v in prompts.items() if k in keep}
  if not prompts:
    raise SuiteError(f"{o.prompts}: no prompt fits the model's context")
  methods = build_methods(o)
  greedy = [m for m in methods if m.kind == "redrafter" and m.temperature == 0]
  batch_methods = [methods[0], Method.redrafter(o.main_beams)]
  for m in methods + batch_methods:
    store.data["methods"][m.key] = dataclasses.asdict(m)
  for pid, (row, ids, size) in prompts.items():
    store.data["prompts"][pid] = dict(category=row["category"], prompt_tokens=len(ids),
                                      cache_size=size)
  store.save()

  bar = tqdm(total=len(prompts) * (len(methods) + 1) + len(greedy)
             + len(o.batch_sizes) * len(batch_methods), disable=o.no_progress, unit="run")
  for pid, (row, ids, size) in prompts.items():
    seed = o.seed + zlib.crc32(pid.encode()) % 2**30
    for m in methods:
      bar.set_description(f"{pid} {m.key}")
      if not store.has("runs", pid, m.key):
        rec = runner.measure(m, [ids], size, seed)
        store.put("runs", pid, m.key, value=dict(category=row["category"], **rec))
      bar.update()
  divergence_step(o, runner, store, prompts, greedy, tok, bar)
  first = next(iter(prompts.values()))[1]
  for m in greedy:
    bar.set_description(f"step split {m.key}")
    if not store.has("step_split", m.key):
      cfg = m.beams.config(max_new_tokens=o.max_new_tokens, draft_vocab_size=o.draft_vocab)
      store.put("step_split", m.key, value=dict(
          step_split(llm, runner.drafter, first, cfg, o.split_repeat), prompt_tokens=len(first),
          tree_tokens=cfg.num_tree_tokens))
    bar.update()
  batch_sweep(o, runner, store, [ids for _, ids, _ in prompts.values()], batch_methods, bar)
  bar.close()
  store.data["sessions"][-1]["load_average_end"] = load_average()
  store.save()
  report.write(folder)
  return folder


def divergence_step(o, runner: Runner, store, prompts: dict, greedy: list[Method], tok,
                    bar) -> None:
  """What results.md's divergence section needs beyond the runs: per prompt, our AR greedy at
  batch 4 and at another cache size (``divergence.run_controls``), then the float32 model's
  logit gap at every divergence of a greedy ReDrafter or a control from our AR greedy (the
  float32 model loaded only when a gap is missing)."""
  from redrafter_jax.bench import divergence as div

  section = store.data.setdefault("divergence", dict(controls={}, gaps={}))
  ids = {pid: p[1] for pid, p in prompts.items()}
  for pid, (_, _, size) in prompts.items():
    bar.set_description(f"{pid} divergence controls")
    if not store.has("divergence", "controls", pid):
      store.put("divergence", "controls", pid, value=div.run_controls(runner, ids, pid, size))
    bar.update()
  keys = [m.key for m in greedy] + list(div.CONTROLS)
  runs = {pid: {**{k: r for k, r in store.data["runs"].get(pid, {}).items()
                   if k in keys or k == div.REFERENCE}, **section["controls"].get(pid, {})}
          for pid in prompts}
  if div.missing_gaps(runs, section["gaps"], keys):
    bar.set_description("float32 logit gaps")
    judge = div.judge_model(runner.llm, o.model, o.param_dtype)
    div.fill_gaps(judge, ids, runs, section["gaps"], keys, decode=lambda t: tok.decode([t]))
  store.save()


def batch_sweep(o, runner: Runner, store, prompts: list[list[int]], methods, bar) -> None:
  """Our AR and ReDrafter at each batch size, on the first B prompts (cycled when too few)."""
  for B in o.batch_sizes:
    batch = [prompts[i % len(prompts)] for i in range(B)]
    size = runner.cache_size(max(len(p) for p in batch))
    for m in methods:
      bar.set_description(f"batch {B} {m.key}")
      if not store.has("batch", str(B), m.key):
        rec = runner.measure(m, batch, size, o.seed, batch=True)
        store.put("batch", str(B), m.key, value=rec)
      bar.update()


def main(argv=None) -> int:
  from redrafter_jax.bench._measurements import ResultsError
  from redrafter_jax.errors import user_errors

  o = parse_args(argv)
  try:
    folder = run(o)
  except (SuiteError, ResultsError, *user_errors()) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print((folder / "results.md").read_text())
  print(f"results: {folder}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
