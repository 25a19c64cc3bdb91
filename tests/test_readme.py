"""The user-facing documents: README.md stays short and starts with the two commands, every
relative link in README.md, docs/*.md and results/README.md resolves inside the repository, and
every command in README.md's and docs/*.md's shell blocks names a real subcommand or benchmark
and real flags with acceptable values (parsed by the command's own argparse parser, never run).

A parser is taken from the code as the command line builds it: ``redrafter_jax.cli.main`` (or a
``build_parser`` if the CLI grows one) and each module's ``parse_args``/``parser``/``main``, with
``ArgumentParser.parse_args`` intercepted so that nothing runs past the parser's construction.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import pathlib
import re
import shlex
from unittest import mock

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_README_LINES = 300

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
SHELL_INFO = {"", "sh", "bash", "shell", "console"}
LINK = re.compile(r"\[[^\]\n]*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`[^`\n]*`")
NEGATIVE_NUMBER = re.compile(r"-\d")


def documents() -> list[pathlib.Path]:
  return [README, *sorted((REPO / "docs").glob("*.md")), REPO / "results" / "README.md",
          REPO / "checkpoints" / "README.md", REPO / "results" / "drafter-stages.md",
          REPO / "configs" / "stages" / "README.md"]


def command_documents() -> list[pathlib.Path]:
  """The documents whose commands must run as written (results/README.md keeps the commands
  of past runs as they were run)."""
  return [README, *sorted((REPO / "docs").glob("*.md"))]


# ---- links -----------------------------------------------------------------------------------

def links(text: str) -> list[str]:
  """Targets of the Markdown links in ``text``, outside code blocks and code spans."""
  prose = CODE_SPAN.sub("", FENCE.sub("", text))
  return LINK.findall(prose)


def slug(heading: str) -> str:
  """GitHub's anchor for a heading."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
  prose = FENCE.sub("", text)
  return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", prose, re.M)}


def broken_links(path: pathlib.Path, repo: pathlib.Path = REPO) -> list[str]:
  """Each relative link of ``path`` that leaves ``repo`` or names nothing, and each same-page
  anchor that names no heading."""
  text = path.read_text()
  bad = []
  for target in links(text):
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:
      continue
    file_part, _, anchor = target.partition("#")
    if not file_part:
      if anchor not in anchors(text):
        bad.append(f"{target} (no such heading)")
      continue
    resolved = (path.parent / file_part).resolve()
    if not resolved.is_relative_to(repo):
      bad.append(f"{target} (outside the repository)")
    elif not resolved.exists():
      bad.append(f"{target} (does not exist)")
  return bad


def test_documents_exist():
  for path in documents():
    assert path.is_file(), f"{path.relative_to(REPO)} is missing"
  assert len(documents()) > 3, "docs/ holds no pages"


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve_inside_the_repository(path):
  assert broken_links(path) == [], f"{path.relative_to(REPO)}: broken links"


def test_link_check_catches_bad_links(tmp_path):
  """The checker itself: a link to a missing file, one out of the repository and a dangling
  anchor are reported; a code span that looks like a link is not a link."""
  page = tmp_path / "page.md"
  page.write_text("# Title\n[a](missing.md) [b](../../x) [c](#nowhere) [d](#title) "
                  "`[e](ignored.md)` [f](https://example.org)\n")
  assert broken_links(page, tmp_path) == ["missing.md (does not exist)",
                                "../../x (outside the repository)", "#nowhere (no such heading)"]


# ---- the README's shape ----------------------------------------------------------------------

def test_readme_is_short():
  n = len(README.read_text().splitlines())
  assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES})"


def test_readme_starts_with_the_two_commands():
  head = README.read_text().splitlines()[:15]
  starts = [line.split("#")[0].split() for line in head]
  assert ["make", "demo"] in starts, "`make demo` is not in README.md's first 15 lines"
  assert ["make", "test"] in starts, "`make test` is not in README.md's first 15 lines"
  first = next(i for i, line in enumerate(head) if line.startswith("```"))
  assert starts.index(["make", "demo"]) == first + 1, "the first code block opens with make demo"


