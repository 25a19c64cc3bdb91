"""``redrafter-jax serve`` / ``serve.py`` and the load test's compare mode (which starts the
server twice as a subprocess on loopback: ReDrafter, then AR)."""

import pytest

from redrafter_jax import cli
from redrafter_jax.serving import loadtest


def test_serve_without_a_drafter_is_a_clear_error(capsys):
  assert cli.main(["serve", "--config", "configs/tiny.yaml", "--port", "0"]) == 2
  assert "no drafter to serve" in capsys.readouterr().err
  assert cli.main(["serve", "--config", "configs/tiny.yaml", "--port", "0", "--drafter",
                   "/nonexistent/drafter"]) == 2
  assert "drafter not found: /nonexistent/drafter" in capsys.readouterr().err


def test_loadtest_refuses_non_loopback_targets():
  with pytest.raises(SystemExit, match="loopback"):
    loadtest.main(["--url", "http://example.com:8000", "--requests", "1"])


@pytest.mark.slow
def test_loadtest_compare_starts_both_servers(capsys):
  code = loadtest.main(["--compare", "--config", "configs/tiny.yaml", "--random-drafter",
                        "--requests", "8", "--concurrency", "2", "--max-tokens", "8",
                        "--slots", "2", "--json"])
  out = capsys.readouterr().out
  assert code == 0, out
  assert "redrafter" in out and " ar" in out and "speedup (throughput)" in out
  assert out.count("8/8") >= 2
