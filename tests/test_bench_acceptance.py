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
  tokens_xT = np.broadcast_to(padded[None], (starts.size, padded.size))
  got = jax.nn.log_softmax(acceptance.teacher_forced_logits(d, feats_TX[starts], prev_xnD,
                                                            tokens_xT, starts), -1)
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


def test_copy_rule_copies_what_followed_the_latest_earlier_pair():
  #          0  1  2  3  4  5  6  7  8  9 10
  seq = np.array([5, 6, 7, 5, 6, 8, 5, 6, 9, 6, 5])
  guess, fires = acceptance.copy_rule(seq)
  # (5, 6) ends at 1, 4 and 7: at 4 the rule guesses 7 (after 0-1-2), at 7 it guesses 8 (after
  # the latest pair, 3-4-5); the pair (6, 5) ending at 10 never came before.
  assert fires.tolist() == [False] * 4 + [True] + [False] * 2 + [True] + [False] * 3
  assert guess[4] == 7 and guess[7] == 8 and (guess[~fires] == -1).all()
  assert not acceptance.copy_rule(np.array([3, 3]))[1].any()
  # A pair repeated at once: (3, 3) at 1 then at 2 guesses the token after 1, which is 3.
  guess, fires = acceptance.copy_rule(np.array([3, 3, 3, 4]))
  assert fires.tolist() == [False, False, True, False] and guess[2] == 3


def _reference_copy_rule(seq):
  out = []
  for j in range(len(seq)):
    hits = [i for i in range(1, j) if (seq[i - 1], seq[i]) == (seq[j - 1], seq[j])] if j else []
    out.append(seq[hits[-1] + 1] if hits else -1)
  return np.array(out)


def test_copy_rule_equals_a_loop_on_random_sequences():
  rng = np.random.default_rng(0)
  for size in (1, 2, 3, 50, 400):
    seq = rng.integers(0, 6, size)
    guess, fires = acceptance.copy_rule(seq)
    np.testing.assert_array_equal(guess, _reference_copy_rule(seq.tolist()))
    np.testing.assert_array_equal(fires, guess >= 0)


def _paired_answers(num, rng, rate=0.4, gain=0.05):
  """Per answer, the hits of a drafter and of one that is also right at ``gain`` more of the
  positions (paired: the same positions), with answer-level spread."""
  counts = rng.integers(20, 120, num)
  p = np.clip(rate + rng.normal(0, 0.15, num), 0.05, 0.9)
  base = rng.binomial(counts, p)
  better = base + rng.binomial(counts - base, gain / (1 - p))
  return np.stack([base, better], 1), counts


def test_paired_bootstrap_covers_a_known_difference_and_narrows_with_more_answers():
  rng = np.random.default_rng(1)
  widths = []
  for num in (50, 800):
    sums, counts = _paired_answers(num, rng)
    out = acceptance.paired_bootstrap(sums, counts)
    assert out.shape == (2, 3) and (out[0] == 0).all()
    d, low, high = out[1]
    assert low <= d <= high and low < 0.05 < high
    assert d == pytest.approx(sums[:, 1].sum() / counts.sum() - sums[:, 0].sum() / counts.sum())
    widths.append(high - low)
  assert widths[1] < 0.5 * widths[0]
  again = acceptance.paired_bootstrap(sums, counts)  # a fixed seed: the same interval
  np.testing.assert_array_equal(again, out)


def test_paired_bootstrap_of_identical_arms_is_zero():
  rng = np.random.default_rng(2)
  sums, counts = _paired_answers(40, rng)
  out = acceptance.paired_bootstrap(np.stack([sums[:, 0]] * 3, 1), counts)
  np.testing.assert_array_equal(out, np.zeros((3, 3)))
  with pytest.raises(ValueError, match="want sums"):
    acceptance.paired_bootstrap(sums, counts[:-1])


