"""``redrafter-jax tune-tree``: measure a drafter's tokens/step per candidate tree (once per
drafter, written beside its weights as ``acceptance.json``), then time the candidates on this
device and print the tree the demo and the server will pick here (``inference.tree_choice``).

Calibration prompts must not be the ones results are reported on: by default they are requests
of the prompt mix (which excludes Spec-Bench) that have no teacher answer in the data folders
named by ``--held-out-from``, i.e. that the drafter never trained on, taken round-robin over
the mix's categories.
"""

from __future__ import annotations

import collections
import datetime
import pathlib

HELP = "measure a drafter's tokens/step per tree and pick the tree for this device"
DEFAULT_PROMPTS = "data/prompts/mix-v1.jsonl.gz"


def add_arguments(p) -> None:
  from redrafter_jax.commands import show_defaults

  show_defaults(p)
  p.add_argument("--drafter", default="shipped", help="drafter folder (default: the shipped one)")
  p.add_argument("--model", default="smollm2-135m",
                 help="the base LLM the drafter belongs to (a known name or a path)")
  p.add_argument("--prompts", default=None,
                 help="calibration prompts (JSON lines with 'prompt', optional 'category', 'id'; "
                 f"default: {DEFAULT_PROMPTS})")
  p.add_argument("--held-out-from", action="append", default=None, metavar="TEACHER_DIR",
                 help="skip prompts whose id has an answer in this teacher data folder "
                 "(repeatable; default: data/teacher/mix-v1 when it exists)")
  p.add_argument("--num-prompts", type=int, default=48, help="calibration prompts decoded")
  p.add_argument("--max-new-tokens", type=int, default=96, help="tokens per calibration prompt")
  p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
  p.add_argument("--candidates", default=None,
                 help="trees to measure, WxL[+n][+aK][/N] comma-separated (default: "
                 "tree_choice.DEFAULT_CANDIDATES, fifteen trees from 1x2+3/3 to 4x4+3+a4/14)")
  p.add_argument("--param-dtype", choices=("float32", "bfloat16", "auto"), default=None,
                 help="the LLM's weights (default: the drafter's own setting)")
  p.add_argument("--time-only", action="store_true",
                 help="keep the drafter's acceptance.json; only time the trees on this device")
  p.add_argument("--add", action="store_true",
                 help="measure only --candidates and add them to the drafter's acceptance.json "
                 "(which must have been measured with the same prompts and settings)")


def calibration_prompts(path, held_out_from, num: int) -> list:
  """``num`` prompts of ``path`` with no answer in the ``held_out_from`` folders, taken
  round-robin over categories (each category in file order)."""
  from redrafter_jax.training import data as data_lib
  from redrafter_jax.training.distill import read_prompts

  seen = set()
  for folder in held_out_from:
    for shard in sorted(pathlib.Path(folder).glob("shard-*.npz")):
      seen.update(r["id"] for r in data_lib.read_shard(shard))
  by_category = collections.defaultdict(list)
  for prompt in read_prompts(path):
    if prompt.id not in seen:
      by_category[prompt.category].append(prompt)
  out, queues = [], [collections.deque(v) for _, v in sorted(by_category.items())]
  while len(out) < num and any(queues):
    for q in queues:
      if q and len(out) < num:
        out.append(q.popleft())
  return out


def run(args) -> int:
  from redrafter_jax.config import ConfigError
  from redrafter_jax.inference import tree_choice
  from redrafter_jax.weights.base_model import load_base_model, load_base_tokenizer
  from redrafter_jax.weights.drafter_io import load_drafter
  from redrafter_jax.weights.param_dtype import weights_dtype
  from redrafter_jax.weights.shipped import decode_defaults, resolve_drafter
  from redrafter_jax.weights.tokenizer import encode, stop_token_ids

  try:
    candidates = tree_choice.Beams.parse_list(args.candidates
                                              or tree_choice.DEFAULT_CANDIDATES)
  except ValueError as e:
    raise ConfigError(f"--candidates: {e}") from None
  path = resolve_drafter(args.drafter)
  if args.time_only and (args.prompts or args.held_out_from or args.add):
    raise ConfigError("--time-only keeps the drafter's acceptance.json and reads no calibration "
                      "prompts: drop --prompts/--held-out-from/--add, or drop --time-only")
  if args.add and not args.candidates:
    raise ConfigError("--add measures the trees named by --candidates")
  if args.add and tree_choice.read_acceptance(path) is None:
    raise ConfigError(f"--add: {path} has no {tree_choice.ACCEPTANCE_FILE}; measure the whole "
                      "table first (without --add)")
  draft_vocab = int(decode_defaults(path).get("draft_vocab_size", 0))
  param_dtype = weights_dtype(args.param_dtype, drafter=path)
  llm, _ = load_base_model(args.model, param_dtype=param_dtype)
  drafter = load_drafter(path)
  if not args.time_only:
    held = args.held_out_from
    if held is None:
      held = [d for d in ("data/teacher/mix-v1",) if pathlib.Path(d).is_dir()]
    prompts_path = args.prompts or DEFAULT_PROMPTS
    prompts = calibration_prompts(prompts_path, held, args.num_prompts)
    tok = load_base_tokenizer(args.model)
    ids = [encode(tok, p.text, chat=True) for p in prompts]
    print(f"{len(ids)} calibration prompts from {prompts_path} "
          f"({dict(collections.Counter(p.category for p in prompts))}), "
          f"not answered in {held or 'no folder'}; {param_dtype} weights", flush=True)
    table = tree_choice.measure_acceptance(
        llm, drafter, ids, candidates, max_new_tokens=args.max_new_tokens,
        draft_vocab_size=draft_vocab, batch_size=args.batch_size, stop_ids=stop_token_ids(tok),
        on_result=lambda k, r: print(f"  {k:<12} {r['tokens_per_step']:.3f} tokens/step "
                                     f"({r['tokens']} tokens / {r['steps']} steps)", flush=True))
    measured_with = dict(
        prompts=str(prompts_path), held_out_from=held, num_prompts=len(ids),
        ids=[p.id for p in prompts], max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size, param_dtype=param_dtype, decoding="greedy",
        date=datetime.date.today().isoformat(), command="redrafter-jax tune-tree")
    if args.add:
      out = tree_choice.add_acceptance(path, table, measured_with)
    else:
      out = tree_choice.write_acceptance(path, table, measured_with)
    print(f"wrote {out}")
  choice = tree_choice.tuned(path, llm, drafter, draft_vocab_size=draft_vocab)
  if choice is None:
    raise ConfigError(f"{path} has no {tree_choice.ACCEPTANCE_FILE}: run without --time-only")
  print(choice.table())
  print(f"chosen for this device: {choice.beams.text} ({choice.beams.label}), predicted "
        f"{choice.predicted_speedup:.2f}x AR at batch 1")
  if not choice.pays:
    print(f"{choice.verdict()}; `generate` will decode with AR (the same tokens)")
  return 0
