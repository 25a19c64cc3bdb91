"""``bench layers`` on a tiny model: a row per program with compile seconds taken from JAX's
events (a program's first call compiles, so they are positive; a warm call compiles nothing),
the two forms' greedy tokens compared, and bad arguments refused with exit status 2."""

import jax
import jax.numpy as jnp
import pytest

from redrafter_jax.bench import _compiles, layers


def test_layers_bench_rows(tmp_path, capsys):
  out = tmp_path / "layers.md"
  rc = layers.main(["--model", "random:tiny", "--drafter", "random", "--param-dtype", "float32",
                    "--context", "12", "--max-new-tokens", "6", "--repeat", "1",
                    "--out", str(out)])
  assert rc == 0
  text = out.read_text()
  rows = [line.split("|")[1:-1] for line in text.splitlines()
          if line.startswith("| ") and not line.startswith("| program")]
  assert [r[0].strip() for r in rows] == ["decode", "generate", "step", "ar step"]
  for r in rows:
    assert float(r[1]) > 0 and float(r[3]) > 0  # both forms compiled each program
    assert r[2].strip().endswith(("ms", " s")) and r[4].strip().endswith(("ms", " s"))
  assert "identical: yes" in text
  assert text in capsys.readouterr().out


def test_compile_seconds_counts_compiles_only():
  f = jax.jit(lambda x: jnp.sin(x) * 3)
  with _compiles.compile_seconds() as first:
    f(jnp.ones(7)).block_until_ready()
  with _compiles.compile_seconds() as warm:
    f(jnp.ones(7)).block_until_ready()
  assert first[0] > 0 and warm[0] == 0


@pytest.mark.parametrize("argv", [["--forms", "unrolled,looped"], ["--beams", "4x4,2x3"],
                                  ["--repeat", "0"]])
def test_layers_bench_bad_arguments(argv):
  with pytest.raises(SystemExit) as e:
    layers.parse_args(argv)
  assert e.value.code == 2