def test_readme_links_nothing_beside_the_repository():
  assert len(links(README.read_text())) > 10, "the link extractor finds no links in README.md"
  for target in links(README.read_text()):
    assert not target.startswith("../"), f"README.md links {target}, outside a user's clone"


# ---- commands --------------------------------------------------------------------------------

def shell_lines(text: str) -> list[str]:
  """The logical lines of the shell code blocks (backslash continuations joined)."""
  out = []
  for m in FENCE.finditer(text):
    if m.group(1).strip().lower() not in SHELL_INFO:
      continue
    buf = ""
    for raw in m.group(2).splitlines():
      if raw.rstrip().endswith("\\"):
        buf += raw.rstrip()[:-1] + " "
        continue
      line = (buf + raw).strip()
      buf = ""
      if line and not line.startswith("#"):
        out.append(line)
  return out


def our_command(line: str) -> tuple[str, list[str]] | None:
  """``(program, args)`` for a command of ours: program is "cli" (``redrafter-jax``, ``python
  serve.py``, ``python train.py``, ``python -m redrafter_jax.cli``) or a module name
  (``python -m redrafter_jax.X``); None for anything else (make, pip, other tools)."""
  tokens = shlex.split(line, comments=True)
  while tokens and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[0]):  # VAR=value prefixes
    tokens = tokens[1:]
  if not tokens:
    return None
  if tokens[0] == "redrafter-jax":
    # the pass-through commands hand their arguments to a benchmark's own parser
    if tokens[1:2] == ["loadtest"]:
      return "redrafter_jax.bench.loadtest", tokens[2:]
    if tokens[1:2] == ["bench"]:
      return (f"redrafter_jax.bench.{tokens[2]}", tokens[3:]) if len(tokens) > 2 else (
          "redrafter_jax.bench", [])
    return "cli", tokens[1:]
  if tokens[0] not in ("python", "python3") or len(tokens) < 2:
    return None
  if tokens[1] in ("serve.py", "train.py"):
    return "cli", [tokens[1][:-3], *tokens[2:]]
  if tokens[1] == "-m" and len(tokens) > 2 and tokens[2].startswith("redrafter_jax"):
    module = tokens[2]
    if module == "redrafter_jax.cli":
      return "cli", tokens[3:]
    if module == "redrafter_jax.bench":
      if len(tokens) < 4:
        return module, []
      return f"redrafter_jax.bench.{tokens[3]}", tokens[4:]
    return module, tokens[3:]
  return None


def commands(paths) -> list[tuple[str, str]]:
  return [(f"{p.relative_to(REPO)}: {line}", line) for p in paths
          for line in shell_lines(p.read_text()) if our_command(line)]


class _Caught(Exception):
  def __init__(self, parser):
    super().__init__()
    self.parser = parser


def caught_parser(call) -> argparse.ArgumentParser | None:
  """The parser ``call`` builds and parses with, stopped at the parse; None if it parses none."""
  def stop(self, *args, **kwargs):
    raise _Caught(self)

  with (mock.patch.object(argparse.ArgumentParser, "parse_args", stop),
        mock.patch.object(argparse.ArgumentParser, "parse_known_args", stop),
        contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())):
    try:
      call()
    except _Caught as e:
      return e.parser
  return None


@functools.cache
def cli_parser() -> argparse.ArgumentParser:
  cli = importlib.import_module("redrafter_jax.cli")
  if hasattr(cli, "build_parser"):
    return cli.build_parser()
  # main() also sets up the process (glibc's malloc settings, logging): not in the test process.
  with (mock.patch.object(cli, "keep_freed_memory", lambda: None),
        mock.patch("logging.basicConfig", lambda **kwargs: None)):
    parser = caught_parser(lambda: cli.main([]))
  assert parser is not None, "redrafter_jax.cli.main parsed nothing"
  return parser


