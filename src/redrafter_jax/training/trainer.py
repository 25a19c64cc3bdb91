"""Distillation training of the drafter against the frozen LLM (DESIGN §7).

``train(preset)`` runs the whole job: load the LLM and place it on the mesh (``sharding.py``), build
the drafter (fresh, or from ``train.init_drafter``, which may grow wider or read more layers and
starts as it was: ``grow.py``), read batches with the grain
pipeline (``data.py``), and run a jitted step — LLM hidden states on the fly (no gradient) or read
from a features folder (``features.py``, ``train.features``), the chunked distillation loss
(``losses.py``), AdamW with linear warmup + cosine decay and global-norm clipping — with explicit
shardings and a donated train state. Every ``checkpoint_every`` steps, at a requested stop and at
the end it saves a checkpoint (``checkpoint.py``); a rerun with the same output folder resumes from
the newest one and sees exactly the batches it would have seen. At the end the drafter is exported
in the reference format (the redrafter-jax format for a multi-layer drafter, which the reference
cannot hold) to ``<output_dir>/drafter``, with its token ranking (response-token frequency in the
data, or a continued drafter's own; ``train.vocab_limit`` trains on the top K of it).

Time-boxed runs (``train.max_seconds``) fit their step count and schedule to the time they
are given (``timebox.py``).

Held-out evaluation (``train.eval_shards``; every ``eval_every`` steps and at the end, to
``eval.csv``) scores every greedy answer of the held-out shards, packed in a fixed order into
fixed batches (``data.held_out_batches``): no seed and no iterator state enters, so every run and
seed of a preset scores the same positions, and a run holding out mix-v1's ``shard-00062``
scores the committed ``heldout`` evaluation set's answers (``eval_set``). ``train.eval_batches``
is not read (presets still carry it).

Outputs in ``train.output_dir``: ``checkpoints/``, ``metrics.csv``, TensorBoard events in
``tb/``, ``curves.png``, ``drafter/`` (and ``schedule.json`` for a time-boxed run).
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import logging
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from tqdm.auto import tqdm

from redrafter_jax import sharding as sh
from redrafter_jax.config import ConfigError, DrafterConfig, Preset
from redrafter_jax.models.drafter import (Drafter, TokenRanking, init_head_from_llm,
                                          restrict_vocab, with_matmul_dtype)
from redrafter_jax.training import data as data_lib
from redrafter_jax.training import losses
from redrafter_jax.training import timebox as timebox_lib
from redrafter_jax.training.checkpoint import Checkpointer, abstract_like
from redrafter_jax.training.grow import grow_as_asked
from redrafter_jax.training.optimizer import make_optimizer, make_schedule
from redrafter_jax.training.timebox import TimeBox
from redrafter_jax.weights.base_model import load_base_model

log = logging.getLogger(__name__)

# Settings that may change between a run and its resumption (they do not change the math).
RESUMABLE_CHANGES = ("train.output_dir", "train.data", "train.features", "train.log_every", "train.checkpoint_every",
                     "train.keep_checkpoints", "train.mesh_data", "train.mesh_model",
                     "train.loss_chunk", "train.eval_every", "train.eval_batches", "decode",
                     "drafter_path")



@struct.dataclass
class TrainState:
  step: jax.Array
  params: Any  # the drafter's parameters as a pure nested dict
  opt_state: Any

  def as_dict(self) -> dict[str, Any]:
    return {"step": self.step, "params": self.params, "opt_state": self.opt_state}


@dataclasses.dataclass
class TrainResult:
  history: list[dict[str, Any]]  # one row per step run in this call: loss, accuracies, ...
  last_step: int
  start_step: int
  num_steps: int  # the run's step count: train.num_steps, or what a time-boxed run fitted
  params: Any  # host copy of the drafter parameters after the last step
  drafter_dir: pathlib.Path | None
  eval_history: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # held-out rows


@dataclasses.dataclass(frozen=True, eq=False)
class LossSpec:
  """The static settings of a step's loss (closed over by the jitted step)."""

  llm_graphdef: Any
  drafter_of: Any  # params -> the drafter the loss trains
  vocab_ids_R: Any  # a restricted head's token ids, or None
  loss: losses.LossConfig
  feature_layers: tuple[int, ...] = ()  # the drafter's (DrafterConfig.feature_layers)
  seed: int = 0

  @classmethod
  def make(cls, llm_graphdef, drafter_of, vocab_ids_R, cfg, feature_layers=(),
           lookup_ngram: int = 3) -> "LossSpec":
    """From the recipe ``cfg`` (``TrainConfig``); ``lookup_ngram`` is decoding's."""
    loss = losses.LossConfig(
        num_steps=cfg.num_draft_steps, chunk=cfg.loss_chunk, soft=cfg.soft_targets,
        step_weight_decay=cfg.step_weight_decay, self_feed=cfg.self_feed,
        rank_weight=cfg.rank_loss_weight, rank_top_k=cfg.rank_top_k,
        lookup_covered_weight=cfg.lookup_covered_weight, lookup_ngram=lookup_ngram)
    return cls(llm_graphdef, drafter_of, vocab_ids_R, loss, tuple(feature_layers), cfg.seed)


