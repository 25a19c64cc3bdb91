"""``bench context`` on a tiny model: a row per (step, context), buckets chosen as documented,
and bad arguments refused with argparse's exit status 2."""

import pytest

import tiny_models
from redrafter_jax.bench import context


def test_context_bench_rows_and_buckets(tmp_path, capsys):
  folder = tiny_models.save(tiny_models.hf_model("llama"), tmp_path / "m")
  out = tmp_path / "ctx.md"
  rc = context.main(["--model", str(folder), "--param-dtype", "float32", "--cache-size", "64",
                     "--contexts", "5,20,60", "--tree-tokens", "4", "--min-bucket", "16",
                     "--reps", "1", "--out", str(out)])
  assert rc == 0
  text = out.read_text()
  rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| AR")
          or line.startswith("| verify")]
  got = [(r[0].strip(), int(r[1]), int(r[2])) for r in rows]
  assert got == [("AR step (T=1)", 5, 16), ("AR step (T=1)", 20, 32), ("AR step (T=1)", 60, 64),
                 ("verify (N=4)", 5, 16), ("verify (N=4)", 20, 32), ("verify (N=4)", 60, 64)]
  assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows)
  assert text in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--contexts", "a,b"], ["--contexts", "2040", "--cache-size",
                                                           "2048"], ["--reps", "0"]])
def test_context_bench_bad_arguments(argv):
  with pytest.raises(SystemExit) as e:
    context.parse_args(argv)
  assert e.value.code == 2
