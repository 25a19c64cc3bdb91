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


MODES = ("ar", "spec")


def mode_at(b, costs, tps, kind="greedy", modes=MODES):
  """The mode ``plan`` picks for ``b`` rows when only the ``b`` bucket is offered."""
  bucket, mode = policy.plan(b, kind, costs, tps, modes, [b])
  assert bucket == b
  return mode


def test_plan_picks_the_mode_with_the_most_tokens_per_second():
  # A tree step costs little more than an AR step at 1 row and 3x at 8 rows (token bound).
  costs = table(ar={1: 0.020, 2: 0.024, 4: 0.032, 8: 0.050},
                spec={1: 0.025, 2: 0.036, 4: 0.060, 8: 0.150})
  tps = {"ar": 1.0, "spec": 1.8}
  # rates: spec 72/50/30/12 vs ar 50/41.7/31.3/20 tokens/s per row
  assert [mode_at(b, costs, tps) for b in (1, 2, 4, 8)] == ["spec", "spec", "ar", "ar"]
  # Better acceptance moves the switch point up; worse acceptance makes AR win everywhere.
  assert mode_at(4, costs, {"ar": 1.0, "spec": 2.2}) == "spec"
  assert [mode_at(b, costs, {"ar": 1.0, "spec": 1.1}) for b in (1, 2, 4, 8)] == ["ar"] * 4
  # A tie goes to AR (the cheaper program).
  assert mode_at(1, table({1: 0.01}, {1: 0.02}), {"ar": 1.0, "spec": 2.0}) == "ar"


def test_the_tree_shrinks_as_the_rows_grow():
  """With a smaller tree among the modes, the plan goes from the served tree at few rows to
  the smaller tree, then to AR, as a tree's tokens grow costlier with the rows."""
  small = "spec:1x2+3/3"
  costs = {**table(ar={1: 0.010, 2: 0.011, 4: 0.012, 8: 0.020},
                   spec={1: 0.012, 2: 0.016, 4: 0.024, 8: 0.048}),
           **{(b, small, "greedy"): s for b, s in {1: 0.011, 2: 0.0125, 4: 0.015,
                                                      8: 0.032}.items()}}
  tps = {"ar": 1.0, "spec": 2.0, small: 1.5}
  # seconds per token: spec 6.0/8.0/12/24 ms, small 7.3/8.3/10/21.3 ms, ar 10/11/12/20 ms
  modes = ("ar", small, "spec")
  assert [mode_at(b, costs, tps, modes=modes) for b in (1, 2, 4, 8)] == [
      "spec", "spec", small, "ar"]
  # Observed acceptance moves the choice: a drafter that guesses less favours the small tree.
  assert mode_at(2, costs, {"ar": 1.0, "spec": 1.6, small: 1.4}, modes=modes) == small
  # Without measurements: the served tree.
  assert policy.plan(3, "greedy", None, tps, modes, [1, 2, 4, 8]) == (4, "spec")


def test_plan_picks_a_larger_bucket_when_it_costs_less():
  """On XLA:CPU the all-slots bucket gathers no rows and can cost less than a smaller one: 3
  live rows then run on all 8 (for either mode); ties keep the smaller bucket."""
  costs = table(ar={1: 0.040, 2: 0.070, 4: 0.150, 8: 0.080},
                spec={1: 0.080, 2: 0.120, 4: 0.250, 8: 0.140})
  tps = {"ar": 1.0, "spec": 2.0}
  assert policy.plan(1, "greedy", costs, tps, MODES, [1, 2, 4, 8]) == (1, "ar")
  assert policy.plan(3, "greedy", costs, tps, MODES, [1, 2, 4, 8]) == (8, "spec")
  assert policy.plan(3, "greedy", costs, tps, ("ar",), [1, 2, 4, 8]) == (8, "ar")
  assert policy.plan(2, "greedy", costs, {"ar": 1.0, "spec": 1.5}, MODES, [1, 2, 4, 8]) == (
      2, "ar")
  even = table(ar={2: 0.05, 4: 0.05}, spec={2: 0.10, 4: 0.10})  # all 0.05 s per token
  assert policy.plan(2, "greedy", even, tps, MODES, [2, 4]) == (2, "ar")
  with pytest.raises(ValueError, match="no rows bucket"):
    policy.plan(9, "greedy", costs, tps, MODES, [1, 2, 4, 8])