def _batch_loss(spec: LossSpec, llm_state, batch, step=None):
  """``params -> (loss, metrics)`` on ``batch``, the frozen LLM's part computed once (its hidden
  states read from the batch when it holds them: ``train.features``; for a multi-layer drafter
  they hold the last hidden state then the layer states, ``features.py``). ``step`` (an array)
  seeds the self-fed positions; None (evaluation) feeds the data tokens only, so held-out
  rows compare across recipes."""
  llm = nnx.merge(spec.llm_graphdef, llm_state)
  tokens_BT, segments_BT = batch["tokens"], batch["segment_ids"]
  embedding_VD = llm.embed_tokens.embedding[...]
  D = embedding_VD.shape[1]
  if "hidden" in batch:
    stored = batch["hidden"].astype(embedding_VD.dtype)  # distill_loss stops its gradient
    hidden_BTD, context_BTX = stored[..., :D], stored[..., D:]
  else:
    hidden_BTD, context_BTX = losses.frozen_features(llm, tokens_BT, batch["positions"],
                                                     segments_BT, spec.feature_layers)
  if not spec.feature_layers:
    context_BTX = None
  config = spec.loss
  teacher = config.soft or config.rank_weight > 0
  teacher_out_VD = llm.output_matrix() if teacher else None
  if step is None:
    config = dataclasses.replace(config, self_feed=0.0)
  rng = (jax.random.fold_in(jax.random.key(spec.seed), step) if config.self_feed > 0 else None)
  inputs = losses.LossBatch(hidden_BTD, embedding_VD, tokens_BT, batch["loss_mask"], segments_BT,
                            context_BTX, teacher_out_VD)

  def loss_fn(params):
    return losses.distill_loss(spec.drafter_of, params, inputs, config,
                               vocab_ids_R=spec.vocab_ids_R, rng=rng)

  return loss_fn


