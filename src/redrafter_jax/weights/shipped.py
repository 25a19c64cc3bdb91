"""The project's own trained drafter(s), shipped in the repository's ``checkpoints/`` folder.

``resolve_drafter("shipped")`` is the SmolLM2-135M drafter; any other value is taken as a path.
A shipped drafter folder may carry ``decode.json`` with the decoding settings it was measured
with (e.g. its recommended draft vocabulary size); they are defaults, never requirements.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

SHIPPED_NAME = "shipped"
CHECKPOINTS = pathlib.Path(__file__).resolve().parents[3] / "checkpoints"
SMOLLM2_DRAFTER = CHECKPOINTS / "smollm2-135m-drafter"


def resolve_drafter(spec: str | None) -> pathlib.Path:
  """The drafter folder for ``spec`` ('shipped' or a path); a clear error if it is missing."""
  if spec is None or spec == SHIPPED_NAME:
    path = SMOLLM2_DRAFTER
    if not (path / "config.json").is_file():
      raise FileNotFoundError(
          f"the shipped SmolLM2-135M drafter is not at {path} (a source checkout of "
          "redrafter_jax carries it in checkpoints/); pass --drafter PATH")
    return path
  path = pathlib.Path(spec).expanduser()
  if not path.exists():
    raise FileNotFoundError(f"drafter not found: {path}")
  return path


def fingerprint(path) -> str:
  """16 hex digits of SHA-256 over a drafter folder's files (names and bytes): it changes
  whenever the weights, config, ranking or decode settings do, even at the same path."""
  root = pathlib.Path(path)
  digest = hashlib.sha256()
  for f in sorted(p for p in root.rglob("*") if p.is_file()):
    digest.update(f.relative_to(root).as_posix().encode() + b"\0")
    digest.update(f.read_bytes())
  return digest.hexdigest()[:16]


def decode_defaults(path) -> dict:
  """The drafter folder's ``decode.json`` (the settings it was measured with), or ``{}``."""
  file = pathlib.Path(path) / "decode.json"
  if not file.is_file():
    return {}
  return json.loads(file.read_text())


def draft_vocab_for(path, requested: int | None = None) -> int:
  """``requested`` if given, else the draft vocabulary size the drafter was trained/measured
  with (its decode.json), else 0 (the whole vocabulary)."""
  if requested is not None:
    return requested
  return int(decode_defaults(path).get("draft_vocab_size", 0))


def recommended_config(path, *, beam_width: int | None = None, beam_length: int | None = None,
                       lookup_ngram: int | None = None, token_budget: int | None = None,
                       draft_vocab_size: int | None = None, max_new_tokens: int = 128,
                       **fields):
  """A ``DecodeConfig`` from the drafter's ``decode.json`` with the given values overriding it
  (None = the drafter's own; without a decode.json: W=4, L=5, no lookup, the whole tree and
  vocabulary). The recorded token budget belongs to the recorded tree: when W, L or the lookup
  beam is overridden and no budget is given, the whole tree is verified. ``fields``: other
  ``DecodeConfig`` fields (e.g. ``acceptance``). Raises ``ConfigError`` for settings that do not
  fit together. ``inference.defaults.decode_settings`` adds the per-device tree choice."""
  from redrafter_jax.config import DecodeConfig

  d = decode_defaults(path)
  if token_budget is None and not tree_overridden(beam_width, beam_length, lookup_ngram):
    token_budget = d.get("token_budget")
  return DecodeConfig(
      beam_width=d.get("beam_width", 4) if beam_width is None else beam_width,
      beam_length=d.get("beam_length", 5) if beam_length is None else beam_length,
      lookup_ngram=d.get("lookup_ngram", 0) if lookup_ngram is None else lookup_ngram,
      token_budget=token_budget, draft_vocab_size=draft_vocab_for(path, draft_vocab_size),
      max_new_tokens=max_new_tokens, **fields)


def tree_overridden(*values) -> bool:
  """Whether any of the tree's settings (W, L, lookup n-gram, token budget) was given."""
  return any(v is not None for v in values)
