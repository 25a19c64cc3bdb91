"""Teacher data generation: contents, resumption, settings checks and input errors."""

import json
import os
import pathlib

import numpy as np
import pytest

from redrafter_jax import cli
from redrafter_jax.inference.ar import generate
from redrafter_jax.inference.runtime import pack_prompts
from redrafter_jax.training import data, distill
from redrafter_jax.training.data import DataError
from redrafter_jax.weights import base_model
from redrafter_jax.weights.tokenizer import ByteTokenizer, encode, stop_token_ids

PROMPTS = ["Tell me a story.", "What is 2 + 2?", "Name three colours.", "Hi",
           "Explain gravity to a child in two sentences.", "Write a haiku about rain.",
           "Why is the sky blue?", "List the planets."]


@pytest.fixture(scope="module")
def teacher():
  llm, _ = base_model.load_base_model("random:tiny")
  return llm, base_model.load_base_tokenizer("random:tiny")


@pytest.fixture
def prompts_file(tmp_path):
  path = tmp_path / "prompts.jsonl"
  path.write_text("".join(json.dumps({"id": f"p{i}", "source": "test", "category": "misc",
                                      "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
  return path


KW = dict(model_name="random:tiny", max_new_tokens=12, batch_size=4, sampled_fraction=0.5,
          shard_size=4, seed=1, progress=False)


def test_shards_hold_prompt_plus_the_llms_own_response(teacher, prompts_file, tmp_path):
  llm, tok = teacher
  stats = distill.distill(llm, tok, prompts_file, tmp_path / "d", **KW)
  records = data.read_records(tmp_path / "d")
  sampled = [r for r in records if r["sampled"]]
  greedy = {r["id"]: r for r in records if not r["sampled"]}
  assert sorted(greedy) == [f"p{i}" for i in range(len(PROMPTS))]
  assert 0 < len(sampled) < len(PROMPTS)  # a seeded fraction also sampled
  assert stats.records == len(records) and stats.shards_written == -(-len(records) // 4)
  # Greedy responses are exactly what plain greedy decoding of the same LLM gives.
  prompts = [encode(tok, p, chat=True) for p in PROMPTS]
  expected = generate(llm, prompts, max_new_tokens=12, stop_ids=stop_token_ids(tok))
  for i, (prompt, response) in enumerate(zip(prompts, expected.tokens)):
    rec = greedy[f"p{i}"]
    assert rec["tokens"].tolist() == prompt + response
    assert rec["mask"].tolist() == [0] * len(prompt) + [1] * len(response)
  for rec in sampled:
    i = int(rec["id"][1:])
    assert rec["tokens"][:len(prompts[i])].tolist() == prompts[i]
    assert 1 <= int(rec["mask"].sum()) <= 12
  # ... and the training pipeline reads those same sequences back.
  it = data.make_iterator(tmp_path / "d", seq_len=128, global_batch=len(records), seed=0,
                          pack=False)
  batch = next(it)
  rows = sorted(tuple(batch["tokens"][r][batch["segment_ids"][r] > 0])
                for r in range(len(records)))
  assert rows == sorted(tuple(r["tokens"]) for r in records)


def test_rerun_resumes_and_skips_completed_shards(teacher, prompts_file, tmp_path):
  llm, tok = teacher
  first = distill.distill(llm, tok, prompts_file, tmp_path / "d", max_shards=1, **KW)
  assert first.shards_written == 1
  manifest = json.loads((tmp_path / "d" / data.MANIFEST).read_text())
  assert list(manifest["shards"]) == ["shard-00000.npz"]
  shard0 = tmp_path / "d" / "shard-00000.npz"
  before = (shard0.read_bytes(), os.stat(shard0).st_mtime_ns)
  # A crash mid-shard leaves only a temporary file, which is neither listed nor read.
  (tmp_path / "d" / ".shard-00001.npz.tmp").write_bytes(b"partial")
  second = distill.distill(llm, tok, prompts_file, tmp_path / "d", **KW)
  assert second.shards_skipped == 1 and second.shards_written >= 1
  assert (shard0.read_bytes(), os.stat(shard0).st_mtime_ns) == before  # not rewritten
  third = distill.distill(llm, tok, prompts_file, tmp_path / "d", **KW)
  assert third.shards_written == 0 and third.records == 0
  # The resumed folder holds exactly what one uninterrupted run writes.
  distill.distill(llm, tok, prompts_file, tmp_path / "once", **KW)
  key = lambda r: (r["id"], r["sampled"], tuple(r["tokens"]), tuple(r["mask"]))
  assert sorted(map(key, data.read_records(tmp_path / "d"))) == sorted(
      map(key, data.read_records(tmp_path / "once")))


def test_rerun_with_other_settings_is_refused(teacher, prompts_file, tmp_path):
  llm, tok = teacher
  distill.distill(llm, tok, prompts_file, tmp_path / "d", max_shards=1, **KW)
  with pytest.raises(DataError, match="max_new_tokens: 12 -> 20"):
    distill.distill(llm, tok, prompts_file, tmp_path / "d", **dict(KW, max_new_tokens=20))


def test_prompt_file_errors_name_the_line(tmp_path):
  with pytest.raises(DataError, match="prompts file not found"):
    distill.read_prompts(tmp_path / "missing.jsonl")
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"id": "a", "prompt": "ok"}\n\n{"id": "b", "prompt": \n')
  with pytest.raises(DataError, match=r"bad.jsonl:3: not valid JSON"):
    distill.read_prompts(bad)
  bad.write_text('{"id": "a", "prompt": "ok"}\n{"id": "b", "text": "no prompt"}\n')
  with pytest.raises(DataError, match=r"bad.jsonl:2: expected an object with a non-empty"):
    distill.read_prompts(bad)


def test_cli_runs_and_reports_errors_in_one_line(prompts_file, tmp_path, capsys):
  out = tmp_path / "cli"
  argv = ["distill-data", "--prompts", str(prompts_file), "--out", str(out), "--model",
          "random:tiny", "--limit", "3", "--max-new-tokens", "4", "--batch-size", "2",
          "--shard-size", "2", "--sampled-fraction", "0"]
  assert cli.main(argv) == 0
  assert len(data.read_records(out)) == 3
  assert "skipped 0" in capsys.readouterr().out
  assert cli.main(argv) == 0
  assert "wrote 0 shard(s)" in capsys.readouterr().out and len(data.read_records(out)) == 3
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "fine"}\nnot json\n')
  argv[2] = str(bad)
  assert cli.main(argv[:4] + [str(tmp_path / "x")] + argv[5:]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "bad.jsonl:2: not valid JSON" in err[0], err


def test_tokenizer_must_fit_the_model(prompts_file, tmp_path):
  from redrafter_jax.config import ConfigError

  class Big(ByteTokenizer):  # ids up to 400 + 255: beyond a 300-token model
    def _bytes(self, text):
      return [400 + b for b in text.encode()]

  llm, _ = base_model.load_base_model('random:{"vocab_size": 300}')
  with pytest.raises(ConfigError, match="vocab_size is 300"):
    distill.distill(llm, Big(), prompts_file, tmp_path / "d", **KW)


@pytest.mark.slow
def test_real_model_greedy_records(smollm2, tmp_path):
  llm, _, tok = smollm2
  path = pathlib.Path(__file__).resolve().parents[1] / "data" / "sources" / \
      "train_prompts.jsonl.gz"
  distill.distill(llm, tok, path, tmp_path / "d", model_name="smollm2-135m", limit=2,
                  max_new_tokens=16, batch_size=2, sampled_fraction=0.0, progress=False)
  records = data.read_records(tmp_path / "d")
  assert len(records) == 2
  for rec in records:
    response = rec["tokens"][rec["mask"] > 0]
    assert 1 <= len(response) <= 16
    assert tok.decode(response.tolist()).strip()  # real text, not empty


def test_first_shards_are_a_uniform_sample_sorted_within_shards():
  """Stopping after k shards must not leave only the shortest prompts (an early run of ours did:
  jobs sorted globally by length put 612 short, mostly code prompts in the first 3 shards)."""
  from redrafter_jax.training.distill import plan_jobs

  lengths = list(range(1000))  # prompt i has length i
  jobs = plan_jobs(lengths, 0.25, seed=0, shard_size=100)
  assert sorted((j.prompt, j.sampled) for j in jobs) == sorted(
      {(j.prompt, j.sampled) for j in jobs})  # no job twice
  assert sum(not j.sampled for j in jobs) == 1000
  first = [lengths[j.prompt] for j in jobs[:100]]
  for kind in (False, True):  # batches inside a shard pad little
    of_kind = [lengths[j.prompt] for j in jobs[:100] if j.sampled == kind]
    assert of_kind == sorted(of_kind)
  assert 300 < np.mean(first) < 700 and max(first) > 900 and min(first) < 100


def test_a_job_killed_mid_shard_resumes_to_what_one_run_writes(teacher, prompts_file, tmp_path,
                                                               monkeypatch):
  """Kill generation inside the second shard (after one of its batches): the first shard is
  kept, nothing of the second is, and a rerun completes the folder exactly."""
  llm, tok = teacher
  real, calls = distill.generate, []

  def dies_in_shard_two(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2 + 1:  # shard 0 is 1 batch of 4 (shard_size 4), then shard 1's 2nd batch
      raise KeyboardInterrupt
    return real(*args, **kwargs)

  kw = dict(KW, batch_size=2)
  monkeypatch.setattr(distill, "generate", dies_in_shard_two)
  with pytest.raises(KeyboardInterrupt):
    distill.distill(llm, tok, prompts_file, tmp_path / "d", **kw)
  manifest = json.loads((tmp_path / "d" / data.MANIFEST).read_text())
  assert list(manifest["shards"]) == ["shard-00000.npz"]
  assert sorted(p.name for p in (tmp_path / "d").glob("shard-*")) == ["shard-00000.npz"]
  entry = manifest["shards"]["shard-00000.npz"]
  assert entry["cpu_seconds"] > 0 and entry["seconds"] > 0 and "cpus" in entry["machine"]
  monkeypatch.setattr(distill, "generate", real)
  distill.distill(llm, tok, prompts_file, tmp_path / "d", **kw)
  distill.distill(llm, tok, prompts_file, tmp_path / "once", **kw)
  key = lambda r: (r["id"], r["sampled"], tuple(r["tokens"]), tuple(r["mask"]))
  assert list(map(key, data.read_records(tmp_path / "d"))) == list(
      map(key, data.read_records(tmp_path / "once")))


def test_greedy_jobs_come_before_sampled_ones_in_each_shard():
  """So that batches are mostly all-greedy (no per-step random draw over the vocabulary)."""
  jobs = distill.plan_jobs([5, 3, 9, 1, 7, 2, 8, 4], sampled_fraction=0.5, seed=0, shard_size=6)
  assert any(j.sampled for j in jobs)
  for k in range(0, len(jobs), 6):
    kinds = [j.sampled for j in jobs[k:k + 6]]
    assert kinds == sorted(kinds)


def _plan_jobs_before_several_answers(lengths, sampled_fraction, seed, shard_size):
  """``plan_jobs`` as it was when ``sampled_fraction`` was at most 1 (data/teacher/mix-v1 was
  written with it): the reference that plans of ``f <= 1`` must keep matching."""
  rng = np.random.default_rng(seed)
  draw = rng.random(len(lengths))
  jobs = [(i, False) for i in range(len(lengths))]
  jobs += [(i, True) for i in range(len(lengths)) if draw[i] < sampled_fraction]
  jobs = [jobs[i] for i in rng.permutation(len(jobs))]
  by_length = lambda j: (j[1], lengths[j[0]], j[0])
  return [job for k in range(0, len(jobs), shard_size)
          for job in sorted(jobs[k:k + shard_size], key=by_length)]


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.25, 0.5, 0.999, 1.0])
def test_plans_of_at_most_one_sampled_answer_are_unchanged(fraction):
  """Folders written before several answers per prompt existed must resume as the same job."""
  for seed, n, shard_size in [(0, 1, 4), (0, 200, 64), (1, 333, 256), (7, 50, 7), (3, 1000, 100)]:
    lengths = list(np.random.default_rng(seed + 100).integers(1, 50, n))
    jobs = distill.plan_jobs(lengths, fraction, seed=seed, shard_size=shard_size)
    assert [(j.prompt, j.sampled) for j in jobs] == _plan_jobs_before_several_answers(
        lengths, fraction, seed, shard_size)
    assert all(j.sample == 0 for j in jobs)
  assert distill.JOB_ORDER == "shuffled; within shards greedy jobs first, each kind length-sorted"


def test_several_sampled_answers_per_prompt():
  lengths = list(range(1, 2001))
  jobs = distill.plan_jobs(lengths, 2.5, seed=0, shard_size=256)
  assert len({(j.prompt, j.sampled, j.sample) for j in jobs}) == len(jobs)  # no job twice
  sampled = np.bincount([j.prompt for j in jobs if j.sampled], minlength=len(lengths))
  assert set(sampled) == {2, 3} and abs(sampled.mean() - 2.5) < 0.05
  assert sum(not j.sampled for j in jobs) == len(lengths)
  for k in range(0, len(jobs), 256):  # still greedy first, each kind length-sorted
    shard = jobs[k:k + 256]
    assert [j.sampled for j in shard] == sorted(j.sampled for j in shard)
  whole = distill.plan_jobs(lengths[:10], 3.0, seed=0, shard_size=8)
  assert sorted((j.prompt, j.sample) for j in whole if j.sampled) == [
      (i, s) for i in range(10) for s in range(3)]
  for bad in (-0.1, distill.MAX_SAMPLED + 0.5, float("nan")):
    with pytest.raises(distill.ConfigError, match="sampled answers per prompt"):
      distill.plan_jobs(lengths, bad, seed=0, shard_size=256)


def test_sampled_answers_of_one_prompt_differ(teacher, prompts_file, tmp_path):
  """Duplicates of a prompt sit in other rows of a batch (each row draws its own noise) or in
  other batches (each with its own seed): every sampled answer is a draw of its own."""
  llm, tok = teacher
  kw = dict(KW, sampled_fraction=3, shard_size=8, batch_size=4)
  stats = distill.distill(llm, tok, prompts_file, tmp_path / "d", **kw)
  records = data.read_records(tmp_path / "d")
  assert stats.records == len(records) == 4 * len(PROMPTS)
  by_prompt = {}
  for r in records:
    if r["sampled"]:
      by_prompt.setdefault(r["id"], []).append(tuple(r["tokens"]))
  assert sorted(by_prompt) == sorted(f"p{i}" for i in range(len(PROMPTS)))
  for answers in by_prompt.values():
    assert len(answers) == 3 and len(set(answers)) == 3, answers
  manifest = json.loads((tmp_path / "d" / data.MANIFEST).read_text())
  assert manifest["settings"]["sampled_fraction"] == 3
  with pytest.raises(distill.ConfigError, match="same sampling seed"):
    distill.distill(llm, tok, prompts_file, tmp_path / "e", **dict(kw, batch_size=1,
                                                                     shard_size=1010))


class FakeClock:
  """A clock that moves only when ``generate`` is called: ``per_batch`` seconds a batch, and
  ``first_extra`` more for the first (its compiles)."""

  def __init__(self, monkeypatch, per_batch, first_extra=0.0, real=distill.generate):
    self.now, self.calls = 1000.0, 0

    def generate(*args, **kwargs):
      self.calls += 1
      self.now += per_batch + (first_extra if self.calls == 1 else 0.0)
      return real(*args, **kwargs)

    monkeypatch.setattr(distill, "clock", lambda: self.now)
    monkeypatch.setattr(distill, "generate", generate)


def test_time_budget_stops_before_a_shard_that_would_not_finish(teacher, prompts_file, tmp_path,
                                                                monkeypatch):
  llm, tok = teacher
  kw = dict(KW, sampled_fraction=1, shard_size=4, batch_size=2)  # 16 jobs: 4 shards of 2 batches

  def budgeted(out, seconds):  # a call's shard 0 takes 50 s (its compiles), later ones 20 s
    FakeClock(monkeypatch, per_batch=10.0, first_extra=30.0)
    return distill.distill(llm, tok, prompts_file, out, max_seconds=seconds, **kw)

  # After shard 0 (50 s) shard 1 is estimated at 50 s: 100 s > 99 s, so it is not started.
  stats = budgeted(tmp_path / "d", 99)
  assert (stats.shards_written, stats.shards_left, stats.stopped_at_budget) == (1, 3, True)
  # At 100 s shard 1 runs (to 70 s); then the first shard's compiles are left out of the
  # estimate (20 s a shard): shard 2 ends at 90 s, and shard 3 would end at 110 s.
  stats = budgeted(tmp_path / "e", 100)
  assert (stats.shards_written, stats.shards_left, stats.stopped_at_budget) == (3, 1, True)
  assert stats.records == 12 and stats.seconds == 90.0
  manifest = json.loads((tmp_path / "e" / data.MANIFEST).read_text())
  assert sorted(manifest["shards"]) == [distill.shard_name(k) for k in range(3)]
  assert [s["seconds"] for s in manifest["shards"].values()] == [50.0, 20.0, 20.0]
  # A call's first shard always runs (here the one left): the folder is complete, and equal to
  # what one call without a budget writes.
  stats = budgeted(tmp_path / "e", 0)
  assert (stats.shards_written, stats.shards_left, stats.stopped_at_budget) == (1, 0, False)
  budgeted(tmp_path / "once", None)
  key = lambda r: (r["id"], r["sampled"], tuple(r["tokens"]), tuple(r["mask"]))
  assert list(map(key, data.read_records(tmp_path / "e"))) == list(
      map(key, data.read_records(tmp_path / "once")))


def test_several_prompt_files_are_read_in_order(teacher, prompts_file, tmp_path):
  llm, tok = teacher
  other = tmp_path / "more.jsonl"
  other.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"More {i}?"}) + "\n"
                           for i in range(3)))  # the same ids as the first file: fine
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  kw = dict(KW, sampled_fraction=0)
  stats = distill.distill(llm, tok, [prompts_file, empty, other], tmp_path / "d", **kw)
  records = data.read_records(tmp_path / "d")
  assert stats.records == len(records) == len(PROMPTS) + 3
  texts = sorted(tok.decode(r["tokens"].tolist()) for r in records)
  assert sum("More " in t for t in texts) == 3
  settings = json.loads((tmp_path / "d" / data.MANIFEST).read_text())["settings"]
  assert settings["prompts"] == "prompts.jsonl+empty.jsonl+more.jsonl"
  assert len(settings["prompts_sha256"]) == 16
  # Another order is another job.
  with pytest.raises(DataError, match="prompts: "):
    distill.distill(llm, tok, [other, empty, prompts_file], tmp_path / "d", **kw)
  # One file (alone or as a list of one) records exactly what folders always recorded.
  distill.distill(llm, tok, [prompts_file], tmp_path / "one", max_shards=1, **kw)
  settings = json.loads((tmp_path / "one" / data.MANIFEST).read_text())["settings"]
  assert set(settings) == {"model", "vocab_size", "prompts", "prompts_sha256", "limit",
                           "max_new_tokens", "sampled_fraction", "shard_size",
                           "max_prompt_tokens", "seed", "num_shards", "order"}
  import hashlib
  assert settings["prompts"] == "prompts.jsonl" and settings["prompts_sha256"] == hashlib.sha256(
      prompts_file.read_bytes()).hexdigest()[:16]
  distill.distill(llm, tok, prompts_file, tmp_path / "one", **kw)  # resumes as the same job
  with pytest.raises(DataError, match="no prompts"):
    distill.distill(llm, tok, [empty, empty], tmp_path / "x", **kw)


