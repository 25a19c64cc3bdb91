"""The MLX export, run in MLX (CPU): strict loading, log-prob parity with the JAX drafter, and beam
search equal to JAX's ``beam_search`` and to a NumPy reference of DESIGN §5."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import mlx.core as mx
from redrafter_jax.config import DrafterConfig
from redrafter_jax.inference.beam_search import beam_search
from redrafter_jax.models.drafter import abstract_drafter
from redrafter_jax.weights import mlx_runtime
from redrafter_jax.weights.drafter_io import load_drafter, save_drafter
from redrafter_jax.weights.naming import WeightsError
from redrafter_jax.weights.params import flat_params, load_into

pytestmark = pytest.mark.usefixtures("float32_matmuls")  # float32 parity: no TF32 on GPUs

D, C, V = 16, 24, 37
CONFIGS = {
    "proj-rnn": DrafterConfig(vocab_size=V, hidden_size=D, exit_dim=C, num_draft_layers=2),
    "noproj-nornn": DrafterConfig(vocab_size=V, hidden_size=D, num_draft_layers=1, rnn=False),
    "topk": DrafterConfig(vocab_size=V, hidden_size=D, exit_dim=C, num_draft_layers=3,
                          logit_top_k=6),
}


def random_drafter(cfg: DrafterConfig, seed: int = 0, head_scale: float = 3.0):
  """Every parameter random (ResBlocks start at zero otherwise); a wide vocab head spreads the
  log-probs so beam scores are well separated (no top-k ties)."""
  rng = np.random.default_rng(seed)
  arrays = {}
  for name, var in flat_params(abstract_drafter(cfg)).items():
    scale = 0.1 if name.endswith("bias") else 1.0 / np.sqrt(var.shape[0])
    if name == f"lm_head.{cfg.num_draft_layers}.kernel":
      scale *= head_scale
    arrays[name] = (scale * rng.normal(size=var.shape)).astype(np.float32)
  return load_into(abstract_drafter(cfg), arrays, dtype=jnp.float32, source="test")


def _export(tmp_path, name, seed=0, dtype="float32"):
  drafter = random_drafter(CONFIGS[name], seed=seed)
  folder = save_drafter(drafter, tmp_path / f"{name}-{seed}-{dtype}", format="mlx", dtype=dtype)
  return drafter, folder


def _np(x):
  return np.array(x)


# ---------------------------------------------------------------------------------------------
# Strict loading.


def test_loads_strictly_with_exact_key_set(tmp_path):
  drafter, folder = _export(tmp_path, "proj-rnn")
  m = mlx_runtime.load_mlx_drafter(folder)
  from mlx.utils import tree_flatten

  params = dict(tree_flatten(m.parameters()))
  stored = load_file(str(folder / "model.safetensors"))
  assert set(params) == set(stored)
  for name, value in stored.items():
    np.testing.assert_array_equal(_np(params[name]), value, err_msg=name)

  extra = dict(stored, **{"lm_head.3.weight": stored["lm_head.2.weight"]})
  save_file(extra, str(folder / "model.safetensors"))
  with pytest.raises(WeightsError, match=r"lm_head\.3\.weight"):
    mlx_runtime.load_mlx_drafter(folder)

  missing = {k: v for k, v in stored.items() if k != "rnn_w.weight"}
  save_file(missing, str(folder / "model.safetensors"))
  with pytest.raises(WeightsError, match=r"[Mm]issing.*rnn_w\.weight"):
    mlx_runtime.load_mlx_drafter(folder)

  wrong = dict(stored, **{"rnn_u.weight": np.zeros((D, D + 1), np.float32)})
  save_file(wrong, str(folder / "model.safetensors"))
  with pytest.raises(WeightsError, match=r"rnn_u\.weight"):
    mlx_runtime.load_mlx_drafter(folder)


def test_refuses_other_formats_and_missing_files(tmp_path):
  drafter = random_drafter(CONFIGS["proj-rnn"])
  trt = save_drafter(drafter, tmp_path / "trt", format="trtllm")
  with pytest.raises(WeightsError, match="trtllm.*--format mlx"):
    mlx_runtime.load_mlx_drafter(trt)
  with pytest.raises(WeightsError, match="config.json"):
    mlx_runtime.load_mlx_drafter(tmp_path / "nowhere")
  head = drafter.lm_head[-1]
  head.kernel.set_value(head.kernel[...].at[:, V - 1].set(0))  # the row a compact head drops
  compact = save_drafter(drafter, tmp_path / "compact", head_rows=V - 1)
  with pytest.raises(WeightsError, match="head_rows.*--format mlx"):
    mlx_runtime.load_mlx_drafter(compact)
  _, folder = _export(tmp_path, "proj-rnn")
  (folder / "model.safetensors").unlink()
  with pytest.raises(WeightsError, match="model.safetensors"):
    mlx_runtime.load_mlx_drafter(folder)


@pytest.mark.parametrize("dtype, mx_dtype", [("float16", "float16"), ("bfloat16", "bfloat16")])
def test_low_precision_exports_load_in_their_dtype(tmp_path, dtype, mx_dtype):
  drafter, folder = _export(tmp_path, "proj-rnn", dtype=dtype)
  m = mlx_runtime.load_mlx_drafter(folder)
  assert m.dtype == getattr(mx, mx_dtype)
  jdtype = getattr(jnp, dtype)
  want = np.asarray(flat_params(drafter)["lm_head.2.kernel"].astype(jdtype)).T
  np.testing.assert_array_equal(_np(m.lm_head[-1].weight.astype(mx.float32)),
                                want.astype(np.float32))
  # Casting on load gives float32 parameters with the same (rounded) values.
  m32 = mlx_runtime.load_mlx_drafter(folder, dtype="fp32")
  assert m32.dtype == mx.float32
  np.testing.assert_array_equal(_np(m32.lm_head[-1].weight), want.astype(np.float32))
  rng = np.random.default_rng(0)
  h, s = (mx.array(rng.normal(size=(2, D)).astype(np.float32)) for _ in range(2))
  # Same rounded weights in float32: MLX equals JAX to float32 accuracy.
  jax32 = load_drafter(folder)
  want = np.asarray(jax32.log_probs(jnp.asarray(_np(h)), jnp.asarray(_np(s))))
  np.testing.assert_allclose(_np(m32.log_probs(h, s)), want, atol=1e-5, rtol=1e-5)
  # Computing in half precision stays close (log-probs returned in float32).
  got = _np(m.log_probs(h, s))
  assert got.dtype == np.float32
  # Measured: ~0.008 (fp16) and ~0.07 (bf16) on log-probs of magnitude ~18.
  np.testing.assert_allclose(got, want, atol={"float16": 0.03, "bfloat16": 0.2}[dtype])


# ---------------------------------------------------------------------------------------------
# Numerical parity with the JAX drafter.


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_log_probs_and_step_match_jax(tmp_path, name):
  drafter, folder = _export(tmp_path, name, seed=1)
  m = mlx_runtime.load_mlx_drafter(folder)
  rng = np.random.default_rng(2)
  h, s, e = (rng.normal(size=(2, 3, D)).astype(np.float32) for _ in range(3))
  got = _np(m.log_probs(mx.array(h), mx.array(s)))
  want = np.asarray(drafter.log_probs(jnp.asarray(h), jnp.asarray(s)))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  got_lp, got_s = m.step(mx.array(h), mx.array(s), mx.array(e))
  want_lp, want_s = drafter.step(jnp.asarray(h), jnp.asarray(s), jnp.asarray(e))
  np.testing.assert_allclose(_np(got_s), np.asarray(want_s), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(_np(got_lp), np.asarray(want_lp), atol=1e-5, rtol=1e-5)
  if CONFIGS[name].logit_top_k is not None:  # the cut really happened
    assert (got_lp > -1e4).sum(-1).max() == CONFIGS[name].logit_top_k


def numpy_beam_search(drafter, embed_VD, h_BD, g0_B, W, L):
  """DESIGN §5 spelled out with NumPy over the full W x V candidates (drafter steps from JAX).

  Also returns the smallest gap between consecutive candidates around the top-W cut, to prove
  the test inputs have no near-ties (where frameworks may legitimately order differently).
  """
  B, D_ = h_BD.shape
  Vv = embed_VD.shape[0]
  score = np.tile(np.array([0.0] + [-5e4] * (W - 1), np.float32), (B, 1))
  beams = np.repeat(g0_B[:, None, None], W, axis=1).astype(np.int32)
  logp = np.zeros((B, W, 0), np.float32)
  state = np.zeros((B, W, D_), np.float32)
  h_BWD = np.repeat(h_BD[:, None], W, axis=1)
  min_gap = np.inf
  for _ in range(L - 1):
    lp, state = drafter.step(jnp.asarray(h_BWD), jnp.asarray(state),
                             jnp.asarray(embed_VD[beams[..., -1]]))
    lp, state = np.asarray(lp), np.asarray(state)
    total = (score[..., None] + lp).reshape(B, W * Vv)
    order = np.argsort(-total, axis=-1, kind="stable")[:, :W + 1]
    top = np.take_along_axis(total, order, -1)
    min_gap = min(min_gap, float(np.min(top[:, :-1] - top[:, 1:])))
    idx = order[:, :W]
    parent, token = idx // Vv, idx % Vv
    rows = np.arange(B)[:, None]
    score = np.take_along_axis(total, idx, -1)
    beams = np.concatenate([beams[rows, parent], token[..., None]], -1)
    logp = np.concatenate([logp[rows, parent], lp.reshape(B, W * Vv)[rows, idx][..., None]], -1)
    state = state[rows, parent]
  return beams, logp, score, min_gap


@pytest.mark.parametrize("name, W, L", [("proj-rnn", 4, 5), ("noproj-nornn", 3, 4),
                                        ("topk", 4, 3)])
def test_beam_search_matches_jax_and_numpy_reference(tmp_path, name, W, L):
  drafter, folder = _export(tmp_path, name, seed=3)
  m = mlx_runtime.load_mlx_drafter(folder)
  rng = np.random.default_rng(4)
  embed_VD = rng.normal(size=(V, D)).astype(np.float32)
  h_BD = rng.normal(size=(3, D)).astype(np.float32)
  g0_B = np.array([0, 5, 36], np.int32)
  ref_beams, ref_logp, ref_score, gap = numpy_beam_search(drafter, embed_VD, h_BD, g0_B, W, L)
  assert gap > 1e-3, f"test inputs have near-tied beam scores (gap {gap})"
  out = mlx_runtime.beam_search(m, embed_VD, h_BD, g0_B, beam_width=W, beam_length=L)
  beams, logp, score = _np(out.beams_BWL), _np(out.logp_BWJ), _np(out.score_BW)
  assert beams.shape == (3, W, L) and logp.shape == (3, W, L - 1) and score.shape == (3, W)
  np.testing.assert_array_equal(beams[:, :, 0], np.repeat(g0_B[:, None], W, 1))
  np.testing.assert_array_equal(beams, ref_beams)
  np.testing.assert_allclose(logp, ref_logp, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(score, ref_score, atol=1e-4, rtol=1e-5)
  # Scores are plain sums of the drafted log-probs (no length normalisation).
  np.testing.assert_allclose(score, logp.sum(-1), atol=1e-4, rtol=1e-5)
  assert len({tuple(b) for b in beams[0]}) == W  # distinct beams

  jax_out = beam_search(drafter, jnp.asarray(embed_VD), jnp.asarray(h_BD), jnp.asarray(g0_B),
                        beam_width=W, beam_length=L)
  np.testing.assert_array_equal(beams, np.asarray(jax_out.beams_BWL))
  np.testing.assert_allclose(logp, np.asarray(jax_out.logp_BWJ), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(score, np.asarray(jax_out.score_BW), atol=1e-4, rtol=1e-5)


def test_beam_search_rejects_mismatched_inputs(tmp_path):
  _, folder = _export(tmp_path, "proj-rnn")
  m = mlx_runtime.load_mlx_drafter(folder)
  with pytest.raises(ValueError, match="vocab_size=37"):
    mlx_runtime.beam_search(m, np.zeros((V + 1, D), np.float32), np.zeros((1, D), np.float32),
                           np.zeros((1,), np.int32), beam_width=2, beam_length=3)
  with pytest.raises(ValueError, match="beam_length >= 2"):
    mlx_runtime.beam_search(m, np.zeros((V, D), np.float32), np.zeros((1, D), np.float32),
                           np.zeros((1,), np.int32), beam_width=2, beam_length=1)


# ---------------------------------------------------------------------------------------------
# Entry point and packaging.


def test_smoke_entry_point(tmp_path, capsys):
  _, folder = _export(tmp_path, "proj-rnn")
  argv = ["--drafter", str(folder), "--beam-width", "3", "--beam-length", "4"]
  assert mlx_runtime.main(argv) == 0
  out = capsys.readouterr().out
  assert "drafted 3 beams x 3 tokens" in out and out.count("beam ") >= 3
  trt = save_drafter(random_drafter(CONFIGS["proj-rnn"]), tmp_path / "trt", format="trtllm")
  assert mlx_runtime.main(["--drafter", str(trt)]) == 2
  assert "error: " in capsys.readouterr().err


def test_package_imports_without_mlx():
  code = ("import sys; sys.modules['mlx'] = None\n"
          "import redrafter_jax.weights.mlx_runtime as e, redrafter_jax.weights.drafter_io\n"
          "try:\n  e.load_mlx_drafter('.')\nexcept ImportError as err:\n"
          "  assert 'redrafter_jax[mlx]' in str(err), err\n  print('ok')\n")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        env={"JAX_PLATFORMS": "cpu", "PATH": "",
                             **{k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}})
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == "ok"


def test_config_json_is_what_the_reference_mlx_loader_reads(tmp_path):
  """The reference's MLX loader builds its args from config.json: the fields must be there."""
  _, folder = _export(tmp_path, "proj-rnn")
  config = json.loads((folder / "config.json").read_text())
  for field in ("hidden_size", "vocab_size", "exit_dim", "num_draft_layers", "rnn", "model_type"):
    assert field in config