def module_parser(module_name: str) -> argparse.ArgumentParser | None:
  """The parser of ``python -m module_name``; None for a module that takes no options."""
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] != "redrafter_jax":
      pytest.skip(f"{module_name} needs {e.name}, not installed here")
    raise AssertionError(f"no module {module_name}") from None
  if callable(getattr(module, "parser", None)):
    return module.parser()
  if callable(getattr(module, "parse_args", None)):
    return caught_parser(lambda: module.parse_args([]))
  assert callable(getattr(module, "main", None)), f"{module_name} has no main"
  return caught_parser(lambda: module.main([]))


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
  for action in parser._actions:
    if isinstance(action, argparse._SubParsersAction):
      return action.choices
  return {}


def unusable(parser: argparse.ArgumentParser) -> bool:
  """The CLI's stand-in for a command whose package is not installed: it takes anything."""
  return parser.prefix_chars == "\0"


def check_args(parser: argparse.ArgumentParser | None, args: list[str], what: str) -> None:
  """Every flag in ``args`` is one the (sub)parser it reaches defines, spelled out (argparse
  would take a prefix), and the whole line parses."""
  if parser is None:
    flags = [a for a in args if a.startswith("-")]
    assert not flags, f"{what} takes no options, the line gives {flags}"
    return
  current = parser
  for arg in args:
    if unusable(current):
      pytest.skip(f"{what}: the command's packages are not installed here")
    if arg.startswith("-") and not NEGATIVE_NUMBER.match(arg):
      flag = arg.split("=", 1)[0]
      assert flag in current._option_string_actions, (
          f"{what}: {current.prog} has no option {flag}")
    elif arg in subcommands(current):
      current = subcommands(current)[arg]
  if unusable(current):
    pytest.skip(f"{what}: the command's packages are not installed here")
  err = io.StringIO()
  with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    try:
      parser.parse_args(args)
    except SystemExit as e:
      assert e.code in (0, None), f"{what}: {err.getvalue().strip().splitlines()[-1]}"


def check_command(line: str) -> None:
  program, args = our_command(line)
  if program == "cli":
    assert args, "redrafter-jax without a subcommand"
    check_args(cli_parser(), args, "redrafter-jax")
    return
  if program.startswith("redrafter_jax.bench."):
    from redrafter_jax.bench.__main__ import available

    name = program.rsplit(".", 1)[1]
    assert name in available(), f"no benchmark {name!r} (available: {', '.join(available())})"
  elif program == "redrafter_jax.bench":
    return  # the list of benchmarks
  check_args(module_parser(program), args, f"python -m {program}")


README_COMMANDS = commands([README])
DOC_COMMANDS = commands(command_documents())


def test_readme_shows_commands():
  programs = {our_command(line)[0] for _, line in README_COMMANDS}
  assert "cli" in programs, "README.md shows no redrafter-jax command"
  assert any(p.startswith("redrafter_jax.bench.") for p in programs), (
      "README.md shows no benchmark command")


@pytest.mark.parametrize("line", [line for _, line in DOC_COMMANDS],
                         ids=[name[:90] for name, _ in DOC_COMMANDS])
def test_documented_command_parses(line):
  check_command(line)


@pytest.mark.parametrize("line, message", [
    ("redrafter-jax generate --prompt hi --no-such-flag", "has no option --no-such-flag"),
    ("redrafter-jax generate --prompt hi --beam 2", "has no option --beam"),  # a prefix only
    ("redrafter-jax no-such-command", "invalid choice"),
    ("redrafter-jax lease plan --keep x", "has no option --keep"),  # dry-run's, not plan's
    ("redrafter-jax import --drafter d --out o", "has no option --drafter"),
    ("redrafter-jax demo --tree sometimes", "invalid choice"),
    ("python -m redrafter_jax.bench no_such_bench --x", "no benchmark"),
    ("python -m redrafter_jax.bench context --no-such-flag", "has no option --no-such-flag"),
    ("python -m redrafter_jax.bench report FOLDER --flag", "takes no options"),
    ("redrafter-jax loadtest --compare --no-such-flag", "has no option --no-such-flag"),
    ("redrafter-jax bench suite --no-such-flag", "has no option --no-such-flag"),
    ("python serve.py --config c.yaml --no-such-flag", "has no option --no-such-flag"),
])
def test_command_check_catches_mistakes(line, message):
  """The checker fails on what a stale README would say."""
  with pytest.raises(AssertionError, match=re.escape(message)):
    check_command(line)
