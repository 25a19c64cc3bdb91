"""The distillation prompt mix: deterministic, deduplicated, broad, free of the eval set."""

import json

import pytest

from redrafter_jax import cli
from redrafter_jax.training import prompt_mix
from redrafter_jax.training.data import DataError


def _jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


@pytest.fixture
def data_dir(tmp_path):
  d = tmp_path / "data"
  d.mkdir()
  _jsonl(d / "train_prompts.jsonl", [
      {"id": f"m{i}", "category": "math", "source": "gsm", "prompt": f"What is {i} + {i}?"}
      for i in range(30)] + [
      {"id": "c0", "category": "code", "prompt": "Write a loop."},
      {"id": "c1", "category": "code", "prompt": "Write  a loop."},  # same text, other spaces
      {"id": "c2", "category": "code", "prompt": "Line one\u2028still the same prompt"}])
  _jsonl(d / "qa_prompts.jsonl", [{"id": f"q{i}", "category": "qa", "prompt": f"Who is {i}?"}
                                  for i in range(5)])
  _jsonl(d / "passages.jsonl", [{"id": f"p{i}", "source": "gpt", "text": f"Passage {i}. " * 40}
                                for i in range(6)])
  return d


def test_mix_is_deterministic_deduplicated_and_broad(data_dir):
  a = prompt_mix.build_mix(data_dir, tasks_per_passage=3, seed=7)
  assert a == prompt_mix.build_mix(data_dir, tasks_per_passage=3, seed=7)
  assert a != prompt_mix.build_mix(data_dir, tasks_per_passage=3, seed=8)
  texts = [" ".join(r.prompt.split()) for r in a]
  assert len(texts) == len(set(texts)) and len({r.id for r in a}) == len(a)
  assert "c1" not in {r.id for r in a}  # a duplicate of c0 up to whitespace
  assert any("\u2028" in r.prompt for r in a)  # a line separator inside a JSON string is text
  counts = prompt_mix.count_mix(a)
  assert counts["math"] == 30 and counts["qa"] == 10  # each question as written and framed
  ctx = [r for r in a if r.id.startswith("p")]
  assert len(ctx) == 18 and {r.id.split("/")[0] for r in ctx} == {f"p{i}" for i in range(6)}
  assert len({r.id.split("/")[1] for r in ctx}) > 3  # the tasks vary across passages
  for r in ctx:
    category, template = prompt_mix.CONTEXT_TASKS[r.id.split("/")[1]]
    assert r.category == category and "Passage" in r.prompt


def test_caps_and_exclusions(data_dir, tmp_path):
  capped = prompt_mix.build_mix(data_dir, max_per_category=4)
  assert max(prompt_mix.count_mix(capped).values()) == 4
  assert capped == prompt_mix.build_mix(data_dir, max_per_category=4)
  ids = [r.id for r in capped]
  full_ids = [r.id for r in prompt_mix.build_mix(data_dir)]
  assert ids == [i for i in full_ids if i in set(ids)]  # file order kept
  ev = tmp_path / "eval.jsonl"
  _jsonl(ev, [{"prompt": "What is 3 + 3?"}, {"prompt": "Who is  2?"}])
  kept = {r.prompt for r in prompt_mix.build_mix(data_dir, exclude=[ev])}
  assert "What is 3 + 3?" not in kept and "Who is 2?" not in kept and "What is 4 + 4?" in kept
  with pytest.raises(DataError, match="max_per_category must be >= 1"):
    prompt_mix.build_mix(data_dir, max_per_category=0)
  with pytest.raises(DataError, match="tasks_per_passage"):
    prompt_mix.build_mix(data_dir, tasks_per_passage=0)


def test_seeds_are_distinct_balanced_and_deterministic():
  seeds = prompt_mix.self_prompt_seeds(2000, seed=0)
  assert seeds == prompt_mix.self_prompt_seeds(2000, seed=0)
  assert len({s.prompt for s in seeds}) == 2000
  counts = prompt_mix.count_mix(seeds[:len(prompt_mix.SEED_TASKS) * 10])
  assert set(counts.values()) == {10}  # any prefix is balanced across categories
  with pytest.raises(DataError, match="task x topic lists hold"):
    prompt_mix.self_prompt_seeds(10**6, seed=0)


def test_cli_writes_the_mix_and_seeds(data_dir, tmp_path, capsys):
  out, seeds = tmp_path / "mix.jsonl", tmp_path / "seeds.jsonl"
  assert cli.main(["prompt-mix", "--data", str(data_dir), "--out", str(out), "--seeds-out",
                   str(seeds), "--num-seeds", "50"]) == 0
  rows = [json.loads(line) for line in out.read_text().split("\n") if line]
  assert {"id", "category", "source", "prompt"} <= set(rows[0])
  assert len(seeds.read_text().split("\n")) == 51
  assert cli.main(["prompt-mix", "--data", str(tmp_path / "nope"), "--out", str(out)]) == 2
  assert "train_prompts.jsonl" in capsys.readouterr().err


def test_gzipped_prompt_files_are_reproducible_and_read_back(data_dir, tmp_path):
  from redrafter_jax.training import distill

  rows = prompt_mix.build_mix(data_dir)
  a, b = tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.gz"
  prompt_mix.write_rows(rows, a)
  prompt_mix.write_rows(rows, b)
  assert a.read_bytes() == b.read_bytes()  # the manifest's prompts digest stays the same
  assert a.stat().st_size < len("".join(r.prompt for r in rows)) / 2
  back = distill.read_prompts(a)
  assert [(p.id, p.category, p.text) for p in back] == [(r.id, r.category, r.prompt)
                                                         for r in rows]


def test_gzipped_sources_give_the_same_mix(data_dir, tmp_path):
  import gzip

  gz = tmp_path / "gz"
  gz.mkdir()
  for f in data_dir.iterdir():
    (gz / f"{f.name}.gz").write_bytes(gzip.compress(f.read_bytes(), mtime=0))
  assert prompt_mix.build_mix(gz, seed=3) == prompt_mix.build_mix(data_dir, seed=3)
  (gz / "qa_prompts.jsonl.gz").unlink()
  with pytest.raises(DataError, match="no qa_prompts.jsonl or qa_prompts.jsonl.gz"):
    prompt_mix.build_mix(gz)


def test_the_committed_mix_is_rebuilt_byte_for_byte_from_the_checkout(tmp_path, capsys):
  """data/README.md's command, on the sources the repository carries (data/sources, the default
  --data), writes exactly the committed data/prompts/mix-v1.jsonl.gz and seeds-v1.jsonl.gz."""
  root = prompt_mix.SOURCES.parent
  mix, seeds = tmp_path / "mix.jsonl.gz", tmp_path / "seeds.jsonl.gz"
  assert cli.main(["prompt-mix", "--out", str(mix), "--seeds-out", str(seeds),
                   "--num-seeds", "6000", "--max-per-category", "2000",
                   "--exclude", str(root / "spec_bench.jsonl.gz")]) == 0
  assert "12889 prompts" in capsys.readouterr().out
  assert mix.read_bytes() == (root / "prompts" / "mix-v1.jsonl.gz").read_bytes()
  assert seeds.read_bytes() == (root / "prompts" / "seeds-v1.jsonl.gz").read_bytes()
