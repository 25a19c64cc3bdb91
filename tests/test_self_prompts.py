"""Self-written prompts: the user-turn prefix, which samples count, exact resumption, errors."""

import json
import sys

import pytest

from redrafter_jax import cli
from redrafter_jax.training import self_prompts
from redrafter_jax.training.data import DataError
from redrafter_jax.weights.tokenizer import ByteTokenizer

GEN = sys.modules["redrafter_jax.inference.ar"]
TOK = ByteTokenizer()
PREFIX = [1] + TOK._bytes("user\n")


def fake_generate(calls):
  """A stand-in for ``generate``: row i of the batch drawn with seed s is, by i % 4, an unfinished
  turn, a too-short request, the same request every time, or a request unique to (s, i)."""

  def generate(llm, prompts, *, max_new_tokens, temperature, seed, stop_ids):
    calls.append(dict(prompts=prompts, temperature=temperature, seed=seed))
    tokens, stopped = [], []
    for i in range(len(prompts)):
      kind = i % 4
      text = ["never ends", "hi", "the same request", f"request {seed} {i}, please"][kind]
      tokens.append(TOK._bytes(text) + ([] if kind == 0 else [2]))
      stopped.append(kind != 0)
    return GEN.Result(tokens=tokens, stopped=stopped, steps=1)

  return generate


def _write(path, num, monkeypatch, **kw):
  calls = []
  monkeypatch.setattr(GEN, "generate", fake_generate(calls))
  stats = self_prompts.write_self_prompts(None, TOK, path, num=num, source="test",
                                          batch_size=8, progress=False, **kw)
  return stats, calls


def _rows(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def test_user_turn_prefix_stops_where_the_users_text_begins():
  assert self_prompts.user_turn_prefix(TOK) == PREFIX


def test_only_finished_new_requests_of_some_length_count(tmp_path, monkeypatch):
  path = tmp_path / "p.jsonl"
  stats, calls = _write(path, 5, monkeypatch, seed=3)
  rows = _rows(path)
  # Batch 0 keeps 3 (the shared request once, two unique), batch 1 two unique ones.
  assert [r["prompt"] for r in rows] == [
      "the same request", "request 3000009 3, please", "request 3000009 7, please",
      "request 3000010 3, please", "request 3000010 7, please"]
  assert [c["seed"] for c in calls] == [3000009, 3000010]
  assert all(c["prompts"] == [PREFIX] * 8 and c["temperature"] == 1.0 for c in calls)
  assert {r["category"] for r in rows} == {"self"} and len({r["id"] for r in rows}) == 5
  assert (stats.prompts, stats.new, stats.batches) == (5, 5, 2)


def test_resumed_file_equals_an_uninterrupted_one(tmp_path, monkeypatch):
  whole, parts = tmp_path / "whole.jsonl", tmp_path / "parts.jsonl"
  _write(whole, 8, monkeypatch)
  stats, _ = _write(parts, 8, monkeypatch, max_batches=1)
  assert stats.prompts == 3
  with open(parts, "a") as f:
    f.write('{"id": "self-b1-0", "pro')  # a write torn by a crash
  _, calls = _write(parts, 8, monkeypatch)
  assert [c["seed"] for c in calls] == [1, 2, 3]  # continues with batch 1
  assert parts.read_text() == whole.read_text()
  stats, calls = _write(parts, 8, monkeypatch)  # complete: nothing more is drawn
  assert (stats.new, calls) == (0, [])


def test_errors(tmp_path, monkeypatch):
  other = tmp_path / "other.jsonl"
  other.write_text(json.dumps({"id": "gsm8k-1", "prompt": "x"}) + "\n")
  with pytest.raises(DataError, match="not a file written by self-prompts"):
    _write(other, 4, monkeypatch)
  with pytest.raises(self_prompts.ConfigError, match="temperature must be > 0"):
    _write(tmp_path / "t.jsonl", 4, monkeypatch, temperature=0.0)
  assert cli.main(["self-prompts", "--model", "random:tiny", "--out", str(tmp_path / "c.jsonl"),
                   "--num", "0"]) == 2


def test_seeds_open_the_user_turn_and_give_the_category(tmp_path, monkeypatch):
  from redrafter_jax.training.prompt_mix import MixRow

  seeds = [MixRow(id="s0", category="writing", source="seed", prompt="Write a poem about"),
           MixRow(id="s1", category="stem", source="seed", prompt="Explain how")]
  path = tmp_path / "p.jsonl"
  stats, calls = _write(path, 4, monkeypatch, seed=0, seeds=seeds)
  seed_ids = [TOK._bytes(s.prompt) for s in seeds]
  assert calls[0]["prompts"] == [PREFIX + seed_ids[i % 2] for i in range(8)]
  rows = _rows(path)
  # Opening + continuation; the length rule counts the whole request (row 1's "hi" now counts).
  assert [r["prompt"] for r in rows[:2]] == ["Explain howhi", "Write a poem aboutthe same request"]
  for r in rows:
    i = int(r["id"].split("-")[-1])
    assert r["seed"] == seeds[i % 2].prompt and r["category"] == seeds[i % 2].category
    assert r["prompt"].startswith(r["seed"])


def test_time_budget_stops_before_a_batch_that_would_not_finish(tmp_path, monkeypatch):
  """A call's batch 0 takes 40 s (its compile), later ones 10 s, on a clock that moves only
  with the draws; the file stops on a complete batch and a rerun continues it exactly."""
  def budgeted(path, seconds, **kw):
    calls = []
    monkeypatch.setattr(self_prompts, "clock",
                        lambda: 1000.0 + 10 * len(calls) + (30 if calls else 0))
    monkeypatch.setattr(GEN, "generate", fake_generate(calls))
    return self_prompts.write_self_prompts(None, TOK, path, num=100, source="test",
                                           batch_size=8, progress=False, max_seconds=seconds,
                                           **kw)

  path = tmp_path / "p.jsonl"
  stats = budgeted(path, 79)  # batch 1 is estimated at 40 s: 80 s > 79 s
  assert (stats.batches, stats.stopped_at_budget, stats.seconds) == (1, True, 40.0)
  # Batch 1 ends at 50 s; then the compile is left out (10 s a batch): batches 2-4 end at 80 s.
  stats = budgeted(path, 80)
  assert (stats.batches, stats.stopped_at_budget, stats.seconds) == (5, True, 80.0)
  whole = tmp_path / "whole.jsonl"
  budgeted(whole, None, max_batches=6)
  assert path.read_text() == whole.read_text()
  stats = budgeted(path, 0, max_batches=3)  # the first batch of a call always runs
  assert (stats.batches, stats.stopped_at_budget) == (1, True)


def test_cli_time_budget(tmp_path, capsys):
  out = tmp_path / "c.jsonl"
  argv = ["self-prompts", "--model", "random:tiny", "--out", str(out), "--num", "1000",
          "--batch-size", "4", "--max-new-tokens", "4", "--max-seconds", "0"]
  assert cli.main(argv) == 0
  line = capsys.readouterr().out
  assert "from 1 batch(es)" in line and "stopped at the time budget (rerun to continue)" in line
  assert out.exists()
