"""``bench profile``: per-op times from a real profiler trace, joined with the optimized HLO."""

import jax
import jax.numpy as jnp
import pytest

from redrafter_jax.bench import profile
from redrafter_jax.generate import generate
from tests import tiny_models


def test_ops_are_joined_with_their_hlo_shapes(tmp_path):
  f = jax.jit(lambda a, b: jnp.tanh(a @ b))
  a, b = jnp.ones((8, 96)), jnp.ones((96, 40))
  text = f.lower(a, b).compile().as_text()
  module = text.split("HloModule ")[1].split(",")[0].split()[0]
  (tmp_path / f"module_0001.{module}.cpu_after_optimizations.txt").write_text(text)
  sig = profile.hlo_signatures(tmp_path)
  assert any("f32[8,40]" in v for v in sig.values()), sig
  seconds, steps, table = profile.profile(lambda: f(a, b).block_until_ready(), lambda r: 2,
                                          tmp_path)
  assert steps == 2 and seconds > 0
  labels = [key for _, _, key in table]
  if jax.default_backend() == "cpu":  # CPU traces name every op, with the HLO's names
    assert any("f32[8,40]" in key for key in labels), labels


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
