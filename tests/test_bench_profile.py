"""``bench profile``: per-op times from a real profiler trace, joined with the optimized HLO."""

import jax
import jax.numpy as jnp
import pytest

from redrafter_jax.bench import profile
from redrafter_jax.inference.ar import generate
from tests import tiny_models


def _dump_hlo(folder, f, *args):
  """Write ``f``'s optimized HLO where XLA's --xla_dump_to would."""
  text = f.lower(*args).compile().as_text()
  module = text.split("HloModule ")[1].split(",")[0].split()[0]
  (folder / f"module_0001.{module}.cpu_after_optimizations.txt").write_text(text)


def test_ops_are_joined_with_their_hlo_shapes(tmp_path):
  f = jax.jit(lambda a, b: jnp.tanh(a @ b))
  a, b = jnp.ones((8, 96)), jnp.ones((96, 40))
  _dump_hlo(tmp_path, f, a, b)
  sig = profile.hlo_signatures(tmp_path)
  assert any("f32[8,40]" in label for label, _ in sig.values()), sig
  assert all(in_loop for _, in_loop in sig.values())  # no while loop: the whole program counts
  seconds, steps, table = profile.profile(lambda: f(a, b).block_until_ready(), lambda r: 2,
                                          tmp_path)
  assert steps == 2 and seconds > 0
  labels = [key for _, _, key in table]
  if jax.default_backend() == "cpu":  # CPU traces name every op, with the HLO's names
    assert any("f32[8,40]" in key for key in labels), labels


def test_ops_of_a_while_body_are_told_from_the_ops_outside(tmp_path):
  def f(a, w):
    h = jnp.tanh(a @ w[:, :24])  # [3, 24], before the loop
    return jax.lax.fori_loop(0, 4, lambda i, x: jnp.sin(x @ w[:24, :24]), h)

  a, w = jnp.ones((3, 40)), jnp.ones((40, 40)) * 0.01
  _dump_hlo(tmp_path, jax.jit(f), a, w)
  sig = profile.hlo_signatures(tmp_path)
  in_loop = {label for label, inside in sig.values() if inside}
  outside = {label for label, inside in sig.values() if not inside}
  assert in_loop and outside, sig
  assert any(label.startswith("sine") or "f32[3,24]" in label for label in in_loop), in_loop
  seconds, steps, table = profile.profile(lambda: jax.jit(f)(a, w).block_until_ready(),
                                          lambda r: 4, tmp_path)
  keys = [key for _, _, key in table]
  if jax.default_backend() == "cpu":  # CPU traces name every op
    assert profile.OUTSIDE_LOOP in keys, keys  # the first matmul and its tanh
    assert any(key != profile.OUTSIDE_LOOP for key in keys), keys


def test_generate_profile_has_per_step_rows(tmp_path):
  llm, _, _ = tiny_models.load_tiny(tmp_path)
  prompt = tiny_models.random_tokens(0, 12)
  seconds, steps, table = profile.profile(
      lambda: generate(llm, [prompt], max_new_tokens=6), lambda r: len(r.tokens[0]))
  assert steps == 6
  assert table and all(ms >= 0 and n > 0 for ms, n, _ in table)
  if jax.default_backend() == "cpu":
    kinds = {key.split(":")[0] for _, _, key in table}
    assert any("dot" in k or "ynn" in k for k in kinds), kinds


def test_bad_arguments_are_rejected():
  with pytest.raises(SystemExit):
    profile.parse_args(["--max-new-tokens", "0"])
  with pytest.raises(SystemExit):
    profile.parse_args(["--mode", "beam"])
