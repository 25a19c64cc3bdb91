"""Growing a continued drafter (``train.init_drafter``) into the one a preset asks for.

Three changes are allowed, alone or together, and each gives a drafter that starts as the one it
continues: the same logits for every input, so a continued run's first held-out score is that
drafter's own and training learns only what the new capacity adds.

- ``feature_layers``: a drafter that reads the LLM's last hidden state grows to read several
  layers ending at the last one. Its fresh ``feature_proj`` passes that layer through.
- ``exit_dim``: a wider drafter (EAGLE-style capacity, the width ablation's best row). The old
  channels keep their weights; the new channels get fresh random rows in ``input_proj`` (so they
  carry signal from the first step and receive gradients), and zeros everywhere they would reach
  the old channels or the logits: the ResBlocks' new rows and columns and the head's new rows.
  A ResBlock adds ``SiLU(0) = 0`` to a new channel, so the logits are the old drafter's.
- ``copy_ngram``: a drafter without the copy hint gains it. The hint's weights start at zero
  (``Drafter``), so the grown drafter ignores the hint until training teaches it to read it.
- ``context_attention`` (with ``context_heads``): a drafter without the context attention gains
  it. Its output projection starts at zero (``Drafter``), so what it reads adds nothing until
  training teaches it to; the keys, values and query start random, so gradients reach them.

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
  growable = {"feature_layers", "exit_dim", "copy_ngram", "context_attention", "context_heads"}
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
  if "copy_ngram" in differ:
    drafter = _add_option(drafter, dict(copy_ngram=asked.copy_ngram), seed=seed, source=source)
  if {"context_attention", "context_heads"} & set(differ):
    drafter = _add_option(drafter, dict(context_attention=asked.context_attention,
                                        context_heads=asked.context_heads),
                          seed=seed, source=source)
  return drafter


def _add_option(drafter: Drafter, option: dict, *, seed: int, source: str) -> Drafter:
  """``drafter`` grown an option whose new weights leave its logits as they are (the first of
  ``option``'s fields is the switch, off at 0)."""
  got = drafter.config
  name, value = next(iter(option.items()))
  if getattr(got, name) or not value:
    raise ConfigError(f"train.init_drafter {source} has {name}={getattr(got, name)}; only a "
                      f"drafter without the option grows it (asked: {name}={value})")
  grown = Drafter(dataclasses.replace(got, **option), dtype=drafter.dtype,
                  rngs=nnx.Rngs(seed))
  nnx.update(grown, nnx.state(drafter))
  grown.vocab_ids = drafter.vocab_ids
  return grown


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
  fresh_in_proj = wide.input_proj.kernel[...]
  linears = [getattr(layer, "linear", layer) for layer in wide.lm_head]  # ResBlocks', head
  wide_shapes = [(lin.kernel[...].shape, lin.bias is not None and lin.bias[...].shape)
                 for lin in linears]
  # Every weight that does not depend on the width (the RNN, feature_proj, the token ranking)
  # is the drafter's own; the width-dependent ones are set again below.
  nnx.update(wide, nnx.state(drafter))
  wide.vocab_ids = drafter.vocab_ids

  def in_corner(base, old):
    """``old`` in the leading corner of ``base``."""
    return base.at[tuple(slice(0, n) for n in old.shape)].set(old.astype(base.dtype))

  def zeros_around(old, shape):
    return in_corner(jnp.zeros(shape, old.dtype), old)

  # input_proj's new output columns keep their fresh random values: the new channels' signal.
  wide.input_proj.kernel.set_value(in_corner(fresh_in_proj, drafter.input_proj.kernel[...]))
  wide.input_proj.bias.set_value(zeros_around(drafter.input_proj.bias[...], (exit_dim,)))
  for lin, (kernel_shape, bias_shape) in zip(linears, wide_shapes):
    lin.kernel.set_value(zeros_around(lin.kernel[...], kernel_shape))
    if bias_shape:
      lin.bias.set_value(zeros_around(lin.bias[...], bias_shape))
  return wide
