"""The drafter-acceptance benchmark: teacher-forced hits equal a step-by-step drafter walk."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from redrafter_jax.bench import acceptance
from redrafter_jax.config import DrafterConfig
from redrafter_jax.models.drafter import Drafter, restrict_vocab
from tests import tiny_models


def _walk_features(llm, drafter, seq):
  """What decoding hands the drafter at every position of ``seq``: the last hidden state, or a
  multi-layer drafter's layer states (``forward_layers``), before its projection."""
  T = len(seq)
  args = (jnp.asarray(seq)[None], jnp.arange(T)[None], jnp.tril(jnp.ones((1, T, T), bool)))
  layers = tuple(drafter.config.feature_layers)
  return (llm.forward_layers(*args, layers=layers)[1] if layers else
          llm.forward_hidden(*args)[0])[0]


def _walk_hits(llm, drafter, prompt, answer, n, logp_out=None):
  """Reference: per position, ``drafter.step`` n times on the true tokens (one at a time), from
  what decoding hands the drafter: the last hidden state, or a multi-layer drafter's layer
  states (``forward_layers``) through its projection (``Drafter.context``). ``logp_out``: a
  list that gets each position's step log-probabilities ``[n, V]``."""
  seq = prompt + answer
  T = len(seq)
  feats = _walk_features(llm, drafter, seq)
  emb = llm.embed_tokens.embedding[...]
  rows = []
  for t in range(len(prompt) - 1, T - n - 1):
    h = drafter.context(feats[t][None])
    s, row, logps = drafter.init_state(h), [], []
    for i in range(n):
      logp, s = drafter.step(h, s, emb[seq[t + 1 + i]][None])
      logps.append(np.asarray(logp[0]))
      k = int(jnp.argmax(logp[0]))
      tok = int(drafter.vocab_ids[...][k]) if drafter.vocab_ids is not None else k
      row.append(tok == seq[t + 2 + i])
    rows.append(row)
    if logp_out is not None:
      logp_out.append(np.stack(logps))
  return np.array(rows, bool)


def _answer_with_hits(llm, drafter, prompt, answer):
  """``answer`` with two of every three tokens replaced, left to right, by the drafter's step-1
  guess for them, so that a random drafter has hits to find."""
  seq = list(prompt) + list(answer)
  for j in range(len(prompt) + 1, len(seq)):
    if j % 3:
      seq[j] = int(_walk_guess(llm, drafter, seq[:j]))
  return seq[len(prompt):]


def _context_at(llm, drafter, seq, t):
  """The drafter's context vector at position t of ``seq`` (which reads tokens up to t)."""
  padded = np.zeros((64,), np.int32)
  padded[:t + 1] = seq[:t + 1]  # one compiled shape; padding comes last (causal)
  feats = acceptance._features(*nnx.split(llm), jnp.asarray(padded)[None],
                               tuple(drafter.config.feature_layers))[:, t]
  return drafter.context(feats)


def _walk_guess(llm, drafter, seq):
  """The drafter's step-1 guess for the token after ``seq`` (from h at len-2 and seq[-1])."""
  h = _context_at(llm, drafter, seq, len(seq) - 2)
  logp, _ = drafter.step(h, drafter.init_state(h), llm.embed_tokens.embedding[...][seq[-1]][None])
  k = int(jnp.argmax(logp[0]))
  return drafter.vocab_ids[...][k] if drafter.vocab_ids is not None else k


def _layered(cfg, seed=2):
  """A multi-layer drafter (EAGLE-3-style features) whose projection mixes its layers: a fresh
  one copies the last layer, which is the last hidden state, and would hide a bench that hands
  it the wrong states."""
  d = Drafter(DrafterConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, exit_dim=48,
                            feature_layers=(0, 1)), rngs=nnx.Rngs(seed))
  kernel = d.feature_proj.kernel[...]
  d.feature_proj.kernel.set_value(
      np.random.default_rng(seed).normal(0, 0.2, kernel.shape).astype(kernel.dtype))
  return d


def test_hits_equal_a_step_by_step_walk(tmp_path):
  llm, cfg, _ = tiny_models.load_tiny(tmp_path)
  drafter = Drafter(DrafterConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                  exit_dim=48), rngs=nnx.Rngs(1))
  prompt = tiny_models.random_tokens(1, 9)
  for d in (drafter, restrict_vocab(drafter, 40), _layered(cfg)):
    answer = _answer_with_hits(llm, d, prompt, tiny_models.random_tokens(2, 30))
    got = acceptance.teacher_forced_hits(llm, d, prompt, answer, 3)
    want = _walk_hits(llm, d, prompt, answer, 3)
    assert got.shape == want.shape == (len(answer) - 3, 3)
    np.testing.assert_array_equal(got, want)
    assert 0 < want.sum() < want.size  # both hits and misses are checked


