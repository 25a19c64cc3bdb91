"""End-to-end training on the tiny config: learning, checkpoint/resume, sharding, errors."""

import csv
import json
import pathlib
import types

import numpy as np
import pytest

from redrafter_jax import cli
from redrafter_jax.config import ConfigError, load_preset
from redrafter_jax.training import data, optimizer, timebox, trainer

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
VOCAB = 512  # random:tiny's vocabulary


def write_synthetic(folder: pathlib.Path, num: int = 160, seed: int = 0) -> pathlib.Path:
  """Records shaped like the tiny random LLM's answers: a random prompt, then a response of runs
  of repeated tokens from a small set (a drafter learns quickly that the next token is mostly
  the last one)."""
  rng = np.random.default_rng(seed)
  recs = []
  for i in range(num):
    n_prompt, n_resp = int(rng.integers(4, 16)), int(rng.integers(8, 60))
    resp = np.repeat(rng.integers(100, 132, n_resp), rng.integers(4, 12, n_resp))[:n_resp]
    tokens = np.concatenate([rng.integers(0, VOCAB, n_prompt), resp])
    recs.append(data.make_record(tokens, [0] * n_prompt + [1] * n_resp, id=f"s{i}"))
  folder.mkdir(parents=True)
  half = num // 2
  data.write_shard(folder / "shard-00000.npz", recs[:half])
  data.write_shard(folder / "shard-00001.npz", recs[half:])
  manifest = {"settings": {"vocab_size": VOCAB},
              "shards": {"shard-00000.npz": {}, "shard-00001.npz": {}}}
  (folder / data.MANIFEST).write_text(json.dumps(manifest))
  return folder


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
  return write_synthetic(tmp_path_factory.mktemp("data") / "syn")


def preset(data_dir, out_dir, drafter=None, **train):
  """TINY on ``data_dir``, writing to ``out_dir``, with ``train.*`` and ``drafter.*`` fields."""
  overrides = {"train.data": str(data_dir), "train.output_dir": str(out_dir),
               "train.seq_len": 64, "train.log_every": 2}
  overrides.update({f"train.{k}": v for k, v in train.items()})
  overrides.update({f"drafter.{k}": v for k, v in (drafter or {}).items()})
  return load_preset(TINY, overrides)


def losses_of(result):
  return {r["step"]: r["loss"] for r in result.history}


def test_tiny_config_learns_and_writes_outputs(synthetic, tmp_path):
  from redrafter_jax.weights.drafter_io import load_drafter
  from redrafter_jax.weights.params import flat_params

  out = tmp_path / "run"
  result = trainer.train(preset(synthetic, out, num_steps=30, learning_rate=0.01),
                         progress=False)
  losses = [r["loss"] for r in result.history]
  assert len(losses) == 30 and all(np.isfinite(losses))
  assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5]), losses
  assert result.history[-1]["top1_1"] > result.history[0]["top1_1"]
  rows = list(csv.DictReader(open(out / "metrics.csv")))
  assert [int(r["step"]) for r in rows] == list(range(1, 31))
  assert float(rows[-1]["tokens_per_s"]) > 0
  assert (out / "curves.png").stat().st_size > 1000
  assert list((out / "tb").glob("events.out.tfevents.*"))
  # The exported drafter (reference format) holds exactly the trained parameters.
  drafter = load_drafter(out / "drafter")
  exported = flat_params(drafter)
  trained = trainer.flat_dict(result.params)
  assert sorted(exported) == sorted(trained)
  for name, value in trained.items():
    np.testing.assert_array_equal(np.asarray(exported[name]), value)
  # ... and ranks tokens by how often they are response tokens in the training data.
  counts = data.token_counts(synthetic, VOCAB)
  ranking = np.asarray(drafter.token_ranking[...])
  assert sorted(ranking.tolist()) == list(range(VOCAB))
  assert np.all(np.diff(counts[ranking]) <= 0) and counts[ranking[0]] == counts.max()


def test_vocab_limit_trains_on_the_most_frequent_tokens(synthetic, tmp_path):
  result = trainer.train(preset(synthetic, tmp_path / "run", num_steps=3, vocab_limit=16),
                         progress=False, export=False)
  counts = data.token_counts(synthetic, VOCAB)
  top16 = np.argsort(-counts, kind="stable")[:16]
  row = result.history[0]
  assert 0 < row["coverage_1"] < 1
  assert row["coverage_1"] == pytest.approx(counts[top16].sum() / counts.sum(), abs=0.15)
  assert np.isfinite(row["loss"])
  # Only the 16 tokens' rows of the vocabulary projection are non-zero (trained).
  kernel = trainer.flat_dict(result.params)["lm_head.1.kernel"]
  nonzero = np.flatnonzero(np.abs(kernel).max(axis=0) > 0)
  assert sorted(nonzero.tolist()) == sorted(top16.tolist())


