"""Reversible name tables between our parameter paths and a checkpoint format's tensor names.

A table is a list of ``Rule(ours, theirs, transpose)`` with ``{i}`` standing for a layer index.
Ours are dotted NNX paths (``layers.3.self_attn.q_proj.weight`` for the base LLM, whose weights
keep PyTorch's (out, in) layout; ``lm_head.0.linear.kernel`` for the drafter, whose Flax kernels
are (in, out)); theirs are the format's names, transposed where ``transpose`` is set. The same
table maps both ways, so every format's import and export agree by construction and are
round-trip tested.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable

from redrafter_jax.errors import UserError


class WeightsError(UserError, ValueError):
  """A checkpoint is missing tensors, has unexpected ones, or has wrong shapes."""


# Tensors some checkpoints carry that the forward does not use.
_UNUSED = ("rotary_emb.inv_freq", "rope_freqs.weight")


def unused(name: str) -> bool:
  """Whether a checkpoint tensor is one the forward does not read (RoPE buffers)."""
  return any(name.endswith(s) for s in _UNUSED)


@dataclasses.dataclass(frozen=True)
class Rule:
  ours: str
  theirs: str
  transpose: bool = False


def _pattern(template: str) -> re.Pattern:
  return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


class NameTable:

  def __init__(self, name: str, rules: Iterable[Rule]):
    self.name = name
    self.rules = tuple(rules)
    self._ours = [(_pattern(r.ours), r) for r in self.rules]
    self._theirs = [(_pattern(r.theirs), r) for r in self.rules]

  def to_ours(self, theirs: str) -> tuple[str, bool] | None:
    """(our name, transpose) for a tensor name of this format, or None if it has no rule."""
    for pat, rule in self._theirs:
      m = pat.match(theirs)
      if m:
        return rule.ours.format(**m.groupdict()), rule.transpose
    return None

  def to_theirs(self, ours: str) -> tuple[str, bool] | None:
    for pat, rule in self._ours:
      m = pat.match(ours)
      if m:
        return rule.theirs.format(**m.groupdict()), rule.transpose
    return None

  def import_arrays(self, tensors: dict, *, ignore=lambda name: False) -> dict:
    """Rename (and transpose) a format's tensors into our names; unknown names are an error."""
    out, unknown = {}, []
    for name, value in tensors.items():
      mapped = self.to_ours(name)
      if mapped is None:
        if not ignore(name):
          unknown.append(name)
        continue
      ours, transpose = mapped
      out[ours] = value.T if transpose else value
    if unknown:
      raise WeightsError(f"{self.name}: unexpected tensor name(s) {sorted(unknown)[:8]}"
                         f"{' ...' if len(unknown) > 8 else ''}")
    return out

  def export_arrays(self, params: dict) -> dict:
    out = {}
    for ours, value in params.items():
      mapped = self.to_theirs(ours)
      if mapped is None:
        raise WeightsError(f"{self.name}: no name for parameter {ours!r}")
      theirs, transpose = mapped
      out[theirs] = value.T if transpose else value
    return out
