"""A clone with nothing beside it works: no code path, test, preset or documented command reads
outside the checkout, and the data the defaults read is in it.

Early sessions read their prompt sets from a ``shared/`` folder beside the checkout, which a
user's clone does not have; these tests fail when such a path comes back.
"""

import pathlib
import re

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
# What is scanned: the code, tests, presets and the commands a user runs.
SCANNED = ("src", "tests", "configs", ".ci", "Makefile", "train.py", "serve.py", "pyproject.toml")
SUFFIXES = {".py", ".yaml", ".yml", ".toml", ".cfg", ".sh", ".txt", ".md", ".json", ""}

# Each: (pattern, what it means). Built from pieces so that this file does not match itself.
_UP, _SHARED = r"\.\.", "shared"
OUTSIDE = (
    (re.compile(_UP + r"[/\\]" + _SHARED + r"\b"), "the folder beside the checkout"),
    (re.compile(r"""/\s*["']""" + _SHARED + r"""["'/]"""), "a path joined onto a shared/ folder"),
    (re.compile(r"""["']""" + _SHARED + r"/data"), "a shared/data path"),
    (re.compile(r"\bparents\[\d+\]\.parent\b"), "a folder above a parents[] root"),
    (re.compile(r"\bREPO_ROOT\.parent\b"), "the folder above the repository root"),
    (re.compile(r"(?<![\w.])/work/"), "an absolute path of one machine"),
)


def outside_references(text: str) -> list[tuple[int, str, str]]:
  """``(line number, line, meaning)`` of each reference to a path outside the checkout."""
  out = []
  for lineno, line in enumerate(text.split("\n"), 1):
    for pattern, meaning in OUTSIDE:
      if pattern.search(line):
        out.append((lineno, line.strip(), meaning))
  return out


def scanned_files(root: pathlib.Path) -> list[pathlib.Path]:
  files = []
  for name in SCANNED:
    path = root / name
    found = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    files += [p for p in found
              if p.suffix in SUFFIXES and not any(part.endswith(".egg-info") or
                                                  part == "__pycache__" for part in p.parts)]
  return files


def offending_lines(root: pathlib.Path) -> list[str]:
  out = []
  for f in scanned_files(root):
    if f.resolve() == pathlib.Path(__file__).resolve():
      continue
    try:
      text = f.read_text(encoding="utf-8")
    except UnicodeDecodeError:
      continue
    out += [f"{f.relative_to(root)}:{n}: {meaning}: {line}"
            for n, line, meaning in outside_references(text)]
  return out


def test_nothing_refers_to_a_path_outside_the_checkout():
  assert len(scanned_files(ROOT)) > 100  # the scan reaches the code, not an empty folder
  assert offending_lines(ROOT) == []


@pytest.mark.parametrize("line", [
    'DEFAULT_PROMPTS = REPO_ROOT.parent / "shared" / "data" / "spec_bench.jsonl"',
    'path = Path(__file__).resolve().parents[1].parent / "shared" / "data"',
    "$(PY) -m redrafter_jax.bench suite --prompts " + "../" + "shared/data/spec_bench.jsonl",
    "#   redrafter-jax prompt-mix --data " + "../" + "shared/data --out runs/mix.jsonl",
    'open("' + "shared" + '/data/train_prompts.jsonl")',
    'DATA = "/work/' + 'shared/data"',
])
def test_the_scan_catches_paths_outside_the_checkout(line):
  assert outside_references(f"x = 1\n{line}\n"), line


@pytest.mark.parametrize("line", [
    'DEFAULT_PROMPTS = REPO_ROOT / "data" / "spec_bench.jsonl.gz"',
    "a slow spell of a shared machine slows every candidate alike",
    "the drafter is replicated; caches are shared by the rows",
    "[checkpoints/README.md](../checkpoints/README.md)",
])
def test_the_scan_leaves_paths_inside_the_checkout_alone(line):
  assert outside_references(line) == []


def test_a_planted_reference_fails_the_scan(tmp_path):
  (tmp_path / "src").mkdir()
  (tmp_path / "src" / "ok.py").write_text('PATH = ROOT / "data" / "x.jsonl.gz"\n')
  assert offending_lines(tmp_path) == []
  (tmp_path / "Makefile").write_text("bench:\n\tpython -m b --prompts " + "../" +
                                     "shared/data/spec_bench.jsonl\n")
  assert offending_lines(tmp_path) == [
      "Makefile:2: the folder beside the checkout: python -m b --prompts " + "../" +
      "shared/data/spec_bench.jsonl"]


def _inside(path: pathlib.Path) -> bool:
  try:
    path.resolve().relative_to(ROOT)
  except ValueError:
    return False
  return True


def test_default_data_is_inside_the_checkout():
  from redrafter_jax.bench import ar
  from redrafter_jax.training import prompt_mix
  from redrafter_jax.weights import shipped

  assert _inside(ar.DEFAULT_PROMPTS) and ar.DEFAULT_PROMPTS.is_file()
  assert len(ar.read_prompts(ar.DEFAULT_PROMPTS, None)) == 480
  assert _inside(prompt_mix.SOURCES)
  for name in ("train_prompts", "qa_prompts", "passages"):
    assert _inside(prompt_mix.source_file(prompt_mix.SOURCES, name))
  assert _inside(shipped.SMOLLM2_DRAFTER) and (shipped.SMOLLM2_DRAFTER / "config.json").is_file()


def _header_commands(text: str) -> str:
  """The commands a preset's comments document, continuation lines joined."""
  lines = [line.lstrip("#").strip() for line in text.split("\n") if line.startswith("#")]
  return " ".join(lines).replace("\\ ", " ")


PRESETS = sorted((ROOT / "configs").rglob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: str(p.relative_to(ROOT)))
def test_presets_read_data_inside_the_checkout(preset):
  """A preset's training data is in the checkout, or is what a command its comments document
  writes under runs/ (from inputs in the checkout); its drafter and base preset are too."""
  text = preset.read_text()
  cfg = yaml.safe_load(text) or {}
  commands = _header_commands(text)
  written = set(re.findall(r"--out\s+(\S+)", commands))
  read = re.findall(r"--(?:prompts|data|exclude|seeds)\s+(\S+)", commands)
  for path in read:
    assert path in written or path.startswith("runs/") or (ROOT / path).exists(), \
        f"{preset.name}: a documented command reads {path}, which is not in the checkout"
  data = (cfg.get("train") or {}).get("data")
  for path in [data] if isinstance(data, str) else (data or []):
    assert (ROOT / path).exists() or (path.startswith("runs/") and path in written) or \
        (path.startswith("runs/") and _documented_elsewhere(path)), \
        f"{preset.name}: train.data {path} is not in the checkout nor made by a documented command"
  if cfg.get("drafter_path") not in (None, "shipped"):
    assert _inside(ROOT / cfg["drafter_path"]), cfg["drafter_path"]
  if "base" in cfg:
    assert (ROOT / cfg["base"]).is_file(), cfg["base"]


def _documented_elsewhere(path: str) -> bool:
  """``path`` is written by a command documented in some preset's comments (a stage-2 preset
  reads what stage 1's preset documents)."""
  return any(path in re.findall(r"--out\s+(\S+)", _header_commands(p.read_text()))
             for p in PRESETS)


def test_results_hold_measurements_not_scripts():
  """``results/`` holds what runs measured; how to measure is a command of the package (a
  ``bench`` option), written on the run's page. A script left there is code no test runs."""
  scripts = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "results").rglob("*")
                   if p.suffix in (".sh", ".py", ".bash"))
  assert scripts == []
