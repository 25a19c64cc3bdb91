"""JSON-lines files (prompts, answers, prompt mixes): reading them checked, writing them
reproducibly, and ``DataError``, the error of every malformed data file.

It sits on the bottom layer and needs only the standard library, so code that merely reads a
prompts file (the benchmarks) does not import the training stack and its input pipeline
(grain), which an inference-only machine may lack. ``training.data`` re-exports ``DataError``:
the training code raises it for its own folders, shards and records too.
"""

from __future__ import annotations

import gzip
import json
import pathlib
from typing import Any, Mapping, Sequence

from redrafter_jax.errors import UserError


class DataError(UserError, ValueError):
  """A data folder, prompts file or record is missing or malformed."""


def read_jsonl(path: str | pathlib.Path, field: str, *, what: str = "file",
               limit: int | None = None) -> list[tuple[int, dict[str, Any]]]:
  """``(line number, object)`` of each non-blank line of a JSON-lines file (gzip-compressed when
  its name ends in ``.gz``); every object must hold a non-empty string ``field``. Lines end at
  "\\n" only (``str.splitlines`` would also split at U+2028 inside a JSON string)."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise DataError(f"{what} not found: {path}")
  raw = path.read_bytes()
  text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode("utf-8")
  out = []
  for lineno, line in enumerate(text.split("\n"), 1):
    if not line.strip():
      continue
    try:
      obj = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
    if not isinstance(obj, dict) or not isinstance(obj.get(field), str) or not obj[field].strip():
      raise DataError(f"{path}:{lineno}: expected an object with a non-empty string {field!r}")
    out.append((lineno, obj))
    if limit is not None and len(out) >= limit:
      break
  return out


def write_jsonl(rows: Sequence[Mapping[str, Any]], path: str | pathlib.Path) -> None:
  """Write rows as JSON lines (gzip-compressed, byte-for-byte reproducible, for ``.gz``)."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
  path.write_bytes(gzip.compress(text, mtime=0) if path.suffix == ".gz" else text)
