"""``bench throughput`` runs every row end to end (tiny random model; numbers not checked)."""

import json

from redrafter_jax.bench import throughput
from tests.test_trainer import TINY


def test_every_row_is_measured(tmp_path, capsys):
  prompts = tmp_path / "p.jsonl"
  prompts.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in
                             enumerate(["Hello there", "Write a poem", "Add 2 and 3", "A cat"])))
  assert throughput.main(["--model", "random:tiny", "--prompts", str(prompts),
                          "--forward-shapes", "2x32", "--gen-prompts", "4", "--gen-batch", "2",
                          "--sampled-fraction", "0.5", "--max-new-tokens", "16",
                          "--config", str(TINY), "--train-steps", "1", "--reps", "1"]) == 0
  table = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| ")][2:]
  jobs = [l.split(" | ")[0][2:] for l in table]
  assert jobs == ["forward (roofline)"] * 2 + ["teacher generation", "training",
                                               "features (once per data)", "training from features"]
  assert all(float(l.split(" | ")[2]) > 0 for l in table)