def test_a_continued_drafter_keeps_its_token_ranking(synthetic, tmp_path):
  """From ``init_drafter`` with ``vocab_limit``, the head trains the rows of the continued
  drafter's own ranking (saved with it) and exports that ranking: ranking the new data again
  would zero rows the drafter trained and start others from zero."""
  import json
  import shutil

  first = trainer.train(preset(synthetic, tmp_path / "a", num_steps=2, vocab_limit=16),
                        progress=False)
  init = tmp_path / "init"
  shutil.copytree(first.drafter_dir, init)
  ranking = np.random.default_rng(0).permutation(VOCAB)  # stands for another data set's
  counts = data.token_counts(synthetic, VOCAB)
  assert set(ranking[:16]) != set(np.argsort(-counts, kind="stable")[:16].tolist())
  (init / "token_ranking.json").write_text(json.dumps({"token_ranking": ranking.tolist()}))
  result = trainer.train(preset(synthetic, tmp_path / "b", num_steps=2, vocab_limit=16,
                                init_drafter=str(init)), progress=False)
  kernel = trainer.flat_dict(result.params)["lm_head.1.kernel"]
  nonzero = np.flatnonzero(np.abs(kernel).max(axis=0) > 0)
  assert sorted(nonzero.tolist()) == sorted(ranking[:16].tolist())
  saved = json.loads((result.drafter_dir / "token_ranking.json").read_text())["token_ranking"]
  assert saved == ranking.tolist()


@pytest.mark.parametrize("exit_dim", [128, 96, 32])  # 2D (no input_proj), C >= D, C < D
def test_head_init_from_llm_reproduces_the_llm_logits(exit_dim):
  import jax.numpy as jnp

  from redrafter_jax.config import DrafterConfig
  from redrafter_jax.models.drafter import init_drafter, init_head_from_llm
  from redrafter_jax.weights.base_model import load_base_model

  llm, llm_cfg = load_base_model("random:tiny")
  D = llm_cfg.hidden_size
  drafter = init_drafter(DrafterConfig(vocab_size=VOCAB, hidden_size=D, exit_dim=exit_dim))
  out_VD = np.asarray(llm.output_matrix())
  init_head_from_llm(drafter, out_VD)
  h_xD = np.random.default_rng(0).standard_normal((5, D)).astype(np.float32)
  got = np.asarray(drafter.logits(jnp.asarray(h_xD), jnp.zeros((5, D))))
  if exit_dim >= D:  # full rank: the LLM's own logits while the drafter state is zero
    np.testing.assert_allclose(got, np.asarray(llm.logits(jnp.asarray(h_xD))), atol=1e-4)
  else:  # the best rank-C approximation of the LLM's logits
    _, _, vt = np.linalg.svd(out_VD, full_matrices=False)
    want = h_xD @ vt[:exit_dim].T @ vt[:exit_dim] @ out_VD.T
    np.testing.assert_allclose(got, want, atol=1e-4)
  if exit_dim != 2 * D:  # the state's half of input_proj keeps its random init
    moved = np.asarray(drafter.logits(jnp.asarray(h_xD), jnp.ones((5, D))))
    assert np.abs(moved - got).max() > 1e-3
  with pytest.raises(ValueError, match="output projection has shape"):
    init_head_from_llm(drafter, out_VD[:, :-1])


def test_head_init_llm_trains_and_starts_from_the_llm(synthetic, tmp_path):
  result = trainer.train(preset(synthetic, tmp_path / "run", num_steps=4, head_init="llm",
                                learning_rate=0.0),
                         progress=False, export=False)
  # With a zero learning rate the head stays the LLM's output projection (tied embeddings).
  from redrafter_jax.weights.base_model import load_base_model
  llm, _ = load_base_model("random:tiny")
  kernel = trainer.flat_dict(result.params)["lm_head.1.kernel"]  # [C, V] with C = 32 < D
  out_VD = np.asarray(llm.output_matrix())
  _, _, vt = np.linalg.svd(out_VD, full_matrices=False)
  np.testing.assert_allclose(kernel, (out_VD @ vt[:32].T).T, atol=1e-4)
  with pytest.raises(ConfigError, match="head_init"):
    preset(synthetic, tmp_path / "x", head_init="medusa")


def test_soft_targets_train_end_to_end(synthetic, tmp_path):
  result = trainer.train(preset(synthetic, tmp_path / "run", num_steps=20, learning_rate=0.01,
                                soft_targets=True, head_init="llm"),
                         progress=False, export=False)
  losses = [r["loss"] for r in result.history]
  assert len(losses) == 20 and all(np.isfinite(losses))
  assert np.mean(losses[-5:]) < np.mean(losses[:5]), losses
  with pytest.raises(ConfigError, match="soft_targets"):
    preset(synthetic, tmp_path / "x", soft_targets="yes")


