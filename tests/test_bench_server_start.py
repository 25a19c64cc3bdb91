"""``bench server_start``: the server's time to ready from a cold and a warm compilation cache."""

import json

import pytest

from redrafter_jax.bench import server_start


@pytest.mark.slow  # two server start-ups with their warm-ups and background compiles (~2-3 min)
def test_cold_then_warm_start(tmp_path, capsys):
  out = tmp_path / "start.md"
  rc = server_start.main(["--config", "configs/tiny.yaml", "--out", str(out), "--settle",
                          "--probe-every", "1", "--",
                          "--random-drafter", "--devices", "1", "--slots", "2",
                          "--max-tokens", "16", "--max-context", "128"])
  assert rc == 0, capsys.readouterr().err[-3000:]
  runs = json.loads(out.with_suffix(".json").read_text())["runs"]
  assert len(runs) == 2
  for r in runs:
    assert r["error"] is None and r["exit_status"] == 0
    assert 0 < r["listening_s"] <= r["ready_s"]
    assert r["rss_mb"] > 0 and r["peak_rss_mb"] >= r["rss_mb"]
    # ready on the covering programs; --settle waited for the background compile of the rest
    assert r["settled_s"] >= r["ready_s"] and r["settled_rss_mb"] > 0
    assert r["settled_programs"] > r["warmup_programs"]
    assert r["first_token_s"] > 0 and r["settled_first_token_s"] > 0  # the short request
    assert r["pauses"] >= 1 and r["longest_pause_s"] > 0  # steps timed between requests
  assert runs[0]["probes_s"] and all(s > 0 for s in runs[0]["probes_s"])  # while compiling
  assert runs[0]["warmup_programs"] and runs[0]["warmup_programs"] > 0
  text = out.read_text()
  assert "| 1 | cold |" in text and "| 2 | warm |" in text
  log = (tmp_path / "start-run1.log").read_text()
  assert "warm-up 1/" in log and "ready in" in log and "GET /health" not in log


def test_pauses_are_read_from_the_servers_log():
  from redrafter_jax.serving.engine import PAUSE_LOG

  log = (f"INFO engine: steps for (rows, context) [(1, 32)] timed and in use\n"
         f"INFO engine: {PAUSE_LOG} 0.42 s\nINFO engine: steps at context 32 timed together\n"
         f"INFO engine: {PAUSE_LOG} 1.50 s\nINFO app: GET /health 200\n")
  assert server_start.pause_seconds(log) == [0.42, 1.5]
  assert server_start.pause_seconds("INFO nothing here\n") == []


def test_bad_arguments():
  for argv in (["--warm-runs", "-1"], ["--config", "/nonexistent.yaml"], ["--timeout", "0"],
               ["--probe-every", "-1", "--settle"], ["--probe-every", "5"]):
    with pytest.raises(SystemExit) as e:
      server_start.parse_args(argv)
    assert e.value.code == 2
