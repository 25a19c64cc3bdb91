"""``bench server_step`` on a tiny model: one row per serving layer with positive step times for
the tree and AR, the served tokens/step of the tree within what a step can give, and arguments
that cannot run refused."""

import pytest

from redrafter_jax.bench import server_step


def test_server_step_bench_rows(capsys, tmp_path):
  out = tmp_path / "server_step.md"
  rc = server_step.main(["--model", "random:tiny", "--drafter", "random", "--param-dtype",
                         "float32", "--prompt", "hello there", "--max-tokens", "6", "--slots",
                         "2", "--max-context", "64", "--min-context-bucket", "32", "--repeat",
                         "2", "--requests", "1", "--beams", "1x3", "--out", str(out)])
  assert rc == 0
  text = out.read_text()
  assert text in capsys.readouterr().out
  rows = [line.split("|")[1:-1] for line in text.splitlines()
          if line.startswith("| ") and not line.startswith("| part")]
  assert [r[0].strip() for r in rows] == ["batch-1 step", "server step, 1 slot",
                                          "server step, 1 of 2", "served"]
  for r in rows:
    assert float(r[1]) > 0 and float(r[2]) > 0
  tps = float(text.split("Served tokens/step of the tree: ")[1].split()[0])
  assert 1.0 <= tps <= 3.0  # W=1, L=3: at most the beam's length per step


@pytest.mark.parametrize("argv", [["--repeat", "0"], ["--beams", "1x3,2x2"],
                                  ["--slots", "0"]])
def test_server_step_bench_bad_arguments(argv):
  with pytest.raises(SystemExit) as e:
    server_step.parse_args(argv)
  assert e.value.code == 2


def test_server_step_bench_prompt_that_does_not_fit():
  with pytest.raises(SystemExit, match="do not fit"):
    server_step.main(["--model", "random:tiny", "--drafter", "random", "--max-tokens", "60",
                      "--max-context", "64", "--prompt", "a long prompt " * 4])