def test_held_out_shards_are_evaluated_and_not_trained_on(synthetic, tmp_path):
  out = tmp_path / "run"
  result = trainer.train(preset(synthetic, out, num_steps=6, eval_shards=1, eval_every=3,
                                eval_batches=2, learning_rate=0.0),
                         progress=False, export=False)
  rows = result.eval_history
  assert [r["step"] for r in rows] == [3, 6]
  assert rows[0]["targets"] > 0 and np.isfinite(rows[0]["loss"])
  # Same held-out batches every time: with a zero learning rate the scores repeat exactly.
  assert rows[0] == dict(rows[1], step=3)
  # Every greedy answer of the held-out shard in fixed batches: another seed (and another
  # eval_batches, no longer read) scores the same positions.
  other = trainer.train(preset(synthetic, tmp_path / "seed", num_steps=3, eval_shards=1,
                               eval_every=3, eval_batches=1, learning_rate=0.0, seed=1),
                        progress=False, export=False).eval_history
  assert other[0]["targets"] == rows[0]["targets"] and other[0]["loss"] != rows[0]["loss"]
  assert [int(r["step"]) for r in csv.DictReader(open(out / "eval.csv"))] == [3, 6]
  # The ranking (and so the training data) comes from the first shard only.
  first = data.token_counts(synthetic, VOCAB, holdout=1)
  assert first.sum() < data.token_counts(synthetic, VOCAB).sum()
  # With a learning rate the held-out scores move.
  moved = trainer.train(preset(synthetic, tmp_path / "lr", num_steps=6, eval_shards=1,
                               eval_every=3, eval_batches=2, learning_rate=0.01),
                        progress=False, export=False).eval_history
  assert moved[1]["loss"] != moved[0]["loss"]
  with pytest.raises(data.DataError, match="cannot hold out 2 of its 2"):
    trainer.train(preset(synthetic, tmp_path / "bad", num_steps=2, eval_shards=2),
                  progress=False, export=False)


def test_several_data_folders_train_as_one(synthetic, tmp_path):
  other = write_synthetic(tmp_path / "other", num=40, seed=1)
  both = load_preset(TINY, {"train.data": [str(synthetic), str(other)],
                            "train.output_dir": str(tmp_path / "run"), "train.seq_len": 64,
                            "train.num_steps": 4, "train.eval_shards": 1, "train.eval_every": 2,
                            "train.eval_batches": 1})
  assert both.train.data == (str(synthetic), str(other))
  result = trainer.train(both, progress=False, export=False)
  assert [r["step"] for r in result.eval_history] == [2, 4]
  assert all(np.isfinite(r["loss"]) for r in result.history)
  # The ranking counts the training shards of every folder (the last of each is held out).
  np.testing.assert_array_equal(
      data.token_counts([synthetic, other], VOCAB, holdout=1),
      data.token_counts(synthetic, VOCAB, holdout=1) + data.token_counts(other, VOCAB, holdout=1))


def test_data_shards_keeps_a_run_the_same_when_its_folder_grows(synthetic, tmp_path):
  grown = tmp_path / "grown"
  grown.mkdir()
  for f in synthetic.iterdir():
    (grown / f.name).write_bytes(f.read_bytes())
  extra = write_synthetic(tmp_path / "extra", num=40, seed=3)
  (grown / "shard-00002.npz").write_bytes((extra / "shard-00000.npz").read_bytes())
  manifest = json.loads((grown / data.MANIFEST).read_text())
  manifest["shards"]["shard-00002.npz"] = {}
  (grown / data.MANIFEST).write_text(json.dumps(manifest))
  kw = dict(num_steps=4, eval_shards=1, eval_every=2, eval_batches=1)
  before = trainer.train(preset(synthetic, tmp_path / "a", **kw), progress=False, export=False)
  pinned = trainer.train(preset(grown, tmp_path / "b", data_shards=2, **kw), progress=False,
                         export=False)
  assert losses_of(pinned) == losses_of(before) and pinned.eval_history == before.eval_history
  moved = trainer.train(preset(grown, tmp_path / "c", **kw), progress=False, export=False)
  assert moved.eval_history != before.eval_history  # all 3 shards: another held-out shard


def test_checkpoints_from_before_a_new_setting_resume_under_its_default(synthetic, tmp_path):
  current = trainer.preset_dict(preset(synthetic, tmp_path))
  saved = {**current, "train": {k: v for k, v in current["train"].items()
                                if k not in ("soft_targets", "head_init", "eval_shards")}}
  trainer.check_resumable(saved, current, tmp_path)  # the defaults: nothing changed
  changed = trainer.preset_dict(preset(synthetic, tmp_path, soft_targets=True))
  with pytest.raises(ConfigError, match="train.soft_targets: checkpoint False, config True"):
    trainer.check_resumable(saved, changed, tmp_path)


def test_resume_after_crash_equals_uninterrupted_run(synthetic, tmp_path):
  kw = dict(num_steps=10, checkpoint_every=4)
  full = trainer.train(preset(synthetic, tmp_path / "full", **kw), progress=False, export=False)
  crashed = preset(synthetic, tmp_path / "crash", **kw)
  first = trainer.train(crashed, stop_after=6, save_at_stop=False, progress=False,
                        export=False)  # dies after step 6, without a checkpoint there
  assert first.last_step == 6
  resumed = trainer.train(crashed, progress=False, export=False)
  assert resumed.start_step == 4  # the newest checkpoint; steps 5-6 are redone
  full_losses, resumed_losses = losses_of(full), losses_of(resumed)
  assert sorted(resumed_losses) == list(range(5, 11))
  for step, loss in resumed_losses.items():
    assert loss == pytest.approx(full_losses[step], rel=1e-6, abs=1e-6), step
  for name, value in trainer.flat_dict(full.params).items():
    np.testing.assert_allclose(trainer.flat_dict(resumed.params)[name], value, rtol=1e-6,
                               atol=1e-6, err_msg=name)
  # metrics.csv describes one consistent run: the crashed steps 5-6 are not listed twice.
  rows = list(csv.DictReader(open(tmp_path / "crash" / "metrics.csv")))
  assert [int(r["step"]) for r in rows] == list(range(1, 11))


