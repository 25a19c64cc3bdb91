"""The package works on a machine without its optional packages, as on the GPU lease image.

That image has jax (CUDA), flax, optax, orbax, chex, transformers, torch, safetensors and pytest,
but not grain, gguf, fastapi, uvicorn or mlx. Each check runs in a fresh Python process in which
those packages are absent: ``sys.modules[name] = None`` makes ``import name`` (and its
submodules) raise ``ModuleNotFoundError`` and ``importlib.util.find_spec(name)`` return None, as
for a package that is not installed. (A ``sys.meta_path`` finder that raises would break
libraries that probe optional packages with ``find_spec``: transformers probes mlx that way.)

Only the modules in ``ALLOWED`` may need one of those packages at import time; any other module
that starts importing one at module level fails ``test_only_allowed_modules_need_a_missing_package``.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

import tiny_models

REPO = pathlib.Path(__file__).resolve().parents[1]
SRC = REPO / "src"
PACKAGE = SRC / "redrafter_jax"
MISSING = ("grain", "gguf", "fastapi", "uvicorn", "mlx")

# Modules that may fail to import for want of a missing package, and the packages each may need.
ALLOWED = {
    "redrafter_jax.serving.app": {"fastapi"},
    "redrafter_jax.serving.server": {"fastapi", "uvicorn"},  # imports app and lifecycle
    "redrafter_jax.serving.lifecycle": {"uvicorn"},
    "redrafter_jax.training.": {"grain"},  # the training stack (a prefix): the input pipeline
}
# weights.mlx_runtime needs mlx only when it runs, lease/tiny and weights.llama_weights need gguf
# only for GGUF files: they must import without it, so they are not listed.

PRELUDE = textwrap.dedent(f"""
    import json, sys
    MISSING = {MISSING!r}
    assert not any(name in sys.modules for name in MISSING), "imported before blocking"
    for name in MISSING:
      sys.modules[name] = None  # absent: import raises ModuleNotFoundError, find_spec gives None