def test_dominated_groups_are_those_a_larger_bucket_beats_in_every_mode_and_kind():
  """A (rows, context) group is dominated when a larger rows bucket at the same context costs
  no more in every mode and kind timed for it; with the dominated groups left out, ``plan``
  picks what it picked with them, for any acceptance."""
  seconds = {}
  for c, ar, spec in ((512, {1: .02, 2: .03, 4: .05, 8: .045}, {1: .03, 2: .04, 4: .08, 8: .07}),
                      (2048, {1: .04, 2: .045, 4: .12, 8: .05}, {1: .05, 2: .09, 4: .15, 8: .08})):
    seconds.update({(b, m, "greedy", c): s for m, t in (("ar", ar), ("spec", spec))
                    for b, s in t.items()})
  # 512: 4 rows lose to 8 in both modes (2 rows win in both); 2048: 2 rows win in AR only.
  assert policy.dominated(seconds) == {(4, 512), (4, 2048)}
  assert policy.dominated({**seconds, (2, "ar", "greedy", 2048): 0.05}) == {
      (2, 2048), (4, 512), (4, 2048)}  # a tie counts
  # A kind the rival was not timed in keeps the group.
  assert policy.dominated({**seconds, (4, "ar", "sampled", 512): 0.1}) == {(4, 2048)}
  assert policy.dominated({}) == set()
  for c in (512, 2048):
    for tps in ({"ar": 1.0, "spec": s} for s in (1.0, 1.3, 1.8, 2.5, 4.0)):
      costs = {(b, m, k): s for (b, m, k, cc), s in seconds.items() if cc == c}
      kept = [b for b in (1, 2, 4, 8) if (b, c) not in policy.dominated(seconds)]
      for rows in range(1, 9):
        full = policy.plan(rows, "greedy", costs, tps, MODES, [1, 2, 4, 8])
        pruned = policy.plan(rows, "greedy", costs, tps, MODES, kept)
        cost = lambda bm: costs[bm[0], bm[1], "greedy"] / tps[bm[1]]
        assert cost(pruned) == cost(full), (c, tps, rows, full, pruned)


def test_plan_without_a_cost_table_keeps_the_engines_mode():
  tps = {"ar": 1.0, "spec": 1.0}
  assert policy.plan(3, "greedy", None, tps, MODES, [1, 2, 4, 8]) == (4, "spec")


def test_only_what_was_timed_competes_and_ar_is_the_default():
  """A candidate the table does not price never beats one it does, however cheap its tokens
  would be; with nothing priced for the step's kind, AR at the smallest bucket."""
  tps = {"ar": 1.0, "spec": 4.0}
  costs = table(ar={8: 0.04}, spec={8: 0.05}, kind="greedy")
  # The sampled kind was never timed: AR, not the tree.
  assert policy.plan(8, "sampled", costs, tps, MODES, [8]) == (8, "ar")
  assert policy.plan(3, "sampled", costs, tps, MODES, [4, 8]) == (4, "ar")
  # Only AR timed at 8 rows: AR, although the tree would give 4 tokens a step.
  only_ar = table(ar={8: 0.04}, spec={})
  assert policy.plan(8, "greedy", only_ar, tps, MODES, [8]) == (8, "ar")
  # The tree timed at the 8-row bucket only: it competes there, the unpriced 4-row bucket
  # does not: the tree at 8 rows.
  partial = table(ar={}, spec={8: 0.05})
  assert policy.plan(3, "greedy", partial, tps, MODES, [4, 8]) == (8, "spec")
  # Both priced: the usual choice (4 tokens for 0.05 s beats 1 for 0.04 s).
  assert policy.plan(8, "greedy", costs, tps, MODES, [8]) == (8, "spec")
  assert policy.plan(8, "greedy", costs, tps, ("ar",), [8]) == (8, "ar")