def test_sharded_runs_match_single_device(synthetic, tmp_path):
  import jax

  assert jax.device_count() == 8  # conftest fakes 8 CPU devices
  runs = {}
  for name, mesh in {"single": (1, 1), "data8": (8, 1), "data4_model2": (4, 2)}.items():
    p = preset(synthetic, tmp_path / name, num_steps=3, mesh_data=mesh[0], mesh_model=mesh[1])
    runs[name] = losses_of(trainer.train(p, progress=False, export=False))
  for name in ("data8", "data4_model2"):
    for step, loss in runs["single"].items():
      assert runs[name][step] == pytest.approx(loss, rel=1e-5), (name, step)


def test_resume_refuses_a_different_drafter(synthetic, tmp_path):
  out = tmp_path / "run"
  trainer.train(preset(synthetic, out, num_steps=4, checkpoint_every=2), stop_after=1,
                progress=False, export=False)
  changed = load_preset(TINY, {"train.data": str(synthetic), "train.output_dir": str(out),
                               "train.seq_len": 64, "train.num_steps": 4,
                               "train.checkpoint_every": 2, "drafter.exit_dim": 48})
  with pytest.raises(ConfigError, match="drafter.*exit_dim"):
    trainer.train(changed, progress=False, export=False)


def test_a_continued_run_scores_its_starting_drafter_first(synthetic, tmp_path):
  """From ``init_drafter``, eval.csv starts with the starting drafter's held-out score (step 0),
  which is the exported drafter of the run it continues; a resumed call does not repeat it."""
  first = trainer.train(preset(synthetic, tmp_path / "a", num_steps=4, eval_shards=1,
                               eval_every=2, eval_batches=2), progress=False)
  p = preset(synthetic, tmp_path / "b", num_steps=4, eval_shards=1, eval_every=2,
             eval_batches=2, init_drafter=str(first.drafter_dir))
  rows = trainer.train(p, stop_after=2, progress=False).eval_history
  assert [r["step"] for r in rows] == [0, 2]
  want = {k: v for k, v in first.eval_history[-1].items() if k != "step"}
  assert {k: v for k, v in rows[0].items() if k != "step"} == pytest.approx(want, rel=1e-5)
  rows += trainer.train(p, progress=False).eval_history
  assert [r["step"] for r in rows] == [0, 2, 4]
  assert [int(r["step"]) for r in csv.DictReader(open(tmp_path / "b" / "eval.csv"))] == [0, 2, 4]


def test_a_drafter_grows_multi_layer_features_and_starts_as_it_was(synthetic, tmp_path):
  """``drafter.feature_layers`` ending at the LLM's last layer, on a continued single-layer
  drafter: the grown drafter's first held-out score is the drafter's own (its fresh
  feature_proj passes the last layer through), training moves it, and it exports with the
  layers. Other changes to the continued drafter are refused by name."""
  from redrafter_jax.weights.drafter_io import load_drafter

  kw = dict(num_steps=4, eval_shards=1, eval_every=2, eval_batches=2)
  first = trainer.train(preset(synthetic, tmp_path / "a", **kw), progress=False)
  kw["init_drafter"] = str(first.drafter_dir)
  result = trainer.train(preset(synthetic, tmp_path / "b", {"feature_layers": [0, 1]}, **kw),
                         progress=False)
  rows = result.eval_history
  want = {k: v for k, v in first.eval_history[-1].items() if k != "step"}
  assert {k: v for k, v in rows[0].items() if k != "step"} == pytest.approx(want, rel=1e-5)
  assert rows[-1] != pytest.approx(rows[0], rel=1e-5)
  assert load_drafter(result.drafter_dir).config.feature_layers == (0, 1)
  refused = [({"feature_layers": [1, 0]}, r"last listed layer is the LLM's last \(1\)"),
             ({"num_draft_layers": 3},
              r"num_draft_layers=1 \(the preset's drafter.num_draft_layers: 3\)")]
  for drafter, needle in refused:
    with pytest.raises(ConfigError, match=needle):
      trainer.train(preset(synthetic, tmp_path / "c", drafter, **kw), progress=False,
                    export=False)


def test_a_drafter_grows_wider_and_starts_as_it_was(synthetic, tmp_path):
  """``drafter.exit_dim`` wider than the continued drafter's: the first held-out score is the
  drafter's own, training moves it, and the export is the wider drafter. A narrower width, or
  one that would drop ``input_proj``, is refused by name."""
  from redrafter_jax.weights.drafter_io import load_drafter

  kw = dict(num_steps=4, eval_shards=1, eval_every=2, eval_batches=2)
  first = trainer.train(preset(synthetic, tmp_path / "a", **kw), progress=False)
  kw["init_drafter"] = str(first.drafter_dir)
  result = trainer.train(preset(synthetic, tmp_path / "b", {"exit_dim": 48}, **kw),
                         progress=False)
  rows = result.eval_history
  want = {k: v for k, v in first.eval_history[-1].items() if k != "step"}
  assert {k: v for k, v in rows[0].items() if k != "step"} == pytest.approx(want, rel=1e-5)
  assert rows[-1] != pytest.approx(rows[0], rel=1e-5)
  assert load_drafter(result.drafter_dir).config.exit_dim == 48
  for width, needle in [(16, r"exit_dim=32; drafter.exit_dim=16 can grow"),
                        (128, r"exit_dim=32; drafter.exit_dim=128 can grow")]:
    with pytest.raises(ConfigError, match=needle):
      trainer.train(preset(synthetic, tmp_path / "c", {"exit_dim": width}, **kw),
                    progress=False, export=False)