def test_a_multi_layer_drafter_scores_what_decoding_would(tmp_path):
  """Hits alone can agree by chance (a random drafter's guess may hang on the previous token):
  the teacher-forced log-probabilities of a multi-layer drafter equal the walk's at every
  position and step, so it is scored on its layers' states, not the last hidden state."""
  import jax

  llm, cfg, _ = tiny_models.load_tiny(tmp_path)
  d = _layered(cfg)
  prompt, answer, n = tiny_models.random_tokens(1, 9), tiny_models.random_tokens(2, 20), 3
  want = []
  _walk_hits(llm, d, prompt, answer, n, logp_out=want)
  seq = prompt + answer
  padded = np.zeros((128,), np.int32)
  padded[:len(seq)] = seq
  feats_TX = acceptance._features(*nnx.split(llm), jnp.asarray(padded)[None], (0, 1))[0]
  starts = np.arange(len(prompt) - 1, len(seq) - n - 1)
  prev_xnD = llm.embed_tokens.embedding[...][padded[starts[:, None] + 1 + np.arange(n)]]
  got = jax.nn.log_softmax(acceptance.teacher_forced_logits(d, feats_TX[starts], prev_xnD), -1)
  np.testing.assert_allclose(np.asarray(got), np.stack(want), atol=2e-4)


def _walk_beams(llm, drafter, prompt, answer, n, width):
  """Reference for ``beam_hits``: beam search run position by position on the states decoding
  hands the drafter, its beams compared with the answer token by token."""
  from redrafter_jax.inference.beam_search import beam_search

  seq = prompt + answer
  T = len(seq)
  feats = _walk_features(llm, drafter, seq)
  emb = llm.embed_tokens.embedding[...]
  in_top, in_beams, run = [], [], []
  for t in range(len(prompt) - 1, T - n - 1):
    h = drafter.context(feats[t][None])
    g0 = jnp.asarray([seq[t + 1]], jnp.int32)
    beams = np.asarray(beam_search(drafter, emb, h, g0, beam_width=width,
                                   beam_length=n + 1).beams_BWL[0])
    logp, _ = drafter.step(h, drafter.init_state(h), emb[g0])
    top = np.argsort(-np.asarray(logp[0]), kind="stable")[:width]
    if drafter.vocab_ids is not None:
      top = np.asarray(drafter.vocab_ids[...])[top]
    want = seq[t + 2:t + 2 + n]
    in_top.append(want[0] in top.tolist())
    in_beams.append(want[0] in beams[:, 1].tolist())
    longest = 0
    for beam in beams:
      k = 0
      while k < n and beam[1 + k] == want[k]:
        k += 1
      longest = max(longest, k)
    run.append(1 + longest)
  return np.array(in_top), np.array(in_beams), np.array(run)


def _answer_along_beams(llm, drafter, prompt, answer, n, width):
  """``answer`` rewritten left to right so that from every (n+1)-th position one of the beams
  (a different one each time) continues the answer for its whole length: a random drafter then
  has full runs, partial ones (other beams share prefixes with it) and misses."""
  from redrafter_jax.inference.beam_search import beam_search

  seq = list(prompt) + list(answer)
  emb = llm.embed_tokens.embedding[...]
  for k, t in enumerate(range(len(prompt) - 1, len(seq) - n - 1, n + 1)):
    beams = beam_search(drafter, emb, _context_at(llm, drafter, seq, t), jnp.asarray([seq[t + 1]]),
                        beam_width=width, beam_length=n + 1).beams_BWL[0]
    seq[t + 2:t + 2 + n] = [int(x) for x in beams[k % width, 1:]]
  return seq[len(prompt):]