""")


def run_without_missing(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(SRC)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=timeout)


def last_json(proc: subprocess.CompletedProcess) -> dict:
  assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
  return json.loads(proc.stdout.strip().splitlines()[-1])


def all_modules() -> list[str]:
  names = []
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(SRC).with_suffix("").parts
    names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
  return names


def allowed(module: str, package: str) -> bool:
  return any((module == m or (m.endswith(".") and module.startswith(m))) and package in pkgs
             for m, pkgs in ALLOWED.items())


FAKE_COMMAND = '''HELP = "a command whose module imports fastapi"
import fastapi  # noqa: E402
'''


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  """One fresh process without the missing packages: imports every module, asks both entry
  points for --help, runs commands that need a missing package, reads a prompts file."""
  tmp = tmp_path_factory.mktemp("gpu_image")
  (tmp / "fake_command.py").write_text(FAKE_COMMAND)
  prompts = tmp / "prompts.jsonl"
  prompts.write_text('{"id": "a", "category": "qa", "prompt": "hello"}\n\n'
                     '{"id": "b", "category": "qa", "prompt": "world"}\n')
  code = f"""
    import contextlib, importlib, importlib.util, io
    out = {{"blocked": [], "failed": {{}}, "imported": []}}
    for name in MISSING:
      try:
        importlib.import_module(name + ".sub")
      except ModuleNotFoundError:
        out["blocked"].append(name if importlib.util.find_spec(name) is None else "")
    for module in {all_modules()!r}:
      try:
        importlib.import_module(module)
        out["imported"].append(module)
      except ModuleNotFoundError as e:
        out["failed"][module] = e.name
      except Exception as e:
        out["failed"][module] = repr(e)

    def call(main, argv):
      stdout, stderr = io.StringIO(), io.StringIO()
      with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
          rc = main(argv)
        except SystemExit as e:
          rc = e.code
        except Exception as e:  # reported, so that each check fails on its own
          rc = repr(e)
      return {{"rc": rc, "out": stdout.getvalue(), "err": stderr.getvalue()}}

    from redrafter_jax import cli
    from redrafter_jax.bench import __main__ as bench_main
    out["cli_help"] = call(cli.main, ["--help"])
    out["bench_help"] = call(bench_main.main, ["--help"])
    out["serve"] = call(cli.main, ["serve", "--config", "nowhere.yaml"])
    sys.path.insert(0, {str(tmp)!r})
    cli.COMMANDS["fake"] = "fake_command"
    out["fake_help"] = call(cli.main, ["--help"])
    out["fake"] = call(cli.main, ["fake", "--any", "thing"])
    del cli.COMMANDS["fake"]

    for name in list(sys.modules):  # a fresh start for reading prompts: nothing of training
      if name.startswith("redrafter_jax.training"):
        del sys.modules[name]
    try:
      from redrafter_jax.bench.ar import read_prompts
      out["prompts"] = [r["prompt"] for r in read_prompts(__import__("pathlib").Path(
          {str(prompts)!r}), None)]
    except Exception as e:
      out["prompts"] = repr(e)
    out["training_imported"] = sorted(m for m in sys.modules if m.startswith(
        "redrafter_jax.training") and sys.modules[m] is not None)
    print(json.dumps(out))
  """
  return last_json(run_without_missing(code))


def test_the_packages_are_really_missing_in_the_checks(report):
  """The check can fail: with the packages absent, the modules that do need them fail."""
  assert report["blocked"] == list(MISSING)
  assert report["failed"].get("redrafter_jax.training.data") == "grain"
  assert report["failed"].get("redrafter_jax.serving.app") == "fastapi"


def test_only_allowed_modules_need_a_missing_package(report):
  bad = {m: why for m, why in report["failed"].items() if not allowed(m, why)}
  assert not bad, ("these modules now need a package the GPU image lacks (import it inside the "
                   f"function that needs it, or list the module in ALLOWED): {bad}")
  for wanted in ("redrafter_jax", "redrafter_jax.cli", "redrafter_jax.jsonl",
                 "redrafter_jax.bench.suite", "redrafter_jax.bench.ar",
                 "redrafter_jax.bench.acceptance", "redrafter_jax.inference.decode",
                 "redrafter_jax.weights.llama_weights", "redrafter_jax.weights.mlx_runtime",
                 "redrafter_jax.models.pallas_attention", "redrafter_jax.commands.serve"):
    assert wanted in report["imported"], wanted
  assert set(report["imported"]) | set(report["failed"]) == set(all_modules())


def test_entry_points_give_help(report):
  assert report["cli_help"]["rc"] == 0
  assert "serve" in report["cli_help"]["out"] and "train" in report["cli_help"]["out"]
  assert report["bench_help"]["rc"] == 0 and "suite" in report["bench_help"]["out"]


def test_a_command_needing_a_missing_package_fails_with_one_line(report):
  """``serve`` imports fastapi as it runs; ``fake`` at import time: both stay listed, and
  running either prints one line naming the package and how to install it."""
  want = ("error: 'serve' needs the package 'fastapi', which is not installed "
          "(pip install 'redrafter_jax[serve]')\n")
  assert (report["serve"]["rc"], report["serve"]["err"]) == (2, want)
  assert report["fake_help"]["rc"] == 0
  assert "a command whose module imports fastapi [needs fastapi, not installed]" in " ".join(
      report["fake_help"]["out"].split())
  assert report["fake"]["rc"] == 2
  assert report["fake"]["err"] == want.replace("'serve' needs", "'fake' needs")


def test_reading_prompts_needs_no_training_stack(report):
  assert report["prompts"] == ["hello", "world"]
  assert report["training_imported"] == []


def test_the_benchmark_suite_runs_end_to_end(tmp_path):
  """``python -m redrafter_jax.bench suite`` (what failed on the first lease: reading its
  prompts imported grain) on a tiny random HF Llama folder, without the missing packages."""
  model = tiny_models.save_tokenizer(
      tiny_models.save(tiny_models.hf_model("llama", seed=3), tmp_path / "model"))
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps(dict(id=f"p{i}", source="test", category="qa",
                                             prompt=text)) + "\n"
                             for i, text in enumerate(["w1 w2 w3 w4", "w5 w6 w7"])))
  out = tmp_path / "results"
  argv = ["suite", "--quick", "--model", str(model), "--prompts", str(prompts), "--out",
          str(out), "--max-new-tokens", "4", "--exit-dim", "16", "--no-progress",
          "--no-transformers", "--beams", "2x2", "--main-beams", "2x2", "--temperatures", "",
          "--typical-temperature", "0", "--split-repeat", "1"]
  proc = run_without_missing(f"""
    from redrafter_jax.bench.__main__ import main
    rc = main({argv!r})
    print(json.dumps({{"rc": rc, "loaded": sorted(set(MISSING) & {{
        m.split(".")[0] for m, v in sys.modules.items() if v is not None}})}}))
  """)
  got = last_json(proc)
  assert got == {"rc": 0, "loaded": []}, proc.stderr[-3000:]
  (measurements,) = out.glob("*/*/measurements.json")
  data = json.loads(measurements.read_text())
  runs = data["runs"]["p0"]  # the first prompt of its category (--per-category 1)
  assert set(data["runs"]) == {"p0"} and set(runs) == {"ar_greedy", "redrafter_W2_L2"}
  assert runs["redrafter_W2_L2"]["output_ids"] == runs["ar_greedy"]["output_ids"]
  assert len(runs["ar_greedy"]["output_ids"]) == 4
