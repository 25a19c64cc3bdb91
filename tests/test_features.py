"""Precomputed LLM hidden states (training/features.py): training reads them instead of running
the LLM, and gets the same losses and gradients."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from redrafter_jax import cli
from redrafter_jax.training import data, features, losses, trainer
from redrafter_jax.weights.base_model import load_base_model
from tests.test_trainer import preset, write_synthetic

SEQ = 64


@pytest.fixture(scope="module")
def made(tmp_path_factory):
  """A synthetic data folder (with records longer than a row) and its float32 features."""
  root = tmp_path_factory.mktemp("feat")
  folder = write_synthetic(root / "syn", num=48)
  recs = data.read_records(folder)
  assert max(r["tokens"].size for r in recs) > SEQ  # some records are windowed
  llm, _ = load_base_model("random:tiny")
  stats = features.write_features(llm, folder, root / "f32", model_name="random:tiny",
                                  seq_len=SEQ, batch_tokens=256)
  assert stats["shards"] == 2 and stats["tokens"] == data.window_lengths(recs, SEQ).sum()
  return folder, root / "f32", llm


def test_states_equal_the_packed_forward_of_training(made):
  folder, feats, llm = made
  kw = dict(seq_len=SEQ, global_batch=4, seed=0, pack=True)
  plain = data.make_iterator(folder, **kw)
  with_h = data.make_iterator(folder, **kw, features=feats, hidden_size=64)
  for _ in range(3):
    a, b = next(plain), next(with_h)
    assert sorted(b) == sorted([*a, "hidden"])
    for name in a:  # the same batches, in the same order
      np.testing.assert_array_equal(a[name], b[name])
    want = losses.frozen_hidden(llm, jnp.asarray(a["tokens"]), jnp.asarray(a["positions"]),
                                jnp.asarray(a["segment_ids"]))
    real = a["segment_ids"] > 0
    assert b["hidden"].shape == (4, SEQ, 64) and not b["hidden"][~real].any()
    np.testing.assert_allclose(b["hidden"][real], np.asarray(want)[real], rtol=1e-5, atol=1e-5)


def test_held_out_batches_read_the_stored_states(made):
  """The trainer's fixed held-out batches are the same with features, which hold the states
  the packed forward computes."""
  folder, feats, llm = made
  kw = dict(seq_len=SEQ, global_batch=4, holdout=1)
  plain = list(data.held_out_batches(folder, **kw))
  with_h = list(data.held_out_batches(folder, **kw, features=feats, hidden_size=64))
  assert len(plain) == len(with_h) > 1
  for a, b in zip(plain, with_h):
    assert sorted(b) == sorted([*a, "hidden"])
    for name in a:
      np.testing.assert_array_equal(a[name], b[name])
    want = losses.frozen_hidden(llm, jnp.asarray(a["tokens"]), jnp.asarray(a["positions"]),
                                jnp.asarray(a["segment_ids"]))
    real = a["segment_ids"] > 0
    assert not b["hidden"][~real].any()
    np.testing.assert_allclose(b["hidden"][real], np.asarray(want)[real], rtol=1e-5, atol=1e-5)


def test_loss_and_gradients_equal_the_inline_forward(made):
  folder, feats, llm = made
  p = preset(folder, "unused", soft_targets=True, vocab_limit=64)
  _, drafter_of, _, params, vocab_ids_R = trainer._trainable_drafter(p, llm.config)
  batch = next(data.make_iterator(folder, seq_len=SEQ, global_batch=4, seed=0, features=feats,
                                  hidden_size=64))
  from flax import nnx

  graphdef, state = nnx.split(llm)
  spec = trainer.LossSpec(graphdef, drafter_of, vocab_ids_R,
                          losses.LossConfig(num_steps=3, chunk=16, soft=True))
  inline = {k: jnp.asarray(v) for k, v in batch.items() if k != "hidden"}
  (l1, m1), g1 = jax.value_and_grad(trainer._batch_loss(spec, state, inline), has_aux=True)(params)
  (l2, m2), g2 = jax.value_and_grad(
      trainer._batch_loss(spec, state, {k: jnp.asarray(v) for k, v in batch.items()}),
      has_aux=True)(params)
  assert float(l1) > 0
  np.testing.assert_allclose(l2, l1, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
  np.testing.assert_array_equal(m1["count_n"], m2["count_n"])
  # The states are what the loss reads: other states, another loss.
  moved = dict(batch, hidden=batch["hidden"] * 2)
  l3, _ = trainer._batch_loss(spec, state, {k: jnp.asarray(v) for k, v in moved.items()})(params)
  assert abs(float(l3) - float(l1)) > 1e-3


def test_training_on_features_matches_training_inline(made, tmp_path):
  folder, feats, _ = made
  kw = dict(num_steps=4, learning_rate=0.01, soft_targets=True, eval_shards=1, eval_every=4,
            eval_batches=1)
  a = trainer.train(preset(folder, tmp_path / "a", **kw), progress=False, export=False)
  b = trainer.train(preset(folder, tmp_path / "b", features=str(feats), **kw), progress=False,
                    export=False)
  np.testing.assert_allclose([r["loss"] for r in b.history], [r["loss"] for r in a.history],
                             rtol=1e-4)
  np.testing.assert_allclose(b.eval_history[0]["loss"], a.eval_history[0]["loss"], rtol=1e-4)
  # The run read the features: doubled states (same manifest) train differently.
  doubled = tmp_path / "doubled"
  shutil.copytree(feats, doubled)
  for f in doubled.glob("*.npy"):
    np.save(f, np.load(f) * 2)
  c = trainer.train(preset(folder, tmp_path / "c", features=str(doubled), **kw), progress=False,
                    export=False)
  assert abs(c.history[0]["loss"] - a.history[0]["loss"]) > 1e-3


def test_resume_skips_done_shards_and_float16_is_close(made, tmp_path):
  folder, feats, llm = made
  out = tmp_path / "f16"
  first = features.write_features(llm, folder, out, model_name="random:tiny", seq_len=SEQ,
                                  dtype="float16", max_shards=1)
  again = features.write_features(llm, folder, out, model_name="random:tiny", seq_len=SEQ,
                                  dtype="float16")
  assert (first["shards"], again["shards"]) == (1, 1)
  for name in ("shard-00000.npy", "shard-00001.npy"):
    h16, h32 = np.load(out / name), np.load(feats / name)
    assert h16.dtype == np.float16
    np.testing.assert_allclose(h16.astype(np.float32), h32, rtol=2e-3, atol=2e-3)
  with pytest.raises(data.DataError, match="use another --out"):
    features.write_features(llm, folder, out, model_name="random:tiny", seq_len=SEQ + 1,
                            dtype="float16")


def test_mismatched_features_are_refused(made, tmp_path):
  folder, feats, _ = made
  kw = dict(seq_len=SEQ, global_batch=4, seed=0)
  with pytest.raises(data.DataError, match="features made with .*seq_len"):
    data.make_iterator(folder, **dict(kw, seq_len=SEQ + 8), features=feats)
  with pytest.raises(data.DataError, match="not a folder written by"):
    data.make_iterator(folder, **kw, features=tmp_path)
  other = write_synthetic(tmp_path / "other", num=48, seed=5)  # same shard names, other bytes
  with pytest.raises(data.DataError, match="made from other data"):
    data.make_iterator(other, **kw, features=feats)
  with pytest.raises(data.DataError, match="one features folder per data folder"):
    data.make_iterator([folder, other], **kw, features=feats)


def test_cli_writes_features_and_reports_bad_data(made, tmp_path, capsys):
  folder, _, _ = made
  out = tmp_path / "cli"
  assert cli.main(["features", "--data", str(folder), "--out", str(out), "--seq-len", str(SEQ),
                   "--model", "random:tiny"]) == 0
  assert "wrote 2 shard(s)" in capsys.readouterr().out
  assert sorted(json.loads((out / "manifest.json").read_text())["shards"]) == [
      "shard-00000.npz", "shard-00001.npz"]
  assert cli.main(["features", "--data", str(tmp_path / "none"), "--out", str(out),
                   "--seq-len", str(SEQ), "--model", "random:tiny"]) == 2
  assert "data folder not found" in capsys.readouterr().err
