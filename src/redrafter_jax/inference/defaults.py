"""The settings a decode runs when the user names none: one resolution for ``generate``, ``demo``,
``tune-tree`` and the Python paths (the server resolves the same way from its preset:
``serving.server.served_decode``).

A drafter is measured with one tree, one draft vocabulary and one precision of the LLM's weights,
and it pays only with them: a larger tree with float32 weights on a CPU verifies more tokens per
step than the drafter's acceptance earns back, and ReDrafter then runs slower than AR. So, first
one found wins:

1. what the caller gives (a command-line flag, a keyword);
2. with ``tree="auto"``, and no tree setting given: the tree predicted fastest on this device
   (``tree_choice.tuned``: the drafter's measured tokens/step per tree over step times taken
   here once and cached); skipped when the drafter has no acceptance table. When even that tree
   is predicted slower than AR (a weak drafter on a device where verifying several tokens costs
   much more than one), ``Settings.decode_ar`` says so: ``generate`` then decodes with AR, which
   gives the same greedy tokens, faster;
3. the drafter's own settings (its ``decode.json``: ``weights.shipped.recommended_config``);
4. the library's: W=4, L=5, no lookup, the whole tree and vocabulary.

The LLM's weight dtype resolves the same way in ``weights.param_dtype.weights_dtype``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from redrafter_jax.config import DecodeConfig
from redrafter_jax.weights import shipped

TREES = ("recorded", "auto")  # the drafter's decode.json tree | the one fastest on this device


@dataclasses.dataclass(frozen=True)
class Settings:
  """A resolved decode: the config, where its tree came from ("given", "device", "recorded":
  decode.json's, or "default": the library's, the drafter recording none) and, for "device",
  the ``tree_choice.Choice`` with its table."""

  config: DecodeConfig
  tree_from: str
  choice: object = None

  @property
  def decode_ar(self) -> bool:
    """The tree was chosen for this device and no tree is predicted faster than AR here."""
    return self.tree_from == "device" and not self.choice.pays

  def describe(self) -> str:
    """One line: the tree, budget and vocabulary, and where the tree came from."""
    c = self.config
    where = {"given": "given", "device": "fastest on this device",
             "recorded": "the drafter's decode.json", "default": "the library's default"}
    return (f"W={c.beam_width} L={c.beam_length} lookup={c.lookup_ngram or 'off'} "
            f"N={c.num_tree_tokens} draft vocab={c.draft_vocab_size or 'all'} "
            f"(tree: {where[self.tree_from]})")


def decode_settings(drafter_path, *, tree: str = "recorded", beam_width: int | None = None,
                    beam_length: int | None = None, lookup_ngram: int | None = None,
                    token_budget: int | None = None, draft_vocab_size: int | None = None,
                    max_new_tokens: int = 128, llm=None, drafter=None,
                    log: Callable[[str], None] = print, **fields) -> Settings:
  """The decode settings for the drafter in ``drafter_path`` (see the module docstring for the
  order). ``tree="auto"`` needs the loaded ``llm`` and ``drafter`` (step times are taken with
  them) and logs the timing table through ``log``; ``fields``: other ``DecodeConfig`` fields.
  Raises ``ConfigError`` for settings that do not fit together, ``ValueError`` for an unknown
  ``tree``."""
  if tree not in TREES:
    raise ValueError(f"tree must be one of {TREES}, got {tree!r}")
  given = shipped.tree_overridden(beam_width, beam_length, lookup_ngram, token_budget)
  cfg = shipped.recommended_config(drafter_path, beam_width=beam_width, beam_length=beam_length,
                                   lookup_ngram=lookup_ngram, token_budget=token_budget,
                                   draft_vocab_size=draft_vocab_size,
                                   max_new_tokens=max_new_tokens, **fields)
  if given:
    return Settings(cfg, "given")
  if tree == "auto":
    if llm is None or drafter is None:
      raise ValueError("tree='auto' needs the loaded llm and drafter (it times their steps)")
    from redrafter_jax.inference import tree_choice

    choice = tree_choice.tuned(drafter_path, llm, drafter,
                               draft_vocab_size=cfg.draft_vocab_size, log=log)
    if choice is not None:
      return Settings(choice.config(cfg), "device", choice)
  recorded = any(k in shipped.decode_defaults(drafter_path)
                 for k in ("beam_width", "beam_length", "lookup_ngram"))
  return Settings(cfg, "recorded" if recorded else "default")
