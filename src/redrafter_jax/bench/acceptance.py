"""How often drafters guess the LLM's own greedy answers, per Spec-Bench category (no timing).

For each chosen prompt the LLM answers greedily (our AR decoder, stop tokens end the answer); one
forward over prompt + answer gives its hidden states (or, for a multi-layer drafter, the states
of its ``feature_layers``, through its own projection, as decoding hands them over); then every
drafter, teacher-forced on the answer, predicts steps 1..n at every answer position t (step i
from ``h_t`` and tokens t+1..t+i, target t+i+1, as in training). Reported per category and
drafter:

  top-1 at step i   share of positions where the drafter's first choice is the LLM's token;
  W=1 run at L      mean of 1 + (consecutive correct steps from step 1, at most L-1): with one
                    beam a correct prefix drafts exactly the teacher-forced tokens, so this is the
                    tokens per verification step a W=1, L decode would get if it stopped at every
                    position (real decodes stop only where the previous step ended).

With ``--beams W`` (and L = n + 1) it also runs the drafter's beam search at every position, as
decoding does (from the same states, g0 = the LLM's token), and reports:

  top-W s1          share of positions whose step-1 target is among the drafter's W first choices
  in beams          ... among the first drafted tokens of the W beams beam search keeps
  WxL run           mean of 1 + the longest beam prefix equal to the LLM's tokens: the tokens per
                    step a greedy W x L tree would get at every position
  + step-1 alts     the same if the tree also held the step-1 alternatives that beam search
                    dropped (a beam [g0, alternative] for each): the most such a tree could gain

Being free of timing noise and batch effects, it compares drafters (``--drafter`` repeated)
exactly and in minutes on a CPU::

  python -m redrafter_jax.bench acceptance --prompts data/spec_bench.jsonl.gz \\
      --drafter runs/drafter_v1 --drafter shipped --per-category 10 --answers runs/answers.jsonl

Generating the answers is most of the time; ``--answers`` keeps them in a JSONL file keyed by
model, prompt tokens and answer length, so later runs (other drafters) only score.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import hashlib
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from redrafter_jax.helptext import show_defaults
from redrafter_jax.models.drafter import restrict_vocab
from redrafter_jax.training.losses import frozen_features
from redrafter_jax.weights.tokenizer import encode, stop_token_ids


def pick_prompts(path, tok, per_category: int, max_prompt_tokens: int, skip: int = 0):
  """``(category, ids)`` of prompts ``skip + 1 .. skip + per_category`` of each category (as the
  suite picks them), chat-templated; longer prompts than ``max_prompt_tokens`` are left out."""
  from redrafter_jax.bench.suite import select_prompts

  out = [(r["category"], encode(tok, r["prompt"], chat=True))
         for r in select_prompts(pathlib.Path(path), per_category, skip)]
  return [(c, ids) for c, ids in out if len(ids) <= max_prompt_tokens]


class AnswerCache:
  """The LLM's greedy answers, kept in a JSONL file (one ``{"key", "answer"}`` per line).

  The key hashes the model name, the prompt's token ids and ``max_new_tokens``: an answer is
  reused only for exactly the request that produced it. Lines are appended as answers are made,
  so an interrupted run keeps what it generated."""

  def __init__(self, path: pathlib.Path | None):
    self.path, self.answers = path, {}
    if path is not None and path.exists():
      from redrafter_jax.jsonl import read_jsonl

      for lineno, row in read_jsonl(path, "key", what="answers file"):
        if not isinstance(row.get("answer"), list):
          raise ValueError(f"{path}:{lineno}: not an answers file (want {{key, answer}} per line)")
        self.answers[row["key"]] = row["answer"]

  @staticmethod
  def key(model: str, prompt: list[int], max_new_tokens: int) -> str:
    blob = json.dumps([model, list(map(int, prompt)), max_new_tokens]).encode()
    return hashlib.sha256(blob).hexdigest()[:32]

  def get(self, model, prompt, max_new_tokens, make):
    k = self.key(model, prompt, max_new_tokens)
    if k not in self.answers:
      self.answers[k] = [int(t) for t in make()]
      if self.path is not None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
          f.write(json.dumps({"key": k, "answer": self.answers[k]}) + "\n")
    return self.answers[k]


def _round_up(n: int, multiple: int = 128) -> int:
  return -(-n // multiple) * multiple


@functools.partial(jax.jit, static_argnames=("graphdef", "layers"))
def _features(graphdef, state, seq_1T, layers: tuple[int, ...] = ()):
  """What a drafter reads over one causal sequence, as training computes it (one packed
  sequence filling the row): the LLM's hidden states after the final norm, or with ``layers``
  (a multi-layer drafter's ``feature_layers``) those layers' normed states, concatenated."""
  T = seq_1T.shape[1]
  return frozen_features(nnx.merge(graphdef, state), seq_1T, jnp.arange(T)[None],
                         jnp.ones((1, T), jnp.int32), layers)[1]


def teacher_forced_logits(drafter, feats_xX, prev_xnD):
  """The drafter's logits at steps 1..n from the LLM's features (``_features``) and the
  embeddings of the true tokens before each step: what decoding's first beam would score."""
  return drafter.unroll_logits(drafter.context(feats_xX), prev_xnD)


@functools.partial(jax.jit, static_argnames="graphdef")
def _top1(graphdef, state, feats_xX, prev_xnD):
  drafter = nnx.merge(graphdef, state)
  pred_xn = jnp.argmax(teacher_forced_logits(drafter, feats_xX, prev_xnD), -1)
  return pred_xn if drafter.vocab_ids is None else drafter.vocab_ids[...][pred_xn]


@dataclasses.dataclass(frozen=True)
class Positions:
  """The answer positions t a drafter is scored at (all n targets t+2 .. t+n+1 inside the
  answer; the first is the prompt's last token), with what it reads there. ``seq`` is prompt +
  answer and ``padded`` the positions, both padded to multiples of 128 (padding comes last, so
  causal attention ignores it); ``feats_xX`` the drafter's features at ``padded``."""

  starts: np.ndarray
  padded: np.ndarray
  seq: np.ndarray
  feats_xX: jax.Array

  def targets(self, n: int) -> np.ndarray:
    """``[t, i]``: the LLM's token that draft step i+1 from position t should guess."""
    return self.seq[self.starts[:, None] + 2 + np.arange(n)]


def answer_positions(llm, drafter, prompt, answer, n: int) -> Positions | None:
  """The scored positions and the features ``drafter`` reads there (one LLM forward), or None
  when the answer is too short for n steps."""
  T, P = len(prompt) + len(answer), len(prompt)
  starts = np.arange(P - 1, T - n - 1)
  if starts.size == 0:
    return None
  seq = np.zeros((_round_up(T + n + 1),), np.int32)
  seq[:T] = prompt + answer
  feats_TX = _features(*nnx.split(llm), jnp.asarray(seq)[None],
                       tuple(drafter.config.feature_layers))[0]
  padded = np.concatenate([starts, np.full((_round_up(starts.size) - starts.size,), starts[0])])
  return Positions(starts, padded, seq, feats_TX[padded])


def teacher_forced_hits(llm, drafter, prompt, answer, n: int,
                        positions: Positions | None = None) -> np.ndarray:
  """``hits[t, i]``: the drafter's top-1 at step i+1 from answer position t is the LLM's token
  (``answer_positions``'s positions; pass them to share their LLM forward)."""
  pos = positions or answer_positions(llm, drafter, prompt, answer, n)
  if pos is None:
    return np.zeros((0, n), bool)
  emb_VD = llm.embed_tokens.embedding[...]
  prev_xnD = emb_VD[pos.seq[pos.padded[:, None] + 1 + np.arange(n)]]
  pred = np.asarray(_top1(*nnx.split(drafter), pos.feats_xX, prev_xnD))[:pos.starts.size]
  return pred == pos.targets(n)


@functools.partial(jax.jit, static_argnames=("graphdef", "width", "length"))
def _beams(graphdef, state, feats_xX, g0_x, embed_VD, *, width: int, length: int):
  """Beam search from every position (``beams_xWL``, token ids) and the step-1 top-W ids."""
  from redrafter_jax.inference.beam_search import beam_search

  drafter = nnx.merge(graphdef, state)
  h_xD = drafter.context(feats_xX)
  beams = beam_search(drafter, embed_VD, h_xD, g0_x, beam_width=width, beam_length=length)
  logits_xV = teacher_forced_logits(drafter, feats_xX, embed_VD[g0_x][:, None])[:, 0]
  top_xW = jax.lax.top_k(logits_xV, width)[1]
  if drafter.vocab_ids is not None:
    top_xW = drafter.vocab_ids[...][top_xW]
  return beams.beams_BWL, top_xW


@dataclasses.dataclass(frozen=True)
class BeamHits:
  """Per answer position (as ``teacher_forced_hits``'s rows): the step-1 target among the step-1
  top-W (``in_top``) and among the kept beams' first drafted tokens (``in_beams``); ``run``, 1 +
  the longest beam prefix that equals the LLM's tokens."""

  in_top: np.ndarray
  in_beams: np.ndarray
  run: np.ndarray

  def with_alternatives(self) -> np.ndarray:
    """``run`` if the tree also held every step-1 alternative as a beam of its own."""
    return np.maximum(self.run, 1 + self.in_top)

  @staticmethod
  def concat(parts: list["BeamHits"]) -> "BeamHits":
    return BeamHits(*(np.concatenate([getattr(p, f) for p in parts])
                      for f in ("in_top", "in_beams", "run")))


def beam_hits(llm, drafter, prompt, answer, n: int, width: int,
              positions: Positions | None = None) -> BeamHits:
  """Beam search (W = ``width``, L = n + 1) at every position ``teacher_forced_hits`` scores,
  from the states decoding would hand the drafter there, against the LLM's answer."""
  pos = positions or answer_positions(llm, drafter, prompt, answer, n)
  if pos is None:
    return BeamHits(np.zeros((0,), bool), np.zeros((0,), bool), np.zeros((0,), np.int64))
  beams_xWL, top_xW = _beams(*nnx.split(drafter), pos.feats_xX,
                             jnp.asarray(pos.seq[pos.padded + 1]),
                             llm.embed_tokens.embedding[...], width=width, length=n + 1)
  beams_xWL = np.asarray(beams_xWL)[:pos.starts.size]
  target_xn = pos.targets(n)
  match_xWn = np.cumprod(beams_xWL[:, :, 1:] == target_xn[:, None, :], axis=2)
  return BeamHits(in_top=(np.asarray(top_xW)[:pos.starts.size] == target_xn[:, :1]).any(axis=1),
                  in_beams=(beams_xWL[:, :, 1] == target_xn[:, None, 0]).any(axis=1),
                  run=1 + match_xWn.sum(axis=2).max(axis=1))


def runs(hits_xn: np.ndarray, L: int) -> np.ndarray:
  """1 + consecutive hits from step 1, capped at L-1 drafted tokens."""
  ok = np.cumprod(hits_xn[:, :L - 1], axis=1)
  return 1 + ok.sum(axis=1)


def main(argv=None) -> int:
  from redrafter_jax.bench._common import draft_vocab_arg, load, load_drafter_arg
  from redrafter_jax.inference.ar import generate

  ap = argparse.ArgumentParser(prog="python -m redrafter_jax.bench acceptance",
                               description=__doc__.splitlines()[0])
  show_defaults(ap)
  ap.add_argument("--prompts", required=True, help="Spec-Bench jsonl ({category, prompt})")
  ap.add_argument("--model", default="smollm2-135m",
                  help="known name, .gguf file or HF folder")
  ap.add_argument("--drafter", action="append", default=None,
                  help="drafter folder or 'shipped' (repeat to compare; default: shipped)")
  ap.add_argument("--draft-vocab", type=int, default=None,
                  help="draft vocabulary size (0 = all; default: each drafter's decode.json)")
  ap.add_argument("--per-category", type=int, default=4, help="prompts per category")
  ap.add_argument("--skip-per-category", type=int, default=0,
                  help="leave out the first N prompts of each category")
  ap.add_argument("--answers", type=pathlib.Path, default=None,
                  help="JSONL file keeping the LLM's answers between runs (read, then appended)")
  ap.add_argument("--max-prompt-tokens", type=int, default=1024,
                  help="leave out longer prompts (chat-templated tokens)")
  ap.add_argument("--max-new-tokens", type=int, default=128, help="answer tokens at most")
  ap.add_argument("--steps", type=int, default=4, help="draft steps n (L = n + 1 at most)")
  ap.add_argument("--beams", type=int, default=0,
                  help="also run beam search of this width W (L = steps + 1) at every position "
                  "(0: off)")
  args = ap.parse_args(argv)
  specs = args.drafter or ["shipped"]
  if args.steps < 1 or args.per_category < 1 or args.skip_per_category < 0 or args.beams < 0:
    print("error: --steps and --per-category must be >= 1, --skip-per-category and --beams "
          ">= 0", file=sys.stderr)
    return 2
  try:
    cache = AnswerCache(args.answers)
  except (OSError, ValueError) as e:
    print(f"error: --answers: {e}", file=sys.stderr)
    return 2

  start = time.perf_counter()
  models = load(args.model)
  llm, llm_cfg, tok = models.llm, models.cfg, models.tokenizer
  drafters = [restrict_vocab(load_drafter_arg(s, llm_cfg, 0), draft_vocab_arg(s, args.draft_vocab))
              for s in specs]
  prompts = pick_prompts(args.prompts, tok, args.per_category, args.max_prompt_tokens,
                         args.skip_per_category)
  n = args.steps
  hits = collections.defaultdict(lambda: [np.zeros((0, n), bool) for _ in drafters])
  beam = collections.defaultdict(lambda: [[] for _ in drafters])
  for k, (cat, ids) in enumerate(prompts):
    answer = cache.get(args.model, ids, args.max_new_tokens,
                       lambda: generate(llm, [ids], max_new_tokens=args.max_new_tokens,
                                        stop_ids=stop_token_ids(tok)).tokens[0])
    for j, d in enumerate(drafters):
      pos = answer_positions(llm, d, ids, answer, n)  # one LLM forward for both scores
      h = teacher_forced_hits(llm, d, ids, answer, n, pos)
      b = beam_hits(llm, d, ids, answer, n, args.beams, pos) if args.beams else None
      for key in (cat, "all"):
        hits[key][j] = np.concatenate([hits[key][j], h])
        if b is not None:
          beam[key][j].append(b)
    print(f"\r{k + 1}/{len(prompts)} prompts", end="", file=sys.stderr, flush=True)
  print(file=sys.stderr)

  print(f"Teacher-forced drafter accuracy on {args.model}'s own greedy answers "
        f"({len(prompts)} prompts of {args.prompts}, up to {args.per_category} per category"
        f"{f' after the first {args.skip_per_category}' if args.skip_per_category else ''}, "
        f"{args.max_new_tokens} new tokens; {time.perf_counter() - start:.0f} s).\n")
  for j, (spec, d) in enumerate(zip(specs, drafters)):
    vocab = "all" if d.vocab_ids is None else d.vocab_ids.shape[0]
    print(f"drafter {j + 1}: {spec} (draft vocabulary {vocab})")
  W, L = args.beams, n + 1
  beam_cols = ([f"top-{W} s1", "in beams", f"{W}x{L} run", "+ step-1 alts"] if W else [])
  head = ["category", "positions"] + [
      f"d{j + 1} {col}" for j in range(len(specs))
      for col in [f"top-1 s{i + 1}" for i in range(min(n, 2))] + [f"W=1 run L={L}"] + beam_cols]
  print("\n| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
  for cat in sorted(hits, key=lambda c: (c == "all", c)):
    row = [f"**{cat}**" if cat == "all" else cat, str(hits[cat][0].shape[0])]
    for j, h in enumerate(hits[cat]):
      row += [f"{h[:, i].mean():.3f}" for i in range(min(n, 2))] + [f"{runs(h, L).mean():.2f}"]
      if W:
        b = BeamHits.concat(beam[cat][j])
        row += [f"{b.in_top.mean():.3f}", f"{b.in_beams.mean():.3f}", f"{b.run.mean():.2f}",
                f"{b.with_alternatives().mean():.2f}"]
    print("| " + " | ".join(row) + " |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
