"""The package's imports point one way: no module imports from a layer above its own.

Every ``import`` in every module counts, function-level ones included (a lazy import is still a
dependency). Layers, bottom first; groups on one layer are peers and must not import each other:

  0  errors, shapes, config, sharding,  what every layer shares
     hostmem, jsonl, helptext
  1  models                             the networks and the KV cache
  2  weights                            loading and exporting them
  3  inference                          decoding: AR and ReDrafter
  4  training | serving                 the drafter's distillation | the HTTP server
  5  bench | lease                      benchmarks | GPU leases (plan, run, dry-run)
  6  commands                           the command line's subcommands
  7  cli                                the ``redrafter-jax`` entry point

The package's ``__init__`` (the curated public API) sits above all of them. Inside a group the
imports form no cycle either (a lazy import that closes one only hides it).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = "redrafter_jax"
ROOT = pathlib.Path(__file__).resolve().parents[1] / "src" / PACKAGE

LAYERS = {
    "errors": 0, "shapes": 0, "config": 0, "sharding": 0, "hostmem": 0, "jsonl": 0,
    "helptext": 0,
    "models": 1,
    "weights": 2,
    "inference": 3,
    "training": 4, "serving": 4,
    "bench": 5, "lease": 5,
    "commands": 6,
    "cli": 7,
}
# one group: they may import each other
CORE = {"errors", "shapes", "config", "sharding", "hostmem", "jsonl", "helptext"}


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def group(module: str) -> str | None:
  """The layer group of a module: ``core`` or the first name under the package."""
  top = module.split(".")[1] if "." in module else None
  if top is None:
    return None  # the package root
  return "core" if top in CORE else top


def level(module: str) -> int:
  top = module.split(".")[1] if "." in module else None
  return LAYERS[top] if top is not None else max(LAYERS.values()) + 1


def imported_modules(path: pathlib.Path, module: str) -> list[tuple[int, str]]:
  """``(line, module)`` of every import of a package module in ``path``, at any depth."""
  is_package = path.name == "__init__.py"
  out = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == PACKAGE]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative: resolve against this module's package
        anchor = module.split(".")[:len(module.split(".")) - node.level + (1 if is_package else 0)]
        base = ".".join(anchor + ([base] if base else []))
      if base.split(".")[0] != PACKAGE:
        continue
      for a in node.names:
        sub = f"{base}.{a.name}"
        out.append((node.lineno, sub if sub in MODULES else base))
  return out


def test_every_module_has_a_layer():
  unplaced = [m for m in MODULES if m != PACKAGE and m.split(".")[1] not in LAYERS]
  assert not unplaced, f"add these to LAYERS in {__file__}: {unplaced}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != PACKAGE))
def test_no_import_runs_back_up(module):
  src_level, src_group = level(module), group(module)
  bad = []
  for line, target in imported_modules(MODULES[module], module):
    if target == PACKAGE:
      bad.append(f"line {line}: imports the package root (the public API), not a module")
      continue
    if group(target) == src_group:
      continue
    if level(target) >= src_level:
      bad.append(f"line {line}: imports {target} (layer {level(target)}, {group(target)}) "
                 f"from layer {src_level} ({src_group})")
  assert not bad, f"{module}:\n  " + "\n  ".join(bad)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan), each sorted."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while not comp or comp[-1] != v:
        comp.append(stack.pop())
        on.discard(comp[-1])
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_no_import_cycles():
  graph = {m: {t for _, t in imported_modules(p, m) if t in MODULES and t not in (m, PACKAGE)}
           for m, p in MODULES.items() if m != PACKAGE}
  assert import_cycles(graph) == []
  # the finder itself: a cycle through a lazy import is one, a chain is not
  assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_walker_sees_function_level_and_relative_imports(tmp_path):
  """The checker itself: a lazy import inside a function is found, a relative one resolved."""
  path = ROOT / "inference" / "decode.py"
  found = {t for _, t in imported_modules(path, "redrafter_jax.inference.decode")}
  assert "redrafter_jax.inference.step" in found and "redrafter_jax.config" in found
  fake = tmp_path / "x.py"
  fake.write_text("def f():\n  from redrafter_jax.serving import engine\n"
                  "from . import step\n")
  got = imported_modules(fake, "redrafter_jax.inference.x")
  assert (2, "redrafter_jax.serving.engine") in got
  assert (3, "redrafter_jax.inference.step") in got
