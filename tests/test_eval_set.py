"""Fixed evaluation sets (training/eval_set.py): the file format, and the committed sets."""

import gzip
import json
import pathlib

import numpy as np
import pytest

from redrafter_jax.training import data, eval_set
from redrafter_jax.training.data import DataError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _answers():
  return [eval_set.EvalAnswer("p1", "math", "m", (1, 2, 3), (4, 5)),
          eval_set.EvalAnswer("p2", "code", "m", (6,), (7, 8, 9))]


def test_a_set_reads_back_what_was_written_byte_for_byte(tmp_path):
  a = eval_set.write_eval_set(_answers(), tmp_path / "a.jsonl.gz")
  b = eval_set.write_eval_set(eval_set.read_eval_set(a), tmp_path / "b.jsonl.gz")
  assert eval_set.read_eval_set(b) == _answers()
  assert a.read_bytes() == b.read_bytes()  # no timestamp in the gzip header
  assert eval_set.resolve("heldout") == eval_set.EVAL_DIR / eval_set.NAMES["heldout"]
  assert eval_set.resolve(a) == a


@pytest.mark.parametrize("line, needle", [
    ({"id": "x", "category": "c", "model": "m", "prompt": [1], "answer": []}, "'answer' must be"),
    ({"id": "x", "category": "c", "model": "m", "prompt": [1, -2], "answer": [3]},
     "'prompt' must be"),
    ({"id": "x", "model": "m", "prompt": [1], "answer": [3]}, "want a string 'category'"),
    ({"id": "p1", "category": "c", "model": "m", "prompt": [1], "answer": [3]}, "duplicate id"),
    ({"id": "x", "category": "c", "model": "n", "prompt": [1], "answer": [3]}, "model 'n'"),
])
def test_a_bad_line_is_named(tmp_path, line, needle):
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps(_answers()[0].row()) + "\n" + json.dumps(line) + "\n")
  with pytest.raises(DataError, match=f"bad.jsonl:2: .*{needle}"):
    eval_set.read_eval_set(path)


def test_scoring_with_another_model_is_refused():
  eval_set.check_model(_answers(), "m", 10, "here")
  with pytest.raises(DataError, match="holds 'm''s answers, not 'n''s: score it with --model m"):
    eval_set.check_model(_answers(), "n", 10, "here")
  with pytest.raises(DataError, match="token id 9, beyond 'm''s vocabulary of 9"):
    eval_set.check_model(_answers(), "m", 9, "here")


def test_greedy_records_become_answers():
  recs = [data.make_record([1, 2, 3, 4], [0, 0, 1, 1], id="a"),
          data.make_record([1, 2, 5], [0, 0, 1], id="a", sampled=True),
          data.make_record([7, 8], [0, 1], id="b")]
  got = eval_set.answers_from_records(recs, {"a": "x", "b": "y"}, "m")
  assert got == [eval_set.EvalAnswer("a", "x", "m", (1, 2), (3, 4)),
                 eval_set.EvalAnswer("b", "y", "m", (7,), (8,))]
  assert eval_set.greedy_indices(recs) == [0, 2]
  with pytest.raises(DataError, match="'b' is not in the prompts file"):
    eval_set.answers_from_records(recs, {"a": "x"}, "m")
  with pytest.raises(DataError, match="want a prompt, then a non-empty response"):
    eval_set.answers_from_records([data.make_record([1, 2], [1, 0], id="a")], {"a": "x"}, "m")


def test_the_held_out_set_is_the_greedy_answers_of_the_held_out_shard():
  """The committed ``heldout`` set is rebuilt from mix-v1's last shard exactly, and its answers
  are those the trainer's held-out batches hold for a run holding that shard out."""
  folder = ROOT / "data" / "teacher" / "mix-v1"
  answers = eval_set.read_eval_set("heldout")
  rebuilt = eval_set.answers_from_shard(folder / "shard-00062.npz",
                                        ROOT / "data" / "prompts" / "mix-v1.jsonl.gz")
  assert answers == rebuilt and len(answers) > 100
  assert {a.model for a in answers} == {"smollm2-135m"}
  assert len({a.category for a in answers}) >= 8
  held = data.read_shard(folder / "shard-00062.npz")
  assert len(answers) == len(eval_set.greedy_indices(held)) < len(held)
  with pytest.raises(DataError, match="is not the prompts file"):
    eval_set.answers_from_shard(folder / "shard-00062.npz", ROOT / "data" / "spec_bench.jsonl.gz")


def test_the_spec_bench_set_answers_the_first_ten_prompts_per_category():
  from redrafter_jax.bench.suite import select_prompts

  answers = eval_set.read_eval_set("specbench")
  picked = select_prompts(ROOT / "data" / "spec_bench.jsonl.gz", 10)
  by_id = {str(r["id"]): r["category"] for r in picked}
  assert len(answers) == 129 and len(picked) == 130  # one prompt is over 1,024 tokens
  assert [a.id for a in answers] == [i for i in by_id if i in {a.id for a in answers}]
  assert all(by_id[a.id] == a.category for a in answers)
  assert {a.model for a in answers} == {"smollm2-135m"}
  assert all(0 < len(a.answer) <= 128 for a in answers)
  assert np.mean([len(a.answer) == 128 for a in answers]) < 0.9  # stop tokens end answers
  raw = (eval_set.EVAL_DIR / eval_set.NAMES["specbench"]).read_bytes()
  assert raw[4:8] == b"\0\0\0\0" and gzip.decompress(raw)  # mtime 0
