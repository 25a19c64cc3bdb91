"""How often drafters guess the LLM's own greedy answers, per category (no timing).

The answers come from a fixed evaluation set committed with the code (``--eval-set``:
``specbench``, the default, ``heldout`` or a file; ``training/eval_set.py``), so every clone
and run scores the same positions; or the LLM writes them now (``--prompts``: our AR decoder,
stop tokens end the answer), or they are a teacher shard's greedy answers (``--shard``);
``--save-eval-set`` keeps those as a set. One
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

  python -m redrafter_jax.bench acceptance --eval-set specbench \\
      --drafter shipped --drafter runs/drafter_v1 --out runs/acceptance_v1

With two or more drafters it gives, per category and overall, the difference of each against
the first at step-1 and step-2 top-1, the W=1 run, step 1 "or rule" (the drafter's top-1 or
the copy rule right) and step 1 "or lookup" (the drafter's top-1 or the context lookup's first
token right: the copy over up to ``--lookup-ngram`` tokens that decoding's lookup beam proposes,
``training.losses.lookup_covered``, what a tree that also holds the lookup beam accepts at step
1; the number to compare for drafters decoded with ``lookup_ngram``), with a paired bootstrap
95% interval
(``paired_bootstrap``: answers are resampled, not positions, since the positions of one answer
are correlated). It also joins every position with the copy rule (``copy_rule``: the token that
followed the latest earlier occurrence of the current two tokens in prompt + answer): the
rule's hit rate, the share of positions where the drafter or the rule is right, how much of it
the drafter alone captures and its hit rate where the rule is right. ``--out DIR`` writes
``report.md``, ``scores.json`` and ``positions.npz`` (every position: category, answer,
position, target, each drafter's step-1 hit, the rule, the lookup).

Generating answers (``--prompts``) is most of a run's time; ``--answers`` keeps them in a JSONL
file keyed by model, prompt tokens and answer length, so later runs only score.
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
from redrafter_jax.models.context_attention import ContextMemory, committed_visible
from redrafter_jax.models.context_copy import copy_hints
from redrafter_jax.models.drafter import restrict_vocab
from redrafter_jax.training.losses import frozen_features, lookup_covered
from redrafter_jax.weights.tokenizer import encode, stop_token_ids


def pick_prompts(path, tok, per_category: int, max_prompt_tokens: int, skip: int = 0):
  """``(id, category, ids)`` of prompts ``skip + 1 .. skip + per_category`` of each category (as
  the suite picks them), chat-templated; longer prompts than ``max_prompt_tokens`` are left
  out."""
  from redrafter_jax.bench._methods import select_prompts

  out = [(str(r["id"]), r["category"], encode(tok, r["prompt"], chat=True))
         for r in select_prompts(pathlib.Path(path), per_category, skip)]
  return [(i, c, ids) for i, c, ids in out if len(ids) <= max_prompt_tokens]


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


def seq_memory(drafter, seq_feats_TX, seq_T, embed_VD, length_x) -> ContextMemory:
  """One sequence's context-attention memory, read by rows whose committed context is its
  first ``length_x`` positions (``[1, T, A]`` keys and values, ``[x, 1, T]`` visible)."""
  keys_1TA, values_1TA = drafter.memory_over(drafter.context(seq_feats_TX)[None], seq_T[None],
                                             embed_VD)
  T = seq_T.shape[0]
  return ContextMemory(keys_1TA, values_1TA, committed_visible(jnp.asarray(length_x), T))


def teacher_forced_logits(drafter, feats_xX, prev_xnD, tokens_xT, starts_x, embed_VD=None,
                          seq_feats_TX=None):
  """The drafter's logits at steps 1..n, teacher-forced: what decoding's first beam would score.
  Every drafter call of this bench goes through here.

  Args:
    drafter: the drafter.
    feats_xX: the LLM's features at each scored position t (``_features``).
    prev_xnD: the embeddings of the true tokens before each step (tokens t+1 .. t+n).
    tokens_xT: the token ids of prompt + answer (padded), one row per position: the context a
      drafter with the copy hint (``copy_ngram``) reads.
    starts_x: each row's position t; step i (0-based) reads token t+1+i, and a copy hint there
      looks only at ``tokens_xT[x, :t + 2 + i]`` (``context_copy``).
    embed_VD: the LLM's input embedding table (needed by a drafter with the copy hint or the
      context attention).
    seq_feats_TX: the LLM's features at every position of the sequence (needed by a drafter
      with the context attention: row x reads the positions up to ``starts_x[x]``).

  Returns:
    ``[x, n, V]`` (or the restricted vocabulary's ``[x, n, R]``) logits.
  """
  K = drafter.config.copy_ngram
  h_xD = drafter.context(feats_xX)
  hint_xn = None
  if K:
    n = prev_xnD.shape[-2]
    query_xn = jnp.asarray(starts_x)[:, None] + 1 + jnp.arange(n)[None, :]
    hint_xn = copy_hints(jnp.asarray(tokens_xT), query_xn, max_ngram=K)
  if not drafter.config.context_attention:
    return drafter.unroll_logits(h_xD, prev_xnD, None, embed_VD, hint_xn)
  # The attention reads queries [rows, queries, D]: here one row of x queries, one memory.
  memory = seq_memory(drafter, seq_feats_TX, tokens_xT[0], embed_VD, starts_x + 1)
  memory = memory.replace(visible_LMS=memory.visible_LMS[:, 0][None])
  one = lambda a: None if a is None else a[None]
  return drafter.unroll_logits(h_xD[None], prev_xnD[None], None, embed_VD,
                               jax.tree.map(one, hint_xn), memory)[0]


@functools.partial(jax.jit, static_argnames="graphdef")
def _top1(graphdef, state, feats_xX, prev_xnD, seq_T, starts_x, embed_VD, seq_feats_TX):
  drafter = nnx.merge(graphdef, state)
  tokens_xT = jnp.broadcast_to(seq_T[None], (starts_x.shape[0], seq_T.shape[0]))
  pred_xn = jnp.argmax(teacher_forced_logits(drafter, feats_xX, prev_xnD, tokens_xT, starts_x,
                                             embed_VD, seq_feats_TX),
                       -1)
  return pred_xn if drafter.vocab_ids is None else drafter.vocab_ids[...][pred_xn]


@dataclasses.dataclass(frozen=True)
class Positions:
  """The answer positions t a drafter is scored at (all n targets t+2 .. t+n+1 inside the
  answer; the first is the prompt's last token), with what it reads there. ``seq`` is prompt +
  answer and ``padded`` the positions, both padded to multiples of 128 (padding comes last, so
  causal attention ignores it); ``feats_xX`` the drafter's features at ``padded`` and
  ``feats_TX`` at every position of ``seq`` (what a drafter with the context attention reads)."""

  starts: np.ndarray
  padded: np.ndarray
  seq: np.ndarray
  feats_xX: jax.Array
  feats_TX: jax.Array

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
  return Positions(starts, padded, seq, feats_TX[padded], feats_TX)


def teacher_forced_hits(llm, drafter, prompt, answer, n: int,
                        positions: Positions | None = None) -> np.ndarray:
  """``hits[t, i]``: the drafter's top-1 at step i+1 from answer position t is the LLM's token
  (``answer_positions``'s positions; pass them to share their LLM forward)."""
  pos = positions or answer_positions(llm, drafter, prompt, answer, n)
  if pos is None:
    return np.zeros((0, n), bool)
  emb_VD = llm.embed_tokens.embedding[...]
  prev_xnD = emb_VD[pos.seq[pos.padded[:, None] + 1 + np.arange(n)]]
  pred = np.asarray(_top1(*nnx.split(drafter), pos.feats_xX, prev_xnD, jnp.asarray(pos.seq),
                          jnp.asarray(pos.padded), emb_VD, pos.feats_TX))[:pos.starts.size]
  return pred == pos.targets(n)


@functools.partial(jax.jit, static_argnames=("graphdef", "width", "length"))
def _beams(graphdef, state, feats_xX, g0_x, embed_VD, seq_T, starts_x, seq_feats_TX, *,
           width: int, length: int):
  """Beam search from every position (``beams_xWL``, token ids) and the step-1 top-W ids."""
  from redrafter_jax.inference.beam_search import beam_search

  drafter = nnx.merge(graphdef, state)
  h_xD = drafter.context(feats_xX)
  tokens_xT = jnp.broadcast_to(seq_T[None], (starts_x.shape[0], seq_T.shape[0]))
  # Decoding's context: the tokens up to g0 (position t + 1); beam search writes each beam's
  # drafted tokens after it, over the answer's own.
  memory = (seq_memory(drafter, seq_feats_TX, seq_T, embed_VD, starts_x + 1)
            if drafter.config.context_attention else None)
  beams = beam_search(drafter, embed_VD, h_xD, g0_x, beam_width=width, beam_length=length,
                      context_BS=tokens_xT, length_B=starts_x + 1, memory=memory)
  logits_xV = teacher_forced_logits(drafter, feats_xX, embed_VD[g0_x][:, None], tokens_xT,
                                    starts_x, embed_VD, seq_feats_TX)[:, 0]
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
                             llm.embed_tokens.embedding[...], jnp.asarray(pos.seq),
                             jnp.asarray(pos.padded), pos.feats_TX, width=width, length=n + 1)
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


def copy_rule(seq_T: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The copy rule's guess for the token after each position of a sequence: the token that
  followed the latest earlier occurrence of the current two tokens.

  Args:
    seq_T: token ids (prompt + answer).

  Returns:
    ``(guess_T, fires_T)``: for each j, where some i < j has ``(seq[i-1], seq[i]) ==
    (seq[j-1], seq[j])`` (the latest such i), ``fires_T[j]`` and ``guess_T[j] = seq[i+1]``,
    the rule's guess for ``seq[j+1]`` from ``seq[:j+1]``; elsewhere False and -1.
  """
  seq_T = np.asarray(seq_T, np.int64)
  T = seq_T.size
  guess_T, fires_T = np.full((T,), -1, np.int64), np.zeros((T,), bool)
  if T < 3:
    return guess_T, fires_T
  key_J = seq_T[:-1] * (int(seq_T.max()) + 1) + seq_T[1:]  # key_J[k]: the pair ending at k + 1
  order = np.argsort(key_J, kind="stable")  # equal pairs stay in position order
  same = key_J[order[1:]] == key_J[order[:-1]]
  prev_J = np.full((T - 1,), -1, np.int64)  # the latest earlier k with the same pair
  prev_J[order[1:][same]] = order[:-1][same]
  fires_T[1:] = prev_J >= 0
  guess_T[1:][fires_T[1:]] = seq_T[prev_J[prev_J >= 0] + 2]
  return guess_T, fires_T


BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def paired_bootstrap(sums_AK: np.ndarray, counts_A: np.ndarray, *,
                     resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                     level: float = 0.95) -> np.ndarray:
  """Paired bootstrap intervals for the difference of each arm's mean against the first arm's.

  The unit resampled is the answer (positions within an answer are correlated): each resample
  draws A answers with replacement, the same draws for every arm (paired), and an arm's mean is
  its pooled mean over the drawn answers (sum of their sums over sum of their counts).

  Args:
    sums_AK: per answer and arm, the sum of the per-position values (e.g. hits).
    counts_A: per answer, its number of positions.
    resamples: bootstrap resamples; seed: their generator's seed (fixed: reruns agree).
    level: the interval's coverage (percentile interval).

  Returns:
    ``[K, 3]``: per arm, the difference of its mean against arm 0's on the answers themselves,
    and the interval's low and high ends (row 0 is all zeros).
  """
  sums_AK = np.asarray(sums_AK, np.float64)
  counts_A = np.asarray(counts_A, np.float64)
  A, K = sums_AK.shape
  if counts_A.shape != (A,) or A == 0 or counts_A.sum() <= 0:
    raise ValueError(f"want sums [A, K] and counts [A] with positions, got {sums_AK.shape} "
                     f"and {counts_A.shape}")
  point_K = sums_AK.sum(0) / counts_A.sum()
  draws_RA = np.random.default_rng(seed).multinomial(A, np.full(A, 1.0 / A), size=resamples)
  means_RK = (draws_RA @ sums_AK) / np.maximum(draws_RA @ counts_A, 1e-12)[:, None]
  diffs_RK = means_RK - means_RK[:, :1]
  tail = (1.0 - level) / 2
  low_K, high_K = np.quantile(diffs_RK, [tail, 1.0 - tail], axis=0)
  return np.stack([point_K - point_K[0], low_K, high_K], axis=1)


@dataclasses.dataclass(frozen=True)
class Scored:
  """Every scored position of a set of answers, one entry per position (N in all), in answer
  order: ``answer_N`` (index into the answers), ``position_N`` (the index in its answer of
  the token step 1 guesses; the drafter reads the LLM's state two tokens before it and the
  token before it), ``target_N`` (that token), ``hits_KNn`` (drafter k's top-1 at step i is the
  LLM's token, ``teacher_forced_hits``), ``rule_fires_N`` / ``rule_hit_N`` (the copy rule
  guesses / guesses right at step 1), ``lookup_hit_N`` (the context lookup's first token is
  right); ``beams``: each drafter's ``BeamHits`` (with --beams)."""

  categories: list[str]  # of the answers
  answer_N: np.ndarray
  position_N: np.ndarray
  target_N: np.ndarray
  hits_KNn: np.ndarray
  rule_fires_N: np.ndarray
  rule_hit_N: np.ndarray
  lookup_hit_N: np.ndarray
  beams: list[BeamHits] | None = None

  @property
  def category_N(self) -> np.ndarray:
    return np.asarray(self.categories, dtype=object)[self.answer_N]

  def counts_A(self, mask_N: np.ndarray | None = None) -> np.ndarray:
    """Positions per answer (of those in ``mask_N``)."""
    w = None if mask_N is None else mask_N.astype(np.float64)
    return np.bincount(self.answer_N, weights=w, minlength=len(self.categories))

  def sums_AK(self, values_KN: np.ndarray, mask_N: np.ndarray | None = None) -> np.ndarray:
    """Per answer, the sum of each drafter's per-position values (of those in ``mask_N``)."""
    keep = np.ones(self.answer_N.shape, bool) if mask_N is None else mask_N
    return np.stack([np.bincount(self.answer_N, weights=v * keep, minlength=len(self.categories))
                     for v in np.asarray(values_KN, np.float64)], axis=1)


def score_answers(llm, drafters, answers, n: int, beams: int = 0,
                  progress: bool = True, lookup_ngram: int = 3) -> Scored:
  """Score every drafter on every answer (``eval_set.EvalAnswer``s): teacher-forced hits at
  every position (one LLM forward per answer and feature-layer choice), beam search with
  ``beams`` > 0, and the copy rule and the context lookup (n-grams up to ``lookup_ngram``) at
  step 1."""
  parts = collections.defaultdict(list)
  beam_parts = [[] for _ in drafters]
  for a, ans in enumerate(answers):
    prompt, answer = list(ans.prompt), list(ans.answer)
    forwards, hits = {}, []
    for j, d in enumerate(drafters):
      layers = tuple(d.config.feature_layers)
      if layers not in forwards:  # one LLM forward serves drafters reading the same layers
        forwards[layers] = answer_positions(llm, d, prompt, answer, n)
      pos = forwards[layers]
      if pos is None:
        break
      hits.append(teacher_forced_hits(llm, d, prompt, answer, n, pos))
      if beams:
        beam_parts[j].append(beam_hits(llm, d, prompt, answer, n, beams, pos))
    if hits:
      starts = pos.starts
      seq_T = pos.seq[:len(prompt) + len(answer)]
      guess_T, fires_T = copy_rule(seq_T)
      target = pos.seq[starts + 2]
      seq_1T = jnp.asarray(seq_T[None], jnp.int32)
      covered_T = np.asarray(lookup_covered(seq_1T, jnp.ones_like(seq_1T), lookup_ngram))[0]
      parts["answer"].append(np.full(starts.shape, a))
      parts["position"].append(starts + 2 - len(prompt))
      parts["target"].append(target)
      parts["hits"].append(np.stack(hits))
      parts["fires"].append(fires_T[starts + 1])
      parts["rule_hit"].append(fires_T[starts + 1] & (guess_T[starts + 1] == target))
      parts["lookup_hit"].append(covered_T[starts])
    if progress:
      print(f"\r{a + 1}/{len(answers)} answers", end="", file=sys.stderr, flush=True)
  if progress:
    print(file=sys.stderr)
  if not parts:
    raise ValueError(f"no answer is long enough for {n} draft steps")
  return Scored([ans.category for ans in answers], np.concatenate(parts["answer"]),
                np.concatenate(parts["position"]), np.concatenate(parts["target"]),
                np.concatenate(parts["hits"], axis=1), np.concatenate(parts["fires"]),
                np.concatenate(parts["rule_hit"]), np.concatenate(parts["lookup_hit"]),
                [BeamHits.concat(b) for b in beam_parts] if beams else None)


def metric_values(scored: Scored, L: int) -> dict[str, np.ndarray]:
  """The per-position values ``[K, N]`` whose means the bench reports and compares: top-1 at
  steps 1 and 2, the W=1 run at L, step 1 "or rule" (the drafter's top-1 or the copy rule is
  the target) and step 1 "or lookup" (the drafter's top-1 or the context lookup's first token
  is the target): what a tree that also holds the context-lookup beam can accept at step 1 (a
  drafter that only learns to copy where the lookup already does gains top-1, not this)."""
  hits_KNn = scored.hits_KNn
  out = {f"top-1 s{i + 1}": hits_KNn[:, :, i] for i in range(min(hits_KNn.shape[2], 2))}
  out[f"W=1 run L={L}"] = np.stack([runs(h, L) for h in hits_KNn])
  out["s1 or rule"] = hits_KNn[:, :, 0] | scored.rule_hit_N[None]
  out["s1 or lookup"] = hits_KNn[:, :, 0] | scored.lookup_hit_N[None]
  return out


def _groups(scored: Scored) -> list[tuple[str, np.ndarray]]:
  """``(category, mask_N)`` per category (sorted), then ``("all", everything)``."""
  cats = scored.category_N
  return ([(c, cats == c) for c in sorted(set(scored.categories))]
          + [("all", np.ones(cats.shape, bool))])


def summarize(scored: Scored, L: int, beams: int = 0, *, resamples: int = BOOTSTRAP_RESAMPLES,
              seed: int = BOOTSTRAP_SEED) -> dict[str, dict]:
  """Per category and overall (``"all"``): answers, positions, each drafter's means, each
  drafter's difference against the first with its paired bootstrap interval, and the copy rule
  joined with each drafter's step-1 hits."""
  values = metric_values(scored, L)
  out = {}
  for cat, mask in _groups(scored):
    counts = scored.counts_A(mask)
    used = counts > 0
    row = {"answers": int(used.sum()), "positions": int(mask.sum()), "drafters": [],
           "differences": []}
    for k in range(scored.hits_KNn.shape[0]):
      row["drafters"].append({name: float(v[k][mask].mean()) for name, v in values.items()})
      if scored.beams is not None:
        b = scored.beams[k]
        row["drafters"][k].update({f"top-{beams} s1": float(b.in_top[mask].mean()),
                                   "in beams": float(b.in_beams[mask].mean()),
                                   f"{beams}x{L} run": float(b.run[mask].mean()),
                                   "+ step-1 alts": float(b.with_alternatives()[mask].mean())})
    intervals = {name: paired_bootstrap(scored.sums_AK(v, mask)[used], counts[used],
                                        resamples=resamples, seed=seed)
                 for name, v in values.items()}
    row["differences"] = [{name: [float(x) for x in iv[k]] for name, iv in intervals.items()}
                          for k in range(1, scored.hits_KNn.shape[0])]
    hit_KN, fires, rule = scored.hits_KNn[:, mask, 0], scored.rule_fires_N[mask], \
        scored.rule_hit_N[mask]
    either_KN = values["s1 or rule"][:, mask]
    row["copy_rule"] = {
        "fires": float(fires.mean()), "hit": float(rule.mean()),
        "hit_where_fires": float(rule.sum() / max(fires.sum(), 1)),
        "drafters": [{"hit": float(h.mean()), "either": float(e.mean()),
                      "share_of_either": float(h.sum() / max(e.sum(), 1)),
                      "hit_where_rule_hits": float(h[rule].mean()) if rule.any() else None}
                     for h, e in zip(hit_KN, either_KN)]}
    out[cat] = row
  return out


def _cell(x) -> str:
  return "-" if x is None else f"{x:.3f}"


def _interval(d) -> str:
  return f"{d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}]"


def markdown(summary: dict[str, dict], n_drafters: int) -> str:
  """The report's three tables: each drafter's means; each drafter's difference against the
  first with 95% intervals (two or more drafters); the copy rule joined with the drafters."""
  cols = list(summary["all"]["drafters"][0])
  head = ["category", "positions"] + [f"d{k + 1} {c}" for k in range(n_drafters) for c in cols]
  lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
  label = lambda cat: f"**{cat}**" if cat == "all" else cat
  for cat, row in summary.items():
    cells = [label(cat), str(row["positions"])]
    for d in row["drafters"]:
      cells += [f"{d[c]:.2f}" if "run" in c else f"{d[c]:.3f}" for c in cols]
    lines.append("| " + " | ".join(cells) + " |")
  if n_drafters > 1:
    diff_names = list(summary["all"]["differences"][0])
    head = ["category", "answers"] + [f"d{k + 2} - d1 {c}" for k in range(n_drafters - 1)
                                      for c in diff_names]
    lines += ["", "Differences against drafter 1, with paired bootstrap 95% intervals "
              f"(answers resampled, {BOOTSTRAP_RESAMPLES} resamples, seed {BOOTSTRAP_SEED}):",
              "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for cat, row in summary.items():
      cells = [label(cat), str(row["answers"])]
      cells += [_interval(d[c]) for d in row["differences"] for c in diff_names]
      lines.append("| " + " | ".join(cells) + " |")
  head = ["category", "rule fires", "rule s1", "rule s1 where fires"] + [
      f"d{k + 1} {c}" for k in range(n_drafters)
      for c in ("s1", "either", "share of either", "s1 where rule hits")]
  lines += ["", "Step 1 against the copy rule (the token that followed the latest earlier "
            "occurrence of the current two tokens; rates over all positions unless said):",
            "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
  for cat, row in summary.items():
    r = row["copy_rule"]
    cells = [label(cat), _cell(r["fires"]), _cell(r["hit"]), _cell(r["hit_where_fires"])]
    for d in r["drafters"]:
      cells += [_cell(d["hit"]), _cell(d["either"]), _cell(d["share_of_either"]),
                _cell(d["hit_where_rule_hits"])]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def write_positions(scored: Scored, specs: list[str], path: pathlib.Path) -> None:
  """Every scored position, joined with the copy rule, as a compressed ``.npz``: ``category``
  (index into ``category_names``), ``answer``, ``position``, ``target``, ``hit`` ``[N, K]``
  (drafter k's step-1 top-1 is the target; ``drafters`` names them), ``rule_fires``,
  ``rule_hit``, ``lookup_hit``."""
  names = sorted(set(scored.categories))
  index = {c: i for i, c in enumerate(names)}
  path.parent.mkdir(parents=True, exist_ok=True)
  np.savez_compressed(
      path, category_names=np.array(names), drafters=np.array(specs),
      category=np.array([index[c] for c in scored.category_N], np.int16),
      answer=scored.answer_N.astype(np.int32), position=scored.position_N.astype(np.int32),
      target=scored.target_N.astype(np.int32), hit=scored.hits_KNn[:, :, 0].T,
      rule_fires=scored.rule_fires_N, rule_hit=scored.rule_hit_N,
      lookup_hit=scored.lookup_hit_N)


def _load_answers(args, llm_model_name: str, tok, llm, stop_ids):
  """The answers to score (``eval_set.EvalAnswer``s) and a name for where they came from."""
  from redrafter_jax.inference.ar import generate
  from redrafter_jax.training import eval_set

  if args.prompts is not None:
    cache = AnswerCache(args.answers)
    out = []
    for pid, cat, ids in pick_prompts(args.prompts, tok, args.per_category,
                                      args.max_prompt_tokens, args.skip_per_category):
      answer = cache.get(llm_model_name, ids, args.max_new_tokens,
                         lambda: generate(llm, [ids], max_new_tokens=args.max_new_tokens,
                                          stop_ids=stop_ids).tokens[0])
      out.append(eval_set.EvalAnswer(pid, cat, llm_model_name, tuple(ids), tuple(answer)))
      print(f"\r{len(out)} answers", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return out
  if args.shard is not None:
    return eval_set.answers_from_shard(args.shard, args.shard_prompts)
  return eval_set.read_eval_set(args.eval_set)


def _source_name(args) -> str:
  if args.prompts is not None:
    skip = f" after the first {args.skip_per_category}" if args.skip_per_category else ""
    return (f"its answers now to {args.prompts}, up to {args.per_category} per category{skip}, "
            f"{args.max_new_tokens} new tokens")
  if args.shard is not None:
    return f"the greedy answers of {args.shard}"
  return f"eval set {args.eval_set}"


def _eval_set_model(args) -> str | None:
  """The model that wrote the answers to score, where the answers say (None: ``--prompts``)."""
  from redrafter_jax.training import data as data_lib
  from redrafter_jax.training import eval_set

  if args.prompts is not None:
    return None
  if args.shard is not None:
    return data_lib.read_manifest(args.shard.parent).get("settings", {}).get("model")
  return eval_set.read_eval_set(args.eval_set)[0].model


def _check_drafter(spec: str, drafter, llm_cfg, model: str) -> None:
  got = drafter.config
  if (got.hidden_size, got.vocab_size) != (llm_cfg.hidden_size, llm_cfg.vocab_size):
    from redrafter_jax.errors import UserError

    raise UserError(f"drafter {spec} is made for an LLM of hidden size {got.hidden_size} and "
                    f"vocabulary {got.vocab_size}, not {model!r} ({llm_cfg.hidden_size}, "
                    f"{llm_cfg.vocab_size}) that wrote the answers")


def main(argv=None) -> int:
  from redrafter_jax.bench._common import draft_vocab_arg, load, load_drafter_arg
  from redrafter_jax.training import eval_set

  ap = argparse.ArgumentParser(prog="python -m redrafter_jax.bench acceptance",
                               description=__doc__.splitlines()[0])
  show_defaults(ap)
  src = ap.add_mutually_exclusive_group()
  src.add_argument("--eval-set", default="specbench",
                   help=f"fixed answers to score: {', '.join(eval_set.NAMES)} (data/eval) or a "
                   "file")
  src.add_argument("--prompts", type=pathlib.Path, default=None,
                   help="instead: the LLM answers these prompts now (Spec-Bench-style jsonl "
                   "{id, category, prompt})")
  src.add_argument("--shard", type=pathlib.Path, default=None,
                   help="instead: the greedy answers of this teacher shard (distill-data)")
  ap.add_argument("--shard-prompts", type=pathlib.Path,
                  default=eval_set.EVAL_DIR.parent / "prompts" / "mix-v1.jsonl.gz",
                  help="the prompts file --shard's folder was made from (its categories)")
  ap.add_argument("--save-eval-set", type=pathlib.Path, default=None,
                  help="write the answers scored (--prompts or --shard) as an eval set file")
  ap.add_argument("--model", default=None,
                  help="known name, .gguf file or HF folder (default: the answers' model; "
                  "smollm2-135m with --prompts)")
  ap.add_argument("--drafter", action="append", default=None,
                  help="drafter folder or 'shipped' (repeat to compare against the first; "
                  "default: shipped)")
  ap.add_argument("--draft-vocab", type=int, default=None,
                  help="draft vocabulary size (0 = all; default: each drafter's decode.json)")
  ap.add_argument("--per-category", type=int, default=4, help="--prompts: prompts per category")
  ap.add_argument("--skip-per-category", type=int, default=0,
                  help="--prompts: leave out the first N prompts of each category")
  ap.add_argument("--answers", type=pathlib.Path, default=None,
                  help="--prompts: JSONL file keeping the LLM's answers between runs (read, "
                  "then appended)")
  ap.add_argument("--max-prompt-tokens", type=int, default=1024,
                  help="--prompts: leave out longer prompts (chat-templated tokens)")
  ap.add_argument("--max-new-tokens", type=int, default=128,
                  help="--prompts: answer tokens at most")
  ap.add_argument("--steps", type=int, default=4, help="draft steps n (L = n + 1 at most)")
  ap.add_argument("--lookup-ngram", type=int, default=3,
                  help="the context lookup's longest n-gram, for the 's1 or lookup' column "
                  "(decoding's lookup_ngram)")
  ap.add_argument("--beams", type=int, default=0,
                  help="also run beam search of this width W (L = steps + 1) at every position "
                  "(0: off)")
  ap.add_argument("--out", type=pathlib.Path, default=None,
                  help="write report.md, scores.json and positions.npz (every position) here")
  args = ap.parse_args(argv)
  specs = args.drafter or ["shipped"]
  if (args.steps < 1 or args.per_category < 1 or args.skip_per_category < 0 or args.beams < 0
      or args.lookup_ngram < 1):
    print("error: --steps, --per-category and --lookup-ngram must be >= 1, "
          "--skip-per-category and --beams >= 0", file=sys.stderr)
    return 2
  if args.save_eval_set is not None and args.prompts is None and args.shard is None:
    print("error: --save-eval-set keeps answers made by --prompts or read by --shard",
          file=sys.stderr)
    return 2
  if args.prompts is not None:
    try:
      AnswerCache(args.answers)
    except (OSError, ValueError) as e:
      print(f"error: --answers: {e}", file=sys.stderr)
      return 2

  start = time.perf_counter()
  wrote = _eval_set_model(args)
  model = args.model or wrote or "smollm2-135m"
  if wrote is not None and wrote != model:
    print(f"error: {_source_name(args)} holds {wrote!r}'s answers, not {model!r}'s: score it "
          f"with --model {wrote}", file=sys.stderr)
    return 2
  models = load(model)
  llm, llm_cfg, tok = models.llm, models.cfg, models.tokenizer
  drafters = []
  for s in specs:
    d = load_drafter_arg(s, llm_cfg, 0)
    _check_drafter(s, d, llm_cfg, model)
    drafters.append(restrict_vocab(d, draft_vocab_arg(s, args.draft_vocab)))
  answers = _load_answers(args, model, tok, llm, stop_token_ids(tok))
  eval_set.check_model(answers, model, llm_cfg.vocab_size, _source_name(args))
  if args.save_eval_set is not None:
    print(f"{eval_set.write_eval_set(answers, args.save_eval_set)}: {len(answers)} answers",
          file=sys.stderr)
  n, L = args.steps, args.steps + 1
  scored_at = time.perf_counter()
  scored = score_answers(llm, drafters, answers, n, args.beams,
                         lookup_ngram=args.lookup_ngram)
  summary = summarize(scored, L, args.beams)
  seconds, score_seconds = time.perf_counter() - start, time.perf_counter() - scored_at

  lines = [f"Teacher-forced drafter accuracy on {model}'s own greedy answers: "
           f"{_source_name(args)} ({len(answers)} answers, {scored.answer_N.size} positions; "
           f"{seconds:.0f} s, scoring {score_seconds:.0f} s).", ""]
  for j, (spec, d) in enumerate(zip(specs, drafters)):
    vocab = "all" if d.vocab_ids is None else d.vocab_ids.shape[0]
    lines.append(f"drafter {j + 1}: {spec} (draft vocabulary {vocab})")
  report = "\n".join(lines) + "\n\n" + markdown(summary, len(specs))
  print(report)
  if args.out is not None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.md").write_text(report + "\n")
    (args.out / "scores.json").write_text(json.dumps({
        "answers_from": _source_name(args), "model": model, "drafters": specs,
        "steps": n, "beams": args.beams, "answers": len(answers),
        "positions": int(scored.answer_N.size),
        "bootstrap": {"unit": "answer", "resamples": BOOTSTRAP_RESAMPLES,
                      "seed": BOOTSTRAP_SEED, "level": 0.95},
        "seconds": round(seconds, 1), "scoring_seconds": round(score_seconds, 1),
        "categories": summary}, indent=1) + "\n")
    write_positions(scored, specs, args.out / "positions.npz")
  return 0


if __name__ == "__main__":
  sys.exit(main())
