"""``bench throughput`` runs every row end to end (tiny random model; numbers not checked)."""

import json

import pytest

from redrafter_jax.bench import throughput
from tests.test_trainer import TINY


def test_every_row_is_measured(tmp_path, capsys):
  prompts = tmp_path / "p.jsonl"
  prompts.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in
                             enumerate(["Hello there", "Write a poem", "Add 2 and 3", "A cat"])))
  assert throughput.main(["--model", "random:tiny", "--prompts", str(prompts),
                          "--forward-shapes", "2x32", "--gen-prompts", "4", "--gen-batch", "2",
                          "--sampled-fraction", "0.5", "--max-new-tokens", "8,16",
                          "--config", str(TINY), "--train-steps", "1", "--reps", "1",
                          "--decode-steps", "2x16,2x64"]) == 0
  table = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| ")][2:]
  jobs = [l.split(" | ")[0][2:] for l in table]
  assert jobs == (["forward (roofline)"] * 2 + ["decode step"] * 2 +
                  ["teacher generation"] * 2 + ["training", "features (once per data)",
                   "training from features"])
  assert all(float(l.split(" | ")[2]) > 0 for l in table)
  assert "8 new" in table[4] and "16 new" in table[5]


def test_roofline_only_and_bad_shapes(tmp_path, capsys):
  prompts = tmp_path / "p.jsonl"
  prompts.write_text(json.dumps({"id": "0", "prompt": "Hi"}) + "\n")
  assert throughput.main(["--model", "random:tiny", "--prompts", str(prompts), "--reps", "1",
                          "--forward-shapes", "2x8", "--decode-steps", "4x32",
                          "--roofline-only"]) == 0
  table = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| ")][2:]
  assert [l.split(" | ")[0][2:] for l in table] == ["forward (roofline)"] * 2 + ["decode step"]
  assert "batch 4, cache 32 slots" in table[2]
  with pytest.raises(SystemExit):
    throughput.main(["--prompts", str(prompts), "--decode-steps", "4x1"])
  assert "--decode-steps" in capsys.readouterr().err
