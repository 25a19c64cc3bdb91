"""``bf16_dot_general``: a dense layer's matmul in bfloat16 with float32 accumulation, forward
and backward, and the drafter built on it for training (``train.matmul_dtype``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from redrafter_jax.config import DrafterConfig
from redrafter_jax.models.bf16_matmul import bf16_dot_general
from redrafter_jax.models.drafter import Drafter, with_matmul_dtype

HI = jax.lax.Precision.HIGHEST
DENSE = (((2,), (0,)), ((), ()))  # x[..., K] @ w[K, N], as nnx.Linear asks


def bf16(a):
  return np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32))


def f32_matmul(a, b):
  return np.asarray(jnp.matmul(jnp.asarray(a), jnp.asarray(b), precision=HI))


@pytest.fixture(scope="module")
def operands():
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (3, 5, 96), jnp.float32)
  w = jax.random.normal(kw, (96, 40), jnp.float32) * 0.1
  g = jax.random.normal(kg, (3, 5, 40), jnp.float32)
  return x, w, g


def test_forward_and_gradients_are_bf16_products_summed_in_float32(operands):
  """Every product is of bf16-rounded operands (the cotangent rounded too) and is summed in
  float32: the results match float32 math on the rounded operands to summation order, and
  differ from plain float32 math by the rounding (so the test would see it missing)."""
  x, w, g = operands
  y, vjp = jax.vjp(lambda x, w: bf16_dot_general(x, w, DENSE), x, w)
  dx, dw = vjp(g)
  assert y.dtype == dx.dtype == dw.dtype == jnp.float32
  want_y = f32_matmul(bf16(x), bf16(w))
  want_dx = f32_matmul(bf16(g), bf16(w).T)
  want_dw = f32_matmul(bf16(x).reshape(-1, 96).T, bf16(g).reshape(-1, 40))
  for got, want, exact in ((y, want_y, f32_matmul(x, w)),
                           (dx, want_dx, f32_matmul(g, np.asarray(w).T)),
                           (dw, want_dw, f32_matmul(np.asarray(x).reshape(-1, 96).T,
                                                    np.asarray(g).reshape(-1, 40)))):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.max(np.abs(exact - want)) > 1e-3  # the rounding is visible at this tolerance


def test_jit_and_other_contractions(operands):
  x, w, _ = operands
  got = jax.jit(lambda x, w: bf16_dot_general(x, w, DENSE, preferred_element_type=jnp.float32))
  np.testing.assert_allclose(got(x, w), f32_matmul(bf16(x), bf16(w)), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match=r"x\[..., K\] @ w\[K, N\] only"):
    bf16_dot_general(x, w.T, (((2,), (1,)), ((), ())))


def test_the_training_drafter_shares_the_parameters_and_multiplies_in_bf16():
  cfg = DrafterConfig(vocab_size=64, hidden_size=32, exit_dim=48, feature_layers=(0, 1))
  drafter = Drafter(cfg, rngs=nnx.Rngs(0))
  mixed = with_matmul_dtype(drafter, jnp.bfloat16)
  assert nnx.to_pure_dict(nnx.state(mixed)).keys() == nnx.to_pure_dict(nnx.state(drafter)).keys()
  for a, b in zip(jax.tree.leaves(nnx.state(drafter)), jax.tree.leaves(nnx.state(mixed))):
    np.testing.assert_array_equal(a, b)
  h = jax.random.normal(jax.random.key(1), (4, 32))
  s = jax.random.normal(jax.random.key(2), (4, 32))
  full, half = drafter.logits(h, s), mixed.logits(h, s)
  assert half.dtype == jnp.float32
  np.testing.assert_allclose(half, full, rtol=0.05, atol=0.05)
  assert not np.array_equal(np.asarray(half), np.asarray(full))
  with pytest.raises(ValueError, match="matmul_dtype must be None or bfloat16"):
    Drafter(cfg, matmul_dtype=jnp.float16, rngs=nnx.Rngs(0))


def test_the_train_step_bench_times_both_settings(tmp_path, capsys):
  from redrafter_jax.bench import train_step
  from tests.test_trainer import TINY, write_synthetic

  data_dir = write_synthetic(tmp_path / "data", num=64)
  out = tmp_path / "table.md"
  assert train_step.main(["--config", str(TINY), f"train.data={data_dir}", "train.seq_len=64",
                          "--steps", "3", "--out", str(out)]) == 0
  table = out.read_text().splitlines()
  assert table[-2].startswith("| float32 |") and table[-1].startswith("| bfloat16 |")
  cells = [line.split("|") for line in table[-2:]]
  assert all(float(c[2]) > 0 and float(c[3]) > 0 for c in cells)  # s/step, tokens/s
  first_loss = [float(c[5]) for c in cells]  # the same drafter and batch, rounded matmuls
  assert first_loss[1] == pytest.approx(first_loss[0], rel=1e-2)
  assert "\n".join(table) in capsys.readouterr().out
