"""Teacher data generation: contents, resumption, settings checks and input errors."""

import json
import os
import pathlib

import numpy as np
import pytest

from redrafter_jax import cli
from redrafter_jax.inference.ar import generate
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