def test_cli_takes_several_prompt_files_and_a_time_budget(prompts_file, tmp_path, capsys):
  other = tmp_path / "more.jsonl"
  other.write_text(json.dumps({"id": "m0", "prompt": "One more?"}) + "\n")
  out = tmp_path / "cli"
  argv = ["distill-data", "--prompts", str(prompts_file), str(other), "--out", str(out),
          "--model", "random:tiny", "--max-new-tokens", "4", "--batch-size", "3",
          "--shard-size", "3", "--sampled-fraction", "0", "--max-seconds", "0"]
  assert cli.main(argv) == 0
  line = capsys.readouterr().out
  assert "wrote 1 shard(s) (3 sequences" in line, line
  assert "stopped at the time budget, 2 shard(s) left (rerun to continue)" in line, line
  assert cli.main(argv[:-2]) == 0
  line = capsys.readouterr().out
  assert "wrote 2 shard(s) (6 sequences" in line and "skipped 1" in line, line
  assert "left" not in line and len(data.read_records(out)) == len(PROMPTS) + 1
  assert cli.main(argv[:-2] + ["--sampled-fraction", "17"]) == 2
  assert "(sampled answers per prompt) must be in [0, 16], got 17" in capsys.readouterr().err


def test_one_prompt_bucket_runs_every_batch_at_one_shape(teacher, prompts_file, tmp_path,
                                                         monkeypatch):
  """With ``prompt_multiple`` at least the longest prompt, every batch pads to the same prompt
  length and cache size (on a GPU each new shape is a compile of tens of seconds), and the
  greedy answers are still plain greedy decoding's."""
  llm, tok = teacher
  real, shapes = distill.generate, set()

  def spy(model, prompts, **kwargs):
    tokens_BT, _ = pack_prompts(prompts, multiple=kwargs["prompt_multiple"])
    shapes.add((tokens_BT.shape, kwargs["cache_size"]))
    return real(model, prompts, **kwargs)

  monkeypatch.setattr(distill, "generate", spy)
  distill.distill(llm, tok, prompts_file, tmp_path / "d", **dict(KW, sampled_fraction=0.0),
                  max_prompt_tokens=64, prompt_multiple=64)
  assert len(shapes) == 1
  prompts = [encode(tok, p, chat=True) for p in PROMPTS]
  expected = generate(llm, prompts, max_new_tokens=12, stop_ids=stop_token_ids(tok))
  got = {r["id"]: r["tokens"].tolist() for r in data.read_records(tmp_path / "d")}
  assert [got[f"p{i}"] for i in range(len(PROMPTS))] == [
      p + r for p, r in zip(prompts, expected.tokens)]
  # small buckets: several prompt lengths, still one cache size for the whole run
  shapes.clear()
  distill.distill(llm, tok, prompts_file, tmp_path / "e", **dict(KW, sampled_fraction=0.0),
                  prompt_multiple=8)
  assert len({s for s, _ in shapes}) > 1 and len({cache for _, cache in shapes}) == 1