def test_acceptance_estimate():
  a = policy.Acceptance(prior=4.0, prior_weight=4)
  assert a.tokens_per_step == 4.0
  a.observe([0, 0, 0, 0])  # four row-steps of one token each
  assert a.tokens_per_step == pytest.approx((16 + 4) / 8)
  a.observe([])
  assert a.tokens_per_step == pytest.approx(2.5)
  small = policy.Acceptance(prior=1.5)
  assert policy.tokens_per_step({"spec": a, "spec:1x2": small}) == {
      "ar": 1.0, "spec": pytest.approx(2.5), "spec:1x2": 1.5}
  assert policy.tokens_per_step({}) == {"ar": 1.0}  # an AR engine
  assert policy.kind_of(True, False) == "filtered" and policy.kind_of(False, True) == "greedy"


def test_step_costs_follow_the_steps_served():
  """Warm-up costs until a key has been served ``min_seen`` times, then the running average
  of the served steps; per kind and context; ``min_seen`` None keeps the warm-up table."""
  warm = {(8, "ar", "greedy", 512): 0.05, (8, "spec", "greedy", 512): 0.09,
          (8, "ar", "greedy", 1024): 0.06, (8, "ar", "sampled", 512): 0.07}
  costs = policy.StepCosts(warm, min_seen=3, alpha=0.5)
  assert costs.table("greedy", 512) == {(8, "ar", "greedy"): 0.05, (8, "spec", "greedy"): 0.09}
  for seconds in (0.2, 0.2):
    costs.observe((8, "spec", "greedy", 512), seconds)
  assert costs.table("greedy", 512)[8, "spec", "greedy"] == 0.09  # seen twice: not yet
  costs.observe((8, "spec", "greedy", 512), 0.1)
  assert costs.table("greedy", 512)[8, "spec", "greedy"] == pytest.approx(0.15)  # 0.2, then half way
  assert costs.table("greedy", 1024) == {(8, "ar", "greedy"): 0.06}
  assert costs.table("sampled", 512) == {(8, "ar", "sampled"): 0.07}
  # With these costs and 1.8 tokens per tree step, the tree no longer pays at 8 rows.
  assert policy.plan(8, "greedy", costs.table("greedy", 512), {"ar": 1.0, "spec": 1.8}, MODES,
                     [8]) == (8, "ar")
  frozen = policy.StepCosts(warm, min_seen=None)
  for _ in range(10):
    frozen.observe((8, "ar", "greedy", 512), 1.0)
  assert frozen.table("greedy", 512) == {(8, "ar", "greedy"): 0.05, (8, "spec", "greedy"): 0.09}



def test_the_mode_not_chosen_is_priced_under_load():
  """``explore`` runs the other mode while its served cost is not yet in use, then once per
  ``every`` steps; with the served costs of both modes ``plan`` switches to the one that pays
  under load even when the warm-up table said otherwise."""
  warm = {(8, "ar", "greedy", 512): 0.06, (8, "spec", "greedy", 512): 0.09}
  costs = policy.StepCosts(warm, min_seen=2, alpha=0.5)
  tps = {"ar": 1.0, "spec": 2.0}
  run = []
  for _ in range(20):
    b, mode = policy.plan(8, "greedy", costs.table("greedy", 512), tps, MODES, [8])
    mode = policy.explore(b, mode, "greedy", 512, costs, MODES, every=5)
    run.append(mode)
    # Under this load AR steps cost what they cost alone, tree steps 3x: the tree does not pay.
    costs.observe((8, mode, "greedy", 512), {"ar": 0.06, "spec": 0.27}[mode])
  # Warm-up table: spec (0.045 s/token) beats AR (0.06), but AR is explored until priced
  # (steps 0-1), then spec runs until its served cost is in use (0.135 s/token: it loses to
  # AR's 0.06), and from then on AR runs, the tree again after every 5 steps of AR.
  assert [i for i, m in enumerate(run) if m == "spec"] == [2, 3, 9, 15], run
  assert policy.explore(8, "spec", "greedy", 512, None, MODES, every=5) == "spec"
  assert policy.explore(8, "spec", "greedy", 512, costs, MODES, every=0) == "spec"
  frozen = policy.StepCosts(warm, min_seen=None)
  assert policy.explore(8, "spec", "greedy", 512, frozen, MODES, every=5) == "spec"