def _tiny_answers(tmp_path, drafter, llm):
  from redrafter_jax.training import eval_set

  rows = []
  for k, cat in enumerate(["b", "a", "b"]):
    prompt = tiny_models.random_tokens(10 + k, 7)
    answer = _answer_with_hits(llm, drafter, prompt, tiny_models.random_tokens(20 + k, 25))
    answer += prompt[2:7] + answer[3:9]  # copies, for the copy rule to find
    rows.append(eval_set.EvalAnswer(f"q{k}", cat, "random:tiny", tuple(prompt), tuple(answer)))
  return rows


def _reference_lookup(seq, max_ngram):
  """For each j, the token that followed the latest earlier end of the longest suffix of
  ``seq[:j+1]`` (up to ``max_ngram`` tokens) that occurred before; -1 where none did."""
  out = []
  for j in range(len(seq)):
    best = None  # (length, end)
    for e in range(j):
      k = 0
      while k < max_ngram and e - k >= 0 and seq[e - k] == seq[j - k]:
        k += 1
      if k and (best is None or (k, e) > best):
        best = (k, e)
    out.append(seq[best[1] + 1] if best else -1)
  return np.array(out)


def test_scores_join_the_hits_with_the_copy_rule(tmp_path):
  """``score_answers``' positions: step-1 hits equal ``teacher_forced_hits``', the copy rule
  is the loop's at the same alignment (the guess for the step-1 target), and two copies of a
  drafter differ by exactly [0, 0]."""
  llm, cfg, _ = tiny_models.load_tiny(tmp_path)
  d = Drafter(DrafterConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, exit_dim=48),
              rngs=nnx.Rngs(1))
  answers = _tiny_answers(tmp_path, d, llm)
  scored = acceptance.score_answers(llm, [d, d], answers, 3, progress=False)
  at = 0
  for a, ans in enumerate(answers):
    prompt, answer = list(ans.prompt), list(ans.answer)
    hits = acceptance.teacher_forced_hits(llm, d, prompt, answer, 3)
    rows = slice(at, at + hits.shape[0])
    at += hits.shape[0]
    assert (scored.answer_N[rows] == a).all()
    np.testing.assert_array_equal(scored.hits_KNn[0, rows], hits)
    np.testing.assert_array_equal(scored.target_N[rows], np.array(answer)[scored.position_N[rows]])
    assert scored.position_N[rows].tolist() == list(range(1, len(answer) - 2))
    guess = _reference_copy_rule(prompt + answer)[len(prompt) + scored.position_N[rows] - 1]
    np.testing.assert_array_equal(scored.rule_hit_N[rows], guess == scored.target_N[rows])
    np.testing.assert_array_equal(scored.rule_fires_N[rows], guess >= 0)
    looked = _reference_lookup(prompt + answer, 3)[len(prompt) + scored.position_N[rows] - 1]
    np.testing.assert_array_equal(scored.lookup_hit_N[rows], looked == scored.target_N[rows])
  assert at == scored.answer_N.size and scored.rule_hit_N.any()
  assert (scored.lookup_hit_N >= scored.rule_hit_N).mean() > 0.9  # it fires more often
  summary = acceptance.summarize(scored, 4)
  assert list(summary) == ["a", "b", "all"]
  assert summary["b"]["answers"] == 2 and summary["all"]["positions"] == at
  for row in summary.values():
    for interval in row["differences"][0].values():
      assert interval == [0.0, 0.0, 0.0]
    rule = row["copy_rule"]
    for drafter in rule["drafters"]:
      assert max(drafter["hit"], rule["hit"]) <= drafter["either"] <= drafter["hit"] + rule["hit"]
  hit = scored.hits_KNn[0, :, 0]
  assert summary["all"]["drafters"][0]["top-1 s1"] == pytest.approx(hit.mean())