def test_beam_hits_equal_a_position_by_position_beam_search(tmp_path):
  llm, cfg, _ = tiny_models.load_tiny(tmp_path)
  drafter = Drafter(DrafterConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                  exit_dim=48), rngs=nnx.Rngs(1))
  prompt = tiny_models.random_tokens(1, 9)
  for d in (drafter, restrict_vocab(drafter, 40), _layered(cfg)):
    answer = _answer_along_beams(llm, d, prompt, tiny_models.random_tokens(2, 30), 3, 4)
    got = acceptance.beam_hits(llm, d, prompt, answer, 3, 4)
    in_top, in_beams, run = _walk_beams(llm, d, prompt, answer, 3, 4)
    np.testing.assert_array_equal(got.in_top, in_top)
    np.testing.assert_array_equal(got.in_beams, in_beams)
    np.testing.assert_array_equal(got.run, run)
    assert 0 < in_beams.sum() < in_beams.size and (run == 4).any() and (run == 1).any()
    assert (got.in_beams <= got.in_top).all()  # the kept beams start with step-1 choices
    assert (got.with_alternatives() >= got.run).all()
    assert (got.with_alternatives() == np.where(got.in_top & (got.run == 1), 2, got.run)).all()


def test_one_beam_runs_as_far_as_the_teacher_forced_top_1(tmp_path):
  """With W = 1 beam search drafts the drafter's top-1 chain, which matches the answer exactly
  as long as the teacher-forced top-1 does: the two measures must agree position by position."""
  llm, cfg, _ = tiny_models.load_tiny(tmp_path)
  d = Drafter(DrafterConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, exit_dim=48),
              rngs=nnx.Rngs(1))
  prompt = tiny_models.random_tokens(1, 9)
  answer = _answer_with_hits(llm, d, prompt, tiny_models.random_tokens(2, 30))
  hits = acceptance.teacher_forced_hits(llm, d, prompt, answer, 3)
  b = acceptance.beam_hits(llm, d, prompt, answer, 3, 1)
  np.testing.assert_array_equal(b.in_top, hits[:, 0])
  np.testing.assert_array_equal(b.in_beams, hits[:, 0])
  np.testing.assert_array_equal(b.run, acceptance.runs(hits, 4))


def test_runs_count_consecutive_hits_from_step_one():
  hits = np.array([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1], [1, 0, 1, 1]], bool)
  assert acceptance.runs(hits, 5).tolist() == [3, 1, 5, 2]
  assert acceptance.runs(hits, 3).tolist() == [3, 1, 3, 2]


def test_answer_cache_reuses_only_the_same_request(tmp_path):
  path, made = tmp_path / "sub" / "answers.jsonl", []

  def make(answer):
    return lambda: made.append(answer) or answer

  cache = acceptance.AnswerCache(path)
  assert cache.get("m", [1, 2], 8, make([5, 6])) == [5, 6]
  assert cache.get("m", [1, 2], 8, make([0])) == [5, 6]  # cached: not made again
  assert cache.get("m", [1, 2], 9, make([7])) == [7]  # another length is another request
  assert cache.get("m", [1, 3], 8, make([8])) == [8]
  assert cache.get("n", [1, 2], 8, make([9])) == [9]
  assert made == [[5, 6], [7], [8], [9]]
  again = acceptance.AnswerCache(path)  # read back from the file
  assert again.get("m", [1, 2], 8, make([0])) == [5, 6] and made == [[5, 6], [7], [8], [9]]
  path.write_text('{"answer": [1]}\n')
  with pytest.raises(ValueError, match="non-empty string .key."):
    acceptance.AnswerCache(path)
  path.write_text('{"key": "k", "answer": 3}\n')
  with pytest.raises(ValueError, match="1: not an answers file"):
    acceptance.AnswerCache(path)


@pytest.mark.slow
def test_real_run_prints_one_row_per_category(spec_bench_path, tmp_path, capsys):
  rows = [json.loads(line) for line in spec_bench_path.read_text().splitlines()]
  cats = ["math_reasoning", "translation"]
  small = tmp_path / "p.jsonl"
  small.write_text("".join(json.dumps(next(r for r in rows if r["category"] == c)) + "\n"
                           for c in cats))
  answers = tmp_path / "answers.jsonl"
  args = ["--prompts", str(small), "--drafter", "shipped", "--drafter", "shipped",
          "--per-category", "1", "--max-new-tokens", "24", "--answers", str(answers)]
  assert acceptance.main(args) == 0
  table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
  assert len(answers.read_text().splitlines()) == 2
  assert acceptance.main(args) == 0  # from the kept answers: the same table
  assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")] == table
  assert len(answers.read_text().splitlines()) == 2
  assert [line.split(" | ")[0][2:] for line in table[2:]] == cats + ["**all**"]
  for line in table[2:]:
    cells = line.strip("| ").split(" | ")
    assert int(cells[1]) > 0
    assert cells[2:5] == cells[5:8]  # the same drafter twice scores the same
    assert all(0.0 <= float(c) <= 1.0 for c in cells[2:4]) and 1.0 <= float(cells[4]) <= 5.0
