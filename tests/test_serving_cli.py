"""``redrafter-jax serve`` / ``serve.py`` (as a subprocess: graceful shutdown on SIGTERM, exit
status 0) and the load test's compare mode (which starts the server twice as a subprocess on
loopback: ReDrafter, then AR)."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from redrafter_jax import cli
from redrafter_jax.bench import loadtest


def test_serve_without_a_drafter_is_a_clear_error(capsys):
  assert cli.main(["serve", "--config", "configs/tiny.yaml", "--port", "0"]) == 2
  assert "no drafter to serve" in capsys.readouterr().err
  assert cli.main(["serve", "--config", "configs/tiny.yaml", "--port", "0", "--drafter",
                   "/nonexistent/drafter"]) == 2
  assert "drafter not found: /nonexistent/drafter" in capsys.readouterr().err


def test_compile_cache_is_off_for_a_cpu_server_over_several_devices(tmp_path):
  """XLA:CPU hangs in the collectives of sharded programs loaded from the persistent cache, so
  a server over several CPU devices compiles instead; over one device it caches."""
  import jax

  from redrafter_jax.serving import server

  assert jax.default_backend() == "cpu" and jax.local_device_count() == 8  # conftest's fakes
  before = jax.config.jax_compilation_cache_dir
  assert server.use_compile_cache(str(tmp_path / "all")) is None
  assert server.use_compile_cache(str(tmp_path / "two"), devices=2) is None
  assert jax.config.jax_compilation_cache_dir == before and not (tmp_path / "all").exists()
  assert server.use_compile_cache("off", devices=1) is None
  assert server.use_compile_cache(str(tmp_path / "one"), devices=1) == str(tmp_path / "one")
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / "one")
  assert (tmp_path / "one").is_dir()


def test_loadtest_compare_default_preset_has_a_drafter():
  """`loadtest --compare` as the README writes it (no --config) serves a preset with a
  drafter, so it runs instead of exiting 2."""
  from redrafter_jax.config import load_preset

  args = loadtest.parser().parse_args(["--compare"])
  assert load_preset(args.config).drafter_path is not None


def test_loadtest_refuses_non_loopback_targets():
  with pytest.raises(SystemExit, match="loopback"):
    loadtest.main(["--url", "http://example.com:8000", "--requests", "1"])


def test_loadtest_rounds_are_pooled_and_each_ratio_printed():
  def load(tokens, wall, latency):
    return loadtest.Load([loadtest.Result(ok=True, latency=latency, ttft=0.1, tokens=tokens)],
                         1, wall)

  rounds = [{"redrafter": load(100, 1.0, 1.0), "ar": load(100, 2.0, 2.0)},
            {"redrafter": load(100, 4.0, 3.0), "ar": load(100, 1.0, 1.0)},
            {"redrafter": load(100, 1.0, 1.0), "ar": load(100, 1.0, 1.0)}]
  pooled = loadtest.Load.pooled([r["redrafter"] for r in rounds]).summary()
  assert (pooled["requests"], pooled["completed"], pooled["completion_tokens"]) == (3, 3, 300)
  assert pooled["tokens_per_s"] == pytest.approx(300 / 6.0)
  assert pooled["latency_p50_s"] == pytest.approx(1.0)
  lines = loadtest.format_rounds(rounds).splitlines()
  assert lines[1].split()[1:] == ["redrafter", "100.0", "50.0", "2.00x"]
  assert lines[2].split()[1:] == ["ar", "25.0", "100.0", "0.25x"]
  assert lines[-1] == "redrafter / ar over 3 rounds: median 1.00x, min 0.25x, max 2.00x"


def test_loadtest_rounds_need_compare():
  with pytest.raises(SystemExit):
    loadtest.main(["--url", "http://127.0.0.1:9", "--rounds", "2"])
  with pytest.raises(SystemExit):
    loadtest.main(["--compare", "--rounds", "0"])


@pytest.mark.slow
def test_loadtest_compare_starts_both_servers(capsys):
  code = loadtest.main(["--compare", "--config", "configs/tiny.yaml", "--random-drafter",
                        "--requests", "8", "--concurrency", "2", "--max-tokens", "8",
                        "--slots", "2", "--rounds", "2", "--json"])
  out = capsys.readouterr().out
  assert code == 0, out
  assert "redrafter" in out and " ar" in out and "speedup (throughput)" in out
  assert "16/16" in out  # pooled over the two rounds
  assert out.count("[round ") == 4 and "over 2 rounds: median" in out
  assert '"rounds"' in out


def _start_serve(*extra: str):
  """``redrafter-jax serve`` on the tiny preset in a subprocess; returns it, its URL (read from
  the 'listening on' line it prints) and its output lines so far (a reader thread appends)."""
  src = str(pathlib.Path(__file__).resolve().parents[1] / "src")
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
  proc = subprocess.Popen(
      [sys.executable, "-m", "redrafter_jax.cli", "serve", "--config", "configs/tiny.yaml",
       "--random-drafter", "--devices", "1", "--port", "0", "--slots", "2", "--max-tokens", "64",
       *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
  lines, listening = [], threading.Event()

  def read():
    for line in proc.stdout:
      lines.append(line)
      if line.startswith("listening on http://"):
        listening.set()

  threading.Thread(target=read, daemon=True).start()
  if not listening.wait(300):
    proc.kill()
    raise AssertionError("the server did not print its address:\n" + "".join(lines))
  url = next(line for line in lines if line.startswith("listening on ")).split()[2]
  health = _wait_ready(proc, url, lines)
  return proc, url, lines, health


def _wait_ready(proc, url, lines, timeout=300.0):
  """Poll /health from the moment the server listens until it answers 200; returns every
  answer as (status code, body)."""
  answers, deadline = [], time.monotonic() + timeout
  while time.monotonic() < deadline and proc.poll() is None:
    r = httpx.get(f"{url}/health", timeout=30)
    answers.append((r.status_code, r.json()))
    if r.status_code == 200:
      return answers
    time.sleep(0.05)
  proc.kill()
  raise AssertionError(f"not ready: {answers[-3:]}\n" + "".join(lines))


def test_sigterm_lets_a_request_in_flight_finish_and_exits_0():
  """SIGTERM with a stream in flight (its first step still compiling: no warm-up): the stream
  ends with its finish_reason and [DONE], and the process exits 0."""
  proc, url, lines, _ = _start_serve("--no-warmup", "--shutdown-grace", "120")
  try:
    body = {"model": "random:tiny", "prompt": "Hello", "max_tokens": 48, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as s:
      events = s.iter_lines()
      first = next(line for line in events if line.startswith("data: "))
      proc.send_signal(signal.SIGTERM)
      rest = [line[6:] for line in events if line.startswith("data: ")]
    assert proc.wait(120) == 0, "".join(lines)
  finally:
    if proc.poll() is None:
      proc.kill()
  chunks = [json.loads(first[6:])] + [json.loads(e) for e in rest[:-1]]
  assert rest[-1] == "[DONE]"
  assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop"), chunks[-1]
  assert any("shutting down" in line.lower() for line in lines), "".join(lines)


def test_sigterm_on_an_idle_server_exits_0():
  """(With --api-key, which guards /v1 only.)"""
  proc, url, lines, _ = _start_serve("--no-warmup", "--api-key", "k3y")
  try:
    assert httpx.get(f"{url}/health", timeout=30).json()["status"] == "ok"
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k3y"},
                     timeout=30).status_code == 200
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, "".join(lines)
  finally:
    if proc.poll() is None:
      proc.kill()


def test_server_listens_during_its_warm_up_and_reports_progress():
  """The port answers before the warm-up ends: /health is 503 "starting" (with the stage and the
  warm-up's progress) until it is 200, and each warm-up program is logged with its seconds."""
  proc, url, lines, health = _start_serve()
  try:
    assert health[-1][0] == 200 and health[-1][1]["status"] == "ok"
    for code, body in health[:-1]:
      assert code == 503 and body["status"] == "starting" and body["stage"], body
      if "warmup" in body:
        assert 0 <= body["warmup"]["done"] <= body["warmup"]["total"]
    out = "".join(lines)
    warm = [i for i, line in enumerate(lines) if re.search(r"warm-up \d+/\d+: .* in [0-9.]+ s",
                                                            line)]
    listening = next(i for i, line in enumerate(lines) if line.startswith("listening on"))
    assert warm and listening < warm[0], out  # listening before the first program compiled
    assert re.search(r"ready in [0-9.]+ s", out), out
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, out
  finally:
    if proc.poll() is None:
      proc.kill()


def test_starting_server_answers_503_with_its_progress():
  from fastapi import FastAPI

  from redrafter_jax.serving.server import ServerThread
  from redrafter_jax.serving.lifecycle import Startup

  startup = Startup()
  with ServerThread(startup) as s:
    r = httpx.get(f"{s.url}/health", timeout=30)
    assert r.status_code == 503 and r.json()["status"] == "starting"
    assert r.headers["Retry-After"] == "5"
    startup.stage("loading the model")
    startup.warmup(2, 5, "ar step, 1 rows, context 512", 0.25)
    body = httpx.get(f"{s.url}/health", timeout=30).json()
    assert body["stage"] == "loading the model" and body["warmup"] == {"done": 2, "total": 5}
    r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "starting"
    assert "retry when GET /health answers 200" in r.json()["error"]["message"]
    app = FastAPI()
    app.get("/health")(lambda: {"status": "ok"})
    startup.ready(app)
    assert httpx.get(f"{s.url}/health", timeout=30).json() == {"status": "ok"}
  failed = Startup()
  failed.fail(ValueError("no such model"))
  with ServerThread(failed) as s:
    body = httpx.get(f"{s.url}/health", timeout=30).json()
    assert body["status"] == "failed" and body["error"] == "ValueError: no such model"
    r = httpx.get(f"{s.url}/v1/models", timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "start_failed"


def test_server_weights_follow_the_drafter_settings(tmp_path, monkeypatch):
  """A server loads the LLM's weights in the dtype its drafter's settings were measured with
  (decode.json; "auto" = the platform's faster one) unless the preset sets one; a bad recorded
  value is a clear error; a random drafter leaves the preset's dtype."""
  import dataclasses

  import jax.numpy as jnp

  from redrafter_jax.config import ConfigError, Preset
  from redrafter_jax.models import linear
  from redrafter_jax.serving import server
  from redrafter_jax.weights.base_model import load_base_model

  folder = tmp_path / "drafter"
  folder.mkdir()
  (folder / "decode.json").write_text('{"param_dtype": "bfloat16"}')
  preset = Preset(drafter_path=str(folder))
  assert server.served_weights_dtype(preset) == "bfloat16"
  assert server.served_weights_dtype(dataclasses.replace(preset, param_dtype="float32")) == (
      "float32")
  assert server.served_weights_dtype(preset, random_drafter=True) == "float32"  # preset.dtype
  (folder / "decode.json").write_text('{"param_dtype": "auto"}')
  for fastest in ("float32", "bfloat16"):
    monkeypatch.setattr(linear, "preferred_param_dtype", lambda: fastest)
    assert server.served_weights_dtype(preset) == fastest
    assert server.served_weights_dtype(Preset(drafter_path="shipped")) == fastest
    llm, _ = load_base_model("random:tiny", param_dtype="auto")
    assert llm.param_dtype == jnp.dtype(fastest)
  (folder / "decode.json").write_text('{"param_dtype": "fp8"}')
  with pytest.raises(ConfigError, match="param_dtype must be one of"):
    server.served_weights_dtype(preset)
  with pytest.raises(ConfigError, match="drafter not found"):
    server.served_weights_dtype(Preset(drafter_path=str(tmp_path / "missing")))


def test_server_serves_the_tree_chosen_for_this_device(tmp_path, monkeypatch):
  """``serve --tree auto`` (the CLI's default): a drafter with an acceptance table is served
  with the tree predicted fastest here (step times cached per device), and the policy starts
  from that tree's measured tokens/step; without a table, or with ``tree="preset"``, the
  preset's tree."""
  from flax import nnx

  import dataclasses

  from redrafter_jax.config import Preset, ServeConfig
  from redrafter_jax.inference import tree_choice
  from redrafter_jax.models.drafter import Drafter
  from redrafter_jax.serving import server
  from redrafter_jax.weights.base_model import load_base_model
  from redrafter_jax.weights.drafter_io import save_drafter

  monkeypatch.setenv("REDRAFTER_JAX_CACHE", str(tmp_path / "cache"))
  llm, llm_cfg = load_base_model("random:tiny")
  preset = Preset(model="random:tiny", drafter_path=str(tmp_path / "drafter"),
                  decode=dict(beam_width=3, beam_length=4, max_new_tokens=16))
  drafter = Drafter(preset.drafter_config(llm_cfg), rngs=nnx.Rngs(0))
  save_drafter(drafter, tmp_path / "drafter")
  assert server.served_decode(preset, llm, drafter, tree="auto")[0] == preset.decode  # no table
  tree_choice.write_acceptance(tmp_path / "drafter", {
      "1x3": dict(tokens_per_step=1.3, steps=10, tokens=13),
      "2x3+2/5": dict(tokens_per_step=1.1, steps=10, tokens=11)}, {})
  choice = tree_choice.tuned(tmp_path / "drafter", llm, drafter)  # times and caches
  cfg = server.served_decode(preset, llm, drafter, tree="auto")[0]
  assert (cfg.beam_width, cfg.beam_length, cfg.lookup_ngram, cfg.token_budget) == (
      choice.beams.width, choice.beams.length, choice.beams.lookup, choice.beams.budget or None)
  assert cfg.max_new_tokens == 16
  small = ServeConfig(slots=2, max_context=128, max_tokens=16, warmup=False)
  auto = server.build(preset, small)  # tree="auto" is ServeConfig's default, as the CLI's
  fixed = server.build(preset, dataclasses.replace(small, tree="preset"))
  try:
    assert auto.engine.config.decode == cfg
    assert fixed.engine.config.decode == preset.decode
    # the policy starts from the drafter's measured tokens/step for the served tree, if measured
    assert auto.engine.config.prior_tokens_per_step == {"1x3": 1.3, "2x3+2/5": 1.1}[
        choice.beams.text]
    assert auto.engine.acceptance["spec"].tokens_per_step == (
        auto.engine.config.prior_tokens_per_step)
    assert fixed.engine.config.prior_tokens_per_step is None  # 3x4 was not measured
  finally:
    auto.close()
    fixed.close()
  # Smaller trees beside the served 3x4 (10 tree tokens): those that fit, each from its
  # measured tokens/step when the table has it; the others skipped; a malformed one refused.
  smaller = server.build(preset, dataclasses.replace(
      small, tree="preset", trees=["1x3", "2x3+2/5", "1x5", "3x4", "1x3"]))
  try:
    assert smaller.engine.config.trees == ("1x3", "2x3+2/5")
    assert smaller.engine.config.tree_priors == (1.3, 1.1)
    assert smaller.engine._place.modes() == ("ar", "spec:1x3", "spec:2x3+2/5", "spec")
  finally:
    smaller.close()
  with pytest.raises(server.ConfigError, match="--trees"):
    server.with_smaller_trees(fixed.engine.config, ["1x"])


def test_server_built_from_a_preset_serves_a_multi_layer_drafter():
  """``serve`` with a drafter that reads several layers (the shipped drafter's kind) builds: its
  engine places those layers, answers through tree steps, and the greedy answer is AR's (that the
  slots' states equal a full forward's is test_serving_engine's)."""
  from redrafter_jax.config import Preset
  from redrafter_jax.inference import ar
  from redrafter_jax.serving import server
  from redrafter_jax.serving.request import GenerationRequest
  from redrafter_jax.weights.base_model import load_base_model

  preset = Preset(model="random:tiny", drafter=dict(feature_layers=[0, 1]),
                  decode=dict(beam_width=2, beam_length=3, max_new_tokens=12),
                  serve=dict(slots=2, max_context=128, max_tokens=12, random_drafter=True,
                             warmup=False))
  served = server.build(preset)  # the preset's serve section
  try:
    place = served.engine._place
    assert place.layers == (0, 1)
    prompt = [5, 9, 2, 7, 11, 3]
    done = served.engine.generate(GenerationRequest(prompt_ids=prompt, max_tokens=12))
    assert done.finish_reason == "length" and len(done.token_ids) == 12
    llm, _ = load_base_model("random:tiny")  # the same random weights the server made
    assert done.token_ids == ar.generate(llm, [prompt], max_new_tokens=12).tokens[0]
    tree_row_steps = served.engine.metrics.registry.get_sample_value(
        "redrafter_draft_accepted_at_depth_total", {"depth": "0"})
    assert tree_row_steps > 0  # the answer came from tree steps
  finally:
    served.close()


def test_serve_settings_come_from_the_preset_then_the_flags(tmp_path, monkeypatch):
  """``serve``'s settings: ServeConfig's defaults, then the preset's ``serve:`` section, then
  the flags given (and ``--drafter`` replaces the preset's drafter_path); a bad value in the
  section is one error that names the key."""
  import argparse

  from redrafter_jax.commands import serve as serve_command
  from redrafter_jax.config import ConfigError, ServeConfig, load_preset

  monkeypatch.delenv("REDRAFTER_API_KEY", raising=False)
  path = tmp_path / "p.yaml"
  path.write_text("model: random:tiny\ndrafter_path: shipped\n"
                  "serve: {slots: 4, port: 9000, trees: [1x2, 1x3], cors_origins: '*'}\n")
  p = argparse.ArgumentParser()
  serve_command.add_arguments(p)

  def settings(*argv):
    args = p.parse_args(["--config", str(path), *argv])
    from redrafter_jax.config import parse_overrides
    return serve_command.serve_config(args, load_preset(path, parse_overrides(args.overrides)))

  preset, serve = settings()
  assert preset.drafter_path == "shipped"
  assert serve == ServeConfig(slots=4, port=9000, trees=("1x2", "1x3"), cors_origins=("*",))
  assert settings("--drafter", "elsewhere")[0].drafter_path == "elsewhere"
  preset, serve = settings("--slots", "2", "--ar", "--trees", "1x4",
                           "--no-warmup", "--served-model-name", "m", "--cors-origin", "a",
                           "--cors-origin", "b", "serve.max_queue=3")
  assert serve == ServeConfig(slots=2, port=9000, speculative=False, trees=("1x4",),
                              warmup=False, model_name="m", cors_origins=("a", "b"),
                              max_queue=3)
  monkeypatch.setenv("REDRAFTER_API_KEY", "k1")
  assert settings()[1].api_key == "k1" and settings("--api-key", "k2")[1].api_key == "k2"
  for bad, message in (("serve.slots=0", "slots must be an integer >= 1, got 0"),
                       ("serve.tree=big", "tree must be 'auto' or 'preset'"),
                       ("serve.prot=1", "unknown key(s) 'prot' (did you mean 'port'?)")):
    with pytest.raises(ConfigError, match=re.escape(message)):
      settings(bad)
  with pytest.raises(ConfigError, match="port must be in"):
    settings("--port", "70000")


def test_serve_defaults_are_the_engines():
  """``ServeConfig`` (config.py, below serving in the layering) repeats the defaults of the
  ``EngineConfig`` settings it passes on; they must not drift apart, or ``serve`` and
  ``Engine`` would differ with nothing set."""
  import dataclasses

  from redrafter_jax.config import ServeConfig
  from redrafter_jax.serving.engine import EngineConfig

  engine = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
  shared = [f for f in dataclasses.fields(ServeConfig) if f.name in engine]
  assert {f.name for f in shared} >= {"slots", "max_tokens", "max_queue", "prefill_tokens",
                                      "min_context_bucket", "speculative"}
  for f in shared:
    if f.default is not None:  # None: resolved from the model or preset (engine_config)
      assert f.default == engine[f.name], f.name