@pytest.mark.parametrize("layers", [None, (0, 2, 3)])
def test_growing_keeps_the_logits_and_the_new_width_learns(layers):
  """The grown drafter's logits equal the old one's for any input (wider, and wider with more
  layers read), and the head's rows for the new channels get a gradient at once (the channels
  carry input_proj's fresh rows), so the new width is not stuck at a zero saddle."""
  import dataclasses

  import jax
  import jax.numpy as jnp
  from flax import nnx

  from redrafter_jax.config import DrafterConfig
  from redrafter_jax.models.drafter import Drafter
  from redrafter_jax.training.grow import grow_as_asked

  old_cfg = DrafterConfig(vocab_size=50, hidden_size=16, exit_dim=8, num_draft_layers=2,
                          rnn=True)
  old = Drafter(old_cfg, rngs=nnx.Rngs(0))
  for block in old.lm_head[:-1]:  # trained ResBlocks are not zero: give them weights
    block.linear.kernel.set_value(jax.random.normal(jax.random.key(1), (8, 8)) * 0.3)
    block.linear.bias.set_value(jax.random.normal(jax.random.key(2), (8,)) * 0.3)
  asked = dataclasses.replace(old_cfg, exit_dim=24, feature_layers=layers or ())
  named = {"exit_dim"} | ({"feature_layers"} if layers else set())
  grown = grow_as_asked(old, asked, named, last_layer=3, seed=5, source="old")
  h_xD = jax.random.normal(jax.random.key(3), (4, 16))
  s_xD = jax.random.normal(jax.random.key(4), (4, 16))
  prev_xD = jax.random.normal(jax.random.key(6), (4, 16))
  feats = h_xD if not layers else jnp.concatenate(
      [jax.random.normal(jax.random.key(7), (4, 32)), h_xD], axis=-1)
  want = old.step(old.context(h_xD), s_xD, prev_xD)[0]
  got = grown.step(grown.context(feats), s_xD, prev_xD)[0]
  assert grown.config.exit_dim == 24 and got.shape == want.shape
  assert jnp.allclose(got, want, atol=1e-5, rtol=1e-5)

  def loss(model):
    return -model.step(model.context(feats), s_xD, prev_xD)[0][:, 7].mean()

  grads = nnx.grad(loss)(grown)
  head_new = grads.lm_head[2].kernel[...][8:]  # the head's rows for the new channels
  assert bool(jnp.all(jnp.abs(head_new).sum(axis=1) > 0))


def test_bf16_matmuls_train_and_the_held_out_score_stays_float32(synthetic, tmp_path):
  """``train.matmul_dtype: bfloat16``: the step multiplies in bf16 (its first loss is near the
  float32 run's and not equal to it), the run learns, and held-out evaluation scores the float32
  drafter (a continued run's step 0 equals the float32 score of the drafter it continues)."""
  kw = dict(num_steps=30, learning_rate=0.01, eval_shards=1, eval_every=15, eval_batches=2)
  full = trainer.train(preset(synthetic, tmp_path / "f32", **kw), progress=False)
  half = trainer.train(preset(synthetic, tmp_path / "bf16", matmul_dtype="bfloat16", **kw),
                       progress=False)
  first_full, first_half = full.history[0]["loss"], half.history[0]["loss"]
  assert first_half == pytest.approx(first_full, rel=1e-2) and first_half != first_full
  losses = [r["loss"] for r in half.history]
  assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5]), losses
  go_on = dict(kw, num_steps=2, init_drafter=str(full.drafter_dir), matmul_dtype="bfloat16")
  rows = trainer.train(preset(synthetic, tmp_path / "on", **go_on), progress=False,
                       export=False).eval_history
  want = {k: v for k, v in full.eval_history[-1].items() if k != "step"}
  assert rows[0]["step"] == 0
  assert {k: v for k, v in rows[0].items() if k != "step"} == pytest.approx(want, rel=1e-5)
  with pytest.raises(ConfigError, match="train.matmul_dtype must be 'float32' or 'bfloat16'"):
    preset(synthetic, tmp_path / "x", matmul_dtype="float16")


def test_init_drafter_shape_mismatch_is_a_clear_error(synthetic, tmp_path):
  from redrafter_jax.config import DrafterConfig
  from redrafter_jax.models.drafter import init_drafter
  from redrafter_jax.weights.drafter_io import save_drafter

  other = save_drafter(init_drafter(DrafterConfig(vocab_size=VOCAB, hidden_size=32)),
                       tmp_path / "d32")
  p = preset(synthetic, tmp_path / "run", num_steps=2, init_drafter=str(other))
  with pytest.raises(ConfigError, match="hidden_size=32.*hidden_size=64"):
    trainer.train(p, progress=False, export=False)