@pytest.mark.slow
def test_readme_export_route_runs_the_shipped_drafter_in_mlx(tmp_path, capsys):
  """The README's export commands on the real model: the shipped (multi-layer) drafter refuses
  Apple's layout with a one-line error naming why, exports in the redrafter-jax layout, and MLX
  drafts from SmolLM2's layer states the same beams as JAX's beam search, with the same
  log-probs."""
  from redrafter_jax import cli
  from redrafter_jax.weights.shipped import resolve_drafter

  shipped = resolve_drafter("shipped")
  assert cli.main(["export", "--drafter", str(shipped), "--format", "mlx",
                   "--out", str(tmp_path / "mlx")]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "feature_layers" in err[0] and "redrafter-jax" in err[0], err
  assert not (tmp_path / "mlx").exists()
  out = tmp_path / "rj"
  assert cli.main(["export", "--drafter", str(shipped), "--format", "redrafter-jax",
                   "--out", str(out)]) == 0
  m = mlx_runtime.load_mlx_drafter(out)
  assert m.config.feature_layers == (2, 15, 27)
  embed_VD, feats_BTX, g0_B, ids, _ = mlx_runtime._llm_inputs(
      "smollm2-135m", "Why is the sky blue?", m.config.feature_layers)
  assert feats_BTX.shape == (1, len(ids), 3 * 576)
  h_BD = feats_BTX[:, -1]
  W, L = 4, 5
  got = mlx_runtime.beam_search(m, embed_VD, h_BD, g0_B, beam_width=W, beam_length=L)
  drafter = load_drafter(shipped)  # JAX's beam search takes the context: project the states
  want = beam_search(drafter, jnp.asarray(embed_VD), drafter.context(jnp.asarray(h_BD)),
                     jnp.asarray(g0_B), beam_width=W, beam_length=L)
  np.testing.assert_array_equal(_np(got.beams_BWL), np.asarray(want.beams_BWL))
  # float32 in two libraries' summation orders, over 1728-wide features and logits up to ~25 in
  # size: measured within 1.1e-3 here (the tiny random drafters above hold 1e-5).
  np.testing.assert_allclose(_np(got.logp_BWJ), np.asarray(want.logp_BWJ), atol=2e-3)
  assert mlx_runtime.main(["--drafter", str(out), "--llm", "smollm2-135m",
                           "--prompt", "Why is the sky blue?"]) == 0
  printed = capsys.readouterr().out
  assert "(MLX)" in printed and printed.count("beam ") == W