def test_a_run_on_an_eval_set_writes_intervals_and_every_position(tmp_path, capsys):
  """On a fixed set (the tiny random LLM's): ``--drafter X --drafter X`` gives [0, 0]
  intervals; the report, scores.json and positions.npz agree; a drafter or model other than the
  set's is refused in one line."""
  from redrafter_jax.errors import UserError
  from redrafter_jax.training import eval_set
  from redrafter_jax.weights.base_model import load_base_model
  from redrafter_jax.weights.drafter_io import save_drafter

  llm, cfg = load_base_model("random:tiny")
  d = Drafter(DrafterConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, exit_dim=48),
              rngs=nnx.Rngs(1))
  path = eval_set.write_eval_set(_tiny_answers(tmp_path, d, llm), tmp_path / "set.jsonl.gz")
  folder = save_drafter(d, tmp_path / "drafter")
  out = tmp_path / "out"
  args = ["--eval-set", str(path), "--drafter", str(folder), "--drafter", str(folder),
          "--steps", "3", "--out", str(out)]
  assert acceptance.main(args) == 0
  printed = capsys.readouterr().out
  assert (out / "report.md").read_text().strip() == printed.strip()
  scores = json.loads((out / "scores.json").read_text())
  assert list(scores["categories"]) == ["a", "b", "all"] and scores["answers"] == 3
  for row in scores["categories"].values():
    assert all(iv == [0.0, 0.0, 0.0] for iv in row["differences"][0].values())
  assert "+0.000 [+0.000, +0.000]" in printed
  with np.load(out / "positions.npz") as z:
    assert z["hit"].shape == (scores["positions"], 2) and (z["hit"][:, 0] == z["hit"][:, 1]).all()
    assert z["category_names"].tolist() == ["a", "b"] and z["answer"].max() == 2
    assert z["rule_hit"].mean() == pytest.approx(scores["categories"]["all"]["copy_rule"]["hit"])
    assert z["hit"][:, 0].mean() == pytest.approx(
        scores["categories"]["all"]["drafters"][0]["top-1 s1"])
  assert acceptance.main(args[:2] + ["--model", "random:{\"seed\": 3}"] + args[2:]) == 2
  assert "holds 'random:tiny'" in capsys.readouterr().err
  wide = save_drafter(Drafter(DrafterConfig(vocab_size=cfg.vocab_size, hidden_size=32,
                                            exit_dim=48), rngs=nnx.Rngs(1)), tmp_path / "wide")
  with pytest.raises(UserError, match="made for an LLM of hidden size 32"):
    acceptance.main(["--eval-set", str(path), "--drafter", str(wide)])


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
  tables = _tables(capsys.readouterr().out)
  assert len(answers.read_text().splitlines()) == 2
  assert acceptance.main(args) == 0  # from the kept answers: the same tables
  assert _tables(capsys.readouterr().out) == tables
  assert len(answers.read_text().splitlines()) == 2
  scores, differences, copying = tables
  for table in tables:
    assert [line.split(" | ")[0][2:] for line in table[2:]] == cats + ["**all**"]
  for line in scores[2:]:
    cells = line.strip("| ").split(" | ")
    assert int(cells[1]) > 0
    # per drafter: top-1 s1, top-1 s2, W=1 run, s1 or rule, s1 or lookup; the same drafter
    # twice scores the same
    assert cells[2:7] == cells[7:12]
    assert all(0.0 <= float(c) <= 1.0 for c in cells[2:4]) and 1.0 <= float(cells[4]) <= 5.0
    assert float(cells[2]) <= float(cells[5]) <= 1.0  # or the rule: at least the drafter's
    assert float(cells[2]) <= float(cells[6]) <= 1.0  # or the lookup: the same
  for line in differences[2:]:
    assert line.count("+0.000 [+0.000, +0.000]") == 5
  for line in copying[2:]:
    cells = line.strip("| ").split(" | ")
    assert cells[4:8] == cells[8:12] and cells[4] == scores[copying.index(line)].split(" | ")[2]
    # the copy table's "either" is the scores table's "s1 or rule"
    assert cells[5] == scores[copying.index(line)].split(" | ")[5]


def _tables(text: str) -> list[list[str]]:
  """The markdown tables of a report, each a list of its lines."""
  out, current = [], []
  for line in text.splitlines() + [""]:
    if line.startswith("| "):
      current.append(line)
    elif current:
      out, current = out + [current], []
  return out
