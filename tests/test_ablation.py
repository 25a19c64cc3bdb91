"""`redrafter-jax ablate`: variants train like the trainer would, resume, and the table reads
their held-out scores; bad ablation files are refused before anything trains."""

import csv
import pathlib

import pytest
import yaml

from redrafter_jax import cli
from redrafter_jax.config import ConfigError, load_preset
from redrafter_jax.training import ablation as ablation_lib
from redrafter_jax.training import trainer
from tests.test_trainer import ROOT, TINY, write_synthetic


def write_ablation(tmp_path, variants, steps=4):
  data_dir = write_synthetic(tmp_path / "data", num=96)
  base = yaml.safe_load(TINY.read_text())
  base["train"].update(data=str(data_dir), output_dir=str(tmp_path / "runs"), seq_len=64,
                       num_steps=steps, eval_shards=1, eval_every=2, eval_batches=2,
                       checkpoint_every=2, log_every=1)
  (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
  path = tmp_path / "ablation.yaml"
  path.write_text(yaml.safe_dump({"base": str(tmp_path / "base.yaml"), "variants": variants},
                                 sort_keys=False))
  return path


def eval_rows(folder: pathlib.Path):
  with (folder / "eval.csv").open() as f:
    return list(csv.DictReader(f))


def test_variants_train_as_the_trainer_would_and_the_table_reads_them(tmp_path, capsys):
  path = write_ablation(tmp_path, {"baseline": {}, "wide": {"drafter.exit_dim": 64},
                                   "fast": {"train.learning_rate": 0.03}})
  out = tmp_path / "table.md"
  assert cli.main(["ablate", str(path), "--no-progress", "--out", str(out)]) == 0
  runs = tmp_path / "runs"
  base_eval = eval_rows(runs / "baseline")
  assert [r["step"] for r in base_eval] == ["2", "4"]
  # The baseline is the base preset trained alone: the same held-out scores, bit for bit.
  alone = load_preset(tmp_path / "base.yaml", {"train.output_dir": str(tmp_path / "alone")})
  trainer.train(alone, progress=False, export=False)
  assert eval_rows(tmp_path / "alone") == base_eval
  # Each variant changed what it says: other scores, and the wide drafter has more parameters.
  assert eval_rows(runs / "fast")[-1]["top1_1"] != base_eval[-1]["top1_1"]
  ab = ablation_lib.load_ablation(path)
  rows = {r["variant"]: r for r in (ablation_lib.variant_row(ab, n) for n in ab.variants)}
  assert rows["wide"]["params_m"] > rows["baseline"]["params_m"]
  assert rows["baseline"]["top1_1"] == pytest.approx(float(base_eval[-1]["top1_1"]))
  assert all(r["step"] == 4 for r in rows.values())
  table = out.read_text().splitlines()
  assert len(table) == 2 + 3 and table[3].startswith("| wide | drafter.exit_dim=64 | 4 |")
  assert "\n".join(table) in capsys.readouterr().out
  # A rerun resumes: nothing is trained again.
  assert cli.main(["ablate", str(path), "--no-progress"]) == 0
  assert eval_rows(runs / "baseline") == base_eval


def test_only_and_stop_after_train_a_slice(tmp_path, capsys):
  path = write_ablation(tmp_path, {"a": {}, "b": {"train.learning_rate": 0.01}})
  assert cli.main(["ablate", str(path), "--no-progress", "--only", "b",
                   "--stop-after-steps", "2"]) == 0
  assert not (tmp_path / "runs" / "a").exists()
  assert [r["step"] for r in eval_rows(tmp_path / "runs" / "b")] == ["2"]
  lines = capsys.readouterr().out.splitlines()
  assert any(l.startswith("| a | (base) | - |") for l in lines)
  assert any(l.startswith("| b | train.learning_rate=0.01 | 2 |") for l in lines)


@pytest.mark.parametrize("variants,needle", [
    ({"x": {"drafter.exit_dimm": 8}}, "exit_dimm"),
    ({"x": {"train.output_dir": "elsewhere"}}, "train.output_dir is set by the ablation"),
    ({"bad name": {}}, "variant name 'bad name'"),
    ({}, "'variants' must map names to overrides"),
    ({"x": ["train.seed=1"]}, "variant 'x' must map dotted keys to values"),
])
def test_bad_ablation_files_are_one_line_errors(tmp_path, capsys, variants, needle):
  path = write_ablation(tmp_path, variants)
  assert cli.main(["ablate", str(path)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
  assert not (tmp_path / "runs").exists()


def test_common_overrides_apply_to_every_variant_under_its_own_root(tmp_path):
  path = write_ablation(tmp_path, {"a": {}, "b": {"train.seed": 3}})
  spec = yaml.safe_load(path.read_text())
  spec["common"] = {"train.seed": 7, "train.output_dir": str(tmp_path / "elsewhere")}
  path.write_text(yaml.safe_dump(spec))
  ab = ablation_lib.load_ablation(path)
  a, b = ab.preset("a"), ab.preset("b")
  assert a.train.seed == 7 and b.train.seed == 3  # a variant's own override wins
  assert a.train.output_dir == f"{tmp_path / 'elsewhere'}/a"
  assert b.train.output_dir == f"{tmp_path / 'elsewhere'}/b"
  spec["common"] = ["train.seed=1"]
  path.write_text(yaml.safe_dump(spec))
  with pytest.raises(ConfigError, match="'common' must map dotted keys to values"):
    ablation_lib.load_ablation(path)


def test_unknown_only_and_missing_file(tmp_path, capsys):
  path = write_ablation(tmp_path, {"a": {}})
  assert cli.main(["ablate", str(path), "--only", "zz"]) == 2
  assert "--only zz: no such variant" in capsys.readouterr().err
  with pytest.raises(ConfigError, match="ablation file not found"):
    ablation_lib.load_ablation(tmp_path / "none.yaml")


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "ablations").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_ablations_load(path):
  ab = ablation_lib.load_ablation(path)
  assert "baseline" in ab.variants and ab.variants["baseline"] == {}
  dirs = {ab.preset(n).train.output_dir for n in ab.variants}
  assert len(dirs) == len(ab.variants)


def test_paired_by_step_compares_the_steps_both_logged():
  base = [{"step": str(s), "top1_1": "0.5", "loss": "2.0"} for s in range(1, 6)]
  other = [{"step": str(s), "top1_1": str(0.5 + 0.01 * s), "loss": "1.5"} for s in range(2, 8)]
  rows = ablation_lib.paired_by_step(base, other, block=2, keys=("top1_1", "loss"))
  assert [(r["first"], r["last"]) for r in rows] == [(2, 3), (4, 5)]
  assert rows[0]["top1_1"][0] == pytest.approx(0.025)
  assert rows[0]["top1_1"][1] == pytest.approx(1.96 * 0.01 / 2 ** 0.5 / 2 ** 0.5)
  assert rows[1]["loss"] == (pytest.approx(-0.5), pytest.approx(0.0))
  assert rows[1]["base_top1_1"] == pytest.approx(0.5)
  single = ablation_lib.paired_by_step(base, other, block=10, keys=("loss",))
  assert len(single) == 1 and single[0]["last"] == 5