def test_exploration_interval_keeps_the_loss_within_the_budget():
  """A run of the mode not chosen loses its seconds minus the chosen mode's price for its
  tokens; ``budget`` spaces the runs out so that the loss stays within that fraction of the
  served time (never closer than ``every``, never further than ``every * MAX_STRETCH``)."""
  assert policy.explore_interval(0.052, 0.059, 64, 0.01) == 89  # ceil(0.052 / 0.00059)
  assert policy.explore_interval(0.052, 0.059, 64, 0.0) == 64  # no budget: every
  assert policy.explore_interval(-0.01, 0.059, 64, 0.01) == 64  # it would not lose
  assert policy.explore_interval(0.001, 0.059, 64, 0.01) == 64  # cheap: no closer than every
  assert policy.explore_interval(10.0, 0.059, 64, 0.01) == 64 * policy.MAX_STRETCH

  warm = {(8, "ar", "greedy", 512): 0.06, (8, "spec", "greedy", 512): 0.27}
  tps = {"ar": 1.0, "spec": 2.0}
  for budget, every in ((0.08, 5), (0.04, 5), (0.02, 5), (0.0, 5)):
    costs = policy.StepCosts(warm, min_seen=1)
    run = []
    for _ in range(400):
      b, mode = policy.plan(8, "greedy", costs.table("greedy", 512), tps, MODES, [8])
      mode = policy.explore(b, mode, "greedy", 512, costs, MODES, every, tokens_per_step=tps,
                            budget=budget)
      run.append(mode)
      costs.observe((8, mode, "greedy", 512), warm[8, mode, "greedy", 512])
    trees = run.count("spec")
    assert run[0] == "spec" and trees >= 2, run  # priced first, then explored again
    # Each tree step loses 0.27 - 2 * 0.06 = 0.15 s against AR's price for its tokens; the
    # first one prices the tree (it runs whatever the budget), the others explore.
    lost, served = 0.15 * (trees - 1), 0.06 * run.count("ar")
    gap = policy.explore_interval(0.15, 0.06, every, budget) + 1  # steps from one to the next
    assert trees == len(range(0, 400, gap)), (budget, trees)
    if budget >= 0.04:  # within the stretch limit: the loss is within the budget
      assert gap <= every * policy.MAX_STRETCH and lost / served <= budget, (budget, trees)
    elif budget:  # 0.02 would need 125 steps between runs: the limit (80) holds them closer
      assert gap == every * policy.MAX_STRETCH + 1 and lost / served > budget


def test_a_step_that_is_not_priced_still_counts_as_run():
  """A step right after a prefill is not priced (its time is both's) but it ran: the other
  mode is not explored again at once because of it."""
  warm = {(8, "ar", "greedy", 512): 0.06, (8, "spec", "greedy", 512): 0.27}
  costs = policy.StepCosts(warm, min_seen=1)
  costs.observe((8, "spec", "greedy", 512), 0.27)
  for _ in range(10):
    costs.observe((8, "ar", "greedy", 512), 0.06)
  assert policy.explore(8, "ar", "greedy", 512, costs, MODES, every=5) == "spec"  # 10 steps old
  costs.observe((8, "spec", "greedy", 512), None)  # explored right after a prefill
  assert costs.seen[8, "spec", "greedy", 512] == (0.27, 1) and costs.age(
      (8, "spec", "greedy", 512)) == 0
  assert policy.explore(8, "ar", "greedy", 512, costs, MODES, every=5) == "ar"
  # Unpriced keys are explored until priced, whatever their age.
  fresh = policy.StepCosts(warm, min_seen=2)
  fresh.observe((8, "spec", "greedy", 512), None)
  assert not fresh.priced((8, "spec", "greedy", 512))
  assert policy.explore(8, "ar", "greedy", 512, fresh, MODES, every=5) == "spec"