def _train_step(loss_spec, tx, schedule, llm_state, state: TrainState, batch, lr=None):
  """One optimizer step. ``schedule`` is the one inside ``tx`` (for the ``lr`` metric); with
  ``lr`` given (a time-boxed run: ``tx`` at unit rate) the updates are scaled by it."""
  loss_fn = _batch_loss(loss_spec, llm_state, batch, state.step)
  (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  if lr is None:
    lr = schedule(state.step)
  else:
    updates = jax.tree.map(lambda u: jnp.asarray(lr, u.dtype) * u, updates)
  params = optax.apply_updates(state.params, updates)
  metrics = dict(metrics, loss=loss, grad_norm=optax.global_norm(grads), lr=lr,
                 tokens=jnp.sum(batch["segment_ids"] > 0))
  return TrainState(state.step + 1, params, opt_state), metrics


def _eval_step(loss_spec, llm_state, params, batch):
  """The loss and metrics of one held-out batch (no update)."""
  loss, metrics = _batch_loss(loss_spec, llm_state, batch)(params)
  return dict(metrics, loss=loss)


def _eval_row(step: int, batch_metrics) -> dict[str, Any]:
  """One held-out row: per-step metrics averaged over the batches, weighted by their targets."""
  ms = [{k: np.asarray(sh.local_value(v)) for k, v in m.items()} for m in batch_metrics]
  count_n = sum(m["count_n"] for m in ms)
  means = {name: sum(m[name] * m["count_n"] for m in ms) / np.maximum(count_n, 1)
           for name in PER_STEP_METRICS}
  return {"step": step, "targets": int(count_n[0]), **_per_step_columns(means),
          "loss": float(np.sum(means["loss_n"]))}


# Per-step ``[n]`` metrics of ``losses.distill_loss``; a row holds them as ``loss_1``, ...
PER_STEP_METRICS = ("loss_n", "top1_n", "top5_n", "coverage_n")


def _per_step_columns(metrics) -> dict[str, float]:
  return {f"{name[:-2]}_{i + 1}": float(v) for name in PER_STEP_METRICS
          for i, v in enumerate(np.asarray(metrics[name]).tolist())}


def preset_dict(preset: Preset) -> dict[str, Any]:
  return dataclasses.asdict(preset)


def _flat(d, prefix=""):
  out = {}
  for k, v in d.items():
    key = f"{prefix}{k}"
    if isinstance(v, dict) and k not in ("drafter",):
      out.update(_flat(v, key + "."))
    else:
      out[key] = list(v) if isinstance(v, tuple) else v
  return out


def check_resumable(saved: dict[str, Any], current: dict[str, Any], where) -> None:
  """Refuse to resume a checkpoint written under settings that change the run."""
  a, b = _flat(saved), _flat(current)
  # A setting added after the checkpoint was written counts as its default there.
  a = {**_flat(preset_dict(Preset())), **a}
  ignored = lambda k: any(k == p or k.startswith(p + ".") for p in RESUMABLE_CHANGES)
  diff = sorted(k for k in set(a) | set(b) if not ignored(k) and a.get(k) != b.get(k))
  if diff:
    detail = "; ".join(f"{k}: checkpoint {a.get(k)!r}, config {b.get(k)!r}" for k in diff)
    raise ConfigError(f"the checkpoint in {where} was written with other settings ({detail}); "
                      "its drafter/optimizer state does not fit this run — restore those "
                      "settings or use a new train.output_dir")


def training_shards(cfg) -> dict[str, int]:
  """``data.shard_paths``' selection for ``train.data``: its first ``data_shards`` shards, the
  last ``eval_shards`` of those held out (add ``part="eval"`` for them)."""
  return dict(holdout=cfg.eval_shards, first=cfg.data_shards)


def build_drafter(preset: Preset, llm_cfg) -> Drafter:
  cfg = preset.train
  if cfg.init_drafter:
    from redrafter_jax.weights.drafter_io import load_drafter

    drafter = load_drafter(cfg.init_drafter)
    got = drafter.config
    if (got.hidden_size, got.vocab_size) != (llm_cfg.hidden_size, llm_cfg.vocab_size):
      raise ConfigError(
          f"train.init_drafter {cfg.init_drafter}: drafter has hidden_size={got.hidden_size}, "
          f"vocab_size={got.vocab_size} but the LLM {preset.model!r} has hidden_size="
          f"{llm_cfg.hidden_size}, vocab_size={llm_cfg.vocab_size}")
    return _as_the_preset_asks(drafter, preset, llm_cfg)
  dcfg: DrafterConfig = preset.drafter_config(llm_cfg)
  return Drafter(dcfg, rngs=nnx.Rngs(cfg.seed))


def _as_the_preset_asks(drafter: Drafter, preset: Preset, llm_cfg) -> Drafter:
  """``train.init_drafter``'s drafter, checked against the fields the preset's ``drafter``
  section names, and grown where ``grow`` allows (wider, or reading more layers), so that it
  starts as the drafter it continues; any other difference is an error."""
  return grow_as_asked(drafter, preset.drafter_config(llm_cfg), set(preset.drafter or {}),
                       last_layer=llm_cfg.num_layers - 1, seed=preset.train.seed,
                       source=preset.train.init_drafter)


def _frozen_llm(preset: Preset, mesh, data_vocab: int | None):
  """The LLM's graph, its state placed on ``mesh`` (tensor-parallel rules), its config and its
  output projection ``[V, D]`` on the host (only when ``train.head_init`` is "llm")."""
  llm, llm_cfg = load_base_model(preset.model, dtype=preset.dtype, param_dtype=preset.param_dtype)
  out_VD = None
  if preset.train.head_init == "llm" and not preset.train.init_drafter:
    out_VD = np.asarray(llm.output_matrix(), np.float32)
  if data_vocab is not None and data_vocab != llm_cfg.vocab_size:
    raise ConfigError(f"data in {preset.train.data} was made by a model with vocab_size "
                      f"{data_vocab}, but {preset.model!r} has vocab_size {llm_cfg.vocab_size}")
  graphdef, state = nnx.split(llm)
  shardings = sh.state_shardings(state, mesh)
  return graphdef, sh.place(state, shardings), shardings, llm_cfg, out_VD


def _continued_ranking(cfg, drafter: Drafter) -> np.ndarray | None:
  """The ranking a continued drafter (``train.init_drafter``) keeps: its own. With
  ``vocab_limit`` its head trained the rows of that ranking's top tokens; a ranking of the new
  data would zero those it does not share and start its own from zero (and the run's step 0
  would not score the drafter it continues). None for a fresh drafter, or one saved without a
  ranking (token-id order, e.g. Apple's): the new data ranks the tokens then."""
  if not cfg.init_drafter:
    return None
  ranking_V = np.asarray(drafter.token_ranking[...])
  return None if np.array_equal(ranking_V, np.arange(ranking_V.size)) else ranking_V


def _trainable_drafter(preset: Preset, llm_cfg, out_VD=None):
  """``(merge, drafter_of, train_drafter_of, params, vocab_ids_R)``: params (pure dict) -> full
  drafter; -> the drafter the loss scores (vocabulary-restricted with ``vocab_limit``); -> the
  same, multiplying in ``train.matmul_dtype``, for the training step; initial params."""
  cfg = preset.train
  drafter = build_drafter(preset, llm_cfg)
  # The response-token ranking goes out with the drafter (``restrict_vocab`` reads it) and,
  # with ``vocab_limit``, picks the tokens the head trains on.
  counts = data_lib.token_counts(cfg.data, llm_cfg.vocab_size, **training_shards(cfg))
  kept_V = _continued_ranking(cfg, drafter)
  ranking_V = np.argsort(-counts, kind="stable") if kept_V is None else kept_V
  drafter.token_ranking = TokenRanking(jnp.asarray(ranking_V, jnp.int32))
  vocab_ids_R = None
  if 0 < cfg.vocab_limit < llm_cfg.vocab_size:
    vocab_ids_R = drafter.token_ranking[...][:cfg.vocab_limit]
  if out_VD is not None:
    init_head_from_llm(drafter, out_VD, vocab_ids_R)
  if vocab_ids_R is not None:
    log.info("the head trains on the %d top tokens of %s ranking: %.2f%% of response tokens",
             cfg.vocab_limit, "this data's" if kept_V is None else "the continued drafter's",
             100 * counts[np.asarray(vocab_ids_R)].sum() / max(counts.sum(), 1))
    # Rows of tokens that never train get logit 0 rather than a random one, so a drafter
    # decoded without ``restrict_vocab`` does not propose them at random.
    head = drafter.lm_head[-1]
    keep_V = jnp.zeros((llm_cfg.vocab_size,), bool).at[vocab_ids_R].set(True)
    head.kernel.set_value(jnp.where(keep_V[None, :], head.kernel[...], 0))
  # Only nnx.Params train; the rest (the token ranking) is fixed.
  graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
  merge = lambda p: nnx.merge(graphdef, p, rest)

  def scored(graph):  # params -> the drafter the loss scores, built on ``graph``
    if vocab_ids_R is None:
      return lambda p: nnx.merge(graph, p, rest)
    return lambda p: restrict_vocab(nnx.merge(graph, p, rest), cfg.vocab_limit)

  train_graphdef = graphdef
  if cfg.matmul_dtype != "float32":
    train_graphdef = nnx.split(with_matmul_dtype(drafter, jnp.dtype(cfg.matmul_dtype)),
                               nnx.Param, ...)[0]
  return (merge, scored(graphdef), scored(train_graphdef), nnx.to_pure_dict(params),
          vocab_ids_R)


class _Meter:
  """Collects per-step device metrics and turns them into host rows at log points, timing
  throughput from the end of the first (compiling) step."""

  def __init__(self):
    self.pending, self.clock, self.tokens = [], None, 0

  def add(self, step: int, metrics) -> list[dict[str, Any]] | None:
    self.pending.append((step, metrics))
    if self.clock is None:
      rows = self.flush()
      self.clock, self.tokens = time.perf_counter(), 0
      return rows
    return None

  def flush(self) -> list[dict[str, Any]]:
    rows = [_host_metrics(s, m) for s, m in self.pending]
    self.pending = []
    if self.clock is not None:
      self.tokens += sum(r["tokens"] for r in rows)
      tok_s = self.tokens / max(time.perf_counter() - self.clock, 1e-9)
      for r in rows:
        r["tokens_per_s"] = tok_s
    return rows


def train(preset: Preset, *, stop_after: int | None = None, save_at_stop: bool = True,
          progress: bool = True, export: bool = True) -> TrainResult:
  """Train (or resume) the drafter per ``preset``, from the newest checkpoint in its output dir.

  With ``train.max_seconds`` the run is time-boxed (module docstring): its step count, fixed
  ``PROBE_STEPS`` steps after this call's first step and recorded in ``schedule.json``, takes
  the place of ``num_steps`` for the end of the run (final evaluation, checkpoint and export);
  with held-out evaluation on, the held-out set is also scored at the deciding step, which
  measures what the final evaluation costs. A resumed time-boxed run keeps the recorded count.

  Args:
    preset: the model to distil from, the drafter's shape and ``preset.train`` (data, mesh,
      optimiser, schedule, time budget, checkpoint and eval cadence, output folder).
    stop_after: end this call after that many steps (a time-boxed slice; rerun to continue).
    save_at_stop: write a checkpoint where ``stop_after`` stops (False simulates a crash in
      tests).
    progress: show a progress bar.
    export: at the last step, write the drafter in the reference format (redrafter-jax for a
      multi-layer drafter) to ``output_dir/drafter``.

  Returns:
    A ``TrainResult``: the per-step metrics of this call, the first and last step, the run's
    step count, the drafter's parameters (host copy), the exported folder (or None) and
    held-out eval rows.
  """
  t0 = timebox_lib.clock()
  cfg = preset.train
  out_dir = pathlib.Path(cfg.output_dir)
  data_vocab = data_lib.data_vocab_size(cfg.data)  # fail on bad data before loading models
  mesh = sh.make_mesh(cfg.mesh_data, cfg.mesh_model)
  rows = sh.process_rows(mesh, cfg.batch_size)
  llm_graphdef, llm_state, llm_shardings, llm_cfg, out_VD = _frozen_llm(preset, mesh, data_vocab)
  merge, drafter_of, train_drafter_of, params, vocab_ids_R = _trainable_drafter(
      preset, llm_cfg, out_VD)
  feature_layers = merge(params).config.feature_layers
  boxed = cfg.max_seconds is not None
  # A time-boxed run's schedule is fixed only once it has timed itself: its optimizer runs at
  # unit rate and the step takes the rate as an input.
  tx = make_optimizer(cfg, learning_rate=1.0 if boxed else None)
  schedule = None if boxed else make_schedule(cfg)
  repl = sh.replicated(mesh)
  state = jax.jit(lambda p: TrainState(jnp.zeros((), jnp.int32), p, tx.init(p)),
                  out_shardings=repl)(sh.place(params, jax.tree.map(lambda _: repl, params)))
  state_shardings = jax.tree.map(lambda _: repl, state)
  data_kwargs = dict(seq_len=cfg.seq_len, global_batch=cfg.batch_size, seed=cfg.seed,
                     pack=cfg.pack, rows=rows, vocab_size=llm_cfg.vocab_size,
                     features=cfg.features, hidden_size=llm_cfg.hidden_size,
                     feature_layers=feature_layers, num_layers=llm_cfg.num_layers,
                     **training_shards(cfg))
  iterator = data_lib.make_iterator(cfg.data, **data_kwargs)

  ckpt = Checkpointer(out_dir / "checkpoints", keep=cfg.keep_checkpoints)
  config = preset_dict(preset)
  start = ckpt.latest_step() or 0
  if start:
    check_resumable(ckpt.read_config(start), config, ckpt.directory)
    abstract = abstract_like(state.as_dict(), state_shardings.as_dict())
    state = TrainState(**ckpt.restore(start, abstract, iterator))
  is_main = jax.process_index() == 0
  timebox = TimeBox(cfg, out_dir, start, t0, write=is_main) if boxed else None
  num_steps = timebox.num_steps if boxed else cfg.num_steps  # the run's: fitted when time-boxed
  if start:
    log.info("resuming at step %d of %d", start, num_steps)

  # Held-out evaluation scores the float32 drafter whatever the step multiplies in.
  loss_spec = LossSpec.make(llm_graphdef, drafter_of, vocab_ids_R, cfg, feature_layers,
                            preset.decode.lookup_ngram)
  train_spec = dataclasses.replace(loss_spec, drafter_of=train_drafter_of)
  step_fn = jax.jit(
      functools.partial(_train_step, train_spec, tx, schedule),
      in_shardings=(llm_shardings, state_shardings, sh.batch_sharding(mesh))
      + ((repl,) if boxed else ()),
      out_shardings=(state_shardings, repl), donate_argnums=(1,))

  evaluate = None
  if cfg.eval_shards:
    eval_fn = jax.jit(functools.partial(_eval_step, loss_spec), out_shardings=repl)

    held_out = {k: v for k, v in data_kwargs.items() if k != "seed"}
    data_lib.held_out_batches(cfg.data, **held_out)  # fails on a bad held-out set now

    def evaluate(step, params):
      # Every greedy answer of the held-out shards, in the same fixed batches every time
      # (``data.held_out_batches``): no seed enters, so every run scores the same positions.
      return _eval_row(step, [eval_fn(llm_state, params,
                                      sh.shard_batch(batch, mesh, cfg.batch_size))
                              for batch in data_lib.held_out_batches(cfg.data, **held_out)])

  metrics_log = MetricsLog(out_dir, start_step=start, enabled=is_main)
  eval_log = MetricsLog(out_dir, start_step=start, enabled=is_main and evaluate is not None,
                        name="eval")
  eval_history = []
  call_end = lambda n: n if stop_after is None else min(n, start + stop_after)
  end = call_end(num_steps)
  bar = tqdm(total=num_steps, initial=start, desc="train", unit="step",
             disable=not (progress and is_main))
  history, meter = [], _Meter()

  def record_eval(step, params):
    row = evaluate(step, params)
    eval_log.write(row)
    eval_history.append(row)
    log.info("step %d held-out: loss %.3f, top-1 %s", step, row["loss"],
             " ".join(f"{row[f'top1_{i + 1}']:.3f}" for i in range(cfg.num_draft_steps)))

  if evaluate is not None and cfg.init_drafter and start == 0 < end:
    record_eval(0, state.params)  # the starting drafter: the baseline a continued run must beat
  step = start
  while step < end:
    step += 1
    batch = sh.shard_batch(next(iterator), mesh, cfg.batch_size)
    if timebox is None:
      state, metrics = step_fn(llm_state, state, batch)
    else:
      state, metrics = step_fn(llm_state, state, batch, timebox.lr(step))
      timebox.time_step(step, metrics)
    deciding = timebox is not None and timebox.deciding(step)
    rows_out = meter.add(step, metrics)
    if rows_out is None and (step % cfg.log_every == 0 or step == end or deciding):
      rows_out = meter.flush()
    for r in rows_out or ():
      metrics_log.write(r)
      history.append(r)
      if r["targets"] == 0:
        log.warning("step %d had no training targets (no response tokens within seq_len=%d?)",
                    r["step"], cfg.seq_len)
    if rows_out:
      last = rows_out[-1]
      bar.set_postfix(loss=f"{last['loss']:.3f}", top1=f"{last['top1_1']:.3f}",
                      tok_s=f"{last['tokens_per_s'] or 0:.0f}")
    bar.update(1)
    if timebox is not None and timebox.refitting(step):
      num_steps = timebox.refit(step)
      end = call_end(num_steps)
      bar.total = num_steps
      bar.refresh()
    eval_seconds = 0.0
    if evaluate is not None and (step == num_steps or deciding
                                 or (cfg.eval_every and step % cfg.eval_every == 0)):
      eval_start = timebox_lib.clock()
      record_eval(step, state.params)
      eval_seconds = timebox_lib.clock() - eval_start
    if deciding:
      num_steps = timebox.decide(step, eval_seconds)
      end = call_end(num_steps)
      bar.total = num_steps
      bar.refresh()
    if step % cfg.checkpoint_every == 0 and step < num_steps:
      ckpt.save(step, state.as_dict(), iterator, config)
  bar.close()

  host_params = jax.tree.map(sh.local_value, state.params)
  drafter_dir = None
  if end > start and ckpt.latest_step() != end and (end == num_steps or save_at_stop):
    ckpt.save(end, state.as_dict(), iterator, config)
  if end == num_steps and end > start:
    if is_main:
      metrics_log.plot(eval_log.rows)
      if export:
        from redrafter_jax.weights.drafter_io import save_drafter

        final = merge(jax.tree.map(jnp.asarray, host_params))
        drafter_dir = save_drafter(final, out_dir / "drafter", overwrite=True,
                                   format="redrafter-jax" if final.config.own_options
                                   else "reference")
  ckpt.close()
  metrics_log.close()
  eval_log.close()
  return TrainResult(history=history, last_step=end, start_step=start, num_steps=num_steps,
                     params=host_params, drafter_dir=drafter_dir, eval_history=eval_history)


def export_checkpoint(preset: Preset, out, step: int | None = None) -> pathlib.Path:
  """Write the drafter that a run of ``preset`` saved at ``step`` (None: its latest checkpoint)
  to the folder ``out``, as the run's own export would at its end (format by its options).

  Args:
    preset: the run's preset (its ``train.output_dir`` holds the checkpoints).
    out: the drafter folder to write (replaced if it exists).
    step: a saved step.

  Returns:
    The folder written.
  """
  from redrafter_jax.weights.drafter_io import save_drafter

  cfg = preset.train
  ckpt = Checkpointer(pathlib.Path(cfg.output_dir) / "checkpoints", keep=cfg.keep_checkpoints)
  steps = ckpt.all_steps()
  step = ckpt.latest_step() if step is None else step
  if step is None or step not in steps:
    raise ConfigError(f"{ckpt.directory}: no checkpoint at step {step} (saved: {steps})")
  check_resumable(ckpt.read_config(step), preset_dict(preset), ckpt.directory)
  params = ckpt.restore_params(step)
  ckpt.close()
  mesh = sh.make_mesh(cfg.mesh_data, cfg.mesh_model)
  _, _, _, llm_cfg, _ = _frozen_llm(preset, mesh, data_lib.data_vocab_size(cfg.data))
  merge, _, _, like, _ = _trainable_drafter(preset, llm_cfg)
  def like_this(saved, want):  # the saved dict's keys are strings where the drafter's are ints
    if not isinstance(want, dict):
      return jnp.asarray(saved, want.dtype)
    return {k: like_this(saved[str(k)] if str(k) in saved else saved[k], v)
            for k, v in want.items()}

  drafter = merge(like_this(params, like))
  return save_drafter(drafter, out, overwrite=True,
                      format="redrafter-jax" if drafter.config.own_options else "reference")


def _host_metrics(step: int, metrics) -> dict[str, Any]:
  m = {k: sh.local_value(v) for k, v in metrics.items()}
  row = {"step": step, "loss": float(m["loss"]), "lr": float(m["lr"]),
         "grad_norm": float(m["grad_norm"]), "tokens": int(m["tokens"]),
         "targets": int(np.asarray(m["count_n"])[0]), "tokens_per_s": None}
  return {**row, **_per_step_columns(m)}


def flat_dict(tree) -> dict[str, np.ndarray]:
  """``{"lm_head.0.linear.kernel": array}`` from a nested parameter dict (host copies)."""
  return {sh.path_name(path): np.asarray(sh.local_value(v))
          for path, v in jax.tree_util.tree_leaves_with_path(tree)}


class MetricsLog:
  """Per-step metrics to ``{name}.csv`` (``metrics.csv``; ``eval.csv`` for held-out rows) and
  TensorBoard (``tb/``, tags ``train/...`` or ``eval/...``); ``plot()`` draws the curves.

  On resumption the rows after the resumed step (written before a crash) are dropped, so the
  files describe one consistent run.
  """

  def __init__(self, out_dir: pathlib.Path, *, start_step: int, enabled: bool = True,
               name: str = "metrics"):
    self.enabled = enabled
    self.path = out_dir / f"{name}.csv"
    self.tag = "train" if name == "metrics" else name
    self.rows: list[dict[str, Any]] = []
    self._tb = None
    if not enabled:
      return
    out_dir.mkdir(parents=True, exist_ok=True)
    if self.path.is_file():
      with open(self.path, newline="") as f:
        self.rows = [r for r in csv.DictReader(f) if int(r["step"]) <= start_step]
    try:
      from tensorboardX import SummaryWriter

      self._tb = SummaryWriter(str(out_dir / "tb"), purge_step=start_step + 1)
    except ImportError:  # tensorboardX is optional (the "train" extra); the CSV always exists
      log.info("tensorboardX not installed: metrics go to %s only", self.path)

  def write(self, row: dict[str, Any]) -> None:
    if not self.enabled:
      return
    self.rows.append(row)
    fields = list(row)
    with open(self.path, "w", newline="") as f:
      writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
      writer.writeheader()
      writer.writerows(self.rows)
    if self._tb is not None:
      for k, v in row.items():
        if k != "step" and v is not None:
          self._tb.add_scalar(f"{self.tag}/{k}", float(v), int(row["step"]))

  def plot(self, eval_rows=()) -> pathlib.Path | None:
    """``curves.png``: loss and per-step top-1 accuracy against the step (and held-out
    ``eval_rows`` as markers)."""
    if not self.enabled or not self.rows:
      return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [int(r["step"]) for r in self.rows]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, [float(r["loss"]) for r in self.rows], label="loss (sum over steps)")
    eval_steps = [int(r["step"]) for r in eval_rows]
    if eval_rows:
      ax_loss.plot(eval_steps, [float(r["loss"]) for r in eval_rows], "o", label="held-out")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("cross-entropy")
    ax_loss.legend()
    for k in sorted(k for k in self.rows[0] if k.startswith("top1_")):
      line, = ax_acc.plot(steps, [float(r[k]) for r in self.rows],
                          label=f"top-1, draft step {k[5:]}")
      if eval_rows:
        ax_acc.plot(eval_steps, [float(r[k]) for r in eval_rows], "o", color=line.get_color(),
                    label=f"held-out, step {k[5:]}")
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("accuracy")
    ax_acc.legend()
    fig.tight_layout()
    out = self.path.with_name("curves.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