@pytest.mark.parametrize("argv,needle", [
    (["train.num_stepz=3"], "unknown key(s) 'num_stepz' (did you mean 'num_steps'?)"),
    (["train.data=/no/such/folder"], "data folder not found: /no/such/folder"),
    (["train.batch_size=0"], "train.batch_size must be an integer >= 1"),
    (["train.data=[]"], "train.data must be a folder or a non-empty list of folders"),
])
def test_cli_errors_are_one_line(argv, needle, capsys):
  assert cli.main(["train", "--config", str(TINY), *argv]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


@pytest.mark.parametrize("section,needle", [
    ("train:\n  num_stepz: 3\n", "train config: unknown key(s) 'num_stepz'"),
    ("drafter:\n  exit_dimm: 3\n", "drafter: unknown key(s) ['exit_dimm']"),
    ("decode:\n  beam_widht: 3\n", "decode config: unknown key(s) 'beam_widht'"),
])
def test_a_wrong_nested_key_names_the_file(tmp_path, capsys, section, needle):
  bad = tmp_path / "bad.yaml"
  bad.write_text("model: random:tiny\n" + section)
  assert cli.main(["train", "--config", str(bad)]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith(f"error: {bad}: ") and needle in err, err


def test_data_with_another_vocabulary_is_refused(tmp_path):
  folder = write_synthetic(tmp_path / "d")
  manifest = json.loads((folder / data.MANIFEST).read_text())
  manifest["settings"]["vocab_size"] = 49152
  (folder / data.MANIFEST).write_text(json.dumps(manifest))
  with pytest.raises(ConfigError, match="vocab_size 49152"):
    trainer.train(preset(folder, tmp_path / "run", num_steps=1), progress=False)


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
  p = load_preset(path)
  assert p.train.num_steps >= 1 and p.model


class FakeClock:
  """A clock for ``timebox.clock`` whose every reading is ``tick`` seconds after the last."""

  def __init__(self, tick: float):
    self.now, self.tick = 0.0, tick

  def __call__(self) -> float:
    self.now += self.tick
    return self.now


# With FakeClock(TICK) the probe's PROBE_STEPS steps take TICK: this pace per step (exact in
# binary, so the fitted counts below are exact).
PACE = 0.25
TICK = timebox.PROBE_STEPS * PACE
DECIDED_AT = 1 + timebox.PROBE_STEPS  # the probe ends PROBE_STEPS steps after the first


def budget_for(more_steps: int, evaluated: bool) -> tuple[float, float, float]:
  """``(max_seconds, elapsed, reserve)`` under FakeClock(TICK) for a run that fits
  ``more_steps`` steps after the decision. The budget's clock is read at the start, after the
  first step, after the probe, around the held-out evaluation at the deciding step (when eval is
  on) and at the decision."""
  elapsed = (5 if evaluated else 3) * TICK
  reserve = (TICK if evaluated else 0.0) + timebox.RESERVE_STEPS * PACE + timebox.RESERVE_SECONDS
  return elapsed + reserve + (more_steps + 0.5) * PACE, elapsed, reserve


def test_time_boxed_run_with_time_for_every_step_matches_the_default(synthetic, tmp_path):
  from redrafter_jax.weights.drafter_io import load_drafter
  from redrafter_jax.weights.params import flat_params

  n = DECIDED_AT + 3
  kw = dict(num_steps=n, learning_rate=0.01)
  default = trainer.train(preset(synthetic, tmp_path / "default", **kw), progress=False,
                          export=False)
  out = tmp_path / "boxed"
  boxed = trainer.train(preset(synthetic, out, max_seconds=1e6, **kw), progress=False)
  assert boxed.num_steps == boxed.last_step == n and default.num_steps == n
  schedule = json.loads((out / "schedule.json").read_text())
  assert schedule["num_steps"] == n and schedule["decided_at_step"] == DECIDED_AT
  assert schedule["max_seconds"] == 1e6 and schedule["seconds_per_step"] > 0
  # The same run: the learning rate arrives as an input of the step instead of from the
  # optimizer's own schedule.
  assert [r["lr"] for r in boxed.history] == pytest.approx([r["lr"] for r in default.history],
                                                           rel=1e-6)
  for step, loss in losses_of(default).items():
    assert losses_of(boxed)[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
  exported = flat_params(load_drafter(boxed.drafter_dir))
  for name, value in trainer.flat_dict(default.params).items():
    np.testing.assert_allclose(np.asarray(exported[name]), value, rtol=1e-5, atol=1e-6,
                               err_msg=name)


def test_time_boxed_run_fits_its_schedule_to_the_budget(synthetic, tmp_path, monkeypatch, capsys):
  ceiling, more = 30, 3
  max_seconds, elapsed, reserve = budget_for(more, evaluated=True)
  monkeypatch.setattr(timebox, "clock", FakeClock(TICK))
  out = tmp_path / "run"
  p = preset(synthetic, out, num_steps=ceiling, max_seconds=max_seconds, eval_shards=1,
             eval_batches=1)
  result = trainer.train(p, progress=False)
  fitted = DECIDED_AT + more
  assert result.num_steps == result.last_step == fitted
  assert [r["step"] for r in result.history] == list(range(1, fitted + 1))
  assert json.loads((out / "schedule.json").read_text()) == {
      "max_seconds": max_seconds, "seconds_per_step": PACE, "num_steps": fitted,
      "decided_at_step": DECIDED_AT, "elapsed_seconds": elapsed, "reserve_seconds": reserve,
      "fitted_num_steps": fitted, "refits": []}  # too short a run to time itself again
  # The probe ran on the provisional schedule over num_steps, the rest on the one over the
  # fitted count, which ends where a run of that many steps would: the last step at the
  # schedule's value before its end, the optimizer's count at the end value (0).
  lrs = [r["lr"] for r in result.history]
  provisional, schedule = optimizer.make_schedule(p.train), optimizer.make_schedule(p.train, fitted)
  assert lrs[:DECIDED_AT] == pytest.approx([float(provisional(s)) for s in range(DECIDED_AT)])
  assert lrs[DECIDED_AT:] == pytest.approx(
      [float(schedule(s)) for s in range(DECIDED_AT, fitted)])
  assert lrs[-1] == pytest.approx(float(schedule(fitted - 1))) and float(schedule(fitted)) == 0
  # The held-out set is scored at the decision (measuring the final evaluation's cost) and at
  # the fitted end; the drafter is exported there.
  assert [r["step"] for r in result.eval_history] == [DECIDED_AT, fitted]
  assert result.drafter_dir == out / "drafter" and (out / "drafter").is_dir()
  # A budget already spent at the decision ends the run at once, checkpoint and drafter
  # included; the CLI reports the fitted count.
  monkeypatch.setattr(timebox, "clock", FakeClock(TICK))
  out = tmp_path / "spent"
  assert cli.main(["train", "--config", str(TINY), "--no-progress", f"train.data={synthetic}",
                   f"train.output_dir={out}", "train.seq_len=64", "train.log_every=2",
                   f"train.num_steps={ceiling}", "train.max_seconds=1"]) == 0
  assert f"trained steps 1..{DECIDED_AT} of {DECIDED_AT}:" in capsys.readouterr().out
  assert json.loads((out / "schedule.json").read_text())["num_steps"] == DECIDED_AT
  assert (out / "drafter").is_dir() and (out / "checkpoints" / str(DECIDED_AT)).is_dir()


def test_resumed_time_boxed_run_keeps_its_schedule(synthetic, tmp_path, monkeypatch):
  more = 4
  kw = dict(num_steps=30, max_seconds=budget_for(more, evaluated=False)[0],
            checkpoint_every=DECIDED_AT - 1)
  monkeypatch.setattr(timebox, "clock", FakeClock(TICK))
  full = trainer.train(preset(synthetic, tmp_path / "full", **kw), progress=False, export=False)
  fitted = DECIDED_AT + more
  assert full.num_steps == full.last_step == fitted
  crashed = preset(synthetic, tmp_path / "crash", **kw)
  monkeypatch.setattr(timebox, "clock", FakeClock(TICK))
  first = trainer.train(crashed, stop_after=DECIDED_AT + 2, save_at_stop=False, progress=False,
                        export=False)  # dies after the decision; the newest checkpoint is before
  assert first.num_steps == fitted and first.last_step == DECIDED_AT + 2
  schedule = (tmp_path / "crash" / "schedule.json").read_text()
  # A clock far slower than the first call's: probing again would fit no more steps.
  monkeypatch.setattr(timebox, "clock", FakeClock(100 * TICK))
  resumed = trainer.train(crashed, progress=False, export=False)
  assert resumed.start_step == DECIDED_AT - 1
  assert resumed.num_steps == resumed.last_step == fitted
  assert (tmp_path / "crash" / "schedule.json").read_text() == schedule
  full_losses = losses_of(full)
  for step, loss in losses_of(resumed).items():
    assert loss == pytest.approx(full_losses[step], rel=1e-6, abs=1e-6), step
  for name, value in trainer.flat_dict(full.params).items():
    np.testing.assert_allclose(trainer.flat_dict(resumed.params)[name], value, rtol=1e-6,
                               atol=1e-6, err_msg=name)


class ListClock:
  """A clock for ``timebox.clock`` that returns ``readings`` in turn, then keeps the last."""

  def __init__(self, readings):
    self.readings = list(readings)

  def __call__(self) -> float:
    return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]


def test_time_boxed_run_that_slows_after_its_probe_refits_its_schedule(synthetic, tmp_path,
                                                                        monkeypatch):
  # The probe's pace is PACE and the budget fits 200 steps after the decision at that pace;
  # the re-fits fall 20, 60 and 120 steps after it. From the decision on the steps take twice
  # as long. The clock is read at the start, after the first step, after the probe, at the
  # decision, when re-timing starts, and at each re-fit step.
  more, slow = 200, 2 * PACE
  max_seconds = budget_for(more, evaluated=False)[0]
  assert timebox.REFIT_FRACTIONS == (0.1, 0.3, 0.6) and timebox.REFIT_MIN_STEPS <= 20

  def clock():
    start = [TICK, 2 * TICK, 3 * TICK, 4 * TICK, 5 * TICK]
    return ListClock(start + [5 * TICK + slow * n for n in (20, 60, 120)])

  # At the first re-fit 4*TICK + 20*slow of the budget are spent and the reserve is
  # RESERVE_STEPS * slow + RESERVE_SECONDS: (max_seconds - spent - reserve) / slow = 75.25
  # more steps fit. At the second the same pace fits the same count: no change.
  refit_at, refitted = DECIDED_AT + 20, DECIDED_AT + 20 + 75
  kw = dict(num_steps=1000, max_seconds=max_seconds, checkpoint_every=25)
  monkeypatch.setattr(timebox, "clock", clock())
  p = preset(synthetic, tmp_path / "full", **kw)
  full = trainer.train(p, progress=False, export=False)
  assert full.num_steps == full.last_step == refitted
  schedule = json.loads((tmp_path / "full" / "schedule.json").read_text())
  assert schedule["fitted_num_steps"] == DECIDED_AT + more
  assert schedule["num_steps"] == refitted
  assert [(r["step"], r["seconds_per_step"], r["num_steps"]) for r in schedule["refits"]] == [
      (refit_at, slow, refitted)]
  # Up to the re-fit the rates are those of the schedule over the fitted count; after it,
  # those of the schedule over the re-fitted count at the same steps (a jump down here, where
  # the count shrank), still falling to that schedule's last value at the new end.
  lrs = np.array([r["lr"] for r in full.history])
  planned = timebox._schedule_values(p.train, DECIDED_AT + more, DECIDED_AT + more)
  np.testing.assert_allclose(lrs[DECIDED_AT:refit_at], planned[DECIDED_AT:refit_at], rtol=1e-6)
  replanned = timebox._schedule_values(p.train, refitted, refitted)
  np.testing.assert_allclose(lrs[refit_at:], replanned[refit_at:], rtol=1e-6)
  assert lrs[refit_at] < 0.98 * planned[refit_at]  # not the old schedule's rate
  assert np.all(np.diff(lrs[refit_at - 1:]) < 0)
  # A run that dies after the re-fit resumes on the same rates and count, without re-timing.
  monkeypatch.setattr(timebox, "clock", clock())
  crashed = preset(synthetic, tmp_path / "crash", **kw)
  first = trainer.train(crashed, stop_after=refit_at + 10, save_at_stop=False, progress=False,
                        export=False)
  assert first.num_steps == refitted
  monkeypatch.setattr(timebox, "clock", FakeClock(100 * TICK))
  resumed = trainer.train(crashed, progress=False, export=False)
  assert resumed.start_step == 25 and resumed.num_steps == resumed.last_step == refitted
  full_lrs = {r["step"]: r["lr"] for r in full.history}
  assert all(r["lr"] == full_lrs[r["step"]] for r in resumed.history)
  for step, loss in losses_of(resumed).items():
    assert loss == pytest.approx(losses_of(full)[step], rel=1e-6, abs=1e-6), step


def test_refit_keeps_the_steps_run_and_places_the_rest_on_the_new_schedule():
  cfg = types.SimpleNamespace(learning_rate=1.0, warmup_fraction=0.1, num_steps=10)
  schedule = lambda n: timebox._schedule_values(cfg, n, n)
  rates = schedule(10)  # steps 1..10
  longer = timebox._refitted(cfg, rates, 8, 20)
  assert len(longer) == 20 and np.array_equal(longer[:8], rates[:8])
  np.testing.assert_allclose(longer[8:], schedule(20)[8:], rtol=1e-6)
  # The steps added late are not spent in the old schedule's tail: the rate jumps back up.
  assert longer[8] > 5 * rates[8] and np.all(np.diff(longer[8:]) < 0)
  shorter = timebox._refitted(cfg, rates, 4, 6)
  assert len(shorter) == 6 and np.array_equal(shorter[:4], rates[:4])
  np.testing.assert_allclose(shorter[4:], schedule(6)[4:], rtol=1e-6)
  assert shorter[4] < rates[4]
  assert np.array_equal(timebox._refitted(cfg, rates, 4, 4), rates[:4])  # the budget is spent


@pytest.mark.parametrize("value", [0, -5, "soon", True])
def test_max_seconds_must_be_positive(synthetic, tmp_path, value):
  with pytest.raises(ConfigError, match="train.max_seconds must be a number of seconds > 0"):
    preset(synthetic, tmp_path, max_seconds=value)


def test_a_checkpoint_exports_as_the_run_would_and_a_context_reading_drafter_trains(
    synthetic, tmp_path):
  """``export_checkpoint`` at the last step writes the run's own export, byte for byte, and at
  an earlier step the drafter of that step; a drafter with the copy hint and the context
  attention trains end to end."""
  from redrafter_jax.weights.drafter_io import load_drafter
  from redrafter_jax.weights.params import flat_params

  p = preset(synthetic, tmp_path / "run", drafter={"copy_ngram": 2, "context_attention": 8},
             num_steps=4, checkpoint_every=2)
  result = trainer.train(p, progress=False)
  last = trainer.export_checkpoint(p, tmp_path / "at4", step=4)
  for name in ("model.safetensors", "config.json", "token_ranking.json"):
    assert (last / name).read_bytes() == (result.drafter_dir / name).read_bytes(), name
  back = load_drafter(last).config
  assert (back.copy_ngram, back.context_attention) == (2, 8)
  early = flat_params(load_drafter(trainer.export_checkpoint(p, tmp_path / "at2", step=2)))
  assert any(not np.array_equal(np.asarray(early[k]), np.asarray(v))
             for k, v in flat_params(load_drafter(last)).items())
  with pytest.raises(ConfigError, match="no checkpoint at step 3"):
    trainer.export_checkpoint(p, tmp_path / "at3", step=3)
