"""Growing a continued drafter (``train.init_drafter``) into the one a preset asks for.

Two changes are allowed, alone or together, and each gives a drafter that starts as the one it
continues: the same logits for every input, so a continued run's first held-out score is that
drafter's own and training learns only what the new capacity adds.

- ``feature_layers``: a drafter that reads the LLM's last hidden state grows to read several
  layers ending at the last one. Its fresh ``feature_proj`` passes that layer through.
- ``exit_dim``: a wider drafter (EAGLE-style capacity, the width ablation's best row). The old
  channels keep their weights; the new channels get fresh random rows in ``input_proj`` (so they
  carry signal from the first step and receive gradients), and zeros everywhere they would reach
  the old channels or the logits: the ResBlocks' new rows and columns and the head's new rows.
  A ResBlock adds ``SiLU(0) = 0`` to a new channel, so the logits are the old drafter's.

Any other difference is an error, not a silently ignored field.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from redrafter_jax.config import ConfigError, DrafterConfig
from redrafter_jax.models.drafter import Drafter


def grow_as_asked(drafter: Drafter, asked: DrafterConfig, named: set[str], *, last_layer: int,
                  seed: int, source: str) -> Drafter:
  """``drafter`` as the preset's ``drafter`` section (``asked``, the fields it ``named``) wants
  it, grown where the module docstring allows. ``source`` names the drafter in errors."""
  got = drafter.config
  differ = sorted(k for k in named if getattr(asked, k) != getattr(got, k))
  growable = {"feature_layers", "exit_dim"}
  if set(differ) - growable:
    said = ", ".join(f"{k}={getattr(got, k)!r} (the preset's drafter.{k}: {getattr(asked, k)!r})"
                     for k in differ)
    raise ConfigError(f"train.init_drafter {source} has {said}; make the preset's drafter "
                      f"section match it, or train a fresh drafter")
  if "feature_layers" in differ:
    drafter = _grow_feature_layers(drafter, tuple(asked.feature_layers), last_layer=last_layer,
                                   seed=seed, source=source)
  if "exit_dim" in differ:
    drafter = _widen(drafter, asked.exit_dim, seed=seed, source=source)
  return drafter


def _grow_feature_layers(drafter: Drafter, layers: tuple[int, ...], *, last_layer: int,
                         seed: int, source: str) -> Drafter:
  got = drafter.config
  if got.feature_layers:
    raise ConfigError(
        f"train.init_drafter {source} reads layers {list(got.feature_layers)}; only a drafter "
        f"that reads the LLM's last hidden state grows drafter.feature_layers (asked: "
        f"{list(layers)})")
  if layers[-1] != last_layer:
    raise ConfigError(
        f"train.init_drafter {source} reads the LLM's last hidden state; "
        f"drafter.feature_layers={list(layers)} can grow from it only when the last listed "
        f"layer is the LLM's last ({last_layer}), so that the grown drafter starts as it was")
  grown = Drafter(dataclasses.replace(got, feature_layers=layers), dtype=drafter.dtype,
                  rngs=nnx.Rngs(seed))
  nnx.update(grown, nnx.state(drafter))
  return grown


def _widen(drafter: Drafter, exit_dim: int, *, seed: int, source: str) -> Drafter:
  got = drafter.config
  C, D = got.exit_dim, got.hidden_size
  if exit_dim < C or not got.has_input_proj or exit_dim == 2 * D:
    raise ConfigError(
        f"train.init_drafter {source} has exit_dim={C}; drafter.exit_dim={exit_dim} can grow "
        f"from it only to a wider drafter with an input projection (wider than {C}, not "
        f"{2 * D}), so that the grown drafter starts as it was")
  wide = Drafter(dataclasses.replace(got, exit_dim=exit_dim), dtype=drafter.dtype,
                 rngs=nnx.Rngs(seed))

  def embed(fresh, old, keep_fresh_columns: bool = False):
    """``old`` in the leading corner of a zero (or, for ``input_proj``'s new output columns,
    the fresh random) array of ``fresh``'s shape."""
    out = jnp.zeros(fresh.shape, fresh.dtype)
    if keep_fresh_columns:
      out = fresh
    return out.at[tuple(slice(0, n) for n in old.shape)].set(old.astype(fresh.dtype))

  wide.input_proj.kernel.set_value(
      embed(wide.input_proj.kernel[...], drafter.input_proj.kernel[...],
            keep_fresh_columns=True))
  wide.input_proj.bias.set_value(
      embed(wide.input_proj.bias[...], drafter.input_proj.bias[...]))
  for new, old in zip(wide.lm_head, drafter.lm_head):
    linear_new, linear_old = (new.linear, old.linear) if hasattr(new, "linear") else (new, old)
    linear_new.kernel.set_value(embed(linear_new.kernel[...],
                                      linear_old.kernel[...]))
    if linear_new.bias is not None:
      linear_new.bias.set_value(embed(linear_new.bias[...], linear_old.bias[...]))
  # Everything that does not depend on the width (the RNN, feature_proj, the token ranking).
  for name in ("rnn_u", "rnn_w", "feature_proj"):
    if hasattr(drafter, name):
      nnx.update(getattr(wide, name), nnx.state(getattr(drafter, name)))
  wide.token_ranking.set_value(drafter.token_ranking[...])
  wide.vocab_ids = drafter.vocab_ids
  return wide
