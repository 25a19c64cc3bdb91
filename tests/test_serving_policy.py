"""The per-step choice of rows and mode (``serving.policy``), with fake cost tables."""

import pytest

from redrafter_jax.serving import policy


def test_row_buckets_and_bucket_for():
  assert policy.row_buckets(1) == [1]
  assert policy.row_buckets(8) == [1, 2, 4, 8]
  assert policy.row_buckets(6) == [1, 2, 4, 6]
  assert [policy.bucket_for(n, [1, 2, 4, 6]) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]
  with pytest.raises(StopIteration):
    policy.bucket_for(7, [1, 2, 4, 6])


def table(ar, spec, kind="greedy"):
  """Seconds per step by rows bucket: ``ar`` and ``spec`` map bucket -> seconds."""
  return {**{(b, "ar", kind): s for b, s in ar.items()},
          **{(b, "spec", kind): s for b, s in spec.items()}}


def test_choose_follows_measured_costs():
  # A tree step costs little more than an AR step at 1 row and 3x at 8 rows (token bound).
  costs = table(ar={1: 0.020, 2: 0.024, 4: 0.032, 8: 0.050},
                spec={1: 0.025, 2: 0.036, 4: 0.060, 8: 0.150})
  tps = {"ar": 1.0, "spec": 1.8}
  got = [policy.choose(b, "greedy", costs, tps, ("ar", "spec")) for b in (1, 2, 4, 8)]
  # rates: spec 72/50/30/12 vs ar 50/41.7/31.3/20 tokens/s per row
  assert got == ["spec", "spec", "ar", "ar"]
  # Better acceptance moves the switch point up; worse acceptance makes AR win everywhere.
  assert policy.choose(4, "greedy", costs, {"ar": 1.0, "spec": 2.2}, ("ar", "spec")) == "spec"
  assert [policy.choose(b, "greedy", costs, {"ar": 1.0, "spec": 1.1}, ("ar", "spec"))
          for b in (1, 2, 4, 8)] == ["ar"] * 4
  # A tie goes to AR (the cheaper program).
  assert policy.choose(1, "greedy", table({1: 0.01}, {1: 0.02}), {"ar": 1.0, "spec": 2.0},
                       ("ar", "spec")) == "ar"


def test_choose_without_measurements_keeps_the_engines_mode():
  tps = {"ar": 1.0, "spec": 1.0}
  assert policy.choose(8, "greedy", None, tps, ("ar", "spec")) == "spec"
  # The kind asked for was not measured: no guess.
  costs = table(ar={8: 0.01}, spec={8: 1.0}, kind="greedy")
  assert policy.choose(8, "sampled", costs, tps, ("ar", "spec")) == "spec"
  assert policy.choose(8, "greedy", costs, tps, ("ar",)) == "ar"


def test_acceptance_estimate():
  a = policy.Acceptance(prior=4.0, prior_weight=4)
  assert a.tokens_per_step == 4.0
  a.observe([0, 0, 0, 0])  # four row-steps of one token each
  assert a.tokens_per_step == pytest.approx((16 + 4) / 8)
  a.observe([])
  assert a.tokens_per_step == pytest.approx(2.5)
  assert a.table() == {"ar": 1.0, "spec": pytest.approx(2.5)}
  assert policy.kind_of(True, False) == "filtered" and policy.kind_of(False, True) == "greedy"
