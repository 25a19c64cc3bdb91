"""The drafter's optimizer: AdamW after global-norm clipping, on a linear warmup + cosine decay
schedule (DESIGN §7)."""

from __future__ import annotations

import optax


def make_schedule(cfg, num_steps: int | None = None) -> optax.Schedule:
  """Linear warmup over ``warmup_fraction`` of the run, then cosine decay to 0 at its end; the
  run is ``num_steps`` steps (default ``cfg.num_steps``; a time-boxed run's fitted count)."""
  num_steps = cfg.num_steps if num_steps is None else num_steps
  warmup = int(round(cfg.warmup_fraction * num_steps))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=warmup,
      decay_steps=num_steps, end_value=0.0)


def make_optimizer(cfg, learning_rate: float | None = None) -> optax.GradientTransformation:
  """AdamW (``weight_decay``) after global-norm clipping (``grad_clip``), at ``learning_rate``
  (default: ``make_schedule(cfg)``, inside the optimizer's state). A time-boxed run passes 1.0
  and scales the updates by each step's learning rate in the step (``trainer._train_step``):
  the same AdamW, with the rate an input."""
  lr = make_schedule(cfg) if learning_rate is None else learning_rate
  adamw = optax.adamw(lr, weight_decay=cfg.weight_decay)
  if cfg.grad_clip and cfg.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
  return adamw
